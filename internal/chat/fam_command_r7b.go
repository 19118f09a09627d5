package chat

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// commandR7B: <|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>;
// reasoning in <|START_THINKING|> blocks (thinkTags), text in a response block whose
// markers are removed.
type commandR7B struct{}

func (commandR7B) format() Format                       { return FormatCommandR7B }
func (commandR7B) detect(has func(...string) bool) bool { return has("<|START_ACTION|>") }
func (commandR7B) markers() *markers                    { return commandR7BMarkers }

var commandR7BMarkers = &markers{
	triggers: []string{"<|START_ACTION|>"},
	// The model's tool_call_id is not captured (the name must be group 1); streamed
	// calls get ids of their own, as for every family without ids.
	head:            regexp.MustCompile(`(?:<\|START_ACTION\|>\s*\[|\}\s*,)\s*\{\s*"tool_call_id"\s*:\s*"[^"\\]*"\s*,\s*"tool_name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"parameters"\s*:\s*`),
	list:            true,
	responseMarkers: []string{"<|START_RESPONSE|>", "<|END_RESPONSE|>"},
	thinkTags:       [][2]string{{"<|START_THINKING|>", "<|END_THINKING|>"}},
}

func (commandR7B) parse(ps *parser, text string) Parsed { return ps.commandR(text) }

func (commandR7B) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	r.prim("string")
	r.rules["call"] = r.alts(func(i int, name string) string {
		return fmt.Sprintf(`"{" space %s space ":" space string "," space %s space ":" space %s space "," space %s space ":" space %s "}" space`,
			q(`"tool_call_id"`), q(`"tool_name"`), q(`"`+name+`"`), q(`"parameters"`), r.args[i])
	})
	r.rules["root"] = `"<|START_ACTION|>" space ` + r.list("call") + ` "<|END_ACTION|>"`
	r.ban = "<|" // a JSON string holding <|END_ACTION|> would end the list there
	return []Trigger{{Word: "<|START_ACTION|>"}}, true, nil
}

// commandR: optional <|START_THINKING|>...<|END_THINKING|>, then
// <|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|> or
// <|START_RESPONSE|>text<|END_RESPONSE|>.
func (ps *parser) commandR(text string) Parsed {
	var p Parsed
	if th, ok := between(text, "<|START_THINKING|>", "<|END_THINKING|>"); ok {
		p.Reasoning = strings.TrimSpace(th)
		text = text[strings.Index(text, "<|END_THINKING|>")+len("<|END_THINKING|>"):]
	}
	if r, ok := strings.CutPrefix(strings.TrimSpace(text), "<|START_RESPONSE|>"); ok {
		r, _, _ = strings.Cut(r, "<|END_RESPONSE|>")
		p.Content = strings.TrimSpace(r)
		return p
	}
	i := strings.Index(text, "<|START_ACTION|>")
	if i < 0 {
		p.Content = strings.TrimSpace(text)
		return p
	}
	body := text[i+len("<|START_ACTION|>"):]
	body, after, _ := strings.Cut(body, "<|END_ACTION|>")
	var arr []map[string]json.RawMessage
	if err := json.Unmarshal([]byte(strings.TrimSpace(body)), &arr); err != nil || len(arr) == 0 {
		p.Content = strings.TrimSpace(text)
		return p
	}
	for _, obj := range arr {
		c, ok := ps.callFromObject(obj, "tool_name", "parameters")
		if !ok {
			p.Content = strings.TrimSpace(text)
			p.Calls = nil
			return p
		}
		var id string
		if json.Unmarshal(obj["tool_call_id"], &id) == nil && id != "" {
			c.ID = id
		}
		p.Calls = append(p.Calls, c)
	}
	p.Content = strings.TrimSpace(text[:i] + after)
	return p
}
