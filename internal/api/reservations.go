package api

import (
	"errors"
	"net/http"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

// Reservations (issue 13): POST reserves one admission slot of a pool atomically (on
// the engine goroutine, one at a time), DELETE gives it back unused. A chat or
// completion request carrying `reservation_id` uses it instead of the enforced gate.

// reservationError maps the reservation sentinels, then defers to errorFor.
func reservationError(err error) *apiError {
	switch {
	case errors.Is(err, engine.ErrReservationNotFound):
		return &apiError{status: http.StatusNotFound, typ: "not_found_error", msg: err.Error()}
	case errors.Is(err, engine.ErrReservationLimit):
		return &apiError{status: http.StatusServiceUnavailable, typ: "unavailable_error", msg: err.Error()}
	}
	return errorFor(err)
}

func (s *Server) handleReserve(w http.ResponseWriter, r *http.Request) {
	id, e := pathPoolID(r)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	var body wire.ReservationRequest
	if r.ContentLength != 0 {
		if e := s.decodeBody(w, r, &body); e != nil {
			writeAPIError(w, e)
			return
		}
	}
	var ttl time.Duration
	if body.TTLMs != nil {
		max := engine.MaxReservationTTL.Milliseconds()
		if *body.TTLMs < 1 || *body.TTLMs > max {
			writeAPIError(w, badRequest("ttl_ms must be an integer in [1, %d], got %d", max, *body.TTLMs))
			return
		}
		ttl = time.Duration(*body.TTLMs) * time.Millisecond
	}
	expected := 0
	if body.ExpectedTokens != nil {
		if *body.ExpectedTokens < 0 {
			writeAPIError(w, badRequest("expected_tokens must not be negative, got %d", *body.ExpectedTokens))
			return
		}
		expected = *body.ExpectedTokens
	}
	res, err := s.eng.Send(r.Context(), engine.Reserve{Pool: id, TTL: ttl, ExpectedTokens: expected})
	if err == nil {
		err = res.Err
	}
	if err != nil {
		writeAPIError(w, reservationError(err))
		return
	}
	writeJSON(w, http.StatusOK, wireReservation(res.Reservation))
}

func (s *Server) handleReleaseReservation(w http.ResponseWriter, r *http.Request) {
	id, e := pathPoolID(r)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	rid := r.PathValue("rid")
	res, err := s.eng.Send(r.Context(), engine.ReleaseReservation{Pool: id, ID: rid})
	if err == nil {
		err = res.Err
	}
	if err != nil {
		writeAPIError(w, reservationError(err))
		return
	}
	writeJSON(w, http.StatusOK, wire.ReservationReleased{PoolID: id, ReservationID: rid, Released: true})
}
