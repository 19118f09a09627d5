package chat

import (
	"encoding/json"
	"os"
	"strings"
	"testing"
)

// These pin the transformers behaviours the corpus test measures, without the corpus.

func renderOne(t *testing.T, tmpl string, msgs []Message, tools []Tool) string {
	t.Helper()
	r := NewRenderer(tmpl, "<s>", "</s>")
	if r.Err() != nil {
		t.Fatalf("compile: %v", r.Err())
	}
	out, err := r.Render(msgs, tools, false)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	return out
}

func TestRenderKeepsClientKeyOrderAndIsDeterministic(t *testing.T) {
	var tools []Tool
	raw := `[{"type": "function", "function": {"name": "zeta", "description": "z", "parameters": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "required": ["b"]}}}]`
	if err := json.Unmarshal([]byte(raw), &tools); err != nil {
		t.Fatal(err)
	}
	msgs := []Message{{Role: "user", Content: "x"}, {Role: "assistant", NullContent: true, ToolCalls: []ToolCall{{ID: "a1B2c3D4e", Function: FunctionCall{Name: "zeta", Arguments: `{"z": 1, "a": [1.5, 2], "m": {"y": null, "b": true}}`}}}}}
	tmpl := `{{ tools | tojson }}|{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% for k, v in c.function.arguments | items %}<{{ k }}>{% endfor %}{% endfor %}{% endfor %}|{{ dict(b=1, a=2) | tojson }}`
	want := raw + `|{"z": 1, "a": [1.5, 2], "m": {"y": null, "b": true}}<z><a><m>|{"b": 1, "a": 2}`
	for i := range 30 {
		if got := renderOne(t, tmpl, msgs, tools); got != want {
			t.Fatalf("run %d:\n got %s\nwant %s", i, got, want)
		}
	}
}

func TestRenderPassesTheClientsMessageKeys(t *testing.T) {
	raw := json.RawMessage(`{"thinking": "hmm", "role": "developer", "content": [{"type": "text", "text": "be brief"}], "x": {"b": 1, "a": 2}}`)
	out := renderOne(t, `{% for k, v in messages[0] | items %}{{ k }}={{ v }};{% endfor %}`, []Message{{Role: "developer", Content: "be brief", Raw: raw}}, nil)
	if out != "thinking=hmm;role=system;content=be brief;x={'b': 1, 'a': 2};" {
		t.Fatalf("%q", out)
	}
}

func TestRenderToJSONArgumentsAsJSONDumps(t *testing.T) {
	msgs := []Message{{Role: "user", Content: "é \"q\" <b> \u2028 \x01"}}
	cases := map[string]string{
		`{{ messages[0] | tojson }}`:                                 `{"role": "user", "content": "é \"q\" <b> ` + "\u2028" + ` \u0001"}`,
		`{{ messages[0] | tojson(ensure_ascii=True) }}`:              `{"role": "user", "content": "\u00e9 \"q\" <b> \u2028 \u0001"}`,
		`{{ messages[0] | tojson(indent=2) }}`:                       "{\n  \"role\": \"user\",\n  \"content\": \"é \\\"q\\\" <b> \u2028 \\u0001\"\n}",
		`{{ messages[0] | tojson(sort_keys=True) }}`:                 `{"content": "é \"q\" <b> ` + "\u2028" + ` \u0001", "role": "user"}`,
		`{{ {"a": [1, 2]} | tojson(separators=(",", ":")) }}`:        `{"a":[1,2]}`,
		`{{ [] | tojson(indent=4) }}|{{ {} | tojson(indent=4) }}`:    `[]|{}`,
		`{{ 1.0 }} {{ 0.00001 }} {{ [0.5, 0.0000001, 2] | tojson }}`: `1.0 1e-05 [0.5, 1e-07, 2]`,
	}
	for tmpl, want := range cases {
		if got := renderOne(t, tmpl, msgs, nil); got != want {
			t.Errorf("%s:\n got %q\nwant %q", tmpl, got, want)
		}
	}
}

func TestRenderPythonValuesAndTransformersGlobals(t *testing.T) {
	msgs := []Message{{Role: "assistant", NullContent: true, ToolCalls: []ToolCall{{ID: "x", Function: FunctionCall{Name: "f", Arguments: "{}"}}}}}
	cases := map[string]string{
		// content null prints as Python's None, and is none, not "".
		`{{ messages[0].content }}|{{ messages[0].content is none }}`: `None|True`,
		// transformers passes tools=None and documents=None: defined, but none.
		`{{ tools is defined }} {{ tools is none }} {{ documents is none }}`: `True True True`,
		`{{ bos_token }}{{ eos_token }}`:                                     `<s></s>`,
		`{{ {'a': "it's", 'b': none, 'c': [true]} }}`:                        `{'a': "it's", 'b': None, 'c': [True]}`,
		// trim_blocks and lstrip_blocks, as transformers sets them.
		"a\n  {% if true %}\nb\n  {% endif %}\nc": "a\nb\nc",
		// |safe gives Markup; Markup + str escapes the str, as jinja2 does (functionary v3.1).
		`{{ "<b>"|safe + '"x" & y' }}|{{ '<i>' + "<b>"|safe }}|{{ "a"|safe + "b"|safe }}`: `<b>&#34;x&#34; &amp; y|&lt;i&gt;<b>|ab`,
		// loopcontrols.
		`{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}`: `02`,
	}
	for tmpl, want := range cases {
		if got := renderOne(t, tmpl, msgs, nil); got != want {
			t.Errorf("%s:\n got %q\nwant %q", tmpl, got, want)
		}
	}
	if got := renderOne(t, `{{ strftime_now("%Y") | length }}`, msgs, nil); got != "4" {
		t.Errorf("strftime_now: %q", got)
	}
}

func TestRenderChatTemplateKwargs(t *testing.T) {
	r := NewRenderer(`{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{{ reasoning_effort | default("medium") }}`, "", "")
	out, err := r.RenderOpts([]Message{{Role: "user", Content: "x"}}, nil, Options{Kwargs: json.RawMessage(`{"enable_thinking": false, "reasoning_effort": "high"}`)})
	if err != nil || out != "<think></think>high" {
		t.Fatalf("kwargs: %q %v", out, err)
	}
	if _, err := r.RenderOpts(nil, nil, Options{Kwargs: json.RawMessage(`[1]`)}); err == nil || !strings.Contains(err.Error(), "chat_template_kwargs") {
		t.Fatalf("non-object kwargs: %v", err)
	}
	if _, err := r.RenderOpts(nil, nil, Options{Kwargs: json.RawMessage(`{"messages": []}`)}); err == nil || !strings.Contains(err.Error(), `"messages"`) {
		t.Fatalf("kwargs overriding messages: %v", err)
	}
}

func TestResolveTemplate(t *testing.T) {
	if src, from, err := ResolveTemplate("G", "", ""); src != "G" || from != "gguf" || err != nil {
		t.Fatalf("gguf: %q %q %v", src, from, err)
	}
	src, from, err := ResolveTemplate("", "chatml", "")
	if err != nil || from != "builtin:chatml" {
		t.Fatalf("chatml: %v %s", err, from)
	}
	out, err := NewRenderer(src, "", "").Render([]Message{{Role: "user", Content: "hi"}}, nil, true)
	if err != nil || out != "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" {
		t.Fatalf("chatml render: %q %v", out, err)
	}
	for _, n := range BuiltinTemplateNames() {
		if r := NewRenderer(builtinTemplates[n], "<s>", "</s>"); r.Err() != nil {
			t.Fatalf("builtin %s: %v", n, r.Err())
		} else if _, err := r.Render([]Message{{Role: "system", Content: "s"}, {Role: "user", Content: "u"}}, nil, true); err != nil {
			t.Fatalf("builtin %s: %v", n, err)
		}
	}
	if src, from, _ := ResolveTemplate("G", "{{ 'x' }}", ""); src != "{{ 'x' }}" || from != "inline" {
		t.Fatalf("inline: %q %q", src, from)
	}
	if _, _, err := ResolveTemplate("", "nope", ""); err == nil || !strings.Contains(err.Error(), "chatml") {
		t.Fatalf("unknown name: %v", err)
	}
	p := t.TempDir() + "/t.jinja"
	if err := os.WriteFile(p, []byte("{{ 'f' }}"), 0o644); err != nil {
		t.Fatal(err)
	}
	if src, from, err := ResolveTemplate("G", "", p); src != "{{ 'f' }}" || from != "file:"+p || err != nil {
		t.Fatalf("file: %q %q %v", src, from, err)
	}
	if _, _, err := ResolveTemplate("G", "chatml", p); err == nil {
		t.Fatal("both flags accepted")
	}
}
