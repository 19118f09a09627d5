package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
)

// A streamed completion is two parts: the chunker turns the engine's events into the
// typed chunks of the stream (pure: no I/O, unit-testable without HTTP), and the SSE
// writer frames, sends and flushes them, ends with [DONE] and stops when the client
// goes away.

// streamEnd says what an event did to the stream.
type streamEnd int

const (
	streamOpen   streamEnd = iota // more events follow
	streamDone                    // finished: [DONE] follows the chunks
	streamFailed                  // failed after the headers: the chunks are the error, no [DONE]
)

// chunker builds one streamed generation's chunks. Chat replies go through
// chat.ReplyStream: reasoning streams as delta.reasoning_content, content as it is
// generated, and a tool call as delta.tool_calls from its marker on (name first, then
// arguments as written).
type chunker struct {
	s            *Server
	gen          generation
	includeUsage bool
	calls        *chat.ReplyStream // chat only
	offsets      textOffsets       // legacy text_offset counts on across chunks
}

func (s *Server) newChunker(gen generation, includeUsage bool) *chunker {
	c := &chunker{s: s, gen: gen, includeUsage: includeUsage}
	if gen.plan != nil {
		o := gen.plan.reply
		o.Stream = true // call headers and arguments go out as they are generated
		c.calls = chat.NewReplyStream(o)
	}
	return c
}

// chunkSpec is one chunk before it takes its route's shape (render).
type chunkSpec struct {
	delta  wire.Delta // chat: the new piece
	text   string     // text completions: the new piece
	lps    []engine.TokenLogprob
	finish *string
	final  *engine.Event // the last chunk: context, session, timings, pool, truncation
	usage  *wire.Usage   // the usage chunk (no choices)
}

// piece is a chunk of generated text (with its tokens' logprobs, if asked for).
func piece(text string, lps []engine.TokenLogprob) chunkSpec {
	sp := chunkSpec{text: text, lps: lps}
	if text != "" {
		sp.delta.Content = &text
	}
	return sp
}

// start is what goes out before the first event: a chat stream's role chunk.
func (c *chunker) start() []any {
	if c.gen.k != kindChat {
		return nil
	}
	empty := ""
	return []any{c.openAIChunk(chunkSpec{delta: wire.Delta{Role: "assistant", Content: &empty}})}
}

// event is what one engine event adds to the stream.
func (c *chunker) event(ev engine.Event) ([]any, streamEnd) {
	switch {
	case !ev.Done:
		return c.pieces(ev), streamOpen
	case ev.Err != nil:
		return c.gen.shape.failed(c, errorFor(ev.Err)), streamFailed
	}
	return c.finish(ev), streamDone
}

// pieces are the chunks of a generated piece.
func (c *chunker) pieces(ev engine.Event) []any {
	if ev.Text == "" && len(ev.Tokens) == 0 {
		return nil
	}
	if c.calls == nil {
		return c.render(piece(ev.Text, ev.Tokens))
	}
	thought, text := c.calls.Push(ev.Text)
	var out []any
	if thought != "" {
		out = append(out, c.render(chunkSpec{delta: wire.Delta{ReasoningContent: thought}})...)
	}
	var lps []engine.TokenLogprob
	if text == ev.Text {
		lps = ev.Tokens // passed through unchanged: its tokens' logprobs still apply
	}
	if text != "" {
		out = append(out, c.render(piece(text, lps))...)
	}
	return append(out, c.callDeltas()...)
}

// finish is the end of a generation: what the reply stream still held, the chunk with
// the finish reason and the stats, and the usage chunk when asked for.
func (c *chunker) finish(ev engine.Event) []any {
	reason := finishReason(ev)
	var out []any
	if c.calls != nil {
		thought, released := c.calls.Push(ev.Text)
		fin := c.calls.Finish()
		if thought += fin.Reasoning; thought != "" {
			out = append(out, c.render(chunkSpec{delta: wire.Delta{ReasoningContent: thought}})...)
		}
		if content := released + fin.Content; content != "" {
			out = append(out, c.render(piece(content, nil))...)
		}
		out = append(out, c.callDeltas()...)
		if len(fin.Calls) > 0 {
			reason = "tool_calls"
			c.s.toolTurn(ev)
		}
	} else if ev.Text != "" {
		out = append(out, c.render(piece(ev.Text, nil))...)
	}
	out = append(out, c.render(chunkSpec{finish: &reason, final: &ev})...)
	if c.includeUsage {
		u := wireUsageOf(len(c.gen.req.Prompt), ev.Stats)
		out = append(out, c.render(chunkSpec{usage: &u})...)
	}
	return out
}

// callDeltas are the tool-call pieces the reply stream has ready, one chunk each, as
// OpenAI streams them: the first piece of a call with its index, id, type and name,
// then its arguments as they were generated.
func (c *chunker) callDeltas() []any {
	var out []any
	for _, d := range c.calls.Deltas() {
		tc := wire.ToolCallDelta{Index: d.Index, Function: wire.ToolCallFunctionDelta{Arguments: d.Args}}
		if d.Name != "" {
			tc.ID, tc.Type, tc.Function.Name = d.ID, "function", d.Name
		}
		out = append(out, c.render(chunkSpec{delta: wire.Delta{ToolCalls: []wire.ToolCallDelta{tc}}})...)
	}
	return out
}

// render gives a chunk its API's shape: the events it becomes.
func (c *chunker) render(sp chunkSpec) []any { return c.gen.shape.chunk(c, sp) }

// openAIChunk is a chunk of a chat or text completion stream: a wire.ChatChunk or a
// wire.TextChunk.
func (c *chunker) openAIChunk(sp chunkSpec) any {
	var lps []engine.TokenLogprob
	if c.gen.req.Logprobs {
		lps = sp.lps
	}
	if c.gen.k == kindChat {
		out := wire.ChatChunk{Object: "chat.completion.chunk", Choices: []wire.ChatChunkChoice{}}
		if sp.usage == nil {
			ch := wire.ChatChunkChoice{Delta: sp.delta, FinishReason: sp.finish}
			if len(lps) > 0 {
				ch.Logprobs = c.s.chatLogprobs(lps)
			}
			out.Choices = append(out.Choices, ch)
		}
		chunkTail(c, &out, sp)
		return out
	}
	out := wire.TextChunk{Object: "text_completion", Choices: []wire.TextChunkChoice{}}
	if sp.usage == nil {
		ch := wire.TextChunkChoice{Text: sp.text, FinishReason: sp.finish}
		if len(lps) > 0 {
			ch.Logprobs = c.s.textLogprobs(lps, &c.offsets)
		}
		out.Choices = append(out.Choices, ch)
	}
	chunkTail(c, &out, sp)
	return out
}

// chunkTail fills the members chat and text chunks share.
func chunkTail[C any](c *chunker, out *wire.Chunk[C], sp chunkSpec) {
	out.ID, out.Created, out.Model, out.Usage = c.gen.id, c.gen.created, c.s.info.ModelID, sp.usage
	if ev := sp.final; ev != nil {
		ctx, tm, session := wireSessionCtx(ev.Stats.Ctx), wireTimings(ev.Stats), c.gen.req.SessionID
		out.Context, out.Timings, out.SessionID = &ctx, &tm, &session
		out.PoolID, out.Truncated = ev.Stats.Pool, ev.Truncated
	}
}

// sseWriter is the framing of an event stream.
type sseWriter struct {
	w       http.ResponseWriter
	flusher http.Flusher
}

// startSSE sends the headers of an event stream.
func startSSE(w http.ResponseWriter, trailers ...string) *sseWriter {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	h.Set("X-Accel-Buffering", "no")
	for _, t := range trailers {
		h.Add("Trailer", t)
	}
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	return &sseWriter{w: w, flusher: f}
}

// eventNamer is an event with an SSE event name (Responses and Messages events name
// their type; chat chunks are unnamed data events).
type eventNamer interface{ EventName() string }

// send writes each value as a data event and flushes it; false: the client is gone.
func (sw *sseWriter) send(vs ...any) bool {
	for _, v := range vs {
		b, _ := json.Marshal(v)
		if n, ok := v.(eventNamer); ok {
			if _, err := fmt.Fprintf(sw.w, "event: %s\n", n.EventName()); err != nil {
				return false
			}
		}
		if _, err := fmt.Fprintf(sw.w, "data: %s\n\n", b); err != nil {
			return false
		}
		sw.flush()
	}
	return true
}

// done ends a finished stream as OpenAI's do.
func (sw *sseWriter) done() {
	fmt.Fprint(sw.w, "data: [DONE]\n\n")
	sw.flush()
}

func (sw *sseWriter) flush() {
	if sw.flusher != nil {
		sw.flusher.Flush()
	}
}

// stream sends a generation's events as they come, until it ends or the client goes.
func (s *Server) stream(w http.ResponseWriter, r *http.Request, st *engine.Stream, c *chunker) {
	// Headers wait for the first event: a request held by an admission gate (or failed
	// before its first token) can still answer with a proper status.
	ev, ok, err := st.Next(r.Context())
	if err != nil || !ok {
		return
	}
	if ev.Done && ev.Err != nil {
		c.gen.shape.writeError(w, errorFor(ev.Err))
		return
	}
	// The pool the request is attached to is on every event: a header, as on a reply
	// that is not streamed. What was reused is known only at the end: it follows the
	// body as a trailer.
	if ev.Pool != 0 {
		w.Header().Set("X-Pool-Id", strconv.Itoa(ev.Pool))
	}
	sw := startSSE(w, "X-Cached-Prefix-Tokens")
	if !sw.send(c.gen.shape.start(c)...) {
		return
	}
	for {
		out, end := c.event(ev)
		if end == streamDone {
			w.Header().Set("X-Cached-Prefix-Tokens", strconv.Itoa(ev.Stats.CacheN))
		}
		if !sw.send(out...) || end == streamFailed {
			return
		}
		if end == streamDone {
			c.gen.shape.done(sw)
			return
		}
		if ev, ok, err = st.Next(r.Context()); err != nil || !ok {
			return
		}
	}
}
