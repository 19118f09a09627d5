package chat

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// deepseek: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>... (R1:
// "function<｜tool▁sep｜>NAME\n```json\n{...}\n```"; V3.1: "NAME<｜tool▁sep｜>{...}").
type deepseek struct{}

func (deepseek) format() Format { return FormatDeepSeek }
func (deepseek) detect(has func(...string) bool) bool {
	return has("tool▁calls▁begin") || has("tool▁call▁begin")
}
func (deepseek) markers() *markers { return deepseekMarkers }

var deepseekMarkers = &markers{
	triggers: []string{"<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"},
	// V3.1's form; R1's "function<｜tool▁sep｜>" names no tool and waits for the end.
	head: regexp.MustCompile(`<｜tool▁call▁begin｜>([A-Za-z0-9_.-]+)<｜tool▁sep｜>`),
	// R1 and V3.1 thinking.
	thinkTags: [][2]string{thinkTag},
}

func (deepseek) parse(ps *parser, text string) Parsed {
	return ps.section(text, "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", ps.deepseek)
}

func (deepseek) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	// R1 writes "function<｜tool▁sep｜>NAME\n```json\n{...}\n```", V3.1 "NAME<｜tool▁sep｜>{...}".
	r.rules["call"] = `"<｜tool▁call▁begin｜>" (` + r.alts(func(i int, name string) string {
		return fmt.Sprintf(`"function<｜tool▁sep｜>" %s %s %s %s | %s "<｜tool▁sep｜>" %s`,
			q(name), q("\n```json\n"), r.args[i], q("\n```"), q(name), r.args[i])
	}) + `) "<｜tool▁call▁end｜>"`
	r.rules["root"] = `"<｜tool▁calls▁begin｜>" space call` + r.more("space", "call") + ` space "<｜tool▁calls▁end｜>"`
	r.ban = "<｜" // a JSON string holding <｜tool▁call▁end｜> would end the call there
	return []Trigger{{Word: "<｜tool▁calls▁begin｜>"}}, true, nil
}

// deepseek: "function<｜tool▁sep｜>NAME\n```json\n{...}\n```" (R1) or "NAME<｜tool▁sep｜>{...}" (V3.1).
func (ps *parser) deepseek(body string) (ToolCall, bool) {
	head, args, ok := strings.Cut(body, "<｜tool▁sep｜>")
	if !ok {
		return ToolCall{}, false
	}
	name := strings.TrimSpace(head)
	if name == "function" || name == "" {
		n, rest, ok := strings.Cut(args, "\n")
		if !ok {
			return ToolCall{}, false
		}
		name, args = strings.TrimSpace(n), rest
	}
	args = strings.TrimSpace(args)
	if a, ok := strings.CutPrefix(args, "```json"); ok {
		args = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(a), "```"))
	}
	if name == "" || !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
		return ToolCall{}, false
	}
	return ps.call(name, args, ""), true
}
