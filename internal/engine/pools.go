package engine

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/polykv/polykv/internal/pool"
)

// Errors of pool operations beyond those of package pool.
var (
	ErrSessionNotFound = errors.New("session not found")
	ErrSessionBusy     = errors.New("session is busy")
	// ErrRecurrentBranch: on a model with recurrent state a pool can only be extended
	// at a pool boundary (Config.Recurrent); the API answers 409.
	ErrRecurrentBranch = errors.New("recurrent state cannot branch inside a pool")
)

// boundary is, on a model with recurrent state, the pool of p's ancestry (p included)
// whose whole prefix is the longest on p's path not above n: its own sequence holds the
// recurrent state at exactly that position, so it is the only donor a branch there can
// have. An ancestor counts only while every pool between it and p branched at or after
// its end (else its later tokens are not p's). nil when no pool qualifies.
func boundary(p *pool.Pool, n int) *pool.Pool {
	for q := p; q != nil; q = q.Parent {
		if l := q.L(); l > 0 && l <= n {
			return q
		}
		n = min(n, q.D)
	}
	return nil
}

// recurrentBranchErr names why a branch at d below pool p's boundaries is refused.
func recurrentBranchErr(p *pool.Pool, d int) error {
	var at []string
	for q := p; q != nil; q = q.Parent {
		at = append(at, strconv.Itoa(q.L()))
	}
	return fmt.Errorf("%w: this model has recurrent state (recurrent or hybrid layers), which holds one value per sequence, not one per position, so pool %d can be extended only at a pool boundary (token %s), not at token %d",
		ErrRecurrentBranch, p.ID, strings.Join(at, " or "), d)
}

// PoolSpec asks for a new pool: a root (no parent) or a child of Parent branching at D.
// The prefix is Tokens, or a live session's current context (FromSession).
type PoolSpec struct {
	HasParent   bool
	Parent      int
	D           int
	Tokens      []Token
	FromSession string
	Pin         bool
}

// createPool makes a pool (message CreatePool): a name on a path of the cell tree. A
// pool built from a session by zero-copy seq_cp, or whose whole prefix some resident
// sequence already holds, is resident at once (task 0); otherwise the returned task
// copies the longest resident prefix and prefills the rest (poolDonor), and its Done
// event tells when the pool can be attached. Nothing is left behind when it fails.
func (s *Scheduler) createPool(spec PoolSpec) (int, TaskID, error) {
	now := s.now
	parent, err := s.forkParent(spec)
	if err != nil {
		return 0, 0, err
	}
	tokens, src, err := s.poolSource(spec)
	if err != nil {
		return 0, 0, err
	}
	// Zero-copy snapshot: the session's own cells become the new pool's own cells, and
	// the session is re-attached to the pool it just seeded.
	if src != nil {
		zeroCopy := false
		switch {
		case parent == nil && src.base == nil:
			zeroCopy = true
		case parent == nil && src.base != nil && src.base.State != pool.Released:
			// Its prefix already lives in another pool: the snapshot is that pool's child.
			parent, spec.D, zeroCopy = src.base, src.shared, true
		case parent != nil && src.base == parent && src.shared == spec.D:
			zeroCopy = true
		}
		if zeroCopy {
			p, err := s.addPool(parent, spec.D, tokens)
			if err != nil {
				return 0, 0, err
			}
			s.kv.Share(src.seq, p.Seq, len(tokens))
			s.check(p.Materialized(now))
			s.check(p.SetPin(spec.Pin, now))
			s.prefixStored(p)
			s.recordPinned(p)
			s.attach(src, p, len(tokens))
			src.lastUsed = now
			return p.ID, 0, nil
		}
	}
	p, err := s.addPool(parent, spec.D, tokens)
	if err != nil {
		return 0, 0, err
	}
	s.check(p.SetPin(spec.Pin, now))
	if parent == nil || parent.State == pool.Resident {
		if P, _ := s.poolDonor(p); P == p.L() {
			// Every cell of it is resident already (an anonymous request, a session or
			// another pool holds the prefix): the pool is a name on that node of the
			// cell tree, resident at once without a prefill.
			s.copyPoolPrefix(p)
			s.check(p.Materialized(now))
			s.prefixStored(p)
			s.recordPinned(p)
			return p.ID, 0, nil
		}
	}
	t := s.materialize(p)
	s.admit()
	return p.ID, t.id, nil
}

// forkParent is the pool a new pool forks from (nil: a root), checked: live, and on a
// model with recurrent state forked only at one of its boundaries.
func (s *Scheduler) forkParent(spec PoolSpec) (*pool.Pool, error) {
	if !spec.HasParent {
		return nil, nil
	}
	parent, err := s.pools.Get(spec.Parent)
	if err != nil {
		return nil, err
	}
	if parent.State == pool.Released {
		// As for attach: a released pool no longer exists for clients.
		return nil, fmt.Errorf("%w: pool %d was released; fork from a live pool", pool.ErrNotFound, parent.ID)
	}
	if s.cfg.Recurrent && spec.D > 0 {
		if b := boundary(parent, spec.D); b == nil || b.L() != spec.D {
			return nil, recurrentBranchErr(parent, spec.D)
		}
	}
	return parent, nil
}

// poolSource is a new pool's tokens: the spec's, or, for a snapshot of a session
// (FromSession), what the idle session's sequence holds, with that sequence (src).
func (s *Scheduler) poolSource(spec PoolSpec) (tokens []Token, src *slot, err error) {
	tokens = spec.Tokens
	if spec.FromSession != "" {
		sl, ok := s.bySession[spec.FromSession]
		if !ok {
			return nil, nil, fmt.Errorf("%w: %q holds no sequence (unknown, or evicted)", ErrSessionNotFound, spec.FromSession)
		}
		if sl.task != nil {
			return nil, nil, fmt.Errorf("%w: %q is generating; snapshot it between turns", ErrSessionBusy, spec.FromSession)
		}
		if len(sl.tokens) == 0 {
			return nil, nil, fmt.Errorf("%w: session %q holds no context", pool.ErrBadRequest, spec.FromSession)
		}
		src, tokens = sl, slices.Clone(sl.tokens)
	}
	if len(tokens) >= s.cfg.NCtx {
		return nil, nil, fmt.Errorf("%w: a %d-token prefix does not fit the context (%d)", ErrPromptTooLong, len(tokens), s.cfg.NCtx)
	}
	return tokens, src, nil
}

// addPool adds a root (parent nil) or a child branching at d to the tree.
func (s *Scheduler) addPool(parent *pool.Pool, d int, tokens []Token) (*pool.Pool, error) {
	if parent == nil {
		return s.pools.NewRoot(tokens, s.now)
	}
	return s.pools.Fork(parent, d, tokens, s.now)
}

// copyPoolPrefix seq_cps the longest resident prefix of p onto p's empty sequence
// (poolDonor) and returns its length. Cells copied past the parent's [0, D) were found
// by the prefix cache and count as hits.
func (s *Scheduler) copyPoolPrefix(p *pool.Pool) int {
	P, donor := s.poolDonor(p)
	if P == 0 {
		return 0
	}
	s.kv.Share(donor, p.Seq, P)
	if inherited := min(p.D, P); P > inherited && s.cfg.PrefixCache {
		s.cacheHits += int64(P - inherited)
	}
	return P
}

// poolsUsed marks the pools whose whole prefix seq now borrows below p1 by the prefix
// cache as used now: one order over the cell tree means a pool's cells are as fresh as
// their last borrower, whether or not it named the pool. A pool of which seq borrows
// only part (a few tokens a prompt happens to share with it) is not used: the borrower
// keeps the cells it shares whatever becomes of the pool, the pool's other cells were
// not touched, and counting it would renew the grace of a pool that awaits its attach,
// holding back the very request that borrowed them (issue 54).
func (s *Scheduler) poolsUsed(seq, p1 int) {
	set := s.kv.Cells().HoldersBelow(seq, p1)
	for _, p := range s.pools.All() {
		if set.Has(p.Seq) && p.L() <= p1 && s.kv.Cells().Shares(seq, p.Seq, p.L()-1) {
			p.Used(s.now)
		}
	}
}

// materialize queues the prefill of p's [D, L) on p's own sequence.
func (s *Scheduler) materialize(p *pool.Pool) *task {
	s.check(p.Materialize())
	s.poolSeqs[p.ID] = &slot{seq: p.Seq}
	t := s.newTask(kindMaterialize, Request{Prompt: p.Tokens}, p)
	s.enqueue(t)
	return t
}

// restore re-materializes an evicted pool that a waiting task needs.
func (s *Scheduler) restore(p *pool.Pool) {
	if p.State == pool.Evicted {
		s.materialize(p).restore = true
	}
}

func (s *Scheduler) poolMaterialized(t *task) {
	p := t.pool
	s.check(p.Materialized(s.now))
	s.prefixStored(p)
	s.recordPinned(p) // the driver skips a pool it has recorded already
	stats := Stats{PromptN: p.L() - t.cacheN, CacheN: t.cacheN, PromptTime: s.now.Sub(t.admitted), Seq: p.Seq, Pool: p.ID}
	s.removeRunning(t)
	delete(s.poolSeqs, p.ID)
	s.events = append(s.events, Event{Task: t.id, Done: true, Finish: FinishStop, Pool: p.ID, Stats: stats})
}

// abandonPool undoes a pool whose materialization did not complete (cause says why). A pool that was
// being restored goes back to evicted; a new one is removed and its id returned, after
// the children queued behind it are cancelled (they cannot be built either).
func (s *Scheduler) abandonPool(p *pool.Pool, restoring bool, cause error) {
	s.kv.Free(p.Seq, 0)
	delete(s.poolSeqs, p.ID)
	p.Abandon()
	if restoring {
		return
	}
	for _, c := range slices.Clone(p.Children) {
		for _, q := range slices.Clone(s.queue) {
			if q.kind == kindMaterialize && q.pool == c {
				s.cancel(q.id)
			}
		}
	}
	// A child still being built on it keeps the object (evicted) until it goes too.
	_ = s.pools.Remove(p)
	s.orphanWaiters(p, cause)
}

// orphanWaiters settles the requests waiting for a new pool whose creation was
// abandoned (its creator cancelled, the prefill failed, or it waited past the queue
// timeout: cause): one that named the pool by its key runs unpooled, as a key this
// replica does not hold does; one that named its id fails as for a pool that does not
// exist, with the cause (a queue timeout stays a 503: the creator may retry). Kept
// waiting, they would find the pool evicted and restore it on a sequence id the tree
// has already handed back, under the next pool created.
func (s *Scheduler) orphanWaiters(p *pool.Pool, cause error) {
	gone := fmt.Errorf("%w: pool %d was not created: %w", pool.ErrNotFound, p.ID, cause)
	for _, t := range slices.Clone(s.queue) {
		if t.kind != kindGenerate || t.pool != p {
			continue
		}
		if t.req.PoolKey != nil {
			s.unpool(t)
			continue
		}
		s.queue = slices.DeleteFunc(s.queue, func(q *task) bool { return q == t })
		s.dropGated(t, gone)
	}
	for _, key := range s.adm.HeldKeys() {
		if t := s.tasks[TaskID(key)]; t.pool == p {
			s.adm.Unhold(key)
			if t.req.PoolKey != nil {
				s.unpool(t)
				s.enqueue(t)
				continue
			}
			s.dropGated(t, gone)
		}
	}
}

// unpool turns a request that named a pool by its key into an unpooled one.
func (s *Scheduler) unpool(t *task) {
	t.pool, t.newSession = nil, false
	t.req.HasPool, t.req.PoolID = false, 0
}

// evictPool drops a pool's own cells, keeping the object so it can be restored.
func (s *Scheduler) evictPool(p *pool.Pool) error { return s.dropPool(p, p.Evict) }

// pagePool drops a pool's own cells under pressure when the tier keeps them (issue 40):
// a user-pinned pool too (pool.Page), restored on its next attach.
func (s *Scheduler) pagePool(p *pool.Pool) error { return s.dropPool(p, p.Page) }

// dropPool moves p to evicted through verb (Evict or Page) and drops its cells, spilled
// to the tier first.
func (s *Scheduler) dropPool(p *pool.Pool, verb func() error) error {
	announced := prefixAnnounced(p)
	if err := verb(); err != nil {
		return err
	}
	if announced {
		s.prefixRemoved(p)
	}
	s.spill(p)
	s.kv.Free(p.Seq, 0)
	return nil
}

// reclaim frees a released pool's sequence and its sequence id.
func (s *Scheduler) reclaim(p *pool.Pool) {
	// Its prefix was reported removed when it was released.
	s.kv.Free(p.Seq, 0)
	s.adm.Forget(p.ID)
	delete(s.throttledBy, p.ID)
	delete(s.throttleLead, p.ID)
	delete(s.inTier, p.ID)
	s.check(s.pools.Reclaim(p))
}

// attachable checks a request's pool before it is queued.
func (s *Scheduler) attachable(req Request) (*pool.Pool, error) {
	p, err := s.pools.Get(req.PoolID)
	if err != nil {
		return nil, err
	}
	if p.State == pool.Released {
		return nil, fmt.Errorf("%w: pool %d was released", pool.ErrNotFound, p.ID)
	}
	if n := req.SharedPrefixN; n != nil {
		match := commonPrefix(p.Tokens, req.Prompt)
		if *n < 0 || *n > match {
			return nil, fmt.Errorf("%w: shared_prefix_n_tokens %d, but the prompt shares only %d tokens with pool %d", pool.ErrBadRequest, *n, match, p.ID)
		}
	}
	if s.cfg.Recurrent {
		if P := attachLen(p, req); boundary(p, P) == nil {
			return nil, recurrentBranchErr(p, P)
		}
	}
	return p, nil
}

func (s *Scheduler) getLive(id int) (*pool.Pool, error) {
	p, err := s.pools.Get(id)
	if err != nil {
		return nil, err
	}
	if p.State == pool.Released {
		return nil, fmt.Errorf("%w: pool %d was released", pool.ErrNotFound, id)
	}
	return p, nil
}

// releasePool releases a pool (message ReleasePool): no new attaches; its cells are
// reclaimed once no session uses them and the grace time has passed. A pool with live
// children is refused.
func (s *Scheduler) releasePool(id int) error {
	now := s.now
	p, err := s.getLive(id)
	if err != nil {
		return err
	}
	// Released children only wait for their grace time or their last session; they
	// keep the parent's cells alive by membership until reclaimed (expire reclaims a
	// parent only after its children), so they need not block the parent's release.
	announced := prefixAnnounced(p)
	recorded := p.UserPinned
	if err := p.Release(now); err != nil {
		return err
	}
	if announced {
		s.prefixRemoved(p)
	}
	if recorded {
		s.forgetRecord(p)
	}
	// Idle sessions lose their KV now; running ones when their turn ends.
	for _, sl := range s.slots {
		if sl.base == p && sl.task == nil {
			s.resetSlot(sl)
		}
	}
	s.expire()
	return nil
}

// pinPool sets or clears the user pin (a pinned pool is never lost: under pressure it is
// only paged to the tier, with Config.Tier, and otherwise never evicted).
func (s *Scheduler) pinPool(id int, pin bool) error {
	now := s.now
	p, err := s.getLive(id)
	if err != nil {
		return err
	}
	was := p.UserPinned
	if err := p.SetPin(pin, now); err != nil {
		return err
	}
	switch {
	case pin && !was:
		s.recordPinned(p) // an evicted one is recorded once it is resident again
	case !pin && was:
		s.forgetRecord(p)
	}
	return nil
}

// evictPoolByID drops a pool's cells now (message EvictPool), keeping its tokens: the
// next attach restores it.
func (s *Scheduler) evictPoolByID(id int) error {
	p, err := s.getLive(id)
	if err != nil {
		return err
	}
	return s.evictPool(p)
}

// flushPool drops the KV of the idle sessions attached to a pool (message FlushPool;
// running ones are untouched) and returns how many sessions and own cells were freed.
func (s *Scheduler) flushPool(id int) (int, int, error) {
	p, err := s.getLive(id)
	if err != nil {
		return 0, 0, err
	}
	n, cells := 0, 0
	for _, sl := range s.slots {
		if sl.base == p && sl.task == nil {
			n++
			cells += s.kv.Owned(sl.seq)
			s.resetSlot(sl)
		}
	}
	return n, cells, nil
}

// PoolSession is a sequence attached to a pool, in a status report.
type PoolSession struct {
	SessionID       string
	Seq             int
	SuffixNTokens   int
	MarginalKVBytes int64
	// RecurrentStateBytes is the session's own copy of the recurrent state (hybrid and
	// recurrent models): copied from the pool at attach, then its own.
	RecurrentStateBytes int64
	State               string
	Task                *uint64
}

// PoolInfo is a copy of one pool's state (§4.2 shape).
type PoolInfo struct {
	PoolID         int
	Parent         *int
	BranchPos      int
	PrefixLen      int
	OwnLen         int
	OwnKVBytes     int64
	SubtreeKVBytes int64
	// RecurrentStateBytes is the recurrent state the pool's own sequence holds at its
	// boundary (hybrid and recurrent models, while resident; 0 otherwise).
	RecurrentStateBytes int64
	Residency           string
	State               string
	Pinned              bool
	UserPinned          bool
	OrphanedPin         bool
	LastAccessTS        float64
	Children            []int
	Sessions            []PoolSession
	Depth               int // 1 for a root; the same name as the list's (the deepest)
	PrefixHash          string
	Tokens              []Token
}

// PoolsStatus is a copy of the whole tree.
type PoolsStatus struct {
	Pools        []PoolInfo
	TreeDepth    int
	SeqIDsUsed   int
	SeqIDsMax    int
	PoolsMax     int
	KVCellsUsed  int
	KVCellsMax   int
	BytesPerCell int64
	// RecurrentBytesPerSeq is one sequence's recurrent state (0 without recurrent layers).
	RecurrentBytesPerSeq int64
}

func (s *Scheduler) poolInfo(p *pool.Pool, withTokens bool) PoolInfo {
	bpc := s.cfg.BytesPerCell
	info := PoolInfo{
		PoolID: p.ID, BranchPos: p.D, PrefixLen: p.L(), OwnLen: p.L() - p.D,
		OwnKVBytes: int64(p.OwnCells()) * bpc, SubtreeKVBytes: s.subtreeCells(p) * bpc,
		Residency: residency(p), State: p.State.String(), Pinned: p.Pinned(), UserPinned: p.UserPinned,
		OrphanedPin:  p.UserPinned && p.Sessions == 0 && len(p.Children) == 0,
		LastAccessTS: float64(p.LastAccess.UnixMilli()) / 1000, Children: pool.ChildIDs(p),
		Sessions: []PoolSession{}, Depth: p.Depth(), PrefixHash: strconv.FormatUint(p.Fingerprint(), 16),
	}
	if p.Parent != nil {
		id := p.Parent.ID
		info.Parent = &id
	}
	if info.Residency != "evicted" {
		info.RecurrentStateBytes = s.cfg.RecurrentBytesPerSeq
	}
	for _, sl := range s.slots {
		if sl.base != p {
			continue
		}
		ps := PoolSession{SessionID: sl.session, Seq: sl.seq, SuffixNTokens: s.kv.Owned(sl.seq), MarginalKVBytes: int64(s.kv.Owned(sl.seq)) * bpc,
			RecurrentStateBytes: s.slotRecurrentBytes(sl), State: slotState(sl)}
		if sl.task != nil {
			id := uint64(sl.task.id)
			ps.Task = &id
		}
		info.Sessions = append(info.Sessions, ps)
	}
	if withTokens {
		info.Tokens = slices.Clone(p.Tokens)
	}
	return info
}

// slotRecurrentBytes is the recurrent state sl's sequence holds: one copy once it holds
// any tokens (0 on a model without recurrent layers).
func (s *Scheduler) slotRecurrentBytes(sl *slot) int64 {
	if len(sl.tokens) == 0 {
		return 0
	}
	return s.cfg.RecurrentBytesPerSeq
}

func residency(p *pool.Pool) string {
	switch p.State {
	case pool.Materializing:
		return "materializing"
	case pool.Evicted:
		return "evicted"
	}
	if p.Filled() == 0 {
		return "evicted"
	}
	return "resident"
}

// subtreeCells counts own cells of p, its descendants and their attached sequences.
func (s *Scheduler) subtreeCells(p *pool.Pool) int64 {
	n := int64(p.OwnCells())
	for _, sl := range s.slots {
		if sl.base == p {
			n += int64(s.kv.Owned(sl.seq))
		}
	}
	for _, c := range p.Children {
		n += s.subtreeCells(c)
	}
	return n
}

// Pool copies out one pool (with its tokens).
func (s *Scheduler) Pool(id int) (PoolInfo, error) {
	p, err := s.pools.Get(id)
	if err != nil {
		return PoolInfo{}, err
	}
	return s.poolInfo(p, true), nil
}

// Pools copies out the tree.
func (s *Scheduler) Pools() PoolsStatus {
	st := PoolsStatus{Pools: []PoolInfo{}, TreeDepth: s.pools.MaxDepth(), SeqIDsMax: s.cfg.Parallel + s.cfg.MaxPools,
		PoolsMax: s.cfg.MaxPools, KVCellsUsed: s.kv.Used(), KVCellsMax: s.cfg.NCtx, BytesPerCell: s.cfg.BytesPerCell,
		RecurrentBytesPerSeq: s.cfg.RecurrentBytesPerSeq}
	for _, p := range s.pools.All() {
		st.Pools = append(st.Pools, s.poolInfo(p, false))
	}
	st.SeqIDsUsed = s.pools.Len()
	for _, sl := range s.slots {
		if sl.task != nil || len(sl.tokens) > 0 {
			st.SeqIDsUsed++
		}
	}
	return st
}
