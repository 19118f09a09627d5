package api_test

// Fast tests of the OpenAI and llama-server shapes (issue 9), against the engine with
// the fake backend of enginetest: no model, milliseconds each.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/api"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// renderer joins the messages' contents: the shapes under test do not depend on a
// chat template.
type renderer struct{}

func (renderer) Render(msgs []chat.Message, tools []chat.Tool, gen bool) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m.Role + ": " + m.Content + "\n")
	}
	return b.String(), nil
}
func (renderer) Path() string { return "test" }

// newServer serves the API over an engine whose backend samples script.
func newServer(t testing.TB, script []engine.Token, keys ...string) (string, *enginetest.Backend) {
	t.Helper()
	return newServerCfg(t, engine.Config{NCtx: 512, Parallel: 2, NBatch: 64, MaxQueue: 8}, script, keys...)
}

// newServerCfg is newServer with the engine configuration cfg.
func newServerCfg(t testing.TB, cfg engine.Config, script []engine.Token, keys ...string) (string, *enginetest.Backend) {
	t.Helper()
	return serveFake(t, cfg, script, nil, keys...)
}

// newServerMetrics is newServerCfg with /metrics served, fed by the engine.
func newServerMetrics(t testing.TB, cfg engine.Config, script []engine.Token) string {
	t.Helper()
	url, _ := serveFake(t, cfg, script, api.NewMetrics())
	return url
}

// serveFake serves the API over a fake-backend engine with configuration cfg; metrics
// (may be nil) observe the engine and are served at /metrics.
func serveFake(t testing.TB, cfg engine.Config, script []engine.Token, metrics *api.Metrics, keys ...string) (string, *enginetest.Backend) {
	t.Helper()
	sched, err := engine.NewScheduler(cfg, enginetest.Vocab{})
	if err != nil {
		t.Fatal(err)
	}
	be := enginetest.NewBackend(script)
	var obs engine.Observer
	if metrics != nil {
		obs = metrics
	}
	eng := engine.New(sched, be, obs)
	if metrics != nil {
		metrics.SetEngine(eng)
	}
	srv := api.New(eng, enginetest.Vocab{}, renderer{}, api.Info{ModelID: "fake", NCtx: cfg.NCtx, Parallel: cfg.Parallel,
		NBatch: cfg.NBatch, NVocab: enginetest.NVocab, MaxPools: cfg.MaxPools, BytesPerCell: cfg.BytesPerCell,
		BuildInfo: "b11434-test", CPUFeatures: []string{"AVX2", "FMA"}}, metrics, nil)
	srv.RequireAPIKeys(keys)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	return ts.URL, be
}

type reply struct {
	code   int
	header http.Header
	raw    []byte
	body   map[string]any
}

func do(t *testing.T, method, url string, body any, header ...string) reply {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	r := reply{code: resp.StatusCode, header: resp.Header, raw: raw}
	_ = json.Unmarshal(raw, &r.body)
	return r
}

// sse reads a stream's data payloads (without [DONE]).
func sse(t *testing.T, url string, body any) []map[string]any {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		raw, _ := io.ReadAll(resp.Body)
		t.Fatalf("stream: %d %s", resp.StatusCode, raw)
	}
	var out []map[string]any
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || line == "[DONE]" {
			continue
		}
		if strings.ContainsRune(line, '\uFFFD') || strings.Contains(line, `\ufffd`) {
			t.Errorf("stream chunk carries U+FFFD: %s", line)
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("chunk %q: %v", line, err)
		}
		out = append(out, m)
	}
	return out
}

func errorOf(t *testing.T, r reply) map[string]any {
	t.Helper()
	e, ok := r.body["error"].(map[string]any)
	if !ok {
		t.Fatalf("status %d without a JSON error body: %s", r.code, r.raw)
	}
	if e["code"] != float64(r.code) || e["type"] == "" || e["message"] == "" {
		t.Fatalf("error body %v does not match status %d", e, r.code)
	}
	return e
}

func choice(t *testing.T, body map[string]any) map[string]any {
	t.Helper()
	cs, ok := body["choices"].([]any)
	if !ok || len(cs) == 0 {
		t.Fatalf("no choices in %v", body)
	}
	return cs[0].(map[string]any)
}

var chatMsgs = []map[string]any{{"role": "user", "content": "hi"}}

func TestMaxTokensZeroIs400(t *testing.T) {
	url, _ := newServer(t, enginetest.Bytes("abc"))
	for _, route := range []string{"/v1/chat/completions", "/v1/completions"} {
		for _, field := range []string{"max_tokens", "max_completion_tokens"} {
			for _, v := range []int{0, -2} {
				body := map[string]any{"messages": chatMsgs, "prompt": "x", field: v}
				r := do(t, "POST", url+route, body)
				if r.code != 400 {
					t.Fatalf("%s %s=%d: status %d, want 400: %s", route, field, v, r.code, r.raw)
				}
				e := errorOf(t, r)
				want := "Invalid '" + field + "': integer below minimum value. Expected a value >= 1"
				if e["type"] != "invalid_request_error" || !strings.HasPrefix(e["message"].(string), want) || e["param"] != field {
					t.Fatalf("%s %s=%d: error %v", route, field, v, e)
				}
			}
		}
	}
	// 1 is the smallest limit, and it is one token.
	r := do(t, "POST", url+"/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1})
	if r.code != 200 || choice(t, r.body)["text"] != "a" || choice(t, r.body)["finish_reason"] != "length" {
		t.Fatalf("max_tokens 1: %d %s", r.code, r.raw)
	}
}

func TestTopLogprobsOutOfRangeIs400(t *testing.T) {
	url, _ := newServer(t, enginetest.Bytes("abc"))
	for _, tc := range []struct {
		route string
		body  map[string]any
		param string
	}{
		{"/v1/chat/completions", map[string]any{"logprobs": true, "top_logprobs": 21}, "top_logprobs"},
		{"/v1/chat/completions", map[string]any{"logprobs": true, "top_logprobs": -1}, "top_logprobs"},
		{"/v1/chat/completions", map[string]any{"top_logprobs": 2}, "top_logprobs"}, // needs logprobs
		{"/v1/completions", map[string]any{"logprobs": 21}, "logprobs"},
		{"/v1/completions", map[string]any{"logprobs": -1}, "logprobs"},
	} {
		tc.body["messages"], tc.body["prompt"], tc.body["max_tokens"] = chatMsgs, "x", 2
		r := do(t, "POST", url+tc.route, tc.body)
		if r.code != 400 {
			t.Fatalf("%s %v: status %d, want 400", tc.route, tc.body, r.code)
		}
		if e := errorOf(t, r); e["param"] != tc.param || e["type"] != "invalid_request_error" {
			t.Fatalf("%s %v: error %v", tc.route, tc.body, e)
		}
	}
	// The bounds themselves are accepted.
	for _, n := range []int{0, 20} {
		r := do(t, "POST", url+"/v1/chat/completions", map[string]any{"messages": chatMsgs, "max_tokens": 2, "logprobs": true, "top_logprobs": n})
		if r.code != 200 {
			t.Fatalf("top_logprobs %d: %d %s", n, r.code, r.raw)
		}
		for _, c := range choice(t, r.body)["logprobs"].(map[string]any)["content"].([]any) {
			if got := len(c.(map[string]any)["top_logprobs"].([]any)); got != n {
				t.Fatalf("top_logprobs %d: %d alternatives", n, got)
			}
		}
	}
}

// checkChatLogprobs checks OpenAI's chat shape for each token: token, logprob, bytes
// and n alternatives with the same three fields, most likely first.
func checkChatLogprobs(t *testing.T, content []any, wantTokens []string, n int) {
	t.Helper()
	if len(content) != len(wantTokens) {
		t.Fatalf("%d logprob entries, want %d", len(content), len(wantTokens))
	}
	for i, c := range content {
		e := c.(map[string]any)
		if e["token"] != wantTokens[i] || e["logprob"] != float64(enginetest.TopLogprob(0)) {
			t.Fatalf("entry %d: %v", i, e)
		}
		var bs []byte
		for _, b := range e["bytes"].([]any) {
			bs = append(bs, byte(b.(float64)))
		}
		if string(bs) != wantTokens[i] {
			t.Fatalf("entry %d: bytes %v", i, e["bytes"])
		}
		top := e["top_logprobs"].([]any)
		if len(top) != n {
			t.Fatalf("entry %d: %d alternatives, want %d", i, len(top), n)
		}
		for j, a := range top {
			alt := a.(map[string]any)
			if alt["logprob"] != float64(enginetest.TopLogprob(j)) || alt["token"] == nil || alt["bytes"] == nil {
				t.Fatalf("entry %d alternative %d: %v", i, j, alt)
			}
		}
		if top[0].(map[string]any)["token"] != wantTokens[i] {
			t.Fatalf("entry %d: the fake's most likely alternative is the sampled token, got %v", i, top[0])
		}
	}
}

func TestChatTopLogprobs(t *testing.T) {
	script := append(enginetest.Bytes("hi"), enginetest.FirstWord+1, enginetest.EOG) // "hi" "world"
	url, be := newServer(t, script)
	body := map[string]any{"messages": chatMsgs, "logprobs": true, "top_logprobs": 3, "max_tokens": 8}
	r := do(t, "POST", url+"/v1/chat/completions", body)
	if r.code != 200 {
		t.Fatalf("%d %s", r.code, r.raw)
	}
	ch := choice(t, r.body)
	if ch["message"].(map[string]any)["content"] != "hiworld" {
		t.Fatalf("content %v", ch["message"])
	}
	checkChatLogprobs(t, ch["logprobs"].(map[string]any)["content"].([]any), []string{"h", "i", "world"}, 3)
	if p := be.Params(); len(p) == 0 || p[len(p)-1].NProbs != 3 {
		t.Fatalf("backend asked for %+v, want NProbs 3", p)
	}

	body["stream"] = true
	var content []any
	for _, c := range sse(t, url+"/v1/chat/completions", body) {
		if lp, ok := choice(t, c)["logprobs"].(map[string]any); ok {
			content = append(content, lp["content"].([]any)...)
		}
	}
	checkChatLogprobs(t, content, []string{"h", "i", "world"}, 3)
	if be.Samplers() != 0 {
		t.Fatalf("%d samplers left after the requests", be.Samplers())
	}
}

// The € is split across three byte tokens, as a byte-level BPE does with rare
// characters: the legacy shape spells the fragments "bytes:\xNN", text_offset gives
// them the character's offset, and the text carries the whole character.
func TestCompletionsLegacyLogprobs(t *testing.T) {
	script := append(enginetest.Bytes("a€b"), enginetest.FirstWord, enginetest.EOG) // then "hello"
	url, _ := newServer(t, script)
	wantTokens := []string{"a", `bytes:\xe2`, `bytes:\x82`, `bytes:\xac`, "b", "hello"}
	wantOffsets := []float64{0, 1, 1, 1, 2, 3}
	check := func(name string, lp map[string]any, text string) {
		t.Helper()
		if text != "a€bhello" {
			t.Fatalf("%s: text %q", name, text)
		}
		toks, vals, tops, offs := lp["tokens"].([]any), lp["token_logprobs"].([]any), lp["top_logprobs"].([]any), lp["text_offset"].([]any)
		if len(toks) != len(wantTokens) || len(vals) != len(toks) || len(tops) != len(toks) || len(offs) != len(toks) {
			t.Fatalf("%s: lengths %d %d %d %d, want %d", name, len(toks), len(vals), len(tops), len(offs), len(wantTokens))
		}
		for i := range toks {
			if toks[i] != wantTokens[i] || offs[i] != wantOffsets[i] || vals[i] != float64(enginetest.TopLogprob(0)) {
				t.Fatalf("%s: token %d = %v offset %v logprob %v", name, i, toks[i], offs[i], vals[i])
			}
			top := tops[i].(map[string]any)
			if len(top) != 2 || top[wantTokens[i]] != float64(enginetest.TopLogprob(0)) {
				t.Fatalf("%s: top_logprobs[%d] = %v, want 2 alternatives led by %q", name, i, top, wantTokens[i])
			}
		}
	}
	body := map[string]any{"prompt": "x", "logprobs": 2, "max_tokens": 10}
	r := do(t, "POST", url+"/v1/completions", body)
	if r.code != 200 {
		t.Fatalf("%d %s", r.code, r.raw)
	}
	ch := choice(t, r.body)
	check("non-stream", ch["logprobs"].(map[string]any), ch["text"].(string))

	body["stream"] = true
	merged := map[string]any{"tokens": []any{}, "token_logprobs": []any{}, "top_logprobs": []any{}, "text_offset": []any{}}
	text := ""
	for _, c := range sse(t, url+"/v1/completions", body) {
		ch := choice(t, c)
		text += ch["text"].(string)
		if lp, ok := ch["logprobs"].(map[string]any); ok {
			for k := range merged {
				merged[k] = append(merged[k].([]any), lp[k].([]any)...)
			}
		}
	}
	check("stream", merged, text)
}

// A reply cut by max_tokens inside a character drops the dangling bytes, streamed or
// not: no U+FFFD anywhere.
func TestNoReplacementCharacterWhenCutInsideACharacter(t *testing.T) {
	url, _ := newServer(t, enginetest.Bytes("ab€c"))
	for _, tc := range []struct {
		max  int
		want string
	}{{3, "ab"}, {4, "ab"}, {5, "ab€"}, {6, "ab€c"}} {
		for _, route := range []string{"/v1/completions", "/v1/chat/completions"} {
			body := map[string]any{"prompt": "x", "messages": chatMsgs, "max_tokens": tc.max}
			r := do(t, "POST", url+route, body)
			if r.code != 200 || bytes.Contains(r.raw, []byte(`\ufffd`)) || bytes.ContainsRune(r.raw, '\uFFFD') {
				t.Fatalf("%s max_tokens %d: %d %s", route, tc.max, r.code, r.raw)
			}
			ch := choice(t, r.body)
			got, _ := ch["text"].(string)
			if route == "/v1/chat/completions" {
				got, _ = ch["message"].(map[string]any)["content"].(string)
			}
			if got != tc.want {
				t.Fatalf("%s max_tokens %d: %q, want %q", route, tc.max, got, tc.want)
			}
			body["stream"] = true
			streamed := ""
			for _, c := range sse(t, url+route, body) { // sse fails on any U+FFFD
				if cs := c["choices"].([]any); len(cs) > 0 {
					ch := cs[0].(map[string]any)
					if s, ok := ch["text"].(string); ok {
						streamed += s
					}
					if d, ok := ch["delta"].(map[string]any); ok {
						s, _ := d["content"].(string)
						streamed += s
					}
				}
			}
			if streamed != tc.want {
				t.Fatalf("%s stream max_tokens %d: %q, want %q", route, tc.max, streamed, tc.want)
			}
		}
	}
}

func TestTokenizePiecesJoinBackToContent(t *testing.T) {
	url, _ := newServer(t, enginetest.Bytes("a"))
	content := "hello é🦙 € world"
	r := do(t, "POST", url+"/tokenize", map[string]any{"content": content, "with_pieces": true})
	if r.code != 200 {
		t.Fatalf("%d %s", r.code, r.raw)
	}
	var joined []byte
	arrays := 0
	for _, p := range r.body["tokens"].([]any) {
		switch piece := p.(map[string]any)["piece"].(type) {
		case string:
			if strings.ContainsRune(piece, '\uFFFD') {
				t.Fatalf("piece %q carries U+FFFD", piece)
			}
			joined = append(joined, piece...)
		case []any:
			arrays++
			for _, b := range piece {
				joined = append(joined, byte(b.(float64)))
			}
		default:
			t.Fatalf("piece %v is neither a string nor a byte array", piece)
		}
	}
	if string(joined) != content {
		t.Fatalf("pieces join to %q, want %q", joined, content)
	}
	if arrays != len("é🦙") {
		t.Fatalf("%d byte-array pieces, want one per byte of é🦙 (%d)", arrays, len("é🦙"))
	}
}

func TestCORS(t *testing.T) {
	url, _ := newServer(t, enginetest.Bytes("a"), "secret")
	origin := "http://ui.example"
	r := do(t, "OPTIONS", url+"/v1/chat/completions", nil, "Origin", origin,
		"Access-Control-Request-Method", "POST", "Access-Control-Request-Headers", "authorization, content-type, x-custom")
	if r.code/100 != 2 {
		t.Fatalf("preflight (without a key): %d %s", r.code, r.raw)
	}
	h := r.header
	if h.Get("Access-Control-Allow-Origin") != origin || !strings.Contains(h.Get("Access-Control-Allow-Methods"), "POST") {
		t.Fatalf("preflight headers %v", h)
	}
	allow := strings.ToLower(h.Get("Access-Control-Allow-Headers"))
	for _, want := range []string{"authorization", "content-type", "x-custom"} {
		if !strings.Contains(allow, want) {
			t.Fatalf("Access-Control-Allow-Headers %q lacks %s", allow, want)
		}
	}
	// Replies carry Access-Control-Allow-Origin: success, errors and 401s alike.
	for _, c := range []struct {
		method, path string
		key          string
		code         int
	}{{"GET", "/health", "", 200}, {"GET", "/v1/models", "Bearer secret", 200}, {"GET", "/v1/models", "", 401},
		{"POST", "/v1/completions", "Bearer secret", 400}} {
		r := do(t, c.method, url+c.path, nil, "Origin", origin, "Authorization", c.key)
		if r.code != c.code || r.header.Get("Access-Control-Allow-Origin") != origin {
			t.Fatalf("%s %s: %d, Access-Control-Allow-Origin %q", c.method, c.path, r.code, r.header.Get("Access-Control-Allow-Origin"))
		}
	}
	if r := do(t, "GET", url+"/health", nil); r.header.Get("Access-Control-Allow-Origin") != "*" {
		t.Fatalf("no Origin: Access-Control-Allow-Origin %q, want *", r.header.Get("Access-Control-Allow-Origin"))
	}
}

func TestWrongMethodIs405WithAllow(t *testing.T) {
	url, _ := newServer(t, enginetest.Bytes("a"))
	for _, c := range []struct{ method, path, allow string }{
		{"GET", "/v1/chat/completions", "POST"},
		{"PUT", "/v1/completions", "POST"},
		{"DELETE", "/v1/models", "GET"},
		{"POST", "/health", "GET"},
		{"GET", "/tokenize", "POST"},
	} {
		r := do(t, c.method, url+c.path, nil)
		if r.code != 405 || !strings.Contains(r.header.Get("Allow"), c.allow) {
			t.Fatalf("%s %s: %d, Allow %q: %s", c.method, c.path, r.code, r.header.Get("Allow"), r.raw)
		}
		if e := errorOf(t, r); !strings.Contains(e["message"].(string), c.method) {
			t.Fatalf("%s %s: error %v", c.method, c.path, e)
		}
	}
	r := do(t, "GET", url+"/no/such/route", nil)
	if r.code != 404 || errorOf(t, r)["type"] != "not_found_error" {
		t.Fatalf("unknown route: %d %s", r.code, r.raw)
	}
}

func TestAPIKey(t *testing.T) {
	url, _ := newServer(t, enginetest.Bytes("ok"), "k1", "k2")
	for _, c := range []struct {
		method, path, auth string
		code               int
	}{
		{"GET", "/health", "", 200},
		{"GET", "/v1/models", "", 401},
		{"GET", "/v1/models", "Bearer nope", 401},
		{"GET", "/v1/models", "Bearer k1x", 401},
		{"GET", "/v1/models", "Basic k1", 401},
		{"GET", "/v1/models", "k1", 401},
		{"GET", "/v1/models", "Bearer k1", 200},
		{"GET", "/v1/models", "Bearer k2", 200},
		{"GET", "/props", "", 401},
		{"GET", "/slots", "", 401},
		{"GET", "/polykv/pools", "", 401},
		{"POST", "/tokenize", "", 401},
		{"GET", "/no/such/route", "", 401}, // routes are not revealed without a key
		{"GET", "/no/such/route", "Bearer k1", 404},
	} {
		r := do(t, c.method, url+c.path, nil, "Authorization", c.auth)
		if r.code != c.code {
			t.Fatalf("%s %s with %q: %d, want %d: %s", c.method, c.path, c.auth, r.code, c.code, r.raw)
		}
		if c.code == 401 {
			e := errorOf(t, r)
			if e["message"] != "Invalid API Key" || e["type"] != "authentication_error" {
				t.Fatalf("401 body %v", e)
			}
		}
	}
	body := map[string]any{"prompt": "x", "max_tokens": 2}
	if r := do(t, "POST", url+"/v1/completions", body, "Authorization", "Bearer k2"); r.code != 200 || choice(t, r.body)["text"] != "ok" {
		t.Fatalf("completion with a key: %d %s", r.code, r.raw)
	}
	// Without keys the server is open.
	open, _ := newServer(t, enginetest.Bytes("ok"))
	if r := do(t, "GET", open+"/v1/models", nil); r.code != 200 {
		t.Fatalf("no keys configured: %d", r.code)
	}
}

// A pool whose whole prefix a finished request without pool_id left in the prefix cache
// is a name on those cells (issue 12, one mechanism): created at once, zero_copy, with
// nothing prefilled. With the cache off the same pool prefills its prefix.
func TestPoolFromCachedPrefixIsZeroCopy(t *testing.T) {
	for _, cache := range []bool{true, false} {
		cfg := engine.Config{NCtx: 512, Parallel: 2, NBatch: 64, MaxQueue: 8, MaxPools: 2, PrefixCache: cache}
		url, _ := newServerCfg(t, cfg, enginetest.Bytes("ok"))
		if r := do(t, "POST", url+"/v1/completions", map[string]any{"prompt": "a shared system prompt, then a question", "max_tokens": 1}); r.code != 200 {
			t.Fatalf("completion: %d %s", r.code, r.raw)
		}
		r := do(t, "POST", url+"/polykv/pools", map[string]any{"prompt": "a shared system prompt"})
		if r.code != 201 {
			t.Fatalf("create: %d %s", r.code, r.raw)
		}
		zero, prefilled := r.body["zero_copy"], r.body["prefilled_tokens"]
		if cache && (zero != true || prefilled != float64(0)) || !cache && (zero != false || prefilled == float64(0)) {
			t.Fatalf("prefix cache %v: zero_copy %v, prefilled_tokens %v", cache, zero, prefilled)
		}
	}
}
