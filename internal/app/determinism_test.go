package app

// Determinism under traffic: a greedy request must return the same tokens and logprobs
// whatever other clients do beside it. The noise here is what frees KV cells while the
// request decodes (streams cancelled after 0, 1 or 3 chunks; pools created, forked,
// attached, evicted and released), because freed cells are where placement used to go
// wrong. POLYKV_DET_ROUNDS sets the rounds (one unpooled and one pooled request each)
// per kind of noise: default 1, cheap enough for make test (before the fix every run
// differed); POLYKV_DET_NOISE=streams or =pools runs one kind only; POLYKV_DET_MODEL=gemma3
// runs it on Gemma 3 270M (sliding-window layers, shadow sequences) instead of SmolLM2.
// Longer counts:
//
//	POLYKV_DET_ROUNDS=100 POLYKV_DET_NOISE=pools go test ./internal/app -run TestGreedyUnderTraffic -count=1 -v -timeout 0

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// greedyRun is one greedy completion's token ids and logprobs.
type greedyRun struct {
	ids []int
	lps []float64
}

func (r greedyRun) equal(o greedyRun) bool {
	return slices.Equal(r.ids, o.ids) && slices.Equal(r.lps, o.lps)
}

// greedyRunOf completes prompt greedily: attached to a pool (poolID > 0), from the
// prefix cache (poolID < 0: whatever resident sequence holds the longest prefix), or
// cold (0: the whole prompt prefilled).
func greedyRunOf(t testing.TB, base string, prompt []int32, poolID, n int) greedyRun {
	t.Helper()
	body := map[string]any{"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "ignore_eos": true}
	switch {
	case poolID > 0:
		body["pool_id"] = poolID
	case poolID == 0:
		body["cache_prompt"] = false
	}
	code, out := post(t, base+"/v1/completions", body)
	if code != 200 {
		t.Fatalf("completion: %d %v", code, out)
	}
	lp := out["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)
	var r greedyRun
	for _, v := range lp["token_ids"].([]any) {
		r.ids = append(r.ids, num(v))
	}
	for _, v := range lp["token_logprobs"].([]any) {
		r.lps = append(r.lps, v.(float64))
	}
	return r
}

// streamAndCancel opens a streaming completion and drops the connection after k data
// chunks (k = 0: as soon as the headers arrive, i.e. once the task runs).
func streamAndCancel(base string, prompt string, k int) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": 64, "stream": true, "temperature": 0, "ignore_eos": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", base+"/v1/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return nil // 503 when the queue is full is fine noise
	}
	rd := bufio.NewReader(resp.Body)
	for got := 0; got < k; {
		line, err := rd.ReadString('\n')
		if err != nil {
			return nil
		}
		if strings.HasPrefix(line, "data: ") {
			got++
		}
	}
	return nil
}

func deleteReq(base, path string) {
	req, _ := http.NewRequest("DELETE", base+path, nil)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
	}
}

// poolChurn creates a root, forks it, attaches a short request to the child, evicts
// and releases both: every step allocates or frees cells.
func poolChurn(t testing.TB, base string, rng *rand.Rand) {
	words := strings.Fields("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma")
	var b strings.Builder
	for range 20 + rng.IntN(60) {
		b.WriteString(words[rng.IntN(len(words))] + " ")
	}
	code, root := post(t, base+"/polykv/pools", map[string]any{"prompt": b.String()})
	if code != 201 {
		return // 503 while all pool ids are taken is fine noise
	}
	id := num(root["pool_id"])
	var info struct {
		Tokens []int `json:"tokens"`
	}
	get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
	d := len(info.Tokens) / 2
	child := append(slices.Clone(info.Tokens[:d]), info.Tokens[len(info.Tokens)-5:]...)
	code, fork := post(t, fmt.Sprintf("%s/polykv/pools/%d/fork", base, id), map[string]any{"branch_pos": d, "tokens": child})
	if code == 201 {
		cid := num(fork["pool_id"])
		post(t, base+"/v1/completions", map[string]any{"prompt": append(slices.Clone(child), info.Tokens[1:9]...), "pool_id": cid, "max_tokens": 1 + rng.IntN(6)})
		post(t, fmt.Sprintf("%s/polykv/pools/%d/evict", base, cid), map[string]any{})
		deleteReq(base, fmt.Sprintf("/polykv/pools/%d", cid))
	}
	post(t, base+"/v1/completions", map[string]any{"prompt": info.Tokens, "pool_id": id, "max_tokens": 1 + rng.IntN(4)})
	deleteReq(base, fmt.Sprintf("/polykv/pools/%d", id))
}

func TestGreedyUnderTraffic(t *testing.T) {
	rounds := 1
	if v, err := strconv.Atoi(os.Getenv("POLYKV_DET_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	cfg := Config{NCtx: 2048, Parallel: 6, MaxPools: 6, PoolGrace: time.Nanosecond}
	switch m := os.Getenv("POLYKV_DET_MODEL"); m {
	case "", "smollm2":
		cfg.ModelPath = modelPath(t)
	case "gemma3":
		cfg.ModelPath, cfg.ChatTemplate = gemmaPath(t), "gemma"
	default:
		t.Fatalf("POLYKV_DET_MODEL=%q: want smollm2 or gemma3", m)
	}
	t.Logf("model: %s", filepath.Base(cfg.ModelPath))
	a, base := startServer(t, cfg)
	prefix := tokenize(t, a, longSystem(t, a, 160))
	pool := num(createPool(t, base, map[string]any{"tokens": prefix, "pin": true})["pool_id"])
	prompt := append(slices.Clone(prefix), suffixTokens(t, a, " Question: which tool answers topic 21 best, and why? Answer:")...)
	const n = 16
	quiet := greedyRunOf(t, base, prompt, 0, n)
	if got := greedyRunOf(t, base, prompt, pool, n); !got.equal(quiet) {
		t.Fatalf("quiet server: pooled %v differs from unpooled %v", got.ids, quiet.ids)
	}

	noises := []struct {
		name string
		run  func(rng *rand.Rand)
	}{
		{"streams: cancelled after 0/1/3 chunks", func(rng *rand.Rand) {
			p := otherPrompts[rng.IntN(len(otherPrompts))] + strings.Repeat(" and then", rng.IntN(40))
			if err := streamAndCancel(base, p, []int{0, 1, 3}[rng.IntN(3)]); err != nil {
				t.Error(err)
			}
		}},
		{"pools: created, forked, attached, evicted, released", func(rng *rand.Rand) { poolChurn(t, base, rng) }},
	}
	for _, noise := range noises {
		if only := os.Getenv("POLYKV_DET_NOISE"); only != "" && !strings.HasPrefix(noise.name, only) {
			continue
		}
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var ops atomic.Int64
		for w := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(w), 10))
				for {
					select {
					case <-stop:
						return
					default:
					}
					noise.run(rng)
					ops.Add(1)
				}
			}()
		}
		differ := map[string]int{}
		var first string
		// Three kinds: cold, attached to the pool, and from the prefix cache (which the
		// noise keeps warm with many cached sequences).
		for r := range 3 * rounds {
			kind, id := "unpooled", 0
			switch r % 3 {
			case 1:
				kind, id = "pooled", pool
			case 2:
				kind, id = "cached", -1
			}
			t0 := time.Now()
			got := greedyRunOf(t, base, prompt, id, n)
			if testing.Verbose() {
				t.Logf("%s %s run %d: %v, equal %v", noise.name, kind, r/3, time.Since(t0).Round(time.Millisecond), got.equal(quiet))
			}
			if !got.equal(quiet) {
				differ[kind]++
				if first == "" {
					first = fmt.Sprintf("%s run %d: %v (logprobs %v), quiet %v (logprobs %v)", kind, r/3, got.ids, got.lps, quiet.ids, quiet.lps)
				}
			}
		}
		close(stop)
		wg.Wait()
		t.Logf("%s (%d noise operations): %d of %d unpooled, %d of %d pooled and %d of %d cached runs differ from the quiet result",
			noise.name, ops.Load(), differ["unpooled"], rounds, differ["pooled"], rounds, differ["cached"], rounds)
		if first != "" {
			t.Errorf("%s: greedy output depends on other traffic; first: %s", noise.name, first)
		}
	}
}
