package chat

import (
	"encoding/json"
	"fmt"
	"strings"
)

// harmony: GPT-OSS channels; analysis is reasoning, final is content, and a call is a
// commentary message to=functions.NAME (its body the JSON arguments).
type harmony struct{}

func (harmony) format() Format { return FormatHarmony }
func (harmony) detect(has func(...string) bool) bool {
	return has("<|channel|>", "<|call|>")
}
func (harmony) markers() *markers { return harmonyMarkers }

var harmonyMarkers = &markers{
	holdAll:   true,
	newStream: func(tools []Tool) *harmonyStream { return &harmonyStream{tools: tools} },
}

func (harmony) parse(ps *parser, text string) Parsed { return ps.harmony(text) }

func (harmony) grammar(r *callRules) ([]Trigger, bool, error) {
	if !r.safeNames() {
		return nil, false, nil
	}
	return r.setRoot(r.harmonyFamily(r.tools))
}

// harmonyHeader reads a message header (what precedes <|message|>): its channel and
// recipient. The whole-reply parser and the stream both read headers with it.
func harmonyHeader(hd string) (channel, recipient string) {
	for _, f := range strings.Fields(strings.NewReplacer("<|channel|>", " <|channel|>", "<|constrain|>", " <|constrain|>", "<|start|>", " ").Replace(hd)) {
		switch {
		case strings.HasPrefix(f, "<|channel|>"):
			channel = strings.TrimPrefix(f, "<|channel|>")
		case strings.HasPrefix(f, "to="):
			recipient = strings.TrimPrefix(f, "to=")
		}
	}
	return channel, recipient
}

// harmonyStream splits GPT-OSS's Harmony output as it is generated: each message is a
// header (channel, recipient) up to <|message|>, then a body up to <|end|>, <|call|> or
// <|return|>. Analysis bodies stream as reasoning, final (and plain) bodies as content,
// and a commentary body to=functions.NAME is a call whose JSON arguments stream too.
type harmonyStream struct {
	tools  []Tool
	buf    string
	inBody bool
	kind   int // body kind: 0 content, 1 reasoning, 2 call
	call   *streamedCall
	calls  []ToolCall
	deltas []CallDelta
	bad    bool // a call body that is not JSON: reported as content at the end
	raw    strings.Builder
}

var harmonyEnds = []string{"<|end|>", "<|call|>", "<|return|>"}

// push returns the reasoning and content ready now.
func (h *harmonyStream) push(text string) (reasoning, content string) {
	h.raw.WriteString(text)
	h.buf += text
	for {
		if !h.inBody {
			i := strings.Index(h.buf, "<|message|>")
			if i < 0 {
				return
			}
			h.header(h.buf[:i])
			h.buf, h.inBody = h.buf[i+len("<|message|>"):], true
			continue
		}
		end, at := -1, ""
		for _, e := range harmonyEnds {
			if j := strings.Index(h.buf, e); j >= 0 && (end < 0 || j < end) {
				end, at = j, e
			}
		}
		var body string
		if end >= 0 {
			body = h.buf[:end]
		} else {
			keep := 0
			for _, e := range harmonyEnds {
				keep = max(keep, partialSuffix([]byte(h.buf), []byte(e)))
			}
			body = h.buf[:len(h.buf)-keep]
		}
		switch h.kind {
		case 0:
			content += body
		case 1:
			reasoning += body
		}
		if h.kind == 2 {
			h.callBody(body, end >= 0)
		} else {
			h.buf = h.buf[len(body):]
		}
		if end < 0 {
			return
		}
		if h.kind == 2 {
			h.buf = h.buf[end:]
		}
		h.buf, h.inBody = h.buf[len(at):], false
		if h.kind != 2 && at != "" {
			if h.kind == 0 {
				content += "\n"
			} else {
				reasoning += "\n"
			}
		}
	}
}

func (h *harmonyStream) header(hd string) {
	channel, recipient := harmonyHeader(hd)
	switch {
	case harmonyCallName(recipient) != "":
		h.kind = 2
		name := harmonyCallName(recipient)
		h.call = &streamedCall{id: NewCallID(), name: name}
		h.deltas = append(h.deltas, CallDelta{Index: len(h.calls), ID: h.call.id, Name: name})
	case channel == "analysis":
		h.kind = 1
	default:
		h.kind = 0
	}
}

// callBody streams the arguments written so far; done closes the call.
func (h *harmonyStream) callBody(body string, done bool) {
	t := strings.TrimLeft(body, " \n")
	n, _ := jsonValuePrefix(t)
	if n > len(h.call.args) && strings.HasPrefix(t[:n], h.call.args) {
		h.deltas = append(h.deltas, CallDelta{Index: len(h.calls), Args: t[len(h.call.args):n]})
		h.call.args = t[:n]
	}
	if !done {
		return
	}
	args := strings.TrimSpace(t)
	if args != h.call.args || !strings.HasPrefix(args, "{") {
		h.bad = true
	}
	h.calls = append(h.calls, ToolCall{ID: h.call.id, Type: "function", Function: FunctionCall{Name: h.call.name, Arguments: h.call.args}})
	h.call = nil
}

// finish returns the calls (a call cut short is dropped, its start already sent).
func (h *harmonyStream) finish() (reasoning, content string, calls []ToolCall, truncated bool) {
	raw := h.raw.String()
	if !strings.Contains(raw, "<|channel|>") && !strings.Contains(raw, "<|message|>") {
		return "", raw, nil, false // not Harmony at all: the text as written
	}
	if h.inBody && h.kind != 2 {
		if h.kind == 0 {
			content = h.buf
		} else {
			reasoning = h.buf
		}
	}
	if h.call != nil && h.inBody {
		// The reply ended in the call's body: generation stops at <|call|>, an
		// end-of-generation token that is not in the text. A complete JSON body is the
		// call (as ParseWith reads it); anything else was cut short.
		h.callBody(h.buf, true)
	}
	if h.call != nil {
		truncated = true
	}
	if h.bad {
		return reasoning, content, nil, true
	}
	return reasoning, content, h.calls, truncated && len(h.calls) == 0
}

// harmonyCallName is the function a message addressed to=functions.NAME calls, or ""
// when the recipient is not a function or names none: "to=functions." with nothing
// after it is not a call a client could dispatch, so its body stays text.
func harmonyCallName(recipient string) string {
	name, ok := strings.CutPrefix(recipient, "functions.")
	if !ok {
		return ""
	}
	return name
}

// harmony parses GPT-OSS messages: analysis is reasoning, final is content, a
// commentary message to=functions.NAME is a call (its body the arguments).
func (ps *parser) harmony(text string) Parsed {
	if !strings.Contains(text, "<|channel|>") && !strings.Contains(text, "<|message|>") {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	var p Parsed
	var content, reasoning []string
	for _, seg := range strings.Split(text, "<|start|>") {
		h, body, ok := strings.Cut(seg, "<|message|>")
		if !ok {
			if s := strings.TrimSpace(seg); s != "" && s != "assistant" {
				content = append(content, s)
			}
			continue
		}
		for _, end := range []string{"<|end|>", "<|call|>", "<|return|>"} {
			if j := strings.Index(body, end); j >= 0 {
				body = body[:j]
			}
		}
		channel, recipient := harmonyHeader(h)
		switch {
		case harmonyCallName(recipient) != "":
			args := strings.TrimSpace(body)
			if !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
				return Parsed{Content: strings.TrimSpace(text)}
			}
			p.Calls = append(p.Calls, ps.call(harmonyCallName(recipient), args, ""))
		case channel == "analysis":
			reasoning = append(reasoning, body)
		default:
			content = append(content, body)
		}
	}
	p.Content = strings.TrimSpace(strings.Join(content, "\n"))
	p.Reasoning = strings.TrimSpace(strings.Join(reasoning, "\n"))
	return p
}

// harmonyFamily: GPT-OSS writes a call as a message to=functions.NAME, the recipient in
// the channel line or in the role line; llama.cpp triggers on both (and on a reply that
// opens with the recipient, after a prompt ending in "<|start|>assistant").
func (c *gbnf) harmonyFamily(tools []Tool) (string, []Trigger, bool, error) {
	c.ban = "<|" // the body ends at <|call|>, <|end|> or <|return|>
	args, err := c.toolArgs(tools)
	if err != nil {
		return "", nil, false, err
	}
	if !objectArgs(tools) {
		return "", nil, false, nil
	}
	c.prim("space")
	c.rules["channel"] = `"<|channel|>" ( "commentary" | "analysis" )`
	c.rules["message"] = `( " <|constrain|>json" | " json" )? "<|message|>"`
	var inChannel, inRole []string
	for i, t := range tools {
		inChannel = append(inChannel, fmt.Sprintf(`%s message %s`, q(t.Function.Name), args[i]))
		inRole = append(inRole, fmt.Sprintf(`%s channel message %s`, q(t.Function.Name), args[i]))
	}
	root := fmt.Sprintf(`channel " to=functions." ( %s ) | "<|start|>assistant"? " to=functions." ( %s )`,
		strings.Join(inChannel, " | "), strings.Join(inRole, " | "))
	triggers := []Trigger{
		{Pattern: `[\s\S]*?(<\|channel\|>(?:commentary|analysis) to)[\s\S]*`},
		{Pattern: `[\s\S]*?(<\|start\|>assistant to)[\s\S]*`},
		{Pattern: `( to)[\s\S]*`},
	}
	return root, triggers, true, nil
}
