package api_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// TestSpeculativeFields: a server with speculative decoding reports llama-server's
// draft_n and draft_n_accepted in timings and counts proposals per pool in /metrics; a
// request turns speculation off with speculative false (or n_max 0) and then has no
// draft counters; the output is the same either way; bad values are a JSON 400.
func TestSpeculativeFields(t *testing.T) {
	cfg := engine.Config{NCtx: 512, Parallel: 2, NBatch: 64, MaxQueue: 4,
		Spec: engine.Spec{Types: []string{engine.SpecNgramSimple}, DraftMax: 8}}
	// A repeating answer: ngram-simple finds it in the output so far.
	base := newServerMetrics(t, cfg, enginetest.Bytes(strings.Repeat("abcdefgh", 8)))
	complete := func(extra map[string]any) (string, map[string]any) {
		t.Helper()
		body := map[string]any{"prompt": "x", "max_tokens": 60, "temperature": 0}
		for k, v := range extra {
			body[k] = v
		}
		r := do(t, "POST", base+"/v1/completions", body)
		if r.code != 200 {
			t.Fatalf("%v: %d %s", extra, r.code, r.raw)
		}
		var out struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Timings map[string]any `json:"timings"`
		}
		if err := json.Unmarshal(r.raw, &out); err != nil {
			t.Fatal(err)
		}
		return out.Choices[0].Text, out.Timings
	}
	text, tm := complete(nil)
	if tm["draft_n"] == nil || tm["draft_n_accepted"] == nil || tm["draft_n_accepted"].(float64) == 0 ||
		tm["draft_n_accepted"].(float64) > tm["draft_n"].(float64) || tm["predicted_n"] != float64(60) {
		t.Fatalf("timings with speculation: %v", tm)
	}
	drafted, accepted := tm["draft_n"].(float64), tm["draft_n_accepted"].(float64)
	for _, off := range []map[string]any{{"speculative": false}, {"speculative.n_max": 0}, {"speculative": map[string]any{"n_max": 0}}} {
		offText, tm := complete(off)
		if _, ok := tm["draft_n"]; ok || offText != text {
			t.Fatalf("%v: text %q (with speculation %q), timings %v", off, offText, text, tm)
		}
	}
	// n_max 2 with n_min 2: proposals of exactly two tokens still come.
	if _, tm := complete(map[string]any{"speculative.n_max": 2, "speculative.n_min": 2}); tm["draft_n"] == nil {
		t.Fatalf("n_max 2 n_min 2: no drafts (%v)", tm)
	}
	m := scrape(t, base)
	for _, want := range []string{`polykv_spec_proposals_total{pool="none"}`, `polykv_spec_draft_tokens_total{pool="none"}`, `polykv_spec_draft_tokens_accepted_total{pool="none"}`} {
		if !strings.Contains(m, want) {
			t.Fatalf("/metrics lacks %s:\n%s", want, m)
		}
	}
	t.Logf("drafted %v, accepted %v", drafted, accepted)

	for _, bad := range []struct {
		body map[string]any
		want string
	}{
		{map[string]any{"speculative": "yes"}, "speculative must be a boolean or an object"},
		{map[string]any{"speculative.n_max": -1}, "speculative.n_max must be in 0..256"},
		{map[string]any{"speculative": map[string]any{"n_max": 1000}}, "speculative.n_max must be in 0..256"},
		{map[string]any{"speculative.n_min": -2}, "speculative.n_min must not be negative"},
		{map[string]any{"speculative.n_max": 2, "speculative.n_min": 3}, "must not exceed speculative.n_max"},
	} {
		bad.body["prompt"] = "x"
		r := do(t, "POST", base+"/v1/completions", bad.body)
		if r.code != 400 {
			t.Fatalf("%v: %d %s", bad.body, r.code, r.raw)
		}
		if e := errorOf(t, r); !strings.Contains(e["message"].(string), bad.want) {
			t.Fatalf("%v: message %q, want %q", bad.body, e["message"], bad.want)
		}
	}
}
