package chat

import (
	"regexp"
	"strings"
)

// hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes 2 Pro/3,
// Qwen 2.5/3, Granite 4, and PolyKV's injected prompt for templates without tool
// support). It is the default family: any template matches.
type hermes struct{}

func (hermes) format() Format                   { return FormatHermes }
func (hermes) detect(func(...string) bool) bool { return true }
func (hermes) markers() *markers                { return hermesMarkers }

// hermesHead: a tagged call's name is complete and its arguments begin. Every family
// streams it too: forced calls are Hermes-tagged where a family has no grammar.
var hermesHead = regexp.MustCompile(`<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*`)

// thinkTag is the reasoning block most thinking models write (Qwen3, DeepSeek R1, GLM,
// MiniMax, Kimi Thinking, SmolLM3), whatever their call syntax.
var thinkTag = [2]string{"<think>", "</think>"}

var hermesMarkers = &markers{
	head: hermesHead,
	// A bare JSON call (hermes.parse's bareJSON) streams as Llama 3's does.
	moreHeads:     []*regexp.Regexp{llama3Head},
	opensWithJSON: true,
	// Qwen3, SmolLM3 and the other thinking models with Hermes-tagged calls.
	thinkTags: [][2]string{thinkTag},
}

func (hermes) parse(ps *parser, text string) Parsed {
	p := ps.blocks(text, "<tool_call>", "</tool_call>", ps.hermes)
	if len(p.Calls) == 0 {
		// Models trained on other formats but served with a Hermes prompt sometimes
		// answer with a bare JSON call: accept exactly that and nothing looser.
		if q := ps.bareJSON(text); len(q.Calls) > 0 {
			p = q
		}
	}
	return p
}

func (hermes) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	r.rules["call"] = r.jsonCall("name", "arguments")
	r.rules["tagged"] = `"<tool_call>" space call space "</tool_call>"`
	// A reply that is one bare call object (models served with a Hermes prompt they
	// were not trained on; hermes.parse accepts exactly that) is constrained too.
	r.rules["root"] = `tagged` + r.more(`"\n"`, "tagged") + ` | call`
	if r.forced {
		// Forced, the reply is tagged as the family writes calls: a bare object would
		// stream as content until it ended (the stream holds from the tag).
		r.rules["root"] = `tagged` + r.more(`"\n"`, "tagged")
	}
	r.ban = "</" // a JSON string holding </tool_call> would end the call there
	return []Trigger{{Word: "<tool_call>"}, {Pattern: `\s*(` + r.nameStart() + `)[\s\S]*`}}, true, nil
}

// hermes: {"name": ..., "arguments": {...}}.
func (ps *parser) hermes(body string) (ToolCall, bool) {
	return ps.callFromJSON(body, "arguments", "parameters")
}

// bareJSON accepts a reply that is exactly one {"name", "arguments"} object.
func (ps *parser) bareJSON(text string) Parsed {
	t := strings.TrimSpace(text)
	if !strings.HasPrefix(t, "{") {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	if c, ok := ps.callFromJSON(t, "arguments", "parameters"); ok && ps.known(c.Function.Name) {
		return Parsed{Calls: []ToolCall{c}}
	}
	return Parsed{Content: strings.TrimSpace(text)}
}
