package api_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// TestQueueTimeout: a request that cannot get cells waits visibly and then gives up
// with 503 and Retry-After (issue 30). A pinned pool holds 50 of 64 cells; a
// 30-token prompt waits for cells ("waiting" in /slots with reason and age,
// polykv_requests_waiting_reason{reason="cells"} in /metrics) until --queue-timeout;
// streamed or not, the answer is a plain JSON 503, not a stream.
func TestQueueTimeout(t *testing.T) {
	cfg := engine.Config{NCtx: 64, Parallel: 2, MaxPools: 1, NBatch: 64, MaxQueue: 4, QueueTimeout: 400 * time.Millisecond}
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
		got := make(chan reply, 1)
		go func() {
			got <- do(t, "POST", base+"/v1/completions", map[string]any{"prompt": ids(100, 30), "max_tokens": 2, "stream": stream})
		}()
		var waiting map[string]any
		for deadline := time.Now().Add(5 * time.Second); waiting == nil && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			var slots []map[string]any
			getJSON(t, base+"/slots", &slots)
			for _, s := range slots {
				if s["state"] == "waiting" {
					waiting = s
				}
			}
		}
		if waiting == nil || waiting["id"] != float64(-1) || waiting["waiting_reason"] != engine.WaitCells ||
			waiting["n_prompt_tokens"] != float64(30) || waiting["waiting_ms"] == nil {
			t.Fatalf("stream=%v: /slots while waiting: %v", stream, waiting)
		}
		if m := scrape(t, base); !strings.Contains(m, `polykv_requests_waiting_reason{reason="cells"} 1`) {
			t.Fatalf("stream=%v: /metrics while waiting lacks the cells wait:\n%s", stream, m)
		}
		r := <-got
		if r.code != http.StatusServiceUnavailable || r.header.Get("Retry-After") != "1" || !strings.HasPrefix(r.header.Get("Content-Type"), "application/json") {
			t.Fatalf("stream=%v: %d Retry-After=%q %s", stream, r.code, r.header.Get("Retry-After"), r.raw)
		}
		if e := errorOf(t, r); !strings.Contains(e["message"].(string), "waited") || !strings.Contains(e["message"].(string), "KV cells") {
			t.Fatalf("stream=%v: message %q does not say what it waited for", stream, e["message"])
		}
		if d := time.Since(start); d < cfg.QueueTimeout {
			t.Fatalf("stream=%v: refused after %s, before the timeout", stream, d)
		}
	}
	m := scrape(t, base)
	for _, want := range []string{"polykv_queue_timeouts_total 2", `polykv_requests_waiting_reason{reason="cells"} 0`, "polykv_queue_oldest_wait_seconds 0"} {
		if !strings.Contains(m, want) {
			t.Fatalf("/metrics after the timeouts lacks %q:\n%s", want, m)
		}
	}
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	r := do(t, "GET", url, nil)
	if r.code != 200 {
		t.Fatalf("GET %s: %d %s", url, r.code, r.raw)
	}
	if err := json.Unmarshal(r.raw, v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
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
