package engine

import (
	"slices"
	"time"

	"github.com/polykv/polykv/internal/pool"
)

// usedCells counts the physical cells in use: every run of shared cells once, however
// many sequences hold it (the cell tree mirrors the cache).
func (s *Scheduler) usedCells() int { return s.cells.total }

// own is the cells attributed to a sequence by ownership (cellTree): a session's
// suffix past what it borrows, a pool's [D, L). Σ over every sequence == usedCells.
func (s *Scheduler) own(sl *slot) int { return s.cells.Owned(sl.seq) }

// poolOwn is a pool's own cells by the same attribution.
func (s *Scheduler) poolOwn(p *pool.Pool) int { return p.OwnCells() }

// rmOp plans seq_rm(seq, p0, -1) and takes seq out of those cells in the cell tree.
func (s *Scheduler) rmOp(seq, p0 int) {
	s.ops = append(s.ops, SeqOp{Kind: OpSeqRm, Seq: seq, P0: p0, P1: -1})
	s.cells.Rm(seq, p0)
}

// cpOp plans seq_cp(src, dst, 0, p1): dst (empty) shares src's first p1 cells.
func (s *Scheduler) cpOp(src, dst, p1 int) {
	s.ops = append(s.ops, SeqOp{Kind: OpSeqCp, Src: src, Seq: dst, P0: 0, P1: p1})
	s.cells.Cp(src, dst, p1)
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

// evictable lists idle sequences holding cells, in the order they go under pressure:
// finished anonymous sequences kept as cache first, then idle sessions, each least
// recently used first.
func (s *Scheduler) evictable(except *slot) []*slot {
	var out []*slot
	for _, sl := range s.slots {
		if sl != except && sl.task == nil && len(sl.tokens) > 0 {
			out = append(out, sl)
		}
	}
	slices.SortStableFunc(out, func(a, b *slot) int {
		if ca, cb := a.session == "", b.session == ""; ca != cb {
			if ca {
				return -1
			}
			return 1
		}
		return a.lastUsed.Compare(b.lastUsed)
	})
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

// evictableCells counts the cells that evicting every idle sequence but except, and
// every evictable pool, would free: cells some other (running) sequence shares stay.
// keep's cells below keepTo are not counted (a placement is about to copy them).
func (s *Scheduler) evictableCells(except *slot) int { return s.evictableCellsKeeping(except, -1, 0) }

func (s *Scheduler) evictableCellsKeeping(except *slot, keep, keepTo int) int {
	var set seqSet
	for _, sl := range s.evictable(except) {
		set.add(sl.seq)
	}
	for _, p := range s.evictablePools() {
		set.add(p.Seq)
	}
	return s.cells.Freed(set, keep, keepTo)
}

// resetSlot drops everything a sequence holds and detaches it from its pool; the
// session (if any) stays bound to the sequence.
func (s *Scheduler) resetSlot(sl *slot) {
	if len(sl.tokens) > 0 {
		s.rmOp(sl.seq, 0)
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
		s.rmOp(sl.seq, n)
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
// returns the free count: cached anonymous sequences lose their least recently used
// unshared tail first (token by token: their prefixes stay as cache as long as
// possible), then idle sessions go whole (LRU first, never except), then idle unpinned
// pools. planned are cells already promised to the batch being built.
func (s *Scheduler) freeCells(want int, except *slot, planned int) int {
	free := func() int { return s.cfg.NCtx - s.usedCells() - planned }
	for _, sl := range s.evictable(except) {
		if free() >= want {
			return free()
		}
		if sl.session == "" {
			if x := s.cells.Exclusive(sl.seq, 0); x > 0 {
				n := min(x, want-free())
				s.truncate(sl, len(sl.tokens)-n)
				if len(sl.tokens) == 0 {
					s.resetSlot(sl)
				}
				s.cacheEvictions++
			}
			continue
		}
		s.evictSlot(sl)
	}
	for _, p := range s.evictablePools() {
		if free() >= want {
			return free()
		}
		s.check(s.evictPool(p))
	}
	return free()
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
	for _, p := range s.pools.All() {
		if p.Reclaimable(s.now, s.cfg.PoolGrace) {
			s.reclaim(p)
		}
	}
}
