package engine

import (
	"fmt"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/pool"
)

// Reservations make a fan-out's admission atomic (issue 13): the admission controller
// (package admission) grants, counts and expires them; the scheduler checks the pool
// and hands it the pool's facts, one message at a time on the engine goroutine.

// Reservation limits (admission's, named here for the API).
const (
	DefaultReservationTTL  = admission.DefaultReservationTTL
	MaxReservationTTL      = admission.MaxReservationTTL
	MaxReservationsPerPool = admission.MaxReservationsPerPool
)

// ErrReservationLimit is a pool with MaxReservationsPerPool outstanding reservations.
var ErrReservationLimit = admission.ErrReservationLimit

// ErrReservationNotFound is a DELETE of a reservation that is unknown, used or expired.
var ErrReservationNotFound = admission.ErrReservationNotFound

// ReservationReport is the answer of POST /polykv/pools/{id}/reservations.
type ReservationReport struct {
	PoolID        int
	ReservationID *string // nil when not granted
	Granted       bool
	ExpiresInMs   int64
	// Verdict is the verdict the reservation was decided by (before counting it).
	Verdict admission.Verdict
}

// reserve decides one reservation for pool id (message Reserve): granted when the
// pool's verdict (with every earlier reservation counted) admits a new session. ttl 0
// means DefaultReservationTTL.
func (s *Scheduler) reserve(id int, ttl time.Duration, expected int) (ReservationReport, error) {
	p, err := s.getLive(id)
	if err != nil {
		return ReservationReport{}, err
	}
	if err := admission.CheckReservation(ttl, expected); err != nil {
		return ReservationReport{}, fmt.Errorf("%w: %v", pool.ErrBadRequest, err)
	}
	g, err := s.adm.Reserve(s.now, id, ttl, s.poolFacts(p, expected, ""))
	if err != nil {
		return ReservationReport{}, err
	}
	rep := ReservationReport{PoolID: id, Granted: g.ID != "", Verdict: g.Verdict}
	if rep.Granted {
		rep.ReservationID = &g.ID
		rep.ExpiresInMs = g.TTL.Milliseconds()
	}
	return rep, nil
}

// releaseReservation gives a reservation back unused (message ReleaseReservation).
func (s *Scheduler) releaseReservation(id int, rid string) error {
	if _, err := s.getLive(id); err != nil {
		return err
	}
	return s.adm.ReleaseReservation(s.now, id, rid)
}
