package api

import (
	"net/http"
	"strings"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

// responsesShape spells a generation as a Responses API response. Streamed, the
// chunker's pieces become typed events in the order the official SDK's accumulator
// expects: response.created and response.in_progress; then per output item
// output_item.added, for text items content_part.added, the deltas
// (reasoning_text.delta, output_text.delta or function_call_arguments.delta), their
// .done, content_part.done and output_item.done; last response.completed (or
// response.incomplete when max_output_tokens cut it short). A non-streamed answer is
// built by the same item builder, so both carry the same output.
type responsesShape struct {
	s    *Server
	resp wire.Response // the skeleton; its output and status fill in as items close
	turn *responseTurn
	seq  int
	open wire.ResponseOutputItem // the item receiving deltas (nil: none)
	text strings.Builder         // the open item's text or arguments so far
	ev   []any                   // events produced by the current chunk
}

func (r *responsesShape) start(*chunker) []any {
	r.emit(wire.ResponseEvent{Type: "response.created", Response: r.snapshot()})
	r.emit(wire.ResponseEvent{Type: "response.in_progress", Response: r.snapshot()})
	return r.flush()
}

func (r *responsesShape) chunk(c *chunker, sp chunkSpec) []any {
	switch {
	case sp.usage != nil:
	case sp.final != nil:
		resp := r.finish(c.gen, *sp.final, sp.finish != nil && *sp.finish == "tool_calls")
		typ := "response.completed"
		if resp.Status == "incomplete" {
			typ = "response.incomplete"
		}
		r.emit(wire.ResponseEvent{Type: typ, Response: &resp})
	case sp.delta.ReasoningContent != "":
		r.reasoning(sp.delta.ReasoningContent)
	case sp.delta.Content != nil:
		r.content(*sp.delta.Content)
	}
	for _, tc := range sp.delta.ToolCalls {
		if tc.Function.Name != "" {
			r.callStart(tc.ID, tc.Function.Name)
		}
		r.callArgs(tc.Function.Arguments)
	}
	return r.flush()
}

// failed ends the stream with response.failed, the error in the response.
func (r *responsesShape) failed(_ *chunker, e *apiError) []any {
	resp := r.resp
	resp.Status, resp.Error = "failed", &wire.ResponseError{Code: e.typ, Message: e.msg}
	resp.Output = nonNil(resp.Output)
	r.emit(wire.ResponseEvent{Type: "response.failed", Response: &resp})
	return r.flush()
}

// done: a Responses stream ends with its last event, no [DONE].
func (r *responsesShape) done(*sseWriter) {}

func (r *responsesShape) answer(s *Server, gen generation, text string, _ []engine.TokenLogprob, ev engine.Event) any {
	msg, calls := replyMessage(gen.plan, text)
	if calls {
		s.toolTurn(ev)
	}
	r.reasoning(msg.ReasoningContent)
	if msg.Content != nil && *msg.Content != "" {
		r.content(*msg.Content)
	}
	for _, c := range msg.ToolCalls {
		r.callStart(c.ID, c.Function.Name)
		r.callArgs(c.Function.Arguments)
	}
	return r.finish(gen, ev, calls)
}

func (r *responsesShape) writeError(w http.ResponseWriter, e *apiError) { writeAPIError(w, e) }

// emit queues one event, numbered in stream order.
func (r *responsesShape) emit(e wire.ResponseEvent) {
	e.SequenceNumber = r.seq
	r.seq++
	r.ev = append(r.ev, e)
}

func (r *responsesShape) flush() []any {
	out := r.ev
	r.ev = nil
	return out
}

// snapshot is the response as it stands (a copy: the events keep what they showed).
func (r *responsesShape) snapshot() *wire.Response {
	resp := r.resp
	resp.Output = append([]wire.ResponseOutputItem{}, r.resp.Output...)
	return &resp
}

func ptr[T any](v T) *T { return &v }

// openItem closes the open item unless it is of type typ, and opens a new one made by
// mk. It reports whether it opened one.
func (r *responsesShape) openItem(typ string, mk func(id string) wire.ResponseOutputItem) bool {
	if r.open != nil && r.open.OutputType() == typ && typ != "function_call" {
		return false
	}
	r.closeItem()
	prefix := map[string]string{"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}[typ]
	r.open = mk(newID(prefix))
	r.text.Reset()
	r.emit(wire.ResponseEvent{Type: "response.output_item.added", OutputIndex: ptr(len(r.resp.Output)), Item: r.open})
	return true
}

// partEvent is a content-part or text event of the open item (content index 0).
func (r *responsesShape) partEvent(typ, id string, e wire.ResponseEvent) {
	e.Type, e.OutputIndex, e.ItemID, e.ContentIndex = typ, ptr(len(r.resp.Output)), id, ptr(0)
	r.emit(e)
}

func (r *responsesShape) reasoning(text string) {
	if text == "" {
		return
	}
	if r.openItem("reasoning", func(id string) wire.ResponseOutputItem {
		return &wire.ResponseReasoningItem{ID: id, Type: "reasoning", Status: "in_progress", Summary: []wire.ResponseInputPart{}, Content: []wire.ResponseInputPart{}}
	}) {
		r.partEvent("response.content_part.added", r.itemID(), wire.ResponseEvent{Part: wire.ResponseInputPart{Type: "reasoning_text", Text: ptr("")}})
	}
	r.text.WriteString(text)
	r.partEvent("response.reasoning_text.delta", r.itemID(), wire.ResponseEvent{Delta: &text})
}

func (r *responsesShape) content(text string) {
	if r.openItem("message", func(id string) wire.ResponseOutputItem {
		return &wire.ResponseMessage{ID: id, Type: "message", Status: "in_progress", Role: "assistant", Content: []wire.ResponseOutputText{}}
	}) {
		r.partEvent("response.content_part.added", r.itemID(), wire.ResponseEvent{Part: outputText("")})
	}
	if text == "" {
		return
	}
	r.text.WriteString(text)
	r.partEvent("response.output_text.delta", r.itemID(), wire.ResponseEvent{Delta: &text, Logprobs: &[]any{}})
}

func (r *responsesShape) callStart(callID, name string) {
	namespace, name := r.turn.tools.clientName(name)
	r.openItem("function_call", func(id string) wire.ResponseOutputItem {
		return &wire.ResponseFunctionCall{ID: id, Type: "function_call", Status: "in_progress", CallID: callID, Name: name, Namespace: namespace}
	})
}

func (r *responsesShape) callArgs(args string) {
	if args == "" || r.open == nil || r.open.OutputType() != "function_call" {
		return
	}
	r.text.WriteString(args)
	r.emit(wire.ResponseEvent{Type: "response.function_call_arguments.delta", OutputIndex: ptr(len(r.resp.Output)), ItemID: r.itemID(), Delta: &args})
}

func outputText(text string) wire.ResponseOutputText {
	return wire.ResponseOutputText{Type: "output_text", Text: text, Annotations: []any{}, Logprobs: []any{}}
}

func (r *responsesShape) itemID() string {
	switch it := r.open.(type) {
	case *wire.ResponseMessage:
		return it.ID
	case *wire.ResponseReasoningItem:
		return it.ID
	case *wire.ResponseFunctionCall:
		return it.ID
	}
	return ""
}

// closeItem finishes the open item: its .done events, then output_item.done with the
// completed item, which joins the response's output.
func (r *responsesShape) closeItem() {
	if r.open == nil {
		return
	}
	text, id := r.text.String(), r.itemID()
	switch it := r.open.(type) {
	case *wire.ResponseMessage:
		r.partEvent("response.output_text.done", id, wire.ResponseEvent{Text: &text, Logprobs: &[]any{}})
		r.partEvent("response.content_part.done", id, wire.ResponseEvent{Part: outputText(text)})
		done := *it
		done.Status, done.Content = "completed", []wire.ResponseOutputText{outputText(text)}
		r.open = &done
	case *wire.ResponseReasoningItem:
		part := wire.ResponseInputPart{Type: "reasoning_text", Text: &text}
		r.partEvent("response.reasoning_text.done", id, wire.ResponseEvent{Text: &text})
		r.partEvent("response.content_part.done", id, wire.ResponseEvent{Part: part})
		done := *it
		done.Status, done.Content = "completed", []wire.ResponseInputPart{part}
		if r.turn.encrypted {
			done.EncryptedContent = ptr(sealReasoning(text))
		}
		r.open = &done
	case *wire.ResponseFunctionCall:
		r.emit(wire.ResponseEvent{Type: "response.function_call_arguments.done", OutputIndex: ptr(len(r.resp.Output)), ItemID: id, Name: it.Name, Arguments: &text})
		done := *it
		done.Status, done.Arguments = "completed", text
		r.open = &done
	}
	r.emit(wire.ResponseEvent{Type: "response.output_item.done", OutputIndex: ptr(len(r.resp.Output)), Item: r.open})
	r.resp.Output = append(r.resp.Output, r.open)
	r.open = nil
}

// finish closes the last item and completes the response: status, usage, PolyKV's
// members; a stored response is kept for GET and previous_response_id.
func (r *responsesShape) finish(gen generation, ev engine.Event, calls bool) wire.Response {
	if r.open == nil && len(r.resp.Output) == 0 {
		r.content("") // an empty reply is still one (empty) message
	}
	r.closeItem()
	resp := r.resp
	resp.Status = "completed"
	if ev.Finish == engine.FinishLength && !calls {
		resp.Status, resp.IncompleteDetails = "incomplete", &wire.IncompleteDetails{Reason: "max_output_tokens"}
	}
	u := wireUsageOf(len(gen.req.Prompt), ev.Stats)
	resp.Usage = &wire.ResponseUsage{InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens, TotalTokens: u.TotalTokens,
		InputTokensDetails: wire.InputTokensDetails{CachedTokens: u.PromptTokensDetails.CachedTokens}}
	if gen.req.SessionID != "" {
		resp.Usage.InputTokensDetails.CacheWriteTokens = ev.Stats.PromptN
	}
	for _, it := range resp.Output {
		if rs, ok := it.(*wire.ResponseReasoningItem); ok && len(rs.Content) > 0 && rs.Content[0].Text != nil {
			if toks, err := r.s.tok.Tokenize(*rs.Content[0].Text, false, false); err == nil {
				resp.Usage.OutputTokensDetails.ReasoningTokens += len(toks)
			}
		}
	}
	ctx, tm := wireSessionCtx(ev.Stats.Ctx), wireTimings(ev.Stats)
	resp.Context, resp.Timings, resp.PoolID = &ctx, &tm, ev.Stats.Pool
	if r.turn.store {
		history := r.replyHistory(resp.Output) // adds the reply's calls to r.turn.calls
		r.s.responses.put(&storedResponse{resp: resp, history: history, calls: r.turn.calls, session: r.turn.session})
	}
	return resp
}

// replyHistory is the conversation through the reply, for a continuation.
func (r *responsesShape) replyHistory(out []wire.ResponseOutputItem) []chatTurnMsg {
	c := newConvo(r.turn.history, nil)
	for _, it := range out {
		switch it := it.(type) {
		case *wire.ResponseReasoningItem:
			for _, p := range it.Content {
				if p.Text != nil {
					c.think(*p.Text)
				}
			}
		case *wire.ResponseMessage:
			for _, p := range it.Content {
				c.say("assistant", p.Text)
			}
		case *wire.ResponseFunctionCall:
			c.call(it.CallID, it.Name, it.Arguments)
		}
	}
	for id, name := range r.turn.calls {
		c.calls[id] = name
	}
	r.turn.calls = c.calls
	return c.msgs
}
