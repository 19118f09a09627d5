package engine

import (
	"slices"
	"testing"
	"time"
)

// What a pool's grace (--pool-grace-ms) holds and what it does not (issue 54): it holds
// a pool that awaits its first use since it became resident, so that a pool just made
// survives until the attach it was made for, while running work will make room for
// whoever else needs cells; it never holds back a request that no running work will
// ever make room for; and a request that shares a few tokens of a pool's prefix does
// not use the pool (nor renew its grace).

// graceCfg is issue 54's server in miniature: the default grace (30 s), a tier below
// the cache, the prefix cache on, and a cache that holds the pool or the request, not
// both.
func graceCfg() Config {
	cfg := spillCfg()
	cfg.NCtx, cfg.Parallel, cfg.PoolGrace, cfg.QueueTimeout = 64, 2, 30*time.Second, time.Minute
	return cfg
}

// Issue 54's shape: a pinned pool just made, nothing running, and a plain request whose
// prompt shares the pool's first tokens but needs more cells than the pool leaves. It
// starts within one step (the pool is paged to the tier at once: nothing running would
// ever make room, so waiting would only wait out the grace), answers what it answers on
// a fresh server, and the pool's next attach restores it with a cold prefill's output.
// Without a tier the same holds for an unpinned pool, which is evicted and prefilled
// again by its attach.
func TestGraceYieldsWhenNothingRunningMakesRoom(t *testing.T) {
	for _, tier := range []bool{true, false} {
		cfg := graceCfg()
		cfg.Tier = tier
		h := newHarness(t, cfg)
		prefix := seqTokens(100, 33)
		id := h.createPool(PoolSpec{Tokens: prefix, Pin: tier})
		start := h.now
		// 3 tokens shared with the pool, 36 in all: 33 new cells, 31 free.
		prompt := append(slices.Clone(prefix[:3]), seqTokens(400, 33)...)
		req := h.submit(Request{Prompt: prompt, MaxTokens: 4, Logprobs: true})
		h.step()
		if w := h.s.Waiting(h.now); len(w) != 0 {
			t.Fatalf("tier=%v: the request still waits after one step: %+v", tier, w)
		}
		h.run()
		ev, ok := h.done(req)
		if !ok || ev.Err != nil || ev.Stats.CacheN != 3 {
			t.Fatalf("tier=%v: request beside a pool just made: %+v", tier, ev)
		}
		if took := h.now.Sub(start); took > time.Second {
			t.Fatalf("tier=%v: the request took %s (the grace is %s)", tier, took, cfg.PoolGrace)
		}
		ref := newHarness(t, cfg)
		_, want := ref.turn(Request{Prompt: prompt, MaxTokens: 4})
		if got := tokensOf(h, req); !slices.Equal(got, want) {
			t.Fatalf("tier=%v: reply %v, want %v (as on a fresh server)", tier, got, want)
		}
		info, _ := h.s.Pool(id)
		if info.State != "evicted" || (tier && !h.be.keptPools[id]) {
			t.Fatalf("tier=%v: the pool after the request: %+v (kept in the tier: %v)", tier, info, h.be.keptPools[id])
		}
		attach := append(slices.Clone(prefix), 7, 8)
		aev, got := h.turn(Request{Prompt: attach, HasPool: true, PoolID: id, MaxTokens: 3})
		restores := 0
		if tier {
			restores = 1
		}
		if aev.Stats.Shared != len(prefix) || h.be.tierRestores != restores {
			t.Fatalf("tier=%v: attach after the page-out: %+v, %d restores, want %d", tier, aev.Stats, h.be.tierRestores, restores)
		}
		_, cold := newHarness(t, cfg).turn(Request{Prompt: attach, MaxTokens: 3})
		if !slices.Equal(got, cold) {
			t.Fatalf("tier=%v: reply through the restored pool %v, want %v", tier, got, cold)
		}
	}
}

// tokensOf is the tokens task id generated.
func tokensOf(h *harness, id TaskID) []Token {
	var out []Token
	for _, e := range h.events[id] {
		for _, tl := range e.Tokens {
			out = append(out, tl.Token)
		}
	}
	return out
}

// The reason for the grace: a pool created while other work runs, and attached right
// after, is not evicted in between, though a request that needs its cells arrives
// first: that request waits for the running work, which makes room for it, and the
// attach finds the pool resident (no page-out, no restore).
func TestGraceHoldsAPoolForItsFirstAttach(t *testing.T) {
	h := newHarness(t, graceCfg())
	running := h.submit(Request{Prompt: seqTokens(600, 16), MaxTokens: 12})
	h.step()
	prefix := seqTokens(100, 24)
	id := h.createPool(PoolSpec{Tokens: prefix, Pin: true})
	// 64 cells: the running request's ~20, the pool's 24; this one needs 26, which
	// the running request leaves when it ends.
	other := h.submit(Request{Prompt: seqTokens(400, 26), MaxTokens: 2})
	h.step()
	h.step()
	if w := h.s.Waiting(h.now); len(w) != 1 || w[0].Reason != WaitCells {
		t.Fatalf("the request that needs the pool's cells: %+v, want waiting for cells", w)
	}
	attach := h.submit(Request{Prompt: append(slices.Clone(prefix), 7), HasPool: true, PoolID: id, MaxTokens: 2})
	h.run()
	for _, id := range []TaskID{running, other, attach} {
		if ev, ok := h.done(id); !ok || ev.Err != nil {
			t.Fatalf("task %d: %+v", id, ev)
		}
	}
	// (Used, the pool is an ordinary victim: the waiting request may page it then.)
	if ev, _ := h.done(attach); ev.Stats.Shared != len(prefix) || ev.Stats.CacheN != len(prefix) || h.be.tierRestores != 0 {
		t.Fatalf("attach: %+v, %d restores; want the pool resident at its attach", ev.Stats, h.be.tierRestores)
	}
}

// A request that shares only a few tokens with a pool does not use it: the pool still
// awaits its first attach, within its grace, so the next request that needs its cells
// waits for the running work instead of paging it, and the pool's last use is still
// its creation. A request that borrows all of it uses it.
func TestBorrowingPartOfAPoolIsNotAUse(t *testing.T) {
	h := newHarness(t, graceCfg())
	prefix := seqTokens(100, 24)
	id := h.createPool(PoolSpec{Tokens: prefix, Pin: true})
	made, _ := h.s.Pool(id)
	h.now = h.now.Add(time.Second)
	// It shares the pool's first 3 tokens (cache_n 3) and keeps running.
	borrower := h.submit(Request{Prompt: append(slices.Clone(prefix[:3]), seqTokens(600, 13)...), MaxTokens: 12})
	h.step()
	if ev := h.events[borrower]; len(ev) == 0 {
		t.Fatal("the borrower did not start")
	}
	if info, _ := h.s.Pool(id); info.LastAccessTS != made.LastAccessTS {
		t.Fatalf("a 3-token borrow moved the pool's last use from %v to %v", made.LastAccessTS, info.LastAccessTS)
	}
	other := h.submit(Request{Prompt: seqTokens(400, 30), MaxTokens: 2})
	h.step()
	if w := h.s.Waiting(h.now); len(w) != 1 || w[0].Reason != WaitCells || h.be.tierSpills != 0 {
		t.Fatalf("after a 3-token borrow: waiting %+v, %d pool spills; want the request waiting for the running one, the pool kept", w, h.be.tierSpills)
	}
	h.run()
	if ev, ok := h.done(other); !ok || ev.Err != nil {
		t.Fatalf("the waiting request: %+v", ev)
	}
	// All of it borrowed (no pool_id): that is a use; the pool is an ordinary victim.
	whole := h.submit(Request{Prompt: append(slices.Clone(prefix), 9), MaxTokens: 2})
	h.run()
	if ev, _ := h.done(whole); ev.Stats.CacheN != len(prefix) {
		t.Fatalf("a whole borrow: %+v", ev.Stats)
	}
	if info, _ := h.s.Pool(id); info.LastAccessTS == made.LastAccessTS {
		t.Fatal("a borrow of the whole pool did not count as its use")
	}
}

// A pool in its grace whose first use waits in the queue is never taken, and that use
// goes ahead of the task that waits for its cells. Two pools that fit only one at a
// time, both paged, and an attach to each: the first restored is attached before the
// second's restore takes its cells. (Builds go first in the queue: a restore that took
// the pool just restored would be overtaken by the other's restore again, and so on
// forever; and one that left it but went first would wait for the grace to run out
// behind the attach that holds it.)
func TestRestoresDoNotPageEachOther(t *testing.T) {
	cfg := graceCfg()
	cfg.NCtx = 48
	h := newHarness(t, cfg)
	a, b := seqTokens(100, 30), seqTokens(300, 30)
	var ids []int
	for _, toks := range [][]Token{a, b} {
		id := h.createPool(PoolSpec{Tokens: toks})
		if err := h.evictPool(id); err != nil { // to the tier
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	done := make(chan struct{})
	var ra, rb TaskID
	go func() {
		defer close(done)
		ra = h.submit(Request{Prompt: append(slices.Clone(a), 1), HasPool: true, PoolID: ids[0], MaxTokens: 2})
		rb = h.submit(Request{Prompt: append(slices.Clone(b), 1), HasPool: true, PoolID: ids[1], MaxTokens: 2})
		h.run()
	}()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("two restores page each other's pools forever")
	}
	for _, id := range []TaskID{ra, rb} {
		if ev, ok := h.done(id); !ok || ev.Err != nil || ev.Stats.Shared != 30 {
			t.Fatalf("attach %d: %+v", id, ev)
		}
	}
	if h.be.tierRestores != 2 {
		t.Fatalf("%d restores, want 2 (one per pool)", h.be.tierRestores)
	}
}

// A request admitted by taking pools in their grace may take them for its decode too:
// two pools just made, nothing running, and a request whose prompt needs one of them
// paged and whose reply needs the other. It answers in full, as on a fresh server,
// rather than stop at "length" beside a pool nothing uses.
func TestGraceYieldsForTheWholeReply(t *testing.T) {
	h := newHarness(t, graceCfg())
	for _, from := range []int{100, 300} {
		h.createPool(PoolSpec{Tokens: seqTokens(from, 20), Pin: true})
	}
	prompt := seqTokens(500, 30) // 24 free: one pool must go; 30 + 20 > 44: then the other
	ev, got := h.turn(Request{Prompt: prompt, MaxTokens: 20})
	if ev.Truncated || ev.Stats.PredictedN != 20 || h.be.tierSpills != 2 {
		t.Fatalf("reply beside two pools just made: %+v, %d pools paged; want all 20 tokens, both paged", ev, h.be.tierSpills)
	}
	_, want := newHarness(t, graceCfg()).turn(Request{Prompt: prompt, MaxTokens: 20})
	if !slices.Equal(got, want) {
		t.Fatalf("reply %v, want %v (as on a fresh server)", got, want)
	}
}
