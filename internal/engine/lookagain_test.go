package engine

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// tierLocked is the locked fake with the fake's sequence tier (under the lock) and a
// pause before each decode, so a request can hold the only sequence for a while.
type tierLocked struct {
	*lockedBackend
	pause time.Duration
}

func (l tierLocked) Decode(b []BatchEntry) ([]Sampled, error) {
	time.Sleep(l.pause)
	return l.lockedBackend.Decode(b)
}

func (l tierLocked) Caps() Caps { return Caps{Tier: l, SeqTier: l} }

func (l tierLocked) Tier(op SeqOp) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.Tier(op)
}

func (l tierLocked) Load(op SeqOp) (Loaded, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.Load(op)
}

// TestQueuedRequestLooksAgain (issues 44, 55): a request that waits in the queue asks
// the tier again when it is seated (OpLookup; Config.TierFleet), so chunks another
// replica writes through while it waits are loaded, not prefilled; and it asks exactly
// then: once at submission, once at its seat, never while it waits (no request polls).
func TestQueuedRequestLooksAgain(t *testing.T) {
	cfg := spillCfg()
	cfg.TierFleet = true
	s, err := NewScheduler(cfg, fakeVocab{})
	if err != nil {
		t.Fatal(err)
	}
	be := tierLocked{lockedBackend: &lockedBackend{f: newFakeBackend(t, cfg.NCtx)}, pause: 2 * time.Millisecond}
	e := New(s, be, nil)
	t.Cleanup(e.Close)

	prompt := seqTokens(100, 30) // chunks of 8: [0,8) [8,16) [16,24) and [24,30)
	var segs []Segment
	for k := 0; k < len(prompt); k += 8 {
		segs = append(segs, Segment{Start: k, Tokens: prompt[:min(k+8, len(prompt))]})
	}
	var written atomic.Bool // another replica has written the prompt's chunks through
	var asked atomic.Int64
	e.SetTierLookup(func(p []Token) []Segment {
		if len(p) != len(prompt) {
			return nil
		}
		asked.Add(1)
		if !written.Load() {
			return nil
		}
		return segs
	})

	ctx := context.Background()
	// The only sequence is busy for about 0.5 s (250 decode steps of 2 ms).
	busy, _, err := e.Submit(ctx, Request{Prompt: seqTokens(900, 6), MaxTokens: 250, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	st, _, err := e.Submit(ctx, Request{Prompt: prompt, MaxTokens: 4})
	if err != nil {
		t.Fatal(err)
	}
	// What another replica writes through while the request waits.
	be.mu.Lock()
	for _, g := range segs {
		be.f.segs[segKey(g.Start, g.Tokens, false)] = g.Tokens[g.Start:]
	}
	be.mu.Unlock()
	written.Store(true)
	time.Sleep(100 * time.Millisecond) // the request waits: nothing asks the tier meanwhile
	if n := asked.Load(); n != 1 {
		t.Fatalf("the tier was asked %d times while the request waited, want 1 (at submission)", n)
	}

	if _, ev := drain(t, busy); ev.Err != nil {
		t.Fatal(ev.Err)
	}
	text, ev := drain(t, st)
	if ev.Err != nil || ev.Stats.RestoredN != len(prompt)-1 || ev.Stats.PromptN != 1 {
		t.Fatalf("queued request: %+v, want all but its last token loaded from what was written while it waited", ev.Stats)
	}
	if want := expectedText(t, prompt, 4); text != want {
		t.Fatalf("reply %q, want %q", text, want)
	}
	if n := asked.Load(); n != 2 {
		t.Fatalf("the tier was asked %d times, want 2 (at submission and at the seat)", n)
	}
}

// A request seated in the step it is submitted does not ask again (the lookup at
// submission is fresh); one seated after a wait asks once and prefills nothing until
// the answer comes; one cancelled while its lookup is pending ends cleanly, and the
// late answer finds nothing waiting for it.
func TestLookupAtSeatOnlyAfterAWait(t *testing.T) {
	cfg := spillCfg()
	cfg.TierFleet = true
	h := newHarness(t, cfg)
	var lookups []SeqOp
	h.lookup = func(op SeqOp) (Found, bool) {
		lookups = append(lookups, op)
		return Found{}, true // answered later, by the test
	}
	seatedAfterWait := func(running, waiting TaskID) SeqOp {
		t.Helper()
		for range 100 {
			if w := h.s.tasks[waiting]; w != nil && w.status == statusLookup {
				break
			}
			h.step()
		}
		if _, ok := h.done(running); !ok {
			t.Fatal("the running request did not end")
		}
		if len(lookups) != 1 || lookups[0].Task != waiting {
			t.Fatalf("lookups %+v, want one, for the request that waited", lookups)
		}
		op := lookups[0]
		lookups = nil
		for range 3 {
			for _, e := range h.step() {
				if e.Seq == op.Seq {
					t.Fatalf("the request waiting for its lookup prefilled %+v", e)
				}
			}
		}
		return op
	}

	a := h.submit(Request{Prompt: seqTokens(1, 20), MaxTokens: 2, IgnoreEOS: true})
	b := h.submit(Request{Prompt: seqTokens(50, 20), MaxTokens: 2, IgnoreEOS: true})
	op := seatedAfterWait(a, b)
	h.send(Found{Task: b, Seq: op.Seq})
	h.run()
	if ev, ok := h.done(b); !ok || ev.Err != nil || ev.Stats.PromptN != 20 {
		t.Fatalf("after its answer (nothing found) the request: %+v, want it prefilled and done", ev)
	}

	c := h.submit(Request{Prompt: seqTokens(300, 10), MaxTokens: 3, IgnoreEOS: true})
	d := h.submit(Request{Prompt: seqTokens(400, 20), MaxTokens: 2, IgnoreEOS: true})
	op = seatedAfterWait(c, d)
	h.cancel(d)
	h.send(Found{Task: d, Seq: op.Seq}) // the late answer
	h.run()
	if ev, ok := h.done(d); !ok || ev.Finish != FinishCancelled {
		t.Fatalf("the cancelled request: %+v", ev)
	}
	if n := len(h.events[d]); n != 1 {
		t.Fatalf("the cancelled request has %d events, want its Done only", n)
	}
	if len(lookups) != 0 {
		t.Fatalf("more lookups: %+v", lookups)
	}
	if used := h.s.kv.Used(); used != h.be.cells() {
		t.Fatalf("the cell tree counts %d cells, the backend holds %d", used, h.be.cells())
	}
}
