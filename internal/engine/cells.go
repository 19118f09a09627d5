package engine

// The scheduler's side of the cells: what happens to a sequence, a session or a pool
// when its cells go (the KV-cache manager, package kvcache, owns the cells themselves).

import (
	"time"

	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
)

// reservedPrefill counts cells promised to prompts already admitted but not prefilled,
// so a new admission can never strand two half-prefilled prompts (a deadlock).
func (s *Scheduler) reservedPrefill() int {
	n := 0
	for _, t := range s.running {
		if t.prefilling() {
			n += len(t.req.Prompt) - len(t.slot.tokens)
		}
	}
	return n
}

// resetSlot drops everything a sequence holds and detaches it from its pool; the
// session (if any) stays bound to the sequence.
func (s *Scheduler) resetSlot(sl *slot) {
	if len(sl.tokens) > 0 {
		s.kv.Free(sl.seq, 0)
	}
	sl.tokens = nil
	s.detach(sl)
}

// evictSlot drops a slot's session and its KV.
func (s *Scheduler) evictSlot(sl *slot) {
	s.resetSlot(sl)
	s.bind(sl, "")
}

// bind makes sl the sequence of session ("" = none). The previous session's entry goes
// with it: the table must only name sequences that hold that session's tokens, or a
// later request of the displaced session would wait on (and wipe) another session's
// sequence, and the table would grow forever.
func (s *Scheduler) bind(sl *slot, session string) {
	if sl.session == session {
		return
	}
	if sl.session != "" && s.bySession[sl.session] == sl {
		delete(s.bySession, sl.session)
	}
	sl.session = session
	if session != "" {
		s.bySession[session] = sl
	}
}

// truncate keeps [0, n) of a sequence; borrowed cells beyond n stop being borrowed.
func (s *Scheduler) truncate(sl *slot, n int) {
	if s.cfg.Recurrent && n < len(sl.tokens) {
		n = 0 // recurrent state cannot be cut back: the sequence goes whole
	}
	if n < len(sl.tokens) {
		s.kv.Free(sl.seq, n)
		sl.tokens = sl.tokens[:n]
	}
	if sl.shared > n {
		sl.shared = n
	}
	if sl.shared == 0 {
		s.detach(sl)
	}
}

func (s *Scheduler) attach(sl *slot, p *pool.Pool, shared int) {
	s.detach(sl)
	sl.base = p
	sl.shared = shared
	p.Attach(s.now)
}

func (s *Scheduler) detach(sl *slot) {
	if p := sl.base; p != nil {
		s.check(p.Detach(s.now))
	}
	sl.base = nil
	sl.shared = 0
}

// freeCells makes room until want cells are free or nothing is left to evict, and
// returns the free count: the KV-cache manager picks the victims (kvcache.MakeRoom),
// evictVictim takes each. planned are cells already promised to the batch being
// built; except is never taken; g says whether pools in their grace may go (last).
func (s *Scheduler) freeCells(want int, except *slot, planned int, g kvcache.GraceRule) int {
	return s.kv.MakeRoom(s.now, want, exceptSeq(except), planned, g, s.take)
}

// evictVictim takes n cells from a victim's tail (a pool: all of its own). With the
// tier (issue 40) what is taken is spilled first: a sequence's cells from where it is
// cut on, a pool's own cells (a user-pinned pool is paged, never lost).
func (s *Scheduler) evictVictim(v victim, n int) {
	if v.p != nil {
		s.poolEvictions++
		if s.cfg.Tier {
			s.check(s.pagePool(v.p))
		} else {
			s.check(s.evictPool(v.p))
		}
		return
	}
	sl := v.sl
	if sl.session == "" {
		s.cacheEvictions++
	} else {
		s.sessionEvictions++
	}
	keep := len(sl.tokens) - n
	if s.cfg.Recurrent {
		keep = 0 // recurrent state cannot be cut back: truncate drops the sequence whole
	}
	s.spillSeq(sl, keep, spillKindOf(sl))
	s.truncate(sl, keep)
	if len(sl.tokens) == 0 {
		s.evictSlot(sl) // nothing left: a session is forgotten, as by its TTL
	}
}

// expire drops idle sessions past the TTL and reclaims released pools nothing uses.
func (s *Scheduler) expire() {
	if s.cfg.SessionTTL > 0 {
		for _, sl := range s.slots {
			// Cached anonymous sequences expire as idle sessions do.
			if sl.task == nil && (sl.session != "" || len(sl.tokens) > 0) && s.now.Sub(sl.lastUsed) > s.cfg.SessionTTL {
				if sl.session == "" {
					s.cacheEvictions++
				}
				s.evictSlot(sl)
			}
		}
	}
	s.adm.ForgetSessions(s.now, max(s.cfg.SessionTTL, time.Hour))
	s.forgetGaps(max(s.cfg.SessionTTL, time.Hour))
	for _, p := range s.pools.All() {
		if p.Reclaimable(s.now, s.cfg.PoolGrace) {
			s.reclaim(p)
		}
	}
}
