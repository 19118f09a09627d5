package chat

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// functionaryV31: <function=NAME>{...}</function>, or <|python_tag|>code (a call of
// the built-in python tool).
type functionaryV31 struct{}

func (functionaryV31) format() Format                       { return FormatFunctionaryV31 }
func (functionaryV31) detect(has func(...string) bool) bool { return has("<function=") }
func (functionaryV31) markers() *markers                    { return functionaryV31Markers }

var functionaryV31Markers = &markers{
	triggers: []string{"<function=", "<|python_tag|>"},
	head:     regexp.MustCompile(`<function=([A-Za-z0-9_.-]+)>`),
}

func (functionaryV31) parse(ps *parser, text string) Parsed {
	p := ps.blocks(text, "<function=", "</function>", ps.functionary31)
	if len(p.Calls) == 0 {
		p = ps.pythonTag(text)
	}
	return p
}

func (functionaryV31) grammar(r *callRules) ([]Trigger, bool, error) {
	if err := r.jsonArgs(); err != nil {
		return nil, false, err
	}
	r.rules["call"] = r.alts(func(i int, name string) string {
		return fmt.Sprintf(`%s space %s "</function>"`, q("<function="+name+">"), r.args[i])
	})
	r.rules["root"] = "call" + r.more("space", "call")
	r.ban = "</" // a JSON string holding </function> would end the call there
	return []Trigger{{Word: "<function="}}, true, nil
}

// functionary31: NAME>{...} (the inside of <function=NAME>{...}</function>).
func (ps *parser) functionary31(body string) (ToolCall, bool) {
	name, args, ok := strings.Cut(body, ">")
	args = strings.TrimSpace(args)
	if !ok || name == "" || !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
		return ToolCall{}, false
	}
	return ps.call(name, args, ""), true
}

// pythonTag: <|python_tag|>code is a call of the "python" tool with {"code": ...}.
func (ps *parser) pythonTag(text string) Parsed {
	i := strings.Index(text, "<|python_tag|>")
	if i < 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	code := strings.TrimSpace(text[i+len("<|python_tag|>"):])
	args, _ := marshalNoEscape(map[string]string{"code": code})
	return Parsed{Content: strings.TrimSpace(text[:i]), Calls: []ToolCall{ps.call("python", string(args), "")}}
}
