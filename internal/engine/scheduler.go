package engine

import (
	"fmt"
	"slices"
	"time"
)

// Config sizes the scheduler.
type Config struct {
	NCtx       int           // KV cells in the unified cache
	Parallel   int           // session sequences (ids 0..Parallel-1)
	NBatch     int           // tokens per decode step (decode tokens + prefill chunks)
	MaxQueue   int           // waiting requests beyond the running ones; past it: ErrQueueFull
	SessionTTL time.Duration // idle sessions older than this lose their KV (0 = never)
}

// Validate checks a configuration.
func (c Config) Validate() error {
	switch {
	case c.NCtx < 8:
		return fmt.Errorf("context size %d is too small", c.NCtx)
	case c.Parallel < 1:
		return fmt.Errorf("parallel must be at least 1, got %d", c.Parallel)
	case c.NBatch < c.Parallel:
		return fmt.Errorf("batch size %d must be at least parallel (%d): every running session decodes one token per step", c.NBatch, c.Parallel)
	case c.MaxQueue < 0:
		return fmt.Errorf("queue bound must not be negative, got %d", c.MaxQueue)
	}
	return nil
}

// OpKind names a sequence operation.
type OpKind int

// Sequence operations the backend performs before a batch.
const (
	OpSeqRm OpKind = iota // remove Seq's cells in [P0, P1)
	OpSeqCp               // add Seq to Src's cells in [P0, P1)
)

// SeqOp is one sequence operation.
type SeqOp struct {
	Kind     OpKind
	Seq, Src int
	P0, P1   int
}

// SamplerOp creates or frees a task's sampler.
type SamplerOp struct {
	Task     TaskID
	Free     bool
	Params   SamplingParams
	Logprobs bool
	History  []Token
}

// Plan is what the driver must do now, in order: samplers, sequence ops, then decode
// Batch (if any) and hand the result to Commit.
type Plan struct {
	Samplers []SamplerOp
	SeqOps   []SeqOp
	Batch    []BatchEntry
}

type slot struct {
	seq      int
	session  string
	tokens   []Token // exactly the tokens whose KV this sequence holds, at positions 0..len-1
	task     *task
	lastUsed time.Time
}

type task struct {
	id        TaskID
	req       Request
	slot      *slot
	cacheN    int
	next      Token // sampled but not yet decoded
	hasNext   bool
	generated int
	text      *textAssembler
	submitted time.Time
	admitted  time.Time
	firstTok  time.Time
}

func (t *task) prefilling() bool { return t.slot != nil && len(t.slot.tokens) < len(t.req.Prompt) }

// inflight remembers what a planned batch holds for a task, so Commit can apply it.
type inflight struct {
	t      *task
	n      int  // tokens of this task in the batch
	decode bool // a decode token (else a prefill chunk)
	sample bool
}

// Scheduler is PolyKV's batching state machine. It performs no I/O and reads no clock:
// requests, cancellations and backend results come in as calls, time as an argument,
// and it answers with Plans and Events. See the package documentation for the loop.
type Scheduler struct {
	cfg       Config
	vocab     Vocab
	slots     []*slot
	bySession map[string]*slot
	queue     []*task // waiting, FIFO
	running   []*task // holding a slot, in admission order
	tasks     map[TaskID]*task
	nextID    TaskID

	ops      []SeqOp
	samplers []SamplerOp
	events   []Event
	inflight []inflight
}

// NewScheduler creates a scheduler for cfg.
func NewScheduler(cfg Config, vocab Vocab) (*Scheduler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Scheduler{cfg: cfg, vocab: vocab, bySession: map[string]*slot{}, tasks: map[TaskID]*task{}}
	for i := range cfg.Parallel {
		s.slots = append(s.slots, &slot{seq: i})
	}
	return s, nil
}

// Submit queues a request. It fails at once when the prompt can never run or the
// queue is full; otherwise the task runs as soon as a sequence and cells are free.
func (s *Scheduler) Submit(req Request, now time.Time) (TaskID, error) {
	if len(req.Prompt) == 0 {
		return 0, ErrEmptyPrompt
	}
	if len(req.Prompt) >= s.cfg.NCtx {
		return 0, fmt.Errorf("%w: %d prompt tokens, context size %d", ErrPromptTooLong, len(req.Prompt), s.cfg.NCtx)
	}
	s.admit(now)
	if len(s.queue) >= s.cfg.MaxQueue && !s.canStartNow(req) {
		return 0, fmt.Errorf("%w (%d waiting)", ErrQueueFull, len(s.queue))
	}
	s.nextID++
	t := &task{id: s.nextID, req: req, text: newTextAssembler(req.Stop), submitted: now}
	s.tasks[t.id] = t
	s.queue = append(s.queue, t)
	s.admit(now)
	return t.id, nil
}

// canStartNow reports whether a request would get a sequence at once (so the queue
// bound does not apply to it).
func (s *Scheduler) canStartNow(req Request) bool {
	if len(s.queue) > 0 {
		return false // FIFO: someone is already waiting
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

// Cancel ends a task: a waiting one leaves the queue, a running one stops and frees its
// sequence before the next step. Unknown ids are ignored (the task already ended).
func (s *Scheduler) Cancel(id TaskID, now time.Time) {
	t, ok := s.tasks[id]
	if !ok {
		return
	}
	if t.slot == nil {
		s.queue = slices.DeleteFunc(s.queue, func(q *task) bool { return q == t })
		delete(s.tasks, id)
		s.events = append(s.events, Event{Task: id, Done: true, Finish: FinishCancelled, Err: ErrCancelled})
		return
	}
	s.finish(t, FinishCancelled, false, ErrCancelled, now)
}

// Events drains the events produced since the last call.
func (s *Scheduler) Events() []Event {
	ev := s.events
	s.events = nil
	return ev
}

// Idle reports that nothing is waiting or running.
func (s *Scheduler) Idle() bool { return len(s.queue) == 0 && len(s.running) == 0 }

// usedCells counts cells held by session sequences: sequences share nothing yet, so
// this is the sum of their lengths.
func (s *Scheduler) usedCells() int {
	n := 0
	for _, sl := range s.slots {
		n += len(sl.tokens)
	}
	return n
}

// reservedPrefill counts cells promised to prompts already admitted but not prefilled,
// so a new admission can never strand two half-prefilled prompts (a deadlock).
func (s *Scheduler) reservedPrefill() int {
	n := 0
	for _, t := range s.running {
		if t.prefilling() {
			n += len(t.req.Prompt) - len(t.slot.tokens)
		}
	}
	return n
}

// evictable lists idle sessions holding cells, least recently used first.
func (s *Scheduler) evictable(except *slot) []*slot {
	var out []*slot
	for _, sl := range s.slots {
		if sl != except && sl.task == nil && sl.session != "" && len(sl.tokens) > 0 {
			out = append(out, sl)
		}
	}
	slices.SortFunc(out, func(a, b *slot) int { return a.lastUsed.Compare(b.lastUsed) })
	return out
}

// evictSlot drops a slot's session and its KV.
func (s *Scheduler) evictSlot(sl *slot) {
	if len(sl.tokens) > 0 {
		s.ops = append(s.ops, SeqOp{Kind: OpSeqRm, Seq: sl.seq, P0: 0, P1: -1})
	}
	if sl.session != "" {
		delete(s.bySession, sl.session)
	}
	sl.session = ""
	sl.tokens = nil
}

// freeCells evicts idle sessions (LRU first, never except) until want cells are free or
// nothing is left to evict; it returns the free count. planned are cells already
// promised to the batch being built.
func (s *Scheduler) freeCells(want int, except *slot, planned int) int {
	free := s.cfg.NCtx - s.usedCells() - planned
	for _, sl := range s.evictable(except) {
		if free >= want {
			break
		}
		free += len(sl.tokens)
		s.evictSlot(sl)
	}
	return free
}

// pickSlot chooses the sequence for t without side effects: its session's own, else
// an empty one, else the least recently used idle session's.
func (s *Scheduler) pickSlot(t *task) *slot {
	if t.req.SessionID != "" {
		if sl, ok := s.bySession[t.req.SessionID]; ok {
			if sl.task != nil {
				return nil
			}
			return sl
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
		if lru == nil || sl.lastUsed.Before(lru.lastUsed) {
			lru = sl
		}
	}
	return lru
}

// admit moves waiting tasks onto sequences in FIFO order. A task whose cells are not
// available blocks those behind it, so a long prompt is never starved.
func (s *Scheduler) admit(now time.Time) {
	for i := 0; i < len(s.queue); {
		t := s.queue[i]
		sl := s.pickSlot(t)
		if sl == nil {
			i++ // its session is busy, or no sequence is free: later tasks may still fit
			continue
		}
		own := sl.session != "" && sl.session == t.req.SessionID
		lcp := 0
		if own {
			lcp = commonPrefix(sl.tokens, t.req.Prompt)
			if lcp == len(t.req.Prompt) {
				lcp-- // the last prompt token must be decoded again to get its logits
			}
		}
		released := len(sl.tokens) - lcp
		need := len(t.req.Prompt) - lcp
		free := s.cfg.NCtx - s.usedCells() + released - s.reservedPrefill()
		evict := 0
		for _, e := range s.evictable(sl) {
			evict += len(e.tokens)
		}
		if free+evict < need {
			return // head-of-line: wait for running tasks to end
		}
		if !own {
			s.evictSlot(sl)
		} else if released > 0 {
			s.ops = append(s.ops, SeqOp{Kind: OpSeqRm, Seq: sl.seq, P0: lcp, P1: -1})
			sl.tokens = sl.tokens[:lcp]
		}
		if free < need {
			s.freeCells(need+s.reservedPrefill(), sl, 0)
		}
		if t.req.SessionID != "" && !own {
			sl.session = t.req.SessionID
			s.bySession[sl.session] = sl
		}
		sl.task = t
		sl.lastUsed = now
		t.slot = sl
		t.cacheN = lcp
		t.admitted = now
		s.samplers = append(s.samplers, SamplerOp{Task: t.id, Params: t.req.Sampling, Logprobs: t.req.Logprobs, History: t.req.Prompt})
		s.running = append(s.running, t)
		s.queue = slices.Delete(s.queue, i, i+1)
	}
}

func commonPrefix(a, b []Token) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// expireSessions drops idle sessions past the TTL.
func (s *Scheduler) expireSessions(now time.Time) {
	if s.cfg.SessionTTL <= 0 {
		return
	}
	for _, sl := range s.slots {
		if sl.task == nil && sl.session != "" && now.Sub(sl.lastUsed) > s.cfg.SessionTTL {
			s.evictSlot(sl)
		}
	}
}

// Plan builds the next step: one decode token for every generating task, then prompt
// chunks in admission order with what is left of the batch (chunked prefill).
func (s *Scheduler) Plan(now time.Time) Plan {
	s.expireSessions(now)
	s.admit(now)
	s.inflight = s.inflight[:0]
	var batch []BatchEntry
	budget := s.cfg.NBatch
	free := s.cfg.NCtx - s.usedCells()
	planned := 0
	for _, t := range slices.Clone(s.running) {
		if !t.hasNext {
			continue
		}
		if free == 0 {
			free = s.freeCells(1, nil, planned)
		}
		if free == 0 {
			// Every cell is held by a running task: stop cleanly rather than shift.
			s.finish(t, FinishLength, true, nil, now)
			continue
		}
		batch = append(batch, BatchEntry{Token: t.next, Pos: len(t.slot.tokens), Seq: t.slot.seq, Sample: true, Task: t.id})
		s.inflight = append(s.inflight, inflight{t: t, n: 1, decode: true, sample: true})
		free--
		planned++
		budget--
	}
	for _, t := range s.running {
		if budget == 0 {
			break
		}
		if !t.prefilling() {
			continue
		}
		have := len(t.slot.tokens)
		k := min(len(t.req.Prompt)-have, budget)
		if free < k {
			free = s.freeCells(k, nil, planned)
		}
		k = min(k, free)
		if k == 0 {
			break
		}
		for j := range k {
			p := have + j
			last := p == len(t.req.Prompt)-1
			batch = append(batch, BatchEntry{Token: t.req.Prompt[p], Pos: p, Seq: t.slot.seq, Sample: last, Task: t.id})
		}
		s.inflight = append(s.inflight, inflight{t: t, n: k, sample: have+k == len(t.req.Prompt)})
		budget -= k
		free -= k
		planned += k
	}
	p := Plan{Samplers: s.samplers, SeqOps: s.ops, Batch: batch}
	s.samplers, s.ops = nil, nil
	return p
}

// Commit applies the result of decoding the last planned batch.
func (s *Scheduler) Commit(sampled []Sampled, err error, now time.Time) {
	in := s.inflight
	s.inflight = nil
	if err != nil {
		for _, f := range in {
			if f.t.slot == nil {
				continue
			}
			// The cells this batch may have written are not trusted: drop them.
			s.ops = append(s.ops, SeqOp{Kind: OpSeqRm, Seq: f.t.slot.seq, P0: len(f.t.slot.tokens), P1: -1})
			s.finish(f.t, FinishError, false, fmt.Errorf("%w: %v", ErrDecode, err), now)
		}
		return
	}
	si := 0
	for _, f := range in {
		t := f.t
		if f.decode {
			t.slot.tokens = append(t.slot.tokens, t.next)
			t.hasNext = false
		} else {
			have := len(t.slot.tokens)
			t.slot.tokens = append(t.slot.tokens, t.req.Prompt[have:have+f.n]...)
		}
		if f.sample {
			if si >= len(sampled) {
				s.finish(t, FinishError, false, fmt.Errorf("%w: backend returned %d samples for a batch that asked for more", ErrDecode, len(sampled)), now)
				continue
			}
			s.onToken(t, sampled[si], now)
			si++
		}
	}
}

func (s *Scheduler) onToken(t *task, smp Sampled, now time.Time) {
	if t.generated == 0 {
		t.firstTok = now
	}
	if s.vocab.IsEOG(smp.Token) && !t.req.IgnoreEOS {
		s.finish(t, FinishStop, false, nil, now)
		return
	}
	t.generated++
	text, stopped := t.text.push(s.vocab.Piece(smp.Token))
	ev := Event{Task: t.id, Text: text}
	if t.req.Logprobs {
		ev.Tokens = []TokenLogprob{{Token: smp.Token, Logprob: smp.Logprob}}
	}
	if text != "" || ev.Tokens != nil {
		s.events = append(s.events, ev)
	}
	switch {
	case stopped:
		s.finish(t, FinishStop, false, nil, now)
	case t.req.MaxTokens > 0 && t.generated >= t.req.MaxTokens:
		s.finish(t, FinishLength, false, nil, now)
	case len(t.slot.tokens) >= s.cfg.NCtx:
		// The next token would sit at position n_ctx: stop, never shift the context.
		s.finish(t, FinishLength, true, nil, now)
	default:
		t.next = smp.Token
		t.hasNext = true
	}
}

// finish ends a running task and releases its sequence: a session keeps its KV for the
// next turn, an anonymous task's cells are freed at once.
func (s *Scheduler) finish(t *task, reason string, truncated bool, err error, now time.Time) {
	sl := t.slot
	stats := Stats{PromptN: len(t.req.Prompt) - t.cacheN, CacheN: t.cacheN, PredictedN: t.generated, Seq: sl.seq}
	if !t.firstTok.IsZero() {
		stats.PromptTime = t.firstTok.Sub(t.admitted)
		stats.PredictTime = now.Sub(t.firstTok)
	} else {
		stats.PromptTime = now.Sub(t.admitted)
	}
	s.events = append(s.events, Event{Task: t.id, Text: t.text.flush(), Done: true, Finish: reason, Truncated: truncated, Err: err, Stats: stats})
	s.samplers = append(s.samplers, SamplerOp{Task: t.id, Free: true})
	sl.task = nil
	sl.lastUsed = now
	if sl.session == "" {
		s.evictSlot(sl)
	}
	t.slot = nil
	s.running = slices.DeleteFunc(s.running, func(r *task) bool { return r == t })
	delete(s.tasks, t.id)
	// A task ended by Plan may still be listed for this step's batch: drop it.
	s.inflight = slices.DeleteFunc(s.inflight, func(f inflight) bool { return f.t == t })
}

// SlotInfo is a copy of one sequence's state for /slots.
type SlotInfo struct {
	Seq       int    `json:"id"`
	SessionID string `json:"session_id"`
	State     string `json:"state"` // idle | prefill | decode
	NPast     int    `json:"n_past"`
	Decoded   int    `json:"n_decoded"`
	Task      uint64 `json:"task_id,omitempty"`
}

// Slots copies out every sequence in use (holding cells or running a task).
func (s *Scheduler) Slots() []SlotInfo {
	out := []SlotInfo{}
	for _, sl := range s.slots {
		if sl.task == nil && len(sl.tokens) == 0 {
			continue
		}
		info := SlotInfo{Seq: sl.seq, SessionID: sl.session, State: "idle", NPast: len(sl.tokens)}
		if t := sl.task; t != nil {
			info.Task = uint64(t.id)
			info.Decoded = t.generated
			info.State = "decode"
			if t.prefilling() {
				info.State = "prefill"
			}
		}
		out = append(out, info)
	}
	return out
}

// Usage is a copy of the engine's load.
type Usage struct {
	CellsUsed int `json:"kv_cells_used"`
	CellsMax  int `json:"kv_cells_max"`
	Running   int `json:"requests_running"`
	Waiting   int `json:"requests_waiting"`
	Sessions  int `json:"sessions"`
}

// Usage reports the current load.
func (s *Scheduler) Usage() Usage {
	return Usage{CellsUsed: s.usedCells(), CellsMax: s.cfg.NCtx, Running: len(s.running), Waiting: len(s.queue), Sessions: len(s.bySession)}
}
