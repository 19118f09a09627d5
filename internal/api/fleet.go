package api

import (
	"net/http"
	"strconv"
	"strings"

	"github.com/polykv/polykv/internal/api/wire"
)

// Routes and request fields for running several replicas behind a router (llm-d's
// endpoint picker): render endpoints the router tokenizes through, the x-session-id
// header and content-addressed pool keys.

// handleChatRender answers the token ids a chat request would prefill, without
// running it: the same messages, tools and template path as /v1/chat/completions.
func (s *Server) handleChatRender(w http.ResponseWriter, r *http.Request) {
	var req wire.ChatRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		writeAPIError(w, e)
		return
	}
	toks, _, e := s.chatPrompt(&req)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, wire.Rendered{TokenIDs: nonNil(toks)})
}

// handleCompletionsRender answers the token ids a text completion would prefill. As
// vLLM's does, it answers an array with one {"token_ids"} per prompt (llm-d's
// token-producer decodes it so); PolyKV takes exactly one prompt per request.
func (s *Server) handleCompletionsRender(w http.ResponseWriter, r *http.Request) {
	var req wire.CompletionRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		writeAPIError(w, e)
		return
	}
	toks, e := s.completionPrompt(req.Prompt)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, []wire.Rendered{{TokenIDs: nonNil(toks)}})
}

// SessionHeader carries the session id when the body has none: llm-d's
// session-affinity scorer routes by it, so the replica it picks keeps the session.
const SessionHeader = "X-Session-Id"

// NextTurnHeader carries next_turn_ms when the body has none (issue 40): the client's
// word on when this conversation's next turn follows the reply.
const NextTurnHeader = "X-PolyKV-Next-Turn-Ms"

// sessionFromHeader uses the x-session-id header as session_id, and
// x-polykv-next-turn-ms as next_turn_ms, unless the body sets them. A header that is not
// a number is kept as an impossible value, which toEngine refuses with a 400.
func sessionFromHeader(r *http.Request, g *wire.GenParams) {
	if v := strings.TrimSpace(r.Header.Get(SessionHeader)); v != "" && g.SessionID == nil {
		g.SessionID = &v
	}
	if v := strings.TrimSpace(r.Header.Get(NextTurnHeader)); v != "" && g.NextTurnMs == nil {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			ms = -1
		}
		g.NextTurnMs = &ms
	}
}

// parsePoolKey reads a pool key: a pool's prefix_hash (hexadecimal, as pool status
// reports it; an optional 0x is accepted).
func parsePoolKey(v string) (uint64, *apiError) {
	h := strings.TrimPrefix(strings.ToLower(strings.TrimSpace(v)), "0x")
	key, err := strconv.ParseUint(h, 16, 64)
	if err != nil || h == "" {
		return 0, badRequest("pool_key must be a pool's prefix_hash (up to 16 hexadecimal digits), got %q", v)
	}
	return key, nil
}
