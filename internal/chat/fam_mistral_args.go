package chat

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// mistralArgs: [TOOL_CALLS]NAME[ARGS]{...} per call, optionally with [CALL_ID]ID before
// [ARGS] (Mistral Small 3.2, Devstral, Ministral 3, Magistral).
type mistralArgs struct{}

func (mistralArgs) format() Format { return FormatMistralArgs }
func (mistralArgs) detect(has func(...string) bool) bool {
	return has("[TOOL_CALLS]", "[ARGS]")
}
func (mistralArgs) markers() *markers { return mistralArgsMarkers }

var mistralArgsMarkers = &markers{
	triggers: []string{"[TOOL_CALLS]"},
	head:     regexp.MustCompile(`\[TOOL_CALLS\]([A-Za-z0-9_.-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]`),
	shortIDs: true,
}

func (mistralArgs) parse(ps *parser, text string) Parsed { return ps.mistralArgs(text) }

func (mistralArgs) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	r.rules["call"] = `"[TOOL_CALLS]" (` + r.alts(func(i int, name string) string {
		return fmt.Sprintf(`%s "[ARGS]" %s`, q(name), r.args[i])
	}) + ")"
	r.rules["root"] = "call" + r.more(`space`, "call")
	return []Trigger{{Word: "[TOOL_CALLS]"}}, true, nil
}

// mistralArgs: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}, repeated.
func (ps *parser) mistralArgs(text string) Parsed {
	const marker = "[TOOL_CALLS]"
	i := strings.Index(text, marker)
	if i < 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	if strings.HasPrefix(strings.TrimSpace(text[i+len(marker):]), "[") {
		return ps.mistral(text) // older list form
	}
	var calls []ToolCall
	rest := text[i:]
	for strings.HasPrefix(rest, marker) {
		rest = rest[len(marker):]
		j := strings.Index(rest, "[ARGS]")
		if j < 0 {
			return Parsed{Content: strings.TrimSpace(text)}
		}
		name, id := rest[:j], ""
		if k := strings.Index(name, "[CALL_ID]"); k >= 0 {
			name, id = name[:k], name[k+len("[CALL_ID]"):]
		}
		name = strings.TrimSpace(name)
		rest = rest[j+len("[ARGS]"):]
		dec := json.NewDecoder(strings.NewReader(rest))
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil || name == "" {
			return Parsed{Content: strings.TrimSpace(text)}
		}
		args, ok := argsText(raw)
		if !ok {
			return Parsed{Content: strings.TrimSpace(text)}
		}
		calls = append(calls, ps.call(name, args, strings.TrimSpace(id)))
		rest = strings.TrimLeft(rest[dec.InputOffset():], " \n")
	}
	return Parsed{Content: strings.TrimSpace(text[:i] + rest), Calls: calls}
}
