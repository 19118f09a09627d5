package chat

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// kimiK2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
// <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>.
type kimiK2 struct{}

func (kimiK2) format() Format { return FormatKimiK2 }
func (kimiK2) detect(has func(...string) bool) bool {
	return has("<|tool_calls_section_begin|>")
}
func (kimiK2) markers() *markers { return kimiK2Markers }

var kimiK2Markers = &markers{
	triggers: []string{"<|tool_calls_section_begin|>"},
	// Kimi K2 Thinking.
	thinkTags: [][2]string{thinkTag},
	head:      regexp.MustCompile(`<\|tool_call_begin\|>\s*(?:functions\.)?([A-Za-z0-9_.-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>`),
	// The call's id is what the model wrote between the markers (functions.NAME:IDX),
	// as Kimi's template expects it back.
	headID: func(m string) string {
		id := strings.TrimSpace(m)
		id = strings.TrimSuffix(strings.TrimPrefix(id, "<|tool_call_begin|>"), "<|tool_call_argument_begin|>")
		return strings.TrimSpace(id)
	},
}

func (kimiK2) parse(ps *parser, text string) Parsed {
	return ps.section(text, "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>", ps.kimi)
}

func (kimiK2) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	r.rules["call"] = `"<|tool_call_begin|>" (` + r.alts(func(i int, name string) string {
		return fmt.Sprintf(`%s ":" [0-9]{1,3} "<|tool_call_argument_begin|>" %s`, q("functions."+name), r.args[i])
	}) + `) "<|tool_call_end|>"`
	r.rules["root"] = `"<|tool_calls_section_begin|>" space call` + r.more("space", "call") + ` space "<|tool_calls_section_end|>"`
	r.ban = "<|" // a JSON string holding <|tool_call_end|> would end the call there
	return []Trigger{{Word: "<|tool_calls_section_begin|>"}}, true, nil
}

// kimi: functions.NAME:IDX<|tool_call_argument_begin|>{...}; the id is the model's.
func (ps *parser) kimi(body string) (ToolCall, bool) {
	id, args, ok := strings.Cut(body, "<|tool_call_argument_begin|>")
	if !ok {
		return ToolCall{}, false
	}
	id = strings.TrimSpace(id)
	name := strings.TrimPrefix(id, "functions.")
	if k := strings.LastIndexByte(name, ':'); k >= 0 {
		name = name[:k]
	}
	args = strings.TrimSpace(args)
	if name == "" || !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
		return ToolCall{}, false
	}
	return ps.call(name, args, id), true
}
