// Package kvcache is the KV-cache manager (issue 28) and its model of the cache, the
// cell tree (issue 12): the one owner of the unified KV cache's cells and the only
// place that evicts. The scheduler (package engine) plans which task sits on which
// sequence and how many cells a step needs; it asks the Manager to allocate, free and
// share cells, to find the longest cached prefix of a prompt, and to make room, and the
// Manager records each change as a sequence operation of the plan being built
// (Recorder). What a holder of cells is (a session, a cached sequence, a pool) stays
// the scheduler's: the Manager sees each through the small Holder interface, orders
// the victims, and hands each one it picks back to the scheduler to take, since taking
// a session's or a pool's cells changes its lifecycle.
package kvcache

import (
	"slices"
	"time"
)

// Token is a vocabulary id (the engine's and the pool tree's Token).
type Token = int32

// MaxSeqs is the largest n_seq_max llama.cpp accepts: sequence ids are below it.
const MaxSeqs = 256

// Kind is what a holder of cells is. Between victims last used at the same instant the
// lower kind goes first (Manager.Victims).
type Kind int

const (
	// Cached is a finished anonymous sequence kept as cache (no client named it).
	Cached Kind = iota
	// Session is a session's sequence.
	Session
	// Pool is a prefix pool's sequence: it loses its own cells whole, never a tail.
	Pool
)

// Holder is one holder of cells eviction may take, as the scheduler knows it: an idle
// sequence (a cached anonymous one or a session), which loses the cells only it holds
// from its tail, token by token, or a pool, which loses its own cells whole (a pool is
// immutable: resident or evicted, never half).
type Holder interface {
	// Seq is the holder's sequence id.
	Seq() int
	// LastUsed is when it was last used (a pool: last accessed).
	LastUsed() time.Time
	// Kind is what it is.
	Kind() Kind
	// Busy reports that it cannot be taken at all now: a sequence a task runs on or
	// that holds nothing, a pool that is not resident.
	Busy() bool
	// Pinned reports that, without a tier to page to, it is never taken (a pool that
	// is user-pinned, has attached sessions or children).
	Pinned() bool
	// Pageable reports that with a tier it may be paged out all the same (a pool
	// whose children hold no cells).
	Pageable() bool
	// UserPinned reports a user-pinned pool: paged only after every other victim.
	UserPinned() bool
	// AwaitsUse reports a pool that became resident (created, forked or restored) and
	// was not used since: within Config.Grace of that it is in its grace (GraceRule).
	AwaitsUse() bool
	// UseQueued reports a pool whose first use (an attach, a fork) waits in the queue:
	// in its grace, it is then never a victim, not even under GraceYields (the
	// scheduler lets that use go first: a pool restored for a request and taken by
	// another's restore before the request attached would be restored again, and two
	// such restores would page each other's pools forever).
	UseQueued() bool
}

// GraceRule says whether eviction may take the pools in their grace: those that await
// their first use since they became resident (Holder.AwaitsUse), within Config.Grace.
// The grace exists so that a pool just made survives until the attach it was made for;
// it must not hold back a request that nothing running will ever make room for (on an
// idle server it would wait out the grace time beside a pool it does not use, issue 54).
// The caller decides which applies: it knows what is running.
type GraceRule int

const (
	// GraceHolds: pools in their grace are not victims. For a caller that running work
	// will make room for: it waits for that work, and the pool for its attach.
	GraceHolds GraceRule = iota
	// GraceYields: pools in their grace are victims too, after every other one. For a
	// caller that no running work will make room for: waiting would only wait out the
	// grace time, and a pool taken is paged to the tier (or prefilled again) when its
	// attach comes.
	GraceYields
)

// Recorder receives the sequence operations the Manager plans, in the order it plans
// them (the scheduler appends them to the plan being built, among the tier's).
type Recorder interface {
	// SeqRm plans seq_rm(seq, p0, -1).
	SeqRm(seq, p0 int)
	// SeqCp plans seq_cp(src, dst, 0, p1).
	SeqCp(src, dst, p1 int)
}

// Config is what a Manager is built with.
type Config struct {
	// NCtx is the cache's size in cells.
	NCtx int
	// FirstPool: sequence ids >= FirstPool are pools' (NewTree).
	FirstPool int
	// Grace: a pool that awaits its first use since it became resident (created, forked
	// or restored: Holder.AwaitsUse), and was last used within Grace, is in its grace:
	// a victim only under GraceYields, and then last. Once used, a pool is an ordinary
	// victim in eviction's order.
	Grace time.Duration
	// PinPaging: a tier keeps what is evicted, so user-pinned pools and pools whose
	// children hold no cells are victims too (Holder.Pageable), after the rest.
	PinPaging bool
	// Plan receives the removals and copies the Manager plans.
	Plan Recorder
	// Holders lists every holder of cells eviction might take, in a stable order (the
	// scheduler's sequences, then its pools); the Manager filters them (Victims).
	Holders func() []Holder
	// NextUse is the scheduler's estimate of when a holder is needed again; victims
	// go in order of it, the one expected last first. nil: least recently used.
	NextUse func(h Holder) time.Time
	// BelowChunk, BelowLimit size the index of what lives below the cells (below.go:
	// the tier's segments); BelowChunk 0: there is no tier, and no index.
	BelowChunk, BelowLimit int
}

// Manager is the KV-cache manager, the one owner of the cache's cells, as vLLM's
// KVCacheManager is: it mirrors which sequences hold which cells (Tree), records every
// change it makes to them as the plan's sequence operations, finds the longest cached
// prefix of a prompt, and lists and takes victims when cells run out.
//
// Its API is small: Allocate, Free, Share (the three changes; Shared and Discard are
// the two halves of a change done elsewhere), Longest/LongestFrom (the prefix lookup),
// Victims, Evictable, MakeRoom and DraftRoom (eviction: the only two loops that take
// cells, the second a bounded pass for speculative drafts), and the counts (Used, Room,
// Owned, FreedBy). The cell tree changes only through it; readers that only look (the
// pool tree's ownership, the residency reports) read Cells.
type Manager struct {
	cfg   Config
	cells *Tree
	// below is the index of the KV below the cells (nil: no tier).
	below *Below
}

// New returns a manager of an empty cache.
func New(cfg Config) *Manager {
	kv := &Manager{cfg: cfg, cells: NewTree(cfg.FirstPool)}
	if cfg.BelowChunk > 0 {
		kv.below = NewBelow(cfg.BelowChunk, cfg.BelowLimit)
	}
	return kv
}

// Cells is the cell tree, to read.
func (kv *Manager) Cells() *Tree { return kv.cells }

// PinPaging reports Config.PinPaging.
func (kv *Manager) PinPaging() bool { return kv.cfg.PinPaging }

// Used counts the physical cells in use: every run of shared cells once, however many
// sequences hold it (the cell tree mirrors the cache).
func (kv *Manager) Used() int { return kv.cells.total }

// Room is what is free once planned cells (promised to the batch being built) are
// counted.
func (kv *Manager) Room(planned int) int { return kv.cfg.NCtx - kv.Used() - planned }

// Owned is the cells attributed to a sequence by ownership (Tree): a session's
// suffix past what it borrows, a pool's [D, L). Σ over every sequence == used.
func (kv *Manager) Owned(seq int) int { return kv.cells.Owned(seq) }

// Allocate records that seq now holds toks at its next positions: cells a decode
// step, a loaded slot or a tier restore wrote (the cache allocates them as it writes,
// so the manager only counts them; the scheduler made room first).
func (kv *Manager) Allocate(seq int, toks []Token) { kv.cells.write(seq, toks) }

// Free plans seq_rm(seq, p0, -1) and takes seq out of those cells.
func (kv *Manager) Free(seq, p0 int) {
	kv.cfg.Plan.SeqRm(seq, p0)
	kv.cells.remove(seq, p0)
}

// Share plans seq_cp(src, dst, 0, p1): dst (empty) shares src's first p1 cells.
func (kv *Manager) Share(src, dst, p1 int) {
	kv.cfg.Plan.SeqCp(src, dst, p1)
	kv.cells.share(src, dst, p1)
}

// Shared records that dst (empty) now shares src's first p1 cells, a seq_cp the driver
// already performed itself (a recurrent pool's tier restore shares the parent's cells
// before loading the pool's own state: a planned seq_cp after the load would replace
// that state by the parent's), so nothing is planned.
func (kv *Manager) Shared(src, dst, p1 int) { kv.cells.share(src, dst, p1) }

// Longest is the longest prefix of prompt (at most limit tokens) some sequence holds,
// and the cell-tree node where it ends (its holders can seq_cp it).
func (kv *Manager) Longest(prompt []Token, limit int) (int, *Node) {
	return kv.cells.Longest(prompt, limit)
}

// LongestFrom is Longest among the sequences that share seq's cells [0, at): a fork
// that must keep its parent's prefix.
func (kv *Manager) LongestFrom(seq, at int, prompt []Token, limit int) (int, *Node) {
	return kv.cells.LongestFrom(seq, at, prompt, limit)
}

// FreedBy counts the cells that removing every sequence of set would free, but for
// keep's [0, keepTo) (keep -1: nothing kept): cells another sequence holds stay.
func (kv *Manager) FreedBy(set SeqSet, keep, keepTo int) int {
	return kv.cells.Freed(set, keep, keepTo)
}

// victim is a Holder eviction may take now, with when it is expected to be needed.
type victim struct {
	h      Holder
	used   time.Time
	next   time.Time // when it is expected to be needed again (Config.NextUse)
	graced bool      // a pool in its grace (GraceYields)
}

// pinned: a user-pinned pool, paged only after every other victim.
func (v victim) pinned() bool { return v.h.UserPinned() }

// last orders the victims that go after the rest: 0 for most, 1 for a user-pinned
// pool, 2 for a pool in its grace (GraceYields only), which a request takes only when
// nothing else would do (its attach is likely on its way).
func (v victim) last() int {
	switch {
	case v.graced:
		return 2
	case v.pinned():
		return 1
	}
	return 0
}

// rank orders kinds only between victims last used at the same instant: the one no
// client named (a cached anonymous sequence) first, then an idle session, then a pool.
// Otherwise there is no tiering by kind. The workloads (agent frameworks with a
// plain OpenAI client) send no session id: their anonymous sequences are conversations
// that continue exactly as sessions do, so an idle session does not deserve to outlive
// a more recently used anonymous one; recency is the one signal every kind has. What a
// session keeps is bounded by --session-ttl, and losing its tail costs its next turn
// only the re-prefill of that tail.
func (v victim) rank() int { return int(v.h.Kind()) }

// Victims lists what eviction may take at now under GraceHolds, the one expected to be
// needed last first (Config.NextUse; least recently used without it): idle sequences
// holding cells (but the sequence except; -1: none) and evictable pools. Never a
// running task's sequence (and so never cells a running request borrows: the cell tree
// keeps a cell while any sequence holds it), never a pool with attached sessions, and
// never a pool in its grace (Config.Grace: a pool just created or restored must survive
// until the attach it was made for; under GraceYields it goes last). Without a tier,
// never a user-pinned pool or one with children (released ones too: their [0, D) lives
// in its cells); with one (PinPaging), such a pool is paged once its children hold no
// cells, user-pinned ones after everything else.
func (kv *Manager) Victims(now time.Time, except int) []Holder {
	vs := kv.victims(now, except, GraceHolds)
	out := make([]Holder, len(vs))
	for i, v := range vs {
		out[i] = v.h
	}
	return out
}

func (kv *Manager) victims(now time.Time, except int, g GraceRule) []victim {
	var out []victim
	for _, h := range kv.cfg.Holders() {
		if h.Busy() {
			continue
		}
		if h.Kind() != Pool {
			if h.Seq() != except {
				out = append(out, victim{h: h, used: h.LastUsed()})
			}
			continue
		}
		graced := kv.Graced(now, h)
		if graced && (g == GraceHolds || h.UseQueued()) {
			continue
		}
		if (kv.cfg.PinPaging && h.Pageable()) || !h.Pinned() {
			out = append(out, victim{h: h, used: h.LastUsed(), graced: graced})
		}
	}
	for i := range out {
		if kv.cfg.NextUse != nil {
			out[i].next = kv.cfg.NextUse(out[i].h)
		} else {
			out[i].next = out[i].used
		}
	}
	slices.SortStableFunc(out, func(a, b victim) int {
		if c := a.last() - b.last(); c != 0 {
			return c
		}
		if kv.cfg.NextUse != nil {
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

// Graced reports whether h is in its grace at now (Config.Grace).
func (kv *Manager) Graced(now time.Time, h Holder) bool {
	return h.Kind() == Pool && h.AwaitsUse() && now.Sub(h.LastUsed()) < kv.cfg.Grace
}

// Evictable counts the cells that evicting every victim (GraceHolds) but the sequence
// except (-1: none) would free: cells some other (running) sequence shares stay.
func (kv *Manager) Evictable(now time.Time, except int) int {
	return kv.cells.Freed(kv.VictimSet(now, except, GraceHolds), -1, 0)
}

// VictimSet is the sequences of the victims under g (Victims is GraceHolds's).
func (kv *Manager) VictimSet(now time.Time, except int, g GraceRule) SeqSet {
	var set SeqSet
	for _, v := range kv.victims(now, except, g) {
		set.Add(v.h.Seq())
	}
	return set
}

// MakeRoom frees cells until want are free or nothing is left to evict, and returns
// the free count. It takes leaves of the cell tree in one least recently used order
// (victims): each victim in turn gives up the cells only it holds (a sequence from its
// tail, as many as are still wanted; a pool its own run, whole). A victim whose cells
// others share is passed over: it is not a leaf; the sharer's turn comes. When a whole
// pass frees nothing but cells are still wanted, the cells left are shared only among
// victims (a cached sequence that borrowed an idle pool's prefix): the least recently
// used victim that holds such cells goes whole, and the passes go on. planned are
// cells already promised to the batch being built; the sequence except (-1: none) is
// never taken; g says whether pools in their grace are victims (last). take(h, n) is
// the scheduler's: h gives up n cells from its tail (a pool: all of its own), which it
// removes through Free.
func (kv *Manager) MakeRoom(now time.Time, want int, except int, planned int, g GraceRule, take func(h Holder, n int)) int {
	for kv.Room(planned) < want {
		vs := kv.victims(now, except, g)
		progress := false
		for _, v := range vs {
			if kv.Room(planned) >= want {
				break
			}
			if x := kv.cells.Exclusive(v.h.Seq(), 0); x > 0 {
				take(v.h, min(x, want-kv.Room(planned)))
				progress = true
			}
		}
		if progress || kv.Room(planned) >= want {
			continue
		}
		set := kv.VictimSet(now, except, g)
		i := slices.IndexFunc(vs, func(v victim) bool { return kv.cells.Joint(v.h.Seq(), set) > 0 })
		if i < 0 {
			break // nothing left that eviction could free
		}
		take(vs[i].h, len(kv.cells.Tokens(vs[i].h.Seq())))
	}
	return kv.Room(planned)
}

// DraftRoom frees up to n cells for speculative drafts when too few are free, and
// returns the cells freed: one pass over the victims in makeRoom's order, taking from
// the tails of idle sequences (cached anonymous ones, idle sessions) what only they
// hold, as a decode token does when the cache is full, but never a pool, which goes
// whole. take is MakeRoom's. Without it a server whose cache had filled (its steady
// state under varied traffic: cached sequences and idle sessions keep their cells
// until they are wanted) never drafted again. It costs little: a draft's cells come
// back after its step (rejected ones are removed; accepted ones are tokens the session
// would have decoded, which evict as decode tokens do), so the drafts of a session
// take a window of cells once, not new ones every step; a session that loses tail
// tokens to it prefills them again on its next turn.
func (kv *Manager) DraftRoom(now time.Time, n int, take func(h Holder, n int)) int {
	before := kv.Room(0)
	for _, v := range kv.victims(now, -1, GraceHolds) {
		left := n - (kv.Room(0) - before)
		if left <= 0 {
			break
		}
		if v.h.Kind() == Pool {
			continue
		}
		if x := kv.cells.Exclusive(v.h.Seq(), 0); x > 0 {
			take(v.h, min(x, left))
		}
	}
	return kv.Room(0) - before
}

// Discard plans seq_rm(seq, p0, -1) of cells the last step wrote that the cell tree
// never held: rejected speculative drafts (only the backend's cache holds them).
func (kv *Manager) Discard(seq, p0 int) {
	kv.cfg.Plan.SeqRm(seq, p0)
}
