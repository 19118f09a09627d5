package kvevents

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/pool"
)

func prefix(d int, toks []int32) engine.PrefixChange {
	return engine.PrefixChange{Pool: 1, D: d, Tokens: toks, Hash: pool.RollingHash(toks)}
}

func seqTokens(n int, base int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = base + int32(i)
	}
	return out
}

func TestOwnedBlocksFullBlocksAndParentChain(t *testing.T) {
	parentToks := seqTokens(40, 100) // blocks 0, 1 full; 32..39 partial
	parent := prefix(0, parentToks)
	pb := OwnedBlocks(parent, 16)
	if len(pb.Hashes) != 2 || pb.Parent != nil || !slices.Equal(pb.Tokens, parentToks[:32]) {
		t.Fatalf("root: %d blocks, parent %v, %d tokens; want 2 blocks from 0, 32 tokens", len(pb.Hashes), pb.Parent, len(pb.Tokens))
	}
	// A child extending at D = 40 owns blocks 2..4: block 2 mixes the parent's partial
	// tail (32..39) with its own 40..47, and chains to the parent's block 1.
	childToks := append(slices.Clone(parentToks), seqTokens(41, 500)...) // L = 81: blocks 0..4 full
	child := prefix(40, childToks)
	cb := OwnedBlocks(child, 16)
	if len(cb.Hashes) != 3 || !slices.Equal(cb.Tokens, childToks[32:80]) {
		t.Fatalf("child: %d blocks, %d tokens; want blocks 2..4 (48 tokens)", len(cb.Hashes), len(cb.Tokens))
	}
	if cb.Parent == nil || *cb.Parent != pb.Hashes[1] {
		t.Fatalf("child's parent hash %v, want the parent's last block %x", cb.Parent, pb.Hashes[1])
	}
	// The same tokens in a root pool give the same hashes (content addressed).
	whole := OwnedBlocks(prefix(0, childToks), 16)
	if !slices.Equal(whole.Hashes[:2], pb.Hashes) || !slices.Equal(whole.Hashes[2:], cb.Hashes) {
		t.Fatalf("a root over the child's tokens must announce the same block hashes")
	}
	// Shorter than a block: nothing to announce.
	if b := OwnedBlocks(prefix(0, seqTokens(15, 1)), 16); len(b.Hashes) != 0 {
		t.Fatalf("a 15-token prefix has no full 16-token block, got %d", len(b.Hashes))
	}
	// A branch whose own tokens end inside the block holding D owns nothing.
	if b := OwnedBlocks(prefix(33, append(seqTokens(33, 100), 7, 8)), 16); len(b.Hashes) != 0 {
		t.Fatalf("branch at 33 with L 35 owns no full block, got %d", len(b.Hashes))
	}
}

// TestPublisherWireFormat subscribes over real ZMQ and decodes what a router would.
func TestPublisherWireFormat(t *testing.T) {
	pub, err := Open(Config{Endpoint: "tcp://127.0.0.1:0", BlockSize: 16, PodID: "pod-a", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	addr := pub.sock.Addr().String()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	waitSnapshot(t, pub, 1)
	toks := seqTokens(35, 10)
	c := prefix(0, toks)
	pub.PrefixStored(c)
	pub.PrefixRemoved(c)
	var got []Message
	for len(got) < 3 {
		msg, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		m, err := Decode(msg.Frames)
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range m.Events { // a batch may hold both changes: one message per event here
			got = append(got, Message{Topic: m.Topic, Seq: m.Seq, Events: []Event{ev}})
		}
	}
	if got[0].Topic != "kv@pod-a@m" || got[0].Seq != 0 || got[0].Events[0].Tag != TagAllBlocksCleared {
		t.Fatalf("first message %+v, want AllBlocksCleared at seq 0 on kv@pod-a@m", got[0])
	}
	st, rm := got[1].Events[0], got[2].Events[0]
	want := OwnedBlocks(c, 16)
	if st.Tag != TagBlockStored || !slices.Equal(st.Hashes, want.Hashes) || st.Parent != nil || st.BlockSize != 16 || !slices.Equal(st.Tokens, toks[:32]) {
		t.Fatalf("stored %+v, want 2 blocks of 16 from 0", st)
	}
	if rm.Tag != TagBlockRemoved || !slices.Equal(rm.Hashes, want.Hashes) {
		t.Fatalf("removed %+v, want the stored hashes", rm)
	}
	if got[1].Seq < 1 || got[2].Seq < got[1].Seq {
		t.Fatalf("sequence numbers %d, %d after 0", got[1].Seq, got[2].Seq)
	}
}

func waitSnapshot(t *testing.T, pub *Publisher, n uint64) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); pub.Snapshots.Load() < n; {
		if time.Now().After(deadline) {
			t.Fatal("no subscriber seen within 10 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func dialSub(t *testing.T, ctx context.Context, pub *Publisher) zmq4.Socket {
	t.Helper()
	sub := zmq4.NewSub(ctx)
	if err := sub.Dial("tcp://" + pub.Addr()); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	return sub
}

// TestLateSubscriberGetsSnapshot: pools stored before anyone listens reach a router
// that subscribes later, parents before children, after AllBlocksCleared, at seq 0;
// a removed pool is not in the snapshot.
func TestLateSubscriberGetsSnapshot(t *testing.T) {
	pub, err := Open(Config{Endpoint: "tcp://127.0.0.1:0", PodID: "p", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	root := seqTokens(40, 1)
	childToks := append(slices.Clone(root), seqTokens(30, 900)...)
	gone := prefix(0, seqTokens(20, 5000))
	gone.Pool = 9
	pub.PrefixStored(prefix(0, root))
	child := prefix(40, childToks)
	child.Pool = 2
	pub.PrefixStored(child)
	pub.PrefixStored(gone)
	pub.PrefixRemoved(gone)
	time.Sleep(100 * time.Millisecond) // nobody listens: nothing is sent
	if n := pub.Sent.Load(); n != 0 {
		t.Fatalf("%d messages sent with no subscriber", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sub := dialSub(t, ctx, pub)
	defer sub.Close()
	msg, err := sub.Recv()
	if err != nil {
		t.Fatal(err)
	}
	m, err := Decode(msg.Frames)
	if err != nil {
		t.Fatal(err)
	}
	if m.Seq != 0 || len(m.Events) != 3 || m.Events[0].Tag != TagAllBlocksCleared {
		t.Fatalf("snapshot seq %d with %d events, want seq 0: AllBlocksCleared, root, child", m.Seq, len(m.Events))
	}
	rb, cb := OwnedBlocks(prefix(0, root), 16), OwnedBlocks(child, 16)
	if !slices.Equal(m.Events[1].Hashes, rb.Hashes) || !slices.Equal(m.Events[2].Hashes, cb.Hashes) || *m.Events[2].Parent != rb.Hashes[1] {
		t.Fatalf("snapshot is not root then child chained to it: %+v", m.Events[1:])
	}
}
