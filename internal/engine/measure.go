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
	ObsTTFT          ObsKind = iota // a task's first token: D since submission, on Pool
	ObsTokenLatency                 // D between a task's consecutive tokens
	ObsQuery                        // a finished request: PromptTokens, CachedTokens, on Pool
	ObsPrefixStored                 // a pool's prefix became resident: Prefix
	ObsPrefixRemoved                // a pool's prefix can no longer be reused here: Prefix
)

// Observation is one measurement made during a step.
type Observation struct {
	Kind                       ObsKind
	Pool                       int
	D                          time.Duration
	PromptTokens, CachedTokens int
	Prefix                     PrefixChange
}

// Observe hands observations to o; the prefix changes only when o also implements
// PrefixObserver.
func Observe(o Observer, obs []Observation) {
	po, _ := o.(PrefixObserver)
	for _, x := range obs {
		switch x.Kind {
		case ObsPrefixStored:
			if po != nil {
				po.PrefixStored(x.Prefix)
			}
		case ObsPrefixRemoved:
			if po != nil {
				po.PrefixRemoved(x.Prefix)
			}
		case ObsTTFT:
			o.TTFT(x.Pool, x.D)
		case ObsTokenLatency:
			o.TokenLatency(x.D)
		case ObsQuery:
			o.Query(x.Pool, x.PromptTokens, x.CachedTokens)
		}
	}
}

// poolAdmission is a pool's admission policy and measurement state (§14.2).
type poolAdmission struct {
	policy admission.Policy
	// The settle window after the last new-session admit.
	settleTask  *task
	settleStart time.Time
	meanAtAdmit float64
	settling    bool
	// Measured-drop forecast and the last settled mean (for the idle-gap estimate).
	dropEWMA    float64
	hasDrop     bool
	settledMean float64
	settledAt   time.Time
	// Granted, unused reservations (reservations.go), by id.
	reservations    map[string]*reservation
	nextReservation uint64
}

func (s *Scheduler) admissionOf(id int) *poolAdmission {
	pa, ok := s.admission[id]
	if !ok {
		pa = &poolAdmission{policy: admission.DefaultPolicy()}
		s.admission[id] = pa
	}
	return pa
}

// setAdmission patches a pool's policy (message SetAdmission) and returns it.
func (s *Scheduler) setAdmission(id int, patch admission.Patch) (admission.Policy, error) {
	if _, err := s.getLive(id); err != nil {
		return admission.Policy{}, err
	}
	pa := s.admissionOf(id)
	p := patch.Apply(pa.policy)
	if err := p.Validate(); err != nil {
		return admission.Policy{}, fmt.Errorf("%w: %v", pool.ErrBadRequest, err)
	}
	pa.policy = p
	return p, nil
}

// Floors lists the pools with a tps floor set, and the floor.
func (s *Scheduler) Floors() map[string]float64 {
	out := map[string]float64{}
	for id, pa := range s.admission {
		if pa.policy.TargetTPS > 0 {
			out[fmt.Sprint(id)] = pa.policy.TargetTPS
		}
	}
	return out
}

// decoding reports a task that is generating (past its prompt).
func (t *task) decoding() bool {
	return t.kind == kindGenerate && t.slot != nil && !t.prefilling() && !t.firstTok.IsZero()
}

// poolRates lists the warm decoding sessions' rates of pool p (nil: all sessions) and
// counts the warming ones.
func (s *Scheduler) poolRates(p *pool.Pool, all bool) ([]float64, int) {
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
		rates = append(rates, t.ewma.RateAt(s.now))
	}
	return rates, warming
}

// settle advances every pool's settle window; a finished window folds the measured
// drop of mean tps into the forecast.
func (s *Scheduler) settle() {
	for id, pa := range s.admission {
		if !pa.settling {
			continue
		}
		t := pa.settleTask
		_, alive := s.tasks[t.id]
		if !admission.SettleDone(pa.policy, pa.settleStart, s.now, t.generated, !alive) {
			continue
		}
		pa.settling = false
		pa.settleTask = nil
		p, err := s.pools.Get(id)
		if err != nil {
			continue
		}
		rates, _ := s.poolRates(p, false)
		if len(rates) == 0 {
			continue
		}
		mean := tps.Mean(rates)
		if pa.meanAtAdmit > 0 {
			pa.dropEWMA = admission.FoldDrop(pa.dropEWMA, pa.hasDrop, pa.meanAtAdmit, mean)
			pa.hasDrop = true
		}
		pa.settledMean, pa.settledAt = mean, s.now
	}
}

// startSettle opens the settle window for a new session admitted to p.
func (s *Scheduler) startSettle(t *task) {
	p := t.slot.base
	if p == nil || !t.newSession {
		return
	}
	pa := s.admissionOf(p.ID)
	rates, _ := s.poolRates(p, false)
	pa.settling, pa.settleTask, pa.settleStart = true, t, s.now
	pa.meanAtAdmit = tps.Mean(rates)
}

// freeForNew is the cells a new session could get: free plus idle sessions' (evictable).
func (s *Scheduler) freeForNew() int {
	return s.cfg.NCtx - s.usedCells() + s.evictableCells(nil)
}

// pressure is §13.3's compaction pressure: the larger of the cache's fill and the
// largest session's share of the context.
func (s *Scheduler) pressure() float64 {
	// Cells only the prefix cache holds are free for the asking: a warm cache is no
	// pressure.
	fill := float64(s.usedCells()-s.cacheOnlyCells()) / float64(s.cfg.NCtx)
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
			n += s.poolOwn(p)
		}
	}
	return n
}

// SessionCtx is one session's own context pressure (issue 13): what its sequence
// holds against what it can still grow into. Idle neighbours' cells (evictable) and
// released pools in their grace period count as free, so a busy neighbour that is
// only idle does not push this session to compact.
type SessionCtx struct {
	SessionID         string  `json:"session_id,omitempty"`
	PoolID            *int    `json:"pool_id"` // the pool its sequence is attached to now (nil: none)
	CtxUsed           int     `json:"ctx_used"`
	CtxHeadroomTokens int     `json:"ctx_headroom_tokens"`
	CtxPressure       float64 `json:"ctx_pressure"`
}

// sessionContext computes sl's own pressure: used / (used + headroom), where headroom
// is bounded by positions (n_ctx) and by the cells sl could get.
func (s *Scheduler) sessionContext(sl *slot) SessionCtx {
	used := len(sl.tokens)
	free := s.cfg.NCtx - s.usedCells() + s.evictableCells(sl) + s.graceCells()
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

// capacityInput gathers a pool's admission snapshot.
func (s *Scheduler) capacityInput(p *pool.Pool, expected int, session string) admission.Input {
	pa := s.admissionOf(p.ID)
	rates, warming := s.poolRates(p, false)
	in := admission.Input{
		Policy: pa.policy, Now: s.now, PoolSessions: p.Sessions + s.pendingAdmits(p), ActiveTPS: rates, NWarming: warming,
		DropEWMA: pa.dropEWMA, HasDrop: pa.hasDrop, SettledMean: pa.settledMean, SettledAt: pa.settledAt,
		FreeCells: s.freeForNew(), TotalCells: s.cfg.NCtx, Expected: expected, Pressure: s.pressure(),
	}
	own, n := 0, 0
	for _, sl := range s.slots {
		if sl.base == p {
			own += s.own(sl)
			n++
		}
	}
	if n > 0 {
		in.MarginalCells = float64(own) / float64(n)
	}
	// A granted reservation is a session that has not arrived yet: it takes a place
	// (so the guarantee and the floor see it), is warming (so the pool is settling until
	// it has been measured) and will need cells.
	marginal := in.MarginalCells
	if marginal <= 0 {
		marginal = admission.DefaultMarginalCells
	}
	nres, rcells := pa.liveReservations(s.now, marginal)
	in.Reserved = nres
	in.PoolSessions += nres
	in.NWarming += nres
	in.FreeCells = max(0, in.FreeCells-rcells)
	if pa.settling || s.pendingAdmits(p) > 0 || nres > 0 {
		in.Settling = true
		if pa.settling {
			in.SettleLeft = time.Duration(pa.policy.SettleMaxMs)*time.Millisecond - s.now.Sub(pa.settleStart)
		}
	}
	if session != "" {
		_, known := s.seen[session]
		in.KnownSession = &known
	}
	return in
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
	PoolID int `json:"pool_id"`
	admission.Verdict
	SessionPressure *float64    `json:"session_pressure,omitempty"`
	Session         *SessionCtx `json:"session,omitempty"`
}

// capacity answers GET /polykv/pools/{id}/capacity (message QueryCapacity).
func (s *Scheduler) capacity(id, expected int, session string) (CapacityReport, error) {
	p, err := s.getLive(id)
	if err != nil {
		return CapacityReport{}, err
	}
	rep := CapacityReport{PoolID: id, Verdict: admission.Decide(s.capacityInput(p, expected, session))}
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

// gate applies an enforced pool's policy to a new session. It returns whether to hold
// the task, or an error to refuse it.
func (s *Scheduler) gate(t *task) (Gate, error) {
	p := t.pool
	// A reservation is consumed by any request of its pool that names it (a
	// continuation too), so a used reservation never lingers until its expiry.
	if s.useReservation(t) {
		return Gate{Reserved: true}, nil
	}
	if p == nil || !t.newSession || t.req.Overcommit {
		return Gate{}, nil
	}
	pa := s.admissionOf(p.ID)
	if !pa.policy.Enforced() {
		return Gate{}, nil
	}
	v := admission.Decide(s.capacityInput(p, 0, ""))
	g := Gate{Checked: true, SessionsRemaining: v.HeadroomSessions, Verdict: v}
	if v.CanAdmit {
		return g, nil
	}
	switch {
	case pa.policy.OnSaturation == admission.OnWarn:
		g.Warned = true
		return g, nil
	case v.Reason == admission.ReasonSettling:
		// Slow the spawn just enough: hold until the measurement settles (bounded).
		t.gateDeadline = s.now.Add(time.Duration(pa.policy.SettleMaxMs)*time.Millisecond + time.Second)
	case pa.policy.OnSaturation == admission.OnQueue:
		t.gateDeadline = s.now.Add(time.Duration(pa.policy.QueueTimeoutMs) * time.Millisecond)
	default:
		return g, &SaturatedError{Pool: p.ID, Verdict: v}
	}
	g.Held = true
	return g, nil
}

// releaseGated lets held tasks through once their pool can admit, in arrival order,
// and refuses those whose wait ran out.
func (s *Scheduler) releaseGated() {
	for i := 0; i < len(s.gated); {
		t := s.gated[i]
		if t.pool.State == pool.Released {
			s.dropGated(i, fmt.Errorf("%w: pool %d was released while the request waited", pool.ErrNotFound, t.pool.ID))
			continue
		}
		v := admission.Decide(s.capacityInput(t.pool, 0, ""))
		pol := s.admissionOf(t.pool.ID).policy
		switch {
		case v.CanAdmit:
			s.gated = append(s.gated[:i], s.gated[i+1:]...)
			s.queue = append(s.queue, t)
			continue
		case !s.now.Before(t.gateDeadline),
			// Held only for the settle: once measured, a reject pool answers at once.
			v.Reason != admission.ReasonSettling && pol.OnSaturation == admission.OnReject:
			s.dropGated(i, &SaturatedError{Pool: t.pool.ID, Verdict: v})
			continue
		}
		i++
	}
}

func (s *Scheduler) dropGated(i int, err error) {
	t := s.gated[i]
	s.gated = append(s.gated[:i], s.gated[i+1:]...)
	delete(s.tasks, t.id)
	s.events = append(s.events, Event{Task: t.id, Done: true, Finish: FinishError, Err: err})
}

// SessionTPS is one session in the tps stream.
type SessionTPS struct {
	SessionID         string  `json:"session_id"`
	Seq               int     `json:"seq_id"`
	PoolID            *int    `json:"pool_id"`
	State             string  `json:"state"`
	TPSEWMA           float64 `json:"tps_ewma"`
	Warming           bool    `json:"warming"`
	Decoded           int     `json:"n_decoded"`
	CtxUsed           int     `json:"ctx_used"`
	CtxTotal          int     `json:"ctx_total"`
	CtxHeadroomTokens int     `json:"ctx_headroom_tokens"`
	CtxPressure       float64 `json:"ctx_pressure"` // the session's own pressure (sessionContext)
}

// TPSSnapshot is one event of GET /polykv/tps.
type TPSSnapshot struct {
	TS            float64      `json:"ts"`
	AggregateTPS  float64      `json:"aggregate_tps"`
	PromptTPS     float64      `json:"prompt_tps"`
	MeanActiveTPS float64      `json:"mean_active_tps"`
	NActive       int          `json:"n_active"`
	NWarming      int          `json:"n_warming"`
	Sessions      []SessionTPS `json:"sessions"`
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
	}
	return st
}

// TPS copies out the tps picture.
func (s *Scheduler) TPS(now time.Time) TPSSnapshot {
	s.now = now
	rates, warming := s.poolRates(nil, true)
	snap := TPSSnapshot{TS: float64(now.UnixMilli()) / 1000, AggregateTPS: s.agg.RateAt(now), PromptTPS: s.aggPrompt.RateAt(now),
		MeanActiveTPS: tps.Mean(rates), NActive: len(rates), NWarming: warming, Sessions: []SessionTPS{}}
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
}

// Metrics copies out the per-pool gauges (plus a row for sessions on no pool).
func (s *Scheduler) Metrics(now time.Time) ([]PoolMetric, Usage) {
	s.now = now
	byPool := map[*pool.Pool]*PoolMetric{}
	none := &PoolMetric{Unattached: true}
	for _, p := range s.pools.All() {
		byPool[p] = &PoolMetric{PoolID: p.ID, KVBytes: int64(s.poolOwn(p)) * s.cfg.BytesPerCell}
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
		m.KVBytes += int64(s.own(sl)) * s.cfg.BytesPerCell
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
