package api_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/engine/enginetest"
)

// FuzzRequestDecoding posts arbitrary bodies to the generation and tokenizer routes of
// one server over the fake engine. Whatever arrives, the answer is a clean status (never
// a 500 or a crash) with a JSON body (or an SSE stream for a successful stream), and
// once it is answered nothing is left running, waiting or holding a sampler.
func FuzzRequestDecoding(f *testing.F) {
	for _, seed := range []string{
		`{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}`,
		`{"prompt":"hello","max_tokens":2,"logprobs":2}`,
		`{"messages":[{"role":"user","content":"x"}],"stream":true,"max_tokens":2,"logprobs":true,"top_logprobs":3}`,
		`{"messages":[],"max_tokens":0}`,
		`{"prompt":[1,2,3],"session_id":"s","stop":["l"],"temperature":0.5,"seed":3}`,
		`{"content":"héllo","with_pieces":true}`,
		`{"tokens":[1,2,99999]}`,
		`{"messages":[{"role":"user","content":"a"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],"tool_choice":"required"}`,
		`{"prompt":"x","max_tokens":-1}`, `[1,2]`, `{`, `null`, `{"prompt":{"a":1}}`,
	} {
		for route := range byte(4) {
			f.Add(route, []byte(seed))
		}
	}
	base, be := newServer(f, append(enginetest.Bytes("ok!"), enginetest.EOG))
	f.Fuzz(func(t *testing.T, route byte, body []byte) {
		fuzzPost(t, base, be, []string{"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}[route%4], body)
	})
}

// FuzzAgentAPIDecoding is FuzzRequestDecoding for the Responses and Messages routes
// (their decoders and translations onto chat): a clean status, a JSON body or an
// event stream, nothing left running; the Messages routes answer errors in
// Anthropic's shape. The server's script calls a tool, so tool calls are translated
// back too.
func FuzzAgentAPIDecoding(f *testing.F) {
	for _, seed := range []string{
		`{"input":"hi","max_output_tokens":3}`,
		`{"input":[{"role":"user","content":[{"type":"input_text","text":"x"}]},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"1"}],"stream":true}`,
		`{"input":[{"type":"reasoning","content":[{"type":"reasoning_text","text":"t"}]},{"type":"bogus"}],"previous_response_id":"resp_x"}`,
		`{"input":"x","tools":[{"type":"function","name":"get_weather","parameters":{"type":"object"}}],"tool_choice":"required","text":{"format":{"type":"json_schema","schema":{"type":"object"}}}}`,
		`{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}`,
		`{"messages":[{"role":"assistant","content":[{"type":"thinking","thinking":"t"},{"type":"tool_use","id":"t1","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"1"}]}]}],"max_tokens":2}`,
		`{"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":"x"}],"tools":[{"name":"get_weather","input_schema":{"type":"object"}}],"tool_choice":{"type":"any"},"max_tokens":50}`,
		`{"messages":[],"max_tokens":0}`, `[1]`, `{`, `null`, `{"input":{"a":1}}`,
	} {
		for route := range byte(3) {
			f.Add(route, []byte(seed))
		}
	}
	base, be := newServer(f, toolServerScript())
	f.Fuzz(func(t *testing.T, route byte, body []byte) {
		path := []string{"/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}[route%3]
		raw, status := fuzzPost(t, base, be, path, body)
		if strings.HasPrefix(path, "/v1/messages") && status != http.StatusOK && !bytes.HasPrefix(raw, []byte(`{"type":"error"`)) {
			t.Fatalf("%s %q: status %d is not in Anthropic's error shape: %s", path, body, status, raw)
		}
	})
}

// fuzzPost posts body to path and checks the answer: never a 500 (503 is a full queue),
// a JSON body or an event stream with events, and no sampler left once it is read.
func fuzzPost(t *testing.T, base string, be *enginetest.Backend, path string, body []byte) ([]byte, int) {
	t.Helper()
	resp, err := http.Post(base+path, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	switch {
	case resp.StatusCode >= 500 && resp.StatusCode != http.StatusServiceUnavailable:
		t.Fatalf("%s %q: status %d %s", path, body, resp.StatusCode, raw)
	case strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream"):
		if !bytes.Contains(raw, []byte("data: ")) {
			t.Fatalf("%s %q: an event stream without events: %s", path, body, raw)
		}
	case !json.Valid(raw):
		t.Fatalf("%s %q: status %d, body is not JSON: %s", path, body, resp.StatusCode, raw)
	}
	for deadline := time.Now().Add(2 * time.Second); ; {
		if be.Samplers() == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s %q: %d samplers left after the reply", path, body, be.Samplers())
		}
		time.Sleep(time.Millisecond)
	}
	return raw, resp.StatusCode
}
