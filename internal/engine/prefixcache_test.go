package engine

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestWarmCacheCountsAsFree: cells that only cached sequences hold count as free for
// admission and headroom (a warm cache must not lower capacity), while cells a running
// request shares with a cached sequence do not.
func TestWarmCacheCountsAsFree(t *testing.T) {
	cfg := Config{NCtx: 256, Parallel: 4, MaxPools: 1, NBatch: 32, MaxQueue: 4, SessionTTL: time.Hour, PoolGrace: time.Second, PrefixCache: true}
	h := newHarness(t, cfg)
	system := seqTokens(1, 100)
	for i := range 2 {
		h.submit(Request{Prompt: append(slices.Clone(system), Token(500+i)), MaxTokens: 4})
		h.run()
	}
	if u := h.s.Usage(); u.CellsUsed == 0 || u.CacheCells != u.CellsUsed || u.CacheSeqs != 1 {
		// The second request took over the first's cached sequence: one sequence.
		t.Fatalf("after two requests: %+v", u)
	}
	if free := h.s.freeForNew(); free != cfg.NCtx {
		t.Fatalf("free for a new session %d with only cached cells, want %d", free, cfg.NCtx)
	}
	if p := h.s.pressure(); p != 0 {
		t.Fatalf("pressure %v with only cached cells", p)
	}
	// A new session takes the cached sequence over: its 100 cells are no longer free.
	id := h.submit(Request{Prompt: append(slices.Clone(system), 600, 601), MaxTokens: 50, SessionID: "S"})
	h.step()
	if ev, ok := h.done(id); ok {
		t.Fatalf("ended early: %+v", ev)
	}
	u := h.s.Usage()
	if free, want := h.s.freeForNew(), cfg.NCtx-u.CellsUsed+u.CacheCells; free != want || u.CacheCells >= u.CellsUsed-100 {
		t.Fatalf("free %d, want %d (usage %+v)", free, want, u)
	}
	if u.CacheHitTokens != 100+100 {
		t.Fatalf("hit tokens %d, want 200 (the takeover's and the session's)", u.CacheHitTokens)
	}
}

// TestRandomTrafficWithPrefixCache runs FuzzSchedulerInvariants' body over 200 fixed
// pseudo-random inputs with and without the prefix cache, in a roomy and a tight
// cache, so every go test exercises implicit reuse and eviction under random traffic
// (the fuzz seeds alone are few): accounting, the cache, the tree and the slots agree
// after every step, no request waits with room to run (checkLiveness), and every text
// equals a cold prefill's.
func TestRandomTrafficWithPrefixCache(t *testing.T) {
	for i := range 200 {
		r := rand.New(rand.NewPCG(uint64(i), 12))
		data := make([]byte, 40+r.IntN(200))
		for j := range data {
			data[j] = byte(r.IntN(256))
		}
		for _, cache := range []bool{false, true} {
			for _, nctx := range []int{256, 96} {
				for _, spec := range []bool{false, true} {
					fuzzScheduler(t, slices.Clone(data), cache, nctx, spec, nctx == 96)
				}
			}
		}
	}
}

// TestImplicitBorrowRefreshesPool: eviction's one least recently used order counts a
// pool's cells as used when a request without pool_id borrows them (issue 12): the
// pool, created before session T, comes after T once x has borrowed its prefix.
func TestImplicitBorrowRefreshesPool(t *testing.T) {
	cfg := Config{NCtx: 256, Parallel: 3, MaxPools: 2, NBatch: 32, MaxQueue: 4, SessionTTL: time.Hour, PoolGrace: time.Second, PrefixCache: true}
	h := newHarness(t, cfg)
	id := h.createPool(PoolSpec{Tokens: seqTokens(1, 10)})
	h.now = h.now.Add(2 * time.Second)
	h.submit(Request{Prompt: seqTokens(200, 10), SessionID: "T", MaxTokens: 1})
	h.run()
	h.now = h.now.Add(2 * time.Second)
	x := h.submit(Request{Prompt: append(seqTokens(1, 10), 77), MaxTokens: 1})
	h.run()
	if ev, _ := h.done(x); ev.Stats.CacheN != 10 || ev.Stats.Pool != 0 {
		t.Fatalf("x: %+v, want 10 cells borrowed from the pool without naming it", ev.Stats)
	}
	h.now = h.now.Add(2 * time.Second)
	h.step() // the scheduler's clock: the pool is past its grace time
	var order []string
	for _, hv := range h.s.kv.Victims(h.s.now, -1) {
		switch v := victimOf(hv); {
		case v.p != nil:
			order = append(order, fmt.Sprintf("pool%d", v.p.ID))
		case v.sl.session != "":
			order = append(order, v.sl.session)
		default:
			order = append(order, "cached")
		}
	}
	if want := []string{"T", fmt.Sprintf("pool%d", id), "cached"}; !slices.Equal(order, want) {
		t.Fatalf("eviction order %v, want %v", order, want)
	}
}
