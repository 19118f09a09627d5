// Package api is PolyKV's HTTP layer: the OpenAI-compatible routes, llama-server's
// utility routes, JSON errors and SSE. Handlers never touch the llama context; they
// tokenize with the (read-only) model, submit work to the engine and read its streams.
package api

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/pool"
	"github.com/polykv/polykv/internal/tier"
	"github.com/polykv/polykv/internal/tps"
	"github.com/polykv/polykv/internal/ui"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Tokenizer is the read-only model surface handlers use. *llama.Model implements it.
type Tokenizer interface {
	Tokenize(text string, addSpecial, parseSpecial bool) ([]int32, error)
	Detokenize(tokens []int32, removeSpecial, unparseSpecial bool) (string, error)
	TokenPiece(tok int32, special bool) []byte
	ValidToken(tok int32) bool
	NVocab() int
	CheckGrammar(gbnf string) error
}

// ChatRenderer turns chat messages into prompt text. Pools render the start of a
// conversation (addGenerationPrompt false) with the same renderer as chat requests, so
// a pool's prefix is a token prefix of the chats that attach to it.
type ChatRenderer interface {
	Render(msgs []chat.Message, tools []chat.Tool, addGenerationPrompt bool) (string, error)
	Path() string
}

// Info describes the served model and configuration for /props and /v1/models.
type Info struct {
	ModelID      string
	ModelPath    string
	ModelDesc    string
	NCtx         int
	NCtxTrain    int
	Parallel     int
	NBatch       int
	NVocab       int
	ChatTemplate string
	Started      time.Time
	MaxPools     int
	PoolGraceMs  int64
	BytesPerCell int64
	// NPredict is --n-predict: max_tokens for a request that names none (0: none).
	NPredict int
	// PoolTier is why the pool tier is off although asked for ("" when on or not asked).
	PoolTier string
	// SlotSavePath is --slot-save-path ("": slot save/restore off); ModelKey names the
	// model, build and cache types saved files are valid for (package tier).
	SlotSavePath string
	ModelKey     string
	TPSTauMs     int64
	// PrefixCache: automatic prefix sharing is on (--prefix-cache).
	PrefixCache bool
	// Spec is the speculative decoding in force (--spec-type, --draft-max,
	// --draft-min; off on a recurrent model).
	Spec engine.Spec
	// Compute is where the model runs (devices, GPU layers), as app.Offload describes it.
	Compute any
	// SessionTTL is --session-ttl: stored responses expire with it, as their chain's
	// session loses its KV then (0: never).
	SessionTTL time.Duration
	// ResponsesMax and ResponsesMaxBytes bound the stored responses (--responses-max,
	// --responses-max-bytes; 0: the defaults, 1,024 and 64 MiB). The oldest go first.
	ResponsesMax      int
	ResponsesMaxBytes int64
	// BuildInfo names the linked llama.cpp (llama.BuildInfo); CPUFeatures are the x86
	// features its CPU backend was compiled with (llama.CPUFeatures).
	BuildInfo   string
	CPUFeatures []string
	// OrderedAttention reports whether attention is ordered by position (nil: false; see
	// llama.Context.OrderedAttention). A func: it turns false if an attention node ever
	// runs llama.cpp's kernel.
	OrderedAttention func() bool
}

// Server holds the handlers' dependencies.
type Server struct {
	eng     *engine.Engine
	tok     Tokenizer
	chat    ChatRenderer
	info    Info
	log     *slog.Logger
	maxBody int64
	metrics *Metrics
	apiKeys [][sha256.Size]byte // SHA-256 of each accepted key; none = open
	// responses are the stored Responses API responses (store: true).
	responses *responseStore
	tier      *tier.Store // the pool tier (nil: none)
}

// SetTier shows where evicted pools' KV lives (residency ram / disk, restore_cost) and
// the tier's counters in /props.
func (s *Server) SetTier(t *tier.Store) { s.tier = t }

// New creates the HTTP server state. metrics may be nil (no /metrics route).
func New(eng *engine.Engine, tok Tokenizer, chat ChatRenderer, info Info, metrics *Metrics, log *slog.Logger) *Server {
	if log == nil {
		log = slog.Default()
	}
	return &Server{eng: eng, tok: tok, chat: chat, info: info, log: log, maxBody: 16 << 20, metrics: metrics,
		responses: newResponseStore(info.SessionTTL, info.ResponsesMax, info.ResponsesMaxBytes)}
}

// Handler returns the routed handler. This is the route table: every route the server
// answers is registered here, grouped by API, and nowhere else.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	// OpenAI-compatible generation; the paths without /v1 are llama-server's aliases.
	mux.HandleFunc("POST /v1/chat/completions", s.handleChat)
	mux.HandleFunc("POST /chat/completions", s.handleChat)
	mux.HandleFunc("POST /v1/completions", s.handleCompletions)
	mux.HandleFunc("POST /completions", s.handleCompletions)
	mux.HandleFunc("GET /v1/models", s.handleModels)
	mux.HandleFunc("GET /models", s.handleModels)
	// OpenAI's Responses API (responses.go) and Anthropic's Messages API (anthropic.go).
	mux.HandleFunc("POST /v1/responses", s.handleResponses)
	mux.HandleFunc("GET /v1/responses/{id}", s.handleGetResponse)
	mux.HandleFunc("DELETE /v1/responses/{id}", s.handleDeleteResponse)
	mux.HandleFunc("POST /v1/messages", s.handleMessages)
	mux.HandleFunc("POST /v1/messages/count_tokens", s.handleCountTokens)
	// Rendering without generating: the token ids a request would prefill (fleet.go, for
	// llm-d's router) and llama-server's prompt text (template.go).
	mux.HandleFunc("POST /v1/chat/completions/render", s.handleChatRender)
	mux.HandleFunc("POST /v1/completions/render", s.handleCompletionsRender)
	mux.HandleFunc("POST /apply-template", s.handleApplyTemplate)
	// llama-server's utility routes and slot API (slots.go).
	mux.HandleFunc("POST /tokenize", s.handleTokenize)
	mux.HandleFunc("POST /detokenize", s.handleDetokenize)
	mux.HandleFunc("GET /health", s.handleHealth)
	mux.HandleFunc("GET /props", s.handleProps)
	mux.HandleFunc("GET /slots", s.handleSlots)
	mux.HandleFunc("POST /slots/{id}", s.handleSlotAction)
	// Pools (pools.go).
	mux.HandleFunc("POST /polykv/pools", s.handleCreatePool)
	mux.HandleFunc("GET /polykv/pools", s.handleListPools)
	mux.HandleFunc("GET /polykv/pools/{id}", s.handleGetPool)
	mux.HandleFunc("DELETE /polykv/pools/{id}", s.handleReleasePool)
	mux.HandleFunc("POST /polykv/pools/{id}/fork", s.handleForkPool)
	mux.HandleFunc("POST /polykv/pools/{id}/pin", s.poolAction(func(id int) engine.Msg { return engine.PinPool{Pool: id, Pin: true} }))
	mux.HandleFunc("POST /polykv/pools/{id}/unpin", s.poolAction(func(id int) engine.Msg { return engine.PinPool{Pool: id} }))
	mux.HandleFunc("POST /polykv/pools/{id}/evict", s.poolAction(func(id int) engine.Msg { return engine.EvictPool{Pool: id} }))
	mux.HandleFunc("POST /polykv/pools/{id}/flush", s.poolAction(func(id int) engine.Msg { return engine.FlushPool{Pool: id} }))
	// Speed and admission (tps.go, reservations.go).
	mux.HandleFunc("GET /polykv/tps", s.handleTPS)
	mux.HandleFunc("GET /polykv/pools/{id}/capacity", s.handleCapacity)
	mux.HandleFunc("GET /polykv/pools/{id}/admission", s.handleGetAdmission)
	mux.HandleFunc("POST /polykv/pools/{id}/admission", s.handleSetAdmission)
	mux.HandleFunc("POST /polykv/pools/{id}/reservations", s.handleReserve)
	mux.HandleFunc("DELETE /polykv/pools/{id}/reservations/{rid}", s.handleReleaseReservation)
	if s.metrics != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(s.metrics.Registry, promhttp.HandlerOpts{}))
	}
	ui.Register(mux) // the dashboard page: GET /ui/ (and GET / redirects there)
	// No catch-all "/" route: it would match every method and turn a wrong method
	// into 404; routeErrors answers unmatched requests with JSON 404 or 405 + Allow.
	// CORS is outermost so that 401s and errors are readable by browser clients too.
	return cors(s.auth(s.recoverer(routeErrors(mux))))
}

// recoverer turns a handler panic into a 500 instead of a dropped connection: a bug
// in one request must not take the server down.
func (s *Server) recoverer(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				s.log.Error("handler panic", "path", r.URL.Path, "panic", v)
				writeError(w, http.StatusInternalServerError, "server_error", "internal error")
			}
		}()
		h.ServeHTTP(w, r)
	})
}

// apiError is an error with its HTTP status and OpenAI error type.
type apiError struct {
	status int
	typ    string
	msg    string
	// extra holds the optional members of the error body (param, pool_id, ...);
	// writeAPIError fills in code, type and message.
	extra   wire.Error
	headers map[string]string
}

func (e *apiError) Error() string { return e.msg }

func badRequest(format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", msg: fmt.Sprintf(format, args...)}
}

// errorFor maps engine sentinel errors to HTTP statuses in one place.
func errorFor(err error) *apiError {
	var ae *apiError
	var sat *engine.SaturatedError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &sat):
		v := wireVerdict(sat.Verdict)
		return &apiError{status: http.StatusTooManyRequests, typ: "pool_saturated_error", msg: err.Error(),
			extra:   wire.Error{PoolID: &sat.Pool, Capacity: &v},
			headers: map[string]string{"Retry-After": strconv.Itoa(max(1, sat.Verdict.RetryAfterS))}}
	case errors.Is(err, engine.ErrQueueFull), errors.Is(err, engine.ErrQueueTimeout):
		// Busy, not broken: the client may retry (a router, on another replica). A
		// queue timeout is checked before "not found": a pool_id request whose pool's
		// creation timed out may succeed once the creator retries.
		return &apiError{status: http.StatusServiceUnavailable, typ: "unavailable_error", msg: err.Error(),
			headers: map[string]string{"Retry-After": strconv.Itoa(retryAfterBusyS)}}
	case errors.Is(err, engine.ErrNeverFits):
		// Waiting cannot help until a client unpins a pool: said at once, no Retry-After.
		return &apiError{status: http.StatusServiceUnavailable, typ: "unavailable_error", msg: err.Error()}
	case errors.Is(err, engine.ErrPromptTooLong):
		return &apiError{status: http.StatusBadRequest, typ: "exceed_context_size_error", msg: err.Error()}
	case errors.Is(err, engine.ErrEmptyPrompt), errors.Is(err, engine.ErrInvalidToken):
		return badRequest("%v", err)
	case errors.Is(err, pool.ErrNotFound), errors.Is(err, engine.ErrSessionNotFound):
		return &apiError{status: http.StatusNotFound, typ: "not_found_error", msg: err.Error()}
	case errors.Is(err, pool.ErrNoSeqIDs):
		return &apiError{status: http.StatusServiceUnavailable, typ: "unavailable_error", msg: err.Error()}
	case errors.Is(err, pool.ErrPrefixMismatch), errors.Is(err, pool.ErrHasChildren), errors.Is(err, pool.ErrConflict), errors.Is(err, engine.ErrSessionBusy),
		errors.Is(err, engine.ErrRecurrentBranch):
		return &apiError{status: http.StatusConflict, typ: "conflict_error", msg: err.Error()}
	case errors.Is(err, pool.ErrBadRequest):
		return badRequest("%v", err)
	case errors.Is(err, engine.ErrEngineClosed):
		return &apiError{status: http.StatusServiceUnavailable, typ: "unavailable_error", msg: err.Error()}
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return &apiError{status: 499, typ: "cancelled", msg: err.Error()}
	default:
		return &apiError{status: http.StatusInternalServerError, typ: "server_error", msg: err.Error()}
	}
}

// retryAfterBusyS is the Retry-After (seconds) of a 503 for a full queue or a wait past
// --queue-timeout: a hint to come back soon, since the queue moves as requests end.
const retryAfterBusyS = 1

func writeError(w http.ResponseWriter, status int, typ, msg string) {
	writeAPIError(w, &apiError{status: status, typ: typ, msg: msg})
}

func writeAPIError(w http.ResponseWriter, e *apiError) {
	for k, v := range e.headers {
		w.Header().Set(k, v)
	}
	writeJSON(w, e.status, e.body())
}

// body is the error's JSON body.
func (e *apiError) body() wire.ErrorBody {
	b := e.extra
	b.Code, b.Type, b.Message = e.status, e.typ, e.msg
	return wire.ErrorBody{Error: b}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// decodeGen is the preamble of the generation routes (chat and text completions,
// Responses, Messages): it reads the JSON body into a new T, answers a body that does
// not decode through fail (the route's error shape) and returns false, and takes the
// session id from the x-session-id header when the body names none.
func decodeGen[T any, PT interface {
	*T
	Params() *wire.GenParams
}](s *Server, w http.ResponseWriter, r *http.Request, fail func(http.ResponseWriter, *apiError)) (*T, bool) {
	req := new(T)
	if e := s.decodeBody(w, r, req); e != nil {
		fail(w, e)
		return nil, false
	}
	sessionFromHeader(r, PT(req).Params())
	return req, true
}

// decodeBody reads a JSON object into v, turning decoder errors into clear 400s.
// Unknown fields are ignored: OpenAI clients send extras.
func (s *Server) decodeBody(w http.ResponseWriter, r *http.Request, v any) *apiError {
	body := http.MaxBytesReader(w, r.Body, s.maxBody)
	dec := json.NewDecoder(body)
	if err := dec.Decode(v); err != nil {
		var syn *json.SyntaxError
		var typ *json.UnmarshalTypeError
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			return &apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error", msg: fmt.Sprintf("request body exceeds %d bytes", tooBig.Limit)}
		case errors.As(err, &typ):
			field := typ.Field
			if field == "" {
				return badRequest("request body must be a JSON object, got %s", typ.Value)
			}
			return badRequest("field %q: expected %s, got %s", field, jsonKind(typ.Type.Kind().String()), typ.Value)
		case errors.As(err, &syn):
			return badRequest("malformed JSON at byte %d: %v", syn.Offset, err)
		case errors.Is(err, context.Canceled):
			return &apiError{status: 499, typ: "cancelled", msg: "client went away"}
		default:
			if err.Error() == "EOF" {
				return badRequest("empty request body")
			}
			return badRequest("malformed JSON: %v", err)
		}
	}
	if dec.More() {
		return badRequest("malformed JSON: trailing data after the object")
	}
	return nil
}

func jsonKind(goKind string) string {
	switch goKind {
	case "int", "int32", "int64", "uint32":
		return "an integer"
	case "float32", "float64":
		return "a number"
	case "bool":
		return "a boolean"
	case "string":
		return "a string"
	case "slice":
		return "an array"
	case "struct", "map":
		return "an object"
	default:
		return goKind
	}
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	select {
	case <-s.eng.Done():
		writeError(w, http.StatusServiceUnavailable, "unavailable_error", "engine stopped")
	default:
		writeJSON(w, http.StatusOK, wire.Health{Status: "ok"})
	}
}

func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, wire.ModelList{Object: "list", Data: []wire.Model{{
		ID: s.info.ModelID, Object: "model", Created: s.info.Started.Unix(), OwnedBy: "polykv",
		Meta: wire.ModelMeta{NCtxTrain: s.info.NCtxTrain, NVocab: s.info.NVocab, Desc: s.info.ModelDesc},
	}}})
}

func (s *Server) handleProps(w http.ResponseWriter, r *http.Request) {
	snap := s.eng.Snapshot()
	props := wire.Props{
		Model:            s.info.ModelID,
		BuildInfo:        s.info.BuildInfo,
		ModelPath:        s.info.ModelPath,
		ModelDesc:        s.info.ModelDesc,
		NCtx:             s.info.NCtx,
		NCtxTrain:        s.info.NCtxTrain,
		Parallel:         s.info.Parallel,
		TotalSlots:       s.info.Parallel,
		NBatch:           s.info.NBatch,
		KVUnified:        true,
		ChatTemplate:     s.info.ChatTemplate,
		ChatTemplatePath: s.chat.Path(),
		ToolCallFormat:   string(s.format()),
		Usage:            wireUsage(snap.Usage),
		Compute:          s.info.Compute,
		PolyKV: wire.PolyKVProps{
			MaxPools:       s.info.MaxPools,
			CPUFeatures:    s.info.CPUFeatures,
			PoolGraceMs:    s.info.PoolGraceMs,
			KVBytesPerCell: s.info.BytesPerCell,
			KVOrdered:      s.info.OrderedAttention != nil && s.info.OrderedAttention(),
			NSeqMax:        s.info.Parallel + s.info.MaxPools,
			PoolsSupported: true,
			PoolTier:       s.tierProps(),
			PrefixCache: wire.PrefixCacheProps{Enabled: s.info.PrefixCache, HitTokens: snap.Usage.CacheHitTokens,
				ResidentTokens: snap.Usage.CacheCells, CachedSequences: snap.Usage.CacheSeqs, Evictions: snap.Usage.CacheEvictions},
			AdmissionDefault: wirePolicy(admission.DefaultPolicy()),
			Floors:           snap.Floors,
			TPS: wire.TPSProps{
				EWMA:                    "time-based EWMA of decode tokens/s per session, bias-corrected while young",
				TauMs:                   s.info.TPSTauMs,
				WarmMinTokens:           tps.MinWarmTokens,
				StreamIntervalMsDefault: 500,
			},
		},
	}
	if sp := s.info.Spec; sp.On() {
		props.PolyKV.Speculative = &wire.SpeculativeProps{Types: sp.Types, DraftMax: sp.DraftMax, DraftMin: sp.DraftMin}
	}
	s.templateProps(&props)
	writeJSON(w, http.StatusOK, props)
}

// handleSlots lists the sequences in use, then the requests waiting for one (state
// "waiting", id -1: they hold no sequence yet) with why and for how long (issue 30).
func (s *Server) handleSlots(w http.ResponseWriter, r *http.Request) {
	snap := s.eng.Snapshot()
	writeJSON(w, http.StatusOK, append(mapSlice(snap.Slots, wireSlot), mapSlice(snap.Waiting, wireWaiting)...))
}

func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req wire.TokenizeRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		writeAPIError(w, e)
		return
	}
	if req.Content == nil {
		writeAPIError(w, badRequest("field \"content\" is required"))
		return
	}
	parse := req.ParseSpecial == nil || *req.ParseSpecial
	toks, err := s.tok.Tokenize(*req.Content, req.AddSpecial, parse)
	if err != nil {
		writeAPIError(w, badRequest("%v", err))
		return
	}
	if !req.WithPieces {
		writeJSON(w, http.StatusOK, wire.Tokens{Tokens: nonNil(toks)})
		return
	}
	out := make([]wire.TokenPiece, len(toks))
	for i, t := range toks {
		out[i] = wire.TokenPiece{ID: t, Piece: s.tok.TokenPiece(t, true)}
	}
	writeJSON(w, http.StatusOK, wire.TokenPieces{Tokens: out})
}

func (s *Server) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	var req wire.DetokenizeRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		writeAPIError(w, e)
		return
	}
	if req.Tokens == nil {
		writeAPIError(w, badRequest("field \"tokens\" is required"))
		return
	}
	if e := s.checkTokens(*req.Tokens); e != nil {
		writeAPIError(w, e)
		return
	}
	text, err := s.tok.Detokenize(*req.Tokens, false, true)
	if err != nil {
		writeAPIError(w, badRequest("%v", err))
		return
	}
	writeJSON(w, http.StatusOK, wire.Detokenized{Content: text})
}

func (s *Server) checkTokens(toks []int32) *apiError {
	for i, t := range toks {
		if !s.tok.ValidToken(t) {
			return badRequest("token %d at index %d is outside the vocabulary (0..%d)", t, i, s.tok.NVocab()-1)
		}
	}
	return nil
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
