package admission

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"
)

// Controller is the admission state of every pool of one scheduler (docs/design.md §14.2):
// policies, the settle window after each new-session admit, the measured-drop forecast,
// new sessions held by an enforced gate, and reservations. It is as pure as Decide: it
// reads no clock (every call is given now), does no I/O and knows nothing of sequences
// or cells. The scheduler feeds it Facts about a pool and what happened (a new session
// was seated, a settle window's session decoded, a request named a reservation) and acts
// on its Decisions (admit now, hold until a deadline, refuse as saturated). Keeping all of
// it here, and none in the engine, is what keeps the gate, /capacity and reservations
// reading the same numbers.
type Controller struct {
	pools map[int]*poolState
	held  []heldEntry // new sessions held by an enforced pool's gate, in arrival order
	// seen holds the session ids seated before, and when last: their next requests are
	// continuations, never gated.
	seen map[string]time.Time
}

// poolState is one pool's policy and measurements.
type poolState struct {
	policy Policy
	// The settle window after the last new-session admit: open while settling.
	settling    bool
	settleKey   uint64 // the admitted session's request, as the scheduler names it
	settleStart time.Time
	meanAtAdmit float64
	// Measured-drop forecast and the last settled mean (for the idle-gap estimate).
	dropEWMA    float64
	hasDrop     bool
	settledMean float64
	settledAt   time.Time
	// Granted, unused reservations, by id.
	reservations    map[string]reservation
	nextReservation uint64
}

// heldEntry is one request held by its pool's gate until Until.
type heldEntry struct {
	key   uint64
	pool  int
	until time.Time
}

// reservation is one granted, unused admission slot of a pool.
type reservation struct {
	expected int // expected_tokens given at reservation (0: use the pool's marginal)
	expires  time.Time
}

// NewController returns a controller that knows no pool yet: every pool starts with
// DefaultPolicy.
func NewController() *Controller {
	return &Controller{pools: map[int]*poolState{}, seen: map[string]time.Time{}}
}

// Known sessions. A session the scheduler has seated before is a continuation: its
// next request is never gated and opens no settle window, whatever pool it names.

// SessionSeated records that a named session got a sequence at now.
func (c *Controller) SessionSeated(session string, now time.Time) {
	if session != "" {
		c.seen[session] = now
	}
}

// Known reports whether a session was seated before (and not forgotten since).
func (c *Controller) Known(session string) bool {
	_, ok := c.seen[session]
	return ok
}

// ForgetSessions forgets the sessions last seated more than keep before now: their
// next request is a new session again.
func (c *Controller) ForgetSessions(now time.Time, keep time.Duration) {
	for id, at := range c.seen {
		if now.Sub(at) > keep {
			delete(c.seen, id)
		}
	}
}

func (c *Controller) state(pool int) *poolState {
	ps, ok := c.pools[pool]
	if !ok {
		ps = &poolState{policy: DefaultPolicy()}
		c.pools[pool] = ps
	}
	return ps
}

// Facts is what the scheduler knows about a pool at the moment of one decision: what
// the controller cannot know itself. Expected and KnownSession describe the asker.
type Facts struct {
	Sessions      int       // sequences attached to the pool (decoding or idle)
	Pending       int       // new sessions let through the gate that wait for a sequence
	Rates         []float64 // experienced tps of the pool's warm decoding sessions
	Warming       int       // decoding sessions whose EWMA is still cold
	FreeCells     int       // cells a new session could get (free plus evictable)
	TotalCells    int
	MarginalCells float64 // mean own cells of the pool's sessions (0: unknown)
	Pressure      float64 // compaction pressure, 0..1
	Expected      int     // expected_tokens of the asker (0: not given)
	KnownSession  *bool   // set when the asker named a session
}

// Policy returns a pool's policy (DefaultPolicy when none was set).
func (c *Controller) Policy(pool int) Policy {
	if ps, ok := c.pools[pool]; ok {
		return ps.policy
	}
	return DefaultPolicy()
}

// SetPolicy applies patch to a pool's policy and returns the policy now in force, or
// the validation error (and no change).
func (c *Controller) SetPolicy(pool int, patch Patch) (Policy, error) {
	ps := c.state(pool)
	p := patch.Apply(ps.policy)
	if err := p.Validate(); err != nil {
		return Policy{}, err
	}
	ps.policy = p
	return p, nil
}

// Floors lists the pools with a tps floor set, and the floor.
func (c *Controller) Floors() map[int]float64 {
	out := map[int]float64{}
	for id, ps := range c.pools {
		if ps.policy.TargetTPS > 0 {
			out[id] = ps.policy.TargetTPS
		}
	}
	return out
}

// Throttling reports whether any pool's policy throttles its sessions toward its floor.
func (c *Controller) Throttling() bool {
	for _, ps := range c.pools {
		if ps.policy.Throttles() {
			return true
		}
	}
	return false
}

// Forget drops a reclaimed pool's policy, measurements and reservations. Held requests
// are not dropped here: the scheduler refuses them itself (Unhold) when it sees their
// pool released, with its own error.
func (c *Controller) Forget(pool int) { delete(c.pools, pool) }

// input completes a pool's facts into Decide's input, first dropping expired
// reservations.
func (c *Controller) input(now time.Time, pool int, f Facts) Input {
	ps := c.state(pool)
	in := Input{
		Policy: ps.policy, Now: now, PoolSessions: f.Sessions + f.Pending, ActiveTPS: f.Rates, NWarming: f.Warming,
		DropEWMA: ps.dropEWMA, HasDrop: ps.hasDrop, SettledMean: ps.settledMean, SettledAt: ps.settledAt,
		FreeCells: f.FreeCells, TotalCells: f.TotalCells, MarginalCells: f.MarginalCells, Expected: f.Expected,
		KnownSession: f.KnownSession, Pressure: f.Pressure,
	}
	// A granted reservation is a session that has not arrived yet: it takes a place
	// (so the guarantee and the floor see it), is warming (so the pool is settling until
	// it has been measured) and will need cells.
	marginal := f.MarginalCells
	if marginal <= 0 {
		marginal = DefaultMarginalCells
	}
	nres, rcells := ps.liveReservations(now, marginal)
	in.Reserved = nres
	in.PoolSessions += nres
	in.NWarming += nres
	in.FreeCells = max(0, in.FreeCells-rcells)
	// A new session let in but not yet seated has not been measured either.
	if ps.settling || f.Pending > 0 || nres > 0 {
		in.Settling = true
		if ps.settling {
			in.SettleLeft = time.Duration(ps.policy.SettleMaxMs)*time.Millisecond - now.Sub(ps.settleStart)
		}
	}
	return in
}

// Verdict is a pool's answer to "one more session?" now (/capacity).
func (c *Controller) Verdict(now time.Time, pool int, f Facts) Verdict {
	return Decide(c.input(now, pool, f))
}

// Settle windows. A new session seated on a pool opens its window (the mean tps just
// before it is remembered); the window closes after the session's SettleTokens, its
// end or SettleMaxMs, and the drop of the mean since is folded into the forecast. While
// a window is open the gate holds further new sessions, so each admit is measured alone.

// Seated opens the settle window for a new session (key names its request) seated on
// pool at now, when the pool's warm sessions decoded at rates.
func (c *Controller) Seated(now time.Time, pool int, key uint64, rates []float64) {
	ps := c.state(pool)
	ps.settling, ps.settleKey, ps.settleStart = true, key, now
	ps.meanAtAdmit = meanOrZero(rates)
}

// Window is an open settle window: the pool, and the request whose session it measures.
type Window struct {
	Pool int
	Key  uint64
}

// Windows lists the open settle windows, by pool id.
func (c *Controller) Windows() []Window {
	var out []Window
	for id, ps := range c.pools {
		if ps.settling {
			out = append(out, Window{Pool: id, Key: ps.settleKey})
		}
	}
	slices.SortFunc(out, func(a, b Window) int { return a.Pool - b.Pool })
	return out
}

// Progress reports on a pool's open settle window at now: the window's session has
// decoded tokens (or has ended), and the pool's warm sessions decode at rates now. A
// window that is over closes; when the pool was measured at both ends, the drop of
// the mean is folded into the forecast and the mean is kept for the idle-gap estimate.
// It reports whether the window closed.
func (c *Controller) Progress(now time.Time, pool int, decoded int, ended bool, rates []float64) bool {
	ps, ok := c.pools[pool]
	if !ok || !ps.settling || !SettleDone(ps.policy, ps.settleStart, now, decoded, ended) {
		return false
	}
	ps.settling, ps.settleKey = false, 0
	if len(rates) == 0 {
		return true
	}
	m := mean(rates)
	if ps.meanAtAdmit > 0 {
		ps.dropEWMA = FoldDrop(ps.dropEWMA, ps.hasDrop, ps.meanAtAdmit, m)
		ps.hasDrop = true
	}
	ps.settledMean, ps.settledAt = m, now
	return true
}

// The gate.

// Action is what the scheduler must do with a new session.
type Action int

// Gate actions.
const (
	Admit  Action = iota // queue it now
	Warn                 // queue it now, over the policy (on_saturation=warn)
	Hold                 // keep it out of the queue until Until, asking again (Review)
	Refuse               // answer it saturated (HTTP 429, Retry-After from the verdict)
)

// Decision is the gate's answer for one new session.
type Decision struct {
	Action  Action
	Checked bool // the pool is enforced: Verdict was computed
	Verdict Verdict
	Until   time.Time // Hold: when the wait runs out
}

// Gate decides a new session for pool at now (a continuation, an overcommit or a
// reservation never reaches it). An advisory pool admits without a verdict. An
// enforced pool admits what Decide admits; otherwise it warns (on_saturation=warn),
// holds while the pool settles (bounded by the settle window plus a second), holds
// for queue_timeout_ms (on_saturation=queue), or refuses. A hold is not recorded
// until the scheduler calls Hold, so a request refused for a full queue leaves nothing.
func (c *Controller) Gate(now time.Time, pool int, f Facts) Decision {
	pol := c.Policy(pool)
	if !pol.Enforced() {
		return Decision{Action: Admit}
	}
	v := c.Verdict(now, pool, f)
	d := Decision{Checked: true, Verdict: v}
	switch {
	case v.CanAdmit:
		d.Action = Admit
	case pol.OnSaturation == OnWarn:
		d.Action = Warn
	case v.Reason == ReasonSettling:
		// Slow the spawn just enough: hold until the measurement settles (bounded).
		d.Action, d.Until = Hold, now.Add(time.Duration(pol.SettleMaxMs)*time.Millisecond+time.Second)
	case pol.OnSaturation == OnQueue:
		d.Action, d.Until = Hold, now.Add(time.Duration(pol.QueueTimeoutMs)*time.Millisecond)
	default:
		d.Action = Refuse
	}
	return d
}

// Hold records a request (key) the gate of pool held until until, behind those held
// before it.
func (c *Controller) Hold(key uint64, pool int, until time.Time) {
	c.held = append(c.held, heldEntry{key: key, pool: pool, until: until})
}

// Held counts the held requests: they wait, so they count against the queue bound.
func (c *Controller) Held() int { return len(c.held) }

// HeldKeys lists the held requests in arrival order (a copy: Review and Unhold may
// remove from the list while the caller walks it).
func (c *Controller) HeldKeys() []uint64 {
	if len(c.held) == 0 {
		return nil // the common case, on every step: no allocation
	}
	out := make([]uint64, len(c.held))
	for i, h := range c.held {
		out[i] = h.key
	}
	return out
}

// Unhold forgets a held request (cancelled, or its pool released) and reports whether
// it was held.
func (c *Controller) Unhold(key uint64) bool {
	n := len(c.held)
	c.held = slices.DeleteFunc(c.held, func(h heldEntry) bool { return h.key == key })
	return len(c.held) < n
}

// Review decides a held request again at now with its pool's current facts: Admit
// (and no longer held) once the pool can admit; Refuse (and no longer held) when its
// wait ran out, or when the pool has settled and its policy rejects (a request held
// only for the settle of a reject pool is answered as soon as the pool is measured);
// otherwise Hold. Release held requests one at a time, in HeldKeys order, with facts
// that count the ones admitted before (they are pending).
func (c *Controller) Review(now time.Time, key uint64, f Facts) Decision {
	i := slices.IndexFunc(c.held, func(h heldEntry) bool { return h.key == key })
	if i < 0 {
		return Decision{Action: Refuse}
	}
	h := c.held[i]
	pol := c.Policy(h.pool)
	v := c.Verdict(now, h.pool, f)
	d := Decision{Checked: true, Verdict: v, Action: Hold, Until: h.until}
	switch {
	case v.CanAdmit:
		d.Action = Admit
	case !now.Before(h.until),
		v.Reason != ReasonSettling && pol.OnSaturation == OnReject:
		d.Action = Refuse
	default:
		return d
	}
	c.held = slices.Delete(c.held, i, i+1)
	return d
}

// Reservations make a fan-out's admission atomic (issue 13). Every branch of a
// LangGraph `Send` fan-out asks for capacity in the same step; read-only verdicts would
// all say "yes" to the same free slot. A reservation is decided one at a time, and a
// granted one counts as a warming session of its pool in every later verdict (it holds
// a guaranteed slot, keeps the pool "settling" and takes its cells out of the headroom)
// until a request carrying its id uses it, it is released, or it expires. Expiry is
// judged from the now each call is given.

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

// ErrReservationNotFound is a release of a reservation that is unknown, used or expired.
var ErrReservationNotFound = errors.New("reservation not found")

// CheckReservation validates a reservation request's ttl (0: the default) and
// expected tokens; the error says which field is wrong.
func CheckReservation(ttl time.Duration, expected int) error {
	if ttl < 0 || ttl > MaxReservationTTL {
		return fmt.Errorf("ttl_ms must be in [1, %d], got %d", MaxReservationTTL.Milliseconds(), ttl.Milliseconds())
	}
	if expected < 0 {
		return fmt.Errorf("expected_tokens must not be negative, got %d", expected)
	}
	return nil
}

// Grant is the answer to a reservation: ID is empty when it was not granted.
type Grant struct {
	ID      string
	TTL     time.Duration
	Verdict Verdict // the verdict it was decided by (before counting it)
}

// Reserve decides one reservation of pool at now (f.Expected: the expected tokens):
// granted, for ttl (0: DefaultReservationTTL), when the verdict with every earlier live
// reservation counted admits a new session. Call CheckReservation first.
func (c *Controller) Reserve(now time.Time, pool int, ttl time.Duration, f Facts) (Grant, error) {
	if ttl == 0 {
		ttl = DefaultReservationTTL
	}
	v := c.Verdict(now, pool, f)
	g := Grant{Verdict: v}
	if !v.CanAdmit {
		return g, nil
	}
	ps := c.state(pool)
	if len(ps.reservations) >= MaxReservationsPerPool {
		return Grant{}, fmt.Errorf("%w: pool %d holds %d", ErrReservationLimit, pool, len(ps.reservations))
	}
	if ps.reservations == nil {
		ps.reservations = map[string]reservation{}
	}
	ps.nextReservation++
	g.ID = "rsv-" + strconv.Itoa(pool) + "-" + strconv.FormatUint(ps.nextReservation, 10)
	g.TTL = ttl
	ps.reservations[g.ID] = reservation{expected: f.Expected, expires: now.Add(ttl)}
	return g, nil
}

// ReleaseReservation gives a live reservation back unused.
func (c *Controller) ReleaseReservation(now time.Time, pool int, id string) error {
	if !c.take(now, pool, id) {
		return fmt.Errorf("%w: pool %d has no reservation %q (unknown, used or expired)", ErrReservationNotFound, pool, id)
	}
	return nil
}

// UseReservation consumes the reservation id of pool, if it is live, and reports
// whether it was: the admission was decided when it was granted, so the request skips
// the gate. Any request of the pool that names it uses it (a continuation too), so a
// used reservation never lingers until its expiry.
func (c *Controller) UseReservation(now time.Time, pool int, id string) bool {
	return id != "" && c.take(now, pool, id)
}

// Reservations counts a pool's live reservations at now.
func (c *Controller) Reservations(now time.Time, pool int) int {
	ps, ok := c.pools[pool]
	if !ok {
		return 0
	}
	n, _ := ps.liveReservations(now, 0)
	return n
}

func (c *Controller) take(now time.Time, pool int, id string) bool {
	ps, ok := c.pools[pool]
	if !ok {
		return false
	}
	ps.liveReservations(now, 0)
	if _, ok := ps.reservations[id]; !ok {
		return false
	}
	delete(ps.reservations, id)
	return true
}

// liveReservations drops expired reservations and returns how many remain and the
// cells they stand for (marginal is the per-session cost when none was given).
func (ps *poolState) liveReservations(now time.Time, marginal float64) (int, int) {
	cells := 0
	for id, r := range ps.reservations {
		if !now.Before(r.expires) {
			delete(ps.reservations, id)
			continue
		}
		cells += int(max(float64(r.expected), marginal))
	}
	return len(ps.reservations), cells
}

func meanOrZero(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	return mean(xs)
}
