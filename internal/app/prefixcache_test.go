package app

import (
	"slices"
	"sync"
	"testing"
	"time"
)

// cachedGreedy completes prompt greedily with the prefix cache allowed (no pool, an
// optional session) and returns the tokens and cache_n.
func cachedGreedy(t testing.TB, base string, prompt []int32, session string, n int) ([]int, int) {
	t.Helper()
	body := map[string]any{"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "ignore_eos": true}
	if session != "" {
		body["session_id"] = session
	}
	code, out := post(t, base+"/v1/completions", body)
	if code != 200 {
		t.Errorf("completion: %d %v", code, out)
		return nil, 0
	}
	var ids []int
	for _, v := range out["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)["token_ids"].([]any) {
		ids = append(ids, num(v))
	}
	cached := num(out["usage"].(map[string]any)["prompt_tokens_details"].(map[string]any)["cached_tokens"])
	if tm := num(out["timings"].(map[string]any)["cache_n"]); tm != cached {
		t.Errorf("timings.cache_n %d != usage cached_tokens %d", tm, cached)
	}
	return ids, cached
}

// TestPrefixCacheGreedyEqualsCold (issue 12): requests without pool_id or a known
// session start from the longest prefix any resident sequence holds, and their greedy
// tokens equal a cold prefill's: reusing a whole earlier prompt (root), a prefix that
// diverges mid-prompt, and a prefix borrowed from a session that moves on to a
// different suffix (dropping the borrowed cells from its own sequence) while the
// borrower still decodes.
func TestPrefixCacheGreedyEqualsCold(t *testing.T) {
	for _, m := range []struct {
		name string
		cfg  func(t *testing.T) Config
	}{
		{"smollm2", func(t *testing.T) Config { return Config{ModelPath: modelPath(t)} }},
		// Gemma 3: sliding-window layers; borrowed prefixes reach past the window.
		{"gemma3", func(t *testing.T) Config { return Config{ModelPath: gemmaPath(t)} }},
	} {
		t.Run(m.name, func(t *testing.T) {
			cfg := m.cfg(t)
			cfg.NCtx, cfg.Parallel, cfg.MaxPools = 4096, 4, 2
			a, err := Open(withDefaults(cfg), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(a.Close)
			base := serve(t, a)
			system := tokenize(t, a, longSystem(t, a, 600)) // past Gemma 3's 512-token window
			n := len(system)
			q := func(s string) []int32 { return suffixTokens(t, a, s) }
			root := append(slices.Clone(system), q(" Question: which tool answers topic 21? Answer:")...)
			mid := append(slices.Clone(system[:n/2]), q(" Forget the tools. Tell a short story about a lighthouse.")...)
			donor := append(slices.Clone(system), q(" Session: summarize tool 3.")...)
			borrower := append(slices.Clone(donor), q(" Then name the tool for topic 14.")...)
			moved := append(slices.Clone(system[:n/3]), q(" Session, second turn: something else entirely.")...)
			const k = 12
			cold := map[string][]int{}
			for name, p := range map[string][]int32{"root": root, "mid": mid, "borrower": borrower, "moved": moved} {
				cold[name], _ = greedyTokens(t, base, p, 0, k)
			}
			// Root: the second request of the same prompt reuses all but its last token.
			got, cacheN := cachedGreedy(t, base, root, "", k)
			if !slices.Equal(got, cold["root"]) || cacheN != len(root)-1 {
				t.Fatalf("root: cached %v (cache_n %d of %d), cold %v", got, cacheN, len(root), cold["root"])
			}
			got, cacheN = cachedGreedy(t, base, mid, "", k)
			if !slices.Equal(got, cold["mid"]) || cacheN < n/2 || cacheN >= len(mid) {
				t.Fatalf("mid-prompt divergence: cached %v (cache_n %d, shared %d), cold %v", got, cacheN, n/2, cold["mid"])
			}
			// The session's first turn; then the borrower copies its prefix while the
			// session's second turn drops everything past n/3 of its own sequence.
			if _, cacheN = cachedGreedy(t, base, donor, "S", 4); cacheN < n-1 {
				t.Fatalf("a new session starts from the cache too: cache_n %d, want >= %d", cacheN, n-1)
			}
			var wg sync.WaitGroup
			var bGot []int
			var bCache int
			wg.Add(1)
			go func() {
				defer wg.Done()
				bGot, bCache = cachedGreedy(t, base, borrower, "", 64)
			}()
			// Only once the borrower decodes (its prefix copied) does the session move on.
			for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
				var slots []map[string]any
				get(t, base+"/slots", &slots)
				if slices.ContainsFunc(slots, func(s map[string]any) bool { return s["session_id"] == "" && s["state"] == "decode" }) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the borrower never decoded: %v", slots)
				}
			}
			mGot, _ := cachedGreedy(t, base, moved, "S", k)
			wg.Wait()
			if t.Failed() {
				t.FailNow()
			}
			if len(bGot) != 64 || !slices.Equal(bGot[:k], cold["borrower"]) || bCache < len(donor) {
				t.Fatalf("borrower: cached %v (cache_n %d, donor %d), cold %v", bGot[:min(k, len(bGot))], bCache, len(donor), cold["borrower"])
			}
			if !slices.Equal(mGot, cold["moved"]) {
				t.Fatalf("donor session's second turn: %v, cold %v", mGot, cold["moved"])
			}
			bFull, _ := greedyTokens(t, base, borrower, 0, 64)
			if !slices.Equal(bGot, bFull) {
				t.Fatalf("borrower's 64 tokens differ from a cold prefill's:\n%v\n%v", bGot, bFull)
			}
			var props map[string]any
			get(t, base+"/props", &props)
			pc := props["polykv"].(map[string]any)["prefix_cache"].(map[string]any)
			if pc["enabled"] != true || num(pc["hit_tokens"]) < len(root)-1+n/2+n-1+len(donor) {
				t.Fatalf("/props prefix_cache %v", pc)
			}
			metrics := scrapeMetrics(t, base)
			for _, name := range []string{"polykv_prefix_cache_implicit_hit_tokens_total", "polykv_prefix_cache_resident_tokens", "polykv_prefix_cache_sequences", "polykv_prefix_cache_evictions_total"} {
				if f, ok := metrics[name]; !ok || len(f.GetMetric()) != 1 {
					t.Errorf("/metrics lacks %s", name)
				}
			}
			if f, ok := metrics["polykv_evictions_total"]; !ok || len(f.GetMetric()) != 3 {
				t.Errorf("/metrics: polykv_evictions_total should have one series per kind (cached, session, pool): %v", f)
			}
			if hits := metrics["polykv_prefix_cache_implicit_hit_tokens_total"].GetMetric()[0].GetCounter().GetValue(); int(hits) != num(pc["hit_tokens"]) {
				t.Errorf("/metrics hit tokens %v, /props %v", hits, pc["hit_tokens"])
			}
		})
	}
}

// TestPrefixCacheOff: --prefix-cache off reuses nothing across requests.
func TestPrefixCacheOff(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 2048, Parallel: 2, PrefixCache: "off"})
	p := append(tokenize(t, a, longSystem(t, a, 100)), suffixTokens(t, a, " Answer:")...)
	for i := range 2 {
		if _, cacheN := cachedGreedy(t, base, p, "", 2); cacheN != 0 {
			t.Fatalf("request %d: cache_n %d with the prefix cache off", i, cacheN)
		}
	}
	var props map[string]any
	get(t, base+"/props", &props)
	if pc := props["polykv"].(map[string]any)["prefix_cache"].(map[string]any); pc["enabled"] != false {
		t.Fatalf("/props prefix_cache %v", pc)
	}
}
