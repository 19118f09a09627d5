package app

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
)

// timedTurn is one greedy completion of token ids with what a client sees of its time.
type timedTurn struct {
	ids                      []int
	lps                      []float64
	cacheN, promptN          int
	restoredN                int
	promptMs, predictedMs    float64
	wall                     time.Duration
	firstPrefill, longestGap time.Duration // from /slots (watchSlots); 0 when not watched
}

// timedCompletion posts body (prompt token ids, greedy, logprobs) and times it.
func timedCompletion(t testing.TB, base string, body map[string]any) timedTurn {
	t.Helper()
	body["temperature"], body["logprobs"], body["ignore_eos"] = 0, 1, true
	start := time.Now()
	code, out := post(t, base+"/v1/completions", body)
	wall := time.Since(start)
	if code != 200 {
		t.Fatalf("completion: %d %v", code, out)
	}
	lp := out["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)
	r := timedTurn{wall: wall}
	for i, v := range lp["token_ids"].([]any) {
		r.ids = append(r.ids, num(v))
		r.lps = append(r.lps, lp["token_logprobs"].([]any)[i].(float64))
	}
	tm := out["timings"].(map[string]any)
	r.cacheN, r.promptN = num(tm["cache_n"]), num(tm["prompt_n"])
	r.promptMs, r.predictedMs = tm["prompt_ms"].(float64), tm["predicted_ms"].(float64)
	if v, ok := tm["restored_n"]; ok {
		r.restoredN = num(v)
	}
	return r
}

// watchSlots polls /slots until stop is closed and reports, from start, when a
// sequence first prefilled (some slot in state prefill or decode, none waiting) and
// the longest time the prefilling slot's n_past stood still (a stall).
func watchSlots(t testing.TB, base string, start time.Time, stop <-chan struct{}) (firstPrefill, longestGap func() time.Duration) {
	var mu sync.Mutex
	var first, gap time.Duration
	done := make(chan struct{})
	go func() {
		defer close(done)
		lastPast, lastMove := -1, start
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			var slots []wire.Slot
			if code := get(t, base+"/slots", &slots); code != 200 {
				continue
			}
			now := time.Since(start)
			mu.Lock()
			waiting := slices.ContainsFunc(slots, func(s wire.Slot) bool { return s.State == "waiting" })
			i := slices.IndexFunc(slots, func(s wire.Slot) bool { return s.State == "prefill" })
			if first == 0 && !waiting && slices.ContainsFunc(slots, func(s wire.Slot) bool { return s.State == "prefill" || s.State == "decode" }) {
				first = now
			}
			if i >= 0 && slots[i].NPast != lastPast {
				lastPast, lastMove = slots[i].NPast, time.Now()
			} else if first > 0 && i >= 0 {
				gap = max(gap, time.Since(lastMove))
			}
			mu.Unlock()
		}
	}()
	read := func(v *time.Duration) func() time.Duration {
		return func() time.Duration { <-done; mu.Lock(); defer mu.Unlock(); return *v }
	}
	return read(&first), read(&gap)
}

func poolRestores(t testing.TB, base string) int64 {
	t.Helper()
	return tierProps(t, base).Kinds["pool"].Restores
}

// TestPinnedPoolJustMadeDoesNotHoldARequest: issue 54's shape on SmolLM2 with the
// defaults (--parallel 4, --pool-grace-ms 30000, a RAM tier), scaled to a quarter so
// that it runs in seconds on a CPU (-c 1024, not 4096; measured at full size too: see
// the commit). An orchestrator pins its ~half-cache team prompt, then sends an
// unrelated request of about the same length that shares the chat opening with it and
// needs more cells than the pool leaves, on a server where nothing else runs. The request starts prefilling at once (the pool is paged to the
// tier, not waited beside for 30-60 s), answers the greedy tokens and logprobs it
// answers alone on a fresh server in about that time, and the pool's next attach
// restores it from the tier with the output an attach gives on a server where the
// pool, created and attached right away, never left the cache.
func TestPinnedPoolJustMadeDoesNotHoldARequest(t *testing.T) {
	const nctx = 1024
	ref, refBase := startServer(t, Config{NCtx: nctx})
	opening := "<|im_start|>system\n"
	prefix := tokenize(t, ref, opening+longSystem(t, ref, nctx/2)+"<|im_end|>\n")
	var other strings.Builder
	other.WriteString(opening + "You are a careful translator. Glossary:\n")
	for i := 0; len(tokenize(t, ref, other.String())) < nctx/2-10; i++ {
		fmt.Fprintf(&other, "Term %d: the harbour light number %d means lantern %d.\n", i, i*3, i*11)
	}
	other.WriteString("<|im_end|>\n<|im_start|>user\nTranslate the last term.<|im_end|>\n<|im_start|>assistant\n")
	req := tokenize(t, ref, other.String())
	shared := 0
	for shared < len(req) && req[shared] == prefix[shared] {
		shared++
	}
	if shared == 0 || shared > 16 || len(prefix)+len(req)-shared+8 <= nctx {
		t.Fatalf("shape: pool %d tokens, request %d sharing %d: want a few shared and more than %d cells in all", len(prefix), len(req), shared, nctx)
	}
	question := suffixTokens(t, ref, "<|im_start|>user\nWho leads the team?<|im_end|>\n<|im_start|>assistant\n")
	attach := append(slices.Clone(prefix), question...)

	// Alone, on a fresh server (warmed up: a server's first request pays for setting up
	// its compute graphs).
	timedCompletion(t, refBase, map[string]any{"prompt": tokenize(t, ref, "Hello there."), "max_tokens": 2})
	alone := timedCompletion(t, refBase, map[string]any{"prompt": req, "max_tokens": 8})
	// Created and attached right away: never evicted in between (resident, no restore).
	refPool := num(createPool(t, refBase, map[string]any{"tokens": prefix, "pin": true})["pool_id"])
	before := timedCompletion(t, refBase, map[string]any{"prompt": attach, "max_tokens": 8, "pool_id": refPool})
	if before.cacheN != len(prefix) || poolRestores(t, refBase) != 0 || poolEntry(t, refBase, refPool).Residency != "resident" {
		t.Fatalf("a pool created and attached right away: cache_n %d of %d, %d restores, residency %q", before.cacheN, len(prefix), poolRestores(t, refBase), poolEntry(t, refBase, refPool).Residency)
	}

	// The shape.
	_, base := startServer(t, Config{NCtx: nctx})
	timedCompletion(t, base, map[string]any{"prompt": tokenize(t, ref, "Hello there."), "max_tokens": 2}) // warmed up too
	id := num(createPool(t, base, map[string]any{"tokens": prefix, "pin": true})["pool_id"])
	start, stop := time.Now(), make(chan struct{})
	firstPrefill, longestGap := watchSlots(t, base, start, stop)
	got := timedCompletion(t, base, map[string]any{"prompt": req, "max_tokens": 8})
	close(stop)
	got.firstPrefill, got.longestGap = firstPrefill(), longestGap()
	t.Logf("pool %d tokens, request %d (cache_n %d): first prefill after %s, longest stall %s, %s in all (prompt_ms %.0f, predicted_ms %.0f); alone %s (prompt_ms %.0f, predicted_ms %.0f)",
		len(prefix), len(req), got.cacheN, got.firstPrefill.Round(time.Millisecond), got.longestGap.Round(time.Millisecond),
		got.wall.Round(time.Millisecond), got.promptMs, got.predictedMs, alone.wall.Round(time.Millisecond), alone.promptMs, alone.predictedMs)
	if !slices.Equal(got.ids, alone.ids) || !slices.Equal(got.lps, alone.lps) || got.cacheN != shared {
		t.Fatalf("beside the pinned pool: tokens %v logprobs %v cache_n %d; alone %v %v (shared %d)", got.ids, got.lps, got.cacheN, alone.ids, alone.lps, shared)
	}
	// Not after a grace (30 s), nor stalled for one: prefilling within an engine step
	// (the first /slots poll, 20 ms in, sees it), never standing still longer than a step
	// takes (seconds for a 512-token batch on a loaded 2-core machine), and about as long
	// as alone: bounds far from the grace, since a shared machine's noise is not. (Before
	// issue 54: first prefill after 30.0 s, a 27.6 s stall, 60.5 s in all.)
	if got.firstPrefill > 5*time.Second || got.longestGap > 10*time.Second || got.wall > alone.wall+20*time.Second {
		t.Fatalf("first prefill after %s, longest stall %s, %s in all (alone %s)", got.firstPrefill, got.longestGap, got.wall, alone.wall)
	}
	if info := poolEntry(t, base, id); info.Residency != "ram" || !info.Pinned {
		t.Fatalf("pinned pool after the request: residency %q pinned %v, want paged to ram", info.Residency, info.Pinned)
	}
	// Its next attach restores it from the tier, with the output it had never paged.
	after := timedCompletion(t, base, map[string]any{"prompt": attach, "max_tokens": 8, "pool_id": id})
	if after.cacheN != len(prefix) || poolRestores(t, base) != 1 || !slices.Equal(after.ids, before.ids) || !slices.Equal(after.lps, before.lps) {
		t.Fatalf("attach after the page-out: cache_n %d, %d restores, tokens %v logprobs %v; never paged: %v %v", after.cacheN, poolRestores(t, base), after.ids, after.lps, before.ids, before.lps)
	}
}

// TestPoolMadeUnderLoadKeptForItsAttach: the reason for the grace, on SmolLM2. A pool is
// created while a request decodes, and a request that needs the pool's cells arrives
// before the pool's attach: it waits for the running request (which will make room), not
// for the pool, and the attach right after finds the pool resident (no page-out, no
// restore).
func TestPoolMadeUnderLoadKeptForItsAttach(t *testing.T) {
	const nctx = 1024
	a, base := startServer(t, Config{NCtx: nctx})
	// The running request holds ~400 cells from its first step (its prompt), the pool
	// ~300, and the waiting one needs ~400: more than those leave, fewer than the pool
	// alone leaves.
	text := func(n int, line string) []int32 {
		var b strings.Builder
		for i := 0; len(tokenize(t, a, b.String())) < n; i++ {
			fmt.Fprintf(&b, line, i, i*5, i%12+1)
		}
		return tokenize(t, a, b.String())
	}
	longToks := text(400, "Step %d: add %d to the total, then carry %d.\n")
	prefix := tokenize(t, a, longSystem(t, a, 300))
	bigToks := text(400, "Line %d: the ferry leaves pier %d at %d o'clock.\n")
	if len(bigToks)+len(prefix)+8 > nctx || len(bigToks)+len(prefix)+len(longToks) <= nctx {
		t.Fatalf("shape: running %d, pool %d, waiting %d", len(longToks), len(prefix), len(bigToks))
	}
	longStart := make(chan struct{})
	var long timedTurn
	var longEnd time.Time
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		close(longStart)
		long = timedCompletion(t, base, map[string]any{"prompt": longToks, "max_tokens": 64})
		longEnd = time.Now()
	}()
	<-longStart
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		var slots []wire.Slot
		get(t, base+"/slots", &slots)
		if slices.ContainsFunc(slots, func(s wire.Slot) bool { return s.State == "decode" }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the long request never decoded")
		}
	}
	id := num(createPool(t, base, map[string]any{"tokens": prefix, "pin": true})["pool_id"])
	bigSent := time.Now()
	wg.Add(1)
	go func() {
		defer wg.Done()
		timedCompletion(t, base, map[string]any{"prompt": bigToks, "max_tokens": 4})
	}()
	time.Sleep(50 * time.Millisecond) // it reaches the queue first
	question := suffixTokens(t, a, " Question: who leads? Answer:")
	got := timedCompletion(t, base, map[string]any{"prompt": append(slices.Clone(prefix), question...), "max_tokens": 4, "pool_id": id})
	wg.Wait()
	if !longEnd.After(bigSent) {
		t.Fatalf("the long request ended (%s) before the other was sent: nothing ran, make it longer", longEnd.Sub(bigSent))
	}
	t.Logf("running request %s in all; the attach took %s (cache_n %d)", long.wall.Round(time.Millisecond), got.wall.Round(time.Millisecond), got.cacheN)
	// (Once attached, the pool is an ordinary victim: the waiting request may page it
	// after the attach, so spills are not counted, only the restore a page-out before
	// the attach would have made it need.)
	if got.cacheN != len(prefix) || got.restoredN != 0 || poolRestores(t, base) != 0 {
		t.Fatalf("attach right after its creation: cache_n %d of %d, %d restores; want the pool resident at its attach",
			got.cacheN, len(prefix), poolRestores(t, base))
	}
}
