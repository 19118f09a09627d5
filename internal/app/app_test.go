package app

// Real-model tests: they load SmolLM2-135M (make model) and drive the full server over
// HTTP. POLYKV_MODEL overrides the model path.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/testmodel"
)

// modelPath finds SmolLM2 (testmodel: skips without it, fails under make test).
func modelPath(t testing.TB) string { return testmodel.SmolLM2(t) }

// withDefaults fills the zero fields of a test's partial configuration from
// DefaultConfig. Only tests take this shortcut; the server itself never reads a zero as
// "not given". A test that needs a zero setting sets it on the App's config after this.
func withDefaults(over Config) Config {
	cfg := DefaultConfig()
	dst, src := reflect.ValueOf(&cfg).Elem(), reflect.ValueOf(over)
	for i := range src.NumField() {
		if dst.Field(i).CanSet() && !src.Field(i).IsZero() {
			dst.Field(i).Set(src.Field(i))
		}
	}
	cfg.noSWAAnchors = over.noSWAAnchors // unexported: reflect cannot set it
	return cfg
}

// startServer opens an App on the test model and serves it on a loopback port. Zero
// fields of cfg take their defaults (withDefaults).
func startServer(t testing.TB, cfg Config) (*App, string) {
	t.Helper()
	cfg = withDefaults(cfg)
	if cfg.ModelPath == "" {
		cfg.ModelPath = modelPath(t)
	}
	a, err := Open(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(a.API.Handler())
	t.Cleanup(func() {
		ts.Close()
		a.Close()
	})
	return a, ts.URL
}

// forEachModel runs a core-suite test on SmolLM2 and on Gemma 3 270M (a second
// architecture: sliding-window attention, another tokenizer and template), each as a
// subtest with the model's path and template set in cfg. A missing model skips its
// subtest (fails under make test, like modelPath).
func forEachModel(t *testing.T, cfg Config, run func(t *testing.T, cfg Config)) {
	for _, m := range []struct {
		name     string
		path     func(testing.TB) string
		template string
	}{{"smollm2", modelPath, ""}, {"gemma3", gemmaPath, "gemma"}} {
		t.Run(m.name, func(t *testing.T) {
			c := cfg
			c.ModelPath = m.path(t)
			if c.ChatTemplate == "" {
				c.ChatTemplate = m.template
			}
			run(t, c)
		})
	}
}

func post(t testing.TB, url string, body any) (int, map[string]any) {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case string:
		rd = strings.NewReader(b)
	default:
		buf, _ := json.Marshal(b)
		rd = bytes.NewReader(buf)
	}
	resp, err := http.Post(url, "application/json", rd)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("%s: status %d, body is not JSON: %q", url, resp.StatusCode, raw)
	}
	return resp.StatusCode, out
}

func get(t testing.TB, url string, v any) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("%s: %v", url, err)
	}
	return resp.StatusCode
}

// completion is a greedy /v1/completions call returning token ids and logprobs.
func completion(t testing.TB, base, prompt string, maxTokens int) ([]int, []float64) {
	t.Helper()
	code, out := post(t, base+"/v1/completions", map[string]any{
		"prompt": prompt, "max_tokens": maxTokens, "temperature": 0, "logprobs": 1, "ignore_eos": true,
	})
	if code != 200 {
		t.Fatalf("completion: %d %v", code, out)
	}
	lp := out["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)
	var ids []int
	var vals []float64
	for _, v := range lp["token_ids"].([]any) {
		ids = append(ids, int(v.(float64)))
	}
	for _, v := range lp["token_logprobs"].([]any) {
		vals = append(vals, v.(float64))
	}
	return ids, vals
}

var otherPrompts = []string{
	"The quick brown fox", "In 1492, Columbus", "def fibonacci(n):", "My favourite recipe is",
	"The mitochondria is", "Dear hiring manager,", "Rain in Spain falls",
}

func TestGreedySameAloneAndInABatch(t *testing.T) {
	forEachModel(t, Config{NCtx: 4096, Parallel: 8}, func(t *testing.T, cfg Config) {
		_, base := startServer(t, cfg)
		const prompt = "Once upon a time, in a small village by the sea,"
		const n = 32
		alone, aloneLP := completion(t, base, prompt, n)
		if len(alone) != n {
			t.Fatalf("alone: %d tokens, want %d", len(alone), n)
		}
		var wg sync.WaitGroup
		var batched []int
		var batchedLP []float64
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if i == 0 {
					batched, batchedLP = completion(t, base, prompt, n)
					return
				}
				completion(t, base, otherPrompts[i-1], n+16) // keeps decoding beside it
			}()
		}
		wg.Wait()
		maxDelta := 0.0
		for i := range alone {
			if i < len(batched) && alone[i] == batched[i] {
				maxDelta = math.Max(maxDelta, math.Abs(aloneLP[i]-batchedLP[i]))
			}
		}
		t.Logf("max |Δ logprob| of the sampled token, alone vs beside 7 decoding sessions: %.2e", maxDelta)
		for i := range alone {
			if i >= len(batched) || alone[i] != batched[i] {
				t.Fatalf("greedy tokens diverge at step %d: alone %v, batched %v", i, alone, batched)
			}
		}
		if maxDelta > 0.05 {
			t.Fatalf("logprobs drift by %.3f between batch shapes", maxDelta)
		}
	})
}

func TestSessionSecondTurnReusesCache(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 4096, Parallel: 4})
	msgs := []map[string]any{
		{"role": "system", "content": "You are a terse assistant."},
		{"role": "user", "content": "Name a colour."},
	}
	code, first := post(t, base+"/v1/chat/completions", map[string]any{"messages": msgs, "session_id": "agent-1", "max_tokens": 16, "temperature": 0})
	if code != 200 {
		t.Fatalf("first turn: %d %v", code, first)
	}
	promptLen := first["usage"].(map[string]any)["prompt_tokens"].(float64)
	reply := first["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	msgs = append(msgs, map[string]any{"role": "assistant", "content": reply}, map[string]any{"role": "user", "content": "Another one."})
	code, second := post(t, base+"/v1/chat/completions", map[string]any{"messages": msgs, "session_id": "agent-1", "max_tokens": 16, "temperature": 0})
	if code != 200 {
		t.Fatalf("second turn: %d %v", code, second)
	}
	cacheN := second["timings"].(map[string]any)["cache_n"].(float64)
	cached := second["usage"].(map[string]any)["prompt_tokens_details"].(map[string]any)["cached_tokens"].(float64)
	if cacheN < promptLen || cached != cacheN {
		t.Fatalf("second turn cache_n %v (cached_tokens %v), want >= first prompt length %v", cacheN, cached, promptLen)
	}
	if second["session_id"] != "agent-1" {
		t.Fatalf("session_id echoed as %v", second["session_id"])
	}
	var slots []map[string]any
	get(t, base+"/slots", &slots)
	if len(slots) != 1 || slots[0]["session_id"] != "agent-1" || slots[0]["state"] != "idle" {
		t.Fatalf("slots %v: want the idle session agent-1", slots)
	}
}

// readSSE reads a streaming response and checks it is well-formed OpenAI SSE.
func readSSE(t testing.TB, resp *http.Response) (string, string) {
	t.Helper()
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Errorf("content-type %q", ct)
	}
	sc := bufio.NewScanner(resp.Body)
	var text strings.Builder
	finish := ""
	sawDone := false
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Errorf("not an SSE data line: %q", line)
			continue
		}
		if data == "[DONE]" {
			sawDone = true
			continue
		}
		if sawDone {
			t.Errorf("data after [DONE]: %q", data)
		}
		var chunk struct {
			Object  string `json:"object"`
			Choices []struct {
				Delta        map[string]any `json:"delta"`
				FinishReason *string        `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Errorf("chunk is not JSON: %q", data)
			continue
		}
		if chunk.Object != "chat.completion.chunk" {
			t.Errorf("chunk object %q", chunk.Object)
		}
		for _, c := range chunk.Choices {
			if s, ok := c.Delta["content"].(string); ok {
				text.WriteString(s)
			}
			if c.FinishReason != nil {
				finish = *c.FinishReason
			}
		}
	}
	if !sawDone {
		t.Error("stream did not end with data: [DONE]")
	}
	return text.String(), finish
}

func TestConcurrentStreams(t *testing.T) {
	forEachModel(t, Config{NCtx: 4096, Parallel: 8}, func(t *testing.T, cfg Config) {
		_, base := startServer(t, cfg)
		var wg sync.WaitGroup
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				body, _ := json.Marshal(map[string]any{
					"messages": []map[string]any{{"role": "user", "content": fmt.Sprintf("Count to %d.", i+3)}},
					"stream":   true, "max_tokens": 24, "stream_options": map[string]any{"include_usage": true},
				})
				resp, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(body))
				if err != nil {
					t.Error(err)
					return
				}
				text, finish := readSSE(t, resp)
				if finish != "stop" && finish != "length" {
					t.Errorf("stream %d: finish_reason %q", i, finish)
				}
				if text == "" {
					t.Errorf("stream %d produced no text", i)
				}
			}()
		}
		wg.Wait()
	})
}

func TestBadInputKeepsServing(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 512, Parallel: 2, MaxQueue: 1})
	// A session decoding throughout must not be disturbed by the bad requests.
	body, _ := json.Marshal(map[string]any{"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": true, "stream": true, "temperature": 0})
	resp, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("hello world ", 400)
	cases := []struct {
		name, path string
		body       any
		status     int
		typ        string
	}{
		{"malformed JSON", "/v1/chat/completions", `{"messages": [`, 400, "invalid_request_error"},
		{"not an object", "/v1/chat/completions", `[1,2]`, 400, "invalid_request_error"},
		{"empty body", "/v1/completions", ``, 400, "invalid_request_error"},
		{"wrong type", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":"ten"}`, 400, "invalid_request_error"},
		{"negative max_tokens", "/v1/completions", map[string]any{"prompt": "hi", "max_tokens": -5}, 400, "invalid_request_error"},
		{"temperature out of range", "/v1/completions", map[string]any{"prompt": "hi", "temperature": 9}, 400, "invalid_request_error"},
		{"no messages", "/v1/chat/completions", map[string]any{"messages": []any{}}, 400, "invalid_request_error"},
		{"bad role", "/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "wizard", "content": "x"}}}, 400, "invalid_request_error"},
		{"bad token id", "/v1/completions", map[string]any{"prompt": []int{1, 99999999}}, 400, "invalid_request_error"},
		{"n > 1", "/v1/completions", map[string]any{"prompt": "hi", "n": 3}, 400, "invalid_request_error"},
		{"prompt longer than context", "/v1/completions", map[string]any{"prompt": long}, 400, "exceed_context_size_error"},
		{"detokenize bad id", "/detokenize", map[string]any{"tokens": []int{-3}}, 400, "invalid_request_error"},
		{"tokenize without content", "/tokenize", map[string]any{}, 400, "invalid_request_error"},
		{"unknown route", "/v1/embeddings", map[string]any{}, 404, "not_found_error"},
	}
	for _, c := range cases {
		code, out := post(t, base+c.path, c.body)
		e, _ := out["error"].(map[string]any)
		if code != c.status || e == nil || e["type"] != c.typ || e["message"] == "" {
			t.Errorf("%s: status %d body %v, want %d %s", c.name, code, out, c.status, c.typ)
		}
	}
	// Queue full: one sequence left, one waiting slot; the third concurrent request is refused.
	hold := func() *http.Response {
		b, _ := json.Marshal(map[string]any{"prompt": "Count slowly:", "max_tokens": 120, "ignore_eos": true, "stream": true})
		r, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	r1 := hold()
	r2done := make(chan *http.Response, 1)
	go func() { r2done <- hold() }() // waits in the queue: headers come only when it runs
	time.Sleep(300 * time.Millisecond)
	code, out := post(t, base+"/v1/completions", map[string]any{"prompt": "one too many", "max_tokens": 4})
	if code != 503 || out["error"].(map[string]any)["type"] != "unavailable_error" {
		t.Errorf("queue full: %d %v", code, out)
	}
	r1.Body.Close()
	r2 := <-r2done
	r2.Body.Close()
	// The long-running stream finished intact.
	text, finish := readCompletionSSE(t, resp)
	if finish != "length" || len(text) == 0 {
		t.Fatalf("the running session was disturbed: finish %q, text %q", finish, text)
	}
	code, out = post(t, base+"/v1/completions", map[string]any{"prompt": "Still alive?", "max_tokens": 4})
	if code != 200 {
		t.Fatalf("server stopped serving: %d %v", code, out)
	}
	// max_tokens beyond the context is capped at it, not refused (agent CLIs send their
	// model's limit): the reply stops by itself or where the context ends.
	code, out = post(t, base+"/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 1 << 30, "temperature": 0})
	if code != 200 {
		t.Fatalf("absurd max_tokens: %d %v", code, out)
	}
	if used := out["context"].(map[string]any)["ctx_used"].(float64); used > 512 {
		t.Fatalf("absurd max_tokens: %v cells used in a 512-cell context", used)
	}
}

func readCompletionSSE(t testing.TB, resp *http.Response) (string, string) {
	t.Helper()
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	var text strings.Builder
	finish := ""
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Text         string  `json:"text"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("bad chunk %q", data)
		}
		for _, c := range chunk.Choices {
			text.WriteString(c.Text)
			if c.FinishReason != nil {
				finish = *c.FinishReason
			}
		}
	}
	return text.String(), finish
}

func TestDisconnectFreesSequence(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 2048, Parallel: 2})
	ctx, cancel := context.WithCancel(context.Background())
	b, _ := json.Marshal(map[string]any{"prompt": "Write forever:", "ignore_eos": true, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", base+"/v1/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	rd := bufio.NewReader(resp.Body)
	if _, err := rd.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var slots []map[string]any
		get(t, base+"/slots", &slots)
		// A finished request's sequence may stay as prefix cache ("cached"): not in use.
		slots = slices.DeleteFunc(slots, func(s map[string]any) bool { return s["state"] == "cached" })
		if len(slots) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sequence still in use after the client left: %v", slots)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var props map[string]any
	get(t, base+"/props", &props)
	// Cells the prefix cache keeps for finished requests are not in use by anyone.
	if u := props["usage"].(map[string]any); u["kv_cells_used"].(float64)-u["prefix_cache_cells"].(float64) != 0 {
		used := u["kv_cells_used"]
		t.Fatalf("%v KV cells still used", used)
	}
}

func TestContextExhaustionStopsCleanly(t *testing.T) {
	forEachModel(t, Config{NCtx: 64, Parallel: 1}, func(t *testing.T, cfg Config) {
		_, base := startServer(t, cfg)
		code, out := post(t, base+"/v1/completions", map[string]any{"prompt": "Once upon a time", "ignore_eos": true, "temperature": 0})
		if code != 200 {
			t.Fatalf("%d %v", code, out)
		}
		ch := out["choices"].([]any)[0].(map[string]any)
		usage := out["usage"].(map[string]any)
		if ch["finish_reason"] != "length" || out["truncated"] != true {
			t.Fatalf("finish %v truncated %v", ch["finish_reason"], out["truncated"])
		}
		if total := usage["total_tokens"].(float64); total != 65 {
			t.Fatalf("total tokens %v: the last token is sampled at position 63, want 65", total)
		}
	})
}

func TestTokenizeRoundTripAndInfo(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 512, Parallel: 1})
	code, out := post(t, base+"/tokenize", map[string]any{"content": "Hello, PolyKV!", "with_pieces": true})
	if code != 200 {
		t.Fatalf("tokenize: %d %v", code, out)
	}
	var ids []int
	var pieces strings.Builder
	for _, p := range out["tokens"].([]any) {
		m := p.(map[string]any)
		ids = append(ids, int(m["id"].(float64)))
		pieces.WriteString(m["piece"].(string))
	}
	if pieces.String() != "Hello, PolyKV!" {
		t.Fatalf("pieces %q", pieces.String())
	}
	code, out = post(t, base+"/detokenize", map[string]any{"tokens": ids})
	if code != 200 || out["content"] != "Hello, PolyKV!" {
		t.Fatalf("detokenize: %d %v", code, out)
	}
	var props map[string]any
	get(t, base+"/props", &props)
	if props["n_ctx"].(float64) != 512 || props["parallel"].(float64) != 1 || !strings.Contains(props["chat_template"].(string), "im_start") {
		t.Fatalf("props %v", props)
	}
	var models map[string]any
	get(t, base+"/v1/models", &models)
	if models["data"].([]any)[0].(map[string]any)["id"] != "SmolLM2-135M-Instruct.Q4_1" {
		t.Fatalf("models %v", models)
	}
	var health map[string]any
	if code := get(t, base+"/health", &health); code != 200 || health["status"] != "ok" {
		t.Fatalf("health %d %v", code, health)
	}
}

func jsonDecode(resp *http.Response, v any) error { return json.NewDecoder(resp.Body).Decode(v) }
