package api_test

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/api"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// familyRenderer is renderer for a template of tool-call family f; with think its
// generation prompt opens a think block (as DeepSeek R1's does).
type familyRenderer struct {
	renderer
	f     chat.Format
	think bool
}

func (r familyRenderer) Format() chat.Format { return r.f }

func (r familyRenderer) Render(msgs []chat.Message, tools []chat.Tool, gen bool) (string, error) {
	out, err := r.renderer.Render(msgs, tools, gen)
	if r.think && gen {
		out += "<think>\n"
	}
	return out, err
}

// newFamilyServer is newServer whose chat template implies the call format f.
func newFamilyServer(t *testing.T, f chat.Format, script []engine.Token) (string, *enginetest.Backend) {
	return newFamilyServerWith(t, familyRenderer{f: f}, script)
}

func newFamilyServerWith(t *testing.T, rend familyRenderer, script []engine.Token) (string, *enginetest.Backend) {
	t.Helper()
	cfg := engine.Config{NCtx: 512, Parallel: 2, NBatch: 64, MaxQueue: 8}
	sched, err := engine.NewScheduler(cfg, enginetest.Vocab{})
	if err != nil {
		t.Fatal(err)
	}
	be := enginetest.NewBackend(script)
	eng := engine.New(sched, be, nil)
	srv := api.New(eng, enginetest.Vocab{}, rend, api.Info{ModelID: "fake", NCtx: cfg.NCtx, Parallel: cfg.Parallel,
		NBatch: cfg.NBatch, NVocab: enginetest.NVocab}, nil, nil)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	return ts.URL, be
}

// tool_choice required and a named function hand the engine the family's own forced
// call grammar (chat.ForcedGrammar: not lazy, no triggers), only the named tool for a
// named choice, and the reply, written in the family's syntax, comes back as tool_calls.
// Hermes tags only where the family has no grammar or cannot write the tools.
func TestForcedToolChoiceSendsFamilyGrammar(t *testing.T) {
	weather := map[string]any{"type": "function", "function": map[string]any{"name": "get_weather",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}, "required": []string{"city"}}}}
	add := map[string]any{"type": "function", "function": map[string]any{"name": "add",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"a": map[string]any{"type": "integer"}}}}}
	var tools []chat.Tool
	raw, _ := json.Marshal([]any{weather, add})
	if err := json.Unmarshal(raw, &tools); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		f     chat.Format
		reply string // a call of get_weather as the family writes it
	}{
		{chat.FormatHermes, `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`},
		{chat.FormatMistral, `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]`},
		{chat.FormatMistralArgs, `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`},
		{chat.FormatLlama3, `{"name": "get_weather", "parameters": {"city": "Paris"}}`},
		{chat.FormatQwenXML, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"},
		{chat.FormatGranite, `<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]`},
		{chat.FormatKimiK2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>`},
		{chat.FormatLFM2, `<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>`},
	}
	for _, tc := range cases {
		url, be := newFamilyServer(t, tc.f, append(enginetest.Bytes(tc.reply), enginetest.EOG))
		for _, choice := range []any{"required", map[string]any{"type": "function", "function": map[string]any{"name": "get_weather"}}} {
			r := do(t, "POST", url+"/v1/chat/completions", map[string]any{"messages": chatMsgs, "tools": []any{weather, add},
				"tool_choice": choice, "max_tokens": 200})
			if r.code != 200 {
				t.Fatalf("%s: %d %s", tc.f, r.code, r.raw)
			}
			p := be.Params()[len(be.Params())-1]
			named := ""
			if _, ok := choice.(string); !ok {
				named = "get_weather"
			}
			want, ok, err := chat.ForcedGrammar(tc.f, tools, named, false)
			if !ok || err != nil {
				t.Fatalf("%s: ok %v err %v", tc.f, ok, err)
			}
			if p.Grammar != want || p.GrammarTriggers != nil {
				t.Fatalf("%s %v: grammar (triggers %v)\n%s\nwant\n%s", tc.f, choice, p.GrammarTriggers, p.Grammar, want)
			}
			if tc.f != chat.FormatHermes && tc.f != chat.FormatQwenXML && strings.Contains(p.Grammar, `"<tool_call>"`) {
				t.Fatalf("%s: Hermes tags in the forced grammar:\n%s", tc.f, p.Grammar)
			}
			if named != "" && strings.Contains(p.Grammar, `add`) {
				t.Fatalf("%s: the named grammar offers another tool:\n%s", tc.f, p.Grammar)
			}
			ch := r.body["choices"].([]any)[0].(map[string]any)
			msg := ch["message"].(map[string]any)
			calls, _ := msg["tool_calls"].([]any)
			if ch["finish_reason"] != "tool_calls" || len(calls) != 1 || msg["content"] != nil {
				t.Fatalf("%s: finish %v message %v", tc.f, ch["finish_reason"], msg)
			}
			fn := calls[0].(map[string]any)["function"].(map[string]any)
			var args map[string]any
			if fn["name"] != "get_weather" || json.Unmarshal([]byte(fn["arguments"].(string)), &args) != nil || args["city"] != "Paris" {
				t.Fatalf("%s: call %v", tc.f, fn)
			}
		}
	}
	// No grammar of its own, or a tool name the XML syntax cannot carry: Hermes tags.
	for _, tc := range []struct {
		f    chat.Format
		tool string
	}{{chat.Format("no_such_family"), "get_weather"}, {chat.FormatQwenXML, "1weather"}} {
		url, be := newFamilyServer(t, tc.f, append(enginetest.Bytes("ok"), enginetest.EOG))
		tool := map[string]any{"type": "function", "function": map[string]any{"name": tc.tool}}
		if r := do(t, "POST", url+"/v1/chat/completions", map[string]any{"messages": chatMsgs, "tools": []any{tool},
			"tool_choice": "required", "max_tokens": 4}); r.code != 200 {
			t.Fatalf("%s: %d %s", tc.f, r.code, r.raw)
		}
		p := be.Params()[len(be.Params())-1]
		if p.GrammarTriggers != nil || !strings.HasPrefix(p.Grammar, `root ::= "<tool_call>"`) {
			t.Fatalf("%s fallback: %+v", tc.f, p)
		}
	}
}

// A prompt that opens a think block: the forced grammar lets the reasoning run to the
// closing tag, then forces the call (chat.ForcedAfterThinking); the reply comes back as
// reasoning_content and tool_calls.
func TestForcedToolChoiceAfterThinking(t *testing.T) {
	weather := map[string]any{"type": "function", "function": map[string]any{"name": "get_weather",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}, "required": []string{"city"}}}}
	reply := "Paris, then.</think>\n\n[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}"
	url, be := newFamilyServerWith(t, familyRenderer{f: chat.FormatMistralArgs, think: true}, append(enginetest.Bytes(reply), enginetest.EOG))
	r := do(t, "POST", url+"/v1/chat/completions", map[string]any{"messages": chatMsgs, "tools": []any{weather},
		"tool_choice": "required", "max_tokens": 200})
	if r.code != 200 {
		t.Fatalf("%d %s", r.code, r.raw)
	}
	p := be.Params()[len(be.Params())-1]
	if p.GrammarTriggers != nil || !strings.HasPrefix(p.Grammar, "root ::= think-text-") || !strings.Contains(p.Grammar, "forced-call ::= call\n") || !strings.Contains(p.Grammar, `call ::= "[TOOL_CALLS]"`) {
		t.Fatalf("forced after thinking: %+v", p)
	}
	msg := r.body["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)
	calls, _ := msg["tool_calls"].([]any)
	if msg["reasoning_content"] != "Paris, then." || len(calls) != 1 || msg["content"] != nil {
		t.Fatalf("message %v", msg)
	}
}
