package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

func (s *Server) tpsSnapshot() wire.TPS {
	return wireTPS(s.eng.Snapshot().TPS)
}

// handleTPS streams tps snapshots as SSE every interval_ms (default 500); ?once=1 or
// an Accept header without text/event-stream returns one snapshot as JSON (poll mode).
func (s *Server) handleTPS(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	interval := 500 * time.Millisecond
	if v := q.Get("interval_ms"); v != "" {
		ms, err := strconv.Atoi(v)
		if err != nil || ms < 50 || ms > 60000 {
			writeAPIError(w, badRequest("interval_ms must be an integer in [50, 60000], got %q", v))
			return
		}
		interval = time.Duration(ms) * time.Millisecond
	}
	accept := r.Header.Get("Accept")
	once := q.Get("once") == "1" || q.Get("once") == "true" ||
		(strings.Contains(accept, "application/json") && !strings.Contains(accept, "text/event-stream"))
	if once {
		writeJSON(w, http.StatusOK, s.tpsSnapshot())
		return
	}
	flusher, _ := w.(http.Flusher)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		b, _ := json.Marshal(s.tpsSnapshot())
		if _, err := fmt.Fprintf(w, "event: tps\ndata: %s\n\n", b); err != nil {
			return
		}
		if flusher != nil {
			flusher.Flush()
		}
		select {
		case <-r.Context().Done():
			return
		case <-s.eng.Done():
			return
		case <-tick.C:
		}
	}
}

func (s *Server) handleCapacity(w http.ResponseWriter, r *http.Request) {
	id, e := pathPoolID(r)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	expected := 0
	if v := r.URL.Query().Get("expected_tokens"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			writeAPIError(w, badRequest("expected_tokens must be a non-negative integer, got %q", v))
			return
		}
		expected = n
	}
	session := r.URL.Query().Get("session_id")
	res, err := s.eng.Send(r.Context(), engine.QueryCapacity{Pool: id, ExpectedTokens: expected, Session: session})
	if err == nil {
		err = res.Err
	}
	if err != nil {
		writeAPIError(w, errorFor(err))
		return
	}
	writeJSON(w, http.StatusOK, wireCapacity(res.Capacity))
}

func (s *Server) handleGetAdmission(w http.ResponseWriter, r *http.Request) {
	id, e := pathPoolID(r)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	p, err := s.eng.Snapshot().Admission(id)
	if err != nil {
		writeAPIError(w, errorFor(err))
		return
	}
	writeJSON(w, http.StatusOK, wire.PoolAdmission{PoolID: id, Admission: wirePolicy(p)})
}

// handleSetAdmission merges the given fields into the pool's current policy.
func (s *Server) handleSetAdmission(w http.ResponseWriter, r *http.Request) {
	id, e := pathPoolID(r)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	var body wire.PolicyPatch
	if e := s.decodeBody(w, r, &body); e != nil {
		writeAPIError(w, e)
		return
	}
	patch := admission.Patch{TargetTPS: body.TargetTPS, Mode: body.Mode, OnSaturation: body.OnSaturation,
		GuaranteeMinSessions: body.GuaranteeMinSessions, SettleTokens: body.SettleTokens, SettleMaxMs: body.SettleMaxMs,
		QueueTimeoutMs: body.QueueTimeoutMs, Throttle: body.Throttle, ThrottleMargin: body.ThrottleMargin, ThrottleMaxSkip: body.ThrottleMaxSkip}
	res, err := s.eng.Send(r.Context(), engine.SetAdmission{Pool: id, Patch: patch})
	if err == nil {
		err = res.Err
	}
	if err != nil {
		writeAPIError(w, errorFor(err))
		return
	}
	writeJSON(w, http.StatusOK, wire.PoolAdmission{PoolID: id, Admission: wirePolicy(res.Admission)})
}
