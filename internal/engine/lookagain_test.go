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

// TestQueuedRequestLooksAgain (issue 44): a request that waits in the queue asks the
// tier again, so chunks another replica writes through while it waits are loaded when
// it gets its sequence, not prefilled; it stops asking once it has begun.
func TestQueuedRequestLooksAgain(t *testing.T) {
	defer func(d time.Duration) { lookAgainEvery = d }(lookAgainEvery)
	lookAgainEvery = 5 * time.Millisecond
	cfg := spillCfg()
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
		asked.Add(1)
		if !written.Load() || len(p) != len(prompt) {
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
	n := asked.Load()
	time.Sleep(20 * lookAgainEvery)
	if asked.Load() != n {
		t.Fatalf("the lookup was asked %d more times after the request began", asked.Load()-n)
	}
}
