package engine

import (
	"time"

	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
	"github.com/polykv/polykv/internal/tps"
)

// slot is one sequence of the cache: a session's, or a pool's while it materializes.
type slot struct {
	seq      int
	session  string
	tokens   []Token // exactly the tokens this sequence holds, at positions 0..len-1
	base     *pool.Pool
	shared   int // tokens [0, shared) are the base pool's cells (borrowed, not owned)
	task     *task
	lastUsed time.Time
	// When its conversation is expected back (order.go): lastTask is the task that last
	// ran on it, expect the client's word for the next turn (zero: none), toolTurn its
	// reply ended in a tool call (ExpectTurn).
	lastTask TaskID
	expect   time.Time
	toolTurn bool
	// gap: the typical gap between turns of the anonymous conversation on it (learned
	// when a request continued it; 0: none seen).
	gap time.Duration
}

type taskKind int

const (
	kindGenerate    taskKind = iota
	kindMaterialize          // prefill a pool's [D, L): no logits, no sampling
)

type task struct {
	id     TaskID
	kind   taskKind
	req    Request
	pool   *pool.Pool // kindMaterialize: the pool being built; kindGenerate: the pool to attach to
	slot   *slot
	cacheN int
	// status is t's phase (status.go): changed only through setStatus.
	status    status
	next      Token  // statusDecoding: sampled but not yet decoded
	stopWord  string // the stop string that ended it, if one did
	restore   bool   // kindMaterialize: rebuilding an evicted pool (no client waits)
	generated int
	text      *textAssembler
	submitted time.Time
	admitted  time.Time
	firstTok  time.Time
	lastTok   time.Time
	ewma      tps.EWMA
	// newSession: attaching to a pool as a session it has not seen (gated, settled).
	newSession bool
	// donorP, donorSeq: where pickSlot found the longest cached prefix (prefix cache).
	donorP, donorSeq int
	// queued is when the task entered the queue (its deadline runs from there); wait is
	// why it was still waiting after the last admission pass (a Wait* reason).
	queued time.Time
	wait   string
	// spec is t's speculative decoding (drafter.go): its drafters' sessions and what
	// the scheduler keeps to limit and count its drafts.
	spec specSession
	// The sequence tier (spill.go): while t is loading, an OpLoad of loadSegs up to
	// loadTo is planned and its Loaded answer has not come (nothing of the prompt is
	// prefilled meanwhile); restoredN, the prompt tokens loaded instead of prefilled.
	loadTo    int
	loadSegs  []Segment
	restoredN int
	// The queue's order (order.go): cont, the request continues a conversation seen
	// before; attained, that conversation's accumulated context; passed, how many
	// requests that came later were seated before it (aging: no starvation).
	cont     bool
	attained int
	passed   int
	// contSeq is the idle anonymous sequence t continues (-1: none), which is needed
	// now: eviction takes it last (nextUse).
	contSeq int
	// Throttle toward the floor (throttle.go): the unthrottled rate (admission's),
	// the skip credit, whether Plan skips t in the step it builds, and the steps t
	// skipped so far.
	shadow     tps.EWMA
	skipCredit float64
	skipNow    bool
	throttled  int
	// pacedAt is when the throttle first held t in the queue (zero: never; paced).
	pacedAt time.Time
	// kv is where the waiting t's prompt's KV lived when last measured, at kvAt
	// (Waiting: at most every residencyEvery).
	kv   kvcache.Residency
	kvAt time.Time
	// grace is whether t, seated, may take pools in their grace for its cells:
	// GraceYields when admission found that no running work would make room for it
	// (admitPass), so that neither its prefill nor its decode stalls or stops on a pool
	// that admission let it take.
	grace kvcache.GraceRule
}

func (t *task) prefilling() bool { return t.slot != nil && len(t.slot.tokens) < len(t.req.Prompt) }

// inflight remembers what a planned batch holds for a task, so Commit can apply it.
type inflight struct {
	t      *task
	n      int  // tokens of this task in the batch
	decode bool // a decode token (else a prefill chunk)
	sample bool
	// drafts (with decode) follow the decode token at the next positions, each
	// sampled (speculative decoding); accepted is how many the samples confirmed.
	drafts   []Token
	accepted int
}

func (s *Scheduler) newTask(k taskKind, req Request, p *pool.Pool) *task {
	s.nextID++
	t := &task{id: s.nextID, kind: k, req: req, pool: p, text: newTextAssembler(req.Stop), submitted: s.now, contSeq: -1}
	s.tasks[t.id] = t
	return t
}

// dropTask ends t's life in the scheduler's maps: its status is done.
func (s *Scheduler) dropTask(t *task) {
	s.setStatus(t, statusDone)
	delete(s.tasks, t.id)
}

func (t *task) poolID() int {
	if t.slot != nil && t.slot.base != nil {
		return t.slot.base.ID
	}
	return 0
}
