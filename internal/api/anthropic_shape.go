package api

import (
	"encoding/json"
	"net/http"
	"strings"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

// anthropicShape spells a generation as an Anthropic Messages reply. Streamed, the
// chunker's pieces become Anthropic's event sequence: message_start; per content
// block content_block_start, its deltas (thinking_delta, text_delta,
// input_json_delta) and content_block_stop; message_delta with the stop reason and the
// usage; message_stop. A non-streamed answer is built by the same block builder.
type anthropicShape struct {
	s      *Server
	blocks []wire.AnthropicContent
	open   *wire.AnthropicContent // the block receiving deltas (nil: none)
	text   strings.Builder        // its text, thinking or input JSON so far
	ev     []any
}

func (a *anthropicShape) start(c *chunker) []any {
	msg := a.reply(c.gen)
	msg.Usage.InputTokens = len(c.gen.req.Prompt)
	return []any{wire.AnthropicEvent{Type: "message_start", Message: &msg}}
}

func (a *anthropicShape) chunk(c *chunker, sp chunkSpec) []any {
	switch {
	case sp.usage != nil:
	case sp.final != nil:
		reason := sp.finish != nil && *sp.finish == "tool_calls"
		msg := a.finish(c.gen, *sp.final, reason)
		a.ev = append(a.ev,
			wire.AnthropicEvent{Type: "message_delta", Delta: &wire.AnthropicDelta{StopReason: msg.StopReason}, Usage: &msg.Usage},
			wire.AnthropicEvent{Type: "message_stop"})
	case sp.delta.ReasoningContent != "":
		a.add("thinking", sp.delta.ReasoningContent, "", "")
	case sp.delta.Content != nil:
		a.add("text", *sp.delta.Content, "", "")
	}
	for _, tc := range sp.delta.ToolCalls {
		if tc.Function.Name != "" {
			a.closeBlock()
		}
		a.add("tool_use", tc.Function.Arguments, tc.ID, tc.Function.Name)
	}
	out := a.ev
	a.ev = nil
	return out
}

// failed ends the stream with an error event.
func (a *anthropicShape) failed(_ *chunker, e *apiError) []any {
	ae := anthropicError(e)
	return []any{wire.AnthropicEvent{Type: "error", Error: &ae.Error}}
}

// done: a Messages stream ends with message_stop, no [DONE].
func (a *anthropicShape) done(*sseWriter) {}

func (a *anthropicShape) answer(s *Server, gen generation, text string, _ []engine.TokenLogprob, ev engine.Event) any {
	msg, calls := replyMessage(gen.plan, text)
	if calls {
		s.toolTurn(ev)
	}
	a.add("thinking", msg.ReasoningContent, "", "")
	if msg.Content != nil {
		a.add("text", *msg.Content, "", "")
	}
	for _, c := range msg.ToolCalls {
		a.closeBlock()
		a.add("tool_use", c.Function.Arguments, c.ID, c.Function.Name)
	}
	a.ev = nil
	return a.finish(gen, ev, calls)
}

func (a *anthropicShape) writeError(w http.ResponseWriter, e *apiError) { writeAnthropicError(w, e) }

// add appends text to the open block of type typ, opening one (content_block_start)
// after closing any other.
func (a *anthropicShape) add(typ, text, id, name string) {
	if text == "" && typ != "tool_use" {
		return
	}
	if a.open == nil || a.open.Type != typ {
		a.closeBlock()
		b := wire.AnthropicContent{Type: typ}
		switch typ {
		case "text":
			b.Text = ptr("")
		case "thinking":
			b.Thinking, b.Signature = ptr(""), ptr("")
		case "tool_use":
			b.ID, b.Name, b.Input = id, name, json.RawMessage(`{}`)
		}
		a.open = &b
		a.text.Reset()
		start := b
		a.ev = append(a.ev, wire.AnthropicEvent{Type: "content_block_start", Index: ptr(len(a.blocks)), ContentBlock: &start})
	}
	if text == "" {
		return
	}
	a.text.WriteString(text)
	d := &wire.AnthropicDelta{}
	switch typ {
	case "text":
		d.Type, d.Text = "text_delta", &text
	case "thinking":
		d.Type, d.Thinking = "thinking_delta", &text
	case "tool_use":
		d.Type, d.PartialJSON = "input_json_delta", &text
	}
	a.ev = append(a.ev, wire.AnthropicEvent{Type: "content_block_delta", Index: ptr(len(a.blocks)), Delta: d})
}

// closeBlock ends the open block (content_block_stop) and keeps it, complete.
func (a *anthropicShape) closeBlock() {
	if a.open == nil {
		return
	}
	b, text := *a.open, a.text.String()
	switch b.Type {
	case "text":
		b.Text = &text
	case "thinking":
		b.Thinking = &text
	case "tool_use":
		if strings.TrimSpace(text) != "" && json.Valid([]byte(text)) {
			b.Input = json.RawMessage(text)
		}
	}
	a.ev = append(a.ev, wire.AnthropicEvent{Type: "content_block_stop", Index: ptr(len(a.blocks))})
	a.blocks = append(a.blocks, b)
	a.open = nil
}

// reply is the message with the blocks so far.
func (a *anthropicShape) reply(gen generation) wire.AnthropicReply {
	return wire.AnthropicReply{ID: gen.id, Type: "message", Role: "assistant", Model: a.s.info.ModelID,
		Content: append([]wire.AnthropicContent{}, a.blocks...), SessionID: gen.req.SessionID}
}

// finish closes the last block and completes the message: the stop reason, the usage
// (input_tokens prefilled, cache_read_input_tokens reused from the KV cache) and
// PolyKV's members.
func (a *anthropicShape) finish(gen generation, ev engine.Event, calls bool) wire.AnthropicReply {
	a.closeBlock()
	msg := a.reply(gen)
	reason := "end_turn"
	switch {
	case calls:
		reason = "tool_use"
	case ev.Finish == engine.FinishLength:
		reason = "max_tokens"
	case ev.StopWord != "":
		reason = "stop_sequence"
		msg.StopSequence = &ev.StopWord
	}
	msg.StopReason = &reason
	n := len(gen.req.Prompt)
	msg.Usage = wire.AnthropicUsage{InputTokens: n - ev.Stats.CacheN - ev.Stats.RestoredN, CacheReadInputTokens: ev.Stats.CacheN + ev.Stats.RestoredN, OutputTokens: ev.Stats.PredictedN}
	ctx, tm := wireSessionCtx(ev.Stats.Ctx), wireTimings(ev.Stats)
	msg.Context, msg.Timings, msg.PoolID = &ctx, &tm, ev.Stats.Pool
	return msg
}
