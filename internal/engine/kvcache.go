package engine

import (
	"slices"
	"time"

	"github.com/polykv/polykv/internal/pool"
)

// kvCache is the KV-cache manager (issue 28), the one owner of the cache's cells, as
// vLLM's KVCacheManager is: it mirrors which sequences hold which cells (cellTree),
// records every change it makes to them as the plan's sequence operations, finds the
// longest cached prefix of a prompt, and lists and takes victims when cells run out.
// The scheduler plans (which task sits on which sequence, how many cells a step needs)
// and asks; it never changes the cell tree itself. What a holder is (a session, a
// cached sequence, a pool) stays the scheduler's: the manager reads the sequences and
// pools to order victims, and hands each victim back to the scheduler to take
// (makeRoom's take), since taking a session's or a pool's cells changes its lifecycle.
//
// Its API is small: allocate, free, share (the three changes), longest/longestFrom
// (the prefix lookup), victims, evictable, makeRoom and draftRoom (eviction: the only
// two loops that take cells, the second a bounded pass for speculative drafts), and
// the counts
// (used, room, owned, freedBy). The cell tree changes only through it (Append, Rm and
// Cp are called here alone); readers that only look (the pool tree's ownership, the
// residency reports, poolsUsed) read kv.cells directly.
type kvCache struct {
	nCtx  int
	cells *cellTree
	// plan is the sequence operations of the plan being built (Scheduler.ops): the
	// manager's removals and copies are recorded there in order with the tier's.
	plan  *[]SeqOp
	slots []*slot    // the scheduler's session sequences (victims)
	pools *pool.Tree // the scheduler's pools (victims)
	grace time.Duration
	// pinPaging: a tier keeps what is evicted (Config.Tier), so user-pinned pools and
	// pools whose children hold no cells are victims too (pool.Page), after the rest.
	pinPaging bool
	// nextUse is the scheduler's estimate of when a victim is needed again (order.go);
	// victims go in order of it, the one expected last first. nil: least recently used.
	nextUse func(v victim) time.Time
}

// used counts the physical cells in use: every run of shared cells once, however many
// sequences hold it (the cell tree mirrors the cache).
func (kv *kvCache) used() int { return kv.cells.total }

// room is what is free once planned cells (promised to the batch being built) are
// counted.
func (kv *kvCache) room(planned int) int { return kv.nCtx - kv.used() - planned }

// owned is the cells attributed to a sequence by ownership (cellTree): a session's
// suffix past what it borrows, a pool's [D, L). Σ over every sequence == used.
func (kv *kvCache) owned(seq int) int { return kv.cells.Owned(seq) }

// allocate records that seq now holds toks at its next positions: cells a decode
// step, a loaded slot or a tier restore wrote (the cache allocates them as it writes,
// so the manager only counts them; the scheduler made room first).
func (kv *kvCache) allocate(seq int, toks []Token) { kv.cells.Append(seq, toks) }

// free plans seq_rm(seq, p0, -1) and takes seq out of those cells.
func (kv *kvCache) free(seq, p0 int) {
	*kv.plan = append(*kv.plan, SeqOp{Kind: OpSeqRm, Seq: seq, P0: p0, P1: -1})
	kv.cells.Rm(seq, p0)
}

// share plans seq_cp(src, dst, 0, p1): dst (empty) shares src's first p1 cells.
func (kv *kvCache) share(src, dst, p1 int) {
	*kv.plan = append(*kv.plan, SeqOp{Kind: OpSeqCp, Src: src, Seq: dst, P0: 0, P1: p1})
	kv.cells.Cp(src, dst, p1)
}

// shared records that dst (empty) now shares src's first p1 cells, a seq_cp the driver
// already performed itself (a recurrent pool's tier restore shares the parent's cells
// before loading the pool's own state: a planned seq_cp after the load would replace
// that state by the parent's), so nothing is planned.
func (kv *kvCache) shared(src, dst, p1 int) { kv.cells.Cp(src, dst, p1) }

// longest is the longest prefix of prompt (at most limit tokens) some sequence holds,
// and the cell-tree node where it ends (its holders can seq_cp it).
func (kv *kvCache) longest(prompt []Token, limit int) (int, *cellNode) {
	return kv.cells.Longest(prompt, limit)
}

// longestFrom is longest among the sequences that share seq's cells [0, at): a fork
// that must keep its parent's prefix.
func (kv *kvCache) longestFrom(seq, at int, prompt []Token, limit int) (int, *cellNode) {
	return kv.cells.LongestFrom(seq, at, prompt, limit)
}

// freedBy counts the cells that removing every sequence of set would free, but for
// keep's [0, keepTo) (keep -1: nothing kept): cells another sequence holds stay.
func (kv *kvCache) freedBy(set seqSet, keep, keepTo int) int {
	return kv.cells.Freed(set, keep, keepTo)
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
	next time.Time // when it is expected to be needed again (kvCache.nextUse)
}

// pinned: a user-pinned pool, paged only after every other victim.
func (v victim) pinned() bool { return v.p != nil && v.p.UserPinned }

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

// victims lists what eviction may take at now, the one expected to be needed last first
// (nextUse; least recently used without it): idle sequences holding cells (but except)
// and evictable pools. Never a running task's sequence (and so never cells a running
// request borrows: the cell tree keeps a cell while any sequence holds it), never a pool
// with attached sessions, and never a pool within --pool-grace of its last use (a pool
// just created or restored must survive until the attach it was made for). Without a
// tier, never a user-pinned pool or one with children (released ones too: their [0, D)
// lives in its cells); with one (pinPaging), such a pool is paged once its children hold
// no cells, user-pinned ones after everything else.
func (kv *kvCache) victims(now time.Time, except *slot) []victim {
	var out []victim
	for _, sl := range kv.slots {
		if sl != except && sl.task == nil && len(sl.tokens) > 0 {
			out = append(out, victim{sl: sl, used: sl.lastUsed})
		}
	}
	for _, p := range kv.pools.All() {
		if p.State != pool.Resident || now.Sub(p.LastAccess) < kv.grace {
			continue
		}
		if (kv.pinPaging && p.Pageable()) || !p.Pinned() {
			out = append(out, victim{p: p, used: p.LastAccess})
		}
	}
	for i := range out {
		if kv.nextUse != nil {
			out[i].next = kv.nextUse(out[i])
		} else {
			out[i].next = out[i].used
		}
	}
	slices.SortStableFunc(out, func(a, b victim) int {
		if pa, pb := a.pinned(), b.pinned(); pa != pb {
			if pa {
				return 1
			}
			return -1
		}
		if kv.nextUse != nil {
			if c := b.next.Compare(a.next); c != 0 {
				return c // expected last, evicted first
			}
		} else if c := a.used.Compare(b.used); c != 0 {
			return c
		}
		return a.rank() - b.rank()
	})
	return out
}

// evictable counts the cells that evicting every victim but except would free: cells
// some other (running) sequence shares stay.
func (kv *kvCache) evictable(now time.Time, except *slot) int {
	return kv.cells.Freed(kv.victimSet(now, except), -1, 0)
}

// victimSet is the sequences of victims(now, except).
func (kv *kvCache) victimSet(now time.Time, except *slot) seqSet {
	var set seqSet
	for _, v := range kv.victims(now, except) {
		set.add(v.seq())
	}
	return set
}

// makeRoom frees cells until want are free or nothing is left to evict, and returns
// the free count. It takes leaves of the cell tree in one least recently used order
// (victims): each victim in turn gives up the cells only it holds (a sequence from its
// tail, as many as are still wanted; a pool its own run, whole). A victim whose cells
// others share is passed over: it is not a leaf; the sharer's turn comes. When a whole
// pass frees nothing but cells are still wanted, the cells left are shared only among
// victims (a cached sequence that borrowed an idle pool's prefix): the least recently
// used victim that holds such cells goes whole, and the passes go on. planned are
// cells already promised to the batch being built; except is never taken. take(v, n)
// is the scheduler's: v gives up n cells from its tail (a pool: all of its own), which
// it removes through free.
func (kv *kvCache) makeRoom(now time.Time, want int, except *slot, planned int, take func(v victim, n int)) int {
	for kv.room(planned) < want {
		vs := kv.victims(now, except)
		progress := false
		for _, v := range vs {
			if kv.room(planned) >= want {
				break
			}
			if x := kv.cells.Exclusive(v.seq(), 0); x > 0 {
				take(v, min(x, want-kv.room(planned)))
				progress = true
			}
		}
		if progress || kv.room(planned) >= want {
			continue
		}
		set := kv.victimSet(now, except)
		i := slices.IndexFunc(vs, func(v victim) bool { return kv.cells.Joint(v.seq(), set) > 0 })
		if i < 0 {
			break // nothing left that eviction could free
		}
		take(vs[i], len(kv.cells.tokens(vs[i].seq())))
	}
	return kv.room(planned)
}

// draftRoom frees up to n cells for speculative drafts when too few are free, and
// returns the cells freed: one pass over the victims in makeRoom's order, taking from
// the tails of idle sequences (cached anonymous ones, idle sessions) what only they
// hold, as a decode token does when the cache is full, but never a pool, which goes
// whole. take is makeRoom's. Without it a server whose cache had filled (its steady
// state under varied traffic: cached sequences and idle sessions keep their cells
// until they are wanted) never drafted again. It costs little: a draft's cells come
// back after its step (rejected ones are removed; accepted ones are tokens the session
// would have decoded, which evict as decode tokens do), so the drafts of a session
// take a window of cells once, not new ones every step; a session that loses tail
// tokens to it prefills them again on its next turn.
func (kv *kvCache) draftRoom(now time.Time, n int, take func(v victim, n int)) int {
	before := kv.room(0)
	for _, v := range kv.victims(now, nil) {
		left := n - (kv.room(0) - before)
		if left <= 0 {
			break
		}
		if v.sl == nil {
			continue
		}
		if x := kv.cells.Exclusive(v.sl.seq, 0); x > 0 {
			take(v, min(x, left))
		}
	}
	return kv.room(0) - before
}

// discard plans seq_rm(seq, p0, -1) of cells the last step wrote that the cell tree
// never held: rejected speculative drafts (only the backend's cache holds them).
func (kv *kvCache) discard(seq, p0 int) {
	*kv.plan = append(*kv.plan, SeqOp{Kind: OpSeqRm, Seq: seq, P0: p0, P1: -1})
}
