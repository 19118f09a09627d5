package api_test

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// TestNeverFitsBesidePinnedPools: a request that cannot get cells while a pinned pool
// stays pinned, on a server without a tier to page the pool to, is refused at once with
// a 503 that says why (issue 40; before, it waited out --queue-timeout), streamed or
// not as a plain JSON error, and nothing is left waiting.
func TestNeverFitsBesidePinnedPools(t *testing.T) {
	cfg := engine.Config{NCtx: 64, Parallel: 2, MaxPools: 1, NBatch: 64, MaxQueue: 4, QueueTimeout: time.Minute}
	base := newServerMetrics(t, cfg, enginetest.Bytes("a"))
	ids := func(from, n int) []int {
		out := make([]int, n)
		for i := range out {
			out[i] = from + i
		}
		return out
	}
	if r := do(t, "POST", base+"/polykv/pools", map[string]any{"tokens": ids(1, 50), "pin": true}); r.code != 201 {
		t.Fatalf("pool: %d %s", r.code, r.raw)
	}
	for _, stream := range []bool{false, true} {
		start := time.Now()
		r := do(t, "POST", base+"/v1/completions", map[string]any{"prompt": ids(100, 30), "max_tokens": 2, "stream": stream})
		if r.code != http.StatusServiceUnavailable || !strings.HasPrefix(r.header.Get("Content-Type"), "application/json") {
			t.Fatalf("stream=%v: %d %s", stream, r.code, r.raw)
		}
		if e := errorOf(t, r); !strings.Contains(e["message"].(string), "pinned pools hold 50") {
			t.Fatalf("stream=%v: message %q does not say why", stream, e["message"])
		}
		if d := time.Since(start); d > 30*time.Second {
			t.Fatalf("stream=%v: refused after %s, not at once", stream, d)
		}
	}
	m := scrape(t, base)
	for _, want := range []string{"polykv_queue_timeouts_total 0", `polykv_requests_waiting_reason{reason="cells"} 0`} {
		if !strings.Contains(m, want) {
			t.Fatalf("/metrics lacks %q:\n%s", want, m)
		}
	}
	// One that fits beside the pool runs.
	if r := do(t, "POST", base+"/v1/completions", map[string]any{"prompt": ids(100, 10), "max_tokens": 2}); r.code != 200 {
		t.Fatalf("a request that fits: %d %s", r.code, r.raw)
	}
}

func scrape(t *testing.T, base string) string {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestKVUsageRatioCountsWhatCannotBeReclaimed: polykv_kv_usage_ratio, the KV usage
// llm-d's router reads, counts only cells no new request can get (issue 30). An idle
// session's cells are free for the asking (ratio 0, all of them in
// polykv_kv_cells_evictable); a pinned pool's are not.
func TestKVUsageRatioCountsWhatCannotBeReclaimed(t *testing.T) {
	cfg := engine.Config{NCtx: 512, Parallel: 2, MaxPools: 1, NBatch: 64, MaxQueue: 4}
	base := newServerMetrics(t, cfg, enginetest.Bytes("a"))
	prompt := make([]int, 20)
	for i := range prompt {
		prompt[i] = 100 + i
	}
	if r := do(t, "POST", base+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 2, "session_id": "s"}); r.code != 200 {
		t.Fatalf("completion: %d %s", r.code, r.raw)
	}
	check := func(when string, used, evictable int) {
		t.Helper()
		m := scrape(t, base)
		ratio := float64(used-evictable) / float64(cfg.NCtx)
		for name, want := range map[string]float64{"polykv_kv_cells_used": float64(used), "polykv_kv_cells_evictable": float64(evictable), "polykv_kv_usage_ratio": ratio} {
			if got := metricValue(t, m, name); got != want {
				t.Fatalf("%s: %s = %g, want %g", when, name, got, want)
			}
		}
	}
	check("an idle session", 21, 21) // 20 prompt cells and the first sampled token's
	if r := do(t, "POST", base+"/polykv/pools", map[string]any{"tokens": prompt[:10], "pin": true}); r.code != 201 {
		t.Fatalf("pool: %d %s", r.code, r.raw)
	}
	// Without the prefix cache the pool prefills its own 10 cells: pinned, they are
	// used; the session's 21 stay evictable.
	check("a pinned pool beside the idle session", 31, 21)
}

func metricValue(t *testing.T, text, name string) float64 {
	t.Helper()
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			var f float64
			if _, err := fmt.Sscan(v, &f); err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return f
		}
	}
	t.Fatalf("no %s in /metrics:\n%s", name, text)
	return 0
}
