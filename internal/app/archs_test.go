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

			// Pooled == unpooled greedy, on the pool and on its extend child.
			question := archTokens(a, 3, 9)
			for _, c := range []struct {
				name   string
				pool   int
				prefix []int32
			}{{"root", root, rootToks}, {"extend", child, ext}} {
				prompt := append(slices.Clone(c.prefix), question...)
				want, _ := greedyTokens(t, base, prompt, 0, 12)
				got, cacheN := greedyTokens(t, base, prompt, c.pool, 12)
				if cacheN != len(c.prefix) || !slices.Equal(got, want) {
					t.Fatalf("%s: cache_n %d (want %d), pooled %v, fully prefilled %v", c.name, cacheN, len(c.prefix), got, want)
				}
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
			want, _ := greedyTokens(t, base, prompt, 0, 12)
			got, cacheN := greedyTokens(t, base, prompt, num(out["pool_id"]), 12)
			if cacheN != len(atBoundary) || !slices.Equal(got, want) {
				t.Fatalf("boundary branch: cache_n %d (want %d), pooled %v, fully prefilled %v", cacheN, len(atBoundary), got, want)
			}

			// A session's second turn extends the first one's whole context: kept whole.
			turn1 := append(slices.Clone(rootToks), archTokens(a, 6, 5)...)
			first, _ := sessionTurn(t, base, "s1", turn1, root, 6)
			checkMemoryBytes(t, a, base, root, "s1", recurrent)
			held := len(turn1) + 5 // the last token sampled is not decoded
			turn2 := slices.Clone(turn1)
			for _, id := range first[:5] {
				turn2 = append(turn2, int32(id))
			}
			turn2 = append(turn2, archTokens(a, 7, 4)...)
			wantT2, _ := greedyTokens(t, base, turn2, 0, 6)
			gotT2, cacheN := sessionTurn(t, base, "s1", turn2, 0, 6)
			if cacheN != held || !slices.Equal(gotT2, wantT2) {
				t.Fatalf("session turn 2: cache_n %d (want %d), %v, fully prefilled %v", cacheN, held, gotT2, wantT2)
			}
			// A third turn that rewrites the second: on a recurrent model the session
			// starts over from its pool's boundary (its state cannot be cut back).
			turn3 := append(slices.Clone(turn1), archTokens(a, 8, 4)...)
			wantT3, _ := greedyTokens(t, base, turn3, 0, 6)
			gotT3, cacheN := sessionTurn(t, base, "s1", turn3, 0, 6)
			wantCache := len(turn1) // what turn 3 shares with the session's context
			if recurrent {
				wantCache = L
			}
			if cacheN != wantCache || !slices.Equal(gotT3, wantT3) {
				t.Fatalf("session turn 3: cache_n %d (want %d), %v, fully prefilled %v", cacheN, wantCache, gotT3, wantT3)
			}

			// Determinism under traffic: the pooled and unpooled answers again, each while
			// three other requests (pooled and not, different lengths) run beside it.
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
				wantAlone, _ := greedyTokens(t, base, prompt, 0, 12)
				got, _ := greedyTokens(t, base, prompt, root, 12)
				wg.Wait()
				if !slices.Equal(got, wantAlone) {
					t.Fatalf("round %d: pooled under traffic %v, unpooled %v", round, got, wantAlone)
				}
			}
		})
	}
}

// sessionTurn runs one greedy completion turn of session id (on pool when > 0) and
// returns the generated token ids and the cache_n the server reported.
func sessionTurn(t *testing.T, base, id string, prompt []int32, pool, n int) ([]int, int) {
	t.Helper()
	body := map[string]any{"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "ignore_eos": true, "session_id": id}
	if pool > 0 {
		body["pool_id"] = pool
	}
	code, out := post(t, base+"/v1/completions", body)
	if code != http.StatusOK {
		t.Fatalf("session %s: %d %v", id, code, out)
	}
	var ids []int
	for _, v := range out["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)["token_ids"].([]any) {
		ids = append(ids, num(v))
	}
	return ids, num(out["timings"].(map[string]any)["cache_n"])
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
