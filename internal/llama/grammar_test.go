package llama

import (
	"errors"
	"strings"
	"testing"
)

// callGrammar is a tiny Hermes-style call grammar: the tag, then one JSON object with
// a fixed name.
const callGrammar = `root ::= "<tool_call>" space "{" space "\"name\"" space ":" space "\"get_weather\"" space "}" space "</tool_call>"
space ::= | " " | "\n"
`

func acceptText(t *testing.T, m *Model, s *Sampler, text string) error {
	t.Helper()
	toks, err := m.Tokenize(text, false, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range toks {
		if err := s.Accept(tok); err != nil {
			return err
		}
	}
	return nil
}

// A lazy grammar whose trigger is followed by text the grammar rejects must report
// ErrGrammar instead of letting llama.cpp's std::runtime_error abort the process, and
// the sampler must refuse further use (llama.cpp would assert on its empty stacks).
func TestLazyGrammarBrokenAfterTriggerIsAnError(t *testing.T) {
	m := testModel(t)
	s, err := NewSampler(m, SamplerParams{Grammar: callGrammar, GrammarTriggers: []GrammarTrigger{{Word: "<tool_call>"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	// Free text before the trigger is not constrained.
	if err := acceptText(t, m, s, "Let me look that up for you. "); err != nil {
		t.Fatalf("free text before the trigger: %v", err)
	}
	err = acceptText(t, m, s, "<tool_call>[oops")
	if !errors.Is(err, ErrGrammar) {
		t.Fatalf("text after the trigger that breaks the grammar: err = %v, want ErrGrammar", err)
	}
	if err2 := s.Accept(100); !errors.Is(err2, ErrGrammar) {
		t.Fatalf("a failed sampler accepted again: %v", err2)
	}
	if _, err2 := s.Sample(nil, 0); !errors.Is(err2, ErrGrammar) {
		t.Fatalf("a failed sampler sampled again: %v", err2)
	}
	// Without its grammar the chain goes on.
	s.DropGrammar()
	if s.HasGrammar() {
		t.Fatal("grammar still there")
	}
	if err := acceptText(t, m, s, "<tool_call>[oops again"); err != nil {
		t.Fatalf("after DropGrammar: %v", err)
	}
}

// The same grammar accepts a well-formed call after free text, and a strict (not lazy)
// grammar fails on the first token that does not fit.
func TestLazyGrammarAcceptsCallAfterFreeText(t *testing.T) {
	m := testModel(t)
	s, err := NewSampler(m, SamplerParams{Grammar: callGrammar, GrammarTriggers: []GrammarTrigger{{Word: "<tool_call>"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	if err := acceptText(t, m, s, `Sure. <tool_call>{"name": "get_weather"}</tool_call>`); err != nil {
		t.Fatalf("well-formed call: %v", err)
	}
	strict, err := NewSampler(m, SamplerParams{Grammar: callGrammar})
	if err != nil {
		t.Fatal(err)
	}
	defer strict.Free()
	if err := acceptText(t, m, strict, "Sure."); !errors.Is(err, ErrGrammar) {
		t.Fatalf("strict grammar accepted free text: %v", err)
	}
}

// Long free text before any trigger: llama.cpp matches the trigger regex against the
// whole output after every token (libstdc++'s regex recurses per character), so this
// checks that a reply far longer than a usual max_tokens neither crashes nor fails.
func TestLazyGrammarLongFreeText(t *testing.T) {
	m := testModel(t)
	s, err := NewSampler(m, SamplerParams{Grammar: callGrammar, GrammarTriggers: []GrammarTrigger{{Word: "<tool_call>"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	text := strings.Repeat("The weather in Paris is mild today, with a light breeze.\n", 300) // ~17,000 chars
	if err := acceptText(t, m, s, text); err != nil {
		t.Fatal(err)
	}
	if err := acceptText(t, m, s, `<tool_call>{"name": "get_weather"}</tool_call>`); err != nil {
		t.Fatalf("call after long text: %v", err)
	}
}

// A trigger pattern std::regex refuses is an error from NewSampler, not an abort.
func TestLazyGrammarBadPattern(t *testing.T) {
	m := testModel(t)
	if _, err := NewSampler(m, SamplerParams{Grammar: callGrammar, GrammarTriggers: []GrammarTrigger{{Pattern: "([unclosed"}}}); err == nil {
		t.Fatal("a malformed trigger regex was accepted")
	}
}

func TestEscapeRegex(t *testing.T) {
	if got := escapeRegex(`[TOOL_CALLS]{"a".b}|x`); got != `\[TOOL_CALLS\]\{"a"\.b\}\|x` {
		t.Fatalf("escapeRegex = %s", got)
	}
}

// GrammarFits (speculative drafts) counts the tokens of a continuation the grammar
// allows, stops at the first it forbids, counts an end-of-generation token only where
// the grammar may end, and leaves the sampler's grammar as it was: the same tokens
// then fit again and are accepted.
func TestGrammarFits(t *testing.T) {
	m := testModel(t)
	s, err := NewSampler(m, SamplerParams{Grammar: callGrammar})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	if err := acceptText(t, m, s, `<tool_call>{"name"`); err != nil {
		t.Fatal(err)
	}
	good, err := m.Tokenize(`: "get_weather"}</tool_call>`, false, false)
	if err != nil {
		t.Fatal(err)
	}
	bad, _ := m.Tokenize(`: "get_time"}`, false, false)
	cut := 0
	for cut < len(bad) && cut < len(good) && bad[cut] == good[cut] {
		cut++
	}
	if n := s.GrammarFits(m, bad); n != cut {
		t.Errorf("a call of another tool: %d tokens fit, want %d (the common prefix)", n, cut)
	}
	withEOG := append(append([]Token(nil), good...), m.EOS(), good[0])
	if n := s.GrammarFits(m, withEOG); n != len(good)+1 {
		t.Errorf("the call then end of generation: %d of %d tokens fit, want %d (up to the end)", n, len(withEOG), len(good)+1)
	}
	if n := s.GrammarFits(m, append([]Token{m.EOS()}, good...)); n != 0 {
		t.Errorf("end of generation mid-call: %d tokens fit, want 0", n)
	}
	if n := s.GrammarFits(m, good); n != len(good) {
		t.Errorf("the rest of the call: %d of %d tokens fit", n, len(good))
	}
	for _, tok := range good {
		if err := s.Accept(tok); err != nil {
			t.Fatalf("after GrammarFits the grammar refused the call: %v", err)
		}
	}
	// Without a grammar (a lazy one not started yet, or none) everything fits.
	free, _ := NewSampler(m, SamplerParams{})
	defer free.Free()
	if n := free.GrammarFits(m, bad); n != len(bad) {
		t.Errorf("no grammar: %d of %d fit", n, len(bad))
	}
}
