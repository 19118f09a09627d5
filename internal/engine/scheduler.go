package engine

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
	"github.com/polykv/polykv/internal/tps"
)

// Config sizes the scheduler.
type Config struct {
	NCtx         int           // KV cells in the unified cache
	Parallel     int           // session sequences (ids 0..Parallel-1)
	MaxPools     int           // pool sequences (ids Parallel..Parallel+MaxPools-1)
	NBatch       int           // tokens per decode step (decode tokens + prefill chunks)
	MaxQueue     int           // waiting requests beyond the running ones; past it: ErrQueueFull
	SessionTTL   time.Duration // idle sessions older than this lose their KV (0 = never)
	PoolGrace    time.Duration // a pool just made is kept this long for its first use (kvcache.GraceRule); a released one is reclaimed this long after its last
	BytesPerCell int64         // KV bytes of one cell, for status reports
	// RecurrentBytesPerSeq is the recurrent state of one sequence (hybrid and recurrent
	// models; 0 otherwise), for status reports: unlike KV cells, which a pool's sessions
	// share zero-copy, every sequence holding tokens has its own copy.
	RecurrentBytesPerSeq int64
	// Recurrent: the model keeps per-sequence recurrent state (recurrent or hybrid
	// layers: Qwen3.5's gated delta-net, LFM2's short convolutions, Mamba). That state is
	// one value for the whole sequence, not a cell per position, so a sequence can be
	// extended or dropped but never cut back: truncate drops it whole, a session keeps its
	// cells only when the next prompt extends all of them, and a fork or attach extends a
	// pool at the full length of that pool or of an ancestor (a pool boundary, where the
	// ancestor's own sequence holds the state), otherwise ErrRecurrentBranch.
	Recurrent bool
	TPSTau    time.Duration // EWMA time constant of experienced tps (default 2 s)
	// PrefixCache turns on automatic prefix sharing (issue 12): a new request without a
	// pool (and without a known session) starts from the longest prefix any resident
	// sequence holds, by seq_cp, and finished anonymous sequences stay resident as cache
	// until their cells or sequence ids are needed. Off: such requests prefill their
	// whole prompt and free their cells when they end (the server's --prefix-cache off).
	PrefixCache bool
	// Tier (issue 25): an evicted pool's KV is spilled to a tier below the cache (the
	// plan's OpSpill, before its cells are removed) and restored from there (OpRestore)
	// when it is needed again, falling back to a prefill when the tier misses (the
	// driver answers each restore with a Restored message). Off: eviction drops the KV.
	Tier bool
	// TierRecord: user-pinned pools are also recorded for restarts (OpRecord, OpForget;
	// a disk tier).
	TierRecord bool
	// TierChunk is the tokens per stored segment of a session's or cached sequence's
	// cells (spill.go; 0: DefaultTierChunk). Used with Tier.
	TierChunk int
	// NoSequenceSpill keeps the tier to pools: sessions' and cached sequences' cells are
	// dropped when evicted, as before issue 40 (a backend whose cells another context
	// mirrors cell for cell, the MTP head's, cannot load them back alone).
	NoSequenceSpill bool
	// TierWriteThrough (issue 44): when a request ends, the chunks of its prompt that
	// the tier lacks are saved (OpSave) though its cells stay: with a level other
	// replicas share, what one computed any of them can load. Used with Tier.
	TierWriteThrough bool
	// TierFleet: the tier has a level other replicas write (a shared directory, a remote
	// store), which reports nothing of what they write: a request that waited in the
	// queue asks it again when it is seated (OpLookup), so what another replica wrote
	// meanwhile is loaded, not prefilled. Used with Tier.
	TierFleet bool
	// TierIndexTokens bounds the tokens the index of what lives below the cells holds
	// (kvcache.Below: about the tier's capacity in tokens; 0: 4M).
	TierIndexTokens int
	// PoolIDFloor: pool ids start above it (ids an earlier run may have used).
	PoolIDFloor int
	// QueueTimeout bounds every wait in the queue (issue 30): a request waiting for a
	// sequence, cells or its pool longer than this fails with ErrQueueTimeout (HTTP 503
	// with Retry-After), a pool's creation waiting for cells is abandoned with it. 0:
	// no deadline (benchmarks that queue on purpose). Requests held by an enforced
	// pool's admission gate have that policy's queue_timeout_ms until they are let in.
	QueueTimeout time.Duration
	// AttachMin is the least a request naming a pool by its key (pool_key) must share
	// with the pool's prefix to attach to it as a session (which pins the pool while the
	// session lives); below it the request runs unpooled (issue 30). A request naming a
	// pool by id attaches whatever it shares: its client asked for the pool.
	AttachMin int
	// Spec turns on speculative decoding (issue 23, speculative.go): every decoding
	// session proposes drafts that the step verifies beside everything else.
	// On a recurrent model only with Rollback ≥ Spec.DraftMax.
	Spec Spec
	// Rollback is, on a recurrent model (Recurrent), how many trailing positions the
	// backend can cut off a sequence right after a decode (llama.cpp's n_rs_seq
	// snapshots), which is what removing a rejected draft needs: speculation on such a
	// model needs Spec.DraftMax ≤ Rollback. Unused without Recurrent.
	Rollback int
}

// MaxSeqs is the largest n_seq_max llama.cpp accepts.
const MaxSeqs = kvcache.MaxSeqs

// Validate checks a configuration.
func (c Config) Validate() error {
	switch {
	case c.NCtx < 8:
		return fmt.Errorf("context size %d is too small", c.NCtx)
	case c.Parallel < 1:
		return fmt.Errorf("parallel must be at least 1, got %d", c.Parallel)
	case c.MaxPools < 0:
		return fmt.Errorf("max pools must not be negative, got %d", c.MaxPools)
	case c.Parallel+c.MaxPools > MaxSeqs:
		return fmt.Errorf("parallel (%d) + max pools (%d) exceeds llama.cpp's %d sequences", c.Parallel, c.MaxPools, MaxSeqs)
	case c.NBatch < c.Parallel:
		return fmt.Errorf("batch size %d must be at least parallel (%d): every running session decodes one token per step", c.NBatch, c.Parallel)
	case c.MaxQueue < 0:
		return fmt.Errorf("queue bound must not be negative, got %d", c.MaxQueue)
	case c.AttachMin < 0:
		return fmt.Errorf("attach minimum must not be negative, got %d", c.AttachMin)
	case c.QueueTimeout < 0:
		return fmt.Errorf("queue timeout must not be negative, got %s", c.QueueTimeout)
	case c.Spec.On() && c.Recurrent && c.Spec.withDefaults().DraftMax > c.Rollback:
		return fmt.Errorf("speculative decoding needs sequences that can be cut back after a rejected draft; this model's recurrent state can drop %d positions, --draft-max is %d", c.Rollback, c.Spec.withDefaults().DraftMax)
	}
	if c.Spec.On() {
		return c.Spec.withDefaults().validate()
	}
	return nil
}

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

// Scheduler is PolyKV's batching state machine. It performs no I/O and reads no clock:
// requests, cancellations and backend results come in as calls, time as an argument,
// and it answers with Plans and Events. See the package documentation for the loop.
type Scheduler struct {
	cfg       Config
	vocab     Vocab
	slots     []*slot
	bySession map[string]*slot
	pools     *pool.Tree
	poolSeqs  map[int]*slot // a materializing pool's sequence
	queue     []*task       // waiting, FIFO
	running   []*task       // holding a sequence, in admission order
	tasks     map[TaskID]*task
	nextID    TaskID
	now       time.Time
	// adm is all admission state: per-pool policies, settle windows, holds and
	// reservations, and the sessions seen before (continuations are never gated).
	adm       *admission.Controller
	agg       tps.EWMA  // aggregate decode tokens/s
	aggPrompt tps.EWMA  // aggregate prompt tokens/s
	planAt    time.Time // when the batch being decoded was planned

	ops      []SeqOp
	samplers []SamplerOp
	// urgent are operations a message needs run before its reply (a slot's bytes, a
	// cell probe, a tier read that came in, what is pending at shutdown): the next
	// Ready hands them out, plan or not, ahead of any step.
	urgent   []SeqOp
	events   []Event
	obs      []Observation
	inflight []inflight
	// snapAt is when Ready last handed out a snapshot; snapDue forces the next one
	// (a message was stepped, a decode failed).
	snapAt  time.Time
	snapDue bool

	// kv is the KV-cache manager (package kvcache): the one owner of the cells.
	kv *kvcache.Manager
	// watch is the residency reports' state (ReportResidency; nil: off).
	watch *seqWatch
	// drafters are the speculation types' drafters, in --spec-type order (drafter.go).
	drafters []Drafter
	// draftCheck cuts grammar requests' drafts (nil: they are verified uncut; see
	// DraftChecker): the backend's Caps.Check (useBackend).
	draftCheck DraftChecker
	// The backend's other abilities the scheduler plans around (useBackend): a
	// drafter with a model (the draft round before each plan: draft.go) and slots.
	modelDrafts, slotIO bool
	// The draft round of the coming plan: the wants asked for (Plan.Drafts) and
	// whether their answer (Drafted) came; Plan starts the next round.
	draftAsked []DraftWant
	draftsIn   bool
	// Prefix cache counters (issue 12): prompt tokens served from cached prefixes,
	// and evictions of cached anonymous sequences' cells.
	cacheHits      int64
	cacheEvictions int64
	// Pressure evictions of the other kinds of victim (the one LRU order).
	sessionEvictions, poolEvictions int64
	// inTier: pools whose KV a spill (or an earlier run) put in the tier, so a restore
	// is worth trying; tierRestores and tierMisses count the answers.
	inTier                   map[int]bool
	tierRestores, tierMisses int64
	// queueTimeouts counts waits that ran past Config.QueueTimeout.
	queueTimeouts int64
	// tierStats counts the sequence tier's work (spill.go); what the tier holds is the
	// KV-cache manager's index (kv.Below()).
	tierStats TierStats
	// progressAt is when the server last made progress on its work (a step that
	// computed anything, a request seated or ended): a queued request's deadline runs
	// only while nothing moves (deadlines).
	progressAt time.Time
	// gaps is what was learned of the time between a conversation's turns (order.go).
	gaps gapModel
	// Throttle toward the floor (throttle.go): the sessions the planned step skips,
	// the row-cost fit, each pool's virtual clock lead for its unthrottled rates, and
	// the steps skipped so far (all pools, and per pool).
	skipped        []*task
	rowCost        rowCost
	throttleLead   map[int]time.Duration
	throttledTotal int64
	pacedTotal     int64 // turns the throttle held in the queue (paced), and per pool
	pacedBy        map[int]int64
	throttledBy    map[int]int64

	// afterAdmit, when set (tests), is called at the end of every admission pass, to
	// check the liveness invariant where it must hold (doc.go).
	afterAdmit func()

	// violations counts pool lifecycle verbs that refused a transition the scheduler
	// asked for: a scheduler bug. It is reported (Usage), never a crash.
	violations    int
	lastViolation error
}

// check records a refused lifecycle transition (see violations).
func (s *Scheduler) check(err error) {
	if err != nil {
		s.violations++
		s.lastViolation = err
	}
}

// Violations reports how many lifecycle transitions were refused, and the last one.
// Anything but 0 is a scheduler bug; tests assert it stays 0.
func (s *Scheduler) Violations() (int, error) { return s.violations, s.lastViolation }

// NewScheduler creates a scheduler for cfg.
func NewScheduler(cfg Config, vocab Vocab) (*Scheduler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.TPSTau <= 0 {
		cfg.TPSTau = tps.DefaultTau
	}
	if cfg.Spec.On() {
		cfg.Spec = cfg.Spec.withDefaults()
	}
	s := &Scheduler{cfg: cfg, vocab: vocab, bySession: map[string]*slot{}, tasks: map[TaskID]*task{},
		poolSeqs: map[int]*slot{}, inTier: map[int]bool{},
		throttledBy: map[int]int64{}, pacedBy: map[int]int64{}, throttleLead: map[int]time.Duration{},
		adm: admission.NewController(), gaps: gapModel{sessions: map[string]*sessionGap{}},
		agg: tps.NewEWMA(cfg.TPSTau), aggPrompt: tps.NewEWMA(cfg.TPSTau)}
	for i := range cfg.Parallel {
		s.slots = append(s.slots, &slot{seq: i})
	}
	kc := kvcache.Config{NCtx: cfg.NCtx, FirstPool: cfg.Parallel, Grace: cfg.PoolGrace, PinPaging: cfg.Tier,
		Plan: planOps{&s.ops}, Holders: s.holders, NextUse: s.nextUseOf}
	if cfg.Tier && !cfg.NoSequenceSpill {
		kc.BelowChunk, kc.BelowLimit = cfg.tierChunk(), cfg.TierIndexTokens
	}
	s.kv = kvcache.New(kc)
	s.pools = pool.NewTree(cfg.Parallel, cfg.MaxPools, s.kv.Cells()) // its ownership counts read the cell tree
	s.pools.SkipIDs(cfg.PoolIDFloor)
	s.drafters = newDrafters(cfg.Spec)
	return s, nil
}

// submit queues a request (message Submit). It fails at once when the prompt can never
// run, the pool it names cannot be attached, the queue is full or an enforced pool
// refuses a new session; otherwise the task runs as soon as a sequence and cells are
// free. The Gate says what an enforced pool's gate decided.
func (s *Scheduler) submit(req Request) (TaskID, Gate, error) {
	if len(req.Prompt) == 0 {
		return 0, Gate{}, ErrEmptyPrompt
	}
	if len(req.Prompt) >= s.cfg.NCtx {
		return 0, Gate{}, fmt.Errorf("%w: %d prompt tokens, context size %d", ErrPromptTooLong, len(req.Prompt), s.cfg.NCtx)
	}
	req = s.resolvePoolKey(req)
	var p *pool.Pool
	if req.HasPool {
		var err error
		if p, err = s.attachable(req); err != nil {
			return 0, Gate{}, err
		}
	}
	s.admit()
	// Requests an enforced pool's gate holds are waiting too: they count against the
	// bound, or a saturated pool would let an unbounded number pile up.
	if waiting := len(s.queue) + s.adm.Held(); waiting >= s.cfg.MaxQueue && !s.canStartNow(req) {
		return 0, Gate{}, fmt.Errorf("%w (%d waiting)", ErrQueueFull, waiting)
	}
	t := s.newTask(kindGenerate, req, p)
	if p != nil {
		t.newSession = req.SessionID == "" || !s.adm.Known(req.SessionID)
	}
	s.classify(t)
	g, until, err := s.gate(t)
	if err != nil {
		s.dropTask(t)
		return 0, g, err
	}
	if g.Held {
		// A held request waits however free the sequences are: it always counts.
		if waiting := len(s.queue) + s.adm.Held(); waiting >= s.cfg.MaxQueue {
			s.dropTask(t)
			return 0, g, fmt.Errorf("%w (%d waiting, %d of them held by pool %d's admission gate)", ErrQueueFull, waiting, s.adm.Held(), p.ID)
		}
		s.adm.Hold(uint64(t.id), p.ID, until)
		return t.id, g, nil
	}
	s.enqueue(t)
	s.admit()
	if t.status == statusWaiting {
		s.prefetch(t) // it waits: what it will load can come up from disk meanwhile
	}
	return t.id, g, nil
}

// enqueue puts t at the end of the queue; its queue deadline runs from now.
func (s *Scheduler) enqueue(t *task) {
	t.queued = s.now
	t.wait = ""
	s.queue = append(s.queue, t)
}

func (s *Scheduler) newTask(k taskKind, req Request, p *pool.Pool) *task {
	s.nextID++
	t := &task{id: s.nextID, kind: k, req: req, pool: p, text: newTextAssembler(req.Stop), submitted: s.now, contSeq: -1}
	s.tasks[t.id] = t
	return t
}

// canStartNow reports whether a request would get a sequence at once (so the queue
// bound does not apply to it).
func (s *Scheduler) canStartNow(req Request) bool {
	for _, q := range s.queue {
		if q.kind == kindGenerate {
			return false // FIFO: someone is already waiting
		}
	}
	if sl, ok := s.bySession[req.SessionID]; ok && req.SessionID != "" {
		return sl.task == nil
	}
	for _, sl := range s.slots {
		if sl.task == nil {
			return true
		}
	}
	return false
}

// cancel ends a task (message Cancel).
func (s *Scheduler) cancel(id TaskID) {
	t, ok := s.tasks[id]
	if !ok {
		return
	}
	if t.status == statusWaiting {
		s.unqueue(t, FinishCancelled, ErrCancelled)
		return
	}
	s.finish(t, FinishCancelled, false, ErrCancelled)
}

// unqueue ends a task that holds no sequence (waiting in the queue or held by an
// admission gate): a pool's materialization abandons the pool.
func (s *Scheduler) unqueue(t *task, finish string, err error) {
	s.queue = slices.DeleteFunc(s.queue, func(q *task) bool { return q == t })
	s.adm.Unhold(uint64(t.id))
	s.dropTask(t)
	ev := Event{Task: t.id, Done: true, Finish: finish, Err: err}
	if t.kind == kindMaterialize {
		ev.Pool = t.pool.ID
	}
	s.events = append(s.events, ev)
	if t.kind == kindMaterialize {
		s.abandonPool(t.pool, t.restore, err)
	}
}

// Why a request waits in the queue: SlotInfo.WaitReason in /slots and the reason label
// of polykv_requests_waiting_reason. Each is something that makes progress without the
// request (the liveness invariant, doc.go), except WaitCells when pinned pools hold the
// cells; every wait ends by Config.QueueTimeout at the latest.
const (
	WaitPool      = "pool"      // its pool (or a fork's parent) is being built or restored
	WaitPrefix    = "prefix"    // a running request will soon hold a longer prefix of its prompt
	WaitSession   = "session"   // its session's previous turn is still running
	WaitSequence  = "sequence"  // every sequence id is held by a running request
	WaitCells     = "cells"     // the cells it needs are held by running requests or pinned pools
	WaitQueue     = "queue"     // behind a request that waits for cells (first come, first served)
	WaitAdmission = "admission" // held by an enforced pool's admission gate
	WaitFloor     = "floor"     // paced: its throttled pool's running sessions are at the floor
)

// Events drains the events produced since the last call.
func (s *Scheduler) Events() []Event {
	ev := s.events
	s.events = nil
	return ev
}

// Observations drains the measurements made since the last call; the engine hands
// them to its Observer, so the scheduler itself calls out to nothing.
func (s *Scheduler) Observations() []Observation {
	s.residencyObs()
	o := s.obs
	s.obs = nil
	return o
}

// Idle reports that nothing is waiting or running.
func (s *Scheduler) Idle() bool { return len(s.queue) == 0 && len(s.running) == 0 && s.adm.Held() == 0 }

// pickSlot chooses the sequence for t without side effects: its session's own; for an
// implicit request (prefixCached), an idle cached anonymous sequence holding the
// longest prefix of its prompt (taken over); else an empty one, else the least
// recently used idle one (evictsBefore).
func (s *Scheduler) pickSlot(t *task) *slot {
	if t.kind == kindMaterialize {
		return s.poolSeqs[t.pool.ID]
	}
	if t.req.SessionID != "" {
		if sl, ok := s.bySession[t.req.SessionID]; ok {
			if sl.task != nil {
				return nil
			}
			return sl
		}
	}
	t.donorP, t.donorSeq = 0, -1
	if s.prefixCached(t) {
		t.donorP, t.donorSeq = s.donor(t.req.Prompt)
		if d := s.cachedSlot(t.donorSeq); d != nil {
			return d
		}
	}
	var lru *slot
	for _, sl := range s.slots {
		if sl.task != nil {
			continue
		}
		if sl.session == "" && len(sl.tokens) == 0 {
			return sl
		}
		if lru == nil || s.evictsBefore(sl, lru) {
			lru = sl
		}
	}
	return lru
}

// evictsBefore orders idle sequences for reuse under sequence-id pressure: those
// holding nothing (a session whose KV was flushed) first, then the order eviction under
// cell pressure follows (victims: the one expected to be needed last first, cached
// anonymous sequences and idle sessions alike; then the least recently used, the
// anonymous one first only when both were last used at the same instant).
func (s *Scheduler) evictsBefore(a, b *slot) bool {
	if ea, eb := len(a.tokens) == 0, len(b.tokens) == 0; ea != eb {
		return ea
	}
	if c := s.nextUse(victim{sl: b}).Compare(s.nextUse(victim{sl: a})); c != 0 {
		return c < 0
	}
	if c := a.lastUsed.Compare(b.lastUsed); c != 0 {
		return c < 0
	}
	return a.session == "" && b.session != ""
}

// cachedSlot returns seq's slot when it is a finished anonymous sequence kept as cache.
func (s *Scheduler) cachedSlot(seq int) *slot {
	if seq < 0 || seq >= len(s.slots) {
		return nil
	}
	if sl := s.slots[seq]; sl.task == nil && sl.session == "" && len(sl.tokens) > 0 {
		return sl
	}
	return nil
}

// prefixCached reports whether t starts from whatever resident sequence holds the
// longest prefix of its prompt (issue 12): a request without a pool whose session, if
// it names one, holds no sequence (a known session continues on its own).
func (s *Scheduler) prefixCached(t *task) bool {
	if !s.cfg.PrefixCache || t.kind != kindGenerate || t.pool != nil || t.req.NoPrefixCache {
		return false
	}
	if t.req.SessionID != "" {
		if _, ok := s.bySession[t.req.SessionID]; ok {
			return false
		}
	}
	return true
}

// donor finds the longest prefix of prompt that some sequence holds (sessions, cached
// anonymous sequences, running tasks' committed cells, pools), leaving the last prompt
// token to prefill so there are logits to sample from: its length and a sequence to
// copy it from, an idle cached one when there is one (it can be taken over), else the
// lowest id. (0, -1) when nothing matches.
func (s *Scheduler) donor(prompt []Token) (int, int) {
	P, n := s.kv.Longest(prompt, len(prompt)-1)
	if P == 0 {
		return 0, -1
	}
	best := -1
	n.Holders().Each(func(q int) bool {
		if s.cachedSlot(q) != nil {
			best = q
			return false
		}
		if best < 0 {
			best = q
		}
		return true
	})
	return P, best
}

// poolDonor is where a pool's materialization starts: the same lookup an anonymous
// request makes (issue 12: one mechanism), the longest prefix of the pool's tokens that
// some resident sequence holds, and a holder to seq_cp it from. A root searches the
// whole tree; a child searches below its parent's node at D (the sequences that share
// the parent's cells [0, D): the parent itself, its other children, sessions and cached
// sequences that borrowed from it), so it always shares at least the parent's [0, D),
// as its branch contract says, and copies whatever of its own part is already cached.
// The whole prefix may match (no logits are needed): the pool is then resident without
// a prefill. With the prefix cache off a root starts empty and a child from its
// parent's [0, D) only. The parent must be resident. (0, -1) when nothing matches.
func (s *Scheduler) poolDonor(p *pool.Pool) (int, int) {
	par := p.Parent
	if par != nil && p.D == 0 {
		par = nil // it inherits nothing: a root in all but name
	}
	if !s.cfg.PrefixCache {
		if par != nil && s.cfg.Recurrent {
			// The boundary ancestor's sequence holds the state at D (createPool checked
			// that one ends exactly there); without it, prefill from the start.
			if b := boundary(par, p.D); b != nil && b.L() == p.D && b.State == pool.Resident {
				return p.D, b.Seq
			}
			return 0, -1
		}
		if par != nil {
			return p.D, par.Seq
		}
		return 0, -1
	}
	var P int
	var n *kvcache.Node
	if par != nil {
		P, n = s.kv.LongestFrom(par.Seq, p.D, p.Tokens, p.L())
	} else {
		P, n = s.kv.Longest(p.Tokens, p.L())
	}
	if P == 0 {
		return 0, -1
	}
	donor := -1
	n.Holders().Each(func(q int) bool {
		donor = q
		return false
	})
	if par != nil && n.Holders().Has(par.Seq) {
		donor = par.Seq // the parent when it holds all of it: the plainest seq_cp
	}
	return P, donor
}

// awaitsDonor reports whether t should stay queued because a task still prefilling
// will soon hold a longer prefix of t's prompt than anything resident now (fan-out:
// many requests with one long system prompt arrive together). Only committed cells can
// be copied, so t waits until that task's prefill covers the common part.
func (s *Scheduler) awaitsDonor(t *task) bool {
	limit := len(t.req.Prompt) - 1
	have, _ := s.kv.Longest(t.req.Prompt, limit)
	for _, r := range s.running {
		if r.prefilling() && min(commonPrefix(r.req.Prompt, t.req.Prompt), limit) > have {
			return true
		}
	}
	return false
}

// placement is how a task will sit on its sequence: keep [0, keep) of what the
// sequence holds, or reset it and borrow [0, attachP) from a pool, or reset it and
// share [0, cpP) of sequence cpFrom's cells (implicit prefix sharing).
type placement struct {
	keep    int
	attachP int // > 0: reset the sequence and seq_cp [0, attachP) from the pool
	// attachTo is the pool the sequence joins: the request's, or on a recurrent model the
	// one its session borrowed from before; attachFrom the pool whose sequence the attach
	// copies: attachTo, or on a recurrent model the ancestor whose boundary is attachP.
	attachTo, attachFrom *pool.Pool
	cpFrom               int
	cpP                  int  // > 0: reset the sequence and seq_cp [0, cpP) from cpFrom
	reused               bool // keep or cpP came from the prefix cache (counted as hits)
}

func (s *Scheduler) place(t *task, sl *slot) placement {
	if t.kind == kindMaterialize {
		return placement{}
	}
	prompt := t.req.Prompt
	if s.prefixCached(t) && t.donorSeq >= 0 {
		if sl.seq == t.donorSeq {
			return placement{keep: t.donorP, reused: true}
		}
		return placement{cpFrom: t.donorSeq, cpP: t.donorP, reused: true}
	}
	own := sl.session != "" && sl.session == t.req.SessionID
	k := 0
	if own {
		k = min(commonPrefix(sl.tokens, prompt), len(prompt)-1) // the last prompt token must be decoded for logits
	}
	p := t.pool
	if own && s.cfg.Recurrent && k < len(sl.tokens) {
		k = 0 // its recurrent state is past k: it cannot be cut back (Config.Recurrent)
		if p == nil && sl.base != nil && sl.base.State == pool.Resident {
			p = sl.base // but the pool it borrowed from still holds a state to start over from
		}
	}
	if p != nil {
		P := attachLen(p, t.req)
		src := p
		if s.cfg.Recurrent {
			// Only a pool's own sequence holds recurrent state, at its full length.
			if src = boundary(p, P); src != nil && src.State == pool.Resident {
				P = src.L()
			} else {
				P = 0
			}
		}
		// Continuation on the same pool reuses the session's own cells first.
		if !(own && sl.base == p && k >= P) && P > 0 {
			return placement{attachP: P, attachTo: p, attachFrom: src}
		}
	}
	if !own {
		return placement{}
	}
	return placement{keep: k}
}

// admit moves waiting tasks onto sequences in FIFO order. A task whose cells are not
// available blocks those behind it, so a long prompt is never starved. A pass that
// seats or drops a task starts over: what it did (a pool restored or created without a
// prefill, a session's sequence freed) may have let an earlier waiting task go, and a
// waiting task must be seated in the step its capacity allows it (doc.go, liveness).
func (s *Scheduler) admit() {
	if s.afterAdmit != nil {
		defer s.afterAdmit()
	}
	for s.admitPass() {
	}
}

// admitPass is one pass of admit over the queue; it reports whether it seated or
// dropped a task. Behind the first task that waits for cells (the head) only the first
// use of a pool in its grace may still go (firstUse): it is what the grace keeps that
// pool for, and the head, which cannot take the pool while that use waits (UseQueued),
// would otherwise wait out the grace behind it.
func (s *Scheduler) admitPass() bool {
	moved := false
	s.orderQueue()
	blocked := false // a task ahead waits for cells
	for i := 0; i < len(s.queue); {
		t := s.queue[i]
		if blocked && !s.firstUse(t) {
			t.wait = WaitQueue
			if dep := t.pool; t.kind == kindGenerate && dep != nil && dep.State != pool.Resident {
				t.wait = WaitPool // it could not go even if the head did
			}
			i++
			continue
		}
		if ok, err := s.ready(t); err != nil {
			s.queue = slices.Delete(s.queue, i, i+1)
			s.dropTask(t)
			s.events = append(s.events, Event{Task: t.id, Done: true, Finish: FinishError, Err: err})
			moved = true
			continue
		} else if !ok {
			i++ // waits for its pool (or the pool's parent), or a donor (t.wait says)
			continue
		}
		if s.paced(t) {
			i++ // its pool's sessions would fall under the floor (throttle.go); others may go
			t.wait = WaitFloor
			continue
		}
		sl := s.pickSlot(t)
		if sl == nil {
			i++ // its session is busy, or no sequence is free: later tasks may still fit
			t.wait = WaitSequence
			if _, ok := s.bySession[t.req.SessionID]; ok && t.req.SessionID != "" {
				t.wait = WaitSession
			}
			continue
		}
		pl := s.place(t, sl)
		need, room := s.fit(t, sl, pl, kvcache.GraceHolds, false)
		t.grace = kvcache.GraceHolds
		if room < need {
			// A pool's grace holds it for its first attach while the request can wait
			// for running work to make room. When no running work ever will (an idle
			// server: issue 54), waiting would only wait out the grace time beside a pool
			// the request does not use: the request takes such pools too, after every
			// other victim (paged to the tier, or prefilled again, on their attach), but
			// never one whose first use waits in the queue (UseQueued).
			if _, after := s.fit(t, sl, pl, kvcache.GraceHolds, true); after < need {
				t.grace = kvcache.GraceYields
				need, room = s.fit(t, sl, pl, t.grace, false)
			}
		}
		if room < need {
			if err := s.neverFits(need); err != nil {
				s.unqueue(t, FinishError, err)
				moved = true
				continue
			}
			// Head-of-line: wait for running tasks to end; those behind wait behind it
			// (but a pool's first use).
			t.wait = WaitCells
			blocked = true
			i++
			continue
		}
		s.passedOver(t)
		s.seat(t, sl, pl)
		if s.kv.Room(0) < s.reservedPrefill() {
			// Seated, t is prefilling: reservedPrefill now counts its need too, and fit
			// said eviction can free that much (under t's grace rule).
			s.freeCells(s.reservedPrefill(), nil, 0, t.grace)
		}
		s.queue = slices.Delete(s.queue, i, i+1)
		moved = true
	}
	return moved
}

// fit is what t needs on sl as placed, and the room it has: the cells free now, less
// those promised to prompts already seated (reservedPrefill), plus every cell eviction
// could reclaim for it under grace rule g. That is exactly what seat and freeCells will
// do: sl gives up whatever the placement does not keep, and every victim (idle
// sequences, evictable pools) its cells; what stays is what the placement keeps or
// borrows (sl's own kept prefix, the donor's copied prefix, the pool it attaches to,
// which attaching pins) and whatever a sequence that is not a victim holds. Cells that
// sl shares with other victims count: taking sl and them frees them (counting only what
// sl or the others held alone left such cells out, and a request could wait forever on
// an idle server).
//
// afterRunning asks instead for the room t would have once every running task ended:
// a running request's sequence is then idle (a victim), and so, at most, is the pool it
// borrows (counted though a pin may keep it: erring toward waiting for running work,
// which ends, and is asked again then); a pool being built keeps what it was promised.
// That is whether waiting for running work can make room for t at all.
func (s *Scheduler) fit(t *task, sl *slot, pl placement, g kvcache.GraceRule, afterRunning bool) (need, room int) {
	set := s.kv.VictimSet(s.now, -1, g)
	keepSeq, keepTo := -1, 0
	need = len(t.req.Prompt) - pl.keep - pl.attachP - pl.cpP
	switch {
	case t.kind == kindMaterialize:
		var P int
		P, keepSeq = s.poolDonor(t.pool)
		need, keepTo = t.pool.L()-P, P
	case pl.attachP > 0:
		set.Del(pl.attachTo.Seq)   // attached, the pool stays whole
		set.Del(pl.attachFrom.Seq) // and the one it copies from (itself, or its ancestor)
		set.Add(sl.seq)
	case pl.cpP > 0:
		keepSeq, keepTo = pl.cpFrom, pl.cpP
		set.Add(sl.seq)
	default:
		keepSeq, keepTo = sl.seq, pl.keep
		set.Add(sl.seq)
	}
	reserved := s.reservedPrefill()
	if afterRunning {
		reserved = 0
		for _, r := range s.running {
			if r.kind != kindGenerate {
				if r.prefilling() {
					reserved += len(r.req.Prompt) - len(r.slot.tokens)
				}
				continue
			}
			set.Add(r.slot.seq)
			if b := r.slot.base; b != nil && b != pl.attachTo && b != pl.attachFrom {
				set.Add(b.Seq)
			}
		}
	}
	room = s.kv.Room(reserved) + s.kv.FreedBy(set, keepSeq, keepTo)
	return need, room
}

// ready reports whether a waiting task's pool dependencies are met, and starts
// restoring an evicted pool it needs. A pool released while the task waited fails it.
func (s *Scheduler) ready(t *task) (bool, error) {
	if s.prefixCached(t) && s.awaitsDonor(t) {
		t.wait = WaitPrefix
		return false, nil
	}
	t.wait = WaitPool // until it returns true
	need := t.pool
	if t.kind == kindMaterialize {
		need = t.pool.Parent
	}
	if need == nil {
		return true, nil
	}
	switch need.State {
	case pool.Resident:
		return true, nil
	case pool.Released:
		return false, fmt.Errorf("%w: pool %d was released while the request waited", pool.ErrNotFound, need.ID)
	case pool.Evicted:
		s.restore(need)
	}
	return false, nil
}

// seat puts t on sl as placed.
func (s *Scheduler) seat(t *task, sl *slot, pl placement) {
	if s.cachedSlot(sl.seq) != nil && !(pl.reused && pl.cpP == 0) {
		s.cacheEvictions++ // a cached sequence gives up its sequence id
	}
	s.setStatus(t, statusPrefilling) // a restore or load below moves it on to loading
	if t.kind == kindGenerate && !(sl.session != "" && sl.session == t.req.SessionID) {
		// The sequence id goes to another holder: what it holds beyond what t keeps of it
		// is spilled to the tier first (issue 40), whole unless t takes over a cached
		// sequence's prefix.
		from := 0
		if pl.reused && pl.cpP == 0 {
			from = pl.keep
		}
		s.spillSeq(sl, from, spillKindOf(sl))
		if t.contSeq != sl.seq {
			sl.gap = 0 // another conversation moves onto it
		}
	}
	switch {
	case t.kind == kindMaterialize:
		// A pool (new, forked or restored) starts from whatever sequence holds the
		// longest prefix of it, as a request does: one tree, one mechanism.
		p := t.pool
		sl.shared = p.D
		if s.tierRestore(t) {
			break // the pool's cells come from the tier (Restored), not from a prefill
		}
		have := s.copyPoolPrefix(p)
		sl.tokens = slices.Clone(p.Tokens[:have])
		t.cacheN = have
	case pl.attachP > 0:
		s.resetSlot(sl)
		s.kv.Share(pl.attachFrom.Seq, sl.seq, pl.attachP)
		sl.tokens = slices.Clone(t.req.Prompt[:pl.attachP])
		s.attach(sl, pl.attachTo, pl.attachP)
	case pl.cpP > 0:
		s.resetSlot(sl)
		s.kv.Share(pl.cpFrom, sl.seq, pl.cpP)
		sl.tokens = slices.Clone(t.req.Prompt[:pl.cpP])
		s.poolsUsed(sl.seq, pl.cpP)
	case pl.reused, sl.session != "" && sl.session == t.req.SessionID:
		s.truncate(sl, pl.keep)
		if pl.reused {
			s.poolsUsed(sl.seq, pl.keep)
		}
	default:
		s.resetSlot(sl)
	}
	if t.kind == kindGenerate {
		s.bind(sl, t.req.SessionID)
		s.samplers = append(s.samplers, SamplerOp{Task: t.id, Params: t.req.Sampling, Logprobs: t.req.Logprobs, History: t.req.Prompt})
		t.cacheN = len(sl.tokens)
		if pl.reused {
			s.cacheHits += int64(t.cacheN)
		}
		t.ewma = tps.NewEWMA(s.cfg.TPSTau)
		t.spec = s.newSpecSession()
		t.shadow = tps.NewEWMA(s.cfg.TPSTau)
		s.adm.SessionSeated(t.req.SessionID, s.now)
	}
	sl.task = t
	sl.lastUsed = s.now
	t.slot = sl
	t.admitted = s.now
	s.running = append(s.running, t)
	s.progressAt = s.now
	if t.kind == kindGenerate {
		if !s.lookUp(t, sl) {
			s.planLoad(t, sl)
		}
		s.startSettle(t)
	} else if !t.prefilling() {
		s.poolMaterialized(t) // all of it was resident: nothing to prefill
	}
}

func commonPrefix(a, b []Token) int { return pool.CommonPrefix(a, b) }

// attachLen is how much of pool p a request can borrow: the prefix its prompt shares
// with p (capped by shared_prefix_n_tokens), less the last prompt token, which must be
// decoded for its logits.
func attachLen(p *pool.Pool, req Request) int {
	P := min(commonPrefix(p.Tokens, req.Prompt), len(req.Prompt)-1)
	if req.SharedPrefixN != nil {
		P = min(P, *req.SharedPrefixN)
	}
	return P
}

// advance does what the passing of time does (message Tick, and the start of Plan):
// expiry and reclaim, settle windows, held requests, then admission of waiting tasks.
func (s *Scheduler) advance() {
	s.expire()
	s.settle()
	s.releaseGated()
	s.admit()
	s.deadlines()
	s.prefetchExpected()
}

// deadlines ends the waits past Config.QueueTimeout: a request fails with
// ErrQueueTimeout, a pool's creation is abandoned with it (so are requests that named
// it by id; by key they run unpooled), a restore goes back to evicted (the requests
// that need it restart it, or time out themselves). It runs after admit, so a task
// whose room came at its deadline still runs, and admits again when it dropped
// anything: the head of the queue gone, those behind it may fit.
func (s *Scheduler) deadlines() {
	if s.cfg.QueueTimeout <= 0 {
		return
	}
	dropped := false
	for _, t := range slices.Clone(s.queue) {
		since := t.queued
		if s.progressAt.After(since) {
			since = s.progressAt
		}
		if s.now.Sub(since) < s.cfg.QueueTimeout || s.tasks[t.id] != t {
			continue
		}
		s.queueTimeouts++
		s.unqueue(t, FinishError, fmt.Errorf("%w: waited %s for %s, %s of it with no progress on the server's work (queue timeout %s)", ErrQueueTimeout,
			s.now.Sub(t.queued).Round(time.Millisecond), waitPhrase(t.wait), s.now.Sub(since).Round(time.Millisecond), s.cfg.QueueTimeout))
		dropped = true
	}
	if dropped {
		s.admit()
	}
}

// waitPhrase says a wait reason in words, for errors.
func waitPhrase(reason string) string {
	switch reason {
	case WaitPool:
		return "its pool to be built"
	case WaitPrefix:
		return "a running request's prefix"
	case WaitSession:
		return "its session's running turn"
	case WaitSequence:
		return "a sequence (every one is running)"
	case WaitCells:
		return "KV cells held by running requests or pinned pools"
	case WaitFloor:
		return "its pool's running sessions, which one more would slow under the pool's floor"
	}
	return "the request ahead of it, which waits for KV cells"
}

// Plan builds the next step: one decode token for every generating task, then prompt
// chunks in admission order with what is left of the batch (chunked prefill).
func (s *Scheduler) Plan(now time.Time) Plan {
	s.draftsIn = false // the next plan has a draft round of its own
	s.now = now
	s.planAt = now
	s.advance()
	s.inflight = s.inflight[:0]
	var batch []BatchEntry
	budget := s.cfg.NBatch
	// A restore or load planned in this step writes its cells before the batch runs,
	// though the cell tree counts them only once its answer comes: they count as
	// planned, here and in every freeCells below (else a decode token beside a restore
	// that filled the cache found "room" the restore had taken, and the batch failed).
	pending := s.tierPending() + s.loadPending()
	free := s.kv.Room(pending)
	planned := 0
	// Sessions throttled toward their pool's floor skip this step (throttle.go).
	s.throttleSkips()
	// decoders still to plan: each needs one token of the budget and one cell, which
	// drafts never take from them.
	decoders := 0
	for _, t := range s.running {
		if t.status == statusDecoding && !t.skipNow {
			decoders++
		}
	}
	// spare is what drafts may use: cells free now beyond those promised to prompts
	// being prefilled, so a draft never makes a prefill chunk evict anything.
	spare := 0
	if s.cfg.Spec.On() {
		spare = free - s.reservedPrefill()
	}
	// The step's expected tokens and rows so far, for the cost-aware draft limit:
	// every decoder's token, and the drafts planned and expected to land.
	specGain, specRows := float64(decoders), float64(decoders)
	for _, t := range slices.Clone(s.running) {
		if t.status != statusDecoding || t.skipNow {
			continue
		}
		decoders--
		if free == 0 {
			free = s.freeCells(1, nil, pending+planned, t.grace)
		}
		if free == 0 {
			// Every cell is held by a running task or a pool: stop cleanly rather than shift.
			s.finish(t, FinishLength, true, nil)
			continue
		}
		pos := len(t.slot.tokens)
		batch = append(batch, BatchEntry{Token: t.next, Pos: pos, Seq: t.slot.seq, Sample: true, Task: t.id})
		f := inflight{t: t, n: 1, decode: true, sample: true}
		free--
		spare--
		planned++
		budget--
		if s.specOn(t) && t.spec.wait > 0 {
			t.spec.wait--
		} else if s.specOn(t) {
			// Drafts use what the other decoders leave of the budget and spare cells,
			// which idle sequences' tails give up when there are too few (draftRoom).
			k := min(s.specBudget(t), budget-decoders)
			probe := false
			if c := s.specCostCap(t, k, specGain, specRows); c > 0 {
				k = c
			} else if t.spec.idle >= specProbeEvery {
				k, probe = min(k, specProbeLen), true // a probe: does t copy again?
			} else {
				k = 0
			}
			t.spec.idle++
			d := s.specDraft(t, k, probe)
			if room := spare - decoders; len(d) > room {
				got := s.draftRoom(len(d) - room)
				free += got
				spare += got
				if n := spare - decoders; n < len(d) {
					d = d[:max(n, 0)]
					if len(d) < s.draftMin(t) {
						d = nil
					}
				}
			}
			if len(d) > 0 {
				t.spec.idle = 0
				specGain += t.spec.expected(len(d))
				specRows += float64(len(d))
				for i, tok := range d {
					batch = append(batch, BatchEntry{Token: tok, Pos: pos + 1 + i, Seq: t.slot.seq, Sample: true, Task: t.id, Draft: true})
				}
				f.drafts, f.n = d, 1+len(d)
				free -= len(d)
				spare -= len(d)
				planned += len(d)
				budget -= len(d)
			}
		}
		s.inflight = append(s.inflight, f)
	}
	for _, t := range s.running {
		if budget == 0 {
			break
		}
		if t.status != statusPrefilling || !t.prefilling() {
			continue
		}
		have := len(t.slot.tokens)
		k := min(len(t.req.Prompt)-have, budget)
		if free < k {
			free = s.freeCells(k, nil, pending+planned, t.grace)
		}
		k = min(k, free)
		if k == 0 {
			break
		}
		last := have+k == len(t.req.Prompt)
		sample := last && t.kind == kindGenerate
		for j := range k {
			p := have + j
			batch = append(batch, BatchEntry{Token: t.req.Prompt[p], Pos: p, Seq: t.slot.seq, Sample: sample && j == k-1, Task: t.id})
		}
		s.inflight = append(s.inflight, inflight{t: t, n: k, sample: sample})
		budget -= k
		free -= k
		planned += k
	}
	for _, t := range s.running {
		t.spec.endStep() // the context moves on with this step
		t.skipNow = false
	}
	if len(batch) == 0 && len(s.skipped) > 0 {
		// Nothing else runs this step, so the skips would gain nobody (and an empty
		// batch would idle the loop): plan the skipped sessions' tokens after all.
		skipped := slices.Clone(s.skipped)
		s.unskip()
		for _, t := range skipped {
			if free == 0 {
				free = s.freeCells(1, nil, pending+planned, t.grace)
			}
			if free == 0 {
				s.finish(t, FinishLength, true, nil)
				continue
			}
			batch = append(batch, BatchEntry{Token: t.next, Pos: len(t.slot.tokens), Seq: t.slot.seq, Sample: true, Task: t.id})
			s.inflight = append(s.inflight, inflight{t: t, n: 1, decode: true, sample: true})
			free--
			planned++
		}
	}
	p := Plan{Samplers: s.samplers, SeqOps: s.ops, Batch: batch}
	s.samplers, s.ops = nil, nil
	return p
}

// Commit applies the result of decoding the last planned batch.
func (s *Scheduler) Commit(sampled []Sampled, err error, now time.Time) {
	s.now = now
	in := s.inflight
	s.inflight = nil
	if len(in) > 0 {
		s.progressAt = now // the step computed something: the queue's deadlines restart
	}
	if err != nil {
		s.snapDue = true
		s.skipped = s.skipped[:0]
		for _, f := range in {
			if f.t.slot == nil {
				continue
			}
			// The cells this batch may have written are not trusted: drop them.
			s.kv.Free(f.t.slot.seq, len(f.t.slot.tokens))
			s.finish(f.t, FinishError, false, fmt.Errorf("%w: %v", ErrDecode, err))
		}
		return
	}
	si := 0
	for i, f := range in {
		if f.decode && len(f.drafts) > 0 && si < len(sampled) {
			in[i].accepted = specAccepted(f.drafts, sampled[si:min(si+1+len(f.drafts), len(sampled))])
		}
		if f.sample {
			si += 1 + len(f.drafts)
		}
	}
	s.measureStep(in, now)
	s.throttleCommit(in, now)
	si = 0
	for _, f := range in {
		t := f.t
		if f.decode {
			if si+f.n > len(sampled) {
				s.kv.Free(t.slot.seq, len(t.slot.tokens))
				s.finish(t, FinishError, false, fmt.Errorf("%w: backend returned %d samples for a batch that asked for more", ErrDecode, len(sampled)))
				continue
			}
			s.commitDecode(f, sampled[si:si+f.n], now)
			si += f.n
			continue
		} else {
			have := len(t.slot.tokens)
			s.kv.Allocate(t.slot.seq, t.req.Prompt[have:have+f.n])
			t.slot.tokens = append(t.slot.tokens, t.req.Prompt[have:have+f.n]...)
			if t.kind == kindMaterialize {
				if !t.prefilling() {
					s.poolMaterialized(t)
				}
				continue
			}
		}
		if f.sample {
			if si >= len(sampled) {
				s.finish(t, FinishError, false, fmt.Errorf("%w: backend returned %d samples for a batch that asked for more", ErrDecode, len(sampled)))
				continue
			}
			s.onToken(t, sampled[si])
			si++
		}
	}
}

// commitDecode applies one decode token and its drafts (speculative decoding): the
// decoded token joins the sequence, then each sample in turn is a generated token, and
// while the task goes on and the sample confirms the next draft, that draft (already
// in the cache) joins the sequence too. The cells of drafts past the first mismatch, or
// past where the task ended, are removed with the next step's operations; the cell tree
// never held them.
func (s *Scheduler) commitDecode(f inflight, smp []Sampled, now time.Time) {
	t, sl := f.t, f.t.slot
	seq, pos := sl.seq, len(sl.tokens)
	s.kv.Allocate(seq, []Token{t.next})
	sl.tokens = append(sl.tokens, t.next)
	k := len(f.drafts)
	a := specAccepted(f.drafts, smp)
	if k > 0 {
		t.spec.drafted += k
		t.spec.accepted += a
		s.specAdapt(t, k, a)
		s.obs = append(s.obs, Observation{Kind: ObsDraft, Pool: t.poolID(), Drafted: k, Accepted: a})
	}
	// The step made a+1 tokens (the EWMA takes them in one observation: it folds
	// observations at one instant), and they share its time for inter-token latency.
	t.ewma.Observe(a+1, now)
	t.shadow.Observe(a+1, now.Add(s.throttleLead[t.poolID()]))
	d := now.Sub(t.lastTok) / time.Duration(a+1)
	t.lastTok = now
	kept := pos + 1
	for i := 0; i <= a; i++ {
		s.obs = append(s.obs, Observation{Kind: ObsTokenLatency, D: d})
		s.onToken(t, smp[i])
		if t.status == statusDone || i == a {
			break // ended (its sequence may be gone), or the step's last token
		}
		// smp[i] == f.drafts[i]: that draft's cell at pos+1+i is now the sequence's.
		s.kv.Allocate(seq, f.drafts[i:i+1])
		sl.tokens = append(sl.tokens, f.drafts[i])
		kept++
	}
	if kept < pos+1+k && len(sl.tokens) == kept {
		// Not the cell tree's: only the backend's cache holds these.
		s.kv.Discard(seq, kept)
	}
}

func (s *Scheduler) onToken(t *task, smp Sampled) {
	if t.firstTok.IsZero() {
		t.firstTok, t.lastTok = s.now, s.now
		t.ewma.Start(s.now)
		t.shadow.Start(s.now.Add(s.throttleLead[t.poolID()]))
		s.obs = append(s.obs, Observation{Kind: ObsTTFT, Pool: t.poolID(), D: s.now.Sub(t.submitted)})
	}
	if s.vocab.IsEOG(smp.Token) && !t.req.IgnoreEOS {
		s.finish(t, FinishStop, false, nil)
		return
	}
	t.generated++
	text, stopWord := t.text.push(s.vocab.Piece(smp.Token))
	ev := Event{Task: t.id, Text: text, Pool: t.poolID()}
	if t.req.Logprobs {
		ev.Tokens = []TokenLogprob{{Token: smp.Token, Logprob: smp.Logprob, Top: smp.Top}}
	}
	if text != "" || ev.Tokens != nil {
		s.events = append(s.events, ev)
	}
	switch {
	case stopWord != "":
		t.stopWord = stopWord
		s.finish(t, FinishStop, false, nil)
	case t.req.MaxTokens > 0 && t.generated >= t.req.MaxTokens:
		s.finish(t, FinishLength, false, nil)
	case len(t.slot.tokens) >= s.cfg.NCtx:
		// The next token would sit at position n_ctx: stop, never shift the context.
		s.finish(t, FinishLength, true, nil)
	default:
		t.next = smp.Token
		s.setStatus(t, statusDecoding)
	}
}

// finish ends a running task and releases its sequence: a session keeps its KV for the
// next turn (unless its pool was released), an anonymous task's cells are freed at once.
func (s *Scheduler) finish(t *task, reason string, truncated bool, err error) {
	sl := t.slot
	if t.kind == kindMaterialize {
		s.removeRunning(t)
		s.events = append(s.events, Event{Task: t.id, Done: true, Finish: reason, Err: err, Pool: t.pool.ID})
		s.abandonPool(t.pool, t.restore, cmp.Or(err, ErrCancelled))
		return
	}
	stats := Stats{PromptN: len(t.req.Prompt) - t.cacheN - t.restoredN, CacheN: t.cacheN, RestoredN: t.restoredN, PredictedN: t.generated, Seq: sl.seq,
		DraftN: t.spec.drafted, DraftAccepted: t.spec.accepted, DraftFiltered: t.spec.filtered, ThrottledSteps: t.throttled}
	if sl.base != nil {
		stats.Pool = sl.base.ID
		stats.Shared = sl.shared
	}
	if !t.pacedAt.IsZero() {
		stats.Paced = t.admitted.Sub(t.pacedAt)
	}
	if !t.firstTok.IsZero() {
		stats.PromptTime = t.firstTok.Sub(t.admitted)
		stats.PredictTime = s.now.Sub(t.firstTok)
	} else {
		stats.PromptTime = s.now.Sub(t.admitted)
	}
	if t.status == statusLoading {
		// Its load is planned or being read: whatever it writes beyond what the cell
		// tree counts goes with the next step's operations (as a rejected draft's cells).
		t.loadSegs = nil
		s.kv.Discard(sl.seq, len(sl.tokens))
	}
	stats.TPS = t.ewma.Rate()
	stats.Ctx = s.sessionContext(sl)
	s.events = append(s.events, Event{Task: t.id, Text: t.text.flush(), Done: true, Finish: reason, StopWord: t.stopWord, Truncated: truncated, Err: err, Stats: stats, Pool: stats.Pool})
	s.samplers = append(s.samplers, SamplerOp{Task: t.id, Free: true})
	s.obs = append(s.obs, Observation{Kind: ObsQuery, Pool: stats.Pool, PromptTokens: len(t.req.Prompt), CachedTokens: t.cacheN})
	s.turnEnded(t, sl)
	s.writeThrough(t, sl)
	s.removeRunning(t)
	s.progressAt = s.now
	switch {
	case sl.base != nil && sl.base.State == pool.Released:
		s.evictSlot(sl)
	case sl.session == "" && s.cfg.PrefixCache:
		// Kept as cache: its cells stay until they or its sequence are needed. It no
		// longer counts as a session of its pool (the pool's cells it shares stay
		// shared by membership, whoever goes first).
		s.detach(sl)
	case sl.session == "":
		s.evictSlot(sl)
	}
}

func (s *Scheduler) removeRunning(t *task) {
	sl := t.slot
	sl.task = nil
	sl.lastUsed = s.now
	t.slot = nil
	s.running = slices.DeleteFunc(s.running, func(r *task) bool { return r == t })
	s.dropTask(t)
	// A task ended by Plan may still be listed for this step's batch: drop it.
	s.inflight = slices.DeleteFunc(s.inflight, func(f inflight) bool { return f.t == t })
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

// measureStep feeds the aggregate decode and prompt rates with one step's tokens.
// After an idle gap the averages restart, so idle time is not read as slowness.
func (s *Scheduler) measureStep(in []inflight, now time.Time) {
	gen, prompt := 0, 0
	for _, f := range in {
		switch {
		case f.decode:
			gen += 1 + f.accepted // accepted drafts are tokens generated in this step
		case f.t.kind == kindGenerate && f.sample:
			gen++ // the first token, sampled from the prompt's last position
			prompt += f.n
		default:
			prompt += f.n
		}
	}
	for _, e := range []struct {
		ewma *tps.EWMA
		n    int
	}{{&s.agg, gen}, {&s.aggPrompt, prompt}} {
		if e.n == 0 {
			continue
		}
		if now.Sub(e.ewma.Last()) > s.cfg.TPSTau {
			*e.ewma = tps.NewEWMA(s.cfg.TPSTau)
			e.ewma.Start(s.planAt)
		}
		e.ewma.Observe(e.n, now)
	}
}
