package api

import (
	"net/http"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

// shape is how one API spells a generation's reply. Chat completions, OpenAI
// Responses and Anthropic Messages share everything up to the reply (validation,
// rendering, tool-call grammars and parsing, submission, the chunker's split into
// reasoning, content and call pieces); a shape only spells the result: the answer of
// a non-streamed request, the events of a stream, and errors. A shape may keep state
// across one stream's chunks (Responses and Messages number their items), so each
// generation gets its own.
type shape interface {
	// start is what a stream sends before the first piece.
	start(c *chunker) []any
	// chunk spells one chunk of the stream: a piece, the final chunk (sp.final) or the
	// usage chunk (sp.usage).
	chunk(c *chunker, sp chunkSpec) []any
	// failed spells a failure after the headers went out.
	failed(c *chunker, e *apiError) []any
	// done ends a finished stream.
	done(sw *sseWriter)
	// answer is the body of a finished, non-streamed generation.
	answer(s *Server, gen generation, text string, lps []engine.TokenLogprob, ev engine.Event) any
	// writeError answers an error in the API's own error shape.
	writeError(w http.ResponseWriter, e *apiError)
}

// openaiShape spells chat and text completions (the chunk types follow gen.k).
type openaiShape struct{}

func (openaiShape) start(c *chunker) []any { return c.start() }

func (openaiShape) chunk(c *chunker, sp chunkSpec) []any { return []any{c.openAIChunk(sp)} }

func (openaiShape) failed(_ *chunker, e *apiError) []any {
	return []any{wire.ErrorBody{Error: wire.Error{Code: e.status, Type: e.typ, Message: e.msg}}}
}

// done ends the stream with data: [DONE], as OpenAI's chat streams end.
func (openaiShape) done(sw *sseWriter) { sw.done() }

func (openaiShape) answer(s *Server, gen generation, text string, lps []engine.TokenLogprob, ev engine.Event) any {
	return s.completion(gen, text, lps, ev)
}

func (openaiShape) writeError(w http.ResponseWriter, e *apiError) { writeAPIError(w, e) }
