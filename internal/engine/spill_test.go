package engine

import (
	"errors"
	"maps"
	"slices"
	"testing"
	"time"
)

// spillCfg is a small server with a tier below the cache (issue 40).
func spillCfg() Config {
	return Config{NCtx: 512, Parallel: 1, MaxPools: 2, NBatch: 16, MaxQueue: 8, SessionTTL: time.Hour,
		PoolGrace: time.Second, BytesPerCell: 1, Tier: true, TierChunk: 8, PrefixCache: true}
}

// turn runs one request to the end and returns its Done event and the tokens it
// generated (logprobs on, so the events carry them).
func (h *harness) turn(req Request) (Event, []Token) {
	h.t.Helper()
	req.Logprobs = true
	id := h.submit(req)
	h.run()
	ev, ok := h.done(id)
	if !ok || ev.Err != nil {
		h.t.Fatalf("turn: %+v", ev)
	}
	var out []Token
	for _, e := range h.events[id] {
		for _, tl := range e.Tokens {
			out = append(out, tl.Token)
		}
	}
	return ev, out
}

// conversation runs turns of two agents that alternate on one sequence (every turn
// displaces the other agent), each turn's prompt being the last one, its reply and new
// text. It returns the done events and every reply, by agent.
func conversation(t *testing.T, cfg Config, session bool) (map[string][]Event, map[string][][]Token) {
	h := newHarness(t, cfg)
	prompts := map[string][]Token{"A": seqTokens(100, 30), "B": seqTokens(300, 27)}
	evs, replies := map[string][]Event{}, map[string][][]Token{}
	for round := range 3 {
		for _, a := range []string{"A", "B"} {
			req := Request{Prompt: prompts[a], MaxTokens: 5}
			if session {
				req.SessionID = a
			}
			ev, out := h.turn(req)
			evs[a] = append(evs[a], ev)
			replies[a] = append(replies[a], out)
			prompts[a] = append(append(slices.Clone(prompts[a]), out...), seqTokens(500+round*20, 9)...)
			h.now = h.now.Add(time.Second)
		}
	}
	return evs, replies
}

// An agent displaced by another on the one sequence gets its context back from the
// tier on its next turn instead of prefilling it, and says so (RestoredN); its replies
// are exactly those of a server where nothing was displaced.
func TestDisplacedConversationLoadsInsteadOfPrefilling(t *testing.T) {
	for _, session := range []bool{false, true} {
		cfg := spillCfg()
		got, gotReplies := conversation(t, cfg, session)
		ref := cfg
		ref.Parallel, ref.Tier = 2, false // each agent keeps its own sequence
		_, want := conversation(t, ref, session)
		for _, a := range []string{"A", "B"} {
			for i := range want[a] {
				if !slices.Equal(gotReplies[a][i], want[a][i]) {
					t.Fatalf("session=%v agent %s turn %d: %v, want %v (as without displacement)", session, a, i, gotReplies[a][i], want[a][i])
				}
			}
			for i, ev := range got[a][1:] {
				// Each later turn has its whole earlier context stored: only the new text
				// (and the reply's last token, which was sampled but never decoded) is
				// prefilled.
				if ev.Stats.RestoredN == 0 || ev.Stats.PromptN > 11 {
					t.Fatalf("session=%v agent %s turn %d: %+v, want its context restored (prompt_n ≤ 11)", session, a, i+1, ev.Stats)
				}
			}
		}
	}
}

// The segments of a system prompt shared by several agents are stored once: a second
// agent's spill skips what the first one stored (content, not holder, names them).
func TestSharedPrefixSegmentsStoredOnce(t *testing.T) {
	h := newHarness(t, spillCfg())
	system := seqTokens(100, 24) // three full chunks
	for i := range 3 {
		h.turn(Request{Prompt: append(slices.Clone(system), seqTokens(300+i*50, 10)...), MaxTokens: 2})
	}
	// Three agents, each spilled once by the next: the system prompt's three chunks once,
	// then each agent's own two chunks (tokens 24..31 and 32..35).
	h.turn(Request{Prompt: seqTokens(900, 5), MaxTokens: 2})
	if st := h.s.TierStats(); st.Saves[SpillCached] != 3+3*2 {
		t.Fatalf("segments saved: %+v, want 9 (the shared chunks once)", st)
	}
}

// A segment the store no longer has is a miss: the index forgets it, the prompt is
// prefilled from there, and the reply is the same.
func TestSpillMissPrefills(t *testing.T) {
	h := newHarness(t, spillCfg())
	a := seqTokens(100, 30)
	_, out := h.turn(Request{Prompt: a, SessionID: "A", MaxTokens: 4})
	h.turn(Request{Prompt: seqTokens(300, 20), SessionID: "B", MaxTokens: 2})
	for k := range h.be.segs {
		h.be.missing[k] = true // the store dropped every segment
	}
	next := append(append(slices.Clone(a), out...), 7, 8, 9)
	ev, got := h.turn(Request{Prompt: next, SessionID: "A", MaxTokens: 4})
	if ev.Stats.RestoredN != 0 || ev.Stats.PromptN != len(next) {
		t.Fatalf("after a miss: %+v, want the whole prompt prefilled", ev.Stats)
	}
	if st := h.s.TierStats(); st.Misses != 1 {
		t.Fatalf("misses %d, want 1", st.Misses)
	}
	ref := newHarness(t, spillCfg())
	ref.s.cfg.Tier = false
	_, want := ref.turn(Request{Prompt: next, MaxTokens: 4})
	if !slices.Equal(got, want) {
		t.Fatalf("reply after a miss %v, want %v", got, want)
	}
}

// Issue 40's pinned-pool shape: a pinned pool fills most of the cache and nothing runs;
// a request that needs more cells than are free starts at once (the pool is paged to
// the tier, kept there: a pin means never lost), and the pool's next attach restores it
// with the same reply as a cold prefill.
func TestPinnedPoolPagedForARequest(t *testing.T) {
	cfg := spillCfg()
	cfg.NCtx, cfg.QueueTimeout = 64, 30*time.Second
	h := newHarness(t, cfg)
	prefix := seqTokens(100, 33)
	id := h.createPool(PoolSpec{Tokens: prefix})
	if err := h.pinPool(id, true); err != nil {
		t.Fatal(err)
	}
	h.now = h.now.Add(2 * time.Second) // past the grace time
	big := h.submit(Request{Prompt: seqTokens(400, 34), MaxTokens: 2})
	h.step()
	if w := h.s.Waiting(h.now); len(w) != 0 {
		t.Fatalf("the request still waits after one step: %+v", w)
	}
	h.run()
	if ev, _ := h.done(big); ev.Err != nil {
		t.Fatalf("request beside a pinned pool: %v", ev.Err)
	}
	info, _ := h.s.Pool(id)
	if info.State != "evicted" || !info.Pinned || !h.be.keptPools[id] {
		t.Fatalf("pinned pool after the request: %+v (kept in the tier: %v)", info, h.be.keptPools[id])
	}
	prompt := append(slices.Clone(prefix), 7, 8)
	ev, got := h.turn(Request{Prompt: prompt, HasPool: true, PoolID: id, MaxTokens: 3})
	if ev.Stats.Shared != len(prefix) || h.be.tierRestores != 1 {
		t.Fatalf("attach after paging: %+v, %d restores; want the pool restored from the tier", ev.Stats, h.be.tierRestores)
	}
	ref := newHarness(t, spillCfg())
	_, want := ref.turn(Request{Prompt: prompt, MaxTokens: 3})
	if !slices.Equal(got, want) {
		t.Fatalf("reply through the restored pool %v, want %v", got, want)
	}
	// Unpinned, its entry is an ordinary one again.
	if err := h.pinPool(id, false); err != nil {
		t.Fatal(err)
	}
	h.step()
	if h.be.keptPools[id] {
		t.Fatal("unpinned pool's tier entry still kept")
	}
}

// Without a tier a pinned pool is never evicted: the same request can never fit beside
// it, and is refused at once saying so (not after the queue timeout).
func TestPinnedPoolWithoutTierStaysResident(t *testing.T) {
	cfg := spillCfg()
	cfg.NCtx, cfg.Tier, cfg.QueueTimeout = 64, false, 2*time.Second
	h := newHarness(t, cfg)
	id := h.createPool(PoolSpec{Tokens: seqTokens(100, 33)})
	if err := h.pinPool(id, true); err != nil {
		t.Fatal(err)
	}
	h.now = h.now.Add(2 * time.Second)
	big := h.submit(Request{Prompt: seqTokens(400, 34), MaxTokens: 2})
	if ev, ok := h.done(big); !ok || !errors.Is(ev.Err, ErrNeverFits) {
		t.Fatalf("request beside a pinned pool without a tier: %+v, want refused at once", ev)
	}
	// One that fits beside it runs.
	small := h.submit(Request{Prompt: seqTokens(400, 20), MaxTokens: 2})
	h.run()
	if ev, ok := h.done(small); !ok || ev.Err != nil {
		t.Fatalf("a request that fits beside the pinned pool: %+v", ev)
	}
	if info, _ := h.s.Pool(id); info.State != "resident" {
		t.Fatalf("pinned pool %+v, want resident", info)
	}
}

// On a model with recurrent state a session spills whole, with its state, and loads
// back only onto a sequence holding exactly where it started; its reply is the same.
func TestRecurrentSessionSpillsWhole(t *testing.T) {
	cfg := spillCfg()
	cfg.Recurrent, cfg.PrefixCache = true, false
	got, gotReplies := conversation(t, cfg, true)
	ref := cfg
	ref.Parallel, ref.Tier = 2, false
	_, want := conversation(t, ref, true)
	for _, a := range []string{"A", "B"} {
		for i := range want[a] {
			if !slices.Equal(gotReplies[a][i], want[a][i]) {
				t.Fatalf("agent %s turn %d: %v, want %v", a, i, gotReplies[a][i], want[a][i])
			}
		}
		for i, ev := range got[a][1:] {
			if ev.Stats.RestoredN == 0 {
				t.Fatalf("agent %s turn %d: %+v, want its context loaded", a, i+1, ev.Stats)
			}
		}
	}
}

// Program-aware order: when the one sequence frees, a known session's next turn goes
// before a new agent that asked earlier, and the least attained service first among
// continuations; a new agent passed over agingPasses times goes first after that.
func TestContinuationsBeforeFirstTurns(t *testing.T) {
	cfg := spillCfg()
	cfg.Tier, cfg.MaxQueue = false, 32
	h := newHarness(t, cfg)
	h.turn(Request{Prompt: seqTokens(100, 40), SessionID: "long", MaxTokens: 2})
	h.turn(Request{Prompt: seqTokens(200, 10), SessionID: "short", MaxTokens: 2})
	busy := h.submit(Request{Prompt: seqTokens(900, 4), MaxTokens: 20}) // holds the sequence
	h.step()
	first := h.submit(Request{Prompt: seqTokens(300, 6), SessionID: "new", MaxTokens: 1})
	long := h.submit(Request{Prompt: append(seqTokens(100, 40), 1, 2), SessionID: "long", MaxTokens: 1})
	short := h.submit(Request{Prompt: append(seqTokens(200, 10), 1, 2), SessionID: "short", MaxTokens: 1})
	h.run()
	var order []TaskID
	for _, id := range h.ended {
		if id == first || id == long || id == short {
			order = append(order, id)
		}
	}
	if !slices.Equal(order, []TaskID{short, long, first}) || h.tasksDone(busy) != 1 {
		t.Fatalf("order %v, want short (%d), long (%d), then the first turn (%d)", order, short, long, first)
	}
	// Aging: a first turn passed over agingPasses times goes before later continuations.
	busy = h.submit(Request{Prompt: seqTokens(900, 4), MaxTokens: 200})
	h.step()
	newcomer := h.submit(Request{Prompt: seqTokens(700, 6), SessionID: "late", MaxTokens: 1})
	var conts []TaskID
	for i := range agingPasses + 2 {
		conts = append(conts, h.submit(Request{Prompt: append(seqTokens(200, 10), 1, 2, Token(i)), SessionID: "short", MaxTokens: 1}))
	}
	h.cancel(busy)
	h.run()
	pos := slices.Index(h.ended, newcomer)
	if pos < 0 || slices.Index(h.ended, conts[agingPasses+1]) < pos {
		t.Fatalf("ended %v: the first turn %d must end before the last continuation %d (no starvation)", h.ended, newcomer, conts[agingPasses+1])
	}
}

func (h *harness) tasksDone(ids ...TaskID) int {
	n := 0
	for _, id := range ids {
		if _, ok := h.done(id); ok {
			n++
		}
	}
	return n
}

// The queue deadline runs only while nothing moves: a request behind a long turn keeps
// its place however long the turn, and is refused only once the server stands still.
func TestQueueDeadlineOnlyWithoutProgress(t *testing.T) {
	cfg := spillCfg()
	cfg.Tier, cfg.QueueTimeout = false, 500*time.Millisecond
	h := newHarness(t, cfg)
	h.stepCost = func([]BatchEntry) time.Duration { return 100 * time.Millisecond }
	long := h.submit(Request{Prompt: seqTokens(100, 4), MaxTokens: 40}) // 4 s of decoding
	h.step()
	waiter := h.submit(Request{Prompt: seqTokens(200, 4), MaxTokens: 2})
	h.run()
	for _, id := range []TaskID{long, waiter} {
		if ev, ok := h.done(id); !ok || ev.Err != nil {
			t.Fatalf("task %d: %+v (a request behind a progressing turn must keep its place)", id, ev)
		}
	}
}

// Eviction by expected next use: a session whose client said its next turn comes soon
// (NextTurn) or whose reply ended in a tool call (ExpectTurn) keeps its cells over one
// last used later that said nothing.
func TestEvictionByExpectedNextUse(t *testing.T) {
	for _, how := range []string{"hint", "tool"} {
		cfg := spillCfg()
		cfg.Parallel, cfg.Tier, cfg.PrefixCache = 3, false, false
		h := newHarness(t, cfg)
		req := Request{Prompt: seqTokens(100, 10), SessionID: "soon", MaxTokens: 2}
		if how == "hint" {
			req.NextTurn = 500 * time.Millisecond
		}
		ev, _ := h.turn(req)
		if how == "tool" {
			h.send(ExpectTurn{Seq: ev.Stats.Seq, Task: h.ended[len(h.ended)-1]})
		}
		h.now = h.now.Add(100 * time.Millisecond)
		h.turn(Request{Prompt: seqTokens(200, 10), SessionID: "quiet", MaxTokens: 2})
		h.now = h.now.Add(100 * time.Millisecond)
		// A third session needs a sequence id... and a fourth: one idle sequence goes.
		h.turn(Request{Prompt: seqTokens(300, 10), SessionID: "third", MaxTokens: 2})
		h.turn(Request{Prompt: seqTokens(400, 10), SessionID: "fourth", MaxTokens: 2})
		if _, ok := h.s.bySession["soon"]; !ok {
			t.Fatalf("%s: the session expected soon lost its sequence; sessions %v", how, h.s.Slots())
		}
		if _, ok := h.s.bySession["quiet"]; ok {
			t.Fatalf("%s: the quiet session kept its sequence", how)
		}
	}
}

// A session displaced to the tier whose next turn is expected (a hint, or a reply that
// ended in a tool call) has its segments read up from disk shortly before that turn,
// once; a session with no evidence of its next turn is not prefetched.
func TestExpectedTurnPrefetched(t *testing.T) {
	for _, how := range []string{"hint", "tool", "none"} {
		h := newHarness(t, spillCfg())
		a := seqTokens(100, 30)
		req := Request{Prompt: a, SessionID: "A", MaxTokens: 2}
		if how == "hint" {
			req.NextTurn = 5 * time.Second
		}
		ev, _ := h.turn(req)
		if how == "tool" {
			h.s.gaps.tool = 5 * time.Second // the tool gap learned over earlier turns
			h.send(ExpectTurn{Seq: ev.Stats.Seq, Task: h.ended[len(h.ended)-1]})
		}
		h.turn(Request{Prompt: seqTokens(300, 20), SessionID: "B", MaxTokens: 2}) // takes A's sequence
		if h.be.segSaves == 0 {
			t.Fatalf("%s: A was not spilled", how)
		}
		tick := func(d time.Duration) int {
			h.now = h.now.Add(d)
			h.send(Tick{})
			h.step()
			return len(h.be.prefetches)
		}
		if n := tick(time.Second); n != 0 {
			t.Fatalf("%s: prefetched %d times 4 s before the expected turn", how, n)
		}
		n := tick(2500 * time.Millisecond)
		if how == "none" {
			if n != 0 {
				t.Fatalf("none: a session with no expected turn was prefetched: %+v", h.be.prefetches)
			}
			continue
		}
		if n != 1 {
			t.Fatalf("%s: %d prefetches within 2 s of the expected turn, want 1", how, n)
		}
		op := h.be.prefetches[0]
		if len(op.Segs) == 0 || op.Segs[0].Start != 0 || !slices.Equal(op.Segs[len(op.Segs)-1].Tokens[:len(a)], a) {
			t.Fatalf("%s: prefetch %+v, want A's segments from 0", how, op)
		}
		if n := tick(time.Second); n != 1 {
			t.Fatalf("%s: prefetched again (%d)", how, n)
		}
	}
}

// Issue 44: replica A writes a served request's prompt through to the tier when it ends
// (TierWriteThrough), chunk by chunk with the prompt's last chunk named by the prompt
// itself, though its cells stay resident. Replica B, whose index knows nothing (it
// never served the prompt), is told what the shared store holds (Found) and loads it
// instead of prefilling; its reply is a cold prefill's.
func TestWriteThroughFoundByAnotherReplica(t *testing.T) {
	cfg := spillCfg()
	cfg.TierWriteThrough = true
	a := newHarness(t, cfg)
	prompt := seqTokens(100, 30) // chunks of 8: [0,8) [8,16) [16,24) and [24,30)
	_, outA := a.turn(Request{Prompt: prompt, MaxTokens: 4})
	a.steps(1) // the saves planned at its end run with the next step's operations
	var segs []Segment
	for k := 0; k < len(prompt); k += 8 {
		e := min(k+8, len(prompt))
		own, ok := a.be.segs[segKey(k, prompt[:e], false)]
		if !ok || !slices.Equal(own, prompt[k:e]) {
			t.Fatalf("A stored no chunk [%d, %d) of its prompt: %v", k, e, a.be.segs)
		}
		segs = append(segs, Segment{Start: k, Tokens: prompt[:e]})
	}
	if a.s.TierStats().IndexTokens != len(prompt) || len(a.be.kv[0]) == 0 {
		t.Fatalf("A: index %d tokens, sequence %d cells; want the prompt indexed and its cells kept", a.s.TierStats().IndexTokens, len(a.be.kv[0]))
	}

	b := newHarness(t, spillCfg())
	b.be.segs = maps.Clone(a.be.segs) // the shared level: what A wrote
	b.send(Found{Segs: segs})
	ev, outB := b.turn(Request{Prompt: prompt, MaxTokens: 4})
	if ev.Stats.RestoredN != len(prompt)-1 || ev.Stats.PromptN != 1 {
		t.Fatalf("B: %+v, want all but the prompt's last token loaded", ev.Stats)
	}
	if !slices.Equal(outA, outB) {
		t.Fatalf("B's reply %v, A's %v", outB, outA)
	}
	if st := b.s.TierStats(); st.Found != int64(len(segs)) {
		t.Fatalf("B found %d segments, want %d", st.Found, len(segs))
	}

	// Without write-through nothing of a request that ends resident is stored.
	c := newHarness(t, spillCfg())
	c.turn(Request{Prompt: prompt, MaxTokens: 4})
	c.steps(1)
	if len(c.be.segs) != 0 {
		t.Fatalf("stored without write-through: %v", c.be.segs)
	}
}

// A segment another replica stored that the prompt shares only in part (Found under
// the entry's own name: a teammate's chunk, the end of the prompt both share, then its
// own question) loads the part that matches, and the reply is a cold prefill's.
func TestFoundSegmentSharedInPart(t *testing.T) {
	cfg := spillCfg()
	cfg.TierWriteThrough = true
	a := newHarness(t, cfg)
	mate := seqTokens(100, 32) // chunks of 8: the last, [24, 32), shared up to 28
	a.turn(Request{Prompt: mate, MaxTokens: 2})
	a.steps(1)
	var segs []Segment
	for k := 0; k < len(mate); k += 8 {
		segs = append(segs, Segment{Start: k, Tokens: mate[:k+8]})
	}
	mine := append(slices.Clone(mate[:28]), 900, 901, 902)
	ref := newHarness(t, spillCfg())
	_, want := ref.turn(Request{Prompt: mine, MaxTokens: 4, NoPrefixCache: true})

	b := newHarness(t, spillCfg())
	b.be.segs = maps.Clone(a.be.segs)
	b.send(Found{Segs: segs})
	ev, got := b.turn(Request{Prompt: mine, MaxTokens: 4})
	if ev.Stats.RestoredN != 28 || ev.Stats.PromptN != 3 {
		t.Fatalf("%+v, want the shared 28 tokens loaded and 3 prefilled", ev.Stats)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("reply %v, a cold prefill gives %v", got, want)
	}
}

// The index of what lives below the cells follows the tier's reports (issue 55): a
// chunk the tier reports dropped is not loaded (before, the index offered it, the load
// missed and the rest was prefilled after a wasted step); one it reports stored stays.
func TestIndexFollowsTierDrops(t *testing.T) {
	h := newHarness(t, spillCfg())
	a := seqTokens(100, 30)
	_, out := h.turn(Request{Prompt: a, MaxTokens: 3})
	h.turn(Request{Prompt: seqTokens(300, 27), MaxTokens: 3}) // takes the only sequence: a spills
	saved := h.s.TierStats().IndexSegments
	if saved == 0 {
		t.Fatal("nothing was spilled")
	}
	// The store reports the first chunk stored, then its LRU dropping the third.
	first := Segment{Start: 0, Tokens: a[:8]}
	third := Segment{Start: 16, Tokens: a[:24]}
	h.send(TierChanged{Changes: []TierChange{{Seg: first, Stored: true}, {Seg: third}}})
	delete(h.be.segs, segKey(16, a[:24], false)) // as the store did
	if got := h.s.TierStats(); got.IndexSegments != saved-1 || got.Dropped != 1 {
		t.Fatalf("after the drop report: %d segments (was %d), %d dropped", got.IndexSegments, saved, got.Dropped)
	}
	next := append(append(slices.Clone(a), out...), seqTokens(700, 5)...)
	ev, _ := h.turn(Request{Prompt: next, MaxTokens: 3})
	if ev.Stats.RestoredN != 16 || h.s.TierStats().Misses != 0 {
		t.Fatalf("next turn: restored %d, %d misses; want the first two chunks loaded and no load of the dropped one tried", ev.Stats.RestoredN, h.s.TierStats().Misses)
	}
}

// A waiting request says where its prompt's KV lives now (/slots "kv"): the KV-cache
// manager answers for cells, this replica's tier and the fleet's level in one call.
func TestWaitingSaysWhereItsKVLives(t *testing.T) {
	h := newHarness(t, spillCfg())
	a := seqTokens(100, 30)
	_, out := h.turn(Request{Prompt: a, MaxTokens: 3})
	busy := h.submit(Request{Prompt: seqTokens(300, 27), MaxTokens: 50, IgnoreEOS: true}) // takes the only sequence: a spills
	h.step()
	next := append(append(slices.Clone(a), out...), seqTokens(700, 5)...) // 38 tokens
	// The fleet's level holds a chunk past what this replica stored (another replica's).
	h.send(Found{Segs: []Segment{{Start: 32, Tokens: next[:38]}}})
	id := h.submit(Request{Prompt: next, MaxTokens: 3})
	w := h.s.Waiting(h.now)
	if len(w) != 1 || w[0].Task != uint64(id) {
		t.Fatalf("waiting %+v, want the continuation", w)
	}
	// a and the two reply tokens decoded (32) were spilled as chunks of 8; the fleet's
	// chunk covers [32, 37) up to the last prompt token, which is always decoded.
	if got := w[0]; got.InCells != 0 || got.InTier != 32 || got.InFleet != 5 {
		t.Fatalf("residency cells %d, tier %d, fleet %d; want 0, 32, 5", got.InCells, got.InTier, got.InFleet)
	}
	h.run()
	if ev, ok := h.done(busy); !ok || ev.Err != nil {
		t.Fatalf("busy: %+v", ev)
	}
	if ev, ok := h.done(id); !ok || ev.Stats.RestoredN != 32 {
		t.Fatalf("the continuation: %+v, want its 32 tokens in the tier loaded", ev.Stats)
	}
}
