package chat

import (
	"fmt"
	"regexp"
)

// mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...] (Mistral Nemo).
type mistral struct{}

func (mistral) format() Format                       { return FormatMistral }
func (mistral) detect(has func(...string) bool) bool { return has("[TOOL_CALLS]") }
func (mistral) markers() *markers                    { return mistralMarkers }

var mistralMarkers = &markers{
	triggers: []string{"[TOOL_CALLS]"},
	// The first call after the list's opening, later ones after the previous call
	// object's "}," (listGap checks that this "}" closes that call).
	head:     regexp.MustCompile(`(?:\[TOOL_CALLS\]\s*\[|\}\s*,)\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*`),
	list:     true,
	shortIDs: true,
}

func (mistral) parse(ps *parser, text string) Parsed { return ps.mistral(text) }

func (mistral) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	r.rules["call"] = r.jsonCall("name", "arguments")
	r.rules["root"] = `"[TOOL_CALLS]" space ` + r.list("call")
	return []Trigger{{Word: "[TOOL_CALLS]"}}, true, nil
}

// wrapCall: a forced call is a one-item (or, parallel, longer) [TOOL_CALLS] list.
func (mistral) wrapCall(callRule string, parallel bool) string {
	more := ""
	if parallel {
		more = fmt.Sprintf(` ("," space %s)*`, callRule)
	}
	return fmt.Sprintf("root ::= \"[TOOL_CALLS]\" \"[\" %s%s \"]\"\n", callRule, more)
}

func (ps *parser) mistral(text string) Parsed {
	return ps.jsonList(text, "[TOOL_CALLS]", "", "arguments", "parameters")
}
