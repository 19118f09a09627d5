package kvevents

import (
	"context"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/polykv/polykv/internal/engine"
)

func seqTokens(n int, base int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = base + int32(i)
	}
	return out
}

func toks(t []int32) []engine.Token { return t }

// router models what llm-d's event pool does with our events (llm-d-router
// pkg/kvevents/pool.go, processEventBatch): a BlockStored whose parent it has never
// seen is dropped; otherwise it recomputes the keys from the event's tokens, chained
// from the parent's key (or the model's init hash), and counts each stored hash per
// pod (event_dedup_filter.go), removing a hash from the index when its count reaches 0.
//
// Each medium is a device tier of its own (normalizeEventDeviceTier: lower case, "gpu"
// when absent): index counts the "gpu" entries (cells), tier the "cpu" ones.
type router struct {
	t     *testing.T
	init  uint64
	index map[uint64]int
	tier  map[uint64]int
}

// medium is the index of an event's medium (mediumAt: its field, absent → "gpu").
func (r *router) medium(ev []any, at int) map[uint64]int {
	m := "gpu"
	if len(ev) > at && ev[at] != nil {
		m = strings.ToLower(ev[at].(string))
	}
	switch m {
	case "gpu":
		return r.index
	case "cpu":
		if r.tier == nil {
			r.tier = map[uint64]int{}
		}
		return r.tier
	}
	r.t.Fatalf("medium %q: the router's default configuration weighs it like a cell", m)
	return nil
}

func (r *router) apply(events []any) {
	r.t.Helper()
	for _, raw := range events {
		ev := raw.([]any)
		switch ev[0] {
		case TagAllBlocksCleared:
			r.index, r.tier = map[uint64]int{}, map[uint64]int{}
		case TagBlockRemoved:
			idx := r.medium(ev, 2)
			for _, h := range ev[1].([]uint64) {
				if idx[h]--; idx[h] <= 0 {
					delete(idx, h)
				}
			}
		case TagBlockStored:
			hashes, tokens, bs := ev[1].([]uint64), ev[3].([]int32), ev[4].(int)
			idx := r.medium(ev, 6)
			parent := r.init
			if ev[2] != nil {
				parent = ev[2].(uint64)
				if r.index[parent] == 0 && r.tier[parent] == 0 {
					r.t.Fatalf("BlockStored with parent %#x the router does not hold: it would drop the event", parent)
				}
			}
			if keys := BlockHashes(parent, tokens, bs); !slices.Equal(keys, hashes) {
				r.t.Fatalf("announced hashes %#x, the router computes %#x for the same tokens", hashes, keys)
			}
			for _, h := range hashes {
				idx[h]++
			}
		}
	}
}

// score is llm-d's precise scorer for this replica (kvblock_scorer.go,
// LongestPrefixScorer with DefaultKVCacheBackendConfig): over the leading blocks of
// tokens the replica holds in any medium, the sum of the best weight each is held in
// (gpu 1.0, cpu 0.8).
func (r *router) score(tokens []int32, bs int) float64 {
	s := 0.0
	for _, h := range BlockHashes(r.init, tokens, bs) {
		switch {
		case r.index[h] > 0:
			s += 1.0
		case r.tier[h] > 0:
			s += 0.8
		default:
			return s
		}
	}
	return s
}

// holds reports how many leading full blocks of tokens the router would find.
func (r *router) holds(tokens []int32, bs int) int {
	n := 0
	for _, h := range BlockHashes(r.init, tokens, bs) {
		if r.index[h] == 0 {
			break
		}
		n++
	}
	return n
}

func newMirrorOnly(bs int) *Publisher {
	return &Publisher{cfg: Config{BlockSize: bs}, init: InitHash("", "m"), seqs: map[int]*mirror{}, refs: map[uint64]int{},
		tierRefs: map[uint64]int{}, tierBlocks: map[uint64]tierBlock{}}
}

// TestSharedBlocksAnnouncedOnce: two sequences sharing a system prompt announce its
// blocks once; the second announces only its own blocks, chained to the shared one; a
// decoding sequence announces a block when it fills; a block goes when the last
// sequence holding it lets it go.
func TestSharedBlocksAnnouncedOnce(t *testing.T) {
	p := newMirrorOnly(16)
	r := &router{t: t, init: p.init, index: map[uint64]int{}}
	system := seqTokens(40, 1)
	a := append(slices.Clone(system), seqTokens(10, 500)...) // 50 tokens: 3 blocks
	b := append(slices.Clone(system[:32]), seqTokens(20, 900)...)
	ev := p.take(nil, engine.SeqChange{Seq: 0, Tokens: toks(a)})
	r.apply(ev)
	if len(ev) != 1 || len(ev[0].([]any)[1].([]uint64)) != 3 || ev[0].([]any)[2] != nil {
		t.Fatalf("first sequence: %v, want one BlockStored of 3 blocks from the root", ev)
	}
	ev = p.take(nil, engine.SeqChange{Seq: 1, Tokens: toks(b)})
	r.apply(ev)
	chainA := BlockHashes(p.init, a, 16)
	if len(ev) != 1 || !slices.Equal(ev[0].([]any)[3].([]int32), b[32:48]) || ev[0].([]any)[2] != chainA[1] {
		t.Fatalf("second sequence: %v, want only its third block, parent A's block 1", ev)
	}
	// Decoding B: 12 tokens more, one a step; the block [48, 64) is announced once full.
	stored := 0
	for i := range 12 {
		ev = p.take(nil, engine.SeqChange{Seq: 1, Keep: len(b), Tokens: []engine.Token{int32(2000 + i)}})
		b = append(b, int32(2000+i))
		r.apply(ev)
		stored += len(ev)
	}
	if stored != 1 || r.holds(b, 16) != 4 {
		t.Fatalf("decoding 12 tokens: %d events, the router holds %d of B's blocks; want 1 event and 4 blocks", stored, r.holds(b, 16))
	}
	// A is freed: only its own third block goes; B's (and the shared) stay.
	ev = p.take(nil, engine.SeqChange{Seq: 0})
	r.apply(ev)
	if len(ev) != 1 || ev[0].([]any)[0] != TagBlockRemoved || !slices.Equal(ev[0].([]any)[1].([]uint64), chainA[2:]) {
		t.Fatalf("freeing A: %v, want BlockRemoved of A's own block", ev)
	}
	if r.holds(a, 16) != 2 || r.holds(b, 16) != 4 {
		t.Fatalf("after A: router holds %d of A's, %d of B's blocks; want 2 and 4", r.holds(a, 16), r.holds(b, 16))
	}
	// B truncated to 20 tokens and refilled with other tokens (a new request taking the
	// cached sequence over): its blocks past the first are replaced.
	nb := append(slices.Clone(b[:20]), seqTokens(30, 7000)...)
	r.apply(p.take(nil, engine.SeqChange{Seq: 1, Keep: 20, Tokens: toks(nb[20:])}))
	if r.holds(nb, 16) != 3 || r.holds(b, 16) != 1 || len(r.index) != 3 {
		t.Fatalf("after the takeover: router holds %d of the new, %d of the old blocks, %d in all; want 3, 1, 3", r.holds(nb, 16), r.holds(b, 16), len(r.index))
	}
	r.apply(p.take(nil, engine.SeqChange{Seq: 1}))
	if len(r.index) != 0 || len(p.refs) != 0 || len(p.seqs) != 0 {
		t.Fatalf("all freed: router holds %d, publisher %d refs and %d sequences", len(r.index), len(p.refs), len(p.seqs))
	}
}

// TestRandomChangesKeepTheRouterExact: random appends, truncations and frees of
// sequences drawn from three prompt families; after every change the modelled router
// (which drops a block whose parent it lacks) holds every full block of every sequence
// and nothing else, and a snapshot rebuilds the same index from scratch.
func TestRandomChangesKeepTheRouterExact(t *testing.T) {
	for _, bs := range []int{16, 4} {
		rng := rand.New(rand.NewPCG(7, uint64(bs)))
		p := newMirrorOnly(bs)
		r := &router{t: t, init: p.init, index: map[uint64]int{}}
		held := map[int][]int32{}
		families := [][]int32{seqTokens(80, 1), seqTokens(80, 1000), append(seqTokens(24, 1), seqTokens(60, 3000)...)}
		for step := range 3000 {
			q := rng.IntN(6)
			cur := held[q]
			var c engine.SeqChange
			switch op := rng.IntN(10); {
			case op < 2: // freed
				c = engine.SeqChange{Seq: q}
				cur = nil
			case op < 4: // truncated, then a prompt of a family from there
				keep := rng.IntN(len(cur) + 1)
				f := families[rng.IntN(3)]
				n := keep + rng.IntN(40)
				next := slices.Clone(cur[:keep])
				for i := keep; i < n; i++ {
					if i < len(f) && rng.IntN(20) > 0 {
						next = append(next, f[i])
					} else {
						next = append(next, int32(9000+rng.IntN(5)))
					}
				}
				c = engine.SeqChange{Seq: q, Keep: keep, Tokens: toks(next[keep:])}
				cur = next
			default: // decoding
				tok := int32(9000 + rng.IntN(3))
				c = engine.SeqChange{Seq: q, Keep: len(cur), Tokens: []engine.Token{tok}}
				cur = append(slices.Clone(cur), tok)
			}
			if len(cur) == 0 {
				delete(held, q)
			} else {
				held[q] = cur
			}
			r.apply(p.take(nil, c))
			want := map[uint64]bool{}
			for _, s := range held {
				for _, h := range BlockHashes(p.init, s, bs) {
					want[h] = true
				}
			}
			if len(r.index) != len(want) {
				t.Fatalf("bs %d step %d: router holds %d blocks, the sequences %d", bs, step, len(r.index), len(want))
			}
			for h := range want {
				if r.index[h] != 1 {
					t.Fatalf("bs %d step %d: block %#x counted %d times, want once", bs, step, h, r.index[h])
				}
			}
			if step%500 == 0 {
				fresh := &router{t: t, init: p.init, index: map[uint64]int{}}
				fresh.apply(p.snapshotEvents())
				if !mapsEqual(fresh.index, r.index) {
					t.Fatalf("bs %d step %d: snapshot rebuilds %d blocks, live %d", bs, step, len(fresh.index), len(r.index))
				}
			}
		}
	}
}

func mapsEqual(a, b map[uint64]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestPublisherWireFormat subscribes over real ZMQ and decodes what a router would.
func TestPublisherWireFormat(t *testing.T) {
	pub, err := Open(Config{Endpoint: "tcp://127.0.0.1:0", BlockSize: 16, PodID: "pod-a", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sub := dialSub(t, ctx, pub)
	defer sub.Close()
	waitSnapshot(t, pub, 1)
	tk := seqTokens(35, 10)
	pub.SeqChanged(engine.SeqChange{Seq: 3, Tokens: toks(tk)})
	pub.SeqChanged(engine.SeqChange{Seq: 3})
	got := recvEvents(t, sub, 3)
	if got[0].Topic != "kv@pod-a@m" || got[0].Seq != 0 || got[0].Events[0].Tag != TagAllBlocksCleared {
		t.Fatalf("first message %+v, want AllBlocksCleared at seq 0 on kv@pod-a@m", got[0])
	}
	st, rm := got[1].Events[0], got[2].Events[0]
	want := BlockHashes(InitHash("", "m"), tk, 16)
	if st.Tag != TagBlockStored || !slices.Equal(st.Hashes, want) || st.Parent != nil || st.BlockSize != 16 || !slices.Equal(st.Tokens, tk[:32]) {
		t.Fatalf("stored %+v, want 2 blocks of 16 from 0", st)
	}
	if rm.Tag != TagBlockRemoved || !slices.Equal(rm.Hashes, want) {
		t.Fatalf("removed %+v, want the stored hashes", rm)
	}
	if got[1].Seq < 1 || got[2].Seq < got[1].Seq {
		t.Fatalf("sequence numbers %d, %d after 0", got[1].Seq, got[2].Seq)
	}
	// Closing (a replica shutting down) tells the router to forget this replica.
	pub.SeqChanged(engine.SeqChange{Seq: 3, Tokens: toks(tk)})
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	last := recvEvents(t, sub, 2)
	if last[0].Events[0].Tag != TagBlockStored || last[1].Events[0].Tag != TagAllBlocksCleared {
		t.Fatalf("after Close: %+v, want the queued BlockStored, then AllBlocksCleared", last)
	}
}

// recvEvents receives until n events have arrived, one Message per event.
func recvEvents(t *testing.T, sub zmq4.Socket, n int) []Message {
	t.Helper()
	var got []Message
	for len(got) < n {
		msg, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		m, err := Decode(msg.Frames)
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range m.Events { // a batch may hold several changes
			got = append(got, Message{Topic: m.Topic, Seq: m.Seq, Events: []Event{ev}})
		}
	}
	return got
}

func waitSnapshot(t *testing.T, pub *Publisher, n uint64) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); pub.Snapshots.Load() < n; {
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %d not sent within 10 s", n)
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

// TestEverySubscriberGetsSnapshot: blocks stored before anyone listens reach a router
// that subscribes later (AllBlocksCleared first, at seq 0, shared blocks once, parents
// first; a freed sequence's blocks absent), and a second router that joins while the
// first listens gets the same snapshot (the first receives it again: the same state).
func TestEverySubscriberGetsSnapshot(t *testing.T) {
	pub, err := Open(Config{Endpoint: "tcp://127.0.0.1:0", PodID: "p", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	root := seqTokens(40, 1)
	child := append(slices.Clone(root), seqTokens(30, 900)...)
	pub.SeqChanged(engine.SeqChange{Seq: 0, Tokens: toks(root)})
	pub.SeqChanged(engine.SeqChange{Seq: 1, Tokens: toks(child)})
	pub.SeqChanged(engine.SeqChange{Seq: 2, Tokens: toks(seqTokens(20, 5000))})
	pub.SeqChanged(engine.SeqChange{Seq: 2})
	time.Sleep(100 * time.Millisecond) // nobody listens: nothing is sent
	if n := pub.Sent.Load(); n != 0 {
		t.Fatalf("%d messages sent with no subscriber", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	check := func(who string, m Message) {
		t.Helper()
		if len(m.Events) != 3 || m.Events[0].Tag != TagAllBlocksCleared {
			t.Fatalf("%s: snapshot with %d events, want AllBlocksCleared, root, child", who, len(m.Events))
		}
		rh, ch := BlockHashes(InitHash("", "m"), root, 16), BlockHashes(InitHash("", "m"), child, 16)
		if !slices.Equal(m.Events[1].Hashes, rh) || !slices.Equal(m.Events[2].Hashes, ch[2:]) || *m.Events[2].Parent != rh[1] {
			t.Fatalf("%s: snapshot is not the root's blocks then the child's own chained to them: %+v", who, m.Events[1:])
		}
	}
	recv := func(sub zmq4.Socket) Message {
		t.Helper()
		msg, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		m, err := Decode(msg.Frames)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	first := dialSub(t, ctx, pub)
	defer first.Close()
	m := recv(first)
	if m.Seq != 0 {
		t.Fatalf("first snapshot at seq %d, want 0", m.Seq)
	}
	check("first subscriber", m)
	second := dialSub(t, ctx, pub)
	defer second.Close()
	m2 := recv(second)
	check("second subscriber", m2)
	if again := recv(first); again.Seq != m2.Seq {
		t.Fatalf("the first subscriber got seq %d, the second %d: one stream", again.Seq, m2.Seq)
	} else {
		check("first subscriber, again", again)
	}
}

// TestTierBlocksScoredBelowCells (issue 44): what a replica's tier holds is announced
// with the tier's medium, so with llm-d's default weights a replica holding a prefix
// only in its tier scores for it, below one holding it in cells, and above one that
// holds nothing; holding it in both scores as cells. Entries that overlap (a
// conversation's tail chunk superseded by a longer one) count each block once; a block
// goes when the last entry holding it does; a snapshot gives a new router the same view.
func TestTierBlocksScoredBelowCells(t *testing.T) {
	const bs = 16
	prompt := seqTokens(64, 1) // 4 blocks; tier chunks of 32 tokens: [0,32) [32,64)
	cells := newMirrorOnly(bs)
	rc := &router{t: t, init: cells.init, index: map[uint64]int{}}
	rc.apply(cells.take(nil, engine.SeqChange{Seq: 0, Tokens: toks(prompt)}))

	tr := newMirrorOnly(bs)
	rt := &router{t: t, init: tr.init, index: map[uint64]int{}}
	stored := func(d, end int, in bool) []any {
		ev := tr.apply(nil, change{tier: &tierChange{d: d, tokens: prompt[:end], stored: in}})
		rt.apply(ev)
		return ev
	}
	ev := stored(0, 32, true)
	if len(ev) != 1 || ev[0].([]any)[6] != MediumTier || ev[0].([]any)[2] != nil {
		t.Fatalf("first chunk: %v, want one BlockStored from the root with medium %s", ev, MediumTier)
	}
	stored(32, 48, true) // a tail chunk: one block
	ev = stored(32, 64, true)
	if len(ev) != 1 || len(ev[0].([]any)[1].([]uint64)) != 1 {
		t.Fatalf("the longer chunk: %v, want only its block the tail did not hold", ev)
	}
	stored(32, 48, false) // the superseded tail goes: its block is still held
	want := []float64{4, 3.2, 0}
	if got := []float64{rc.score(prompt, bs), rt.score(prompt, bs), (&router{init: tr.init}).score(prompt, bs)}; !slices.Equal(got, want) {
		t.Fatalf("scores cells/tier/none %v, want %v", got, want)
	}
	// The same replica holding it in cells too scores as cells.
	rt.apply(tr.take(nil, engine.SeqChange{Seq: 3, Tokens: toks(prompt)}))
	if s := rt.score(prompt, bs); s != 4 {
		t.Fatalf("cells and tier: score %v, want 4", s)
	}
	rt.apply(tr.take(nil, engine.SeqChange{Seq: 3}))
	// A snapshot replayed into a new router: the same view.
	fresh := &router{t: t, init: tr.init, index: map[uint64]int{}}
	fresh.apply(tr.snapshotEvents())
	if s := fresh.score(prompt, bs); s != 3.2 {
		t.Fatalf("after a snapshot: score %v, want 3.2", s)
	}
	ev = stored(32, 64, false)
	if len(ev) != 1 || ev[0].([]any)[0] != TagBlockRemoved || ev[0].([]any)[2] != MediumTier || len(ev[0].([]any)[1].([]uint64)) != 2 {
		t.Fatalf("removing the second chunk: %v, want BlockRemoved of its 2 blocks with medium %s", ev, MediumTier)
	}
	if s := rt.score(prompt, bs); s != 1.6 {
		t.Fatalf("first chunk only: score %v, want 1.6", s)
	}
}
