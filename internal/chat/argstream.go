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

// listGap is what may stand between a listed call's arguments and the "}" that closes
// its object: nothing, or Mistral Nemo's model-given id.
var listGap = regexp.MustCompile(`^\s*(?:,\s*"id"\s*:\s*"[^"\\]*"\s*)?$`)

type streamedCall struct {
	id, name string
	args     string // bytes sent
}

// streamArgs scans the held text for calls and queues deltas for what is new: a call
// header once its name is complete, then its arguments as far as they are written.
func (c *CallStream) streamArgs() {
	held := c.buf.String()[c.sent:]
	if c.fam.streamArgs != nil && c.fam.streamArgs(c, held) {
		return
	}
	// The family's own call head, then Hermes' (forced calls), then any others.
	heads := []*regexp.Regexp{hermesHead}
	if re := c.fam.head; re != nil && re != hermesHead {
		heads = append([]*regexp.Regexp{re}, heads...)
	}
	heads = append(heads, c.fam.moreHeads...)
	for _, re := range heads {
		ms := re.FindAllStringSubmatchIndex(held, -1)
		if len(ms) == 0 {
			continue
		}
		prevEnd := -1 // list formats: where the previous call's arguments ended
		i := -1       // index of the call m starts
		for _, m := range ms {
			if c.fam.list && re == c.fam.head {
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
				if c.fam.headID != nil && re == c.fam.head {
					id = c.fam.headID(held[m[0]:m[1]])
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
