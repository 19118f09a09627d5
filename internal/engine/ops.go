package engine

import (
	"github.com/polykv/polykv/internal/admission"
)

// OpKind names a sequence operation.
type OpKind int

// Sequence operations the backend performs before a batch.
const (
	OpSeqRm OpKind = iota // remove Seq's cells in [P0, P1)
	OpSeqCp               // add Seq to Src's cells in [P0, P1)
	// Tier operations (Config.Tier, issue 25), on pool Pool whose prefix is Tokens with
	// its own cells at [D, len(Tokens)) on sequence Seq:
	OpSpill   // copy the pool's own cells out to the tier (an OpSeqRm follows)
	OpRestore // load them from the tier into the empty Seq; the driver answers Restored
	OpRecord  // copy a resident pinned pool's cells to disk and record it for restarts
	OpForget  // the pool is no longer recorded for restarts (unpinned or released)
	// Sequence tier operations (Config.Tier, issue 40; spill.go):
	OpSave     // copy Seq's cells [P0, P1) out as one segment named by Tokens ([0, P1)); Whole: with its recurrent state
	OpLoad     // load Segs into Seq, which holds [0, P0), up to P1; the driver answers Loaded for Task
	OpDrop     // the segment [P0, P1) named by Tokens is superseded: the store may drop it
	OpPrefetch // read Segs from disk into memory ahead of an OpLoad (no answer)
	// Operations a message needs before its reply (they come out of the Ready that
	// follows it, plan or not):
	OpSlotSave // copy session sequence Seq's KV out; the driver answers SlotDone with the bytes
	OpSlotLoad // load Data into Seq, which then holds Tokens; the driver answers SlotDone
	OpProbe    // do P1 copies of token Tok fit in the empty Seq (ProbeFits)? The driver answers Probed
	OpDiscard  // drop the bytes read for an op of kind Of that nothing waits for any more (TierRead)
	// OpLookup asks the tier which segments of Tokens (Task's prompt) it holds, Seq holding
	// [0, P0): the driver answers Found for Task, off the engine goroutine (Config.TierFleet).
	OpLookup
)

// SeqOp is one sequence operation.
type SeqOp struct {
	Kind     OpKind
	Seq, Src int
	P0, P1   int
	// Tier operations only: the pool, its parent (0: a root; Src is then the parent's
	// sequence), branch position and tokens (shared with the pool: read-only).
	Pool, Parent, D int
	Tokens          []Token
	// Admission (OpRecord only): the pool's admission policy when one was set (nil: the
	// default), recorded with it.
	Admission *admission.Policy
	// Pinned (OpSpill): a user-pinned pool paged out under pressure; the tier must keep
	// its entry (a pin means never lost).
	Pinned bool
	// Sequence tier operations only: what the sequence was (metrics), whether a saved
	// segment carries recurrent state, the segments to load or prefetch, and the task
	// whose load it is.
	Spill SpillKind
	Whole bool
	Segs  []Segment
	Task  TaskID
	// Data (OpSlotLoad): the saved KV; Tok (OpProbe): the token written; Of
	// (OpDiscard): the kind of the op whose read is dropped.
	Data []byte
	Tok  Token
	Of   OpKind
}

// SamplerOp creates or frees a task's sampler.
type SamplerOp struct {
	Task     TaskID
	Free     bool
	Params   SamplingParams
	Logprobs bool
	History  []Token
}

// Plan is what the driver must do now, in order: samplers, drafts, sequence ops, then
// decode Batch (if any) and hand the result to Commit. Each operation that has an
// answer (Drafts: Drafted; OpRestore: Restored; OpLoad: Loaded; OpSlotSave,
// OpSlotLoad: SlotDone; OpProbe: Probed) is answered through Step before the batch
// runs.
type Plan struct {
	Samplers []SamplerOp
	// Drafts is the draft round before a step (draft.go): the sessions whose drafts
	// the backend's drafter (Caps.Draft) proposes. A plan with Drafts holds nothing
	// else: the driver answers Drafted and asks for the plan again.
	Drafts []DraftWant
	SeqOps []SeqOp
	Batch  []BatchEntry
}
