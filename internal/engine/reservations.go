package engine

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/pool"
)

// Reservations make a fan-out's admission atomic (issue 13). Every branch of a LangGraph
// `Send` fan-out asks for capacity in the same step; read-only verdicts would all say
// "yes" to the same free slot. A reservation is decided on the engine goroutine, one at
// a time, and a granted one counts as a warming session of its pool in every later
// verdict (it holds a guaranteed slot, keeps the pool "settling" and takes its cells
// out of the headroom) until a request carrying its id uses it, it is released, or it
// expires. Expiry is judged from the `now` the scheduler is given, never a clock.

// Reservation limits.
const (
	DefaultReservationTTL = 30 * time.Second
	MaxReservationTTL     = 10 * time.Minute
	// MaxReservationsPerPool bounds the outstanding reservations of one pool, so a
	// client looping on POST cannot grow the table without limit.
	MaxReservationsPerPool = 256
)

// ErrReservationLimit is a pool with MaxReservationsPerPool outstanding reservations.
var ErrReservationLimit = errors.New("too many outstanding reservations")

// ErrReservationNotFound is a DELETE of a reservation that is unknown, used or expired.
var ErrReservationNotFound = errors.New("reservation not found")

// reservation is one granted, unused admission slot of a pool.
type reservation struct {
	id       string
	expected int // expected_tokens given at reservation (0: use the pool's marginal)
	expires  time.Time
}

// ReservationReport is the answer of POST /polykv/pools/{id}/reservations.
type ReservationReport struct {
	PoolID        int
	ReservationID *string // nil when not granted
	Granted       bool
	ExpiresInMs   int64
	// Verdict is the verdict the reservation was decided by (before counting it).
	Verdict admission.Verdict
}

// liveReservations drops pa's expired reservations and returns how many remain and
// the cells they stand for (marginal is the per-session cost when none was given).
func (pa *poolAdmission) liveReservations(now time.Time, marginal float64) (int, int) {
	cells := 0
	for id, r := range pa.reservations {
		if !now.Before(r.expires) {
			delete(pa.reservations, id)
			continue
		}
		cells += int(max(float64(r.expected), marginal))
	}
	return len(pa.reservations), cells
}

// reserve decides one reservation for pool id (message Reserve): granted when the
// pool's verdict (with every earlier reservation counted) admits a new session. ttl 0
// means DefaultReservationTTL.
func (s *Scheduler) reserve(id int, ttl time.Duration, expected int) (ReservationReport, error) {
	now := s.now
	p, err := s.getLive(id)
	if err != nil {
		return ReservationReport{}, err
	}
	if ttl < 0 || ttl > MaxReservationTTL {
		return ReservationReport{}, fmt.Errorf("%w: ttl_ms must be in [1, %d], got %d", pool.ErrBadRequest, MaxReservationTTL.Milliseconds(), ttl.Milliseconds())
	}
	if ttl == 0 {
		ttl = DefaultReservationTTL
	}
	if expected < 0 {
		return ReservationReport{}, fmt.Errorf("%w: expected_tokens must not be negative, got %d", pool.ErrBadRequest, expected)
	}
	v := admission.Decide(s.capacityInput(p, expected, ""))
	rep := ReservationReport{PoolID: id, Granted: v.CanAdmit, Verdict: v}
	if !v.CanAdmit {
		return rep, nil
	}
	pa := s.admissionOf(id)
	if len(pa.reservations) >= MaxReservationsPerPool {
		return ReservationReport{}, fmt.Errorf("%w: pool %d holds %d", ErrReservationLimit, id, len(pa.reservations))
	}
	if pa.reservations == nil {
		pa.reservations = map[string]*reservation{}
	}
	pa.nextReservation++
	rid := "rsv-" + strconv.Itoa(id) + "-" + strconv.FormatUint(pa.nextReservation, 10)
	pa.reservations[rid] = &reservation{id: rid, expected: expected, expires: now.Add(ttl)}
	rep.ReservationID = &rid
	rep.ExpiresInMs = ttl.Milliseconds()
	return rep, nil
}

// releaseReservation gives a reservation back unused (message ReleaseReservation).
func (s *Scheduler) releaseReservation(id int, rid string) error {
	now := s.now
	if _, err := s.getLive(id); err != nil {
		return err
	}
	pa := s.admissionOf(id)
	pa.liveReservations(now, 0)
	if _, ok := pa.reservations[rid]; !ok {
		return fmt.Errorf("%w: pool %d has no reservation %q (unknown, used or expired)", ErrReservationNotFound, id, rid)
	}
	delete(pa.reservations, rid)
	return nil
}

// useReservation consumes t's reservation, if it names a live one of its pool: the
// admission was decided when it was granted, so the gate is skipped.
func (s *Scheduler) useReservation(t *task) bool {
	if t.pool == nil || t.req.ReservationID == "" {
		return false
	}
	pa := s.admissionOf(t.pool.ID)
	pa.liveReservations(s.now, 0)
	if _, ok := pa.reservations[t.req.ReservationID]; !ok {
		return false
	}
	delete(pa.reservations, t.req.ReservationID)
	return true
}
