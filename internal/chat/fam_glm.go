package chat

import "strings"

// glm: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> (GLM 4.5+).
type glm struct{}

func (glm) format() Format                       { return FormatGLM }
func (glm) detect(has func(...string) bool) bool { return has("<arg_key>") }
func (glm) markers() *markers                    { return glmMarkers }

// GLM's opener is Hermes' "<tool_call>", a trigger of every family; values are text,
// so calls come whole.
var glmMarkers = &markers{thinkTags: [][2]string{thinkTag}}

func (glm) parse(ps *parser, text string) Parsed {
	return ps.blocks(text, "<tool_call>", "</tool_call>", ps.glm)
}

func (glm) grammar(r *callRules) ([]Trigger, bool, error) { return r.xmlFamily(glmForm) }

// llama.cpp's word is "\n<tool_call>"; GLM 4.7 opens a reply with the call and no
// newline, so the opener (one special token) is the word here.
var glmForm = xmlForm{word: "<tool_call>", open: `"<tool_call>"`, close: `"</tool_call>"`, perCall: true,
	call: func(n string) string { return n }, afterName: `"\n"?`, callClose: "",
	param:     func(k string, _ bool) string { return "<arg_key>" + k + "</arg_key>" },
	valueOpen: `"\n"? "<arg_value>"`, valueEnd: "</arg_value>", stops: []string{"</tool_call>"}}

// glm: NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
func (ps *parser) glm(body string) (ToolCall, bool) {
	name, rest, _ := strings.Cut(body, "<arg_key>")
	name = strings.TrimSpace(name)
	if name == "" || strings.ContainsAny(name, "<>{} \n") {
		return ToolCall{}, false
	}
	args := newArgs(ps.schemaFor(name))
	if rest != "" {
		rest = "<arg_key>" + rest
	}
	for strings.TrimSpace(rest) != "" {
		r := strings.TrimSpace(rest)
		k, ok := between(r, "<arg_key>", "</arg_key>")
		if !ok {
			return ToolCall{}, false
		}
		r = strings.TrimSpace(r[strings.Index(r, "</arg_key>")+len("</arg_key>"):])
		v, ok := between(r, "<arg_value>", "</arg_value>")
		if !ok {
			return ToolCall{}, false
		}
		args.add(k, v)
		rest = r[strings.Index(r, "</arg_value>")+len("</arg_value>"):]
	}
	return ps.call(name, args.String(), ""), true
}
