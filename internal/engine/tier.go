package engine

import (
	"fmt"
	"slices"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/pool"
)

// The tier below the cache (issue 25). The scheduler only decides: evicting a pool plans
// an OpSpill before the OpSeqRm that drops its cells; materializing an evicted pool
// whose KV was spilled plans an OpRestore instead of a prefill and waits (statusLoading)
// for the driver's Restored answer, which either makes the pool resident at once or
// sends it down the ordinary prefill path. Bytes, keys, checksums and budgets are the
// driver's (package tier through the runner): the scheduler never learns where an entry
// lives, only whether loading it worked.
//
// What a tier entry holds is a pool's own cells, [D, L): its [0, D) are its parent's
// cells (branch contract), which are resident before a child is restored (ready), and
// are shared again by seq_cp once the child's own cells are back, exactly as a prefill
// from the parent's node would leave them. With recurrent state (Config.Recurrent) the
// entry also holds the pool's state at L, and the driver's restore shares [0, D) itself,
// before that state is put in place (a seq_cp copies a sequence's recurrent state).

// tierOp plans a tier operation on p.
func (s *Scheduler) tierOp(kind OpKind, p *pool.Pool) {
	op := SeqOp{Kind: kind, Seq: p.Seq, Pool: p.ID, D: p.D, Tokens: p.Tokens, Pinned: p.UserPinned}
	if p.Parent != nil {
		op.Parent, op.Src = p.Parent.ID, p.Parent.Seq
	}
	s.ops = append(s.ops, op)
}

// spill plans copying out a resident pool's own cells before they are dropped.
func (s *Scheduler) spill(p *pool.Pool) {
	if s.cfg.Tier && p.Filled() == p.L() {
		s.tierOp(OpSpill, p)
		s.inTier[p.ID] = true
	}
}

// tierRestore starts restoring a pool's materialization t from the tier when the pool
// was spilled and no resident sequence holds all of it: the OpRestore is planned and
// t waits (no prefill) for the Restored answer.
//
// The driver runs the plan's operations in order, and the restore loads the pool's own
// cells [D, L) into free cells (llama_state_seq_set_data refuses when too few are
// free): the room admission counted for them is made here, before the OpRestore, not
// after it (t is not running yet, so reservedPrefill leaves it out). Made after, the
// victims' removals ran behind the load, which found the cache full and fell back to a
// prefill whenever the restore needed cells an idle sequence held.
func (s *Scheduler) tierRestore(t *task) bool {
	p := t.pool
	if !s.cfg.Tier || !t.restore || !s.inTier[p.ID] {
		return false
	}
	if P, _ := s.poolDonor(p); P == p.L() {
		return false // resident already in full: a seq_cp is cheaper than any load
	}
	if want := s.reservedPrefill() + p.L() - p.D; s.kv.Room(0) < want {
		s.freeCells(want, nil, 0, t.grace) // reservedPrefill counts restores still pending
	}
	s.tierOp(OpRestore, p)
	s.setStatus(t, statusLoading)
	return true
}

// tierWaiting reports whether pool's restore onto seq is still awaited.
func (s *Scheduler) tierWaiting(pool, seq int) bool {
	return slices.ContainsFunc(s.running, func(t *task) bool { return t.loading(true) && t.pool.ID == pool && t.pool.Seq == seq })
}

// TierRead is the driver's word that the bytes of an OpRestore or OpLoad it answered
// ErrTierPending are in memory now (AsyncTierBackend.TierReady). If the op's pool or
// task still waits for it on the same sequence, the scheduler plans the op again, to
// run at once (the load into llama.cpp, then its Restored or Loaded answer); if not
// (a late duplicate read, or a materialization or task that ended meanwhile: the
// sequence may be someone else's now), it plans dropping the bytes (OpDiscard).
type TierRead struct{ Op SeqOp }

// tierRead applies a TierRead.
func (s *Scheduler) tierRead(op SeqOp) {
	waits := s.tierWaiting(op.Pool, op.Seq)
	if op.Kind == OpLoad {
		waits = s.loadWaiting(op.Task, op.Seq)
	}
	if !waits {
		op.Of, op.Kind = op.Kind, OpDiscard
	}
	s.urgent = append(s.urgent, op)
}

// tierPending counts the cells restores planned and not yet answered will write.
func (s *Scheduler) tierPending() int {
	n := 0
	for _, t := range s.running {
		if t.loading(true) {
			n += t.pool.L() - t.pool.D
		}
	}
	return n
}

// restored applies the driver's answer to an OpRestore (message Restored). Loaded: the
// pool's sequence holds its own cells [D, L); the parent's [0, D) are shared onto it
// and the pool is resident. Not loaded (a miss: absent, torn, corrupt, foreign,
// refused): the sequence holds nothing, and the pool is built as any evicted pool is,
// from the longest resident prefix and a prefill of the rest.
func (s *Scheduler) restored(m Restored) {
	i := slices.IndexFunc(s.running, func(t *task) bool { return t.loading(true) && t.pool.ID == m.Pool })
	if i < 0 {
		return // cancelled before the answer came: its abandonment already removed the cells
	}
	t := s.running[i]
	s.setStatus(t, statusPrefilling)
	p, sl := t.pool, t.slot
	if m.Err != nil {
		s.tierMisses++
		delete(s.inTier, p.ID) // the driver dropped what did not load
		have := s.copyPoolPrefix(p)
		sl.tokens = slices.Clone(p.Tokens[:have])
		t.cacheN = have
		if !t.prefilling() {
			s.poolMaterialized(t)
		}
		return
	}
	s.tierRestores++
	switch {
	case p.D > 0 && s.cfg.Recurrent:
		// The driver shared the parent's [0, D) itself, before the pool's own cells and
		// state: a seq_cp now would replace the loaded recurrent state by the parent's.
		s.kv.Shared(p.Parent.Seq, p.Seq, p.D)
	case p.D > 0:
		s.kv.Share(p.Parent.Seq, p.Seq, p.D)
	}
	s.kv.Allocate(p.Seq, p.Tokens[p.D:])
	sl.tokens = slices.Clone(p.Tokens)
	t.cacheN = p.L()
	s.poolMaterialized(t)
}

// recordPinned plans recording a resident user-pinned pool for restarts, with its
// admission policy when one was set (the driver rewrites a record only when it
// changed, and copies the cells out only when the tier lacks them).
func (s *Scheduler) recordPinned(p *pool.Pool) {
	if s.cfg.TierRecord && p.UserPinned && p.State == pool.Resident {
		s.tierOp(OpRecord, p)
		if pol := s.adm.Policy(p.ID); pol != admission.DefaultPolicy() {
			s.ops[len(s.ops)-1].Admission = &pol
		}
		s.inTier[p.ID] = true
	}
}

// forgetRecord plans dropping a pool's restart record (unpinned, released), and the
// keep on its tier entry that paging it out while pinned set.
func (s *Scheduler) forgetRecord(p *pool.Pool) {
	if s.cfg.Tier {
		s.ops = append(s.ops, SeqOp{Kind: OpForget, Seq: p.Seq, Pool: p.ID})
	}
}

// recoverPool puts back a pool an earlier run recorded (message RecoverPool), evicted,
// its KV in the tier or (m.InTier false: the entry was damaged or missing) to be
// prefilled; a pinned one is restored at once, so it is resident (and announced) before
// clients come back. Either way the restore is the ordinary materialization: a child
// waits for its parent's cells, whether they come from the tier or a prefill.
func (s *Scheduler) recoverPool(m RecoverPool) error {
	if !s.cfg.Tier {
		return fmt.Errorf("%w: recovering pools needs the tier", pool.ErrBadRequest)
	}
	var parent *pool.Pool
	if m.Parent != 0 {
		var err error
		if parent, err = s.pools.Get(m.Parent); err != nil {
			return err
		}
	}
	if len(m.Tokens) >= s.cfg.NCtx {
		return fmt.Errorf("%w: a %d-token prefix does not fit the context (%d)", ErrPromptTooLong, len(m.Tokens), s.cfg.NCtx)
	}
	p, err := s.pools.Recover(m.ID, parent, m.D, m.Tokens, s.now)
	if err != nil {
		return err
	}
	if m.InTier {
		s.inTier[p.ID] = true
	}
	if m.Pin {
		s.check(p.SetPin(true, s.now))
		s.restore(p)
		s.admit()
	}
	return nil
}
