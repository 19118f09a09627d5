package engine

import (
	"errors"
	"fmt"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/pool"
	"github.com/polykv/polykv/internal/tps"
)

// Observer receives per-token and per-request measurements (Prometheus, in the server).
// The engine calls it on its goroutine after each step, with the step's Observations;
// it must not block.
type Observer interface {
	TTFT(pool int, d time.Duration)
	TokenLatency(d time.Duration)
	Query(pool int, promptTokens, cachedTokens int)
}

// ObsKind names a measurement.
type ObsKind int

// Measurements the scheduler makes.
const (
	ObsTTFT         ObsKind = iota // a task's first token: D since submission, on Pool
	ObsTokenLatency                // D between a task's consecutive tokens
	ObsQuery                       // a finished request: PromptTokens, CachedTokens, on Pool
	ObsSeqChange                   // a sequence's reusable content changed: Seq (residency.go)
	ObsDraft                       // a verified speculative proposal: Drafted tokens, Accepted of them, on Pool
)

// DraftObserver is an Observer that also counts speculative decoding's proposals and
// their acceptance (Prometheus, per pool).
type DraftObserver interface {
	Draft(pool, drafted, accepted int)
}

// Observation is one measurement made during a step.
type Observation struct {
	Kind                       ObsKind
	Pool                       int
	D                          time.Duration
	PromptTokens, CachedTokens int
	Seq                        SeqChange
	Drafted, Accepted          int
}

// Observe hands observations to o; the sequence changes only when it implements
// ResidencyObserver, the drafts only when it implements DraftObserver.
func Observe(o Observer, obs []Observation) {
	ro, _ := o.(ResidencyObserver)
	do, _ := o.(DraftObserver)
	for _, x := range obs {
		switch x.Kind {
		case ObsSeqChange:
			if ro != nil {
				ro.SeqChanged(x.Seq)
			}
		case ObsTTFT:
			o.TTFT(x.Pool, x.D)
		case ObsTokenLatency:
			o.TokenLatency(x.D)
		case ObsQuery:
			o.Query(x.Pool, x.PromptTokens, x.CachedTokens)
		case ObsDraft:
			if do != nil {
				do.Draft(x.Pool, x.Drafted, x.Accepted)
			}
		}
	}
}

// setAdmission patches a pool's policy (message SetAdmission) and returns it.
func (s *Scheduler) setAdmission(id int, patch admission.Patch) (admission.Policy, error) {
	pl, err := s.getLive(id)
	if err != nil {
		return admission.Policy{}, err
	}
	p, err := s.adm.SetPolicy(id, patch)
	if err != nil {
		return admission.Policy{}, fmt.Errorf("%w: %v", pool.ErrBadRequest, err)
	}
	s.recordPinned(pl) // a recorded pool's record carries its policy
	return p, nil
}

// Floors lists the pools with a tps floor set, and the floor.
func (s *Scheduler) Floors() map[string]float64 {
	out := map[string]float64{}
	for id, floor := range s.adm.Floors() {
		out[fmt.Sprint(id)] = floor
	}
	return out
}

// decoding reports a task that is generating (past its prompt).
func (t *task) decoding() bool {
	return t.kind == kindGenerate && t.slot != nil && !t.prefilling() && !t.firstTok.IsZero()
}

// poolRates lists the warm decoding sessions' experienced rates of pool p (nil: all
// sessions) and counts the warming ones.
func (s *Scheduler) poolRates(p *pool.Pool, all bool) ([]float64, int) {
	return s.rates(p, all, func(t *task) float64 { return t.ewma.RateAt(s.now) })
}

// admissionRates is poolRates as admission reads it: each session's unthrottled rate,
// so the capacity a throttle frees is not read as a lack of it (throttle.go).
func (s *Scheduler) admissionRates(p *pool.Pool) ([]float64, int) {
	return s.rates(p, false, s.admissionRate)
}

func (s *Scheduler) rates(p *pool.Pool, all bool, rate func(*task) float64) ([]float64, int) {
	var rates []float64
	warming := 0
	for _, t := range s.running {
		if !t.decoding() || (!all && t.slot.base != p) {
			continue
		}
		if t.ewma.Warming() {
			warming++
			continue
		}
		rates = append(rates, rate(t))
	}
	return rates, warming
}

// settle reports progress to every open settle window of the admission controller
// (which closes finished ones and folds the measured drop of mean tps into the
// forecast).
func (s *Scheduler) settle() {
	for _, w := range s.adm.Windows() {
		decoded, ended := 0, true
		if t, ok := s.tasks[TaskID(w.Key)]; ok {
			decoded, ended = t.generated, false
		}
		var rates []float64
		if p, err := s.pools.Get(w.Pool); err == nil {
			rates, _ = s.admissionRates(p)
		}
		s.adm.Progress(s.now, w.Pool, decoded, ended, rates)
	}
}

// startSettle tells the admission controller that a new session was seated on its pool
// (which opens the pool's settle window).
func (s *Scheduler) startSettle(t *task) {
	p := t.slot.base
	if p == nil || !t.newSession {
		return
	}
	rates, _ := s.admissionRates(p)
	s.adm.Seated(s.now, p.ID, uint64(t.id), rates)
}

// freeForNew is the cells a new session could get: free plus idle sessions' (evictable).
func (s *Scheduler) freeForNew() int {
	return s.cfg.NCtx - s.kv.Used() + s.kv.Evictable(s.now, -1)
}

// pressure is §13.3's compaction pressure: the larger of the cache's fill and the
// largest session's share of the context.
func (s *Scheduler) pressure() float64 {
	// Cells only the prefix cache holds are free for the asking: a warm cache is no
	// pressure.
	fill := float64(s.kv.Used()-s.cacheOnlyCells()) / float64(s.cfg.NCtx)
	for _, sl := range s.slots {
		if sl.session == "" && sl.task == nil {
			continue // a cached anonymous sequence is nobody's context
		}
		fill = max(fill, float64(len(sl.tokens))/float64(s.cfg.NCtx))
	}
	return fill
}

// graceCells counts the cells of released pools that nothing uses any more: they are
// reclaimed once --pool-grace-ms has passed, so a session's pressure treats them as
// free. (Compaction releases the old working pool; counting its cells as used for the
// grace period made the next turn look full and compact again.)
func (s *Scheduler) graceCells() int {
	n := 0
	for _, p := range s.pools.All() {
		if p.State == pool.Released && p.Sessions == 0 && len(p.Children) == 0 {
			n += p.OwnCells()
		}
	}
	return n
}

// SessionCtx is one session's own context pressure (issue 13): what its sequence
// holds against what it can still grow into. Idle neighbours' cells (evictable) and
// released pools in their grace period count as free, so a busy neighbour that is
// only idle does not push this session to compact.
type SessionCtx struct {
	SessionID         string
	PoolID            *int // the pool its sequence is attached to now (nil: none)
	CtxUsed           int
	CtxHeadroomTokens int
	CtxPressure       float64
}

// sessionContext computes sl's own pressure: used / (used + headroom), where headroom
// is bounded by positions (n_ctx) and by the cells sl could get.
func (s *Scheduler) sessionContext(sl *slot) SessionCtx {
	used := len(sl.tokens)
	free := s.cfg.NCtx - s.kv.Used() + s.kv.Evictable(s.now, exceptSeq(sl)) + s.graceCells()
	c := SessionCtx{SessionID: sl.session, CtxUsed: used, CtxHeadroomTokens: s.headroom(used, free)}
	if sl.base != nil {
		id := sl.base.ID
		c.PoolID = &id
	}
	if used > 0 {
		c.CtxPressure = float64(used) / float64(used+c.CtxHeadroomTokens)
	}
	return c
}

// poolFacts gathers what the admission controller needs to know about pool p now;
// expected and session describe the asker (0 and "": not given).
func (s *Scheduler) poolFacts(p *pool.Pool, expected int, session string) admission.Facts {
	rates, warming := s.admissionRates(p)
	f := admission.Facts{
		Sessions: p.Sessions, Pending: s.pendingAdmits(p), Rates: rates, Warming: warming,
		FreeCells: s.freeForNew(), TotalCells: s.cfg.NCtx, Expected: expected, Pressure: s.pressure(),
	}
	own, n := 0, 0
	for _, sl := range s.slots {
		if sl.base == p {
			own += s.kv.Owned(sl.seq)
			n++
		}
	}
	if n > 0 {
		f.MarginalCells = float64(own) / float64(n)
	}
	if session != "" {
		known := s.adm.Known(session)
		f.KnownSession = &known
	}
	return f
}

// pendingAdmits counts new sessions let through the gate but not yet on a sequence.
func (s *Scheduler) pendingAdmits(p *pool.Pool) int {
	n := 0
	for _, t := range s.queue {
		if t.kind == kindGenerate && t.pool == p && t.newSession {
			n++
		}
	}
	return n
}

// CapacityReport is /capacity's answer for one pool. With a session_id that holds a
// sequence it also carries that session's own context pressure.
type CapacityReport struct {
	PoolID int
	admission.Verdict
	SessionPressure *float64
	Session         *SessionCtx
}

// capacity answers GET /polykv/pools/{id}/capacity (message QueryCapacity).
func (s *Scheduler) capacity(id, expected int, session string) (CapacityReport, error) {
	p, err := s.getLive(id)
	if err != nil {
		return CapacityReport{}, err
	}
	rep := CapacityReport{PoolID: id, Verdict: s.adm.Verdict(s.now, id, s.poolFacts(p, expected, session))}
	if sl, ok := s.bySession[session]; ok && session != "" {
		c := s.sessionContext(sl)
		rep.Session, rep.SessionPressure = &c, &c.CtxPressure
	}
	return rep, nil
}

// SaturatedError is an enforced pool refusing a new session (HTTP 429).
type SaturatedError struct {
	Pool    int
	Verdict admission.Verdict
}

func (e *SaturatedError) Error() string {
	return fmt.Sprintf("pool %d cannot admit a new session: %s", e.Pool, e.Verdict.Reason)
}

// ErrSaturated matches any *SaturatedError with errors.Is.
var ErrSaturated = errors.New("pool saturated")

// Is makes errors.Is(err, ErrSaturated) work.
func (e *SaturatedError) Is(target error) bool { return target == ErrSaturated }

// Gate is what the enforced gate said about a submitted request.
type Gate struct {
	Checked           bool // the pool is enforced and the request was a new session
	Reserved          bool // the request used a live reservation: admitted when it was granted
	Held              bool // waiting for capacity (settling, or on_saturation=queue)
	Warned            bool // admitted over the floor (on_saturation=warn)
	SessionsRemaining int
	Verdict           admission.Verdict
}

// gate asks the admission controller about a new session and says what it decided.
// A Held gate comes with the deadline of the wait and is not yet recorded: submit
// holds the request once the queue bound allows. An error refuses the request.
func (s *Scheduler) gate(t *task) (Gate, time.Time, error) {
	p := t.pool
	// A reservation is consumed by any request of its pool that names it (a
	// continuation too), so a used reservation never lingers until its expiry.
	if p != nil && s.adm.UseReservation(s.now, p.ID, t.req.ReservationID) {
		return Gate{Reserved: true}, time.Time{}, nil
	}
	if p == nil || !t.newSession || t.req.Overcommit {
		return Gate{}, time.Time{}, nil
	}
	d := s.adm.Gate(s.now, p.ID, s.poolFacts(p, 0, ""))
	if !d.Checked {
		return Gate{}, time.Time{}, nil
	}
	g := Gate{Checked: true, SessionsRemaining: d.Verdict.HeadroomSessions, Verdict: d.Verdict}
	switch d.Action {
	case admission.Warn:
		g.Warned = true
	case admission.Hold:
		g.Held = true
	case admission.Refuse:
		return g, time.Time{}, &SaturatedError{Pool: p.ID, Verdict: d.Verdict}
	}
	return g, d.Until, nil
}

// releaseGated asks the admission controller again about each held request, in
// arrival order: it is let into the queue, refused, or stays held. A pool released
// while the request waited fails it.
func (s *Scheduler) releaseGated() {
	for _, key := range s.adm.HeldKeys() {
		t := s.tasks[TaskID(key)]
		if t.pool.State == pool.Released {
			s.adm.Unhold(key)
			s.dropGated(t, fmt.Errorf("%w: pool %d was released while the request waited", pool.ErrNotFound, t.pool.ID))
			continue
		}
		// Facts per request: one let in before is pending, and keeps the pool settling.
		switch d := s.adm.Review(s.now, key, s.poolFacts(t.pool, 0, "")); d.Action {
		case admission.Admit:
			s.enqueue(t)
		case admission.Refuse:
			s.dropGated(t, &SaturatedError{Pool: t.pool.ID, Verdict: d.Verdict})
		}
	}
}

func (s *Scheduler) dropGated(t *task, err error) {
	s.dropTask(t)
	s.events = append(s.events, Event{Task: t.id, Done: true, Finish: FinishError, Err: err})
}

// SessionTPS is one session in the tps stream.
type SessionTPS struct {
	SessionID         string
	Seq               int
	PoolID            *int
	State             string
	TPSEWMA           float64
	Warming           bool
	Decoded           int
	CtxUsed           int
	CtxTotal          int
	CtxHeadroomTokens int
	CtxPressure       float64 // the session's own pressure (sessionContext)
	// DraftN, DraftAccepted: the running task's speculative proposals so far and the
	// tokens of them accepted (llama-server's draft_n, draft_n_accepted).
	DraftN, DraftAccepted int
	// ThrottledSteps: decode steps the running task skipped for its pool's throttle.
	ThrottledSteps int
}

// TPSSnapshot is one event of GET /polykv/tps.
type TPSSnapshot struct {
	TS            float64
	AggregateTPS  float64
	PromptTPS     float64
	MeanActiveTPS float64
	NActive       int
	NWarming      int
	// ThrottledSteps counts the decode steps skipped by throttles so far (all pools).
	ThrottledSteps int64
	// PacedTurns counts the turns throttles held in the queue so far (all pools).
	PacedTurns int64
	Sessions   []SessionTPS
}

// headroom is how many more tokens a sequence holding used tokens can take: bounded
// by positions (n_ctx) and by the cells a new token could get.
func (s *Scheduler) headroom(used, free int) int {
	return max(0, min(s.cfg.NCtx-used, free))
}

func (s *Scheduler) sessionTPS(sl *slot, free int) SessionTPS {
	st := SessionTPS{SessionID: sl.session, Seq: sl.seq, State: slotState(sl), CtxUsed: len(sl.tokens), CtxTotal: s.cfg.NCtx,
		CtxHeadroomTokens: s.headroom(len(sl.tokens), free), CtxPressure: s.sessionContext(sl).CtxPressure}
	if sl.base != nil {
		id := sl.base.ID
		st.PoolID = &id
	}
	if t := sl.task; t != nil && t.kind == kindGenerate {
		st.TPSEWMA = t.ewma.RateAt(s.now)
		st.Warming = t.ewma.Warming()
		st.Decoded = t.generated
		st.DraftN, st.DraftAccepted = t.spec.drafted, t.spec.accepted
		st.ThrottledSteps = t.throttled
	}
	return st
}

// TPS copies out the tps picture.
func (s *Scheduler) TPS(now time.Time) TPSSnapshot {
	s.now = now
	rates, warming := s.poolRates(nil, true)
	snap := TPSSnapshot{TS: float64(now.UnixMilli()) / 1000, AggregateTPS: s.agg.RateAt(now), PromptTPS: s.aggPrompt.RateAt(now),
		MeanActiveTPS: tps.Mean(rates), NActive: len(rates), NWarming: warming, ThrottledSteps: s.throttledTotal, PacedTurns: s.pacedTotal, Sessions: []SessionTPS{}}
	free := s.freeForNew()
	for _, sl := range s.slots {
		if sl.task != nil || len(sl.tokens) > 0 {
			snap.Sessions = append(snap.Sessions, s.sessionTPS(sl, free))
		}
	}
	return snap
}

// PoolMetric is one pool's gauges for /metrics.
type PoolMetric struct {
	PoolID     int
	GenTPS     float64 // Σ experienced tps of its decoding sessions
	KVBytes    int64   // own cells plus attached sessions' suffixes
	Sessions   int
	Unattached bool // the "none" row: sessions on no pool
	// ThrottledSteps: decode steps its sessions skipped for its throttle, since the
	// scheduler started; PacedTurns, its turns the throttle held in the queue.
	ThrottledSteps int64
	PacedTurns     int64
}

// Metrics copies out the per-pool gauges (plus a row for sessions on no pool).
func (s *Scheduler) Metrics(now time.Time) ([]PoolMetric, Usage) {
	s.now = now
	byPool := map[*pool.Pool]*PoolMetric{}
	none := &PoolMetric{Unattached: true}
	for _, p := range s.pools.All() {
		byPool[p] = &PoolMetric{PoolID: p.ID, KVBytes: int64(p.OwnCells()) * s.cfg.BytesPerCell, ThrottledSteps: s.throttledBy[p.ID], PacedTurns: s.pacedBy[p.ID]}
	}
	for _, sl := range s.slots {
		m := none
		if sl.base != nil {
			m = byPool[sl.base]
		}
		if m == nil {
			continue
		}
		if sl.task != nil || len(sl.tokens) > 0 {
			m.Sessions++
		}
		m.KVBytes += int64(s.kv.Owned(sl.seq)) * s.cfg.BytesPerCell
		if t := sl.task; t != nil && t.decoding() {
			m.GenTPS += t.ewma.RateAt(now)
		}
	}
	out := []PoolMetric{*none}
	for _, p := range s.pools.All() {
		out = append(out, *byPool[p])
	}
	return out, s.Usage()
}
