package chat

import (
	"encoding/json"
	"regexp"
	"strings"
)

// llama3: a JSON object {"name": ..., "parameters": {...}}, optionally after
// <|python_tag|>, possibly with text around it (Llama 3.1-3.3, Firefunction v2).
type llama3 struct{}

func (llama3) format() Format { return FormatLlama3 }
func (llama3) detect(has func(...string) bool) bool {
	return has("<|python_tag|>") || has("ipython")
}
func (llama3) markers() *markers { return llama3Markers }

var llama3Head = regexp.MustCompile(`(?:^|<\|python_tag\|>)\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*`)

var llama3Markers = &markers{
	// Llama 3.x may write its JSON call after some text: hold from where a call
	// object would start (llama.cpp triggers on the same shapes).
	triggers:      []string{"<|python_tag|>", `{"name"`, `{"type"`, `{ "name"`, `{ "type"`},
	head:          llama3Head,
	opensWithJSON: true,
	argsKey:       "parameters",
}

func (llama3) parse(ps *parser, text string) Parsed { return ps.llama3(text) }

func (llama3) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	r.rules["call"] = r.jsonCall("name", "parameters")
	r.rules["root"] = `"<|python_tag|>"? space call` + r.more(`(";" | "\n") space`, "call")
	return []Trigger{{Word: "<|python_tag|>"}, {Pattern: `[\s\S]*?(` + r.nameStart() + `)[\s\S]*`}}, true, nil
}

// wrapCall: a forced call is the bare object.
func (llama3) wrapCall(callRule string, _ bool) string { return "root ::= " + callRule + "\n" }

// llama3: optional <|python_tag|>, then JSON call objects separated by ";" or
// newlines; or one call object inside text.
func (ps *parser) llama3(text string) Parsed {
	t := strings.TrimSpace(text)
	if rest, ok := strings.CutPrefix(t, "<|python_tag|>"); ok {
		t = strings.TrimSpace(rest)
	}
	if strings.HasPrefix(t, "{") {
		var calls []ToolCall
		all := true
		for _, part := range splitJSONObjects(t) {
			c, ok := ps.callFromJSON(part, "parameters", "arguments")
			if !ok {
				all = false
				break
			}
			calls = append(calls, c)
		}
		if all && len(calls) > 0 {
			return Parsed{Calls: calls}
		}
		ps.n = 0
	}
	// Text around one call: the first '{' that starts a call object naming a
	// declared tool.
	for i := strings.IndexByte(text, '{'); i >= 0; {
		dec := json.NewDecoder(strings.NewReader(text[i:]))
		var raw json.RawMessage
		if dec.Decode(&raw) == nil {
			if c, ok := ps.callFromJSON(string(raw), "parameters", "arguments"); ok && ps.known(c.Function.Name) && len(ps.tools) > 0 {
				end := i + int(dec.InputOffset())
				return Parsed{Content: strings.TrimSpace(text[:i] + text[end:]), Calls: []ToolCall{c}}
			}
		}
		k := strings.IndexByte(text[i+1:], '{')
		if k < 0 {
			break
		}
		i += 1 + k
	}
	return Parsed{Content: strings.TrimSpace(text)}
}

// splitJSONObjects splits "{...}; {...}" or "{...}\n{...}" into objects.
func splitJSONObjects(s string) []string {
	dec := json.NewDecoder(strings.NewReader(s))
	var out []string
	for {
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			rest := strings.TrimSpace(s[dec.InputOffset():])
			if rest != "" {
				// A trailing separator like ";" is fine, anything else is not a call list.
				if strings.HasPrefix(rest, ";") {
					return append(out, splitJSONObjects(strings.TrimPrefix(rest, ";"))...)
				}
				return []string{s + "\x00"} // forces a parse failure upstream
			}
			return out
		}
		out = append(out, string(raw))
	}
}
