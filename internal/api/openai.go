package api

import (
	"bytes"
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

	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
)

// genParams are the generation fields shared by chat and text completions.
type genParams struct {
	Model               string          `json:"model"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	TopP                *float64        `json:"top_p"`
	TopK                *int            `json:"top_k"`
	MinP                *float64        `json:"min_p"`
	Seed                *int64          `json:"seed"`
	Stop                json.RawMessage `json:"stop"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	N                *int            `json:"n"`
	PresencePenalty  *float64        `json:"presence_penalty"`
	FrequencyPenalty *float64        `json:"frequency_penalty"`
	RepeatPenalty    *float64        `json:"repeat_penalty"`
	RepeatLastN      *int            `json:"repeat_last_n"`
	IgnoreEOS        bool            `json:"ignore_eos"`
	Logprobs         json.RawMessage `json:"logprobs"`
	TopLogprobs      *int            `json:"top_logprobs"`
	SessionID        *string         `json:"session_id"`
	PoolID           json.RawMessage `json:"pool_id"`
	SharedPrefixN    *int            `json:"shared_prefix_n_tokens"`
	PoolKey          *string         `json:"pool_key"`
	Overcommit       bool            `json:"overcommit"`
	ReservationID    *string         `json:"reservation_id"`
	// CachePrompt false (llama-server's name): prefill the whole prompt rather than
	// start from a cached prefix of another sequence (a cold reference).
	CachePrompt *bool `json:"cache_prompt"`
}

type chatRequest struct {
	genParams
	Messages          json.RawMessage `json:"messages"`
	Tools             json.RawMessage `json:"tools"`
	ToolChoice        json.RawMessage `json:"tool_choice"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls"`
	ResponseFormat    json.RawMessage `json:"response_format"`
	templateOptions                   // chat_template_kwargs, reasoning_effort (template.go)
}

// parseMessages validates OpenAI chat messages (tool calls and tool results included)
// and flattens their content to text.
func parseMessages(raw json.RawMessage) ([]chat.Message, *apiError) {
	var in []struct {
		Role       string          `json:"role"`
		Content    json.RawMessage `json:"content"`
		Name       string          `json:"name"`
		Reasoning  string          `json:"reasoning_content"`
		ToolCallID string          `json:"tool_call_id"`
		ToolCalls  []struct {
			ID       string `json:"id"`
			Type     string `json:"type"`
			Function struct {
				Name      string          `json:"name"`
				Arguments json.RawMessage `json:"arguments"`
			} `json:"function"`
		} `json:"tool_calls"`
	}
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
		msg := chat.Message{Role: m.Role, Content: text, NullContent: isNull(m.Content), Name: m.Name, ToolCallID: m.ToolCallID, ReasoningContent: m.Reasoning, Raw: raws[i]}
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

type completionRequest struct {
	genParams
	Prompt json.RawMessage `json:"prompt"`
}

// Defaults follow llama-server's.
const (
	defaultTemperature = 0.8
	defaultTopK        = 40
	defaultTopP        = 0.95
	defaultMinP        = 0.05
)

// toEngine validates the shared fields and builds the engine request (without prompt).
func (s *Server) toEngine(g *genParams) (engine.Request, *apiError) {
	var req engine.Request
	id, has, e := parsePoolID(g.PoolID)
	if e != nil {
		return req, e
	}
	req.HasPool, req.PoolID = has, id
	if g.PoolKey != nil {
		if has {
			return req, badRequest("pass pool_id or pool_key, not both")
		}
		key, e := parsePoolKey(*g.PoolKey)
		if e != nil {
			return req, e
		}
		req.PoolKey = &key
	}
	if g.SharedPrefixN != nil {
		if !has {
			return req, badRequest("shared_prefix_n_tokens needs pool_id")
		}
		if *g.SharedPrefixN < 0 {
			return req, badRequest("shared_prefix_n_tokens must not be negative, got %d", *g.SharedPrefixN)
		}
		req.SharedPrefixN = g.SharedPrefixN
	}
	if g.ReservationID != nil {
		if !has {
			return req, badRequest("reservation_id needs pool_id")
		}
		if len(*g.ReservationID) > 256 {
			return req, badRequest("reservation_id is longer than 256 bytes")
		}
		req.ReservationID = *g.ReservationID
	}
	if g.N != nil && *g.N != 1 {
		return req, badRequest("n: only 1 choice per request is supported, got %d", *g.N)
	}
	// OpenAI refuses max_tokens 0 (it would generate nothing, and llama-server's
	// reading of 0, "unlimited", surprises OpenAI clients); -1 stays llama-server's
	// "no limit". max_completion_tokens, OpenAI's newer name, wins when both are sent.
	for _, f := range []struct {
		name string
		v    *int
	}{{"max_tokens", g.MaxTokens}, {"max_completion_tokens", g.MaxCompletionTokens}} {
		switch {
		case f.v == nil:
		case *f.v < 1 && *f.v != -1:
			return req, invalidParam(f.name, "Invalid '%s': integer below minimum value. Expected a value >= 1, but got %d instead.", f.name, *f.v)
		case *f.v > s.info.NCtx:
			return req, invalidParam(f.name, "Invalid '%s': %d exceeds the context size %d.", f.name, *f.v, s.info.NCtx)
		case *f.v > 0:
			req.MaxTokens = *f.v
		default: // -1
			req.MaxTokens = 0
		}
	}
	sp := engine.SamplingParams{Temperature: defaultTemperature, TopK: defaultTopK, TopP: defaultTopP, MinP: defaultMinP, RepeatPenalty: 1}
	if v := g.Temperature; v != nil {
		if *v < 0 || *v > 2 {
			return req, badRequest("temperature must be in [0, 2], got %g", *v)
		}
		sp.Temperature = float32(*v)
	}
	if v := g.TopP; v != nil {
		if *v < 0 || *v > 1 {
			return req, badRequest("top_p must be in [0, 1], got %g", *v)
		}
		sp.TopP = float32(*v)
	}
	if v := g.TopK; v != nil {
		if *v < 0 {
			return req, badRequest("top_k must not be negative, got %d", *v)
		}
		sp.TopK = *v
	}
	if v := g.MinP; v != nil {
		if *v < 0 || *v > 1 {
			return req, badRequest("min_p must be in [0, 1], got %g", *v)
		}
		sp.MinP = float32(*v)
	}
	for name, v := range map[string]*float64{"presence_penalty": g.PresencePenalty, "frequency_penalty": g.FrequencyPenalty} {
		if v != nil && (*v < -2 || *v > 2) {
			return req, badRequest("%s must be in [-2, 2], got %g", name, *v)
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
			return req, badRequest("repeat_penalty must be in (0, 10], got %g", *v)
		}
		sp.RepeatPenalty = float32(*v)
	}
	if v := g.RepeatLastN; v != nil {
		if *v < -1 || *v > s.info.NCtx {
			return req, badRequest("repeat_last_n must be in [-1, n_ctx], got %d", *v)
		}
		sp.RepeatLastN = *v
	}
	if g.Seed != nil {
		sp.Seed = uint32(*g.Seed)
	} else {
		var b [4]byte
		_, _ = rand.Read(b[:])
		sp.Seed = binary.LittleEndian.Uint32(b[:])
	}
	req.Sampling = sp
	stops, e := parseStop(g.Stop)
	if e != nil {
		return req, e
	}
	req.Stop = stops
	req.IgnoreEOS = g.IgnoreEOS
	req.NoPrefixCache = g.CachePrompt != nil && !*g.CachePrompt
	req.Overcommit = g.Overcommit
	lp, n, e := parseLogprobs(g.Logprobs, g.TopLogprobs)
	if e != nil {
		return req, e
	}
	req.Logprobs = lp
	req.Sampling.NProbs = n
	if g.SessionID != nil {
		if len(*g.SessionID) > 256 {
			return req, badRequest("session_id is longer than 256 bytes")
		}
		req.SessionID = *g.SessionID
	}
	return req, nil
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
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
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
	var req chatRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		writeAPIError(w, e)
		return
	}
	sessionFromHeader(r, &req.genParams)
	ereq, e := s.toEngine(&req.genParams)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	toks, plan, e := s.chatPrompt(&req)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	ereq.Sampling.Grammar = plan.grammar
	ereq.Prompt = toks
	s.generate(w, r, kindChat, &req.genParams, ereq, &plan)
}

// chatPrompt is the one path from a chat request to the tokens it prefills (messages,
// tools and the chat template): the completion handler and the render endpoint share
// it, so what a router tokenizes through render is what the request prefills.
func (s *Server) chatPrompt(req *chatRequest) ([]int32, toolPlan, *apiError) {
	msgs, e := parseMessages(req.Messages)
	if e != nil {
		return nil, toolPlan{}, e
	}
	plan, e := s.planTools(req)
	if e != nil {
		return nil, plan, e
	}
	prompt, e := s.renderChat(msgs, plan.tools, true, req.templateOptions)
	if e != nil {
		return nil, plan, e
	}
	plan.reply.ThinkingOpen = chat.PromptOpensThinking(prompt)
	toks, err := s.tok.Tokenize(prompt, true, true)
	if err != nil {
		return nil, plan, badRequest("%v", err)
	}
	return toks, plan, nil
}

func (s *Server) handleCompletions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		writeAPIError(w, e)
		return
	}
	sessionFromHeader(r, &req.genParams)
	ereq, e := s.toEngine(&req.genParams)
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
	s.generate(w, r, kindText, &req.genParams, ereq, nil)
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

// result accumulates a finished generation.
type result struct {
	text     strings.Builder
	logprobs []engine.TokenLogprob
	done     engine.Event
}

func (s *Server) usage(promptN int, ev engine.Event) map[string]any {
	return map[string]any{
		"prompt_tokens":         promptN,
		"completion_tokens":     ev.Stats.PredictedN,
		"total_tokens":          promptN + ev.Stats.PredictedN,
		"prompt_tokens_details": map[string]any{"cached_tokens": ev.Stats.CacheN},
	}
}

func timings(st engine.Stats) map[string]any {
	t := llamaTimings(st)
	t["tps_ewma"] = st.TPS
	return t
}

func llamaTimings(st engine.Stats) map[string]any {
	pms := float64(st.PromptTime.Microseconds()) / 1000
	gms := float64(st.PredictTime.Microseconds()) / 1000
	t := map[string]any{
		"cache_n":   st.CacheN,
		"prompt_n":  st.PromptN,
		"prompt_ms": pms, "predicted_n": st.PredictedN, "predicted_ms": gms,
		"prompt_per_token_ms": 0.0, "prompt_per_second": 0.0,
		"predicted_per_token_ms": 0.0, "predicted_per_second": 0.0,
	}
	if st.PromptN > 0 && pms > 0 {
		t["prompt_per_token_ms"] = pms / float64(st.PromptN)
		t["prompt_per_second"] = 1000 * float64(st.PromptN) / pms
	}
	if st.PredictedN > 0 && gms > 0 {
		t["predicted_per_token_ms"] = gms / float64(st.PredictedN)
		t["predicted_per_second"] = 1000 * float64(st.PredictedN) / gms
	}
	return t
}

func finishReason(ev engine.Event) string {
	if ev.Finish == engine.FinishLength {
		return "length"
	}
	return "stop"
}

func (s *Server) generate(w http.ResponseWriter, r *http.Request, k kind, g *genParams, req engine.Request, plan *toolPlan) {
	st, gate, err := s.eng.Submit(r.Context(), req)
	if err != nil {
		e := errorFor(err)
		if e.typ == "exceed_context_size_error" {
			e.extra = map[string]any{"n_prompt_tokens": len(req.Prompt), "n_ctx": s.info.NCtx}
		}
		writeAPIError(w, e)
		return
	}
	if req.Overcommit && req.HasPool {
		s.log.Info("overcommit: admission gate skipped", "pool", req.PoolID, "session", req.SessionID)
	}
	if gate.Reserved {
		w.Header().Set("X-PolyKV-Reservation", "used")
	}
	if gate.Checked {
		w.Header().Set("X-Sessions-Remaining", strconv.Itoa(gate.SessionsRemaining))
		if gate.Warned {
			w.Header().Set("X-PolyKV-Warning", fmt.Sprintf("pool %d admitted this session over its policy: %s", req.PoolID, gate.Verdict.Reason))
		}
	}
	// Whatever happens to this handler, the task must not outlive it.
	defer st.Cancel()
	id := newID(map[kind]string{kindChat: "chatcmpl-", kindText: "cmpl-"}[k])
	created := time.Now().Unix()
	if g.Stream {
		s.stream(w, r, k, g, req, st, id, created, plan)
		return
	}
	evs, err := st.Collect(r.Context())
	if err != nil || len(evs) == 0 {
		return // client gone; the deferred Cancel frees the sequence
	}
	var res result
	for _, ev := range evs {
		res.text.WriteString(ev.Text)
		res.logprobs = append(res.logprobs, ev.Tokens...)
	}
	res.done = evs[len(evs)-1]
	ev := res.done
	if ev.Err != nil {
		writeAPIError(w, errorFor(ev.Err))
		return
	}
	choice := map[string]any{"index": 0, "finish_reason": finishReason(ev), "logprobs": nil}
	if req.Logprobs {
		choice["logprobs"] = s.logprobsJSON(k, res.logprobs, &textOffsets{})
	}
	object := "text_completion"
	if k == kindChat {
		object = "chat.completion"
		msg := map[string]any{"role": "assistant", "content": res.text.String()}
		if plan != nil {
			msg = replyMessage(plan, res.text.String(), choice) // reasoning, content, tool calls (tools.go)
		}
		choice["message"] = msg
	} else {
		choice["text"] = res.text.String()
	}
	body := map[string]any{
		"id": id, "object": object, "created": created, "model": s.info.ModelID,
		"choices": []any{choice}, "usage": s.usage(len(req.Prompt), ev), "timings": timings(ev.Stats),
		"session_id": req.SessionID, "context": ev.Stats.Ctx,
	}
	if ev.Stats.Pool != 0 {
		body["pool_id"] = ev.Stats.Pool
		w.Header().Set("X-Pool-Id", strconv.Itoa(ev.Stats.Pool))
	}
	w.Header().Set("X-Cached-Prefix-Tokens", strconv.Itoa(ev.Stats.CacheN))
	if ev.Truncated {
		body["truncated"] = true
	}
	writeJSON(w, http.StatusOK, body)
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

func nilIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func (s *Server) stream(w http.ResponseWriter, r *http.Request, k kind, g *genParams, req engine.Request, st *engine.Stream, id string, created int64, plan *toolPlan) {
	// Chat replies go through chat.ReplyStream: reasoning streams as
	// delta.reasoning_content, content as it is generated, and a tool call as
	// delta.tool_calls from its marker on (name first, then arguments as written).
	var calls *chat.ReplyStream
	if plan != nil {
		o := plan.reply
		o.Stream = true // call headers and arguments go out as they are generated
		calls = chat.NewReplyStream(o)
	}
	flusher, _ := w.(http.Flusher)
	// Headers wait for the first event: a request held by an admission gate (or failed
	// before its first token) can still answer with a proper status.
	first, ok, err := st.Next(r.Context())
	if err != nil || !ok {
		return
	}
	if first.Done && first.Err != nil {
		writeAPIError(w, errorFor(first.Err))
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	h.Set("X-Accel-Buffering", "no")
	// What was reused is known only at the end: it follows the body as a trailer.
	h.Set("Trailer", "X-Cached-Prefix-Tokens")
	w.WriteHeader(http.StatusOK)
	pending := &first
	object := "text_completion"
	if k == kindChat {
		object = "chat.completion.chunk"
	}
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return false
		}
		if flusher != nil {
			flusher.Flush()
		}
		return true
	}
	offsets := &textOffsets{} // legacy text_offset counts on across chunks
	chunk := func(text string, lps []engine.TokenLogprob, finish any) map[string]any {
		choice := map[string]any{"index": 0, "finish_reason": finish, "logprobs": nil}
		if req.Logprobs && len(lps) > 0 {
			choice["logprobs"] = s.logprobsJSON(k, lps, offsets)
		}
		if k == kindChat {
			delta := map[string]any{}
			if text != "" {
				delta["content"] = text
			}
			choice["delta"] = delta
		} else {
			choice["text"] = text
		}
		return map[string]any{"id": id, "object": object, "created": created, "model": s.info.ModelID, "choices": []any{choice}}
	}
	if k == kindChat {
		first := chunk("", nil, nil)
		first["choices"].([]any)[0].(map[string]any)["delta"] = map[string]any{"role": "assistant", "content": ""}
		if !send(first) {
			return
		}
	}
	for {
		var ev engine.Event
		if pending != nil {
			ev, pending = *pending, nil
		} else {
			var ok bool
			var err error
			if ev, ok, err = st.Next(r.Context()); err != nil || !ok {
				return
			}
		}
		if ev.Done {
			if ev.Err != nil {
				e := errorFor(ev.Err)
				send(map[string]any{"error": map[string]any{"code": e.status, "type": e.typ, "message": e.msg}})
				return
			}
			reason := finishReason(ev)
			if calls != nil {
				thought, released := calls.Push(ev.Text)
				fin := calls.Finish()
				rest, parsed := fin.Content, fin.Calls
				if thought += fin.Reasoning; thought != "" && !send(reasoningChunk(chunk("", nil, nil), thought)) {
					return
				}
				if content := released + rest; content != "" && !send(chunk(content, nil, nil)) {
					return
				}
				if !sendCallDeltas(send, chunk("", nil, nil), calls.Deltas()) {
					return
				}
				if len(parsed) > 0 {
					reason = "tool_calls"
				}
			} else if ev.Text != "" && !send(chunk(ev.Text, nil, nil)) {
				return
			}
			h.Set("X-Cached-Prefix-Tokens", strconv.Itoa(ev.Stats.CacheN))
			last := chunk("", nil, reason)
			last["timings"] = timings(ev.Stats)
			last["session_id"] = req.SessionID
			last["context"] = ev.Stats.Ctx
			if ev.Stats.Pool != 0 {
				last["pool_id"] = ev.Stats.Pool
			}
			if ev.Truncated {
				last["truncated"] = true
			}
			if !send(last) {
				return
			}
			if g.StreamOptions != nil && g.StreamOptions.IncludeUsage {
				u := map[string]any{"id": id, "object": object, "created": created, "model": s.info.ModelID,
					"choices": []any{}, "usage": s.usage(len(req.Prompt), ev)}
				if !send(u) {
					return
				}
			}
			fmt.Fprint(w, "data: [DONE]\n\n")
			if flusher != nil {
				flusher.Flush()
			}
			return
		}
		if ev.Text == "" && len(ev.Tokens) == 0 {
			continue
		}
		if calls != nil {
			thought, out := calls.Push(ev.Text)
			if thought != "" && !send(reasoningChunk(chunk("", nil, nil), thought)) {
				return
			}
			var lps []engine.TokenLogprob
			if out == ev.Text {
				lps = ev.Tokens // passed through unchanged: its tokens' logprobs still apply
			}
			if out != "" && !send(chunk(out, lps, nil)) {
				return
			}
			if !sendCallDeltas(send, chunk("", nil, nil), calls.Deltas()) {
				return
			}
			continue
		}
		if !send(chunk(ev.Text, ev.Tokens, nil)) {
			return
		}
	}
}
