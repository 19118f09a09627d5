package app

// Architectures with no small real model here, on tiny random-weight models that
// make testmodels writes (llama.cpp's own test-llama-archs; Gemma 4 by
// scripts/gemma4-testmodel.cpp): Qwen3.5 (gated delta-net layers + attention), LFM2
// (short convolutions + attention) and Granite hybrid (Mamba 2 + attention) — this
// year's hybrid families —, Gemma 4 (interleaved sliding-window and full attention, two
// head sizes, per-layer embeddings) and llama as the plain-attention control.
// Their outputs are noise, but it is the noise each architecture's real graph computes,
// so loading, batching, pools and determinism under traffic are checked on it.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/polykv/polykv/internal/runner"
	"github.com/polykv/polykv/internal/testmodel"
)

// archTokens is n token ids drawn with a fixed seed from the model's vocabulary, past
// its first few ids (the random-weight models' vocabulary has no special tokens, but the
// low ids are where llama.cpp's test tokenizer puts its markers).
func archTokens(a *App, seed uint64, n int) []int32 {
	r := rand.New(rand.NewPCG(seed, 7))
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(4 + r.IntN(a.Model.NVocab()-4))
	}
	return out
}

// TestArchsPoolsAndTraffic: on each architecture, pooled == fully prefilled (tokens and
// logprobs, on the pool, its extend child and a boundary branch), a session's turns, and
// the same answers under other traffic compared with a quiet server's run; another
// prefix must change the answer, so none of this holds by the model ignoring it.
func TestArchsPoolsAndTraffic(t *testing.T) {
	for _, arch := range []string{"qwen35", "lfm2", "granitehybrid", "gemma4", "llama"} {
		t.Run(arch, func(t *testing.T) {
			a, base := startServer(t, Config{ModelPath: testmodel.Arch(t, arch), NCtx: 2048, Parallel: 4, MaxPools: 4, Threads: 2})
			recurrent := a.Model.IsRecurrent() || a.Model.IsHybrid()
			if want := arch != "llama" && arch != "gemma4"; recurrent != want {
				t.Fatalf("%s: recurrent or hybrid = %v, want %v", arch, recurrent, want)
			}
			// Gemma 4 loads with its interleaved sliding window (32 positions in the test
			// model): the prompts below go past it, so pools rely on the SWA anchors.
			if got := a.Model.Meta("general.architecture"); got != arch || (arch == "gemma4" && a.Model.NSWA() != 32) {
				t.Fatalf("loaded as %q with a %d-position window", got, a.Model.NSWA())
			}
			if pol := runner.ModelPolicy(a.Model); arch == "gemma4" && (pol.SWA != 32 || !pol.Anchors || pol.Recurrent || pol.TierOff() != "") {
				t.Fatalf("Gemma 4's policy %+v (tier: %q): want SWA anchors for its window, no recurrent rules, the tier on", pol, pol.TierOff())
			}
			rootToks := archTokens(a, 1, 120)
			L := len(rootToks)
			root := num(createPool(t, base, map[string]any{"tokens": rootToks})["pool_id"])
			ext := append(slices.Clone(rootToks), archTokens(a, 2, 30)...)
			code, out := forkPool(t, base, root, L, map[string]any{"tokens": ext})
			if code != 201 {
				t.Fatalf("extend fork at L: %d %v", code, out)
			}
			child := num(out["pool_id"])

			// Pooled == unpooled greedy, tokens and logprobs, on the pool and on its extend
			// child. quiet is the root's answer on an otherwise idle server: the reference
			// for the runs under traffic below.
			question := archTokens(a, 3, 9)
			var quiet greedyRun
			for _, c := range []struct {
				name   string
				pool   int
				prefix []int32
			}{{"root", root, rootToks}, {"extend", child, ext}} {
				prompt := append(slices.Clone(c.prefix), question...)
				want := archRun(t, base, prompt, 0, 12)
				got, cacheN := archRunN(t, base, prompt, c.pool, 12)
				if cacheN != len(c.prefix) || !got.equal(want) {
					t.Fatalf("%s: cache_n %d (want %d), pooled %v %v, fully prefilled %v %v", c.name, cacheN, len(c.prefix), got.ids, got.lps, want.ids, want.lps)
				}
				if c.name == "root" {
					quiet = want
				}
			}
			// The answer depends on the prefix, so the equalities above and below cannot hold
			// by the model ignoring it: another root of the same length, the same question,
			// gives another continuation. On these random-weight models the greedy tokens
			// follow the question's last tokens (4 of the 5 give the same 12 tokens), but
			// the logprobs move (by ~1e-4), and every check here compares them bit for bit.
			other := archRun(t, base, append(archTokens(a, 9, L), question...), 0, 12)
			moved := lpDist(other, quiet)
			if other.equal(quiet) || moved < 10*archTrafficTol {
				t.Fatalf("another prefix gives the continuation %v, logprobs %v, within %.2g of this prefix's: the model ignores its prefix (or the traffic bound below, %g, is too loose to tell)", other.ids, other.lps, moved, archTrafficTol)
			}

			// A branch inside the pool: fine with attention only, a 409 naming the reason
			// on a model with recurrent state; a branch at a pool boundary works on both.
			branch := append(slices.Clone(rootToks[:L/2]), archTokens(a, 4, 10)...)
			code, out = forkPool(t, base, root, L/2, map[string]any{"tokens": branch})
			switch {
			case recurrent && (code != 409 || !strings.Contains(fmt.Sprint(out), "recurrent state")):
				t.Fatalf("branch below L on a recurrent model: %d %v, want 409 naming recurrent state", code, out)
			case !recurrent && code != 201:
				t.Fatalf("branch below L: %d %v", code, out)
			}
			atBoundary := append(slices.Clone(rootToks), archTokens(a, 5, 10)...)
			code, out = forkPool(t, base, child, L, map[string]any{"tokens": atBoundary})
			if code != 201 {
				t.Fatalf("branch of the child at its parent's boundary %d: %d %v", L, code, out)
			}
			prompt := append(slices.Clone(atBoundary), question...)
			want := archRun(t, base, prompt, 0, 12)
			got, cacheN := archRunN(t, base, prompt, num(out["pool_id"]), 12)
			if cacheN != len(atBoundary) || !got.equal(want) {
				t.Fatalf("boundary branch: cache_n %d (want %d), pooled %v %v, fully prefilled %v %v", cacheN, len(atBoundary), got.ids, got.lps, want.ids, want.lps)
			}

			// A session's second turn extends the first one's whole context: kept whole.
			turn1 := append(slices.Clone(rootToks), archTokens(a, 6, 5)...)
			first, _ := sessionTurn(t, base, "s1", turn1, root, 6)
			checkMemoryBytes(t, a, base, root, "s1", recurrent)
			held := len(turn1) + 5 // the last token sampled is not decoded
			turn2 := slices.Clone(turn1)
			for _, id := range first.ids[:5] {
				turn2 = append(turn2, int32(id))
			}
			turn2 = append(turn2, archTokens(a, 7, 4)...)
			wantT2 := archRun(t, base, turn2, 0, 6)
			gotT2, cacheN := sessionTurn(t, base, "s1", turn2, 0, 6)
			if cacheN != held || !gotT2.equal(wantT2) {
				t.Fatalf("session turn 2: cache_n %d (want %d), %v, fully prefilled %v", cacheN, held, gotT2, wantT2)
			}
			// A third turn that rewrites the second: on a recurrent model the session
			// starts over from its pool's boundary (its state cannot be cut back).
			turn3 := append(slices.Clone(turn1), archTokens(a, 8, 4)...)
			wantT3 := archRun(t, base, turn3, 0, 6)
			gotT3, cacheN := sessionTurn(t, base, "s1", turn3, 0, 6)
			wantCache := len(turn1) // what turn 3 shares with the session's context
			if recurrent {
				wantCache = L
			}
			if cacheN != wantCache || !gotT3.equal(wantT3) {
				t.Fatalf("session turn 3: cache_n %d (want %d), %v, fully prefilled %v", cacheN, wantCache, gotT3, wantT3)
			}

			// Determinism under traffic: the pooled and unpooled answers again, each while
			// three other requests (pooled and not, different lengths) run beside it, equal
			// to the quiet server's answer: the tokens exactly, the logprobs within
			// archTrafficTol (and far closer than another prefix puts them).
			worst := 0.0
			for round := range 3 {
				var wg sync.WaitGroup
				for k := range 3 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						noise := archTokens(a, uint64(100+10*round+k), 20+15*k)
						p := 0
						if k == 1 {
							noise, p = append(slices.Clone(rootToks), noise...), root
						}
						body := map[string]any{"prompt": noise, "max_tokens": 10 + 5*k, "temperature": 0, "ignore_eos": true}
						if p > 0 {
							body["pool_id"] = p
						}
						if code, out := post(t, base+"/v1/completions", body); code != http.StatusOK {
							t.Errorf("noise %d: %d %v", k, code, out)
						}
					}()
				}
				prompt := append(slices.Clone(rootToks), question...)
				cold := archRun(t, base, prompt, 0, 12)
				pooled := archRun(t, base, prompt, root, 12)
				wg.Wait()
				d := max(lpDist(cold, quiet), lpDist(pooled, quiet))
				worst = max(worst, d)
				if !slices.Equal(cold.ids, quiet.ids) || !slices.Equal(pooled.ids, quiet.ids) || d > archTrafficTol {
					t.Fatalf("round %d: under traffic unpooled %v %v, pooled %v %v; on a quiet server %v %v (logprobs apart by %.2g)", round, cold.ids, cold.lps, pooled.ids, pooled.lps, quiet.ids, quiet.lps, d)
				}
			}
			t.Logf("under traffic: the quiet server's tokens, logprobs within %.2g of its (bound %g); another prefix moved them by %.2g", worst, archTrafficTol, moved)
		})
	}
}

// archTrafficTol bounds how far a random-weight model's logprobs under other traffic may
// be from the quiet server's. Not 0: these models' f16/f32 weight products run ggml's own
// matrix kernels (PolyKV's covers the Q4_1 and K-quant weights of served models), and the
// recurrent layers llama.cpp's, neither batch-invariant: a decode step batched with other
// requests moves logprobs by up to ~5e-7 (measured: llama 5e-7, qwen35 3e-7; tokens
// equal). Another prefix of the same length moves them by 4e-5 to 5e-4 (checked above
// to be at least 10× this bound), so a pool or session that lost or mixed up its prefix
// still fails.
const archTrafficTol = 2e-6

// lpDist is the largest difference between two runs' logprobs, step by step.
func lpDist(a, b greedyRun) float64 {
	d := 0.0
	for i := range min(len(a.lps), len(b.lps)) {
		d = max(d, math.Abs(a.lps[i]-b.lps[i]))
	}
	return d
}

// archRun completes prompt greedily with logprobs, attached to pool when > 0, else
// fully prefilled.
func archRun(t *testing.T, base string, prompt []int32, pool, n int) greedyRun {
	t.Helper()
	r, _ := archRunN(t, base, prompt, pool, n)
	return r
}

// archRunN is archRun with the cache_n the server reported.
func archRunN(t *testing.T, base string, prompt []int32, pool, n int) (greedyRun, int) {
	t.Helper()
	ids, lps, cacheN := greedyLogprobs(t, base, prompt, pool, n)
	return greedyRun{ids: ids, lps: lps}, cacheN
}

// sessionTurn runs one greedy completion turn of session id (on pool when > 0) and
// returns the generated tokens with their logprobs and the cache_n the server reported.
func sessionTurn(t *testing.T, base, id string, prompt []int32, pool, n int) (greedyRun, int) {
	t.Helper()
	body := map[string]any{"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "ignore_eos": true, "session_id": id}
	if pool > 0 {
		body["pool_id"] = pool
	}
	ids, lps, cacheN := completionLogprobs(t, base, body)
	return greedyRun{ids: ids, lps: lps}, cacheN
}

// checkMemoryBytes checks the bytes /polykv/pools and /slots report while session id is
// attached to pool: KV bytes are cells × llama.cpp's bytes per cell (per layer: a
// hybrid's recurrent layers hold none), and the recurrent state — one copy per sequence,
// the pool's at its boundary and the session's own — is counted beside them, on a model
// with recurrent layers only.
func checkMemoryBytes(t *testing.T, a *App, base string, pool int, id string, recurrent bool) {
	t.Helper()
	var st struct {
		Pools []struct {
			PoolID     int   `json:"pool_id"`
			OwnLen     int   `json:"own_len"`
			OwnKVBytes int64 `json:"own_kv_bytes"`
			Recurrent  int64 `json:"recurrent_state_bytes"`
			Sessions   []struct {
				SessionID string `json:"session_id"`
				Recurrent int64  `json:"recurrent_state_bytes"`
			} `json:"sessions"`
		} `json:"pools"`
		BytesPerCell int64 `json:"kv_bytes_per_cell"`
		PerSeq       int64 `json:"recurrent_state_bytes_per_seq"`
	}
	get(t, base+"/polykv/pools", &st)
	perSeq := a.Ctx.RecurrentBytesPerSeq()
	if st.BytesPerCell != a.Model.KVBytesPerCell() || st.PerSeq != perSeq || (perSeq > 0) != recurrent {
		t.Fatalf("kv_bytes_per_cell %d (model %d), recurrent_state_bytes_per_seq %d (context %d), recurrent %v",
			st.BytesPerCell, a.Model.KVBytesPerCell(), st.PerSeq, perSeq, recurrent)
	}
	found := false
	for _, p := range st.Pools {
		if p.OwnKVBytes != int64(p.OwnLen)*st.BytesPerCell || p.Recurrent != perSeq {
			t.Fatalf("pool %d: own_kv_bytes %d for %d cells, recurrent_state_bytes %d (want %d)", p.PoolID, p.OwnKVBytes, p.OwnLen, p.Recurrent, perSeq)
		}
		for _, s := range p.Sessions {
			if p.PoolID == pool && s.SessionID == id {
				found = true
				if s.Recurrent != perSeq {
					t.Fatalf("pool %d session %s: recurrent_state_bytes %d, want %d", pool, id, s.Recurrent, perSeq)
				}
			}
		}
	}
	var slots []struct {
		SessionID  string `json:"session_id"`
		NOwnCells  int    `json:"n_own_cells"`
		OwnKVBytes int64  `json:"own_kv_bytes"`
		Recurrent  int64  `json:"recurrent_state_bytes"`
	}
	get(t, base+"/slots", &slots)
	for _, sl := range slots {
		if sl.SessionID == id {
			found = found && sl.OwnKVBytes == int64(sl.NOwnCells)*st.BytesPerCell && sl.NOwnCells > 0 && sl.Recurrent == perSeq
			if !found {
				t.Fatalf("slot of %s: %d own cells, own_kv_bytes %d, recurrent_state_bytes %d (want %d)", id, sl.NOwnCells, sl.OwnKVBytes, sl.Recurrent, perSeq)
			}
			return
		}
	}
	t.Fatalf("session %s not found attached to pool %d in /polykv/pools and /slots", id, pool)
}
