package engine

import (
	"fmt"
	"slices"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
	"github.com/polykv/polykv/internal/tps"
)

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
