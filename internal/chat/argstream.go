package chat

import (
	"regexp"
	"strings"
)

// CallDelta is one streamed piece of a tool call, as OpenAI streams them: the first
// delta of a call carries its ID and Name, later ones pieces of its arguments.
type CallDelta struct {
	Index    int
	ID, Name string
	Args     string
}

// callHeads find, in held text, where a call's name is complete and its JSON
// arguments begin, for the formats whose arguments are JSON written as generated.
// Group 1 is the name; group 2, when present, a model-given id. XML-style formats
// (values written as text) and structured ones are sent when the reply ends.
var callHeads = map[Format]*regexp.Regexp{
	FormatHermes:         regexp.MustCompile(`<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*`),
	FormatLlama3:         regexp.MustCompile(`(?:^|<\|python_tag\|>)\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*`),
	FormatMistralArgs:    regexp.MustCompile(`\[TOOL_CALLS\]([A-Za-z0-9_.-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]`),
	FormatKimiK2:         regexp.MustCompile(`<\|tool_call_begin\|>\s*(?:functions\.)?([A-Za-z0-9_.-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>`),
	FormatDeepSeek:       regexp.MustCompile(`<｜tool▁call▁begin｜>([A-Za-z0-9_.-]+)<｜tool▁sep｜>`),
	FormatFunctionaryV31: regexp.MustCompile(`<function=([A-Za-z0-9_.-]+)>`),
	// List formats: the first call after the list's opening, later ones after the
	// previous call object's "}," (listGap checks that this "}" closes that call).
	FormatMistral: regexp.MustCompile(`(?:\[TOOL_CALLS\]\s*\[|\}\s*,)\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*`),
	// Command R7B: the model's tool_call_id is not captured (the name must be group 1);
	// streamed calls get ids of their own, as for every family without ids.
	FormatCommandR7B: regexp.MustCompile(`(?:<\|START_ACTION\|>\s*\[|\}\s*,)\s*\{\s*"tool_call_id"\s*:\s*"[^"\\]*"\s*,\s*"tool_name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"parameters"\s*:\s*`),
	FormatGranite:    regexp.MustCompile(`(?:<\|tool_call\|>\s*\[|\}\s*,)\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"arguments"\s*:\s*`),
}

// listGap is what may stand between a listed call's arguments and the "}" that closes
// its object: nothing, or Mistral Nemo's model-given id.
var listGap = regexp.MustCompile(`^\s*(?:,\s*"id"\s*:\s*"[^"\\]*"\s*)?$`)

// listFormats write their calls as one JSON list.
func listFormat(f Format) bool {
	return f == FormatMistral || f == FormatGranite || f == FormatCommandR7B
}

// forced-grammar calls are Hermes-tagged in every format without a grammar of its own.
var hermesHead = callHeads[FormatHermes]

type streamedCall struct {
	id, name string
	args     string // bytes sent
}

// streamArgs scans the held text for calls and queues deltas for what is new: a call
// header once its name is complete, then its arguments as far as they are written.
func (c *CallStream) streamArgs() {
	held := c.buf.String()[c.sent:]
	if c.format == FormatQwenXML && !strings.HasPrefix(strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(held), "<tool_call>")), "{") {
		c.streamXMLArgs(held)
		return
	}
	heads := []*regexp.Regexp{hermesHead}
	if re := callHeads[c.format]; re != nil && re != hermesHead {
		heads = append([]*regexp.Regexp{re}, heads...)
	}
	if c.format == FormatHermes {
		heads = append(heads, callHeads[FormatLlama3]) // a bare JSON call (ParseWith's bareJSON)
	}
	for _, re := range heads {
		ms := re.FindAllStringSubmatchIndex(held, -1)
		if len(ms) == 0 {
			continue
		}
		prevEnd := -1 // list formats: where the previous call's arguments ended
		i := -1       // index of the call m starts
		for _, m := range ms {
			if listFormat(c.format) && re == callHeads[c.format] {
				first := held[m[0]] != '}'
				if i < 0 && !first {
					return // not a list of calls: wait for the end
				}
				if !first && (prevEnd < 0 || prevEnd > m[0] || !listGap.MatchString(held[prevEnd:m[0]])) {
					continue // a "}," inside the arguments, not the end of a call
				}
			}
			i++
			name := held[m[2]:m[3]]
			if name == "function" || !c.knownTool(name) {
				return // DeepSeek R1's form, or not a declared tool: wait for the end
			}
			if i == len(c.streamed) {
				id := ""
				if len(m) > 4 && m[4] >= 0 {
					id = held[m[4]:m[5]]
				}
				if c.format == FormatKimiK2 {
					id = strings.TrimSpace(held[m[0]:m[1]])
					id = strings.TrimSuffix(strings.TrimPrefix(id, "<|tool_call_begin|>"), "<|tool_call_argument_begin|>")
					id = strings.TrimSpace(id)
				}
				if id == "" {
					id = NewCallIDFor(c.format)
				}
				c.streamed = append(c.streamed, streamedCall{id: id, name: name})
				c.deltas = append(c.deltas, CallDelta{Index: i, ID: id, Name: name})
			}
			if i >= len(c.streamed) || c.streamed[i].name != name {
				return
			}
			n, complete := jsonValuePrefix(held[m[1]:])
			if complete {
				prevEnd = m[1] + n
			}
			if sent := c.streamed[i].args; n > len(sent) {
				more := held[m[1] : m[1]+n]
				if !strings.HasPrefix(more, sent) {
					return
				}
				c.deltas = append(c.deltas, CallDelta{Index: i, Args: more[len(sent):]})
				c.streamed[i].args = more
			}
		}
		return
	}
}

func (c *CallStream) knownTool(name string) bool {
	if len(c.tools) == 0 {
		return true
	}
	for _, t := range c.tools {
		if t.Function.Name == name {
			return true
		}
	}
	return false
}

// Deltas returns the call pieces queued since the last call.
func (c *CallStream) Deltas() []CallDelta {
	d := c.deltas
	c.deltas = nil
	return d
}

// finalDeltas reconciles the parsed calls with what was streamed: the streamed ids are
// kept, headers of calls not yet announced and the rest of each call's arguments are
// queued. It reports false when the parse contradicts what was sent (a streamed call
// that did not parse): the client already has those pieces.
func (c *CallStream) finalDeltas(calls []ToolCall) bool {
	ok := true
	for i := range calls {
		if i < len(c.streamed) {
			s := c.streamed[i]
			if calls[i].Function.Name != s.name || !strings.HasPrefix(calls[i].Function.Arguments, s.args) {
				ok = false
				continue
			}
			calls[i].ID = s.id
			if rest := calls[i].Function.Arguments[len(s.args):]; rest != "" {
				c.deltas = append(c.deltas, CallDelta{Index: i, Args: rest})
			}
			continue
		}
		c.deltas = append(c.deltas, CallDelta{Index: i, ID: calls[i].ID, Name: calls[i].Function.Name})
		for a := calls[i].Function.Arguments; a != ""; {
			n := min(16, len(a))
			c.deltas = append(c.deltas, CallDelta{Index: i, Args: a[:n]})
			a = a[n:]
		}
	}
	return ok && len(calls) >= len(c.streamed)
}

// jsonValuePrefix returns how many bytes at the start of s belong to one JSON value
// (an object or array: the arguments) as far as it is written, and whether it is
// complete. Trailing whitespace inside an unfinished value is not counted, so a
// streamed prefix never ends in bytes that the final value might not have.
func jsonValuePrefix(s string) (int, bool) {
	depth, inStr, esc := 0, false, false
	last := 0
	for i := 0; i < len(s); i++ {
		ch := s[i]
		if depth == 0 && ch != '{' {
			// Arguments are a JSON object: anything else is not streamed (once sent, a
			// prefix cannot be taken back, so a string or scalar must not start one).
			return 0, false
		}
		switch {
		case inStr:
			switch {
			case esc:
				esc = false
			case ch == '\\':
				esc = true
				continue // an escape is sent with the character it escapes
			case ch == '"':
				inStr = false
			}
			last = i + 1
		case ch == '"':
			inStr = true
			last = i + 1
		case ch == '{' || ch == '[':
			depth++
			last = i + 1
		case ch == '}' || ch == ']':
			depth--
			last = i + 1
			if depth == 0 {
				return last, true
			}
		case ch == ' ' || ch == '\n' || ch == '\t' || ch == '\r':
			if depth == 0 {
				return 0, false // not an object: nothing to stream
			}
		default:
			if depth == 0 {
				return 0, false
			}
			last = i + 1
		}
	}
	// A lone trailing backslash is already held: the escape case above does not
	// advance last (taking one more off would also hold back the character before it,
	// which a split stream had already sent).
	return last, false
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
