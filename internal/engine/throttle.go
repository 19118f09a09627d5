package engine

import "time"

// Throttle toward the floor (issue 41: the design's §4.4 banked step, Andes' idea).
// A decode row is not free: on a CPU every row of a step costs about as much as the
// next (attention over every cell in use, the matrix products), so a session decoding
// well above its pool's floor takes capacity that a session near or under its floor,
// or a prompt the step's token budget cuts, could use. A pool whose policy has
// throttle "toward_floor" lets its warm sessions above floor·(1+margin) skip decode
// steps while someone gains from it:
//
//   - a decoding session of any pool with a floor that is near or under it (its
//     experienced tps at most floor·(1+margin/2)), which then gets shorter steps; or
//   - a prompt being prefilled that the step's token budget cuts, which then gets the
//     skipped rows' tokens of the budget and finishes in fewer steps.
//
// A prefill that fits the step anyway is no reason: a skipped row would save a few
// milliseconds of a step the prompt makes long, and the skipped session would lose
// its token for it.
//
// A skip only delays a session's next token to a later step: the token, its position
// and its sequence's cells are the same, so greedy output does not change (PolyKV's
// kernels make a token's logits independent of the batch it is in). Skips are bounded
// (never starving a session): each decode step a throttled session takes part in gives
// it throttle_max_skip of credit (at most one), a skip costs one, so at most that
// fraction of its steps are skipped and never two in a row while it is at most 0.5.
// Pools without a floor are never throttled.
//
// Admission must not read a throttled session's slowness as a lack of capacity (the
// gate would refuse the very sessions the throttle makes room for). The scheduler
// therefore keeps, beside each session's experienced EWMA, an unthrottled one: the
// rate it would have had if its pool's sessions had skipped no row. Each skipped row
// adds the marginal cost of a row (rowCost) to its pool's virtual clock, which runs
// ahead of the real one; every session's unthrottled EWMA counts a token for each step
// it decoded or skipped, on its pool's clock. Another pool's skips are not added: the
// capacity they give this pool's sessions is real while that pool stays throttled,
// and the gate may count it. The admission facts (the pool's rates, the settle
// windows, the measured drop) read the unthrottled rates once the pool's sessions were
// throttled; /polykv/tps, /metrics and the responses report what sessions experienced.
// Without throttling the two are the same numbers.

// rowCost estimates the marginal cost of one decode row from the steps that decoded
// only (no prompt tokens): an exponentially weighted least-squares fit of step time
// over rows. A skipped row is credited with the slope, bounded to [½, 1] of the mean
// time per row: the mean (no fixed cost per step: a skip frees nothing beyond its own
// share) is what it falls back to while the rows seen barely vary.
type rowCost struct {
	w, x, y, xx, xy float64
}

// rowCostDecay weighs the steps seen: the fit follows the last ~20 decode steps, as
// the context (and so each row's attention) grows.
const rowCostDecay = 0.95

func (c *rowCost) observe(rows int, d time.Duration) {
	x, y := float64(rows), d.Seconds()
	c.w = rowCostDecay*c.w + 1
	c.x = rowCostDecay*c.x + x
	c.y = rowCostDecay*c.y + y
	c.xx = rowCostDecay*c.xx + x*x
	c.xy = rowCostDecay*c.xy + x*y
}

// marginal is the estimated cost of one row (0 before any decode-only step).
func (c *rowCost) marginal() time.Duration {
	if c.w == 0 || c.x == 0 {
		return 0
	}
	mx, my := c.x/c.w, c.y/c.w
	perRow := my / mx
	b := perRow
	if vx := c.xx/c.w - mx*mx; vx > 0.05 {
		if slope := (c.xy/c.w - mx*my) / vx; slope > 0 {
			b = min(max(slope, perRow/2), perRow)
		}
	}
	return time.Duration(b * float64(time.Second))
}

// predict is the expected time of a decode-only step of rows rows, from the same fit:
// its intercept (at least 0) plus rows times the marginal cost (0 before any
// decode-only step).
func (c *rowCost) predict(rows int) time.Duration {
	b := c.marginal()
	if b == 0 {
		return 0
	}
	mx, my := c.x/c.w, c.y/c.w
	a := max(0, my-b.Seconds()*mx)
	return time.Duration((a + b.Seconds()*float64(rows)) * float64(time.Second))
}

// paceMaxHold bounds how long the throttle holds one turn in the queue: past it the
// turn goes like any other (never starving one turn, whatever the others do).
const paceMaxHold = 10 * time.Second

// paced reports whether the throttle holds t, a waiting turn of a pool with a floor
// and throttle toward_floor, in the queue (admitPass): while the pool's own sessions
// run and one more would slow the step's decoding sessions under floor·(1+margin): the
// margin absorbs the steps that carry prompt chunks, which the projection averages.
// The projection is admission's (mean·n/(n+1)) over every session of the step, not
// only the pool's (they share the step): the running sessions' mean unthrottled rate,
// shared by the d decoding and p prefilling ones and t. Where a decode row costs a
// good part of a step (a CPU), one more session decoding cuts every session's speed
// while the machine's throughput grows little, so a turn that waits for a running one
// to end keeps those at the floor and costs the machine little while someone decodes
// (paced). Before any rate is measured the row-cost fit projects the
// step instead. A pool with no running session is never held (its turn goes: liveness),
// nor a turn held paceMaxHold already, nor one whose own session's turn still runs
// (that is what it waits for).
func (s *Scheduler) paced(t *task) bool {
	if t.kind != kindGenerate || t.pool == nil || !s.adm.Throttling() {
		return false
	}
	pol := s.adm.Policy(t.pool.ID)
	if pol.TargetTPS <= 0 || !pol.Throttles() {
		return false
	}
	if !t.pacedAt.IsZero() && s.now.Sub(t.pacedAt) >= paceMaxHold {
		return false
	}
	if sl, ok := s.bySession[t.req.SessionID]; ok && t.req.SessionID != "" && sl.task != nil {
		return false // it waits for its own session's running turn first (WaitSession)
	}
	decoding, prefilling, mine := 0, 0, 0
	var sum float64
	measured := 0
	for _, r := range s.running {
		if r.kind != kindGenerate {
			continue
		}
		if r.poolID() == t.pool.ID {
			mine++
		}
		if !r.decoding() {
			prefilling++
			continue
		}
		decoding++
		if !r.ewma.Warming() {
			sum += s.admissionRate(r)
			measured++
		}
	}
	if mine == 0 {
		return false
	}
	var projected float64
	if measured > 0 {
		projected = sum / float64(measured) * float64(decoding) / float64(decoding+prefilling+1)
	} else if step := s.rowCost.predict(decoding + prefilling + 1); step > 0 {
		projected = 1 / step.Seconds()
	} else {
		return false
	}
	if projected >= pol.TargetTPS*(1+pol.ThrottleMargin) {
		return false
	}
	if t.pacedAt.IsZero() {
		t.pacedAt = s.now
		s.pacedTotal++
		s.pacedBy[t.pool.ID]++
	}
	return true
}

// throttleSkips decides which decoding sessions skip this step (Plan, before its
// decode loop) and marks them (t.skipNow, s.skipped).
func (s *Scheduler) throttleSkips() {
	s.skipped = s.skipped[:0]
	if !s.adm.Throttling() {
		return
	}
	gain := false
	// A prompt the budget cuts: more of the budget would finish it sooner.
	budget, demand := s.cfg.NBatch, 0
	for _, t := range s.running {
		switch {
		case t.status == statusDecoding:
			budget--
		case t.prefilling() && !t.loading(true):
			demand += len(t.req.Prompt) - len(t.slot.tokens)
		}
	}
	gain = demand > budget
	var cands []*task
	for _, t := range s.running {
		if t.status != statusDecoding || t.ewma.Warming() || t.slot.base == nil {
			continue
		}
		pol := s.adm.Policy(t.slot.base.ID)
		if pol.TargetTPS <= 0 {
			continue
		}
		rate := t.ewma.RateAt(s.now)
		if pol.Throttles() {
			t.skipCredit = min(1, t.skipCredit+pol.ThrottleMaxSkip)
			if rate > pol.TargetTPS*(1+pol.ThrottleMargin) && t.skipCredit >= 1 {
				cands = append(cands, t)
				continue
			}
		}
		if rate <= pol.TargetTPS*(1+pol.ThrottleMargin/2) {
			gain = true // near or under its floor
		}
	}
	if !gain {
		return
	}
	for _, t := range cands {
		t.skipCredit--
		t.skipNow = true
		s.skipped = append(s.skipped, t)
	}
}

// unskip takes back this step's skips (Plan, when nothing else made it into the
// batch: a skip would then gain nobody, and an empty batch would idle the loop).
func (s *Scheduler) unskip() {
	for _, t := range s.skipped {
		t.skipCredit++
	}
	s.skipped = s.skipped[:0]
}

// throttleCommit accounts one decoded step for the throttle (Commit, before the
// step's tokens are applied): the row-cost fit learns from a decode-only step, each
// skipped row moves the virtual clock of the unthrottled rates on by a row's cost,
// and every skipped session counts the token it would have decoded there.
func (s *Scheduler) throttleCommit(in []inflight, now time.Time) {
	rows, entries := 0, len(s.skipped)
	prompt := false
	for _, f := range in {
		entries += f.n
		if f.decode {
			rows += f.n
		} else {
			prompt = true
		}
	}
	d := now.Sub(s.planAt)
	if rows > 0 && !prompt && d > 0 {
		s.rowCost.observe(rows, d)
	}
	if len(s.skipped) == 0 {
		return
	}
	row := s.rowCost.marginal()
	if row == 0 && entries > 0 {
		row = d / time.Duration(entries) // nothing learnt yet: this step's time per entry
	}
	// Each pool's clock moves on by its own skipped rows: its sessions' unthrottled
	// rates are what they would decode if the pool's own sessions were not throttled,
	// while the capacity other pools' throttles give them stays counted (it is theirs
	// as long as those pools stay above their floors).
	for _, t := range s.skipped {
		s.throttleLead[t.poolID()] += row
	}
	for _, t := range s.skipped {
		t.throttled++
		s.throttledTotal++
		if id := t.poolID(); id != 0 {
			s.throttledBy[id]++
		}
		t.shadow.Observe(1, now.Add(s.throttleLead[t.poolID()]))
	}
	s.skipped = s.skipped[:0]
}

// admissionRate is t's rate as admission reads it: the unthrottled rate once its
// pool's sessions were throttled, else (the same number) the experienced one.
func (s *Scheduler) admissionRate(t *task) float64 {
	if lead := s.throttleLead[t.poolID()]; lead > 0 {
		return t.shadow.RateAt(s.now.Add(lead))
	}
	return t.ewma.RateAt(s.now)
}

// ThrottledSteps reports the decode steps skipped by the throttle, per pool, since
// the scheduler started.
func (s *Scheduler) ThrottledSteps() map[int]int64 {
	out := make(map[int]int64, len(s.throttledBy))
	for id, n := range s.throttledBy {
		out[id] = n
	}
	return out
}
