package runner

import (
	"errors"
	"fmt"
	"time"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/tier"
)

// Segments of sessions' and cached sequences' cells (issue 40; engine/spill.go): a
// segment is the KV of positions [Start, End) of a sequence, named in the store by the
// whole prefix [0, End). It is saved through the scratch sequence (the segment's cells
// are shared onto it, nothing is copied in the cache, and its state is read), in the
// chunked format of saveChunks: one chunk, or window-aligned chunks on a
// sliding-window model (see swaChunks). A load goes the other way: each chunk into the
// scratch sequence, then only the positions the sequence lacks shared onto it (and its
// shadow), so a segment that starts below what the sequence holds (chunks are aligned)
// adds no cell twice. On a model with recurrent state a segment is the sequence's cells
// from a pool boundary to its end with its state (saveRecurrent), loaded whole onto a
// sequence holding exactly that boundary.
//
// Nothing here decides: the engine plans which segments to save, load or drop, and the
// store checks every byte against its name before a load sees it (a miss is a prefill).
// On a server drafting with the model's MTP head the engine spills no sequence (the MTP
// context mirrors every cell; its part of a segment is not kept): app turns it off.

var _ engine.SeqTierBackend = (*Backend)(nil)

// segmentOp performs OpSave, OpDrop and OpPrefetch.
func (b *Backend) segmentOp(op engine.SeqOp) error {
	m := tier.Meta{D: op.P0, Tokens: op.Tokens}
	kind := op.Spill.String()
	switch op.Kind {
	case engine.OpDrop:
		b.store.Drop(m)
	case engine.OpPrefetch:
		// Off the engine goroutine: a read from disk into RAM, so the load that follows
		// when the request is seated reads memory.
		metas := make([]tier.Meta, len(op.Segs))
		for i, g := range op.Segs {
			metas[i] = tier.Meta{D: g.Start, Tokens: g.Tokens}
		}
		go func() {
			for _, m := range metas {
				if !b.store.Promote(m) {
					return
				}
			}
		}()
	case engine.OpSave:
		if b.store.Has(m) {
			b.store.PutSegment(kind, m, nil) // stored already: only its use is noted
			return nil
		}
		data, err := b.segmentState(op)
		if err != nil {
			b.store.MissKind(kind, &tier.MissError{Reason: tier.MissRejected, Err: fmt.Errorf("save: %w", err)})
			return err
		}
		b.store.PutSegment(kind, m, data)
	}
	return nil
}

// segmentState reads the cells [op.P0, op.P1) of op.Seq (with its recurrent state when
// op.Whole) in the segment format.
func (b *Backend) segmentState(op engine.SeqOp) ([]byte, error) {
	if b.scratch < 0 {
		return nil, errors.New("no scratch sequence")
	}
	if b.rolled[op.Seq] {
		b.settleRollback(op.Seq) // a share taken now must see the rolled-back state
	}
	if p := b.ctx.SeqPosMax(op.Seq); p < op.P1-1 {
		return nil, fmt.Errorf("sequence %d ends at position %d, the segment at %d", op.Seq, p, op.P1-1)
	}
	if op.Whole {
		return b.saveRecurrent(op.Seq, op.P0, op.P1)
	}
	chunks := [][2]int{{op.P0, op.P1}}
	if b.anchor > 0 {
		chunks = b.swaChunks(op.P0, op.P1)
	}
	return saveChunks(b.ctx, b.scratch, op.Seq, chunks)
}

// Load implements engine.SeqTierBackend. Segments found only on disk are read off the
// engine goroutine first (engine.ErrTierPending; the op comes back on TierReady), the
// rest from memory; then they load in order until one fails. The answer's N is what
// the sequence holds after it, Missed the segment the store could not give (or whose
// bytes llama.cpp refused).
func (b *Backend) Load(op engine.SeqOp) (engine.Loaded, error) {
	ans := engine.Loaded{Task: op.Task, Seq: op.Seq, N: op.P0, Missed: -1}
	if b.store == nil || b.scratch < 0 {
		return ans, nil
	}
	kind := op.Spill.String()
	b.mu.Lock()
	read, ok := b.loadsRead[op.Task]
	delete(b.loadsRead, op.Task)
	b.mu.Unlock()
	if !ok && b.anyOnDisk(op.Segs) {
		go func() {
			out := make([]prefetch, len(op.Segs))
			for i, g := range op.Segs {
				t0 := time.Now()
				out[i].data, out[i].loc, out[i].err = b.store.Get(tier.Meta{D: g.Start, Tokens: g.Tokens})
				out[i].read = time.Since(t0)
				if out[i].err != nil {
					out = out[:i+1]
					break
				}
			}
			b.mu.Lock()
			b.loadsRead[op.Task] = out
			b.mu.Unlock()
			b.ready <- op
		}()
		return ans, engine.ErrTierPending
	}
	if err := b.settle(); err != nil {
		return ans, nil
	}
	for i, g := range op.Segs {
		start := time.Now()
		var pf prefetch
		if ok {
			if i >= len(read) {
				break // the read stopped at an earlier miss (already answered below)
			}
			pf = read[i]
			start = start.Add(-pf.read)
		} else {
			pf.data, pf.loc, pf.err = b.store.Get(tier.Meta{D: g.Start, Tokens: g.Tokens})
		}
		if pf.err != nil {
			b.store.MissKind(kind, pf.err)
			ans.Missed = i
			return ans, nil
		}
		hi := min(g.End(), op.P1)
		var err error
		if g.Whole {
			err = b.loadWhole(op.Seq, g.Start, g.End(), pf.data)
		} else {
			err = b.loadSegment(op.Seq, ans.N, hi, g.Start, g.End(), pf.data)
		}
		if err != nil {
			b.store.MissKind(kind, &tier.MissError{Reason: tier.MissRejected, Err: err})
			ans.Missed = i
			if g.Whole {
				ans.N = b.ctx.SeqPosMax(op.Seq) + 1 // a failed whole load leaves the sequence empty
			}
			return ans, nil
		}
		ans.N = hi
		b.store.RestoredKind(kind, pf.loc, time.Since(start), int64(len(pf.data)))
	}
	return ans, nil
}

// anyOnDisk reports whether a segment would be read from a file.
func (b *Backend) anyOnDisk(segs []engine.Segment) bool {
	for _, g := range segs {
		if b.store.OnDiskOnly(tier.Meta{D: g.Start, Tokens: g.Tokens}) {
			return true
		}
	}
	return false
}

// loadSegment loads a segment of positions [start, end) (data, from segmentState) into
// seq, which holds [0, from), sharing [from, to) of it onto seq (and its shadow). On
// failure seq holds [0, from) again.
func (b *Backend) loadSegment(seq, from, to, start, end int, data []byte) (err error) {
	if p := b.ctx.SeqPosMax(seq); p != from-1 {
		return fmt.Errorf("sequence %d ends at position %d, want %d before the load", seq, p, from-1)
	}
	defer func() {
		if err != nil {
			b.ctx.SeqRm(seq, from, -1)
			if b.anchor > 0 {
				b.ctx.SeqRm(seq+b.anchor, from, -1)
			}
			b.holes = true
		}
	}()
	x := b.scratch
	if err := loadChunks(b.ctx, x, start, end, data, func(c0, c1 int) {
		if lo, hi := max(c0, from), min(c1, to); lo < hi {
			b.ctx.SeqCp(x, seq, lo, hi)
			if b.anchor > 0 {
				b.ctx.SeqCp(x, seq+b.anchor, lo, hi)
			}
		}
	}); err != nil {
		return err
	}
	b.holes = true // the scratch's cells below from are free again
	if p := b.ctx.SeqPosMax(seq); p != to-1 {
		return fmt.Errorf("sequence %d ends at position %d after the load, want %d", seq, p, to-1)
	}
	return nil
}

// loadWhole loads a recurrent model's segment [lo, hi) with its state (saveRecurrent)
// onto seq, which holds exactly [0, lo) (from a pool boundary, or nothing). On failure
// seq holds nothing (a recurrent state cannot be cut back to lo).
func (b *Backend) loadWhole(seq, lo, hi int, data []byte) error {
	if p := b.ctx.SeqPosMax(seq); p != lo-1 {
		return fmt.Errorf("sequence %d ends at position %d, want %d before the load", seq, p, lo-1)
	}
	return b.loadRecurrent(seq, -1, lo, hi, data)
}
