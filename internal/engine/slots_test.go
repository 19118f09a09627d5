package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"testing"
)

// SaveSeq implements SlotBackend for the fake (declared in Caps when slots is set): the
// sequence's tokens, 4 bytes each.
func (f *fakeBackend) SaveSeq(seq int) ([]byte, error) {
	var out []byte
	for _, tok := range f.tokens(seq) {
		out = binary.LittleEndian.AppendUint32(out, uint32(tok))
	}
	return out, nil
}

// LoadSeq implements SlotBackend: new cells holding data's tokens, into a sequence the
// operations planned before it emptied.
func (f *fakeBackend) LoadSeq(seq, n int, data []byte) error {
	if len(f.kv[seq]) != 0 {
		f.t.Errorf("fake: slot load into seq %d holding %d cells", seq, len(f.kv[seq]))
	}
	if len(data) != 4*n {
		return fmt.Errorf("fake: %d bytes for %d tokens", len(data), n)
	}
	var cells []fakeCell
	for i := range n {
		f.nextCell++
		cells = append(cells, fakeCell{id: f.nextCell, tok: Token(binary.LittleEndian.Uint32(data[4*i:]))})
	}
	f.kv[seq] = cells
	return nil
}

// ProbeFits implements CellProber: n more cells fit when the fake's cells in use
// leave them free.
func (f *fakeBackend) ProbeFits(seq, n int, _ Token) (bool, error) {
	if len(f.kv[seq]) != 0 {
		return false, fmt.Errorf("probe: sequence %d is not empty", seq)
	}
	return f.cells()+n <= f.nCtx, nil
}

// TestSlotsThroughReady: a slot's save, load and a cell probe go through the one door
// (the operations come out of the Ready after the message, their answers back through
// Step into the reply). The saved bytes are what the sequence holds; a load after an
// erase of the same slot finds the erase's removal done first (the fake fails a load
// into a sequence that holds cells) and leaves the accounting and the cache agreeing;
// a request continuing the loaded tokens starts from them with the output of a cold
// run; the probe's answer is the fake cache's free cells. A backend that declares no
// slots refuses both with errNoSlots, and plans no copy.
func TestSlotsThroughReady(t *testing.T) {
	cfg := poolCfg()
	cfg.PrefixCache = true
	h := newHarness(t, cfg)
	h.be.slots = true
	h.s.useBackend(h.be.Caps())
	prompt := seqTokens(5, 20)
	id := h.submit(Request{Prompt: prompt, SessionID: "s", MaxTokens: 6})
	h.run()
	ev, _ := h.done(id)
	seq := ev.Stats.Seq
	held := h.be.tokens(seq)

	res := h.send(SaveSlot{Seq: seq})
	if res.Err != nil || !slices.Equal(res.Tokens, held) || len(res.Data) != 4*len(held) {
		t.Fatalf("save: %d tokens, %d bytes, err %v; want the %d tokens the sequence holds", len(res.Tokens), len(res.Data), res.Err, len(held))
	}
	if r := h.send(EraseSlot{Seq: seq}); r.Err != nil || r.Erased != len(held) {
		t.Fatalf("erase: %d, %v", r.Erased, r.Err)
	}
	if r := h.send(LoadSlot{Seq: seq, Tokens: res.Tokens, Data: res.Data}); r.Err != nil {
		t.Fatalf("load: %v", r.Err)
	}
	if got := h.be.tokens(seq); !slices.Equal(got, held) {
		t.Fatalf("after the load seq %d holds %v, want %v", seq, got, held)
	}
	h.checkAccounting()

	next := append(slices.Clone(held), seqTokens(900, 5)...)
	warm := h.submit(Request{Prompt: next, MaxTokens: 8})
	h.run()
	cold := h.submit(Request{Prompt: next, MaxTokens: 8, NoPrefixCache: true})
	h.run()
	ew, _ := h.done(warm)
	if ew.Err != nil || ew.Stats.CacheN < len(held) || h.text(warm) != h.text(cold) {
		t.Fatalf("request after the load: cache_n %d (want >= %d), %q vs cold %q, err %v", ew.Stats.CacheN, len(held), h.text(warm), h.text(cold), ew.Err)
	}
	h.checkAccounting()

	empty := slices.IndexFunc(seqTokens(0, cfg.Parallel), func(s Token) bool { return len(h.be.kv[int(s)]) == 0 })
	if empty < 0 {
		t.Fatal("no empty sequence to probe")
	}
	free := cfg.NCtx - h.be.cells()
	if r := h.send(ProbeFits{Seq: empty, N: free, Tok: 1}); r.Err != nil || !r.Fits {
		t.Fatalf("probe of the %d free cells: fits %v, err %v", free, r.Fits, r.Err)
	}
	if r := h.send(ProbeFits{Seq: empty, N: free + 1, Tok: 1}); r.Err != nil || r.Fits {
		t.Fatalf("probe of %d cells, one more than free: fits %v, err %v", free+1, r.Fits, r.Err)
	}

	bare := newHarness(t, cfg) // no slots declared
	id = bare.submit(Request{Prompt: prompt, SessionID: "s", MaxTokens: 6})
	bare.run()
	ev, _ = bare.done(id)
	if r := bare.send(SaveSlot{Seq: ev.Stats.Seq}); !errors.Is(r.Err, errNoSlots) {
		t.Fatalf("save without slots: %v, want %v", r.Err, errNoSlots)
	}
	if r := bare.send(LoadSlot{Seq: ev.Stats.Seq, Tokens: res.Tokens, Data: res.Data}); !errors.Is(r.Err, errNoSlots) {
		t.Fatalf("load without slots: %v, want %v", r.Err, errNoSlots)
	}
	if r := bare.send(ProbeFits{Seq: 3, N: 1}); !errors.Is(r.Err, errNoProbe) {
		t.Fatalf("probe without a prober: %v, want %v", r.Err, errNoProbe)
	}
}

// TestEngineSlotsAndProbe: the engine loop runs a message's operations before its
// reply: SaveSlot's bytes and a probe's verdict reach the caller through Send and
// Probe, and the snapshot read after LoadSlot shows the slot holding the tokens.
func TestEngineSlotsAndProbe(t *testing.T) {
	s, err := NewScheduler(Config{NCtx: 256, Parallel: 2, NBatch: 32, MaxQueue: 8}, fakeVocab{})
	if err != nil {
		t.Fatal(err)
	}
	be := &lockedBackend{f: newFakeBackend(t, 256)}
	be.f.slots = true
	e := New(s, be, nil)
	defer e.Close()
	ctx := context.Background()
	st, _, err := e.Submit(ctx, Request{Prompt: seqTokens(5, 12), SessionID: "s", MaxTokens: 4})
	if err != nil {
		t.Fatal(err)
	}
	_, done := drain(t, st)
	seq := done.Stats.Seq
	saved, err := e.Send(ctx, SaveSlot{Seq: seq})
	if err != nil || saved.Err != nil || len(saved.Data) != 4*len(saved.Tokens) || len(saved.Tokens) == 0 {
		t.Fatalf("save: %d tokens, %d bytes, %v %v", len(saved.Tokens), len(saved.Data), err, saved.Err)
	}
	if r, err := e.Send(ctx, EraseSlot{Seq: seq}); err != nil || r.Err != nil {
		t.Fatalf("erase: %v %v", err, r.Err)
	}
	if r, err := e.Send(ctx, LoadSlot{Seq: seq, Tokens: saved.Tokens, Data: saved.Data}); err != nil || r.Err != nil {
		t.Fatalf("load: %v %v", err, r.Err)
	}
	i := slices.IndexFunc(e.Snapshot().Slots, func(sl SlotInfo) bool { return sl.Seq == seq })
	if i < 0 || e.Snapshot().Slots[i].NPast != len(saved.Tokens) {
		t.Fatalf("snapshot after the load: %+v, want seq %d holding %d tokens", e.Snapshot().Slots, seq, len(saved.Tokens))
	}
	other := 1 - seq
	be.mu.Lock()
	free := 256 - be.f.cells()
	be.mu.Unlock()
	if fits, err := e.Probe(ctx, ProbeFits{Seq: other, N: free, Tok: 1}); err != nil || !fits {
		t.Fatalf("probe of the %d free cells: %v %v", free, fits, err)
	}
	if fits, err := e.Probe(ctx, ProbeFits{Seq: other, N: free + 1, Tok: 1}); err != nil || fits {
		t.Fatalf("probe of one more than the %d free cells: %v %v", free, fits, err)
	}
}
