package runner

import "github.com/polykv/polykv/internal/engine"

// Drafters on the runner's side (issue 43). A ModelDrafter drafts with a model in
// llama.cpp contexts of its own (engine.DraftBackend's half: the engine's backend
// drafters ask it through the Backend); the Backend holds at most one
// (EnableDrafter). A drafter whose contexts must hold what the target holds is also a
// Follower: the Backend then applies every decode and cell operation of the target to
// it, and saves and loads its part of a sequence with the target's (tier entries, slot
// files). The Backend knows nothing else of it, and it knows of the Backend only the
// sequence layout it must mirror (target).
//
// Drafter (a draft model, which resyncs by token prefix) is a ModelDrafter alone; MTP
// (the model's MTP heads, chained or not, or an MTP assistant) is both.

// A ModelDrafter drafts for the engine's backend drafters (engine.DraftBackend).
type ModelDrafter interface {
	// Draft returns a proposal per want it could draft for (a failure is no proposal).
	Draft(wants []engine.DraftWant) []engine.DraftProposal
	// DraftSeqRm drops what it holds for the target's sequence seq, which was emptied.
	DraftSeqRm(seq int)
}

// A Follower is a drafter with llama.cpp contexts that mirror the target's cells. Its
// methods are the Backend's to call, on the engine goroutine.
type Follower interface {
	// follow is called once, by EnableDrafter: the backend it mirrors.
	follow(t target)
	// mirror mirrors a target decode of batch (the target's outputs still readable).
	mirror(batch []engine.BatchEntry)
	// seqRm and seqCp mirror the target's (after the target's own).
	seqRm(seq, p0, p1 int)
	seqCp(src, dst, p0, p1 int)
	// hasPart reports whether the follower keeps cells of its own, which tier entries
	// and slot files carry beside the target's (false: it reads the target's).
	hasPart() bool
	// savePart is its part of seq's cells [lo, hi) (those below lo are src's, as for
	// the target's part); loadPart loads one into seq, which holds nothing of it or
	// src's [0, lo), and leaves seq holding nothing of it on failure.
	savePart(seq, src, lo, hi int) ([]byte, error)
	loadPart(seq, src, lo, hi int, data []byte) error
	// restoring brackets a restore (a tier entry's, a slot file's), whose target-side
	// operations leave the two apart until the follower's part is loaded.
	restoring(on bool)
}

// target is what a Follower reads of the Backend it follows: the sequence layout it
// must mirror (see Backend.EnableSWAAnchors, EnableScratch, rolled).
type target interface {
	// swaAnchor is the SWA shadow offset (0: none).
	swaAnchor() int
	// rolledBack reports a recurrent rollback of seq that its next decode consumes.
	rolledBack(seq int) bool
	// scratchSeq is the sequence id the tier saves and loads chunks through.
	scratchSeq() int
	// swaChunks are the chunks a sliding-window model's cells [lo, hi) are saved in.
	swaChunks(lo, hi int) [][2]int
}

// noFollower is the Backend's follower when its drafter (if any) follows nothing: every
// operation is a no-op and it has no part in tier entries or slot files.
type noFollower struct{}

func (noFollower) follow(target)                               {}
func (noFollower) mirror([]engine.BatchEntry)                  {}
func (noFollower) seqRm(int, int, int)                         {}
func (noFollower) seqCp(int, int, int, int)                    {}
func (noFollower) hasPart() bool                               { return false }
func (noFollower) savePart(int, int, int, int) ([]byte, error) { return nil, nil }
func (noFollower) loadPart(int, int, int, int, []byte) error   { return nil }
func (noFollower) restoring(bool)                              {}

func (b *Backend) swaAnchor() int          { return b.anchor }
func (b *Backend) rolledBack(seq int) bool { return b.rolled[seq] }
func (b *Backend) scratchSeq() int         { return b.scratch }

// EnableDrafter makes the backend draft with d (a draft model, the model's MTP head),
// which, if it is a Follower, from now on mirrors every decode and cell operation of
// the target.
func (b *Backend) EnableDrafter(d ModelDrafter) {
	b.drafter = d
	if f, ok := d.(Follower); ok {
		b.follower = f
		f.follow(b)
	}
}

// Draft implements engine.DraftBackend (no proposals without a drafter).
func (b *Backend) Draft(wants []engine.DraftWant) []engine.DraftProposal {
	if b.drafter == nil {
		return nil
	}
	return b.drafter.Draft(wants)
}

// DraftSeqRm implements engine.DraftBackend.
func (b *Backend) DraftSeqRm(seq int) {
	if b.drafter != nil {
		b.drafter.DraftSeqRm(seq)
	}
}

var _ engine.DraftBackend = (*Backend)(nil)

var (
	_ ModelDrafter = (*Drafter)(nil)
	_ ModelDrafter = (*MTP)(nil)
	_ Follower     = (*MTP)(nil)
	_ Follower     = noFollower{}
)

// FollowerHasPart reports whether the drafter follows the target with cells of its own
// (an MTP head; false for an assistant, which reads the target's, or for no drafter):
// a sequence's cells then cannot be loaded back from the tier without that part, so the
// engine spills no session or cached sequence (engine.Config.NoSequenceSpill).
func (b *Backend) FollowerHasPart() bool { return b.follower.hasPart() }
