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

// restore loads a pool's own cells into its empty sequence and checks that they are
// exactly [D, L). The cache is compacted first when cells were removed since the last
// batch, so the restored cells land above every resident one, in position order (the
// same order a prefill would leave them in: see Decode).
func (b *Backend) restore(op engine.SeqOp, m tier.Meta) error {
	start := time.Now()
	data, loc, err := b.store.Get(m)
	if err == nil && b.holes {
		if err = b.ctx.Compact(); err != nil {
			b.log.Error("KV cache compaction failed; cached sequences may be lost", "err", err)
		} else {
			b.holes = false
			b.Compactions++
		}
	}
	if err == nil {
		if err = b.ctx.SeqStateSet(op.Seq, data); err != nil {
			err = &tier.MissError{Reason: tier.MissRejected, Err: err}
		} else if lo, hi := b.ctx.SeqPosMin(op.Seq), b.ctx.SeqPosMax(op.Seq); lo != op.D || hi != len(op.Tokens)-1 {
			b.ctx.SeqRm(op.Seq, -1, -1)
			b.holes = true
			err = &tier.MissError{Reason: tier.MissRejected, Err: fmt.Errorf("restored positions [%d, %d], want [%d, %d)", lo, hi, op.D, len(op.Tokens))}
		}
	}
	if err != nil {
		b.store.Miss(op.Pool, err)
		return err
	}
	b.store.Restored(loc, time.Since(start))
	return nil
}
