package api

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

func pathPoolID(r *http.Request) (int, *apiError) {
	raw := r.PathValue("id")
	id, err := strconv.Atoi(raw)
	if err != nil || id < 0 {
		return 0, badRequest("pool id %q is not a non-negative integer", raw)
	}
	return id, nil
}

// poolAction sends a pool command: it answers the pool's status after it.
func (s *Server) poolAction(msg func(id int) engine.Msg) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, e := pathPoolID(r)
		if e != nil {
			writeAPIError(w, e)
			return
		}
		m := msg(id)
		res, err := s.eng.Send(r.Context(), m)
		if err == nil {
			err = res.Err
		}
		var info engine.PoolInfo
		if err == nil {
			info, err = s.eng.Snapshot().Pool(id) // published after the command
		}
		if err != nil {
			writeAPIError(w, errorFor(err))
			return
		}
		info.Tokens = nil
		out := wire.PoolCommand{Pool: s.wirePool(info)}
		if _, flush := m.(engine.FlushPool); flush {
			freed := int64(res.Flushed.Cells) * s.info.BytesPerCell
			out.FlushedSessions, out.FreedKVBytes = &res.Flushed.Sessions, &freed
		}
		writeJSON(w, http.StatusOK, out)
	}
}

// prefixTokens turns a create/fork body into the prefix tokens (or a session name).
func (s *Server) prefixTokens(b *wire.PoolRequest) ([]int32, string, *apiError) {
	n := 0
	for _, set := range []bool{b.Tokens != nil, b.Prompt != nil, !isNull(b.Messages), b.FromSession != nil} {
		if set {
			n++
		}
	}
	if n != 1 {
		return nil, "", badRequest("give exactly one of tokens, prompt, messages or from_session (got %d)", n)
	}
	if !isNull(b.Tools) && isNull(b.Messages) {
		return nil, "", badRequest("tools are rendered with messages: give messages too")
	}
	switch {
	case b.Tokens != nil:
		if len(*b.Tokens) == 0 {
			return nil, "", badRequest("tokens must not be empty")
		}
		if e := s.checkTokens(*b.Tokens); e != nil {
			return nil, "", e
		}
		return *b.Tokens, "", nil
	case b.Prompt != nil:
		if *b.Prompt == "" {
			return nil, "", badRequest("prompt must not be empty")
		}
		toks, err := s.tok.Tokenize(*b.Prompt, true, true)
		if err != nil {
			return nil, "", badRequest("%v", err)
		}
		return toks, "", nil
	case b.FromSession != nil:
		if *b.FromSession == "" {
			return nil, "", badRequest("from_session must name a session")
		}
		return nil, *b.FromSession, nil
	}
	msgs, e := parseMessages(b.Messages)
	if e != nil {
		return nil, "", e
	}
	tools, e := parseTools(b.Tools)
	if e != nil {
		return nil, "", e
	}
	// Rendered as the start of a conversation, exactly as a chat request with the same
	// tools renders it, so agents bound to tools share the system + tools prefix.
	text, err := s.chat.Render(msgs, tools, false)
	if err != nil {
		return nil, "", renderError(err)
	}
	toks, err := s.tok.Tokenize(text, true, true)
	if err != nil {
		return nil, "", badRequest("%v", err)
	}
	if len(toks) == 0 {
		return nil, "", badRequest("messages render to an empty prefix")
	}
	return toks, "", nil
}

func (s *Server) handleCreatePool(w http.ResponseWriter, r *http.Request) {
	var b wire.PoolRequest
	if e := s.decodeBody(w, r, &b); e != nil {
		writeAPIError(w, e)
		return
	}
	if b.BranchPos != nil {
		writeAPIError(w, badRequest("branch_pos belongs to fork (POST /polykv/pools/{id}/fork)"))
		return
	}
	s.createPool(w, r, &b, engine.PoolSpec{})
}

func (s *Server) handleForkPool(w http.ResponseWriter, r *http.Request) {
	parent, e := pathPoolID(r)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	var b wire.PoolRequest
	if e := s.decodeBody(w, r, &b); e != nil {
		writeAPIError(w, e)
		return
	}
	if b.BranchPos == nil {
		writeAPIError(w, badRequest("branch_pos is required: the length of the parent prefix the child keeps"))
		return
	}
	if *b.BranchPos < 0 {
		writeAPIError(w, badRequest("branch_pos must not be negative, got %d", *b.BranchPos))
		return
	}
	s.createPool(w, r, &b, engine.PoolSpec{HasParent: true, Parent: parent, D: *b.BranchPos})
}

func (s *Server) createPool(w http.ResponseWriter, r *http.Request, b *wire.PoolRequest, spec engine.PoolSpec) {
	toks, session, e := s.prefixTokens(b)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	spec.Tokens, spec.FromSession, spec.Pin = toks, session, b.Pin
	id, stats, err := s.eng.CreatePool(r.Context(), spec)
	if err != nil {
		writeAPIError(w, errorFor(err))
		return
	}
	info, err := s.eng.Snapshot().Pool(id) // published before the materialization's end was delivered
	if err != nil {
		writeAPIError(w, errorFor(err))
		return
	}
	info.Tokens = nil
	writeJSON(w, http.StatusCreated, wire.PoolCreated{
		PoolID: id, Parent: info.Parent, BranchPos: info.BranchPos, PrefixLen: info.PrefixLen,
		OwnLen: info.OwnLen, PrefixHash: info.PrefixHash, State: info.State,
		PrefilledTokens: stats.PromptN, MaterializeMs: float64(stats.PromptTime.Microseconds()) / 1000,
		ZeroCopy: stats.PromptN == 0, Pool: s.wirePool(info),
	})
}

func (s *Server) handleListPools(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, s.wirePools(s.eng.Snapshot().Pools))
}

func (s *Server) handleGetPool(w http.ResponseWriter, r *http.Request) {
	id, e := pathPoolID(r)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	info, err := s.eng.Snapshot().Pool(id)
	if err != nil {
		writeAPIError(w, errorFor(err))
		return
	}
	writeJSON(w, http.StatusOK, s.wirePool(info))
}

func (s *Server) handleReleasePool(w http.ResponseWriter, r *http.Request) {
	id, e := pathPoolID(r)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	res, err := s.eng.Send(r.Context(), engine.ReleasePool{Pool: id})
	if err == nil {
		err = res.Err
	}
	_, gone := s.eng.Snapshot().Pool(id)
	reclaimed := gone != nil
	if err != nil {
		writeAPIError(w, errorFor(err))
		return
	}
	writeJSON(w, http.StatusOK, wire.PoolReleased{PoolID: id, Released: true, Reclaimed: reclaimed})
}

// parsePoolID reads pool_id from a completion request: an integer (or its string).
func parsePoolID(raw json.RawMessage) (int, bool, *apiError) {
	if isNull(raw) {
		return 0, false, nil
	}
	var id int
	if err := json.Unmarshal(raw, &id); err == nil {
		return id, true, nil
	}
	var str string
	if err := json.Unmarshal(raw, &str); err == nil {
		if id, err := strconv.Atoi(str); err == nil {
			return id, true, nil
		}
	}
	return 0, false, badRequest("pool_id must be an integer pool id, got %s", string(raw))
}
