package chat

import "strings"

// CallStream sits between generated text and a streaming client when tools are in
// play: text that cannot belong to a tool call is released as it arrives; from the
// format's call marker on (or, for Llama-3, a reply that opens with a JSON object)
// everything is held, and Finish parses it into content and calls.
type CallStream struct {
	format  Format
	buf     strings.Builder
	sent    int  // bytes of buf already released
	inCall  bool // a call started: hold the rest
	decided bool // Llama-3: the first visible character was seen
}

// NewCallStream returns a CallStream for the format.
func NewCallStream(f Format) *CallStream { return &CallStream{format: f} }

func (c *CallStream) marker() string {
	switch c.format {
	case FormatMistral:
		return "[TOOL_CALLS]"
	case FormatHermes:
		return hermesOpen
	}
	return ""
}

// Push adds generated text and returns what can be sent to the client now.
func (c *CallStream) Push(text string) string {
	c.buf.WriteString(text)
	if c.inCall {
		return ""
	}
	pending := c.buf.String()[c.sent:]
	if c.format == FormatLlama3 {
		if !c.decided {
			trimmed := strings.TrimLeft(pending, " \t\r\n")
			if trimmed == "" {
				return ""
			}
			c.decided = true
			if trimmed[0] == '{' || strings.HasPrefix(trimmed, "<") {
				c.inCall = true
				return ""
			}
		}
		c.sent += len(pending)
		return pending
	}
	m := c.marker()
	if i := strings.Index(pending, m); i >= 0 {
		c.inCall = true
		c.sent += i
		return pending[:i]
	}
	safe := len(pending) - partialSuffix([]byte(pending), []byte(m))
	c.sent += safe
	return pending[:safe]
}

// Finish parses what was held: the content not yet sent, and the tool calls. Held
// text that is not a well-formed call comes back as content.
func (c *CallStream) Finish() (string, []ToolCall) {
	rest := c.buf.String()[c.sent:]
	c.sent = c.buf.Len()
	content, calls := Parse(c.format, rest)
	if len(calls) == 0 {
		return rest, nil
	}
	return content, calls
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
