package app

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/polykv/polykv/internal/api/wire"
)

func TestEWMAMatchesTimings(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 2048, Parallel: 2})
	code, out := post(t, base+"/v1/completions", map[string]any{"prompt": "Count:", "max_tokens": 300, "ignore_eos": true, "temperature": 0})
	if code != 200 {
		t.Fatalf("%d %v", code, out)
	}
	tm := out["timings"].(map[string]any)
	ewma, truth := tm["tps_ewma"].(float64), tm["predicted_per_second"].(float64)
	t.Logf("steady session: tps_ewma %.1f, predicted_per_second %.1f", ewma, truth)
	if math.Abs(ewma-truth)/truth > 0.10 {
		t.Fatalf("tps_ewma %.1f is not within 10%% of predicted_per_second %.1f", ewma, truth)
	}
}

func TestAggregateIsSumAndSSE(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 2048, Parallel: 2})
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			post(t, base+"/v1/completions", map[string]any{"prompt": fmt.Sprintf("Story %d:", i), "max_tokens": 400, "ignore_eos": true})
		}()
	}
	defer wg.Wait()
	// Read the SSE stream while both decode.
	resp, err := http.Get(base + "/polykv/tps?interval_ms=300")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(resp.Body)
	var events []map[string]any
	var snaps []wire.TPS
	for sc.Scan() && len(events) < 6 {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		var m map[string]any
		var snap wire.TPS
		if json.Unmarshal([]byte(data), &m) != nil || json.Unmarshal([]byte(data), &snap) != nil {
			t.Fatalf("SSE event is not JSON: %q", data)
		}
		events = append(events, m)
		snaps = append(snaps, snap)
	}
	resp.Body.Close()
	if len(events) < 3 {
		t.Fatalf("read %d events", len(events))
	}
	last := snaps[len(snaps)-1]
	if last.NActive != 2 {
		t.Fatalf("last event: %d active sessions, want 2 (%+v)", last.NActive, last)
	}
	sum := last.Sessions[0].TPSEWMA + last.Sessions[1].TPSEWMA
	t.Logf("aggregate %.1f tok/s, Σ sessions %.1f, mean %.1f", last.AggregateTPS, sum, last.MeanActiveTPS)
	if math.Abs(last.AggregateTPS-sum)/sum > 0.15 {
		t.Fatalf("aggregate %.1f vs Σ %.1f", last.AggregateTPS, sum)
	}
	// ?once=1 has the same shape as an event.
	var once map[string]any
	get(t, base+"/polykv/tps?once=1", &once)
	keys := func(m map[string]any) []string {
		var k []string
		for key := range m {
			k = append(k, key)
		}
		slices.Sort(k)
		return k
	}
	if !slices.Equal(keys(once), keys(events[0])) {
		t.Fatalf("once keys %v, event keys %v", keys(once), keys(events[0]))
	}
	s0 := last.Sessions[0]
	if s0.CtxTotal != 2048 || s0.CtxUsed == 0 || s0.CtxHeadroomTokens <= 0 || s0.CtxHeadroomTokens > 2048-s0.CtxUsed {
		t.Fatalf("context fields %+v", s0)
	}
}

func TestMetricsExposition(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 2048, Parallel: 2})
	id := num(createPool(t, base, map[string]any{"prompt": longSystem(t, a, 40)})["pool_id"])
	var info wire.PoolInfo
	get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
	post(t, base+"/v1/completions", map[string]any{"prompt": append(slices.Clone(info.Tokens), 42), "pool_id": id, "session_id": "m1", "max_tokens": 8})
	// Cold (cache_prompt false): otherwise the prefix cache would reuse its BOS token.
	post(t, base+"/v1/completions", map[string]any{"prompt": "unpooled", "max_tokens": 4, "cache_prompt": false})
	families := scrapeMetrics(t, base)
	for _, name := range []string{"polykv_gen_throughput_tps", "polykv_pool_kv_bytes", "polykv_pool_sessions", "polykv_prefix_cache_hits_total",
		"polykv_queries_total", "polykv_time_to_first_token_seconds", "polykv_inter_token_latency_seconds", "polykv_requests_running",
		"polykv_requests_waiting", "polykv_kv_usage_ratio"} {
		if families[name] == nil {
			t.Errorf("metric %s missing", name)
		}
	}
	pools := map[string]float64{}
	for _, m := range families["polykv_prefix_cache_hits_total"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "pool" {
				pools[l.GetValue()] = m.GetCounter().GetValue()
			}
		}
	}
	if pools[fmt.Sprint(id)] != float64(len(info.Tokens)) || pools["none"] != 0 {
		t.Fatalf("prefix cache hits by pool %v, want %d for pool %d", pools, len(info.Tokens), id)
	}
	if got := families["polykv_pool_sessions"]; got == nil || len(got.GetMetric()) != 2 {
		t.Fatalf("pool_sessions rows: %v", got)
	}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if strings.Contains(l.GetName(), "session") {
					t.Fatalf("%s carries a session label", name)
				}
			}
		}
	}
}

func TestEnforcedImpossibleFloorRejectsSecondSession(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 2048, Parallel: 3})
	id := num(createPool(t, base, map[string]any{"prompt": longSystem(t, a, 40)})["pool_id"])
	var info wire.PoolInfo
	get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
	prompt := func(k int) []int32 { return append(slices.Clone(info.Tokens), int32(100+k)) }
	code, pol := post(t, fmt.Sprintf("%s/polykv/pools/%d/admission", base, id), map[string]any{
		"target_tps_per_session": 1e6, "mode": "advisory", "settle_tokens": 8})
	if code != 200 {
		t.Fatalf("set admission: %d %v", code, pol)
	}
	var props map[string]any
	get(t, base+"/props", &props)
	if floors := props["polykv"].(map[string]any)["floors"].(map[string]any); floors[fmt.Sprint(id)] != 1e6 {
		t.Fatalf("/props floors %v", floors)
	}
	// The first session of the pool is guaranteed; it streams throughout.
	body, _ := json.Marshal(map[string]any{"prompt": prompt(0), "pool_id": id, "session_id": "first", "max_tokens": 250, "ignore_eos": true, "stream": true})
	resp, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("first session: %v %v", err, resp.Status)
	}
	rd := bufio.NewReader(resp.Body)
	for range 40 { // let it decode past the settle window
		if _, err := rd.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	// Advisory: never rejects, whatever the floor says.
	code, out := post(t, base+"/v1/completions", map[string]any{"prompt": prompt(1), "pool_id": id, "session_id": "advised", "max_tokens": 4})
	if code != 200 {
		t.Fatalf("advisory pool rejected: %d %v", code, out)
	}
	var capRep wire.Capacity
	get(t, fmt.Sprintf("%s/polykv/pools/%d/capacity?session_id=someone", base, id), &capRep)
	if capRep.CanAdmit || capRep.NPoolSessions < 1 || capRep.KnownSession == nil || *capRep.KnownSession {
		t.Fatalf("capacity under an impossible floor: %+v", capRep.Verdict)
	}
	post(t, fmt.Sprintf("%s/polykv/pools/%d/admission", base, id), map[string]any{"mode": "enforced", "on_saturation": "reject"})
	buf, _ := json.Marshal(map[string]any{"prompt": prompt(2), "pool_id": id, "session_id": "second", "max_tokens": 4})
	r2, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(buf))
	if err != nil {
		t.Fatal(err)
	}
	var rej map[string]any
	_ = json.NewDecoder(r2.Body).Decode(&rej)
	r2.Body.Close()
	if r2.StatusCode != 429 || r2.Header.Get("Retry-After") == "" || rej["error"].(map[string]any)["type"] != "pool_saturated_error" {
		t.Fatalf("enforced second session: %d Retry-After %q %v", r2.StatusCode, r2.Header.Get("Retry-After"), rej)
	}
	// A continuation of a known session and an overcommitted request still pass.
	if code, out := post(t, base+"/v1/completions", map[string]any{"prompt": prompt(1), "pool_id": id, "session_id": "advised", "max_tokens": 2}); code != 200 {
		t.Fatalf("continuation gated: %d %v", code, out)
	}
	if code, out := post(t, base+"/v1/completions", map[string]any{"prompt": prompt(3), "pool_id": id, "session_id": "over", "max_tokens": 2, "overcommit": true}); code != 200 {
		t.Fatalf("overcommit gated: %d %v", code, out)
	}
	// The first session decoded on, untouched, to its full length.
	text, finish := readCompletionSSE(t, resp)
	if finish != "length" || text == "" {
		t.Fatalf("first session: finish %q", finish)
	}
}

func TestPooledSessionPastContextKeepsPoolIntact(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 256, Parallel: 2, MaxPools: 2})
	rootToks := tokenize(t, a, longSystem(t, a, 100))
	id := num(createPool(t, base, map[string]any{"tokens": rootToks})["pool_id"])
	code, out := post(t, base+"/v1/completions", map[string]any{"prompt": append(slices.Clone(rootToks), 42), "pool_id": id, "ignore_eos": true, "temperature": 0})
	if code != 200 || out["truncated"] != true || out["choices"].([]any)[0].(map[string]any)["finish_reason"] != "length" {
		t.Fatalf("pooled session at n_ctx: %d truncated %v", code, out["truncated"])
	}
	var capRep wire.Capacity
	get(t, fmt.Sprintf("%s/polykv/pools/%d/capacity?expected_tokens=1000", base, id), &capRep)
	if capRep.CanAdmit || capRep.Reason != "context headroom exhausted" {
		t.Fatalf("context arm: %+v", capRep.Verdict)
	}
	// The pool is coherent: a fresh attach reuses all of it and decodes what a full prefill does.
	prompt := append(slices.Clone(rootToks), suffixTokens(t, a, " Next step:")...)
	want, _ := greedyTokens(t, base, prompt, 0, 16)
	got, cacheN := greedyTokens(t, base, prompt, id, 16)
	if cacheN != len(rootToks) || !slices.Equal(got, want) {
		t.Fatalf("after the truncated session: cache_n %d (want %d), tokens equal %v", cacheN, len(rootToks), slices.Equal(got, want))
	}
}

// scrapeMetrics reads /metrics and parses it with Prometheus' own text parser.
func scrapeMetrics(t *testing.T, base string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("/metrics does not parse: %v", err)
	}
	return families
}

// Throttle toward the floor (issue 41) changes when a token is decoded, never which:
// two sessions of a pool far above its floor skip steps beside a session of a pool
// whose floor nobody reaches (so it always gains from a skip), and every request's
// greedy tokens are the ones an unthrottled run of the same requests gives. Pacing
// too: with a floor no session reaches, the pool's second turn waits in the queue for
// its first (paced) and decodes the same tokens, and the wait is reported.
func TestThrottleLossless(t *testing.T) {
	forEachModel(t, Config{NCtx: 4096, Parallel: 4}, func(t *testing.T, cfg Config) {
		_, base := startServer(t, cfg)
		const fastSys, slowSys = "You are a fast worker agent. Answer in full sentences.", "You are a careful reviewer agent. Check every claim."
		fast, slow := num(createPool(t, base, map[string]any{"prompt": fastSys})["pool_id"]), num(createPool(t, base, map[string]any{"prompt": slowSys})["pool_id"])
		policy := func(pool int, body map[string]any) {
			if code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/admission", base, pool), body); code != 200 {
				t.Fatalf("admission: %d %v", code, out)
			}
		}
		policy(slow, map[string]any{"target_tps_per_session": 1e6})
		type reply struct {
			ids       []int
			lps       []float64
			throttled int
			pacedMs   float64
		}
		reqs := []struct {
			pool   int
			prompt string
		}{{fast, fastSys + " Task: describe a harbour at dawn."}, {fast, fastSys + " Task: explain how bread rises."}, {slow, slowSys + " Claim: the moon is made of rock."}}
		run := func(throttle string, floor float64, round int) []reply {
			policy(fast, map[string]any{"target_tps_per_session": floor, "throttle": throttle})
			out := make([]reply, len(reqs))
			var wg sync.WaitGroup
			for i, rq := range reqs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					code, res := post(t, base+"/v1/completions", map[string]any{"prompt": rq.prompt, "pool_id": rq.pool,
						"session_id": fmt.Sprintf("r%d-%d", round, i), "max_tokens": 64, "temperature": 0, "logprobs": 1, "ignore_eos": true})
					if code != 200 {
						t.Errorf("request %d: %d %v", i, code, res)
						return
					}
					lp := res["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)
					for _, v := range lp["token_ids"].([]any) {
						out[i].ids = append(out[i].ids, num(v))
					}
					for _, v := range lp["token_logprobs"].([]any) {
						out[i].lps = append(out[i].lps, v.(float64))
					}
					if n, ok := res["timings"].(map[string]any)["throttled_steps"]; ok {
						out[i].throttled = num(n)
					}
					if ms, ok := res["timings"].(map[string]any)["paced_ms"].(float64); ok {
						out[i].pacedMs = ms
					}
				}()
			}
			wg.Wait()
			if t.Failed() {
				t.FailNow()
			}
			return out
		}
		off := run("off", 1, 0)
		on := run("toward_floor", 1, 1)
		maxDelta := 0.0
		for i := range reqs {
			if !slices.Equal(off[i].ids, on[i].ids) {
				t.Fatalf("request %d: greedy tokens differ throttled:\n off %v\n on  %v", i, off[i].ids, on[i].ids)
			}
			for j := range off[i].lps {
				maxDelta = math.Max(maxDelta, math.Abs(off[i].lps[j]-on[i].lps[j]))
			}
			if off[i].throttled != 0 {
				t.Fatalf("request %d skipped %d steps with the throttle off", i, off[i].throttled)
			}
		}
		t.Logf("throttled steps: fast %d and %d of 64 tokens, slow %d; max |Δ logprob| %.2e", on[0].throttled, on[1].throttled, on[2].throttled, maxDelta)
		if on[0].throttled == 0 || on[1].throttled == 0 || on[2].throttled != 0 {
			t.Fatalf("throttled steps: fast %d and %d, slow %d: want the fast sessions throttled and the slow one not", on[0].throttled, on[1].throttled, on[2].throttled)
		}
		if maxDelta > 0.05 {
			t.Fatalf("logprobs drift by %.3f throttled", maxDelta)
		}
		var snap wire.TPS
		get(t, base+"/polykv/tps?once=1", &snap)
		if snap.ThrottledStepsTotal != int64(on[0].throttled+on[1].throttled) {
			t.Fatalf("/polykv/tps throttled_steps_total %d, the responses say %d", snap.ThrottledStepsTotal, on[0].throttled+on[1].throttled)
		}
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		want := fmt.Sprintf("polykv_throttled_steps_total{pool=\"%d\"} %d", fast, on[0].throttled+on[1].throttled)
		if !strings.Contains(string(raw), want) {
			t.Fatalf("/metrics lacks %q", want)
		}
		if snap.PacedTurnsTotal != 0 || on[0].pacedMs+on[1].pacedMs+on[2].pacedMs != 0 {
			t.Fatalf("turns paced with the pool far above its floor: %d, %v %v %v ms", snap.PacedTurnsTotal, on[0].pacedMs, on[1].pacedMs, on[2].pacedMs)
		}

		paced := run("toward_floor", 1e6, 2)
		for i := range reqs {
			if !slices.Equal(off[i].ids, paced[i].ids) {
				t.Fatalf("request %d: greedy tokens differ paced:\n off %v\n on  %v", i, off[i].ids, paced[i].ids)
			}
		}
		t.Logf("paced: fast %.0f and %.0f ms, slow %.0f ms", paced[0].pacedMs, paced[1].pacedMs, paced[2].pacedMs)
		if (paced[0].pacedMs > 0) == (paced[1].pacedMs > 0) || paced[2].pacedMs != 0 {
			t.Fatalf("paced ms: fast %v and %v, slow %v: want exactly one fast turn paced behind the other, the slow pool's not", paced[0].pacedMs, paced[1].pacedMs, paced[2].pacedMs)
		}
		get(t, base+"/polykv/tps?once=1", &snap)
		if snap.PacedTurnsTotal != 1 {
			t.Fatalf("/polykv/tps paced_turns_total %d, want 1", snap.PacedTurnsTotal)
		}
		resp2, err := http.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp2.Body.Close()
		raw, _ = io.ReadAll(resp2.Body)
		if want := fmt.Sprintf("polykv_paced_turns_total{pool=\"%d\"} 1", fast); !strings.Contains(string(raw), want) {
			t.Fatalf("/metrics lacks %q", want)
		}
	})
}
