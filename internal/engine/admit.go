package engine

import (
	"fmt"
	"slices"

	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
	"github.com/polykv/polykv/internal/tps"
)

// admit moves waiting tasks onto sequences in FIFO order. A task whose cells are not
// available blocks those behind it, so a long prompt is never starved. A pass that
// seats or drops a task starts over: what it did (a pool restored or created without a
// prefill, a session's sequence freed) may have let an earlier waiting task go, and a
// waiting task must be seated in the step its capacity allows it (doc.go, liveness).
func (s *Scheduler) admit() {
	if s.afterAdmit != nil {
		defer s.afterAdmit()
	}
	for s.admitPass() {
	}
}

// admitPass is one pass of admit over the queue; it reports whether it seated or
// dropped a task. Behind the first task that waits for cells (the head) only the first
// use of a pool in its grace may still go (firstUse): it is what the grace keeps that
// pool for, and the head, which cannot take the pool while that use waits (UseQueued),
// would otherwise wait out the grace behind it.
func (s *Scheduler) admitPass() bool {
	moved := false
	s.orderQueue()
	blocked := false // a task ahead waits for cells
	for i := 0; i < len(s.queue); {
		t := s.queue[i]
		if blocked && !s.firstUse(t) {
			t.wait = WaitQueue
			if dep := t.pool; t.kind == kindGenerate && dep != nil && dep.State != pool.Resident {
				t.wait = WaitPool // it could not go even if the head did
			}
			i++
			continue
		}
		if ok, err := s.ready(t); err != nil {
			s.queue = slices.Delete(s.queue, i, i+1)
			s.dropTask(t)
			s.events = append(s.events, Event{Task: t.id, Done: true, Finish: FinishError, Err: err})
			moved = true
			continue
		} else if !ok {
			i++ // waits for its pool (or the pool's parent), or a donor (t.wait says)
			continue
		}
		if s.paced(t) {
			i++ // its pool's sessions would fall under the floor (throttle.go); others may go
			t.wait = WaitFloor
			continue
		}
		sl := s.pickSlot(t)
		if sl == nil {
			i++ // its session is busy, or no sequence is free: later tasks may still fit
			t.wait = WaitSequence
			if _, ok := s.bySession[t.req.SessionID]; ok && t.req.SessionID != "" {
				t.wait = WaitSession
			}
			continue
		}
		pl := s.place(t, sl)
		need, room := s.fit(t, sl, pl, kvcache.GraceHolds, false)
		t.grace = kvcache.GraceHolds
		if room < need {
			// A pool's grace holds it for its first attach while the request can wait
			// for running work to make room. When no running work ever will (an idle
			// server: issue 54), waiting would only wait out the grace time beside a pool
			// the request does not use: the request takes such pools too, after every
			// other victim (paged to the tier, or prefilled again, on their attach), but
			// never one whose first use waits in the queue (UseQueued).
			if _, after := s.fit(t, sl, pl, kvcache.GraceHolds, true); after < need {
				t.grace = kvcache.GraceYields
				need, room = s.fit(t, sl, pl, t.grace, false)
			}
		}
		if room < need {
			if err := s.neverFits(need); err != nil {
				s.unqueue(t, FinishError, err)
				moved = true
				continue
			}
			// Head-of-line: wait for running tasks to end; those behind wait behind it
			// (but a pool's first use).
			t.wait = WaitCells
			blocked = true
			i++
			continue
		}
		s.passedOver(t)
		s.seat(t, sl, pl)
		if s.kv.Room(0) < s.reservedPrefill() {
			// Seated, t is prefilling: reservedPrefill now counts its need too, and fit
			// said eviction can free that much (under t's grace rule).
			s.freeCells(s.reservedPrefill(), nil, 0, t.grace)
		}
		s.queue = slices.Delete(s.queue, i, i+1)
		moved = true
	}
	return moved
}

// fit is what t needs on sl as placed, and the room it has: the cells free now, less
// those promised to prompts already seated (reservedPrefill), plus every cell eviction
// could reclaim for it under grace rule g. That is exactly what seat and freeCells will
// do: sl gives up whatever the placement does not keep, and every victim (idle
// sequences, evictable pools) its cells; what stays is what the placement keeps or
// borrows (sl's own kept prefix, the donor's copied prefix, the pool it attaches to,
// which attaching pins) and whatever a sequence that is not a victim holds. Cells that
// sl shares with other victims count: taking sl and them frees them (counting only what
// sl or the others held alone left such cells out, and a request could wait forever on
// an idle server).
//
// afterRunning asks instead for the room t would have once every running task ended:
// a running request's sequence is then idle (a victim), and so, at most, is the pool it
// borrows (counted though a pin may keep it: erring toward waiting for running work,
// which ends, and is asked again then); a pool being built keeps what it was promised.
// That is whether waiting for running work can make room for t at all.
func (s *Scheduler) fit(t *task, sl *slot, pl placement, g kvcache.GraceRule, afterRunning bool) (need, room int) {
	set := s.kv.VictimSet(s.now, -1, g)
	keepSeq, keepTo := -1, 0
	need = len(t.req.Prompt) - pl.keep - pl.attachP - pl.cpP
	switch {
	case t.kind == kindMaterialize:
		var P int
		P, keepSeq = s.poolDonor(t.pool)
		need, keepTo = t.pool.L()-P, P
	case pl.attachP > 0:
		set.Del(pl.attachTo.Seq)   // attached, the pool stays whole
		set.Del(pl.attachFrom.Seq) // and the one it copies from (itself, or its ancestor)
		set.Add(sl.seq)
	case pl.cpP > 0:
		keepSeq, keepTo = pl.cpFrom, pl.cpP
		set.Add(sl.seq)
	default:
		keepSeq, keepTo = sl.seq, pl.keep
		set.Add(sl.seq)
	}
	reserved := s.reservedPrefill()
	if afterRunning {
		reserved = 0
		for _, r := range s.running {
			if r.kind != kindGenerate {
				if r.prefilling() {
					reserved += len(r.req.Prompt) - len(r.slot.tokens)
				}
				continue
			}
			set.Add(r.slot.seq)
			if b := r.slot.base; b != nil && b != pl.attachTo && b != pl.attachFrom {
				set.Add(b.Seq)
			}
		}
	}
	room = s.kv.Room(reserved) + s.kv.FreedBy(set, keepSeq, keepTo)
	return need, room
}

// ready reports whether a waiting task's pool dependencies are met, and starts
// restoring an evicted pool it needs. A pool released while the task waited fails it.
func (s *Scheduler) ready(t *task) (bool, error) {
	if s.prefixCached(t) && s.awaitsDonor(t) {
		t.wait = WaitPrefix
		return false, nil
	}
	t.wait = WaitPool // until it returns true
	need := t.pool
	if t.kind == kindMaterialize {
		need = t.pool.Parent
	}
	if need == nil {
		return true, nil
	}
	switch need.State {
	case pool.Resident:
		return true, nil
	case pool.Released:
		return false, fmt.Errorf("%w: pool %d was released while the request waited", pool.ErrNotFound, need.ID)
	case pool.Evicted:
		s.restore(need)
	}
	return false, nil
}

// seat puts t on sl as placed.
func (s *Scheduler) seat(t *task, sl *slot, pl placement) {
	if s.cachedSlot(sl.seq) != nil && !(pl.reused && pl.cpP == 0) {
		s.cacheEvictions++ // a cached sequence gives up its sequence id
	}
	s.setStatus(t, statusPrefilling) // a restore or load below moves it on to loading
	if t.kind == kindGenerate && !(sl.session != "" && sl.session == t.req.SessionID) {
		// The sequence id goes to another holder: what it holds beyond what t keeps of it
		// is spilled to the tier first (issue 40), whole unless t takes over a cached
		// sequence's prefix.
		from := 0
		if pl.reused && pl.cpP == 0 {
			from = pl.keep
		}
		s.spillSeq(sl, from, spillKindOf(sl))
		if t.contSeq != sl.seq {
			sl.gap = 0 // another conversation moves onto it
		}
	}
	switch {
	case t.kind == kindMaterialize:
		// A pool (new, forked or restored) starts from whatever sequence holds the
		// longest prefix of it, as a request does: one tree, one mechanism.
		p := t.pool
		sl.shared = p.D
		if s.tierRestore(t) {
			break // the pool's cells come from the tier (Restored), not from a prefill
		}
		have := s.copyPoolPrefix(p)
		sl.tokens = slices.Clone(p.Tokens[:have])
		t.cacheN = have
	case pl.attachP > 0:
		s.resetSlot(sl)
		s.kv.Share(pl.attachFrom.Seq, sl.seq, pl.attachP)
		sl.tokens = slices.Clone(t.req.Prompt[:pl.attachP])
		s.attach(sl, pl.attachTo, pl.attachP)
	case pl.cpP > 0:
		s.resetSlot(sl)
		s.kv.Share(pl.cpFrom, sl.seq, pl.cpP)
		sl.tokens = slices.Clone(t.req.Prompt[:pl.cpP])
		s.poolsUsed(sl.seq, pl.cpP)
	case pl.reused, sl.session != "" && sl.session == t.req.SessionID:
		s.truncate(sl, pl.keep)
		if pl.reused {
			s.poolsUsed(sl.seq, pl.keep)
		}
	default:
		s.resetSlot(sl)
	}
	if t.kind == kindGenerate {
		s.bind(sl, t.req.SessionID)
		s.samplers = append(s.samplers, SamplerOp{Task: t.id, Params: t.req.Sampling, Logprobs: t.req.Logprobs, History: t.req.Prompt})
		t.cacheN = len(sl.tokens)
		if pl.reused {
			s.cacheHits += int64(t.cacheN)
		}
		t.ewma = tps.NewEWMA(s.cfg.TPSTau)
		t.spec = s.newSpecSession()
		t.shadow = tps.NewEWMA(s.cfg.TPSTau)
		s.adm.SessionSeated(t.req.SessionID, s.now)
	}
	sl.task = t
	sl.lastUsed = s.now
	t.slot = sl
	t.admitted = s.now
	s.running = append(s.running, t)
	s.progressAt = s.now
	if t.kind == kindGenerate {
		if !s.lookUp(t, sl) {
			s.planLoad(t, sl)
		}
		s.startSettle(t)
	} else if !t.prefilling() {
		s.poolMaterialized(t) // all of it was resident: nothing to prefill
	}
}
