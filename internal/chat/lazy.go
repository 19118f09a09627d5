package chat

import (
	"fmt"
	"strings"
)

// Trigger starts a lazy grammar (llama.cpp's lazy grammars): Word is literal text
// anywhere in the output; Pattern is a regular expression (ECMAScript, as std::regex)
// that must match the whole output so far, the grammar starting at its first capture
// group. Exactly one is set.
type Trigger struct {
	Word    string
	Pattern string
}

// AutoGrammar is tool_choice auto's grammar for format f: free text until the family's
// own call syntax starts (a trigger), then exactly the family's call syntax with each
// declared tool's name and argument schema, then the end of the reply (several calls
// only with parallel). Triggers follow llama.cpp's common/chat.cpp: the family's call
// opener as a word (a special token when the vocabulary has it), and for families whose
// calls are bare JSON, a call object naming a declared tool.
//
// Each family's file writes its own (family.grammar). ok is false
// where a tool cannot be written in the family's syntax so that its parser reads back a
// valid call (a name or key the syntax cannot carry, a text value the parser could
// misread): that reply stays unconstrained, and the parser keeps anything that is not
// a well-formed call as content.
func AutoGrammar(f Format, tools []Tool, parallel bool) (grammar string, triggers []Trigger, ok bool, err error) {
	return callGrammar(f, tools, parallel, false)
}

// callGrammar is AutoGrammar, or with forced ForcedGrammar's call rule (the same but
// for the variants only a lazy start needs): the family's grammar method, then the
// characters its JSON strings may not hold raw (finishChars).
func callGrammar(f Format, tools []Tool, parallel, forced bool) (grammar string, triggers []Trigger, ok bool, err error) {
	if len(tools) == 0 {
		return "", nil, false, nil
	}
	r := &callRules{gbnf: &gbnf{rules: map[string]string{}, relax: true}, tools: tools, parallel: parallel, forced: forced}
	triggers, ok, err = lookup(f).grammar(r)
	if !ok || err != nil {
		return "", nil, false, err
	}
	r.finishChars()
	return r.String(), triggers, true, nil
}

// ForcedGrammar is the grammar of a forced call (tool_choice "required", or a named
// function when named is set) in family f's own call syntax: auto's call rule for the
// callable tools, but not lazy, so the reply is a call from its first token (several,
// as the family writes parallel calls, only with parallel). The reply is then read by
// the family's parser as with auto. ok is false where f has no call grammar or the
// tools cannot be written in its syntax (AutoGrammar's ok): the caller falls back to
// Hermes tags (CallGrammar), which every family's parser also reads. named must be a
// declared tool (ok is false otherwise).
func ForcedGrammar(f Format, tools []Tool, named string, parallel bool) (grammar string, ok bool, err error) {
	callable := tools
	if named != "" {
		callable = nil
		for _, t := range tools {
			if t.Function.Name == named {
				callable = []Tool{t}
				break
			}
		}
	}
	g, _, ok, err := callGrammar(f, callable, parallel, true)
	return g, ok, err
}

// toolArgs compiles each tool's parameters schema into the grammar as rule args-I and
// returns the rule names. A tool without parameters takes an empty object.
func (c *gbnf) toolArgs(tools []Tool) ([]string, error) {
	out := make([]string, len(tools))
	for i, t := range tools {
		params := []byte(`{"type": "object", "properties": {}}`)
		if p := strings.TrimSpace(string(t.Function.Parameters)); p != "" && p != "null" {
			params = []byte(p)
		}
		if isEmptySchema(params) {
			// "parameters": {} declares arguments of any shape, but arguments are an
			// object in every family's syntax.
			params = []byte(`{"type": "object"}`)
		}
		node, err := parseOrdered(params)
		if err != nil {
			return nil, fmt.Errorf("tool %q: parameters are not valid JSON: %w", t.Function.Name, err)
		}
		c.root, c.refNS = node, fmt.Sprintf("t%d-", i)
		name := fmt.Sprintf("args-%d", i)
		r, err := c.visit(node, name)
		if err != nil {
			return nil, fmt.Errorf("tool %q: %w", t.Function.Name, err)
		}
		if r != name {
			c.rules[name] = r
		}
		out[i] = name
	}
	return out, nil
}

// TriggersAfterThinking adapts auto's triggers to a reply that starts inside a think
// block (PromptOpensThinking): a call opener written while reasoning is not a call,
// so every trigger first needs the block's closing tag. Words become patterns, since a
// trigger token would fire anywhere.
func TriggersAfterThinking(triggers []Trigger) []Trigger {
	var closes []string
	for _, tag := range thinkTags {
		closes = append(closes, regexQuote(tag[1]))
	}
	after := `[\s\S]*?(?:` + strings.Join(closes, "|") + `)`
	out := make([]Trigger, 0, len(triggers))
	for _, t := range triggers {
		if t.Word != "" {
			out = append(out, Trigger{Pattern: after + `[\s\S]*?(` + regexQuote(t.Word) + `)[\s\S]*`})
			continue
		}
		out = append(out, Trigger{Pattern: after + t.Pattern})
	}
	return out
}

// ForcedAfterThinking adapts a forced call's grammar to a reply that starts inside a
// think block (PromptOpensThinking(prompt)): the reasoning runs free to the block's
// closing tag, and the call follows it. Forced from the first token instead, the call
// would be written inside the block, where the parser reads it as reasoning.
func ForcedAfterThinking(grammar, prompt string) string {
	t := strings.TrimRight(prompt, " \n")
	closeTag := ""
	for _, tag := range thinkTags {
		if strings.HasSuffix(t, tag[0]) {
			closeTag = tag[1]
		}
	}
	if closeTag == "" || grammar == "" {
		return grammar
	}
	c := &gbnf{rules: map[string]string{}}
	start := c.textUntil(closeTag, nil)
	// Models leave a blank line after the block (newlines, which the reply's parser
	// drops there: Functionary 3.2 reads the call's name from the first line).
	c.rules["root"] = start + ` "\n"{0,2} forced-call`
	var out strings.Builder
	for _, line := range strings.Split(strings.TrimRight(c.String(), "\n"), "\n") {
		// The call grammar may have text-N rules of its own.
		out.WriteString(strings.ReplaceAll(line, "text-", "think-text-") + "\n")
	}
	for _, line := range strings.Split(strings.TrimRight(grammar, "\n"), "\n") {
		if strings.HasPrefix(line, "root ::=") {
			line = "forced-call ::=" + strings.TrimPrefix(line, "root ::=")
		}
		out.WriteString(line + "\n")
	}
	return out.String()
}

// regexQuote quotes s for an ECMAScript regular expression.
func regexQuote(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`.^$|()*+?[]{}\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// isEmptySchema reports whether b is the schema {} (any value).
func isEmptySchema(b []byte) bool {
	node, err := parseOrdered(b)
	o, ok := node.(*ordered)
	return err == nil && ok && len(o.keys) == 0
}
