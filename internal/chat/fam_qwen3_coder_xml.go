package chat

import (
	"regexp"
	"strings"
)

// qwenXML: <tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>
// (Qwen3-Coder, Qwen 3.5): values are bare text, typed by the tool's schema.
type qwenXML struct{}

func (qwenXML) format() Format { return FormatQwenXML }
func (qwenXML) detect(has func(...string) bool) bool {
	return has("<function=", "<parameter=")
}
func (qwenXML) markers() *markers { return qwenXMLMarkers }

var qwenXMLMarkers = &markers{
	// Qwen 3.5 thinks in <think>; Seed-OSS (calls in this shape inside <seed:tool_call>,
	// so its templates are detected as this family) in <seed:think>.
	thinkTags: [][2]string{thinkTag, {"<seed:think>", "</seed:think>"}},
	// A call whose body is JSON (a forced Hermes-tagged call) streams by Hermes' head.
	streamArgs: func(c *CallStream, held string) bool {
		if strings.HasPrefix(strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(held), "<tool_call>")), "{") {
			return false
		}
		c.streamXMLArgs(held)
		return true
	},
}

func (qwenXML) parse(ps *parser, text string) Parsed {
	return ps.blocks(text, "<tool_call>", "</tool_call>", ps.qwenXML)
}

func (qwenXML) grammar(r *callRules) ([]Trigger, bool, error) {
	return r.xmlFamily(qwenXMLForm)
}

// llama.cpp triggers on "<tool_call>\n<function=" (a word); the opener alone also
// constrains a call written without the newline, which the parser reads too.
var qwenXMLForm = xmlForm{word: "<tool_call>", open: `"<tool_call>" "\n"?`, close: `"\n"? "</tool_call>"`, perCall: true,
	call: func(n string) string { return "<function=" + n + ">" }, afterName: `"\n"?`, callClose: "</function>",
	param:    func(k string, _ bool) string { return "<parameter=" + k + ">" },
	valueEnd: "</parameter>", stops: []string{"</function>", "</tool_call>"}, strip: true}

// qwenXML: <function=NAME><parameter=K>\nV\n</parameter>...</function>.
func (ps *parser) qwenXML(body string) (ToolCall, bool) {
	b := strings.TrimSpace(body)
	rest, ok := strings.CutPrefix(b, "<function=")
	if !ok {
		return ToolCall{}, false
	}
	name, rest, ok := strings.Cut(rest, ">")
	if !ok || name == "" {
		return ToolCall{}, false
	}
	rest, _, _ = strings.Cut(rest, "</function>")
	args := newArgs(ps.schemaFor(name))
	for {
		r := strings.TrimSpace(rest)
		if r == "" {
			break
		}
		r, ok = strings.CutPrefix(r, "<parameter=")
		if !ok {
			return ToolCall{}, false
		}
		k, r, ok := strings.Cut(r, ">")
		if !ok {
			return ToolCall{}, false
		}
		v, after, ok := strings.Cut(r, "</parameter>")
		if !ok {
			return ToolCall{}, false
		}
		v = strings.TrimPrefix(v, "\n")
		v = strings.TrimSuffix(v, "\n")
		args.add(k, v)
		rest = after
	}
	return ps.call(name, args.String(), ""), true
}

// xmlHead is a Qwen3-Coder / Qwen 3.5 call's start: its function name is complete.
var xmlHead = regexp.MustCompile(`<tool_call>\s*<function=([A-Za-z0-9_.-]+)>`)

// streamXMLArgs streams Qwen3-Coder XML calls: the header once the function's name is
// complete, then the JSON arguments one parameter at a time, as each </parameter>
// closes (a value's type, and so its JSON form, is only known once it is whole); the
// closing brace with </function>. The pieces are exactly the prefixes of what ParseWith
// builds from the whole call, so Finish agrees with them.
func (c *CallStream) streamXMLArgs(held string) {
	ms := xmlHead.FindAllStringSubmatchIndex(held, -1)
	for i, m := range ms {
		name := held[m[2]:m[3]]
		if !c.knownTool(name) {
			return
		}
		if i == len(c.streamed) {
			id := NewCallIDFor(c.format)
			c.streamed = append(c.streamed, streamedCall{id: id, name: name})
			c.deltas = append(c.deltas, CallDelta{Index: i, ID: id, Name: name})
		}
		if i >= len(c.streamed) || c.streamed[i].name != name {
			return
		}
		body := held[m[1]:]
		if i+1 < len(ms) {
			body = held[m[1]:ms[i+1][0]]
		}
		args := xmlArgsPrefix(body, (&parser{tools: c.tools}).schemaFor(name))
		if sent := c.streamed[i].args; len(args) > len(sent) {
			if !strings.HasPrefix(args, sent) {
				return
			}
			c.deltas = append(c.deltas, CallDelta{Index: i, Args: args[len(sent):]})
			c.streamed[i].args = args
		}
	}
}

// xmlArgsPrefix is the JSON arguments of the complete <parameter=K>V</parameter>
// blocks at the start of body (without the closing brace), or the whole object once
// </function> closes the call; "" while no parameter is complete.
func xmlArgsPrefix(body string, types map[string]string) string {
	args := newArgs(types)
	rest := body
	for {
		r := strings.TrimSpace(rest)
		if strings.HasPrefix(r, "</function>") {
			return args.String()
		}
		r, ok := strings.CutPrefix(r, "<parameter=")
		if !ok {
			break
		}
		k, r, ok := strings.Cut(r, ">")
		if !ok {
			break
		}
		v, after, ok := strings.Cut(r, "</parameter>")
		if !ok {
			break
		}
		v = strings.TrimSuffix(strings.TrimPrefix(v, "\n"), "\n")
		args.add(k, v)
		rest = after
	}
	if args.n == 0 {
		return ""
	}
	return args.b.String()
}
