package engine

import (
	"fmt"
	"time"

	"github.com/polykv/polykv/internal/admission"
)

// Msg is one input to the scheduler. These types are the complete list of what can
// change the scheduler's state from outside (besides Plan and Commit, which the engine
// loop drives): every request, cancellation and pool or admission command is one of
// them, handed to Scheduler.Step with the time it happened. A log of (time, Msg) pairs
// and backend results replays a run exactly.
type Msg interface{ isMsg() }

// Submit queues a generation request. Result: Task and Gate, or Err when it is refused
// (empty or too long prompt, pool not attachable, queue full, enforced pool saturated).
type Submit struct{ Req Request }

// Cancel ends a task: a waiting one leaves the queue, a running one stops and frees its
// sequence before the next step. An unknown task is ignored (it already ended).
type Cancel struct{ Task TaskID }

// CreatePool makes a root or, with Spec.HasParent, a child pool. Result: Pool, and Task,
// the materialization whose Done event says when the pool can be attached (0 when it is
// resident at once, built zero-copy from a session or from cells already in the cache).
type CreatePool struct{ Spec PoolSpec }

// ReleasePool releases a pool: no new attaches; cells are reclaimed once unused and past
// the grace time.
type ReleasePool struct{ Pool int }

// PinPool sets (Pin) or clears the user pin.
type PinPool struct {
	Pool int
	Pin  bool
}

// EvictPool drops a pool's cells now, keeping its tokens for a transparent restore.
type EvictPool struct{ Pool int }

// FlushPool drops the KV of the idle sessions attached to a pool. Result: Flushed.
type FlushPool struct{ Pool int }

// SetAdmission changes the fields of a pool's admission policy that Patch sets.
// Result: Admission, the policy now in force.
type SetAdmission struct {
	Pool  int
	Patch admission.Patch
}

// QueryCapacity asks for a pool's admission verdict now (it depends on the clock, so
// it is a message, not a snapshot read). Result: Capacity.
type QueryCapacity struct {
	Pool           int
	ExpectedTokens int
	Session        string
}

// Reserve asks for an atomic admission reservation on a pool (a fan-out branch's
// place): granted reservations count as warming sessions in every later verdict until
// a request carrying the id uses it, it is released or it expires. TTL 0: the default.
// Result: Reservation.
type Reserve struct {
	Pool           int
	TTL            time.Duration
	ExpectedTokens int
}

// ReleaseReservation gives a reservation back unused.
type ReleaseReservation struct {
	Pool int
	ID   string
}

// Restored is the driver's answer to a planned OpRestore (Config.Tier): Err nil when
// the pool's own cells were loaded into its sequence, else why not (the sequence then
// holds nothing and the pool is prefilled). The engine loop sends it right after
// applying the plan's operations, before the batch runs.
type Restored struct {
	Pool int
	Err  error
}

// RecoverPool puts back a pool recorded by an earlier run (package tier) under its old
// id, evicted: parents first. InTier: its KV is in the tier (else, a damaged or missing
// entry, it is built again by a prefill). Pin restores it at once. Result: Pool.
type RecoverPool struct {
	ID, Parent, D int
	Tokens        []Token
	Pin           bool
	InTier        bool
}

// ProbeFits asks llama.cpp itself whether N more cells fit, written to the empty
// sequence Seq as copies of token Tok, beside what the cache holds (diagnostics and
// tests of the cell accounting). The backend must declare a CellProber (Caps.Probe).
// Result: Fits, or Err. It plans an OpProbe that the driver runs at once.
type ProbeFits struct {
	Seq, N int
	Tok    Token
}

// Probed is the driver's answer to an OpProbe.
type Probed struct {
	Fits bool
	Err  error
}

// Drafted is the driver's answer to a plan's Drafts: the backend drafter's proposals
// (none for a want it could not draft). The scheduler keeps them for the plan it
// makes next (draft.go).
type Drafted struct{ Props []DraftProposal }

// stopping: the engine shuts down; the operations planned since the last step are
// handed out to run at once.
type stopping struct{}

// Tick lets time pass: idle sessions expire, released pools are reclaimed, settle
// windows close and held requests are let in or refused. Plan does the same first.
type Tick struct{}

func (Submit) isMsg()             {}
func (Cancel) isMsg()             {}
func (CreatePool) isMsg()         {}
func (ReleasePool) isMsg()        {}
func (PinPool) isMsg()            {}
func (EvictPool) isMsg()          {}
func (FlushPool) isMsg()          {}
func (SetAdmission) isMsg()       {}
func (QueryCapacity) isMsg()      {}
func (Tick) isMsg()               {}
func (Reserve) isMsg()            {}
func (ReleaseReservation) isMsg() {}
func (Restored) isMsg()           {}
func (RecoverPool) isMsg()        {}
func (ProbeFits) isMsg()          {}
func (Probed) isMsg()             {}
func (Drafted) isMsg()            {}
func (TierRead) isMsg()           {}
func (stopping) isMsg()           {}

// Result is the scheduler's answer to one message; which fields are set depends on the
// message (see each type). Err is the refusal, mapped to an HTTP status by the API.
type Result struct {
	Task        TaskID
	Gate        Gate
	Pool        int
	Flushed     Flushed
	Capacity    CapacityReport
	Admission   admission.Policy
	Reservation ReservationReport
	// Tokens and Data: SaveSlot's sequence; Erased: EraseSlot's count.
	Tokens []Token
	Data   []byte
	Erased int
	// Fits: ProbeFits's answer.
	Fits bool
	Err  error
}

// Flushed is what FlushPool freed.
type Flushed struct {
	Sessions int
	Cells    int
}

// Step applies one message at time now. It is the scheduler's only entry for inputs;
// the sequence operations and samplers it plans run before the next batch (Plan).
func (s *Scheduler) Step(now time.Time, m Msg) Result {
	switch m := m.(type) {
	case Drafted:
		// Part of planning the coming step, not news from outside: no snapshot is due.
		s.drafted(m)
		return Result{}
	case TierChanged:
		// The index below the cells follows the tier: nothing a reader sees changes
		// at once (a waiting request's residency is republished with the next
		// snapshot), so the store's frequent reports force none.
		s.now = now
		s.tierChanged(m)
		return Result{}
	}
	s.now = now
	s.snapDue = true // a reader must see the message's effect (Ready)
	switch m := m.(type) {
	case Submit:
		id, g, err := s.submit(m.Req)
		return Result{Task: id, Gate: g, Err: err}
	case Cancel:
		s.cancel(m.Task)
	case CreatePool:
		id, task, err := s.createPool(m.Spec)
		return Result{Pool: id, Task: task, Err: err}
	case ReleasePool:
		return Result{Pool: m.Pool, Err: s.releasePool(m.Pool)}
	case PinPool:
		return Result{Pool: m.Pool, Err: s.pinPool(m.Pool, m.Pin)}
	case EvictPool:
		return Result{Pool: m.Pool, Err: s.evictPoolByID(m.Pool)}
	case FlushPool:
		n, cells, err := s.flushPool(m.Pool)
		return Result{Pool: m.Pool, Flushed: Flushed{Sessions: n, Cells: cells}, Err: err}
	case SetAdmission:
		p, err := s.setAdmission(m.Pool, m.Patch)
		return Result{Pool: m.Pool, Admission: p, Err: err}
	case QueryCapacity:
		c, err := s.capacity(m.Pool, m.ExpectedTokens, m.Session)
		return Result{Pool: m.Pool, Capacity: c, Err: err}
	case Reserve:
		rep, err := s.reserve(m.Pool, m.TTL, m.ExpectedTokens)
		return Result{Pool: m.Pool, Reservation: rep, Err: err}
	case ReleaseReservation:
		return Result{Pool: m.Pool, Err: s.releaseReservation(m.Pool, m.ID)}
	case Restored:
		s.restored(m)
		s.admit()
	case Loaded:
		s.loaded(m)
	case Found:
		s.found(m)
	case ExpectTurn:
		s.expectTurn(m)
	case RecoverPool:
		return Result{Pool: m.ID, Err: s.recoverPool(m)}
	case SaveSlot:
		toks, err := s.saveSlot(m)
		return Result{Tokens: toks, Err: err}
	case LoadSlot:
		return Result{Err: s.loadSlot(m)}
	case SlotDone:
		return s.slotDone(m)
	case ProbeFits:
		s.urgent = append(s.urgent, SeqOp{Kind: OpProbe, Seq: m.Seq, P1: m.N, Tok: m.Tok})
	case Probed:
		return Result{Fits: m.Fits, Err: m.Err}
	case TierRead:
		s.tierRead(m.Op)
	case stopping:
		// Operations planned since the last step still run: a pool recorded for
		// restarts (OpRecord) just before a clean shutdown is then on disk.
		s.urgent = append(s.urgent, s.ops...)
		s.ops = nil
	case EraseSlot:
		n, err := s.eraseSlot(m)
		return Result{Erased: n, Err: err}
	case Tick:
		s.advance()
	default:
		return Result{Err: fmt.Errorf("engine: unknown message %T", m)}
	}
	return Result{}
}
