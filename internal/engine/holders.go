package engine

import (
	"slices"
	"time"

	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
)

// The scheduler's side of the KV-cache manager (package kvcache): its sequences and
// pools as the manager's Holders, the plan the manager records its operations in, and
// the victims the manager hands back to take.

// victim is a holder the KV-cache manager picked, as the scheduler's own types: an idle
// sequence (sl) or an evictable pool (p).
type victim struct {
	sl *slot      // an idle sequence, or nil
	p  *pool.Pool // an evictable pool, or nil
}

// victimOf is the scheduler's view of a Holder it gave the manager (holders).
func victimOf(h kvcache.Holder) victim {
	switch h := h.(type) {
	case *slot:
		return victim{sl: h}
	case poolHolder:
		return victim{p: h.p}
	}
	panic("engine: a holder the scheduler did not list")
}

// holders lists the manager's candidates for eviction in a fixed order: the session
// sequences, then the pools (the manager picks the victims among them).
func (s *Scheduler) holders() []kvcache.Holder {
	all := s.pools.All()
	out := make([]kvcache.Holder, 0, len(s.slots)+len(all))
	for _, sl := range s.slots {
		out = append(out, sl)
	}
	for _, p := range all {
		out = append(out, poolHolder{p: p, queued: p.AwaitsUse && s.useQueued(p)})
	}
	return out
}

// useQueued reports whether a waiting task would use p: a request attaching to it, or
// the build of a pool forked from it.
func (s *Scheduler) useQueued(p *pool.Pool) bool {
	return slices.ContainsFunc(s.queue, func(t *task) bool { return t.pool != nil && s.usesPool(t) == p })
}

// usesPool is the pool t waits to use: the pool a request attaches to, the parent a
// fork's build shares (nil: none).
func (s *Scheduler) usesPool(t *task) *pool.Pool {
	if t.kind == kindMaterialize {
		return t.pool.Parent
	}
	return t.pool
}

// firstUse reports whether t would be the first use of a pool in its grace (resident,
// not used since it became so, within --pool-grace-ms): what the grace keeps the pool
// for. Such a task goes ahead of a request that waits for cells (admitPass).
func (s *Scheduler) firstUse(t *task) bool {
	p := s.usesPool(t)
	return p != nil && p.State == pool.Resident && s.kv.Graced(s.now, poolHolder{p: p})
}

// exceptSeq is the sequence the manager must not take for a slot that must stay (nil:
// none).
func exceptSeq(sl *slot) int {
	if sl == nil {
		return -1
	}
	return sl.seq
}

// Seq is the slot's sequence id (kvcache.Holder).
func (sl *slot) Seq() int { return sl.seq }

// LastUsed is when a task last ran on it (kvcache.Holder).
func (sl *slot) LastUsed() time.Time { return sl.lastUsed }

// Kind is a session's or a cached anonymous sequence (kvcache.Holder).
func (sl *slot) Kind() kvcache.Kind {
	if sl.session != "" {
		return kvcache.Session
	}
	return kvcache.Cached
}

// Busy: a task runs on it, or it holds nothing (kvcache.Holder).
func (sl *slot) Busy() bool { return sl.task != nil || len(sl.tokens) == 0 }

// Pinned is false: a sequence is never pinned (kvcache.Holder).
func (sl *slot) Pinned() bool { return false }

// Pageable is false: only pools page (kvcache.Holder).
func (sl *slot) Pageable() bool { return false }

// UserPinned is false: only pools are pinned (kvcache.Holder).
func (sl *slot) UserPinned() bool { return false }

// AwaitsUse is false: only a pool has a grace (kvcache.Holder).
func (sl *slot) AwaitsUse() bool { return false }

// UseQueued is false: only a pool has a grace (kvcache.Holder).
func (sl *slot) UseQueued() bool { return false }

// poolHolder is a pool as a kvcache.Holder (pool.Pool's own fields take the names);
// queued: a queued task waits to use it (useQueued).
type poolHolder struct {
	p      *pool.Pool
	queued bool
}

func (h poolHolder) Seq() int            { return h.p.Seq }
func (h poolHolder) LastUsed() time.Time { return h.p.LastAccess }
func (h poolHolder) Kind() kvcache.Kind  { return kvcache.Pool }
func (h poolHolder) Busy() bool          { return h.p.State != pool.Resident }
func (h poolHolder) Pinned() bool        { return h.p.Pinned() }
func (h poolHolder) Pageable() bool      { return h.p.Pageable() }
func (h poolHolder) UserPinned() bool    { return h.p.UserPinned }
func (h poolHolder) AwaitsUse() bool     { return h.p.AwaitsUse }
func (h poolHolder) UseQueued() bool     { return h.queued }

// planOps records the manager's sequence operations in the plan being built
// (Scheduler.ops), in order with the tier's (kvcache.Recorder).
type planOps struct{ ops *[]SeqOp }

// SeqRm plans seq_rm(seq, p0, -1).
func (r planOps) SeqRm(seq, p0 int) {
	*r.ops = append(*r.ops, SeqOp{Kind: OpSeqRm, Seq: seq, P0: p0, P1: -1})
}

// SeqCp plans seq_cp(src, dst, 0, p1).
func (r planOps) SeqCp(src, dst, p1 int) {
	*r.ops = append(*r.ops, SeqOp{Kind: OpSeqCp, Src: src, Seq: dst, P0: 0, P1: p1})
}

// take is the manager's take for MakeRoom and DraftRoom: the victim it picked gives up
// n cells (evictVictim).
func (s *Scheduler) take(h kvcache.Holder, n int) { s.evictVictim(victimOf(h), n) }

// nextUseOf is the manager's Config.NextUse: nextUse of the scheduler's own victim.
func (s *Scheduler) nextUseOf(h kvcache.Holder) time.Time { return s.nextUse(victimOf(h)) }
