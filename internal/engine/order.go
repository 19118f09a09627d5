package engine

import (
	"cmp"
	"slices"
	"time"
)

// Program-aware order (issue 40). Agents send turns separated by tool calls: a
// session's next request usually comes within a second or two of its last reply, and
// one that went quiet may never come. Two decisions follow from that, both here:
//
//   - Which cells go first when room is needed (victims, pickSlot): the holder expected
//     to be needed last (nextUse), not merely the least recently used. In a round of
//     agents the least recently used is the one whose next turn is due soonest, so
//     recency alone evicts exactly the wrong one. A sequence a queued request continues
//     is needed now; an idle one is expected back after its own typical gap between
//     turns (learned per session, and over all conversations), sooner when its client
//     said so (Request.NextTurn) or its reply ended in a tool call (ExpectTurn); one
//     overdue grows less likely the longer it stays away.
//   - Which waiting request goes first (queueBefore): a conversation already in flight
//     (a known session, or a prompt that continues what an idle or stored sequence
//     holds) before a new agent's first turn, the one with the least attained service
//     (accumulated context) first among them (Autellix's least attained service), and
//     no starvation: a request passed over by agingPasses later arrivals goes first.

// agingPasses is how many later requests may be seated before a waiting one, after
// which it goes before every request that is not as old (no starvation).
const agingPasses = 8

// defaultToolGap is the gap expected after a reply that ended in a tool call until the
// server has measured one; gapAlpha weighs each new observation in the gap averages.
const (
	defaultToolGap = time.Second
	gapAlpha       = 0.3
)

// ExpectTurn tells the scheduler that the reply task Task gave on sequence Seq ended in
// a tool call (the API parsed it), so its conversation's next turn is expected soon:
// its cells are kept ahead of those of conversations that went quiet. Ignored when the
// sequence has moved on since.
type ExpectTurn struct {
	Seq  int
	Task TaskID
}

func (ExpectTurn) isMsg() {}

// gapModel is what the scheduler learned about the time between a conversation's turns.
type gapModel struct {
	all, tool time.Duration // averages over every conversation; 0: none seen
	sessions  map[string]*sessionGap
}

// sessionGap is one session's own history.
type sessionGap struct {
	avg     time.Duration // 0: no gap seen yet
	lastEnd time.Time     // when its last turn ended
	tool    bool          // its last reply ended in a tool call
	served  int           // its context at the end of its last turn (attained service)
	// parked is what the session held when its cells went to the tier (spillSeq), kept
	// until its next turn arrives so that its segments can be read up from disk ahead
	// of the turn its evidence expects (prefetchExpected); expect is that time (zero:
	// no evidence, no prefetch); fetched, the prefetch was planned.
	parked  []Token
	expect  time.Time
	fetched bool
}

func ewmaDur(avg, x time.Duration) time.Duration {
	if avg == 0 {
		return x
	}
	return avg + time.Duration(gapAlpha*float64(x-avg))
}

// turnGap is the expected gap after sl's last turn, from evidence about this
// conversation alone: after a tool call, the tool gap (learned over every conversation);
// else the typical gap its session showed, or, anonymous, the one the conversation on
// this sequence showed. 0 when nothing is known: nextUse then orders it by recency
// alone, after every holder expected back. (A gap learned from other conversations is
// no evidence about this one: applied to all, it would evict the most recently used
// first, which fails every conversation that is not a round of agents.)
func (s *Scheduler) turnGap(sl *slot) time.Duration {
	switch g := s.gaps.sessions[sl.session]; {
	case sl.toolTurn:
		return cmp.Or(s.gaps.tool, defaultToolGap)
	case sl.session != "":
		if g != nil {
			return g.avg
		}
		return 0
	}
	return sl.gap
}

// unknownHorizon is how far ahead a holder nothing is expected of (a pool, or a
// conversation before any gap was learned) is put: after every holder expected back
// sooner, least recently used first among themselves.
const unknownHorizon = 30 * time.Second

// nextUse is when victim v is expected to be needed again (see the top of this file):
// now when a queued request continues it; its expected time while that is ahead, else
// now plus twice how overdue it is (went quiet: the longer, the less likely soon); with
// no expectation, unknownHorizon plus how long it has been idle, which orders such
// holders by recency alone (a server that saw no conversation evicts least recently
// used first).
func (s *Scheduler) nextUse(v victim) time.Time {
	var exp, last time.Time
	if v.p != nil {
		last = v.p.LastAccess
	} else {
		sl := v.sl
		if s.awaited(sl) {
			return s.now
		}
		last = sl.lastUsed
		if exp = sl.expect; exp.IsZero() {
			if g := s.turnGap(sl); g > 0 {
				exp = sl.lastUsed.Add(g)
			}
		}
	}
	if exp.IsZero() {
		return s.now.Add(unknownHorizon + s.now.Sub(last))
	}
	if late := s.now.Sub(exp); late > 0 {
		return s.now.Add(2 * late)
	}
	return exp
}

// awaited reports whether a queued request continues sl: its session's next turn, or
// an anonymous request that found sl as its cached prefix.
func (s *Scheduler) awaited(sl *slot) bool {
	for _, t := range s.queue {
		if t.kind != kindGenerate {
			continue
		}
		if (sl.session != "" && t.req.SessionID == sl.session) || (sl.session == "" && t.contSeq == sl.seq) {
			return true
		}
	}
	return false
}

// turnEnded notes, when t leaves sl idle, when its conversation is expected back: at
// the client's word (Request.NextTurn), or later from the learned gaps (nextUse).
func (s *Scheduler) turnEnded(t *task, sl *slot) {
	sl.lastTask, sl.toolTurn, sl.expect = t.id, false, time.Time{}
	if t.req.NextTurn > 0 {
		sl.expect = s.now.Add(t.req.NextTurn)
	}
	if id := t.req.SessionID; id != "" {
		g := s.gaps.sessions[id]
		if g == nil {
			g = &sessionGap{}
			s.gaps.sessions[id] = g
		}
		g.lastEnd, g.tool, g.served = s.now, false, len(sl.tokens)
	}
}

// expectTurn applies message ExpectTurn.
func (s *Scheduler) expectTurn(m ExpectTurn) {
	if m.Seq < 0 || m.Seq >= len(s.slots) {
		return
	}
	sl := s.slots[m.Seq]
	if sl.lastTask != m.Task || sl.task != nil || len(sl.tokens) == 0 {
		return
	}
	sl.toolTurn = true
	if g := s.gaps.sessions[sl.session]; sl.session != "" && g != nil {
		g.tool = true
	}
}

// turnArrived learns the gap a continuing request shows: its session's, or (anonymous)
// the idle sequence it continues.
func (s *Scheduler) turnArrived(t *task) {
	var gap time.Duration
	tool := false
	switch {
	case t.req.SessionID != "":
		g := s.gaps.sessions[t.req.SessionID]
		if g == nil || g.lastEnd.IsZero() {
			return
		}
		gap, tool = s.now.Sub(g.lastEnd), g.tool
		g.avg = ewmaDur(g.avg, gap)
		g.lastEnd = time.Time{}
		g.parked, g.expect, g.fetched = nil, time.Time{}, false // its request reads them now
	case t.contSeq >= 0:
		sl := s.slots[t.contSeq]
		if sl.task != nil {
			return
		}
		gap, tool = s.now.Sub(sl.lastUsed), sl.toolTurn
		if !tool {
			sl.gap = ewmaDur(sl.gap, gap) // the conversation on this sequence
		}
	default:
		return
	}
	if tool {
		s.gaps.tool = ewmaDur(s.gaps.tool, gap)
	} else {
		s.gaps.all = ewmaDur(s.gaps.all, gap)
	}
}

// forgetGaps drops what is known of sessions idle past horizon (the table must not
// grow with every session ever seen).
func (s *Scheduler) forgetGaps(horizon time.Duration) {
	for id, g := range s.gaps.sessions {
		if g.lastEnd.IsZero() {
			if _, ok := s.bySession[id]; ok {
				continue
			}
		}
		if !g.lastEnd.IsZero() && s.now.Sub(g.lastEnd) <= horizon {
			continue
		}
		if sl, ok := s.bySession[id]; ok && (sl.task != nil || s.now.Sub(sl.lastUsed) <= horizon) {
			continue
		}
		delete(s.gaps.sessions, id)
	}
}

// classify notes, when t is submitted, whether it continues a conversation and how
// much service that conversation attained (continuation), for the queue's order and
// the gap model.
func (s *Scheduler) classify(t *task) {
	t.contSeq = -1
	if t.kind != kindGenerate {
		return
	}
	t.cont, t.attained, t.contSeq = s.continuation(t)
	s.turnArrived(t)
}

// queueBefore orders the waiting tasks for admission (admitPass): pool builds first
// (clients and requests wait on them), then requests that waited through agingPasses
// later arrivals (oldest first), then continuations before first turns, the least
// attained service first among continuations (the most among a throttled pool's paced
// turns: pacedPeers), then arrival.
func queueBefore(a, b *task) int {
	if ka, kb := a.kind == kindMaterialize, b.kind == kindMaterialize; ka != kb {
		if ka {
			return -1
		}
		return 1
	}
	if oa, ob := a.passed >= agingPasses, b.passed >= agingPasses; oa != ob {
		if oa {
			return -1
		}
		return 1
	} else if !oa && a.cont != b.cont {
		if a.cont {
			return -1
		}
		return 1
	} else if !oa && a.cont && a.attained != b.attained {
		if pacedPeers(a, b) {
			return cmp.Compare(b.attained, a.attained)
		}
		return cmp.Compare(a.attained, b.attained)
	}
	if c := a.queued.Compare(b.queued); c != 0 {
		return c
	}
	return cmp.Compare(a.id, b.id)
}

// pacedPeers reports whether a and b are both turns the throttle holds for the same
// pool (paced, throttle.go). Among those the conversation furthest along goes first:
// the pool's sessions are served a few at a time there, and least attained service
// would rotate every conversation through them, so that all of them end late, where
// the most attained first ends each conversation (its agent's task) as soon as it can
// while the others wait no longer in all. Aging still bounds every wait.
func pacedPeers(a, b *task) bool {
	return !a.pacedAt.IsZero() && !b.pacedAt.IsZero() && a.pool != nil && a.pool == b.pool
}

// orderQueue sorts the queue by queueBefore (stable: equal tasks keep their order).
func (s *Scheduler) orderQueue() { slices.SortStableFunc(s.queue, queueBefore) }

// passedOver counts, when t is seated, one more pass over every waiting task that came
// before it.
func (s *Scheduler) passedOver(t *task) {
	for _, q := range s.queue {
		if q != t && (q.queued.Before(t.queued) || q.queued.Equal(t.queued) && q.id < t.id) {
			q.passed++
		}
	}
}
