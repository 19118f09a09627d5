package chat

import (
	"slices"
	"strings"
)

// ReasoningFormat says where a thinking model's reasoning goes (llama-server's
// reasoning_format): "none" leaves it in content, "deepseek" and "auto" move it to
// reasoning_content (auto is the default).
type ReasoningFormat string

// Reasoning formats.
const (
	ReasoningNone     ReasoningFormat = "none"
	ReasoningDeepSeek ReasoningFormat = "deepseek"
	ReasoningAuto     ReasoningFormat = "auto"
)

// thinkTags are the reasoning delimiters every family's models write as text (each
// family's markers().thinkTags), once each in registry order: <think> first, the tag a
// prompt that opens a think block is closed by (NewReplyStream).
var thinkTags = func() [][2]string {
	var out [][2]string
	for _, f := range families {
		for _, tag := range f.markers().thinkTags {
			if !slices.Contains(out, tag) {
				out = append(out, tag)
			}
		}
	}
	return out
}()

// PromptOpensThinking reports whether the rendered prompt ends inside a think block
// (DeepSeek R1 and Qwen3 thinking templates end their generation prompt with
// "<think>\n"): the reply then starts with reasoning and has no opening tag.
func PromptOpensThinking(prompt string) bool {
	t := strings.TrimRight(prompt, " \n")
	for _, tag := range thinkTags {
		if strings.HasSuffix(t, tag[0]) {
			return true
		}
	}
	return false
}

// ReplyOptions configure how a chat reply is split.
type ReplyOptions struct {
	Format Format
	Tools  []Tool
	// Calls: parse tool calls (tools were offered).
	Calls bool
	// Reasoning: move reasoning to reasoning_content (reasoning_format not "none").
	Reasoning bool
	// ThinkingOpen: the prompt ended inside a think block (PromptOpensThinking).
	ThinkingOpen bool
	// Stream: calls are streamed as generated (Deltas), not only returned by Finish.
	Stream bool
	// Forced: a grammar forces a call (tool_choice required or a named function). A
	// call cut short (max_tokens), also a later one after complete calls, is then
	// dropped, not returned as content.
	Forced bool
}

// structured formats carry reasoning and content in their own syntax throughout.
// (Command R7B's thinking, response and action blocks stream like think tags, plain
// text and a call list: see thinkTags, its markers' responseMarkers and call head.)
func (o ReplyOptions) structured() bool {
	return lookup(o.Format).markers().holdAll
}

// ParseReply splits a whole reply into reasoning, content and tool calls.
func ParseReply(o ReplyOptions, text string) Parsed {
	s := NewReplyStream(o)
	r, c := s.Push(text)
	fin := s.Finish()
	fin.Reasoning = strings.TrimSpace(r + fin.Reasoning)
	fin.Content = strings.TrimSpace(c + fin.Content)
	return fin
}

// ReplyStream splits a reply as it is generated: reasoning and content deltas as
// they arrive, tool calls when the reply ends (CallStream).
type ReplyStream struct {
	o       ReplyOptions
	calls   *CallStream
	harmony *harmonyStream
	buf     string // text not yet classified (a possible partial tag)
	marker  string // Command R7B: a possible partial response marker held back
	state   int    // 0: reply start, 1: in reasoning, 2: content
	close   string
}

// NewReplyStream returns a stream for o.
func NewReplyStream(o ReplyOptions) *ReplyStream {
	r := &ReplyStream{o: o}
	if newStream := lookup(o.Format).markers().newStream; newStream != nil {
		r.harmony = newStream(o.Tools)
		return r
	}
	if o.Calls || o.structured() {
		r.calls = NewCallStreamWith(o.Format, o.Tools)
		if o.Stream {
			r.calls.LiveCalls()
		}
	}
	if !o.Reasoning || o.structured() {
		r.state = 2
	} else if o.ThinkingOpen {
		r.state, r.close = 1, thinkTags[0][1]
	}
	return r
}

func (r *ReplyStream) content(s string) string {
	if len(lookup(r.o.Format).markers().responseMarkers) > 0 {
		s = r.stripMarkers(s, false)
	}
	if r.calls != nil {
		return r.calls.Push(s)
	}
	return s
}

// stripMarkers removes the family's response markers (Command R7B's) from content, holding back a
// tail that may be the start of one so the result does not depend on token splits.
func (r *ReplyStream) stripMarkers(s string, final bool) string {
	s = r.marker + s
	responseMarkers := lookup(r.o.Format).markers().responseMarkers
	for _, m := range responseMarkers {
		s = strings.ReplaceAll(s, m, "")
	}
	keep := 0
	if !final {
		for _, m := range responseMarkers {
			keep = max(keep, partialSuffix([]byte(s), []byte(m)))
		}
	}
	r.marker = s[len(s)-keep:]
	return s[:len(s)-keep]
}

// Push adds generated text and returns the reasoning and content to send now.
func (r *ReplyStream) Push(text string) (reasoning, content string) {
	if r.harmony != nil {
		reasoning, content = r.harmony.push(text)
		if !r.o.Reasoning {
			reasoning, content = "", reasoning+content
		}
		return reasoning, content
	}
	r.buf += text
	for {
		switch r.state {
		case 0:
			t := strings.TrimLeft(r.buf, " \t\r\n")
			if t == "" {
				return reasoning, content
			}
			matched := false
			for _, tag := range thinkTags {
				if strings.HasPrefix(t, tag[0]) {
					r.buf, r.state, r.close = t[len(tag[0]):], 1, tag[1]
					matched = true
					break
				}
				if strings.HasPrefix(tag[0], t) {
					return reasoning, content // could still become a tag
				}
			}
			if !matched {
				r.state = 2
			}
		case 1:
			if i := strings.Index(r.buf, r.close); i >= 0 {
				reasoning += r.buf[:i]
				r.buf, r.state = strings.TrimLeft(r.buf[i+len(r.close):], "\n"), 2
				continue
			}
			keep := partialSuffix([]byte(r.buf), []byte(r.close))
			reasoning += r.buf[:len(r.buf)-keep]
			r.buf = r.buf[len(r.buf)-keep:]
			return reasoning, content
		default:
			content += r.content(r.buf)
			r.buf = ""
			return reasoning, content
		}
	}
}

// Deltas returns the tool-call pieces ready to send (ReplyOptions.Stream).
func (r *ReplyStream) Deltas() []CallDelta {
	if r.harmony != nil {
		if !r.o.Calls || !r.o.Stream {
			return nil
		}
		d := r.harmony.deltas
		r.harmony.deltas = nil
		return d
	}
	if r.calls == nil {
		return nil
	}
	return r.calls.Deltas()
}

// Finish returns what is left: reasoning still buffered, the held content, the calls.
func (r *ReplyStream) Finish() Parsed {
	var p Parsed
	if r.harmony != nil {
		p.Reasoning, p.Content, p.Calls, p.Truncated = r.harmony.finish()
		if !r.o.Reasoning {
			p.Reasoning, p.Content = "", p.Reasoning+p.Content
		}
		if !r.o.Calls {
			p.Calls, p.Truncated = nil, false
		}
		if !r.o.Stream {
			r.harmony.deltas = nil
			for i := range p.Calls {
				p.Calls[i].ID = NewCallIDFor(FormatHarmony)
			}
		}
		if r.o.Forced {
			p.Content = "" // the grammar wrote only calls: any rest is a call cut short
		}
		return p
	}
	switch r.state {
	case 1:
		p.Reasoning = r.buf // unclosed: everything was reasoning
	default:
		if r.buf != "" {
			c := r.content(r.buf)
			p.Content = c
		}
	}
	r.buf = ""
	if r.marker != "" {
		tail := r.stripMarkers("", true)
		if r.calls != nil {
			tail = r.calls.Push(tail)
		}
		p.Content += tail
	}
	if r.calls != nil {
		fin := r.calls.Finish()
		p.Content += fin.Content
		p.Reasoning += fin.Reasoning
		p.Calls = fin.Calls
		p.Truncated = fin.Truncated
		if !r.o.Calls {
			p.Calls = nil // structured formats without tools: no calls were offered
		}
		if r.o.Forced {
			// The grammar wrote only calls: text that did not parse is a call cut short
			// (the first, or a later parallel one), never content.
			p.Content = ""
		}
		if !r.o.Reasoning && fin.Reasoning != "" {
			p.Content = fin.Reasoning + "\n" + p.Content
			p.Reasoning = ""
		}
	}
	return p
}
