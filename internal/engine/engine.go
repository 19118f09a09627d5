package engine

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Engine runs a Scheduler against a Backend on one goroutine, the only one that ever
// touches the backend. Other goroutines send it typed messages (Submit, CreatePool,
// Send) and read the immutable Snapshot it publishes; nothing else reaches in.
type Engine struct {
	inbox   chan envelope
	quit    chan struct{}
	stopped chan struct{}
	once    sync.Once
	snap    atomic.Pointer[Snapshot]
	obs     Observer
	lookup  atomic.Pointer[TierLookup]
	// changes are the tier's reports (TierChanged) not yet handed to the scheduler;
	// changed wakes the loop when the first one comes.
	changesMu sync.Mutex
	changes   []TierChange
	changed   chan struct{}
}

// TierLookup lists the segments of a prompt the tier holds, from position 0 (package
// tier's Store.Run): run on the goroutine that submits, it may do I/O.
type TierLookup func(prompt []Token) []Segment

// SetTierLookup makes every Submit ask f first which segments of its prompt the tier
// holds and tell the scheduler (Found) before the request, so that entries its index
// does not know (another replica's on a shared level) are loaded, not prefilled; a
// request seated after a wait in the queue asks again (OpLookup, Config.TierFleet).
func (e *Engine) SetTierLookup(f TierLookup) { e.lookup.Store(&f) }

// TierChanged takes the tier's report that the entry of positions [d, len(tokens))
// named by tokens landed in this replica's tier or left it (package tier's Observer):
// the scheduler's index of what lives below the cells follows it (message
// TierChanged). The store calls it with its lock held, so it only queues the change
// and wakes the engine loop, which hands the queued changes over in order.
func (e *Engine) TierChanged(d int, tokens []int32, stored bool) {
	e.changesMu.Lock()
	e.changes = append(e.changes, TierChange{Seg: Segment{Start: d, Tokens: tokens}, Stored: stored})
	e.changesMu.Unlock()
	select {
	case e.changed <- struct{}{}:
	default:
	}
}

// takeChanges hands over the tier's reports queued since the last call.
func (e *Engine) takeChanges() []TierChange {
	e.changesMu.Lock()
	defer e.changesMu.Unlock()
	c := e.changes
	e.changes = nil
	return c
}

// lookupOp answers an OpLookup (driver.lookup): the lookup runs on a goroutine of its
// own (it may do I/O: a stat per chunk on a shared directory, a round trip to a remote
// store) and its answer comes back as a message. Without a lookup (SetTierLookup) the
// answer, nothing found, is given at once.
func (e *Engine) lookupOp(op SeqOp) (Found, bool) {
	f := e.lookup.Load()
	if f == nil {
		return Found{Task: op.Task, Seq: op.Seq}, false
	}
	go func() {
		e.send(envelope{msg: Found{Segs: (*f)(op.Tokens), Task: op.Task, Seq: op.Seq}})
	}()
	return Found{}, true
}

// envelope carries one message to the engine goroutine; reply (nil for a cancel) gets
// the scheduler's Result and, for a submit or a pool materialization, the task's stream.
type envelope struct {
	msg   Msg
	reply chan reply
}

type reply struct {
	res    Result
	stream *Stream
}

// CellProber is a backend's ability to answer ProbeFits (Caps.Probe).
type CellProber interface {
	ProbeFits(seq, n int, tok Token) (bool, error)
}

// Stream delivers one task's events. Reading never blocks the engine: events queue in
// the stream until read.
type Stream struct {
	id     TaskID
	eng    *Engine
	mu     sync.Mutex
	events []Event
	notify chan struct{}
	ended  bool
	// collect: the reader only wants the whole result, so it is woken once, at the end.
	// Waking a goroutine per token steals a core from llama.cpp's threads.
	collect bool
}

func newStream(id TaskID, eng *Engine) *Stream {
	return &Stream{id: id, eng: eng, notify: make(chan struct{}, 1)}
}

func (s *Stream) push(ev Event) {
	s.mu.Lock()
	s.events = append(s.events, ev)
	quiet := s.collect && !ev.Done
	s.mu.Unlock()
	if quiet {
		return
	}
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// ID is the task's id.
func (s *Stream) ID() TaskID { return s.id }

// Next returns the next event, waiting for it. After the Done event it returns
// ok=false. If ctx ends first the task is cancelled and ctx's error returned.
func (s *Stream) Next(ctx context.Context) (Event, bool, error) {
	for {
		s.mu.Lock()
		if len(s.events) > 0 {
			ev := s.events[0]
			s.events = s.events[1:]
			if ev.Done {
				s.ended = true
			}
			s.mu.Unlock()
			return ev, true, nil
		}
		ended := s.ended
		s.mu.Unlock()
		if ended {
			return Event{}, false, nil
		}
		select {
		case <-s.notify:
		case <-ctx.Done():
			s.Cancel()
			return Event{}, false, ctx.Err()
		case <-s.eng.stopped:
			s.mu.Lock()
			pending := len(s.events) > 0
			s.mu.Unlock()
			if !pending {
				return Event{Task: s.id, Done: true, Finish: FinishError, Err: ErrEngineClosed}, true, nil
			}
		}
	}
}

// Collect waits for the task to end and returns all its events, the Done event last.
// If ctx ends first the task is cancelled and ctx's error returned.
func (s *Stream) Collect(ctx context.Context) ([]Event, error) {
	s.mu.Lock()
	s.collect = true
	s.mu.Unlock()
	var out []Event
	for {
		ev, ok, err := s.Next(ctx)
		if err != nil {
			return out, err
		}
		if !ok {
			return out, nil
		}
		out = append(out, ev)
		if ev.Done {
			return out, nil
		}
	}
}

// Cancel stops the task (idempotent).
func (s *Stream) Cancel() { s.eng.send(envelope{msg: Cancel{Task: s.id}}) }

// New starts an engine over sched and be. It owns both until Close. obs (optional)
// receives the scheduler's measurements after each step.
func New(sched *Scheduler, be Backend, obs Observer) *Engine {
	e := &Engine{inbox: make(chan envelope, 1024), quit: make(chan struct{}), stopped: make(chan struct{}), obs: obs, changed: make(chan struct{}, 1)}
	d := driver{be: be, caps: be.Caps()}
	d.lookup = e.lookupOp
	sched.useBackend(d.caps)
	e.snap.Store(sched.Snapshot(time.Now()))
	go e.run(sched, d)
	return e
}

func (e *Engine) send(m envelope) bool {
	select {
	case e.inbox <- m:
		return true
	case <-e.stopped:
		return false
	}
}

// call sends m and waits for its reply. If ctx ends first the reply still comes (the
// message was handled or will be); a stream it carries is cancelled.
func (e *Engine) call(ctx context.Context, m envelope) (reply, error) {
	m.reply = make(chan reply, 1)
	if !e.send(m) {
		return reply{}, ErrEngineClosed
	}
	select {
	case r := <-m.reply:
		return r, nil
	case <-e.stopped:
		return reply{}, ErrEngineClosed
	case <-ctx.Done():
		go func() {
			if r := <-m.reply; r.stream != nil {
				r.stream.Cancel()
			}
		}()
		return reply{}, ctx.Err()
	}
}

// Submit queues req and returns its event stream and what an enforced pool's gate
// decided, or the scheduler's refusal.
func (e *Engine) Submit(ctx context.Context, req Request) (*Stream, Gate, error) {
	if f := e.lookup.Load(); f != nil && len(req.Prompt) > 0 {
		if segs := (*f)(req.Prompt); len(segs) > 0 {
			e.send(envelope{msg: Found{Segs: segs}})
		}
	}
	r, err := e.call(ctx, envelope{msg: Submit{Req: req}})
	if err != nil {
		return nil, Gate{}, err
	}
	return r.stream, r.res.Gate, r.res.Err
}

// CreatePool creates a pool and waits until it is materialized (attachable). If ctx
// ends first the materialization is cancelled and nothing is left behind.
func (e *Engine) CreatePool(ctx context.Context, spec PoolSpec) (int, Stats, error) {
	r, err := e.call(ctx, envelope{msg: CreatePool{Spec: spec}})
	if err != nil {
		return 0, Stats{}, err
	}
	if r.res.Err != nil || r.stream == nil {
		return r.res.Pool, Stats{Pool: r.res.Pool}, r.res.Err
	}
	defer r.stream.Cancel()
	evs, err := r.stream.Collect(ctx)
	if err != nil {
		return 0, Stats{}, err
	}
	last := evs[len(evs)-1]
	return r.res.Pool, last.Stats, last.Err
}

// Send hands a command (any Msg but Submit and CreatePool, whose tasks come with a
// stream) to the scheduler and returns its Result; the Snapshot read after Send returns
// already shows the command's effect.
func (e *Engine) Send(ctx context.Context, m Msg) (Result, error) {
	switch m.(type) {
	case Submit, CreatePool:
		return Result{}, fmt.Errorf("engine: send %T through Submit or CreatePool", m)
	}
	r, err := e.call(ctx, envelope{msg: m})
	if err != nil {
		return Result{}, err
	}
	return r.res, nil
}

// Probe asks the backend whether p.N more cells fit for p.Seq (see ProbeFits).
func (e *Engine) Probe(ctx context.Context, p ProbeFits) (bool, error) {
	r, err := e.call(ctx, envelope{msg: p})
	if err != nil {
		return false, err
	}
	return r.res.Fits, r.res.Err
}

// Snapshot is the state published after the last message or step. It never blocks.
func (e *Engine) Snapshot() *Snapshot { return e.snap.Load() }

// Close stops the engine after the current step; running tasks end with ErrEngineClosed.
func (e *Engine) Close() {
	e.once.Do(func() { close(e.quit) })
	<-e.stopped
}

// Done is closed once the engine goroutine has exited.
func (e *Engine) Done() <-chan struct{} { return e.stopped }

func (e *Engine) run(sched *Scheduler, d driver) {
	// The backend's C state is used from this thread only.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer close(e.stopped)
	l := &loop{e: e, sched: sched, d: d, streams: map[TaskID]*Stream{}}
	// A periodic wake-up lets time pass (expiry, reclaim, held requests) while no
	// request arrives.
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	var ready <-chan SeqOp // never receives without an AsyncTier
	if d.caps.AsyncTier != nil {
		ready = d.caps.AsyncTier.TierReady()
	}
	idle := true
	for {
		if idle {
			select {
			case m := <-e.inbox:
				l.handle(m)
			case op := <-ready:
				l.handle(envelope{msg: TierRead{Op: op}})
			case <-e.changed:
				l.handle(envelope{msg: TierChanged{Changes: e.takeChanges()}})
			case <-tick.C:
				l.handle(envelope{msg: Tick{}})
			case <-e.quit:
				e.shutdown(sched, d, l.streams)
				return
			}
		}
		for drained := false; !drained; {
			select {
			case m := <-e.inbox:
				l.handle(m)
			case op := <-ready:
				l.handle(envelope{msg: TierRead{Op: op}})
			case <-e.changed:
				l.handle(envelope{msg: TierChanged{Changes: e.takeChanges()}})
			case <-e.quit:
				e.shutdown(sched, d, l.streams)
				return
			default:
				drained = true
			}
		}
		idle = l.step()
	}
}

// loop is the engine goroutine's state: the scheduler, the driver, and the streams of
// the tasks that have one.
type loop struct {
	e       *Engine
	sched   *Scheduler
	d       driver
	streams map[TaskID]*Stream
}

// deliver hands a Ready's outputs out: measurements to the Observer, the snapshot
// (when due) to readers, then the events to their streams: publishing first means a
// reader woken by an event already sees what it did in the snapshot.
func (l *loop) deliver(rd Ready) {
	if l.e.obs != nil {
		Observe(l.e.obs, rd.Observations)
	}
	if rd.Snapshot != nil {
		l.e.snap.Store(rd.Snapshot)
	}
	for _, ev := range rd.Events {
		if st, ok := l.streams[ev.Task]; ok {
			st.push(ev)
			if ev.Done {
				delete(l.streams, ev.Task)
			}
		}
	}
}

// handle steps one message. A message that needs the backend before its reply (a
// slot's bytes, a probe, a tier read that came in) finds its operations in the Ready
// that follows: they run, their answers go back through Step (filling the reply), and
// a second Ready hands out what the answers did.
func (l *loop) handle(m envelope) {
	now := time.Now() // the engine loop is the only reader of the clock
	r := reply{res: l.sched.Step(now, m.msg)}
	// A submitted request, or a pool's materialization: its events get a stream.
	if task := r.res.Task; r.res.Err == nil && task != 0 {
		r.stream = newStream(task, l.e)
		l.streams[task] = r.stream
	}
	rd := l.sched.Ready(now, false)
	if l.d.settle(l.sched, now, rd.Plan, &r.res) {
		l.deliver(rd)
		rd = l.sched.Ready(now, false)
	}
	l.deliver(rd)
	if m.reply != nil {
		m.reply <- r
	}
}

// step plans and runs one step: the draft round, the plan's operations and their
// answers, then the batch and its commit. It reports whether the loop may sleep until
// the next message (nothing ran and nothing changed).
func (l *loop) step() (idle bool) {
	sched, d := l.sched, l.d
	now := time.Now()
	rd := sched.Ready(now, true)
	if len(rd.Plan.Drafts) > 0 {
		// The draft round (draft.go): the drafter's proposals go back before the
		// step is planned.
		d.settle(sched, now, rd.Plan, nil)
		l.deliver(rd)
		now = time.Now()
		rd = sched.Ready(now, true)
	}
	p := rd.Plan
	answered := d.settle(sched, time.Now(), p, nil) // restores' answers, before the batch runs
	l.deliver(rd)
	if answered {
		l.deliver(sched.Ready(now, false)) // what the answers did
	}
	changed := len(p.SeqOps) > 0 || len(p.Samplers) > 0
	if len(p.Batch) == 0 {
		// A plan that only released sequences may let a waiting task start: plan again.
		return !changed
	}
	sampled, err := d.be.Decode(p.Batch)
	now = time.Now()
	sched.Commit(sampled, err, now)
	l.deliver(sched.Ready(now, false))
	return false
}

// TierBackend is a backend's ability (Caps.Tier) to move pools' KV to and from a tier
// below the cache (Config.Tier, issue 25).
type TierBackend interface {
	// Tier performs OpSpill, OpRestore, OpRecord or OpForget. For OpRestore the error
	// says why nothing was loaded (the sequence then holds nothing); the others report
	// their failures to the tier's counters, as nothing waits for them. A restore loads
	// the pool's own cells [D, L); with Config.Recurrent it also shares the parent's
	// [0, D) from op.Src (the scheduler then plans no seq_cp for them).
	Tier(op SeqOp) error
}

// SeqTierBackend is a tier's ability (Caps.SeqTier) to load the segments of sessions'
// and cached sequences' cells (issue 40, spill.go) that its Tier stored: Tier performs
// OpSave, OpDrop and OpPrefetch (their failures are the tier's to count: nothing waits
// for them), Load an OpLoad.
type SeqTierBackend interface {
	// Load loads op.Segs in order into op.Seq, which holds [0, op.P0): each segment
	// whole into a scratch sequence, then the positions op.Seq lacks (up to op.P1)
	// shared from it, until one fails or the run is done; the answer says how far it
	// got and which segment missed. On a failure op.Seq holds exactly [0, Loaded.N).
	// ErrTierPending (an AsyncTierBackend): bytes are being read, no answer yet.
	Load(op SeqOp) (Loaded, error)
}

// AsyncTierBackend is a tier's ability (Caps.AsyncTier) to read a restore's or a
// load's bytes off the engine goroutine, so that other sequences' steps do not wait on
// a disk: it answers such an OpRestore or OpLoad ErrTierPending and, once the bytes are
// in memory, sends the op on TierReady; the engine then applies it again (the load into
// llama.cpp, on the engine goroutine) if the pool or task still waits for it, or calls
// TierDiscard.
type AsyncTierBackend interface {
	TierReady() <-chan SeqOp
	TierDiscard(op SeqOp)
}

// ErrTierPending is an AsyncTierBackend's answer to an OpRestore whose bytes are being
// read: no Restored answer yet (the pool keeps waiting).
var ErrTierPending = errors.New("tier read in progress")

// shutdown ends the streams after running the operations planned since the last step
// (stopping): a pool recorded for restarts (OpRecord) just before a clean shutdown is
// then on disk.
func (e *Engine) shutdown(sched *Scheduler, d driver, streams map[TaskID]*Stream) {
	now := time.Now()
	sched.Step(now, stopping{})
	_ = d.apply(sched.Ready(now, false).Plan)
	for id, st := range streams {
		st.push(Event{Task: id, Done: true, Finish: FinishError, Err: ErrEngineClosed})
	}
}
