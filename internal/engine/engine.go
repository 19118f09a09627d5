package engine

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"time"
)

// Engine runs a Scheduler against a Backend on one goroutine, the only one that ever
// touches the backend. Other goroutines talk to it through messages.
type Engine struct {
	inbox   chan any
	quit    chan struct{}
	stopped chan struct{}
	once    sync.Once
}

type submitMsg struct {
	req   Request
	reply chan submitReply
}

type submitReply struct {
	id     TaskID
	stream *Stream
	gate   Gate
	err    error
}

type cancelMsg struct{ id TaskID }

type inspectMsg struct {
	fn   func(*Scheduler, Backend)
	done chan struct{}
}

type createPoolMsg struct {
	spec  PoolSpec
	reply chan poolReply
}

type poolReply struct {
	id     int
	stream *Stream
	err    error
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
func (s *Stream) Cancel() { s.eng.send(cancelMsg{id: s.id}) }

// New starts an engine over sched and be. It owns both until Close.
func New(sched *Scheduler, be Backend) *Engine {
	e := &Engine{inbox: make(chan any, 1024), quit: make(chan struct{}), stopped: make(chan struct{})}
	go e.run(sched, be)
	return e
}

func (e *Engine) send(m any) bool {
	select {
	case e.inbox <- m:
		return true
	case <-e.stopped:
		return false
	}
}

// Submit queues req and returns its event stream, or the scheduler's refusal.
func (e *Engine) Submit(ctx context.Context, req Request) (*Stream, error) {
	st, _, err := e.SubmitGated(ctx, req)
	return st, err
}

// SubmitGated is Submit, also returning what an enforced pool's gate decided.
func (e *Engine) SubmitGated(ctx context.Context, req Request) (*Stream, Gate, error) {
	reply := make(chan submitReply, 1)
	if !e.send(submitMsg{req: req, reply: reply}) {
		return nil, Gate{}, ErrEngineClosed
	}
	select {
	case r := <-reply:
		return r.stream, r.gate, r.err
	case <-e.stopped:
		return nil, Gate{}, ErrEngineClosed
	case <-ctx.Done():
		// The reply still comes; cancel whatever was created.
		go func() {
			if r := <-reply; r.stream != nil {
				r.stream.Cancel()
			}
		}()
		return nil, Gate{}, ctx.Err()
	}
}

// Inspect runs fn on the engine goroutine between steps. fn must only copy state out.
func (e *Engine) Inspect(ctx context.Context, fn func(*Scheduler)) error {
	return e.Exec(ctx, func(s *Scheduler, _ Backend) { fn(s) })
}

// Do runs a scheduler operation (a pool operation, say) on the engine goroutine and
// returns its error. Sequence operations it plans run before the next step.
func (e *Engine) Do(ctx context.Context, fn func(*Scheduler) error) error {
	var err error
	if xerr := e.Exec(ctx, func(s *Scheduler, _ Backend) { err = fn(s) }); xerr != nil {
		return xerr
	}
	return err
}

// CreatePool creates a pool and waits until it is materialized (attachable). If ctx
// ends first the materialization is cancelled and nothing is left behind.
func (e *Engine) CreatePool(ctx context.Context, spec PoolSpec) (int, Stats, error) {
	reply := make(chan poolReply, 1)
	if !e.send(createPoolMsg{spec: spec, reply: reply}) {
		return 0, Stats{}, ErrEngineClosed
	}
	var r poolReply
	select {
	case r = <-reply:
	case <-e.stopped:
		return 0, Stats{}, ErrEngineClosed
	}
	if r.err != nil || r.stream == nil {
		return r.id, Stats{Pool: r.id}, r.err
	}
	defer r.stream.Cancel()
	evs, err := r.stream.Collect(ctx)
	if err != nil {
		return 0, Stats{}, err
	}
	last := evs[len(evs)-1]
	return r.id, last.Stats, last.Err
}

// Exec runs fn with the scheduler and the backend on the engine goroutine. It exists
// for diagnostics and tests that must observe the backend itself; fn must leave the
// backend as it found it.
func (e *Engine) Exec(ctx context.Context, fn func(*Scheduler, Backend)) error {
	done := make(chan struct{})
	if !e.send(inspectMsg{fn: fn, done: done}) {
		return ErrEngineClosed
	}
	select {
	case <-done:
		return nil
	case <-e.stopped:
		return ErrEngineClosed
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close stops the engine after the current step; running tasks end with ErrEngineClosed.
func (e *Engine) Close() {
	e.once.Do(func() { close(e.quit) })
	<-e.stopped
}

// Done is closed once the engine goroutine has exited.
func (e *Engine) Done() <-chan struct{} { return e.stopped }

func (e *Engine) run(sched *Scheduler, be Backend) {
	// The backend's C state is used from this thread only.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer close(e.stopped)
	streams := map[TaskID]*Stream{}
	deliver := func() {
		for _, ev := range sched.Events() {
			if st, ok := streams[ev.Task]; ok {
				st.push(ev)
				if ev.Done {
					delete(streams, ev.Task)
				}
			}
		}
	}
	handle := func(m any) {
		switch m := m.(type) {
		case submitMsg:
			id, gate, err := sched.SubmitGated(m.req, time.Now())
			if err != nil {
				m.reply <- submitReply{gate: gate, err: err}
				return
			}
			st := newStream(id, e)
			streams[id] = st
			m.reply <- submitReply{id: id, stream: st, gate: gate}
		case cancelMsg:
			sched.Cancel(m.id, time.Now())
		case inspectMsg:
			m.fn(sched, be)
			close(m.done)
		case createPoolMsg:
			id, task, err := sched.CreatePool(m.spec, time.Now())
			var st *Stream
			if err == nil && task != 0 {
				st = newStream(task, e)
				streams[task] = st
			}
			m.reply <- poolReply{id: id, stream: st, err: err}
		}
		deliver()
	}
	// A periodic wake-up lets idle-session expiry run while no request arrives.
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	idle := true
	for {
		if idle {
			select {
			case m := <-e.inbox:
				handle(m)
			case <-tick.C:
			case <-e.quit:
				e.shutdown(streams)
				return
			}
		}
		for drained := false; !drained; {
			select {
			case m := <-e.inbox:
				handle(m)
			case <-e.quit:
				e.shutdown(streams)
				return
			default:
				drained = true
			}
		}
		p := sched.Plan(time.Now())
		apply(be, p)
		deliver()
		if len(p.Batch) == 0 {
			// A plan that only released sequences may let a waiting task start: plan again.
			idle = len(p.SeqOps) == 0 && len(p.Samplers) == 0
			continue
		}
		idle = false
		sampled, err := be.Decode(p.Batch)
		sched.Commit(sampled, err, time.Now())
		deliver()
	}
}

func apply(be Backend, p Plan) {
	for _, op := range p.Samplers {
		if op.Free {
			be.FreeSampler(op.Task)
		} else {
			be.NewSampler(op.Task, op.Params, op.Logprobs, op.History)
		}
	}
	for _, op := range p.SeqOps {
		switch op.Kind {
		case OpSeqRm:
			be.SeqRm(op.Seq, op.P0, op.P1)
		case OpSeqCp:
			be.SeqCp(op.Src, op.Seq, op.P0, op.P1)
		}
	}
}

func (e *Engine) shutdown(streams map[TaskID]*Stream) {
	for id, st := range streams {
		st.push(Event{Task: id, Done: true, Finish: FinishError, Err: ErrEngineClosed})
	}
}

// IsClientError reports errors caused by the request rather than the server.
func IsClientError(err error) bool {
	return errors.Is(err, ErrPromptTooLong) || errors.Is(err, ErrEmptyPrompt) || errors.Is(err, ErrInvalidToken)
}
