package app

// Real-model tests on the second model family, Gemma 3 270M (make model fetches it;
// POLYKV_MODEL_GEMMA overrides the path). Gemma 3 interleaves sliding-window layers
// (window 512) with global ones, which is what pools must survive.

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"testing"

	"github.com/polykv/polykv/internal/testmodel"
)

// gemmaPath finds Gemma 3 270M (testmodel).
func gemmaPath(t testing.TB) string { return testmodel.Gemma(t) }

// TestGemmaSWABranchAfterWindowReuse: a branch fork needs the pool's sliding-window
// cells at positions that have fallen out of the pool's own window. llama.cpp hands such
// cells to other sequences (and purges them from the pool) once its search reaches them,
// which it does after cells were freed. With the runner's SWA anchors the fork still
// gives the fully prefilled greedy tokens; POLYKV_TEST_NO_SWA_ANCHORS=1 shows the failure.
func TestGemmaSWABranchAfterWindowReuse(t *testing.T) {
	// Prefix cache off: the fillers must free their cells (leave holes) when they end.
	cfg := Config{ModelPath: gemmaPath(t), NCtx: 2048, Parallel: 2, MaxPools: 2, PrefixCache: "off"}
	cfg.noSWAAnchors = os.Getenv("POLYKV_TEST_NO_SWA_ANCHORS") == "1"
	a, err := Open(withDefaults(cfg), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	base := serve(t, a)
	w := a.Model.NSWA()
	if w <= 0 {
		t.Fatalf("expected a sliding-window model, n_swa = %d", w)
	}
	rootToks := tokenize(t, a, longSystem(t, a, w+90))
	L := len(rootToks)
	root := num(createPool(t, base, map[string]any{"tokens": rootToks})["pool_id"])
	// Two unrelated requests: the first one's end leaves a hole (and a compaction), so
	// the second one's cells are searched for from the bottom of the cache, where the
	// pool's out-of-window SWA cells are.
	filler := tokenize(t, a, "Unrelated: "+longSystem(t, a, 150)[200:])
	for range 2 {
		greedyTokens(t, base, filler, 0, 2)
	}
	d := L - w + 200 // needs SWA positions [d-w, d), which start below L-w
	branchToks := append(slices.Clone(rootToks[:d]), suffixTokens(t, a, " Only the calculator tool is allowed.")...)
	code, out := forkPool(t, base, root, d, map[string]any{"tokens": branchToks})
	if code != 201 {
		t.Fatalf("branch: %d %v", code, out)
	}
	branch := num(out["pool_id"])
	question := suffixTokens(t, a, " Which tool first? Answer:")
	for _, c := range []struct {
		name   string
		pool   int
		prefix []int32
	}{{"root", root, rootToks}, {"branch", branch, branchToks}} {
		prompt := append(slices.Clone(c.prefix), question...)
		want, _ := greedyTokens(t, base, prompt, 0, 8)
		got, cacheN := greedyTokens(t, base, prompt, c.pool, 8)
		if cacheN != len(c.prefix) || !slices.Equal(got, want) {
			t.Fatalf("%s (L %d, window %d, branch at %d): cache_n %d (want %d), pooled %v, fully prefilled %v",
				c.name, L, w, d, cacheN, len(c.prefix), got, want)
		}
	}
}

// serve serves an opened App on a loopback port until the test ends.
func serve(t testing.TB, a *App) string {
	ts := httptest.NewServer(a.API.Handler())
	t.Cleanup(ts.Close)
	return ts.URL
}

// TestGemmaExhaustionAndStreaming: the context-exhaustion and streaming behaviour of the
// core suite on Gemma (completions: this GGUF ships no chat template).
func TestGemmaExhaustionAndStreaming(t *testing.T) {
	a, err := Open(withDefaults(Config{ModelPath: gemmaPath(t), NCtx: 64, Parallel: 1, MaxPools: 1}), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	base := serve(t, a)
	code, out := post(t, base+"/v1/completions", map[string]any{"prompt": "Once upon a time", "ignore_eos": true, "temperature": 0})
	if code != 200 {
		t.Fatalf("%d %v", code, out)
	}
	ch := out["choices"].([]any)[0].(map[string]any)
	if ch["finish_reason"] != "length" || out["truncated"] != true || num(out["usage"].(map[string]any)["total_tokens"]) != 65 {
		t.Fatalf("exhaustion: finish %v truncated %v usage %v", ch["finish_reason"], out["truncated"], out["usage"])
	}
	b, _ := json.Marshal(map[string]any{"prompt": "The capital of France is", "max_tokens": 8, "stream": true, "temperature": 0, "ignore_eos": true})
	resp, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	text, finish := readCompletionSSE(t, resp)
	if finish != "length" || text == "" {
		t.Fatalf("stream: finish %q text %q", finish, text)
	}
	var props map[string]any
	get(t, base+"/props", &props)
	// Cells the prefix cache keeps for finished requests are not in use by anyone.
	if u := props["usage"].(map[string]any); u["kv_cells_used"].(float64)-u["prefix_cache_cells"].(float64) != 0 {
		used := u["kv_cells_used"]
		t.Fatalf("%v KV cells still used after both requests ended", used)
	}
}
