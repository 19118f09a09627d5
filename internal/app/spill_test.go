package app

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/testmodel"
)

// turnResult is what one agent turn of the spill tests gives back.
type turnResult struct {
	ids                []int
	lps                []float64
	cacheN, restoredN  int
	promptN, cachedTok int
}

// agentTurn completes prompt greedily as session (or anonymously when session is "")
// and returns its tokens, logprobs and counts.
func agentTurn(t testing.TB, base string, prompt []int32, session string, n int) turnResult {
	t.Helper()
	body := map[string]any{"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "ignore_eos": true}
	if session != "" {
		body["session_id"] = session
	}
	code, out := post(t, base+"/v1/completions", body)
	if code != 200 {
		t.Fatalf("completion: %d %v", code, out)
	}
	lp := out["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)
	var r turnResult
	for i, v := range lp["token_ids"].([]any) {
		r.ids = append(r.ids, num(v))
		r.lps = append(r.lps, lp["token_logprobs"].([]any)[i].(float64))
	}
	tm := out["timings"].(map[string]any)
	r.cacheN, r.promptN = num(tm["cache_n"]), num(tm["prompt_n"])
	if v, ok := tm["restored_n"]; ok {
		r.restoredN = num(v)
	}
	r.cachedTok = num(out["usage"].(map[string]any)["prompt_tokens_details"].(map[string]any)["cached_tokens"])
	return r
}

// checkSpilledTurns: two agents take turns on a server with one sequence, so each turn
// displaces the other agent (issue 40). From its second turn on, an agent's context
// comes back from the tier (restored_n) instead of being prefilled (prompt_n is its new
// text), and its greedy tokens and logprobs equal a cold full prefill's of the same
// prompt. session: the agents name sessions; else they are plain requests that only
// the prefix cache and the tier's content addressing recognise.
func checkSpilledTurns(t *testing.T, cfg Config, session bool, ctxTokens func(a *App, agent, turn, n int) []int32) {
	a, base := openServer(t, cfg)
	prompts := map[string][]int32{"A": ctxTokens(a, 0, 0, 150), "B": ctxTokens(a, 1, 0, 130)}
	for round := range 3 {
		for ai, agent := range []string{"A", "B"} {
			sid := ""
			if session {
				sid = agent
			}
			got := agentTurn(t, base, prompts[agent], sid, 6)
			cold, coldLP, _ := greedyLogprobs(t, base, prompts[agent], 0, 6)
			if !slices.Equal(got.ids, cold) || !slices.Equal(got.lps, coldLP) {
				t.Fatalf("agent %s turn %d: tokens %v logprobs %v, a cold prefill gives %v %v", agent, round, got.ids, got.lps, cold, coldLP)
			}
			if round > 0 {
				// Everything but the new text (and, on a recurrent model, back to the
				// session's whole previous context) came from the tier.
				if got.restoredN == 0 || got.promptN > 24 || got.cachedTok != got.cacheN+got.restoredN {
					t.Fatalf("agent %s turn %d: restored_n %d prompt_n %d cache_n %d cached_tokens %d, want its context restored", agent, round, got.restoredN, got.promptN, got.cacheN, got.cachedTok)
				}
			}
			next := append(slices.Clone(prompts[agent]), int32Slice(got.ids)...)
			prompts[agent] = append(next, ctxTokens(a, ai, round+1, 12)...)
		}
	}
	props := tierProps(t, base)
	k := "cached"
	if session {
		k = "session"
	}
	if ks := props.Kinds[k]; ks.Spills == 0 || ks.Restores == 0 || ks.Misses != 0 {
		t.Fatalf("tier kinds %+v, want %s spills and restores and no miss", props.Kinds, k)
	}
}

func int32Slice(ids []int) []int32 {
	out := make([]int32, len(ids))
	for i, v := range ids {
		out[i] = int32(v)
	}
	return out
}

// TestSpilledTurnsEqualPrefill runs checkSpilledTurns on SmolLM2 and Gemma 3 (sliding
// window: each segment is saved and loaded window chunk by window chunk), with sessions
// and as plain requests, in RAM and on disk.
func TestSpilledTurnsEqualPrefill(t *testing.T) {
	for _, c := range []struct {
		where   string
		session bool
	}{{"ram", true}, {"ram", false}, {"disk", true}} {
		where, session := c.where, c.session
		{
			t.Run(fmt.Sprintf("%s/session=%v", where, session), func(t *testing.T) {
				cfg := withDefaults(Config{NCtx: 2048, Parallel: 1, MaxPools: 2, TierChunk: 64, PoolGrace: time.Nanosecond})
				if where == "disk" {
					cfg.PoolRAMMB, cfg.PoolDir = 0, t.TempDir()
				}
				forEachModel(t, cfg, func(t *testing.T, cfg Config) {
					checkSpilledTurns(t, cfg, session, func(a *App, agent, turn, n int) []int32 {
						text := fmt.Sprintf(" Agent %d, step %d: the tool returned rows %d to %d of the ledger.", agent, turn, turn*7, turn*7+n)
						if turn == 0 {
							return tokenize(t, a, longSystem(t, a, n)+text)
						}
						return suffixTokens(t, a, text)
					})
				})
			})
		}
	}
}

// TestSpilledTurnsArchs: on models with recurrent state (Qwen3.5's and LFM2's hybrid
// layers) a displaced session spills whole with its state and its next turn loads it
// back; on Gemma 4 (interleaved window, shared KV layers) segments are window chunks.
// Random weights; greedy tokens and logprobs equal a cold prefill's. Gemma 4 runs as
// its Q4_1 test model: the F32 one's matrix products depend on the batch a token was
// computed in (a decoded reply against a cold prefill of it: logprobs 5e-6 apart),
// which is ggml's, not the tier's; PolyKV's quantized kernel is batch-invariant.
func TestSpilledTurnsArchs(t *testing.T) {
	for _, arch := range []string{"qwen35", "lfm2", "gemma4q"} {
		t.Run(arch, func(t *testing.T) {
			cfg := withDefaults(Config{ModelPath: testmodel.Arch(t, arch), NCtx: 1024, Parallel: 1, MaxPools: 2, Threads: 2, TierChunk: 32})
			checkSpilledTurns(t, cfg, true, func(a *App, agent, turn, n int) []int32 {
				return archTokens(a, uint64(100*agent+turn+1), n)
			})
		})
	}
}

// TestPinnedPoolPagedServed: issue 40's pinned-pool shape on the real model. A pinned
// pool fills most of a small cache and nothing runs; a plain request that needs more
// cells than are free is served at once (the pool is paged to the RAM tier, kept there),
// and the pool's next attach restores it with a cold prefill's output.
func TestPinnedPoolPagedServed(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 1024, Parallel: 2, MaxPools: 2, PoolGrace: time.Nanosecond, QueueTimeout: 30 * time.Second})
	prefix := tokenize(t, a, longSystem(t, a, 520))
	id := num(createPool(t, base, map[string]any{"tokens": prefix})["pool_id"])
	if code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/pin", base, id), map[string]any{}); code != 200 {
		t.Fatalf("pin: %d %v", code, out)
	}
	// Nothing in common with the pool, so the prefix cache cannot borrow its cells.
	other := tokenize(t, a, strings.Repeat(" Zebra crossing number seven, then the harbour lights.", 50))
	if len(other) < 1024-len(prefix) {
		t.Fatalf("the request's %d tokens fit beside the %d-token pool", len(other), len(prefix))
	}
	// Served (the engine's TestPinnedPoolPagedForARequest shows it starts within one
	// step; timings are the benchmark's, not a test's).
	if got := agentTurn(t, base, other, "", 4); len(got.ids) != 4 {
		t.Fatalf("a request beside a pinned pool gave %d tokens", len(got.ids))
	}
	info := poolEntry(t, base, id)
	if info.Residency != "ram" || !info.Pinned {
		t.Fatalf("pinned pool after the request: residency %q pinned %v, want paged to ram", info.Residency, info.Pinned)
	}
	checkRestored(t, base, "paged pinned pool", id, prefix, suffixTokens(t, a, " Question: what next? Answer:"))
}
