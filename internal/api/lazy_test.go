package api_test

import (
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// tool_choice auto hands the engine a lazy grammar (the family's call syntax, started by
// its triggers); none and a response_format do not, and required is the family's call
// rule, not lazy (forced_test.go: every family).
func TestAutoToolChoiceSendsLazyGrammar(t *testing.T) {
	url, be := newServer(t, append(enginetest.Bytes("ok"), enginetest.EOG))
	tool := map[string]any{"type": "function", "function": map[string]any{"name": "get_weather",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}, "required": []string{"city"}}}}
	last := func(body map[string]any) engine.SamplingParams {
		t.Helper()
		if r := do(t, "POST", url+"/v1/chat/completions", body); r.code != 200 {
			t.Fatalf("%d %s", r.code, r.raw)
		}
		p := be.Params()
		return p[len(p)-1]
	}
	p := last(map[string]any{"messages": chatMsgs, "tools": []any{tool}, "max_tokens": 4})
	if !strings.Contains(p.Grammar, `"<tool_call>"`) || !strings.Contains(p.Grammar, `get_weather`) || !strings.Contains(p.Grammar, `city`) {
		t.Fatalf("auto grammar:\n%s", p.Grammar)
	}
	words := map[string]bool{}
	for _, tr := range p.GrammarTriggers {
		words[tr.Word] = true
	}
	if !words["<tool_call>"] || len(p.GrammarTriggers) < 2 {
		t.Fatalf("auto triggers %+v", p.GrammarTriggers)
	}
	if p := last(map[string]any{"messages": chatMsgs, "tools": []any{tool}, "tool_choice": "none", "max_tokens": 4}); p.Grammar != "" || p.GrammarTriggers != nil {
		t.Fatalf("tool_choice none: %+v", p)
	}
	if p := last(map[string]any{"messages": chatMsgs, "max_tokens": 4}); p.Grammar != "" || p.GrammarTriggers != nil {
		t.Fatalf("no tools: %+v", p)
	}
	p = last(map[string]any{"messages": chatMsgs, "tools": []any{tool}, "response_format": map[string]any{"type": "json_object"}, "max_tokens": 4})
	if p.GrammarTriggers != nil || strings.Contains(p.Grammar, "tool_call") || p.Grammar == "" {
		t.Fatalf("auto + response_format: %+v", p)
	}
	p = last(map[string]any{"messages": chatMsgs, "tools": []any{tool}, "tool_choice": "required", "max_tokens": 4})
	if p.GrammarTriggers != nil || !strings.HasPrefix(p.Grammar, "root ::= tagged\n") || !strings.Contains(p.Grammar, `tagged ::= "<tool_call>"`) {
		t.Fatalf("required: %+v", p)
	}
	if be.Samplers() != 0 {
		t.Fatalf("%d samplers left", be.Samplers())
	}
}
