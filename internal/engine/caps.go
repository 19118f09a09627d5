package engine

// Caps are what a backend can do beyond Backend, declared once (Backend.Caps): the
// engine reads them when it starts (New) and never asks the backend what it is again.
// A nil field is an ability the backend lacks, and the engine then does without it: no
// drafts from a model, no tier below the cache (its operations fail, so a pool is
// prefilled again and a session's cells are simply lost), no slot files, no cell
// probe, grammar requests' drafts verified uncut.
type Caps struct {
	// Draft drafts with a model (a draft model, MTP heads: draft.go).
	Draft DraftBackend
	// Check checks drafts against a task's grammar before they are planned
	// (speculative.go).
	Check DraftChecker
	// Tier moves pools' KV to and from the tier below the cache and stores sequences'
	// segments (tier.go, spill.go); SeqTier loads those segments back.
	Tier    TierBackend
	SeqTier SeqTierBackend
	// AsyncTier reads restores' and loads' bytes off the engine goroutine.
	AsyncTier AsyncTierBackend
	// Slots copies a session sequence's KV out and back in (slots.go).
	Slots SlotBackend
	// Probe asks llama.cpp itself whether cells fit (ProbeFits).
	Probe CellProber
}

// useBackend tells the scheduler what the backend it plans for can do (New, and the
// test harness): whether a model drafts (a draft round before each plan), how grammar
// requests' drafts are checked, whether slots can be saved and loaded.
func (s *Scheduler) useBackend(c Caps) {
	s.modelDrafts, s.draftCheck, s.slotIO = c.Draft != nil, c.Check, c.Slots != nil
}
