package chat

import "strings"

// CallStream sits between generated text and a streaming client when tools are in
// play: text that cannot belong to a tool call is released as it arrives; from the
// format's call marker on (or a reply that opens with a JSON object, for formats whose
// calls are bare JSON) everything is held, and Finish parses it into content and calls.
type CallStream struct {
	format   Format
	fam      *markers
	tools    []Tool
	triggers []string
	buf      strings.Builder
	sent     int  // bytes of buf already released
	inCall   bool // a call started: hold the rest
	decided  bool // the reply's first visible character was seen
	holdAll  bool // formats whose replies are structured throughout: parse at the end
	live     bool // stream call headers and arguments as they are generated
	streamed []streamedCall
	deltas   []CallDelta
}

// NewCallStream returns a CallStream for the format.
func NewCallStream(f Format) *CallStream { return NewCallStreamWith(f, nil) }

// LiveCalls makes the stream send each call's header and arguments as they are
// generated (Deltas); without it calls come whole from Finish.
func (c *CallStream) LiveCalls() *CallStream { c.live = true; return c }

// NewCallStreamWith returns a CallStream that parses with the declared tools.
func NewCallStreamWith(f Format, tools []Tool) *CallStream {
	m := lookup(f).markers()
	// "<tool_call>" is in every list: grammar-forced calls use Hermes tags when a
	// format has no grammar of its own.
	triggers := append(append([]string(nil), m.triggers...), "<tool_call>")
	return &CallStream{format: f, fam: m, tools: tools, triggers: triggers, holdAll: m.holdAll}
}

// Push adds generated text and returns what can be sent to the client now.
func (c *CallStream) Push(text string) string {
	c.buf.WriteString(text)
	if c.holdAll {
		return ""
	}
	if c.inCall {
		if c.live {
			c.streamArgs()
		}
		return ""
	}
	pending := c.buf.String()[c.sent:]
	if !c.decided {
		trimmed := strings.TrimLeft(pending, " \t\r\n")
		if trimmed == "" {
			return ""
		}
		if lead := c.fam.textLead; lead != "" {
			// The reply names its recipient first: lead is text, anything else a call.
			if len(trimmed) < len(lead) && strings.HasPrefix(lead, trimmed) {
				return ""
			}
			c.decided = true
			if !strings.HasPrefix(trimmed, lead) {
				c.inCall = true
				if c.live {
					c.streamArgs() // as a later Push would: the outcome must not depend on the split
				}
				return ""
			}
			c.sent += len(pending) - len(trimmed) + len(lead)
			pending = c.buf.String()[c.sent:]
		} else {
			c.decided = true
			if c.fam.opensWithJSON && trimmed[0] == '{' {
				c.inCall = true
				if c.live {
					c.streamArgs()
				}
				return ""
			}
		}
	}
	first := -1
	for _, m := range c.triggers {
		if i := strings.Index(pending, m); i >= 0 && (first < 0 || i < first) {
			first = i
		}
	}
	if first >= 0 {
		c.inCall = true
		c.sent += first
		if c.live {
			c.streamArgs()
		}
		return pending[:first]
	}
	safe := len(pending)
	for _, m := range c.triggers {
		safe = min(safe, len(pending)-partialSuffix([]byte(pending), []byte(m)))
	}
	c.sent += safe
	return pending[:safe]
}

// Finish parses what was held: the content not yet sent, reasoning (formats that
// carry it in their own syntax), and the tool calls. Held text that is not a
// well-formed call comes back as content.
func (c *CallStream) Finish() Parsed {
	rest := c.buf.String()[c.sent:]
	c.sent = c.buf.Len()
	if !c.inCall && !c.holdAll {
		return Parsed{Content: rest} // nothing held but the start of a marker that never came
	}
	p := ParseWith(c.format, rest, c.tools)
	if len(p.Calls) == 0 && p.Reasoning == "" && !c.holdAll && len(c.streamed) == 0 {
		return Parsed{Content: rest}
	}
	if c.live && !c.finalDeltas(p.Calls) {
		// Pieces of a call already went out and the whole does not parse as that call
		// (cut short by max_tokens, or malformed after a valid start): no calls, and
		// the held text is not repeated as content (the client holds it as a call).
		return Parsed{Reasoning: p.Reasoning, Truncated: true}
	}
	return p
}

// partialSuffix is the length of the longest suffix of b that is a proper prefix of s.
func partialSuffix(b, s []byte) int {
	for k := min(len(b), len(s)-1); k > 0; k-- {
		if string(b[len(b)-k:]) == string(s[:k]) {
			return k
		}
	}
	return 0
}
