package chat

import "regexp"

// granite: <|tool_call|>[{"name": ..., "arguments": {...}}] (Granite 3.x).
type granite struct{}

func (granite) format() Format                       { return FormatGranite }
func (granite) detect(has func(...string) bool) bool { return has("<|tool_call|>") }
func (granite) markers() *markers                    { return graniteMarkers }

var graniteMarkers = &markers{
	triggers: []string{"<|tool_call|>"},
	head:     regexp.MustCompile(`(?:<\|tool_call\|>\s*\[|\}\s*,)\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"arguments"\s*:\s*`),
	list:     true,
}

func (granite) parse(ps *parser, text string) Parsed {
	return ps.jsonList(text, "<|tool_call|>", "", "arguments")
}

func (granite) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	r.rules["call"] = r.jsonCall("name", "arguments")
	r.rules["root"] = `"<|tool_call|>" space ` + r.list("call")
	return []Trigger{{Word: "<|tool_call|>"}}, true, nil
}
