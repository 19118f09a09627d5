package engine

import (
	"slices"
	"time"

	"github.com/polykv/polykv/internal/pool"
)

// usedCells counts physical cells by ownership: each session sequence owns its tokens
// past what it borrows from its pool, each pool owns its materialized [D, L). A shared
// cell is counted once, for its owner.
func (s *Scheduler) usedCells() int {
	n := s.pools.OwnCells()
	for _, sl := range s.slots {
		n += sl.ownCells()
	}
	return n
}

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

// evictable lists idle sessions holding cells of their own, least recently used first.
func (s *Scheduler) evictable(except *slot) []*slot {
	var out []*slot
	for _, sl := range s.slots {
		if sl != except && sl.task == nil && sl.session != "" && len(sl.tokens) > 0 {
			out = append(out, sl)
		}
	}
	slices.SortFunc(out, func(a, b *slot) int { return a.lastUsed.Compare(b.lastUsed) })
	return out
}

// evictablePools lists pools whose cells may be dropped under pressure: resident, not
// pinned (by the user, a child or an attached sequence) and idle past the grace time.
func (s *Scheduler) evictablePools() []*pool.Pool {
	var out []*pool.Pool
	for _, p := range s.pools.All() {
		if p.State == pool.Resident && !p.Pinned() && s.now.Sub(p.LastAccess) >= s.cfg.PoolGrace {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b *pool.Pool) int { return a.LastAccess.Compare(b.LastAccess) })
	return out
}

func (s *Scheduler) evictableCells(except *slot) int {
	n := 0
	for _, sl := range s.evictable(except) {
		n += sl.ownCells()
	}
	for _, p := range s.evictablePools() {
		n += p.OwnCells()
	}
	return n
}

// resetSlot drops everything a sequence holds and detaches it from its pool; the
// session (if any) stays bound to the sequence.
func (s *Scheduler) resetSlot(sl *slot) {
	if len(sl.tokens) > 0 {
		s.ops = append(s.ops, SeqOp{Kind: OpSeqRm, Seq: sl.seq, P0: 0, P1: -1})
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
	if n < len(sl.tokens) {
		s.ops = append(s.ops, SeqOp{Kind: OpSeqRm, Seq: sl.seq, P0: n, P1: -1})
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

// freeCells evicts idle sessions (LRU first, never except), then idle unpinned pools,
// until want cells are free or nothing is left to evict; it returns the free count.
// planned are cells already promised to the batch being built.
func (s *Scheduler) freeCells(want int, except *slot, planned int) int {
	free := s.cfg.NCtx - s.usedCells() - planned
	for _, sl := range s.evictable(except) {
		if free >= want {
			return free
		}
		free += sl.ownCells()
		s.evictSlot(sl)
	}
	for _, p := range s.evictablePools() {
		if free >= want {
			return free
		}
		free += p.OwnCells()
		s.check(s.evictPool(p))
	}
	return free
}

// expire drops idle sessions past the TTL and reclaims released pools nothing uses.
func (s *Scheduler) expire() {
	if s.cfg.SessionTTL > 0 {
		for _, sl := range s.slots {
			if sl.task == nil && sl.session != "" && s.now.Sub(sl.lastUsed) > s.cfg.SessionTTL {
				s.evictSlot(sl)
			}
		}
	}
	s.adm.ForgetSessions(s.now, max(s.cfg.SessionTTL, time.Hour))
	for _, p := range s.pools.All() {
		if p.Reclaimable(s.now, s.cfg.PoolGrace) {
			s.reclaim(p)
		}
	}
}
