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

// victim is one holder of cells that eviction may take (issue 12: one least recently
// used order over the unreferenced leaves of the cell tree, whatever their kind): an
// idle sequence, a finished anonymous one kept as cache or an idle session, which loses
// the cells only it holds from its tail, token by token (its prefix stays reusable as
// long as possible: a session's next turn and a cached sequence's next borrower reuse
// whatever prefix is left), or an unpinned pool, which loses its own cells whole (a
// pool is immutable: it is resident or evicted, never half).
type victim struct {
	sl   *slot      // an idle sequence, or nil
	p    *pool.Pool // an evictable pool, or nil
	used time.Time
}

func (v victim) seq() int {
	if v.sl != nil {
		return v.sl.seq
	}
	return v.p.Seq
}

// rank orders kinds only between victims last used at the same instant: the one no
// client named (a cached anonymous sequence) first, then an idle session, then a pool.
// Otherwise there is no tiering by kind. The workloads (agent frameworks with a
// plain OpenAI client) send no session id: their anonymous sequences are conversations
// that continue exactly as sessions do, so an idle session does not deserve to outlive
// a more recently used anonymous one; recency is the one signal every kind has. What a
// session keeps is bounded by --session-ttl, and losing its tail costs its next turn
// only the re-prefill of that tail.
func (v victim) rank() int {
	switch {
	case v.p != nil:
		return 2
	case v.sl.session != "":
		return 1
	}
	return 0
}

// victims lists what eviction may take, least recently used first: idle sequences
// holding cells (but except) and evictable pools. Never a running task's sequence
// (and so never cells a running request borrows: the cell tree keeps a cell while any
// sequence holds it), never a pinned pool, a pool with children (released ones too:
// their [0, D) lives in its cells) or attached sessions (Pinned covers both), and
// never a pool within --pool-grace of its last use (a pool just created or restored
// must survive until the attach it was made for).
func (s *Scheduler) victims(except *slot) []victim {
	var out []victim
	for _, sl := range s.slots {
		if sl != except && sl.task == nil && len(sl.tokens) > 0 {
			out = append(out, victim{sl: sl, used: sl.lastUsed})
		}
	}
	for _, p := range s.pools.All() {
		if p.State == pool.Resident && !p.Pinned() && s.now.Sub(p.LastAccess) >= s.cfg.PoolGrace {
			out = append(out, victim{p: p, used: p.LastAccess})
		}
	}
	slices.SortStableFunc(out, func(a, b victim) int {
		if c := a.used.Compare(b.used); c != 0 {
			return c
		}
		return a.rank() - b.rank()
	})
	return out
}

// evictableCells counts the cells that evicting every victim but except would free:
// cells some other (running) sequence shares stay.
func (s *Scheduler) evictableCells(except *slot) int {
	return s.cells.Freed(s.victimSet(except), -1, 0)
}

func (s *Scheduler) victimSet(except *slot) seqSet {
	var set seqSet
	for _, v := range s.victims(except) {
		set.add(v.seq())
	}
	return set
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
	if s.cfg.Recurrent && n < len(sl.tokens) {
		n = 0 // recurrent state cannot be cut back: the sequence goes whole
	}
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
// returns the free count. It takes leaves of the cell tree in one least recently used
// order (victims): each victim in turn gives up the cells only it holds (a sequence
// from its tail, as many as are still wanted; a pool its own run, whole). A victim
// whose cells others share is passed over: it is not a leaf; the sharer's turn comes.
// When a whole pass frees nothing but cells are still wanted, the cells left are shared
// only among victims (a cached sequence that borrowed an idle pool's prefix): the least
// recently used victim that holds such cells goes whole, and the passes go on. planned
// are cells already promised to the batch being built; except is never taken.
func (s *Scheduler) freeCells(want int, except *slot, planned int) int {
	free := func() int { return s.cfg.NCtx - s.usedCells() - planned }
	for free() < want {
		vs := s.victims(except)
		progress := false
		for _, v := range vs {
			if free() >= want {
				break
			}
			if x := s.cells.Exclusive(v.seq(), 0); x > 0 {
				s.evictVictim(v, min(x, want-free()))
				progress = true
			}
		}
		if progress || free() >= want {
			continue
		}
		set := s.victimSet(except)
		i := slices.IndexFunc(vs, func(v victim) bool { return s.cells.Joint(v.seq(), set) > 0 })
		if i < 0 {
			break // nothing left that eviction could free
		}
		s.evictVictim(vs[i], len(s.cells.tokens(vs[i].seq())))
	}
	return free()
}

// evictVictim takes n cells from a victim's tail (a pool: all of its own).
func (s *Scheduler) evictVictim(v victim, n int) {
	if v.p != nil {
		s.poolEvictions++
		s.check(s.evictPool(v.p))
		return
	}
	sl := v.sl
	if sl.session == "" {
		s.cacheEvictions++
	} else {
		s.sessionEvictions++
	}
	s.truncate(sl, len(sl.tokens)-n)
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
	for _, p := range s.pools.All() {
		if p.Reclaimable(s.now, s.cfg.PoolGrace) {
			s.reclaim(p)
		}
	}
}
