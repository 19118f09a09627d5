package api_test

import (
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/polykv/polykv/internal/api"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// recorder is the test renderer that also keeps the last conversation it rendered, so
// a test can see what a Responses or Messages request became in chat's terms.
type recorder struct {
	renderer
	mu   sync.Mutex
	last []chat.Message
}

func (r *recorder) Render(msgs []chat.Message, tools []chat.Tool, gen bool) (string, error) {
	r.mu.Lock()
	r.last = append([]chat.Message(nil), msgs...)
	r.mu.Unlock()
	return r.renderer.Render(msgs, tools, gen)
}

func (r *recorder) conversation() []chat.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// newRecordingServer is newServer with a recorder as the renderer and info's bounds.
func newRecordingServer(t *testing.T, script []engine.Token, info api.Info) (string, *recorder) {
	t.Helper()
	cfg := engine.Config{NCtx: 512, Parallel: 2, NBatch: 64, MaxQueue: 8}
	sched, err := engine.NewScheduler(cfg, enginetest.Vocab{})
	if err != nil {
		t.Fatal(err)
	}
	eng := engine.New(sched, enginetest.NewBackend(script), nil)
	rec := &recorder{}
	info.ModelID, info.NCtx, info.Parallel, info.NBatch, info.NVocab = "fake", cfg.NCtx, cfg.Parallel, cfg.NBatch, enginetest.NVocab
	ts := httptest.NewServer(api.New(eng, enginetest.Vocab{}, rec, info, nil, nil).Handler())
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	return ts.URL, rec
}

func usageOf(t *testing.T, body map[string]any) (input, cached int) {
	t.Helper()
	u, ok := body["usage"].(map[string]any)
	if !ok {
		t.Fatalf("no usage in %v", body)
	}
	d := u["input_tokens_details"].(map[string]any)
	return int(u["input_tokens"].(float64)), int(d["cached_tokens"].(float64))
}

// A chain continued by previous_response_id runs on its first response's session and
// reuses the cells holding the turns so far: the second turn reports at least the
// first turn's input as cached, and the template sees the whole conversation.
func TestResponsesChainReusesSession(t *testing.T) {
	url, rec := newRecordingServer(t, append(enginetest.Bytes("hello world"), enginetest.EOG), api.Info{})
	first := do(t, "POST", url+"/v1/responses", map[string]any{"input": "hi", "instructions": "be brief", "max_output_tokens": 20})
	if first.code != 200 || first.body["status"] != "completed" {
		t.Fatalf("first turn: %d %s", first.code, first.raw)
	}
	in1, _ := usageOf(t, first.body)
	id := first.body["id"].(string)
	second := do(t, "POST", url+"/v1/responses", map[string]any{"input": "more", "instructions": "be brief",
		"previous_response_id": id, "max_output_tokens": 20})
	if second.code != 200 {
		t.Fatalf("second turn: %d %s", second.code, second.raw)
	}
	in2, cached := usageOf(t, second.body)
	if cached < in1 || in2 <= in1 {
		t.Fatalf("second turn input %d, cached %d: want the first turn's %d input tokens cached", in2, cached, in1)
	}
	if s := second.body["session_id"]; s != first.body["session_id"] || !strings.HasPrefix(s.(string), "resp-chain-"+id) {
		t.Fatalf("sessions %v and %v: a chain stays on its first response's session", first.body["session_id"], s)
	}
	var roles []string
	for _, m := range rec.conversation() {
		roles = append(roles, m.Role+"="+m.Content)
	}
	want := "system=be brief|user=hi|assistant=hello world|user=more"
	if got := strings.Join(roles, "|"); got != want {
		t.Fatalf("the template saw %s, want %s", got, want)
	}
	// Stored: GET answers it, DELETE removes it, and then the chain cannot go on.
	if g := do(t, "GET", url+"/v1/responses/"+id, nil); g.code != 200 || g.body["id"] != id {
		t.Fatalf("GET: %d %s", g.code, g.raw)
	}
	if d := do(t, "DELETE", url+"/v1/responses/"+id, nil); d.code != 200 || d.body["deleted"] != true {
		t.Fatalf("DELETE: %d %s", d.code, d.raw)
	}
	if g := do(t, "GET", url+"/v1/responses/"+id, nil); g.code != 404 {
		t.Fatalf("GET after DELETE: %d %s", g.code, g.raw)
	}
	gone := do(t, "POST", url+"/v1/responses", map[string]any{"input": "x", "previous_response_id": id})
	if e := errorOf(t, gone); gone.code != 400 || e["param"] != "previous_response_id" {
		t.Fatalf("continuing a deleted response: %d %s", gone.code, gone.raw)
	}
}

// store false keeps nothing, so nothing can continue from it.
func TestResponsesStoreFalse(t *testing.T) {
	url, _ := newRecordingServer(t, append(enginetest.Bytes("ok"), enginetest.EOG), api.Info{})
	r := do(t, "POST", url+"/v1/responses", map[string]any{"input": "hi", "store": false})
	if r.code != 200 || r.body["store"] != false || r.body["session_id"] != nil {
		t.Fatalf("store false: %d %s", r.code, r.raw)
	}
	if g := do(t, "GET", url+"/v1/responses/"+r.body["id"].(string), nil); g.code != 404 {
		t.Fatalf("GET of an unstored response: %d %s", g.code, g.raw)
	}
}

// The stored responses are bounded: past --responses-max the oldest is gone.
func TestResponsesBounded(t *testing.T) {
	url, _ := newRecordingServer(t, append(enginetest.Bytes("ok"), enginetest.EOG), api.Info{ResponsesMax: 2})
	var ids []string
	for range 3 {
		r := do(t, "POST", url+"/v1/responses", map[string]any{"input": "hi", "session_id": "bounded"})
		if r.code != 200 {
			t.Fatalf("%d %s", r.code, r.raw)
		}
		ids = append(ids, r.body["id"].(string))
	}
	for i, id := range ids {
		want := 200
		if i == 0 {
			want = 404
		}
		if g := do(t, "GET", url+"/v1/responses/"+id, nil); g.code != want {
			t.Fatalf("response %d of 3 with room for 2: GET %d, want %d", i+1, g.code, want)
		}
	}
}

// A function call round trip: the call of the first response, answered by a
// function_call_output in the next, reaches the template as an assistant tool call
// and a tool message; an output for a call never made is refused naming the field.
func TestResponsesFunctionCallRoundTrip(t *testing.T) {
	url, rec := newRecordingServer(t, toolServerScript(), api.Info{})
	first := do(t, "POST", url+"/v1/responses", map[string]any{"input": "weather in Paris?", "tools": responseTools, "max_output_tokens": 200})
	out, _ := first.body["output"].([]any)
	if first.code != 200 || len(out) != 2 {
		t.Fatalf("first turn: %d %s", first.code, first.raw)
	}
	call := out[1].(map[string]any)
	if call["type"] != "function_call" || call["name"] != "get_weather" || call["arguments"] != `{"city": "Paris"}` {
		t.Fatalf("call item %v", call)
	}
	next := map[string]any{"previous_response_id": first.body["id"], "tools": responseTools, "max_output_tokens": 5,
		"input": []any{map[string]any{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}}}
	if r := do(t, "POST", url+"/v1/responses", next); r.code != 200 {
		t.Fatalf("second turn: %d %s", r.code, r.raw)
	}
	msgs := rec.conversation()
	if len(msgs) != 3 || len(msgs[1].ToolCalls) != 1 || msgs[1].ToolCalls[0].ID != call["call_id"] || msgs[1].ReasoningContent != "hm" ||
		msgs[2].Role != "tool" || msgs[2].Content != "sunny" || msgs[2].ToolCallID != call["call_id"] {
		t.Fatalf("the template saw %+v", msgs)
	}
	next["input"] = []any{map[string]any{"type": "function_call_output", "call_id": "call_other", "output": "x"}}
	r := do(t, "POST", url+"/v1/responses", next)
	if e := errorOf(t, r); r.code != 400 || e["param"] != "input[0].call_id" {
		t.Fatalf("an output without its call: %d %s", r.code, r.raw)
	}
}

// A Messages tool round trip: tool_use and thinking blocks of the assistant turn and
// the tool_result block of the next user turn reach the template as chat's tool call,
// reasoning and tool message; count_tokens counts the prompt the same request renders.
func TestMessagesToolRoundTrip(t *testing.T) {
	url, rec := newRecordingServer(t, toolServerScript(), api.Info{})
	first := do(t, "POST", url+"/v1/messages", map[string]any{"messages": anthropicMsgs, "tools": anthropicTools, "max_tokens": 200})
	content, _ := first.body["content"].([]any)
	if first.code != 200 || first.body["stop_reason"] != "tool_use" || len(content) != 2 {
		t.Fatalf("first turn: %d %s", first.code, first.raw)
	}
	use := content[1].(map[string]any)
	body := map[string]any{"tools": anthropicTools, "max_tokens": 5, "system": "be brief", "messages": []any{
		map[string]any{"role": "user", "content": "weather?"},
		map[string]any{"role": "assistant", "content": content},
		map[string]any{"role": "user", "content": []any{map[string]any{"type": "tool_result", "tool_use_id": use["id"], "content": []any{map[string]any{"type": "text", "text": "sunny"}}},
			map[string]any{"type": "text", "text": "and tomorrow?"}}},
	}}
	if r := do(t, "POST", url+"/v1/messages", body); r.code != 200 {
		t.Fatalf("second turn: %d %s", r.code, r.raw)
	}
	msgs := rec.conversation()
	if len(msgs) != 5 || msgs[0].Role != "system" || msgs[2].ReasoningContent != "hm" || len(msgs[2].ToolCalls) != 1 ||
		msgs[2].ToolCalls[0].Function.Arguments != `{"city":"Paris"}` || msgs[3].Role != "tool" || msgs[3].Content != "sunny" ||
		msgs[4].Role != "user" || msgs[4].Content != "and tomorrow?" {
		t.Fatalf("the template saw %+v", msgs)
	}
	short := do(t, "POST", url+"/v1/messages/count_tokens", map[string]any{"messages": anthropicMsgs})
	long := do(t, "POST", url+"/v1/messages/count_tokens", body)
	if short.code != 200 || long.code != 200 || long.body["input_tokens"].(float64) <= short.body["input_tokens"].(float64) {
		t.Fatalf("count_tokens: %s and %s", short.raw, long.raw)
	}
}

// The Messages stream is Anthropic's event sequence, each event named by its type.
func TestMessagesStreamEventOrder(t *testing.T) {
	url, _ := newRecordingServer(t, toolServerScript(), api.Info{})
	evs := sse(t, url+"/v1/messages", map[string]any{"messages": anthropicMsgs, "tools": anthropicTools, "max_tokens": 200, "stream": true})
	var seq []string
	for _, e := range evs {
		if t := e["type"].(string); len(seq) == 0 || seq[len(seq)-1] != t {
			seq = append(seq, t)
		}
	}
	want := "message_start content_block_start content_block_delta content_block_stop content_block_start content_block_delta content_block_stop message_delta message_stop"
	if got := strings.Join(seq, " "); got != want {
		t.Fatalf("events %s, want %s", got, want)
	}
}
