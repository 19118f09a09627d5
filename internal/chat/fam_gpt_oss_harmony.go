package chat

import "strings"

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
	channel, recipient := "", ""
	for _, f := range strings.Fields(strings.NewReplacer("<|channel|>", " <|channel|>", "<|constrain|>", " <|constrain|>", "<|start|>", " ").Replace(hd)) {
		switch {
		case strings.HasPrefix(f, "<|channel|>"):
			channel = strings.TrimPrefix(f, "<|channel|>")
		case strings.HasPrefix(f, "to="):
			recipient = strings.TrimPrefix(f, "to=")
		}
	}
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
