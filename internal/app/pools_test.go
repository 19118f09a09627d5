package app

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

// longSystem builds a system prompt of at least n tokens (tool descriptions, as an
// agent framework would send).
func longSystem(t testing.TB, a *App, n int) string {
	var b strings.Builder
	b.WriteString("You are the main agent of a research team. You may call these tools:\n")
	for i := 0; ; i++ {
		fmt.Fprintf(&b, "Tool %d: search_%d(query: string, limit: int) returns documents about topic %d, ranked by relevance.\n", i, i, i*7)
		toks, err := a.Model.Tokenize(b.String(), true, true)
		if err != nil {
			t.Fatal(err)
		}
		if len(toks) >= n {
			return b.String()
		}
	}
}

func tokenize(t testing.TB, a *App, text string) []int32 {
	toks, err := a.Model.Tokenize(text, true, true)
	if err != nil {
		t.Fatal(err)
	}
	return toks
}

func createPool(t testing.TB, base string, body map[string]any) map[string]any {
	t.Helper()
	code, out := post(t, base+"/polykv/pools", body)
	if code != 201 {
		t.Fatalf("create pool: %d %v", code, out)
	}
	return out
}

func num(v any) int { return int(v.(float64)) }

// greedyTokens completes prompt tokens greedily, optionally attached to a pool, and
// returns the generated token ids and the cache_n the server reported. Without a pool
// it is a cold reference: the whole prompt is prefilled (cache_prompt false), never
// started from a prefix the prefix cache holds.
func greedyTokens(t testing.TB, base string, prompt []int32, poolID int, n int) ([]int, int) {
	t.Helper()
	ids, _, cacheN := greedyLogprobs(t, base, prompt, poolID, n)
	return ids, cacheN
}

// probeFreeCells asks llama.cpp itself how many cells are free: exactly free cells
// must fit, one more must not.
func probeFreeCells(t testing.TB, a *App, seq, free int) {
	t.Helper()
	ctx := context.Background()
	fits, err1 := a.Engine.Probe(ctx, engine.ProbeFits{Seq: seq, N: free, Tok: 1})
	over, err2 := a.Engine.Probe(ctx, engine.ProbeFits{Seq: seq, N: free + 1, Tok: 1})
	if err1 != nil || err2 != nil {
		t.Fatalf("probe: %v %v", err1, err2)
	}
	if !fits || over {
		t.Fatalf("llama.cpp disagrees with the accounting: %d free cells fit=%v, %d fit=%v", free, fits, free+1, over)
	}
}

func TestZeroCopyProofByCapacity(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 4096, Parallel: 9, MaxPools: 4})
	system := longSystem(t, a, 3000)
	root := createPool(t, base, map[string]any{"prompt": system})
	L := num(root["prefix_len"])
	if L < 3000 || L > 3100 {
		t.Fatalf("root prefix %d tokens", L)
	}
	id := num(root["pool_id"])
	var wg sync.WaitGroup
	results := make([]map[string]any, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			suffix := strings.Repeat(fmt.Sprintf(" Agent %d investigates question %d.", i, i), 6)
			code, out := post(t, base+"/v1/completions", map[string]any{
				"prompt": system + suffix, "pool_id": id, "session_id": fmt.Sprintf("agent-%d", i),
				"max_tokens": 32, "ignore_eos": true, "temperature": 0,
			})
			if code != 200 {
				t.Errorf("agent %d: %d %v", i, code, out)
				return
			}
			results[i] = out
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	suffixCells := 0
	for i, out := range results {
		tm := out["timings"].(map[string]any)
		if num(tm["cache_n"]) < L-1 || num(tm["predicted_n"]) != 32 || out["truncated"] != nil {
			t.Fatalf("agent %d: timings %v truncated %v", i, tm, out["truncated"])
		}
		suffixCells += num(tm["prompt_n"]) + 31 // its prompt suffix plus the decoded tokens (the last is not stored)
	}
	// 8 private copies would need 8 × 3000+ cells; the cache has 4096.
	if 8*L < 4096 {
		t.Fatal("the workload would fit without sharing; it proves nothing")
	}
	var st wire.PoolsStatus
	get(t, base+"/polykv/pools", &st)
	var own int64
	for _, p := range st.Pools {
		own += p.OwnKVBytes
		for _, s := range p.Sessions {
			own += s.MarginalKVBytes
		}
	}
	cells := int(own / st.KVBytesPerCell)
	if cells != st.KVCellsUsed || cells != L+suffixCells {
		t.Fatalf("Σ own = %d cells, accounting says %d used, expected %d", cells, st.KVCellsUsed, L+suffixCells)
	}
	if st.KVBytesPerCell != 30*3*(64+64)*2 {
		t.Fatalf("bytes per cell %d, SmolLM2-135M has 30 layers × 3 KV heads × (64+64) × f16", st.KVBytesPerCell)
	}
	// The physical cache agrees: exactly the rest of the cells are free.
	probeFreeCells(t, a, 8, 4096-cells)
}

func forkPool(t testing.TB, base string, parent, d int, body map[string]any) (int, map[string]any) {
	t.Helper()
	body["branch_pos"] = d
	code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/fork", base, parent), body)
	return code, out
}

func suffixTokens(t testing.TB, a *App, text string) []int32 {
	toks, err := a.Model.Tokenize(text, false, true)
	if err != nil {
		t.Fatal(err)
	}
	return toks
}

func TestPooledMatchesUnpooled(t *testing.T) {
	forEachModel(t, Config{NCtx: 4096, Parallel: 4, MaxPools: 4}, func(t *testing.T, cfg Config) {
		a, base := startServer(t, cfg)
		rootToks := tokenize(t, a, longSystem(t, a, 300))
		root := num(createPool(t, base, map[string]any{"tokens": rootToks})["pool_id"])
		extToks := append(slices.Clone(rootToks), suffixTokens(t, a, " Task: summarise the findings on topic 14.")...)
		code, out := forkPool(t, base, root, len(rootToks), map[string]any{"tokens": extToks})
		if code != 201 {
			t.Fatalf("extend: %d %v", code, out)
		}
		ext := num(out["pool_id"])
		d := len(rootToks) / 2
		branchToks := append(slices.Clone(rootToks[:d]), suffixTokens(t, a, " A different toolset: calculator(expression: string).")...)
		code, out = forkPool(t, base, root, d, map[string]any{"tokens": branchToks})
		if code != 201 {
			t.Fatalf("branch: %d %v", code, out)
		}
		branch := num(out["pool_id"])
		question := suffixTokens(t, a, " Question: what should the team do first? Answer:")
		for _, c := range []struct {
			name   string
			pool   int
			prefix []int32
		}{{"root", root, rootToks}, {"extend child", ext, extToks}, {"branch child", branch, branchToks}} {
			prompt := append(slices.Clone(c.prefix), question...)
			want, cache0 := greedyTokens(t, base, prompt, 0, 24)
			got, cacheN := greedyTokens(t, base, prompt, c.pool, 24)
			if cache0 != 0 || cacheN != len(c.prefix) {
				t.Fatalf("%s: cache_n unpooled %d pooled %d, want 0 and %d", c.name, cache0, cacheN, len(c.prefix))
			}
			// Exact greedy equality: on this CPU backend a token's logits do not depend on the
			// batch it was computed in (TestGreedySameAloneAndInABatch measures Δ = 0).
			if !slices.Equal(got, want) {
				t.Fatalf("%s: pooled tokens %v differ from the fully prefilled %v", c.name, got, want)
			}
		}
	})
}

func TestAutoPAndTree(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 2048, Parallel: 2, MaxPools: 3})
	sys := map[string]any{"role": "system", "content": longSystem(t, a, 100)}
	root := createPool(t, base, map[string]any{"messages": []any{sys}})
	id, L := num(root["pool_id"]), num(root["prefix_len"])
	// A chat request with the same system message attaches at the whole prefix.
	code, out := post(t, base+"/v1/chat/completions", map[string]any{
		"pool_id": id, "max_tokens": 4, "temperature": 0,
		"messages": []any{sys, map[string]any{"role": "user", "content": "Pick a tool."}},
	})
	if code != 200 || num(out["timings"].(map[string]any)["cache_n"]) != L || num(out["pool_id"]) != id {
		t.Fatalf("chat attach: %d cache_n %v pool %v, want %d", code, out["timings"], out["pool_id"], L)
	}
	var info wire.PoolInfo
	get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
	if len(info.Tokens) != L {
		t.Fatalf("GET pool returns %d tokens, want %d", len(info.Tokens), L)
	}
	// Diverging at k < L shares exactly k.
	k := L - 20
	diverge := append(slices.Clone(info.Tokens[:k]), suffixTokens(t, a, " something else entirely")...)
	if _, c := greedyTokens(t, base, diverge, id, 2); c != k {
		t.Fatalf("diverging at %d: cache_n %d", k, c)
	}
	// An explicit P beyond the match is refused; within it, honoured.
	code, out = post(t, base+"/v1/completions", map[string]any{"prompt": diverge, "pool_id": id, "shared_prefix_n_tokens": k + 1, "max_tokens": 2})
	if code != 400 {
		t.Fatalf("explicit P past the match: %d %v", code, out)
	}
	code, out = post(t, base+"/v1/completions", map[string]any{"prompt": diverge, "pool_id": id, "shared_prefix_n_tokens": 10, "max_tokens": 2})
	if code != 200 || num(out["timings"].(map[string]any)["cache_n"]) != 10 {
		t.Fatalf("explicit P 10: %d %v", code, out["timings"])
	}
	// Tree: an extend child and a branch child.
	code, ext := forkPool(t, base, id, L, map[string]any{"tokens": append(slices.Clone(info.Tokens), suffixTokens(t, a, " Extra shared context.")...)})
	if code != 201 || num(ext["branch_pos"]) != L || num(ext["parent"]) != id {
		t.Fatalf("extend: %d %v", code, ext)
	}
	code, br := forkPool(t, base, id, 5, map[string]any{"tokens": append(slices.Clone(info.Tokens[:5]), suffixTokens(t, a, " Other tools.")...)})
	if code != 201 || num(br["branch_pos"]) != 5 {
		t.Fatalf("branch: %d %v", code, br)
	}
	get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
	if !slices.Equal(info.Children, []int{num(ext["pool_id"]), num(br["pool_id"])}) || !info.Pinned {
		t.Fatalf("root children %v pinned %v", info.Children, info.Pinned)
	}
	var st wire.PoolsStatus
	get(t, base+"/polykv/pools", &st)
	if st.TreeDepth != 2 || st.SeqIDsMax != 5 || len(st.Pools) != 3 {
		t.Fatalf("status %+v", st)
	}
	// One pool and the list's entries use the same field names.
	var one map[string]any
	var list struct{ Pools []map[string]any }
	get(t, fmt.Sprintf("%s/polykv/pools/%d", base, num(ext["pool_id"])), &one)
	get(t, base+"/polykv/pools", &list)
	delete(one, "tokens")
	for _, entry := range list.Pools {
		if num(entry["pool_id"]) != num(ext["pool_id"]) {
			continue
		}
		if !slices.Equal(slices.Sorted(maps.Keys(one)), slices.Sorted(maps.Keys(entry))) {
			t.Fatalf("GET one pool has fields %v, the list's entry %v", slices.Sorted(maps.Keys(one)), slices.Sorted(maps.Keys(entry)))
		}
	}
	if one["tree_depth"] != float64(2) {
		t.Fatalf("child's tree_depth %v, want 2", one["tree_depth"])
	}
	// Contract and ordering violations.
	bad := slices.Clone(info.Tokens[:30])
	bad[17]++
	code, out = forkPool(t, base, id, 30, map[string]any{"tokens": append(bad, 42)})
	if code != 409 || !strings.Contains(out["error"].(map[string]any)["message"].(string), "token 17") {
		t.Fatalf("mismatch: %d %v", code, out)
	}
	for _, d := range []int{-1, L + 1} {
		if code, out := forkPool(t, base, id, d, map[string]any{"tokens": info.Tokens}); code != 400 {
			t.Fatalf("branch_pos %d: %d %v", d, code, out)
		}
	}
	if code, out := post(t, base+"/polykv/pools", map[string]any{"tokens": []int{}}); code != 400 {
		t.Fatalf("empty prefix: %d %v", code, out)
	}
	if code, out := post(t, base+"/polykv/pools", map[string]any{"prompt": "x", "tokens": []int{1}}); code != 400 {
		t.Fatalf("two sources: %d %v", code, out)
	}
	// Seq ids: 3 of 3 pools in use.
	if code, out := post(t, base+"/polykv/pools", map[string]any{"prompt": "one more"}); code != 503 {
		t.Fatalf("pool ids exhausted: %d %v", code, out)
	}
	del := func(p int) (int, map[string]any) {
		req, _ := http.NewRequest("DELETE", fmt.Sprintf("%s/polykv/pools/%d", base, p), nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var m map[string]any
		_ = jsonDecode(resp, &m)
		return resp.StatusCode, m
	}
	if code, out := del(id); code != 409 {
		t.Fatalf("release a parent first: %d %v", code, out)
	}
	if code, _ := del(num(br["pool_id"])); code != 200 {
		t.Fatal("release branch")
	}
	if code, out := post(t, base+"/v1/completions", map[string]any{"prompt": "hi", "pool_id": num(br["pool_id"]), "max_tokens": 2}); code != 404 {
		t.Fatalf("attach to a released pool: %d %v", code, out)
	}
	if code, out := post(t, base+"/v1/completions", map[string]any{"prompt": "hi", "pool_id": 999, "max_tokens": 2}); code != 404 {
		t.Fatalf("attach to an unknown pool: %d %v", code, out)
	}
}

func TestFromSessionAndReclaim(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 2048, Parallel: 2, MaxPools: 2, PoolGrace: 1})
	msgs := []any{map[string]any{"role": "system", "content": "You plan work for sub-agents."}, map[string]any{"role": "user", "content": "Plan a trip to Rome."}}
	code, out := post(t, base+"/v1/chat/completions", map[string]any{"messages": msgs, "session_id": "main", "max_tokens": 24, "temperature": 0})
	if code != 200 {
		t.Fatalf("main turn: %d %v", code, out)
	}
	var slots []wire.Slot
	get(t, base+"/slots", &slots)
	held := slots[0].NPast
	snap := createPool(t, base, map[string]any{"from_session": "main"})
	if num(snap["prefix_len"]) != held || snap["zero_copy"] != true || num(snap["prefilled_tokens"]) != 0 {
		t.Fatalf("snapshot: %v (session held %d)", snap, held)
	}
	id := num(snap["pool_id"])
	var info wire.PoolInfo
	get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
	// Forking from a session that added nothing past the snapshot would give an empty child.
	if code, out := forkPool(t, base, id, held, map[string]any{"from_session": "main"}); code != 400 {
		t.Fatalf("fork from a session with nothing new: %d %v", code, out)
	}
	// The session, now attached to its snapshot, takes another turn; a fork at the
	// snapshot's end then takes the new cells zero-copy.
	msgs = append(msgs, map[string]any{"role": "assistant", "content": out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"]},
		map[string]any{"role": "user", "content": "Now list museums."})
	code, out = post(t, base+"/v1/chat/completions", map[string]any{"messages": msgs, "session_id": "main", "pool_id": id, "max_tokens": 16, "temperature": 0})
	if code != 200 {
		t.Fatalf("second turn: %d %v", code, out)
	}
	get(t, base+"/slots", &slots)
	code, child := forkPool(t, base, id, held, map[string]any{"from_session": "main"})
	if code != 201 || child["zero_copy"] != true || num(child["prefix_len"]) != slots[0].NPast || num(child["parent"]) != id {
		t.Fatalf("zero-copy fork from the session: %d %v (session holds %d)", code, child, slots[0].NPast)
	}
	// Release the child at once so the pool can be released later.
	reqc, _ := http.NewRequest("DELETE", fmt.Sprintf("%s/polykv/pools/%d", base, num(child["pool_id"])), nil)
	if resp, err := http.DefaultClient.Do(reqc); err != nil || resp.StatusCode != 200 {
		t.Fatalf("release child: %v", err)
	}
	// The source session goes away (another session takes its sequence); the pool stays.
	for i := range 3 {
		post(t, base+"/v1/completions", map[string]any{"prompt": "filler", "session_id": fmt.Sprintf("other-%d", i), "max_tokens": 2})
	}
	get(t, base+"/slots", &slots)
	for _, s := range slots {
		if s.SessionID == "main" {
			t.Fatalf("main still holds a sequence: %v", slots)
		}
	}
	prompt := append(slices.Clone(info.Tokens), suffixTokens(t, a, " Day one:")...)
	want, _ := greedyTokens(t, base, prompt, 0, 12)
	got, cacheN := greedyTokens(t, base, prompt, id, 12)
	if cacheN != held || !slices.Equal(got, want) {
		t.Fatalf("attach after the source session ended: cache_n %d (want %d), tokens equal %v", cacheN, held, slices.Equal(got, want))
	}
	// Release: cells come back once the grace (1 ns here) has passed.
	req, _ := http.NewRequest("DELETE", fmt.Sprintf("%s/polykv/pools/%d", base, id), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("release: %v %v", err, resp.Status)
	}
	resp.Body.Close()
	// The release answers before the engine's next step, which is where the grace is
	// seen to have passed: until then the listing may show the pool as "released".
	var st wire.PoolsStatus
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		st = wire.PoolsStatus{}
		get(t, base+"/polykv/pools", &st)
		if len(st.Pools) == 0 {
			break
		}
		if st.Pools[0].State != "released" || time.Now().After(deadline) {
			t.Fatalf("released pool not reclaimed: %+v", st.Pools)
		}
	}
	// Its sequence and cells are reusable; its id is not: a kept id answers 404 and can
	// never name the new prefix.
	again := createPool(t, base, map[string]any{"prompt": "A fresh root."})
	if num(again["pool_id"]) == id {
		t.Fatalf("new pool got the reclaimed id %d", id)
	}
	if code := get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &map[string]any{}); code != 404 {
		t.Fatalf("GET of the reclaimed pool id %d: %d, want 404", id, code)
	}
}
