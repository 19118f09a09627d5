package chat

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestParseHermes(t *testing.T) {
	cases := []struct {
		name, in, content string
		calls             []string // name:args
	}{
		{"one call", `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`, "", []string{`get_weather:{"city": "Paris"}`}},
		{"text around", "Let me check.\n<tool_call>\n{\"name\":\"f\",\"arguments\":{}}\n</tool_call>\nDone.", "Let me check.\n\nDone.", []string{"f:{}"}},
		{"two calls", `<tool_call>{"name":"a","arguments":{"x":1}}</tool_call><tool_call>{"name":"b","arguments":"{\"y\": 2}"}</tool_call>`, "", []string{`a:{"x":1}`, `b:{"y": 2}`}},
		{"malformed json stays content", `<tool_call>{"name": "f", "arguments": {</tool_call>`, `<tool_call>{"name": "f", "arguments": {</tool_call>`, nil},
		{"no name stays content", `<tool_call>{"arguments": {}}</tool_call>`, `<tool_call>{"arguments": {}}</tool_call>`, nil},
		{"partial unterminated but complete json", `<tool_call>{"name":"f","arguments":{"q":"x"}}`, "", []string{`f:{"q":"x"}`}},
		{"partial unterminated truncated", `ok <tool_call>{"name":"f","argu`, `ok <tool_call>{"name":"f","argu`, nil},
		{"plain text", "just words", "just words", nil},
	}
	for _, c := range cases {
		content, calls := Parse(FormatHermes, c.in)
		if content != c.content || len(calls) != len(c.calls) {
			t.Fatalf("%s: content %q calls %v", c.name, content, calls)
		}
		for i, want := range c.calls {
			got := calls[i].Function.Name + ":" + calls[i].Function.Arguments
			if got != want || calls[i].Type != "function" || !strings.HasPrefix(calls[i].ID, "call_") {
				t.Fatalf("%s: call %d = %q (%+v), want %q", c.name, i, got, calls[i], want)
			}
		}
	}
}

func TestParseLlama3(t *testing.T) {
	content, calls := Parse(FormatLlama3, `<|python_tag|>{"name": "search", "parameters": {"q": "go"}}`)
	if content != "" || len(calls) != 1 || calls[0].Function.Name != "search" || calls[0].Function.Arguments != `{"q": "go"}` {
		t.Fatalf("python tag: %q %+v", content, calls)
	}
	_, calls = Parse(FormatLlama3, `{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": true}}`)
	if len(calls) != 2 || calls[1].Function.Arguments != `{"k": true}` {
		t.Fatalf("two calls: %+v", calls)
	}
	for _, in := range []string{`The answer is 4.`, `{"not": "a call"}`, `{"name": "a", "parameters": {}} trailing words`, `{"name": "a", "param`} {
		if content, calls := Parse(FormatLlama3, in); len(calls) != 0 || content != strings.TrimSpace(in) {
			t.Fatalf("%q parsed as %q %+v", in, content, calls)
		}
	}
}

func TestParseMistral(t *testing.T) {
	content, calls := Parse(FormatMistral, `Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "neg", "arguments": {"x": 3}}]`)
	if content != "Sure." || len(calls) != 2 || calls[0].Function.Arguments != `{"a": 1, "b": 2}` || len(calls[0].ID) != 9 {
		t.Fatalf("mistral: %q %+v", content, calls)
	}
	for _, in := range []string{`[TOOL_CALLS][{"name": "add", "arguments": {`, `[TOOL_CALLS] nonsense`, `[TOOL_CALLS][{"arguments": {}}]`} {
		if c, calls := Parse(FormatMistral, in); len(calls) != 0 || c != in {
			t.Fatalf("%q parsed as %q %+v", in, c, calls)
		}
	}
}

func TestDetectFormat(t *testing.T) {
	for tmpl, want := range map[string]Format{
		"{{ '[TOOL_CALLS]' }}": FormatMistral, "<|python_tag|>": FormatLlama3, "{% if tools %}<tool_call>{% endif %}": FormatHermes, "plain": FormatHermes,
	} {
		if got := DetectFormat(tmpl); got != want {
			t.Fatalf("%q: %s, want %s", tmpl, got, want)
		}
	}
}

const chatml = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nDefault system<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"

func TestRenderJinja(t *testing.T) {
	r := NewRenderer(chatml, "", "<|im_end|>")
	if r.Path() != PathJinja {
		t.Fatalf("path %s", r.Path())
	}
	got, err := r.Render([]Message{{Role: "user", Content: "hi"}}, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	if want := "<|im_start|>system\nDefault system<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"; got != want {
		t.Fatalf("render %q, want %q", got, want)
	}
}

func TestRenderInjectsToolsForTemplatesWithout(t *testing.T) {
	r := NewRenderer(chatml, "", "")
	tools := []Tool{{Type: "function", Function: ToolFunction{Name: "get_weather", Description: "Weather for a city",
		Parameters: json.RawMessage(`{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}`)}}}
	got, err := r.Render([]Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Paris?"}}, tools, true)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<|im_start|>system\nBe brief.\n\n", `"name": "get_weather"`, `"required": ["city"]`, "<tool_call>", "<|im_start|>user\nParis?"} {
		if !strings.Contains(got, want) {
			t.Fatalf("render lacks %q:\n%s", want, got)
		}
	}
}

func TestRenderToolHistoryThroughTemplate(t *testing.T) {
	tmpl := `{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}
{% endfor %}{% if tools %}TOOLS {{ tools | tojson }}{% endif %}`
	r := NewRenderer(tmpl, "", "")
	msgs := []Message{
		{Role: "user", Content: "2+2?"},
		{Role: "assistant", ToolCalls: []ToolCall{{ID: "call_1", Type: "function", Function: FunctionCall{Name: "add", Arguments: `{"a": 2, "b": 2}`}}}},
		{Role: "tool", ToolCallID: "call_1", Content: "4"},
	}
	tools := []Tool{{Type: "function", Function: ToolFunction{Name: "add", Parameters: json.RawMessage(`{"type":"object"}`)}}}
	got, err := r.Render(msgs, tools, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`CALL add {"a": 2, "b": 2}`, "[tool]4 (for call_1)", `TOOLS [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]`} {
		if !strings.Contains(got, want) {
			t.Fatalf("render lacks %q:\n%s", want, got)
		}
	}
}

func TestRenderRaiseExceptionAndNoTemplate(t *testing.T) {
	r := NewRenderer(`{{ raise_exception("roles must alternate") }}`, "", "")
	if _, err := r.Render([]Message{{Role: "user", Content: "x"}}, nil, true); !errors.Is(err, ErrTemplateRaised) || !strings.Contains(err.Error(), "roles must alternate") {
		t.Fatalf("raise_exception: %v", err)
	}
	// No silent fallback: a template that does not compile, or none at all, refuses
	// every render with an error naming the flag that fixes it.
	for _, src := range []string{`{% for %}`, ""} {
		bad := NewRenderer(src, "", "")
		if bad.Path() != PathNone || bad.Err() == nil {
			t.Fatalf("%q: path %s err %v", src, bad.Path(), bad.Err())
		}
		_, err := bad.Render([]Message{{Role: "user", Content: "x"}}, []Tool{{Type: "function", Function: ToolFunction{Name: "f"}}}, true)
		if !errors.Is(err, ErrNoTemplate) || !strings.Contains(err.Error(), "--chat-template") {
			t.Fatalf("%q: %v", src, err)
		}
	}
	// An engine failure that is not raise_exception is its own error, not a fallback.
	if _, err := NewRenderer(`{{ messages[0].content.nope() }}`, "", "").Render([]Message{{Role: "user", Content: "x"}}, nil, true); !errors.Is(err, ErrTemplateFailed) {
		t.Fatalf("engine failure: %v", err)
	}
}

func TestCallGrammarShape(t *testing.T) {
	g := CallGrammar(FormatHermes, "root ::= \"{\" space \"}\"\nspace ::= \" \"?\n", true)
	if !strings.HasPrefix(g, `root ::= "<tool_call>" tool-call-json "</tool_call>"`) || !strings.Contains(g, "tool-call-json ::= \"{\"") {
		t.Fatalf("grammar:\n%s", g)
	}
	schema, err := CallSchema(FormatHermes, []Tool{{Function: ToolFunction{Name: "a"}}, {Function: ToolFunction{Name: "b"}}})
	if err != nil || !strings.Contains(string(schema), `"anyOf"`) || !strings.Contains(string(schema), `"const": "b"`) || strings.Index(string(schema), `"name"`) > strings.Index(string(schema), `"arguments"`) {
		t.Fatalf("schema %s %v", schema, err)
	}
}

func TestSchemaToGBNF(t *testing.T) {
	g, err := SchemaToGBNF([]byte(`{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"},"unit":{"enum":["C","F"]}},"required":["city"]}`))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"root ::= \"{\" space \"\\\"city\\\"\" space \":\" space", `( "," space "\"days\"" space ":" space`, `"\"C\"" space | "\"F\"" space`} {
		if !strings.Contains(g, want) {
			t.Fatalf("grammar lacks %q:\n%s", want, g)
		}
	}
	arr, err := SchemaToGBNF([]byte(`{"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":3}`))
	if err != nil || !strings.Contains(arr, `"[" space root-item-1 ("," space root-item-1){0,2} "]" space`) {
		t.Fatalf("bounded array: %v\n%s", err, arr)
	}
	rec, err := SchemaToGBNF([]byte(`{"$defs":{"node":{"type":"object","properties":{"kids":{"type":"array","items":{"$ref":"#/$defs/node"}}}}},"$ref":"#/$defs/node"}`))
	if err != nil || !strings.Contains(rec, "ref--defs-node ::=") {
		t.Fatalf("recursive $ref: %v\n%s", err, rec)
	}
	for _, bad := range []string{`{"type":"string","pattern":"^a"}`, `{"allOf":[{}]}`, `{"type":"wat"}`, `not json`, `{"$ref":"http://x"}`, `{"type":"object","properties":{"a":{}},"required":["b"]}`} {
		if _, err := SchemaToGBNF([]byte(bad)); err == nil {
			t.Fatalf("schema %s accepted", bad)
		}
	}
}

func TestCallStreamReleasesTextBeforeACall(t *testing.T) {
	c := NewCallStream(FormatHermes)
	var out string
	for _, p := range []string{"Let me ", "check. <tool", "_call>{\"name\": \"f\", ", "\"arguments\": {\"x\": 1}}</tool_call>"} {
		out += c.Push(p)
	}
	if out != "Let me check. " {
		t.Fatalf("released %q", out)
	}
	fin := c.Finish()
	content, calls := fin.Content, fin.Calls
	if content != "" || len(calls) != 1 || calls[0].Function.Arguments != `{"x": 1}` {
		t.Fatalf("finish: %q %+v", content, calls)
	}
	// A partial marker that turns out not to be one is released at the end.
	c = NewCallStream(FormatHermes)
	got := c.Push("a <tool") + c.Push("box> b")
	if got != "a <toolbox> b" {
		t.Fatalf("false marker: %q", got)
	}
	if fin := c.Finish(); fin.Content != "" || fin.Calls != nil {
		content, calls := fin.Content, fin.Calls
		t.Fatalf("nothing should remain: %q %v", content, calls)
	}
	// A call that does not parse is returned as content.
	c = NewCallStream(FormatHermes)
	c.Push("<tool_call>{broken")
	if fin := c.Finish(); fin.Content != "<tool_call>{broken" || fin.Calls != nil {
		content, calls := fin.Content, fin.Calls
		t.Fatalf("broken call: %q %v", content, calls)
	}
	// Llama-3: a reply opening with JSON is held; prose streams.
	c = NewCallStream(FormatLlama3)
	if c.Push("  ") != "" || c.Push(`{"name": "f", "parameters": {}}`) != "" {
		t.Fatal("llama3 call released")
	}
	if fin := c.Finish(); len(fin.Calls) != 1 {
		t.Fatal("llama3 call not parsed")
	}
	c = NewCallStream(FormatLlama3)
	if c.Push("Hello") != "Hello" {
		t.Fatal("llama3 prose held")
	}
}
