package runner

import (
	"errors"
	"fmt"
	"time"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/tier"
)

var _ engine.TierBackend = (*Backend)(nil)

// EnableTier makes the backend perform the engine's tier operations (issue 25) with
// store. Not with SWA anchors: llama.cpp's sequence state leaves out the cells a
// sliding-window layer has masked, so a restored pool could not serve an attach or a
// fork below its last window (the app refuses the tier for such models).
func (b *Backend) EnableTier(store *tier.Store) { b.store = store }

// Tier implements engine.TierBackend. A pool's own cells [D, L) are what is stored: a
// child's [0, D) are its parent's cells, resident whenever the child is, so they are
// taken out of the child's sequence (membership only: the parent keeps them) before
// the copy, and shared back by the engine's seq_cp after a restore.
func (b *Backend) Tier(op engine.SeqOp) error {
	if b.store == nil {
		return errors.New("no tier")
	}
	m := tier.Meta{D: op.D, Tokens: op.Tokens}
	switch op.Kind {
	case engine.OpSpill:
		if b.store.Has(m) {
			b.store.Put(op.Pool, m, nil) // restored and evicted again: the entry is unchanged
			return nil
		}
		data, err := b.ownState(op, false)
		if err != nil {
			b.store.Miss(op.Pool, fmt.Errorf("spill: %w", err))
			return err
		}
		b.store.Put(op.Pool, m, data)
	case engine.OpRestore:
		return b.restore(op, m)
	case engine.OpRecord:
		if b.store.Recorded(op.Pool) {
			return nil
		}
		rec := tier.Record{ID: op.Pool, Parent: op.Parent, D: op.D}
		if b.store.Has(m) {
			b.store.Record(rec, m, nil)
			return nil
		}
		data, err := b.ownState(op, true)
		if err != nil {
			b.store.Miss(op.Pool, fmt.Errorf("record: %w", err))
			return err
		}
		b.store.Record(rec, m, data)
	case engine.OpForget:
		b.store.Forget(op.Pool)
	}
	return nil
}

// ownState copies out the cells [D, L) of the pool on op.Seq. keep: the pool stays
// resident, so its membership of the parent's [0, D) is put back afterwards (an
// evicted pool's sequence is cleared by the engine's next operation anyway).
func (b *Backend) ownState(op engine.SeqOp, keep bool) ([]byte, error) {
	if lo, hi := b.ctx.SeqPosMin(op.Seq), b.ctx.SeqPosMax(op.Seq); lo != 0 || hi != len(op.Tokens)-1 {
		return nil, fmt.Errorf("pool %d's sequence holds positions [%d, %d], want [0, %d)", op.Pool, lo, hi, len(op.Tokens))
	}
	if op.D > 0 {
		b.ctx.SeqRm(op.Seq, 0, op.D)
		if keep {
			defer b.ctx.SeqCp(op.Src, op.Seq, 0, op.D)
		}
	}
	return b.ctx.SeqStateGet(op.Seq)
}

// restore loads a pool's own cells from the tier into its empty sequence (load), or
// counts why not.
func (b *Backend) restore(op engine.SeqOp, m tier.Meta) error {
	start := time.Now()
	data, loc, err := b.store.Get(m)
	if err == nil {
		if err = b.load(op.Seq, op.D, len(op.Tokens), data); err != nil {
			err = &tier.MissError{Reason: tier.MissRejected, Err: err}
		}
	}
	if err != nil {
		b.store.Miss(op.Pool, err)
		return err
	}
	b.store.Restored(loc, time.Since(start))
	return nil
}

// load writes data (from SeqStateGet) into seq and checks that seq then holds exactly
// positions [lo, hi). Where attention is not ordered by position the cache is compacted
// first when cells were removed since the last batch (settle), so the loaded cells land
// above every resident one, in position order
// (the order a prefill would leave them in: see Decode). On failure seq holds nothing.
func (b *Backend) load(seq, lo, hi int, data []byte) error {
	if err := b.settle(); err != nil {
		return err
	}
	if err := b.ctx.SeqStateSet(seq, data); err != nil {
		return err
	}
	if p0, p1 := b.ctx.SeqPosMin(seq), b.ctx.SeqPosMax(seq); p0 != lo || p1 != hi-1 {
		b.ctx.SeqRm(seq, -1, -1)
		b.holes = true
		return fmt.Errorf("loaded positions [%d, %d], want [%d, %d)", p0, p1, lo, hi)
	}
	return nil
}

var _ engine.SlotBackend = (*Backend)(nil)

// SaveSeq implements engine.SlotBackend (llama-server's slot save).
func (b *Backend) SaveSeq(seq int) ([]byte, error) {
	if b.anchor > 0 {
		return nil, errSWASlots
	}
	return b.ctx.SeqStateGet(seq)
}

// LoadSeq implements engine.SlotBackend (llama-server's slot restore).
func (b *Backend) LoadSeq(seq, n int, data []byte) error {
	if b.anchor > 0 {
		return errSWASlots
	}
	return b.load(seq, 0, n, data)
}

// errSWASlots: as for the tier (EnableTier), a sliding-window model's saved sequence
// lacks the cells its window masks, so a borrower of a shorter prefix would miss them.
var errSWASlots = errors.New("slot save and restore are not available for sliding-window models: llama.cpp's sequence state leaves out the cells the window masks")
