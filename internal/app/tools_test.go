package app

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

var weatherTool = map[string]any{"type": "function", "function": map[string]any{
	"name": "get_weather", "description": "Current weather for a city",
	"parameters": map[string]any{"type": "object", "properties": map[string]any{
		"city": map[string]any{"type": "string"}, "unit": map[string]any{"enum": []string{"celsius", "fahrenheit"}}},
		"required": []string{"city", "unit"}}}}

var timeTool = map[string]any{"type": "function", "function": map[string]any{
	"name": "get_time", "description": "Current time in a timezone",
	"parameters": map[string]any{"type": "object", "properties": map[string]any{
		"timezone": map[string]any{"type": "string"}, "hours_ahead": map[string]any{"type": "integer"}},
		"required": []string{"timezone"}}}}

func compileSchema(t testing.TB, schema any) *jsonschema.Schema {
	t.Helper()
	raw, _ := json.Marshal(schema)
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("schema.json", doc); err != nil {
		t.Fatal(err)
	}
	s, err := c.Compile("schema.json")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func validateArgs(t testing.TB, name, args string) {
	t.Helper()
	tools := map[string]map[string]any{"get_weather": weatherTool, "get_time": timeTool}
	tool, ok := tools[name]
	if !ok {
		t.Fatalf("call names unknown tool %q", name)
	}
	var v any
	if err := json.Unmarshal([]byte(args), &v); err != nil {
		t.Fatalf("arguments are not JSON: %q", args)
	}
	if err := compileSchema(t, tool["function"].(map[string]any)["parameters"]).Validate(v); err != nil {
		t.Fatalf("arguments %s do not validate against %s's schema: %v", args, name, err)
	}
}

func TestRequiredToolChoice(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 4096, Parallel: 2})
	body := map[string]any{
		"messages":    []any{map[string]any{"role": "user", "content": "What is the weather in Paris right now?"}},
		"tools":       []any{weatherTool, timeTool},
		"tool_choice": "required", "temperature": 0, "max_tokens": 120,
	}
	code, out := post(t, base+"/v1/chat/completions", body)
	if code != 200 {
		t.Fatalf("%d %v", code, out)
	}
	ch := out["choices"].([]any)[0].(map[string]any)
	calls, _ := ch["message"].(map[string]any)["tool_calls"].([]any)
	if ch["finish_reason"] != "tool_calls" || len(calls) == 0 {
		t.Fatalf("no tool call: %v", ch)
	}
	fn := calls[0].(map[string]any)["function"].(map[string]any)
	name, args := fn["name"].(string), fn["arguments"].(string)
	validateArgs(t, name, args)
	// Streamed: the deltas reassemble into the same call.
	body["stream"] = true
	buf, _ := json.Marshal(body)
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(buf))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sName, sArgs, finish, sID string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c struct {
			Choices []struct {
				Delta struct {
					ToolCalls []struct {
						Index    int    `json:"index"`
						ID       string `json:"id"`
						Function struct {
							Name      string `json:"name"`
							Arguments string `json:"arguments"`
						} `json:"function"`
					} `json:"tool_calls"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("bad chunk %q", data)
		}
		for _, ch := range c.Choices {
			for _, tc := range ch.Delta.ToolCalls {
				if tc.Index == 0 {
					sName += tc.Function.Name
					sArgs += tc.Function.Arguments
					sID += tc.ID
				}
			}
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
	}
	if sName != name || sArgs != args || finish != "tool_calls" || !strings.HasPrefix(sID, "call_") {
		t.Fatalf("stream reassembled %q(%s) finish %q id %q; non-stream %q(%s)", sName, sArgs, finish, sID, name, args)
	}
}

func TestNamedToolAndJSONSchema(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 4096, Parallel: 2})
	code, out := post(t, base+"/v1/chat/completions", map[string]any{
		"messages": []any{map[string]any{"role": "user", "content": "Time in Tokyo?"}},
		"tools":    []any{weatherTool, timeTool}, "temperature": 0, "max_tokens": 120,
		"tool_choice": map[string]any{"type": "function", "function": map[string]any{"name": "get_time"}},
	})
	if code != 200 {
		t.Fatalf("%d %v", code, out)
	}
	fn := out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["tool_calls"].([]any)[0].(map[string]any)["function"].(map[string]any)
	if fn["name"] != "get_time" {
		t.Fatalf("named tool_choice called %v", fn["name"])
	}
	validateArgs(t, "get_time", fn["arguments"].(string))
	schema := map[string]any{"type": "object", "properties": map[string]any{
		"title": map[string]any{"type": "string", "maxLength": 40}, "year": map[string]any{"type": "integer"},
		"genres": map[string]any{"type": "array", "minItems": 1, "maxItems": 3, "items": map[string]any{"type": "string", "maxLength": 20}}},
		"required": []string{"title", "year", "genres"}}
	code, out = post(t, base+"/v1/chat/completions", map[string]any{
		"messages":        []any{map[string]any{"role": "user", "content": "Describe a famous film as JSON."}},
		"response_format": map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "film", "schema": schema}},
		"temperature":     0, "max_tokens": 300,
	})
	if code != 200 {
		t.Fatalf("%d %v", code, out)
	}
	content := out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	var v any
	if err := json.Unmarshal([]byte(content), &v); err != nil {
		t.Fatalf("json_schema reply is not JSON: %q", content)
	}
	if err := compileSchema(t, schema).Validate(v); err != nil {
		t.Fatalf("reply %s does not validate: %v", content, err)
	}
	code, out = post(t, base+"/v1/chat/completions", map[string]any{
		"messages":        []any{map[string]any{"role": "user", "content": "Give a JSON object with a person's name and age."}},
		"response_format": map[string]any{"type": "json_object"}, "temperature": 0, "max_tokens": 400,
	})
	if code != 200 {
		t.Fatalf("json_object: %d %v", code, out)
	}
	choice := out["choices"].([]any)[0].(map[string]any)
	content = choice["message"].(map[string]any)["content"].(string)
	// json_object constrains the text to a JSON object; it cannot make a tiny model
	// close its strings, so a reply cut at max_tokens ("length") must be a prefix of
	// one, and a finished reply ("stop") a whole one.
	var obj map[string]any
	switch reason := choice["finish_reason"]; reason {
	case "stop":
		if err := json.Unmarshal([]byte(content), &obj); err != nil {
			t.Fatalf("json_object reply is not a JSON object (%v): %q", err, content)
		}
	case "length":
		t.Logf("json_object reply cut at max_tokens: %.80q...", content)
		if !jsonObjectPrefix(content) {
			t.Fatalf("json_object reply cut at max_tokens is not the start of a JSON object: %q", content)
		}
	default:
		t.Fatalf("json_object: finish_reason %v", reason)
	}
}

// jsonObjectPrefix reports whether s is a JSON object, possibly cut short: it starts
// with '{', its tokens parse, and the only error is the text ending (between tokens or
// inside one).
func jsonObjectPrefix(s string) bool {
	dec := json.NewDecoder(strings.NewReader(s))
	for i := 0; ; i++ {
		tok, err := dec.Token()
		if err != nil {
			return i > 0 && (err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF))
		}
		if i == 0 && tok != json.Delim('{') {
			return false
		}
	}
}

func TestToolRoundTrip(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 4096, Parallel: 2})
	msgs := []any{
		map[string]any{"role": "user", "content": "What is the weather in Paris?"},
		map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
			"id": "call_abc", "type": "function", "function": map[string]any{"name": "get_weather", "arguments": `{"city": "Paris", "unit": "celsius"}`}}}},
		map[string]any{"role": "tool", "tool_call_id": "call_abc", "content": `{"temperature": 21, "sky": "sunny"}`},
	}
	code, out := post(t, base+"/v1/chat/completions", map[string]any{"messages": msgs, "tools": []any{weatherTool}, "temperature": 0, "max_tokens": 40})
	if code != 200 {
		t.Fatalf("%d %v", code, out)
	}
	ch := out["choices"].([]any)[0].(map[string]any)
	if ch["finish_reason"] == "tool_calls" {
		t.Logf("the tiny model called again: %v", ch["message"])
	} else if c, _ := ch["message"].(map[string]any)["content"].(string); c == "" {
		t.Fatalf("no final answer: %v", ch)
	}
	// The history reached the prompt: far more prompt tokens than the question alone.
	code, alone := post(t, base+"/v1/chat/completions", map[string]any{"messages": msgs[:1], "tools": []any{weatherTool}, "max_tokens": 1})
	if code != 200 || out["usage"].(map[string]any)["prompt_tokens"].(float64) <= alone["usage"].(map[string]any)["prompt_tokens"].(float64)+20 {
		t.Fatalf("tool history not rendered: %v vs %v", out["usage"], alone["usage"])
	}
}

func TestToolBadInput(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 2048, Parallel: 1})
	user := []any{map[string]any{"role": "user", "content": "hi"}}
	cases := []struct {
		name string
		body map[string]any
	}{
		{"parameters not an object", map[string]any{"messages": user, "tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "f", "parameters": "nope"}}}}},
		{"tools not an array", map[string]any{"messages": user, "tools": "f"}},
		{"bad tool type", map[string]any{"messages": user, "tools": []any{map[string]any{"type": "code", "function": map[string]any{"name": "f"}}}}},
		{"unknown named tool", map[string]any{"messages": user, "tools": []any{weatherTool}, "tool_choice": map[string]any{"type": "function", "function": map[string]any{"name": "nope"}}}},
		{"bad tool_choice", map[string]any{"messages": user, "tools": []any{weatherTool}, "tool_choice": "sometimes"}},
		{"required without tools", map[string]any{"messages": user, "tool_choice": "required"}},
		{"response_format schema the compiler rejects", map[string]any{"messages": user, "response_format": map[string]any{"type": "json_schema",
			"json_schema": map[string]any{"name": "s", "schema": map[string]any{"type": "object", "properties": map[string]any{"x": map[string]any{"type": "string", "pattern": "^a+$"}}}}}}},
		{"bad response_format", map[string]any{"messages": user, "response_format": map[string]any{"type": "yaml"}}},
		{"tool message without id", map[string]any{"messages": []any{map[string]any{"role": "tool", "content": "x"}}}},
	}
	for _, c := range cases {
		code, out := post(t, base+"/v1/chat/completions", c.body)
		if code != 400 || out["error"] == nil {
			t.Errorf("%s: %d %v", c.name, code, out)
		}
	}
	if code, out := post(t, base+"/v1/chat/completions", map[string]any{"messages": user, "max_tokens": 4}); code != 200 {
		t.Fatalf("server stopped serving: %d %v", code, out)
	}
	// The same keyword in a tool's schema is relaxed, not refused (a client's real tools
	// carry pattern and maxLength 10,000): the forced call still comes back.
	code, out := post(t, base+"/v1/chat/completions", map[string]any{"messages": user, "tool_choice": "required", "max_tokens": 64, "temperature": 0,
		"tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "f", "parameters": map[string]any{"type": "object",
			"properties": map[string]any{"x": map[string]any{"type": "string", "pattern": "^a+$", "maxLength": 10000}}}}}}})
	if code != 200 {
		t.Fatalf("a tool schema with pattern: %d %v", code, out)
	}
	msg := out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)
	if calls, _ := msg["tool_calls"].([]any); len(calls) != 1 || calls[0].(map[string]any)["function"].(map[string]any)["name"] != "f" {
		t.Fatalf("a tool schema with pattern: no call of f: %v", msg)
	}
}
