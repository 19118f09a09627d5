package runner

import (
	"fmt"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
)

// Policy is what a model's architecture lets PolyKV do with its cache: which pool
// operations it allows, what the context must be built with, and which settings it
// refuses. It is decided here, from the model, and applied by whoever opens a server
// (internal/app), so that knowledge of architectures stays beside the backend that
// runs them.
type Policy struct {
	// Recurrent: the model has recurrent state (recurrent or hybrid layers), one value
	// per sequence rather than cells per position. It can be extended or dropped but not
	// cut back, so pools work at pool boundaries only (engine.Config.Recurrent), and the
	// prefix cache, which borrows any resident prefix at any length, is off.
	Recurrent bool
	// SWA is the model's sliding-attention window (0: none). llama.cpp's SWA cache keeps
	// only the window unless swa_full is set, and even then hands a cell held by one
	// sequence to anyone once it falls out of that sequence's window. Such a model runs
	// with a full-size SWA cache (so a pool keeps every position of its prefix in the SWA
	// layers too) and, with Anchors, a shadow sequence per sequence
	// (Backend.EnableSWAAnchors). Both cost memory: the SWA layers hold n_ctx cells and
	// the shadows halve the sequence ids.
	SWA int
	// Anchors turns the shadow sequences on (with SWA > 0). Tests turn them off to show
	// what goes wrong without them.
	Anchors bool
}

// ModelPolicy reads the policy from the model's architecture.
func ModelPolicy(m *llama.Model) Policy {
	return Policy{Recurrent: m.IsRecurrent() || m.IsHybrid(), SWA: m.NSWA(), Anchors: m.NSWA() > 0}
}

// Configure applies the policy to the scheduler's configuration. It reports whether it
// turned a requested prefix cache off.
func (p Policy) Configure(c *engine.Config) (prefixCacheOff bool) {
	if !p.Recurrent {
		return false
	}
	c.Recurrent = true
	prefixCacheOff, c.PrefixCache = c.PrefixCache, false
	return prefixCacheOff
}

// SpecRollback is the rollback depth (llama.ContextParams.RSSeq) to build the context
// with so that speculation with drafts of up to draftMax tokens can cut rejected ones
// off a recurrent state; 0 where none is needed or speculation cannot run here. It is
// at most nUBatch-1: llama.cpp keeps a sequence's last RSSeq+1 tokens in one
// micro-batch. With SWA anchors a shadow sequence shares its sequence's recurrent cell
// while llama.cpp's rollback index is per sequence: Backend.SeqRm cuts the sequence
// before its shadow and gives it its own cell at once (settleRollback).
func (p Policy) SpecRollback(draftMax, nUBatch int) int {
	if !p.Recurrent || draftMax < 1 {
		return 0
	}
	return max(0, min(draftMax, nUBatch-1))
}

// ContextSeqs is how many sequence ids the llama context needs for nSeq engine
// sequences (sessions and pools): with SWA anchors twice as many, one shadow each;
// and one more, the scratch sequence the tier saves and loads through
// (Backend.EnableScratch).
func (p Policy) ContextSeqs(nSeq int) int {
	if p.anchors() {
		return 2*nSeq + 1
	}
	return nSeq + 1
}

// Check refuses the settings this model cannot run with: more sequences than the
// context can hold with their shadows, and, with anchors, micro-batches smaller than a
// batch that exceeds the window (within one llama_decode a later micro-batch could
// reuse the cells of an earlier one before they are anchored).
func (p Policy) Check(nSeq, nBatch, nUBatch int) error {
	if !p.anchors() {
		if p.ContextSeqs(nSeq) > engine.MaxSeqs {
			return fmt.Errorf("the tier below the cache needs one sequence id more than the sessions and pools: --parallel + --max-pools must be at most %d, got %d", engine.MaxSeqs-1, nSeq)
		}
		return nil
	}
	if p.ContextSeqs(nSeq) > engine.MaxSeqs {
		return fmt.Errorf("this model uses sliding-window attention, which needs two sequence ids per session or pool and one more: --parallel + --max-pools must be at most %d, got %d", (engine.MaxSeqs-1)/2, nSeq)
	}
	if nUBatch < nBatch && nBatch > p.SWA {
		return fmt.Errorf("with a sliding-window model (window %d) --batch above the window needs --ubatch equal to --batch", p.SWA)
	}
	return nil
}

// Params sets what the llama context must be built with for this model.
func (p Policy) Params(c *llama.ContextParams) {
	c.SWAFull = p.SWA > 0
}

// TierOff says why this model's evicted pools cannot be spilled to the pool tier, or ""
// when they can.
func (p Policy) TierOff() string {
	switch {
	case p.SWA > 0 && !p.Anchors:
		// A loaded cell without its shadow could be handed out again.
		return "sliding-window model without SWA anchors: a loaded pool's cells could be handed out again; evicted pools are prefilled again"
	}
	return ""
}

// Enable turns on what the backend needs for this model, for nSeq engine sequences.
func (p Policy) Enable(b *Backend, nSeq int) {
	switch {
	case p.anchors():
		b.EnableSWAAnchors(nSeq)
		b.EnableScratch(2 * nSeq)
	default:
		b.EnableScratch(nSeq)
	}
}

func (p Policy) anchors() bool { return p.SWA > 0 && p.Anchors }
