package engine

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

func defaultCfg() Config {
	return Config{NCtx: 512, Parallel: 4, NBatch: 16, MaxQueue: 4}
}

// expectedText runs prompt alone on a fresh scheduler: the reference output.
func expectedText(t *testing.T, prompt []Token, maxTokens int) string {
	h := newHarness(t, defaultCfg())
	id := h.submit(Request{Prompt: prompt, MaxTokens: maxTokens})
	h.run()
	return h.text(id)
}

func TestChunkedPrefillInterleavesWithDecode(t *testing.T) {
	h := newHarness(t, Config{NCtx: 512, Parallel: 2, NBatch: 8, MaxQueue: 2})
	a := h.submit(Request{Prompt: seqTokens(1, 3), MaxTokens: 20})
	h.step() // A's prompt
	long := seqTokens(100, 30)
	b := h.submit(Request{Prompt: long, MaxTokens: 5})
	prefillSteps := 0
	for i := 0; i < 5; i++ {
		batch := h.step()
		var decA, preB int
		for _, e := range batch {
			switch {
			case e.Task == a:
				decA++
			case e.Task == b && e.Pos < len(long):
				preB++
			}
		}
		if decA != 1 {
			t.Fatalf("step %d: A decoded %d tokens, want exactly 1 (batch %v)", i, decA, batch)
		}
		if len(batch) > 8 {
			t.Fatalf("step %d: batch of %d exceeds n_batch 8", i, len(batch))
		}
		if preB > 0 {
			prefillSteps++
		}
	}
	// 30 prompt tokens at 7 per step (8 minus A's decode token) take 5 steps.
	if prefillSteps != 5 {
		t.Fatalf("B's prompt was prefilled over %d steps, want 5 chunks", prefillSteps)
	}
	h.run()
	if got, want := h.text(a), expectedText(t, seqTokens(1, 3), 20); got != want {
		t.Fatalf("A's output changed by the interleaving:\n got %q\nwant %q", got, want)
	}
	if got, want := h.text(b), expectedText(t, long, 5); got != want {
		t.Fatalf("B's output differs from a solo run:\n got %q\nwant %q", got, want)
	}
}

func TestQueueBound(t *testing.T) {
	h := newHarness(t, Config{NCtx: 512, Parallel: 1, NBatch: 8, MaxQueue: 2})
	ids := []TaskID{h.submit(Request{Prompt: seqTokens(1, 4), MaxTokens: 3})}
	ids = append(ids, h.submit(Request{Prompt: seqTokens(1, 4), MaxTokens: 3}))
	ids = append(ids, h.submit(Request{Prompt: seqTokens(1, 4), MaxTokens: 3}))
	if u := h.s.Usage(); u.Running != 1 || u.Waiting != 2 {
		t.Fatalf("usage %+v, want 1 running and 2 waiting", u)
	}
	if _, err := h.trySubmit(Request{Prompt: seqTokens(1, 4)}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("4th request: err %v, want ErrQueueFull", err)
	}
	h.run()
	for _, id := range ids {
		ev, ok := h.done(id)
		if !ok || ev.Err != nil || ev.Stats.PredictedN != 3 {
			t.Fatalf("task %d: done=%v event %+v", id, ok, ev)
		}
	}
	// Once drained the queue accepts again.
	if _, err := h.trySubmit(Request{Prompt: seqTokens(1, 4)}); err != nil {
		t.Fatalf("after drain: %v", err)
	}
}

func TestCancelFreesSequence(t *testing.T) {
	h := newHarness(t, Config{NCtx: 512, Parallel: 1, NBatch: 8, MaxQueue: 2})
	a := h.submit(Request{Prompt: seqTokens(1, 5), MaxTokens: 100})
	b := h.submit(Request{Prompt: seqTokens(50, 5), MaxTokens: 2})
	h.step()
	h.step()
	if h.be.cells() == 0 {
		t.Fatal("A holds no cells while running")
	}
	h.cancel(a)
	h.collect()
	ev, ok := h.done(a)
	if !ok || ev.Finish != FinishCancelled || !errors.Is(ev.Err, ErrCancelled) {
		t.Fatalf("cancel event %+v", ev)
	}
	batch := h.step() // releases A's cells, B takes the sequence
	if len(batch) == 0 || batch[0].Task != b || batch[0].Pos != 0 {
		t.Fatalf("B did not start on the freed sequence: %v", batch)
	}
	if got := len(h.be.kv[0]); got != 5 {
		t.Fatalf("sequence holds %d cells after B's prefill, want B's 5 (A's freed)", got)
	}
	h.run()
	if h.be.cells() != 0 || len(h.be.samplers) != 0 {
		t.Fatalf("leak: %d cells, %d samplers", h.be.cells(), len(h.be.samplers))
	}
	h.cancel(a) // cancelling an ended task is harmless
	if got, want := h.text(b), expectedText(t, seqTokens(50, 5), 2); got != want {
		t.Fatalf("B output %q, want %q", got, want)
	}
}

func TestCancelWaitingTask(t *testing.T) {
	h := newHarness(t, Config{NCtx: 512, Parallel: 1, NBatch: 8, MaxQueue: 2})
	h.submit(Request{Prompt: seqTokens(1, 5), MaxTokens: 3})
	b := h.submit(Request{Prompt: seqTokens(1, 5), MaxTokens: 3})
	h.cancel(b)
	h.collect()
	if ev, ok := h.done(b); !ok || ev.Finish != FinishCancelled {
		t.Fatalf("waiting task not cancelled: %+v", ev)
	}
	if u := h.s.Usage(); u.Waiting != 0 {
		t.Fatalf("queue still holds %d", u.Waiting)
	}
}

func TestSessionReuseKeepsCommonPrefix(t *testing.T) {
	h := newHarness(t, defaultCfg())
	first := seqTokens(1, 10)
	a := h.submit(Request{Prompt: first, SessionID: "s1", MaxTokens: 4})
	h.run()
	ev, _ := h.done(a)
	if ev.Stats.CacheN != 0 || ev.Stats.PromptN != 10 {
		t.Fatalf("first turn stats %+v", ev.Stats)
	}
	seq := ev.Stats.Seq
	// The session keeps its KV: prompt + generated tokens (the last sampled one is not decoded).
	if got := len(h.be.kv[seq]); got != 10+3 {
		t.Fatalf("session holds %d cells, want 13", got)
	}
	second := append(seqTokens(1, 6), 99, 98, 97)
	b := h.submit(Request{Prompt: second, SessionID: "s1", MaxTokens: 4})
	batch := h.step()
	if len(batch) != 3 || batch[0].Pos != 6 || batch[0].Seq != seq {
		t.Fatalf("second turn should prefill only positions 6..8 on seq %d: %v", seq, batch)
	}
	h.run()
	ev, _ = h.done(b)
	if ev.Stats.CacheN != 6 || ev.Stats.PromptN != 3 {
		t.Fatalf("second turn stats %+v, want cache 6, prompt 3", ev.Stats)
	}
	if got, want := h.text(b), expectedText(t, second, 4); got != want {
		t.Fatalf("reused-prefix output %q differs from a fresh run %q", got, want)
	}
	// A prompt identical to what is cached still decodes its last token for logits.
	c := h.submit(Request{Prompt: second, SessionID: "s1", MaxTokens: 2})
	h.run()
	if ev, _ := h.done(c); ev.Stats.CacheN != len(second)-1 {
		t.Fatalf("identical prompt: cache_n %d, want %d", ev.Stats.CacheN, len(second)-1)
	}
}

func TestBusySessionWaitsOthersProceed(t *testing.T) {
	h := newHarness(t, Config{NCtx: 512, Parallel: 2, NBatch: 8, MaxQueue: 4})
	a := h.submit(Request{Prompt: seqTokens(1, 3), SessionID: "s", MaxTokens: 10})
	b := h.submit(Request{Prompt: seqTokens(1, 3), SessionID: "s", MaxTokens: 2})
	c := h.submit(Request{Prompt: seqTokens(7, 3), MaxTokens: 2})
	h.step()
	if u := h.s.Usage(); u.Running != 2 || u.Waiting != 1 {
		t.Fatalf("usage %+v: the anonymous task should run beside the session", u)
	}
	h.run()
	for _, id := range []TaskID{a, b, c} {
		if ev, ok := h.done(id); !ok || ev.Err != nil {
			t.Fatalf("task %d: %+v", id, ev)
		}
	}
}

func TestLRUEvictionOfIdleSessions(t *testing.T) {
	h := newHarness(t, Config{NCtx: 512, Parallel: 2, NBatch: 8, MaxQueue: 4})
	for _, s := range []string{"old", "new"} {
		h.submit(Request{Prompt: seqTokens(1, 4), SessionID: s, MaxTokens: 2})
		h.run()
	}
	h.submit(Request{Prompt: seqTokens(1, 4), SessionID: "third", MaxTokens: 2})
	h.run()
	sessions := map[string]bool{}
	for _, sl := range h.s.Slots() {
		sessions[sl.SessionID] = true
	}
	if sessions["old"] || !sessions["new"] || !sessions["third"] {
		t.Fatalf("sessions after eviction %v: the least recently used should be gone", sessions)
	}
}

func TestSessionTTL(t *testing.T) {
	cfg := defaultCfg()
	cfg.SessionTTL = time.Minute
	h := newHarness(t, cfg)
	h.submit(Request{Prompt: seqTokens(1, 4), SessionID: "s", MaxTokens: 2})
	h.run()
	if h.be.cells() == 0 {
		t.Fatal("idle session lost its KV too early")
	}
	h.now = h.now.Add(2 * time.Minute)
	h.step()
	if h.be.cells() != 0 || len(h.s.Slots()) != 0 {
		t.Fatalf("expired session still holds %d cells", h.be.cells())
	}
}

func TestStopConditions(t *testing.T) {
	prompt := seqTokens(1, 3)
	ref := expectedText(t, prompt, 8)
	// Pieces render as "<n>": stop at the third generated piece.
	parts := strings.SplitAfter(ref, ">")
	stop := parts[2]
	h := newHarness(t, defaultCfg())
	id := h.submit(Request{Prompt: prompt, Stop: []string{stop}})
	h.run()
	ev, _ := h.done(id)
	if ev.Finish != FinishStop || h.text(id) != parts[0]+parts[1] {
		t.Fatalf("stop string: finish %q text %q, want %q", ev.Finish, h.text(id), parts[0]+parts[1])
	}
	h2 := newHarness(t, defaultCfg())
	id2 := h2.submit(Request{Prompt: prompt, MaxTokens: 5})
	h2.run()
	if ev, _ := h2.done(id2); ev.Finish != FinishLength || ev.Truncated || ev.Stats.PredictedN != 5 {
		t.Fatalf("max_tokens: %+v", ev)
	}
}

func TestEOGStops(t *testing.T) {
	h := newHarness(t, defaultCfg())
	id := h.submit(Request{Prompt: seqTokens(1, 3)})
	h.step()
	// Force the next sample to be EOG by committing a hand-made result.
	p := h.s.Plan(h.now)
	apply(h.be, p)
	h.s.Commit([]Sampled{{Token: 0}}, nil, h.now)
	h.collect()
	ev, ok := h.done(id)
	if !ok || ev.Finish != FinishStop || ev.Stats.PredictedN != 1 {
		t.Fatalf("EOG: %+v", ev)
	}
}

func TestContextExhaustionTruncates(t *testing.T) {
	h := newHarness(t, Config{NCtx: 32, Parallel: 1, NBatch: 8, MaxQueue: 1})
	id := h.submit(Request{Prompt: seqTokens(1, 20), MaxTokens: 100})
	h.run()
	ev, _ := h.done(id)
	if ev.Finish != FinishLength || !ev.Truncated {
		t.Fatalf("context exhaustion: %+v", ev)
	}
	// One token sampled from the prompt, then one per decoded position 20..31.
	if ev.Stats.PredictedN != 32-20+1 {
		t.Fatalf("generated %d tokens, want %d", ev.Stats.PredictedN, 13)
	}
	if _, err := h.trySubmit(Request{Prompt: seqTokens(1, 32)}); !errors.Is(err, ErrPromptTooLong) {
		t.Fatalf("prompt of n_ctx tokens: %v", err)
	}
}

func TestSharedCellExhaustionStopsCleanly(t *testing.T) {
	// Two sessions whose combined growth exceeds the cells: both end, none crashes.
	h := newHarness(t, Config{NCtx: 40, Parallel: 2, NBatch: 8, MaxQueue: 2})
	a := h.submit(Request{Prompt: seqTokens(1, 10), MaxTokens: 100})
	b := h.submit(Request{Prompt: seqTokens(30, 10), MaxTokens: 100})
	h.run()
	for _, id := range []TaskID{a, b} {
		ev, ok := h.done(id)
		if !ok || ev.Finish != FinishLength || !ev.Truncated {
			t.Fatalf("task %d: %+v", id, ev)
		}
	}
	if h.be.cells() != 0 {
		t.Fatalf("%d cells leaked", h.be.cells())
	}
}

func TestPrefillDoesNotDeadlockOnCells(t *testing.T) {
	// Two long prompts that cannot both be resident: the second waits for the first.
	h := newHarness(t, Config{NCtx: 64, Parallel: 2, NBatch: 8, MaxQueue: 2})
	a := h.submit(Request{Prompt: seqTokens(1, 40), MaxTokens: 4})
	b := h.submit(Request{Prompt: seqTokens(200, 40), MaxTokens: 4})
	h.run()
	for _, id := range []TaskID{a, b} {
		ev, ok := h.done(id)
		if !ok || ev.Err != nil || ev.Stats.PredictedN != 4 {
			t.Fatalf("task %d: %+v", id, ev)
		}
	}
}

func TestDecodeErrorFailsTasksAndKeepsServing(t *testing.T) {
	h := newHarness(t, defaultCfg())
	a := h.submit(Request{Prompt: seqTokens(1, 4), MaxTokens: 10})
	h.step()
	h.be.failNext = errors.New("boom")
	h.step()
	ev, ok := h.done(a)
	if !ok || !errors.Is(ev.Err, ErrDecode) {
		t.Fatalf("decode error not reported: %+v", ev)
	}
	h.step()
	if h.be.cells() != 0 {
		t.Fatalf("failed task left %d cells", h.be.cells())
	}
	b := h.submit(Request{Prompt: seqTokens(1, 4), MaxTokens: 3})
	h.run()
	if ev, _ := h.done(b); ev.Err != nil || ev.Stats.PredictedN != 3 {
		t.Fatalf("after a decode error: %+v", ev)
	}
}

func TestConfigValidation(t *testing.T) {
	bad := []Config{
		{NCtx: 4, Parallel: 1, NBatch: 8},
		{NCtx: 512, Parallel: 0, NBatch: 8},
		{NCtx: 512, Parallel: 16, NBatch: 8},
		{NCtx: 512, Parallel: 1, NBatch: 8, MaxQueue: -1},
	}
	for _, c := range bad {
		if _, err := NewScheduler(c, fakeVocab{}); err == nil {
			t.Errorf("config %+v accepted", c)
		}
	}
	if _, err := NewScheduler(Config{NCtx: 1, Parallel: 1, NBatch: 1}, fakeVocab{}); err == nil {
		t.Error("tiny context accepted")
	}
	h := newHarness(t, defaultCfg())
	if _, err := h.trySubmit(Request{}); !errors.Is(err, ErrEmptyPrompt) {
		t.Fatalf("empty prompt: %v", err)
	}
}

// A sequence handed to a new session must drop the old session's table entry: the
// displaced session then starts fresh on the least recently used sequence instead of
// waiting on (and wiping) the sequence that now belongs to someone else.
func TestDisplacedSessionLeavesTheTable(t *testing.T) {
	cfg := Config{NCtx: 512, Parallel: 2, NBatch: 16, MaxQueue: 4, SessionTTL: time.Minute}
	h := newHarness(t, cfg)
	prompts := map[string][]Token{"A": seqTokens(1, 6), "B": seqTokens(20, 6), "C": seqTokens(40, 6)}
	for _, s := range []string{"A", "B", "C"} {
		h.submit(Request{Prompt: prompts[s], SessionID: s, MaxTokens: 2})
		h.run()
	}
	sessions := func() map[string]int {
		out := map[string]int{}
		for _, sl := range h.s.Slots() {
			if sl.SessionID != "" {
				out[sl.SessionID] = sl.Seq
			}
		}
		return out
	}
	if got := sessions(); len(got) != 2 || got["B"] == got["C"] {
		t.Fatalf("after A, B, C on 2 sequences: sessions %v, want B and C on their own sequences", got)
	}
	if u := h.s.Usage(); u.Sessions != 2 {
		t.Fatalf("session table holds %d entries after A was displaced, want 2", u.Sessions)
	}
	// A comes back: it takes B's sequence (least recently used), not C's.
	a := h.submit(Request{Prompt: prompts["A"], SessionID: "A", MaxTokens: 2})
	h.run()
	if ev, _ := h.done(a); ev.Err != nil || ev.Stats.CacheN != 0 {
		t.Fatalf("returning A: %+v (its KV was evicted, cache_n must be 0)", ev)
	}
	if got := sessions(); len(got) != 2 || got["A"] == got["C"] {
		t.Fatalf("after A returns: sessions %v", got)
	}
	if _, ok := sessions()["B"]; ok {
		t.Fatalf("B should have been displaced, sessions %v", sessions())
	}
	// C's cache survived A's return: its next turn reuses its whole previous prompt.
	cNext := append(slices.Clone(prompts["C"]), 90, 91)
	c := h.submit(Request{Prompt: cNext, SessionID: "C", MaxTokens: 2})
	h.run()
	if ev, _ := h.done(c); ev.Stats.CacheN < len(prompts["C"]) {
		t.Fatalf("C's next turn reused %d tokens, want at least %d: its cache was wiped", ev.Stats.CacheN, len(prompts["C"]))
	}
	// An anonymous request on a session's idle sequence unbinds that session too.
	x := h.submit(Request{Prompt: seqTokens(70, 4), MaxTokens: 1})
	y := h.submit(Request{Prompt: seqTokens(80, 4), MaxTokens: 1})
	h.run()
	for _, id := range []TaskID{x, y} {
		if ev, ok := h.done(id); !ok || ev.Err != nil {
			t.Fatalf("anonymous task %d: %+v", id, ev)
		}
	}
	if u := h.s.Usage(); u.Sessions != 0 || h.be.cells() != 0 {
		t.Fatalf("after anonymous tasks took both sequences: %d sessions, %d cells; want 0 and 0", u.Sessions, h.be.cells())
	}
}

// SessionTTL 0 means idle sessions never expire.
func TestSessionTTLZeroNeverExpires(t *testing.T) {
	cfg := defaultCfg()
	cfg.SessionTTL = 0
	h := newHarness(t, cfg)
	h.submit(Request{Prompt: seqTokens(1, 4), SessionID: "s", MaxTokens: 2})
	h.run()
	h.now = h.now.Add(1000 * time.Hour)
	h.step()
	if h.be.cells() == 0 || len(h.s.Slots()) != 1 {
		t.Fatal("an idle session expired with SessionTTL 0")
	}
}

// Measurements leave the scheduler as data with the step, not as calls from inside it.
func TestObservationsComeOutOfTheStep(t *testing.T) {
	h := newHarness(t, defaultCfg())
	h.submit(Request{Prompt: seqTokens(1, 5), MaxTokens: 3})
	h.run()
	kinds := map[ObsKind]int{}
	for _, o := range h.s.Observations() {
		kinds[o.Kind]++
		if o.Kind == ObsQuery && (o.PromptTokens != 5 || o.CachedTokens != 0) {
			t.Fatalf("query observation %+v", o)
		}
	}
	if kinds[ObsTTFT] != 1 || kinds[ObsTokenLatency] != 2 || kinds[ObsQuery] != 1 {
		t.Fatalf("observations %v: want 1 TTFT, 2 token latencies (3 tokens), 1 query", kinds)
	}
	if len(h.s.Observations()) != 0 {
		t.Fatal("Observations does not drain")
	}
}

// Admission evicts only what the new prompt needs: the least recently used idle session
// loses just the 10 cells wanted, from its tail (its first 30 stay for its next turn),
// and a second one that is not needed keeps all of its cache.
func TestAdmissionEvictsOnlyWhatItNeeds(t *testing.T) {
	h := newHarness(t, Config{NCtx: 100, Parallel: 3, NBatch: 64, MaxQueue: 4})
	h.submit(Request{Prompt: seqTokens(1, 39), SessionID: "A", MaxTokens: 2}) // holds 40 cells
	h.run()
	h.submit(Request{Prompt: seqTokens(100, 29), SessionID: "B", MaxTokens: 2}) // holds 30 cells
	h.run()
	// 30 cells free; a 40-token prompt needs 10 of A's 40, none of B's.
	id := h.submit(Request{Prompt: seqTokens(200, 40), MaxTokens: 1})
	h.run()
	if ev, ok := h.done(id); !ok || ev.Err != nil {
		t.Fatalf("new request: %+v", ev)
	}
	sessions := map[string]int{}
	for _, sl := range h.s.Slots() {
		sessions[sl.SessionID] = sl.NPast
	}
	if sessions["A"] != 30 || sessions["B"] != 30 {
		t.Fatalf("sessions after admission %v: want A's tail of 10 evicted (LRU) and 30 cells each kept", sessions)
	}
}
