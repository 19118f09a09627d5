package api

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
)

// parseMessages validates OpenAI chat messages (tool calls and tool results included)
// and flattens their content to text.
func parseMessages(raw json.RawMessage) ([]chat.Message, *apiError) {
	var in []wire.ChatMessage
	if isNull(raw) {
		return nil, badRequest("messages must be a non-empty array")
	}
	var raws []json.RawMessage
	if err := json.Unmarshal(raw, &in); err != nil || json.Unmarshal(raw, &raws) != nil {
		return nil, badRequest("messages must be an array of {role, content} objects")
	}
	if len(in) == 0 {
		return nil, badRequest("messages must be a non-empty array")
	}
	msgs := make([]chat.Message, len(in))
	for i, m := range in {
		if !knownRoles[m.Role] {
			return nil, badRequest("messages[%d].role %q is not one of system, developer, user, assistant, tool", i, m.Role)
		}
		text, err := flattenContent(m.Content)
		if err != nil {
			return nil, badRequest("messages[%d]: %v", i, err)
		}
		msg := chat.Message{Role: m.Role, Content: text, NullContent: isNull(m.Content), Name: m.Name, ToolCallID: m.ToolCallID, ReasoningContent: m.ReasoningContent, Raw: raws[i]}
		if m.Role == "tool" && m.ToolCallID == "" {
			return nil, badRequest("messages[%d]: a tool message needs tool_call_id", i)
		}
		for j, c := range m.ToolCalls {
			if m.Role != "assistant" {
				return nil, badRequest("messages[%d]: only assistant messages carry tool_calls", i)
			}
			if c.Function.Name == "" {
				return nil, badRequest("messages[%d].tool_calls[%d].function.name is required", i, j)
			}
			args := "{}"
			var str string
			switch {
			case isNull(c.Function.Arguments):
			case json.Unmarshal(c.Function.Arguments, &str) == nil:
				args = str // OpenAI sends arguments as a JSON string
			default:
				args = string(c.Function.Arguments)
			}
			msg.ToolCalls = append(msg.ToolCalls, chat.ToolCall{ID: c.ID, Type: "function", Function: chat.FunctionCall{Name: c.Function.Name, Arguments: args}})
		}
		msgs[i] = msg
	}
	return msgs, nil
}

// Defaults follow llama-server's.
const (
	defaultTemperature = 0.8
	defaultTopK        = 40
	defaultTopP        = 0.95
	defaultMinP        = 0.05
)

// toEngine validates the shared fields and builds the engine request (without prompt).
// The checks run in a fixed order, so a request with several faults always gets the
// same error.
func (s *Server) toEngine(g *wire.GenParams) (engine.Request, *apiError) {
	var req engine.Request
	if e := poolFields(g, &req); e != nil {
		return req, e
	}
	if g.N != nil && *g.N != 1 {
		return req, badRequest("n: only 1 choice per request is supported, got %d", *g.N)
	}
	n, e := s.maxTokens(g)
	if e != nil {
		return req, e
	}
	req.MaxTokens = n
	if req.Sampling, e = s.sampling(g); e != nil {
		return req, e
	}
	if req.Stop, e = parseStop(g.Stop); e != nil {
		return req, e
	}
	req.IgnoreEOS = g.IgnoreEOS
	req.NoPrefixCache = g.CachePrompt != nil && !*g.CachePrompt
	if req.Spec, e = parseSpeculative(g); e != nil {
		return req, e
	}
	req.Overcommit = g.Overcommit
	if req.Logprobs, req.Sampling.NProbs, e = parseLogprobs(g.Logprobs, g.TopLogprobs); e != nil {
		return req, e
	}
	if g.SessionID != nil {
		if len(*g.SessionID) > 256 {
			return req, badRequest("session_id is longer than 256 bytes")
		}
		req.SessionID = *g.SessionID
	}
	if g.NextTurnMs != nil {
		if ms := *g.NextTurnMs; ms < 0 || ms > maxNextTurnMs {
			return req, badRequest("next_turn_ms must be between 0 and %d (a day), got %d", maxNextTurnMs, ms)
		}
		req.NextTurn = time.Duration(*g.NextTurnMs) * time.Millisecond
	}
	return req, nil
}

// maxNextTurnMs bounds next_turn_ms: a day.
const maxNextTurnMs = 24 * 3600 * 1000

// toolTurn tells the engine that the reply of ev's task ended in a tool call, so its
// conversation's next turn is expected soon (issue 40: eviction by expected next use).
// It does not wait: the reply is not held up for it.
func (s *Server) toolTurn(ev engine.Event) {
	if s.eng == nil {
		return // a server without an engine (shape tests)
	}
	go func() { _, _ = s.eng.Send(context.Background(), engine.ExpectTurn{Seq: ev.Stats.Seq, Task: ev.Task}) }()
}

// parseSpeculative reads the request's speculative decoding settings: speculative
// (false: off; true; or an object with n_max and n_min) and llama-server's flat
// speculative.n_max and speculative.n_min.
func parseSpeculative(g *wire.GenParams) (engine.SpecRequest, *apiError) {
	var sr engine.SpecRequest
	nmax, nmin := g.SpecNMax, g.SpecNMin
	if !isNull(g.Speculative) {
		var on bool
		var obj struct {
			NMax *int `json:"n_max"`
			NMin *int `json:"n_min"`
		}
		switch {
		case json.Unmarshal(g.Speculative, &on) == nil:
			sr.Off = !on
		case json.Unmarshal(g.Speculative, &obj) == nil:
			if obj.NMax != nil {
				nmax = obj.NMax
			}
			if obj.NMin != nil {
				nmin = obj.NMin
			}
		default:
			return sr, badRequest("speculative must be a boolean or an object {\"n_max\": N, \"n_min\": N}")
		}
	}
	if nmax != nil && (*nmax < 0 || *nmax > engine.MaxDraft) {
		return sr, badRequest("speculative.n_max must be in 0..%d, got %d", engine.MaxDraft, *nmax)
	}
	if nmin != nil && *nmin < 0 {
		return sr, badRequest("speculative.n_min must not be negative, got %d", *nmin)
	}
	if nmax != nil && nmin != nil && *nmin > *nmax {
		return sr, badRequest("speculative.n_min (%d) must not exceed speculative.n_max (%d)", *nmin, *nmax)
	}
	sr.NMax, sr.NMin = nmax, nmin
	return sr, nil
}

// poolFields reads pool_id or pool_key and the fields that need a pool.
func poolFields(g *wire.GenParams, req *engine.Request) *apiError {
	id, has, e := parsePoolID(g.PoolID)
	if e != nil {
		return e
	}
	req.HasPool, req.PoolID = has, id
	if g.PoolKey != nil {
		if has {
			return badRequest("pass pool_id or pool_key, not both")
		}
		key, e := parsePoolKey(*g.PoolKey)
		if e != nil {
			return e
		}
		req.PoolKey = &key
	}
	if g.SharedPrefixN != nil {
		if !has {
			return badRequest("shared_prefix_n_tokens needs pool_id")
		}
		if *g.SharedPrefixN < 0 {
			return badRequest("shared_prefix_n_tokens must not be negative, got %d", *g.SharedPrefixN)
		}
		req.SharedPrefixN = g.SharedPrefixN
	}
	if g.ReservationID != nil {
		if !has {
			return badRequest("reservation_id needs pool_id")
		}
		if len(*g.ReservationID) > 256 {
			return badRequest("reservation_id is longer than 256 bytes")
		}
		req.ReservationID = *g.ReservationID
	}
	return nil
}

// maxTokens reads the generation limit (0: none). OpenAI refuses max_tokens 0 (it
// would generate nothing, and llama-server's reading of 0, "unlimited", surprises
// OpenAI clients); -1 stays llama-server's "no limit". max_completion_tokens, OpenAI's
// newer name, wins when both are sent.
func (s *Server) maxTokens(g *wire.GenParams) (int, *apiError) {
	n := s.info.NPredict
	for _, f := range []struct {
		name string
		v    *int
	}{{"max_tokens", g.MaxTokens}, {"max_completion_tokens", g.MaxCompletionTokens}} {
		switch {
		case f.v == nil:
		case *f.v < 1 && *f.v != -1:
			return 0, invalidParam(f.name, "Invalid '%s': integer below minimum value. Expected a value >= 1, but got %d instead.", f.name, *f.v)
		case *f.v > s.info.NCtx:
			// More than the context can ever hold: generation stops where the context
			// ends, with finish reason length (stop reason max_tokens), as it would at
			// any max_tokens the context does not leave room for. Agent CLIs send their
			// model's limit (Claude Code: 32,000) whatever the server's context.
			n = s.info.NCtx
		case *f.v > 0:
			n = *f.v
		default: // -1
			n = 0
		}
	}
	return n, nil
}

// sampling reads the sampler fields over llama-server's defaults.
func (s *Server) sampling(g *wire.GenParams) (engine.SamplingParams, *apiError) {
	sp := engine.SamplingParams{Temperature: defaultTemperature, TopK: defaultTopK, TopP: defaultTopP, MinP: defaultMinP, RepeatPenalty: 1}
	if e := truncation(g, &sp); e != nil {
		return sp, e
	}
	if e := s.penalties(g, &sp); e != nil {
		return sp, e
	}
	if g.Seed != nil {
		sp.Seed = uint32(*g.Seed)
	} else {
		var b [4]byte
		_, _ = rand.Read(b[:])
		sp.Seed = binary.LittleEndian.Uint32(b[:])
	}
	return sp, nil
}

// truncation reads temperature and the candidate cuts (top_p, top_k, min_p).
func truncation(g *wire.GenParams, sp *engine.SamplingParams) *apiError {
	if v := g.Temperature; v != nil {
		if *v < 0 || *v > 2 {
			return badRequest("temperature must be in [0, 2], got %g", *v)
		}
		sp.Temperature = float32(*v)
	}
	if v := g.TopP; v != nil {
		if *v < 0 || *v > 1 {
			return badRequest("top_p must be in [0, 1], got %g", *v)
		}
		sp.TopP = float32(*v)
	}
	if v := g.TopK; v != nil {
		if *v < 0 {
			return badRequest("top_k must not be negative, got %d", *v)
		}
		sp.TopK = *v
	}
	if v := g.MinP; v != nil {
		if *v < 0 || *v > 1 {
			return badRequest("min_p must be in [0, 1], got %g", *v)
		}
		sp.MinP = float32(*v)
	}
	return nil
}

// penalties reads the repetition penalties.
func (s *Server) penalties(g *wire.GenParams, sp *engine.SamplingParams) *apiError {
	for name, v := range map[string]*float64{"presence_penalty": g.PresencePenalty, "frequency_penalty": g.FrequencyPenalty} {
		if v != nil && (*v < -2 || *v > 2) {
			return badRequest("%s must be in [-2, 2], got %g", name, *v)
		}
	}
	if v := g.PresencePenalty; v != nil {
		sp.PresencePenalty = float32(*v)
	}
	if v := g.FrequencyPenalty; v != nil {
		sp.FrequencyPenalty = float32(*v)
	}
	if v := g.RepeatPenalty; v != nil {
		if *v <= 0 || *v > 10 {
			return badRequest("repeat_penalty must be in (0, 10], got %g", *v)
		}
		sp.RepeatPenalty = float32(*v)
	}
	if v := g.RepeatLastN; v != nil {
		if *v < -1 || *v > s.info.NCtx {
			return badRequest("repeat_last_n must be in [-1, n_ctx], got %d", *v)
		}
		sp.RepeatLastN = *v
	}
	return nil
}

func isNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || bytes.Equal(t, []byte("null"))
}

func parseStop(raw json.RawMessage) ([]string, *apiError) {
	if isNull(raw) {
		return nil, nil
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, badRequest("stop must be a string or an array of strings")
	}
	if len(many) > 16 {
		return nil, badRequest("stop: at most 16 stop strings, got %d", len(many))
	}
	return many, nil
}

// flattenContent accepts a string or OpenAI content parts of type "text".
func flattenContent(raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []wire.ContentPart
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("content must be a string or an array of content parts")
	}
	var b strings.Builder
	for _, p := range parts {
		if p.Type != "text" || p.Text == nil {
			return "", fmt.Errorf("content part of type %q is not supported (text only)", p.Type)
		}
		b.WriteString(*p.Text)
	}
	return b.String(), nil
}

var knownRoles = map[string]bool{"system": true, "developer": true, "user": true, "assistant": true, "tool": true}

func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) {
	req, ok := decodeGen[wire.ChatRequest](s, w, r, writeAPIError)
	if !ok {
		return
	}
	s.submitChat(w, r, req, generation{k: kindChat, id: newID("chatcmpl-"), shape: openaiShape{}})
}

// submitChat is the one path from a chat request to the engine. Chat completions come
// through it, and so do the Responses and Messages routes once translated into a chat
// request: all three validate, render, constrain, parse tool calls and count alike.
// gen names the reply's id and shape; errors are answered in that shape.
func (s *Server) submitChat(w http.ResponseWriter, r *http.Request, req *wire.ChatRequest, gen generation) {
	ereq, e := s.toEngine(&req.GenParams)
	if e != nil {
		gen.shape.writeError(w, e)
		return
	}
	toks, plan, e := s.chatPrompt(req)
	if e != nil {
		gen.shape.writeError(w, e)
		return
	}
	ereq.Sampling.Grammar = plan.grammar
	for _, t := range plan.triggers {
		ereq.Sampling.GrammarTriggers = append(ereq.Sampling.GrammarTriggers, engine.GrammarTrigger{Word: t.Word, Pattern: t.Pattern})
	}
	ereq.Prompt = toks
	gen.plan = &plan
	s.generate(w, r, &req.GenParams, ereq, gen)
}

// chatPrompt is the one path from a chat request to the tokens it prefills (messages,
// tools and the chat template): the completion handler and the render endpoint share
// it, so what a router tokenizes through render is what the request prefills.
func (s *Server) chatPrompt(req *wire.ChatRequest) ([]int32, toolPlan, *apiError) {
	msgs, e := parseMessages(req.Messages)
	if e != nil {
		return nil, toolPlan{}, e
	}
	plan, e := s.planTools(req)
	if e != nil {
		return nil, plan, e
	}
	prompt, e := s.renderChat(msgs, plan.tools, true, req.TemplateOptions)
	if e != nil {
		return nil, plan, e
	}
	plan.reply.ThinkingOpen = chat.PromptOpensThinking(prompt)
	if plan.reply.ThinkingOpen {
		plan.triggers = chat.TriggersAfterThinking(plan.triggers)
		if plan.reply.Forced {
			// The forced call follows the reasoning the prompt opened (written inside
			// the block, the parser would read it as reasoning).
			plan.grammar = chat.ForcedAfterThinking(plan.grammar, prompt)
			if err := s.tok.CheckGrammar(plan.grammar); err != nil {
				return nil, plan, badRequest("the grammar compiled from the schema was refused: %v", err)
			}
		}
	}
	toks, err := s.tok.Tokenize(prompt, true, true)
	if err != nil {
		return nil, plan, badRequest("%v", err)
	}
	return toks, plan, nil
}

func (s *Server) handleCompletions(w http.ResponseWriter, r *http.Request) {
	req, ok := decodeGen[wire.CompletionRequest](s, w, r, writeAPIError)
	if !ok {
		return
	}
	ereq, e := s.toEngine(&req.GenParams)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	toks, e := s.completionPrompt(req.Prompt)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	ereq.Prompt = toks
	s.generate(w, r, &req.GenParams, ereq, generation{k: kindText, id: newID("cmpl-"), shape: openaiShape{}})
}

// completionPrompt accepts a string, a one-element array of strings, or token ids.
func (s *Server) completionPrompt(raw json.RawMessage) ([]int32, *apiError) {
	if isNull(raw) {
		return nil, badRequest("prompt is required")
	}
	var text string
	if json.Unmarshal(raw, &text) != nil {
		var texts []string
		var toks []int32
		switch {
		case json.Unmarshal(raw, &texts) == nil:
			if len(texts) != 1 {
				return nil, badRequest("prompt: exactly one prompt per request is supported, got %d", len(texts))
			}
			text = texts[0]
		case json.Unmarshal(raw, &toks) == nil:
			if len(toks) == 0 {
				return nil, badRequest("prompt must not be empty")
			}
			if e := s.checkTokens(toks); e != nil {
				return nil, e
			}
			return toks, nil
		default:
			return nil, badRequest("prompt must be a string, an array of one string, or an array of token ids")
		}
	}
	if text == "" {
		return nil, badRequest("prompt must not be empty")
	}
	toks, err := s.tok.Tokenize(text, true, true)
	if err != nil {
		return nil, badRequest("%v", err)
	}
	return toks, nil
}

type kind int

const (
	kindChat kind = iota
	kindText
)

func newID(prefix string) string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

func finishReason(ev engine.Event) string {
	if ev.Finish == engine.FinishLength {
		return "length"
	}
	return "stop"
}

// generation is one submitted completion, what its reply is built from.
type generation struct {
	k       kind
	id      string
	created int64
	req     engine.Request
	plan    *toolPlan // chat only
	shape   shape     // the API the reply is spelled in
}

// generate submits req and answers with its reply, streamed when g asks for it. The
// caller sets gen's kind, id, plan and shape.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, g *wire.GenParams, req engine.Request, gen generation) {
	st, gate, err := s.eng.Submit(r.Context(), req)
	if err != nil {
		e := errorFor(err)
		if e.typ == "exceed_context_size_error" {
			n, nctx := len(req.Prompt), s.info.NCtx
			e.extra = wire.Error{NPromptTokens: &n, NCtx: &nctx}
		}
		gen.shape.writeError(w, e)
		return
	}
	if req.Overcommit && req.HasPool {
		s.log.Info("overcommit: admission gate skipped", "pool", req.PoolID, "session", req.SessionID)
	}
	gateHeaders(w.Header(), req, gate)
	// Whatever happens to this handler, the task must not outlive it.
	defer st.Cancel()
	gen.created, gen.req = time.Now().Unix(), req
	if g.Stream {
		s.stream(w, r, st, s.newChunker(gen, g.StreamOptions != nil && g.StreamOptions.IncludeUsage))
		return
	}
	evs, err := st.Collect(r.Context())
	if err != nil || len(evs) == 0 {
		return // client gone; the deferred Cancel frees the sequence
	}
	var text strings.Builder
	var lps []engine.TokenLogprob
	for _, ev := range evs {
		text.WriteString(ev.Text)
		lps = append(lps, ev.Tokens...)
	}
	ev := evs[len(evs)-1]
	if ev.Err != nil {
		gen.shape.writeError(w, errorFor(ev.Err))
		return
	}
	if ev.Stats.Pool != 0 {
		w.Header().Set("X-Pool-Id", strconv.Itoa(ev.Stats.Pool))
	}
	w.Header().Set("X-Cached-Prefix-Tokens", strconv.Itoa(ev.Stats.CacheN))
	writeJSON(w, http.StatusOK, gen.shape.answer(s, gen, text.String(), lps, ev))
}

// gateHeaders report what an enforced pool's admission gate decided.
func gateHeaders(h http.Header, req engine.Request, gate engine.Gate) {
	if gate.Reserved {
		h.Set("X-PolyKV-Reservation", "used")
	}
	if gate.Checked {
		h.Set("X-Sessions-Remaining", strconv.Itoa(gate.SessionsRemaining))
		if gate.Warned {
			h.Set("X-PolyKV-Warning", fmt.Sprintf("pool %d admitted this session over its policy: %s", req.PoolID, gate.Verdict.Reason))
		}
	}
}

// completion is a finished generation's reply: a wire.ChatCompletion or a
// wire.TextCompletion.
func (s *Server) completion(gen generation, text string, lps []engine.TokenLogprob, ev engine.Event) any {
	if gen.k == kindText {
		choice := wire.TextChoice{FinishReason: finishReason(ev), Text: text}
		if gen.req.Logprobs {
			choice.Logprobs = s.textLogprobs(lps, &textOffsets{})
		}
		out := wire.TextCompletion{Object: "text_completion", Choices: []wire.TextChoice{choice}}
		completionTail(s, &out, gen, ev)
		return out
	}
	choice := wire.ChatChoice{FinishReason: finishReason(ev), Message: wire.Message{Role: "assistant", Content: &text}}
	if gen.req.Logprobs {
		choice.Logprobs = s.chatLogprobs(lps)
	}
	if gen.plan != nil {
		// reasoning, content and tool calls (tools.go)
		var calls bool
		choice.Message, calls = replyMessage(gen.plan, text)
		if calls {
			choice.FinishReason = "tool_calls"
			s.toolTurn(ev)
		}
	}
	out := wire.ChatCompletion{Object: "chat.completion", Choices: []wire.ChatChoice{choice}}
	completionTail(s, &out, gen, ev)
	return out
}

// completionTail fills the members chat and text completions share.
func completionTail[C any](s *Server, out *wire.Completion[C], gen generation, ev engine.Event) {
	out.ID, out.Created, out.Model = gen.id, gen.created, s.info.ModelID
	out.Usage = wireUsageOf(len(gen.req.Prompt), ev.Stats)
	out.Timings = wireTimings(ev.Stats)
	out.SessionID, out.Context = gen.req.SessionID, wireSessionCtx(ev.Stats.Ctx)
	out.PoolID, out.Truncated = ev.Stats.Pool, ev.Truncated
}

// renderError maps a chat-template failure: the template refusing the conversation is
// the caller's 400; anything else is ours.
func renderError(err error) *apiError {
	switch {
	case errors.Is(err, chat.ErrTemplateRaised):
		return badRequest("the model's chat template refused these messages: %v", err)
	case errors.Is(err, chat.ErrNoTemplate), errors.Is(err, chat.ErrTemplateFailed):
		return badRequest("%v", err)
	}
	return &apiError{status: http.StatusInternalServerError, typ: "server_error", msg: "chat template: " + err.Error()}
}
