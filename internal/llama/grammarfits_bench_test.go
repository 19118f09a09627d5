package llama

// BenchmarkGrammarFits measures what the grammar filter of speculative decoding
// (docs/speculative.md, grammar section) costs per proposal: GrammarFits clones the
// request's grammar sampler (llama.cpp copies its rules and its stacks) and walks the
// draft through the clone. The grammar is the server's for tool_choice "required" over
// 20 tools with nested object parameters (chat.ForcedGrammar, Hermes calls as SmolLM2
// writes them), at two points of a call: choosing the tool's name (20 alternatives on
// the stacks) and inside the arguments. Drafts of 1, 4 and 16 tokens separate the
// clone (the intercept) from the walk (per token). decode1 is one single-sequence
// decode step of SmolLM2 at position 300 on the same machine, for scale.
//
//	go test ./internal/llama -run '^$' -bench BenchmarkGrammarFits -benchtime 2s

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/testmodel"
)

// benchTools is n tools whose parameters nest objects three deep, with enums, arrays
// and required keys, as an agent's tool list does.
func benchTools(tb testing.TB, n int) []chat.Tool {
	tb.Helper()
	var tools []chat.Tool
	for i := range n {
		raw := fmt.Sprintf(`{"type":"function","function":{"name":"tool_%02d","description":"Tool %d.",
"parameters":{"type":"object","required":["id","options"],"properties":{
 "id":{"type":"string"},
 "count":{"type":"integer"},
 "options":{"type":"object","required":["mode"],"properties":{
  "mode":{"type":"string","enum":["fast","slow","auto"]},
  "tags":{"type":"array","items":{"type":"string"}},
  "limits":{"type":"object","properties":{"max":{"type":"integer"},"min":{"type":"integer"},"unit":{"type":"string"}}},
  "target":{"type":"object","required":["path"],"properties":{"path":{"type":"string"},"line":{"type":"integer"},"recursive":{"type":"boolean"}}}
 }}}}}}`, i, i)
		var t chat.Tool
		if err := json.Unmarshal([]byte(raw), &t); err != nil {
			tb.Fatal(err)
		}
		tools = append(tools, t)
	}
	return tools
}

func BenchmarkGrammarFits(b *testing.B) {
	m, err := LoadModel(testmodel.SmolLM2(b))
	if err != nil {
		b.Fatal(err)
	}
	defer m.Free()
	g, ok, err := chat.ForcedGrammar(chat.FormatHermes, benchTools(b, 20), "", false)
	if err != nil || !ok {
		b.Fatalf("grammar: ok %v, %v", ok, err)
	}
	b.Logf("grammar: %d bytes, %d rules", len(g), strings.Count(g, "::="))
	call := `<tool_call>
{"name": "tool_13", "arguments": {"id": "report-2026-12-04", "options": {"mode": "fast", "tags": ["alpha", "beta", "gamma"], "limits": {"max": 40, "min": 2, "unit": "tokens"}, "target": {"path": "docs/speculative.md", "line": 120, "recursive": false}}}}
</tool_call>`
	toks, err := m.Tokenize(call, false, false)
	if err != nil {
		b.Fatal(err)
	}
	for _, at := range []struct {
		name   string
		prefix string
	}{
		{"name", `<tool_call>` + "\n" + `{"name": "`},
		{"arguments", `<tool_call>` + "\n" + `{"name": "tool_13", "arguments": {"id": "report-2026-12-04", "options": {"mode": "fast", "tags": ["alpha", `},
	} {
		pre, _ := m.Tokenize(at.prefix, false, false)
		for i := range pre {
			if i >= len(toks) || toks[i] != pre[i] {
				// the prefix must tokenize as the call does, or the draft below is off
				pre = toks[:i]
				break
			}
		}
		s, err := NewSampler(m, SamplerParams{Grammar: g})
		if err != nil {
			b.Fatal(err)
		}
		for _, tok := range pre {
			if err := s.Accept(tok); err != nil {
				b.Fatalf("%s: the call's prefix does not fit the grammar: %v", at.name, err)
			}
		}
		for _, n := range []int{1, 4, 16} {
			draft := toks[len(pre) : len(pre)+n]
			if got := s.GrammarFits(m, draft); got != n {
				b.Fatalf("%s: %d of %d draft tokens fit", at.name, got, n)
			}
			b.Run(fmt.Sprintf("%s/draft%d", at.name, n), func(b *testing.B) {
				for b.Loop() {
					s.GrammarFits(m, draft)
				}
			})
		}
		s.Free()
	}
	b.Run("decode1", func(b *testing.B) {
		c, err := NewContext(m, ContextParams{NCtx: 512, NBatch: 512, NSeqMax: 1, NThreads: 2, KVUnified: true, FlashAttn: 1})
		if err != nil {
			b.Fatal(err)
		}
		defer c.Free()
		const pos = 300
		c.BatchClear()
		for p := range pos {
			if _, err := c.BatchAdd(Token(100+p%500), p, 0, p == pos-1); err != nil {
				b.Fatal(err)
			}
		}
		if err := c.Decode(); err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			c.BatchClear()
			if _, err := c.BatchAdd(Token(42), pos, 0, true); err != nil {
				b.Fatal(err)
			}
			if err := c.Decode(); err != nil {
				b.Fatal(err)
			}
			c.SeqRm(0, pos, -1)
		}
	})
}
