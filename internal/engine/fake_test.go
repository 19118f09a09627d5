package engine

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
)

// fakeBackend models a unified KV cache: numbered cells, each holding a token, and per
// sequence the list of cells it is a member of (position = index). seq_cp shares cells,
// a cell is free once no sequence holds it. It "samples" a token that depends on every
// token the sequence holds, so any cache mistake changes the output, and it fails a
// batch that breaks position contiguity or overflows the cells.
type fakeBackend struct {
	t        *testing.T
	nCtx     int
	kv       map[int][]fakeCell
	nextCell int
	samplers map[TaskID]bool
	batches  [][]BatchEntry
	failNext error
	// tier, when set, is a fake tier (Config.Tier): a spilled pool's own cells' tokens
	// by pool id; tail is a restored child's own cells until its parent's prefix is
	// copied under them.
	tier map[int][]Token
	tail map[int][]fakeCell
	// recurrent: a restore shares the parent's [0, D) itself, as the runner does for a
	// model with recurrent state (Config.Recurrent; see TierBackend).
	recurrent bool
	// async makes a restore's read asynchronous (AsyncTierBackend): the first OpRestore
	// of a pool is answered ErrTierPending and queued in reads; read marks what a test
	// has let finish; discarded counts TierDiscard calls.
	async     bool
	reads     []SeqOp
	read      map[int]bool
	discarded int
	// tierSpills, tierRestores count the operations; records lists the OpRecords.
	tierSpills, tierRestores int
	records                  []SeqOp
	// segs is the fake sequence tier (Config.Tier, issue 40): each saved segment's own
	// tokens by its whole prefix (segKey); missing makes a stored one miss (a store that
	// dropped it); segSaves and segLoads count the segments saved and loaded.
	segs               map[string][]Token
	missing            map[string]bool
	segSaves, segLoads int
	// prefetches: the OpPrefetch operations received, in order.
	prefetches []SeqOp
	// keptPools: pools paged out while user-pinned, whose entries the tier must keep.
	keptPools map[int]bool
	// model is the fake model (nil: fakeNext); drawn counts the samples it drew, so a
	// test can check that a verification draws no more than plain decoding would.
	model func(seq []Token) Token
	drawn int
	// sample, when set, replaces model with a sampler of task's own (a stochastic
	// model: each call is one draw of the task's RNG).
	sample func(task TaskID, seq []Token) Token
	// draft is the fake draft model (DraftBackend; draft_test.go).
	draft fakeDraft
	// grammar, when set, is a fake grammar for tasks whose request has one: token tok
	// may follow prev only if grammar(prev, tok) (prev is -1 before the first draw).
	// A draw it forbids becomes the next token up that it allows, as a grammar's mask
	// would leave the model's next choice; DraftFits walks it (DraftChecker).
	grammar      func(prev, tok Token) bool
	grammarTasks map[TaskID]bool
	lastDrawn    map[TaskID]Token
	// checkDrafts declares DraftFits in Caps (the scheduler then cuts drafts); slots
	// declares SaveSeq, LoadSeq and ProbeFits.
	checkDrafts, slots bool
}

// Caps implements Backend: the fake drafts and has a tier; it checks drafts against
// its grammar (DraftChecker) only when checkDrafts is set, and saves and loads slots
// and answers cell probes (slots_test.go) only when slots is set.
func (f *fakeBackend) Caps() Caps {
	c := Caps{Draft: f, Tier: f, SeqTier: f, AsyncTier: f}
	if f.checkDrafts {
		c.Check = f
	}
	if f.slots {
		c.Slots, c.Probe = f, f
	}
	return c
}

// driver drives the fake as the engine loop drives a backend.
func (f *fakeBackend) driver() driver { return driver{be: f, caps: f.Caps()} }

// apply runs p on the fake (driver.apply).
func apply(f *fakeBackend, p Plan) []Msg { return f.driver().apply(p) }

// DraftFits implements DraftChecker with the fake grammar.
func (f *fakeBackend) DraftFits(task TaskID, drafts []Token) int {
	if f.grammar == nil || !f.grammarTasks[task] {
		return len(drafts)
	}
	prev, ok := f.lastDrawn[task]
	if !ok {
		f.t.Errorf("fake: drafts checked for task %d before it drew a token", task)
	}
	for i, d := range drafts {
		if !f.grammar(prev, d) {
			return i
		}
		prev = d
	}
	return len(drafts)
}

// constrain is the fake grammar's mask over task's draw tok.
func (f *fakeBackend) constrain(task TaskID, tok Token) Token {
	if f.grammar != nil && f.grammarTasks[task] {
		prev, ok := f.lastDrawn[task]
		if !ok {
			prev = -1
		}
		for !f.grammar(prev, tok) {
			tok++
		}
	}
	f.lastDrawn[task] = tok
	return tok
}

// TierReady implements AsyncTierBackend; tests send TierRead themselves.
func (f *fakeBackend) TierReady() <-chan SeqOp { return nil }

// TierDiscard implements AsyncTierBackend.
func (f *fakeBackend) TierDiscard(op SeqOp) {
	delete(f.read, op.Pool)
	f.discarded++
}

// segKey names a stored segment in the fake tier, by its whole prefix, as the store's
// key does.
func segKey(start int, toks []Token, whole bool) string { return fmt.Sprint(start, whole, toks) }

// Load implements SeqTierBackend with the fake's segments: each segment's cells are its
// tokens, loaded as new cells at their positions, the ones below what the sequence
// holds left out (as the runner loads a chunk into a scratch sequence and shares only
// what the sequence lacks).
func (f *fakeBackend) Load(op SeqOp) (Loaded, error) {
	ans := Loaded{Task: op.Task, Seq: op.Seq, N: op.P0, Missed: -1}
	if len(f.kv[op.Seq]) != op.P0 {
		f.t.Errorf("fake: load into seq %d holding %d cells, want %d", op.Seq, len(f.kv[op.Seq]), op.P0)
		return ans, nil
	}
	for i, g := range op.Segs {
		if g.Start > ans.N {
			f.t.Errorf("fake: load segment %d starts at %d past what seq %d holds (%d)", i, g.Start, op.Seq, ans.N)
			return ans, nil
		}
		toks, ok := f.segs[segKey(g.Start, g.Tokens, g.Whole)]
		if !ok || f.missing[segKey(g.Start, g.Tokens, g.Whole)] {
			ans.Missed = i
			return ans, nil
		}
		if g.Whole && g.Start != ans.N {
			f.t.Errorf("fake: a whole segment from %d loaded onto seq %d holding %d", g.Start, op.Seq, ans.N)
		}
		// The runner loads the whole segment into a scratch sequence first: its cells
		// below what the sequence holds are there until the load ends.
		if need := f.cells() + len(toks); need > f.nCtx {
			f.t.Errorf("fake: loading segment [%d, %d) needs %d cells of %d (the scheduler's room accounting)", g.Start, g.Start+len(toks), need, f.nCtx)
		}
		for p := ans.N; p < min(g.Start+len(toks), op.P1); p++ {
			f.nextCell++
			f.kv[op.Seq] = append(f.kv[op.Seq], fakeCell{id: f.nextCell, tok: toks[p-g.Start]})
		}
		ans.N = len(f.kv[op.Seq])
		f.segLoads++
	}
	return ans, nil
}

// Tier implements TierBackend with the fake's tokens.
func (f *fakeBackend) Tier(op SeqOp) error {
	switch op.Kind {
	case OpSpill:
		v := f.kv[op.Seq]
		if len(v) != len(op.Tokens) {
			f.t.Errorf("fake: spill of pool %d holding %d of %d cells", op.Pool, len(v), len(op.Tokens))
		}
		for i, c := range v {
			if c.tok != op.Tokens[i] {
				f.t.Errorf("fake: pool %d holds token %d at %d, its prefix says %d", op.Pool, c.tok, i, op.Tokens[i])
			}
		}
		f.tier[op.Pool] = append([]Token(nil), f.tokens(op.Seq)[op.D:]...)
		f.tierSpills++
		f.keptPools[op.Pool] = op.Pinned
	case OpForget:
		delete(f.keptPools, op.Pool)
	case OpSave:
		v := f.kv[op.Seq]
		if len(v) < op.P1 {
			f.t.Errorf("fake: save of [%d, %d) from seq %d holding %d cells", op.P0, op.P1, op.Seq, len(v))
			return nil
		}
		for i := range op.P1 {
			if v[i].tok != op.Tokens[i] {
				f.t.Errorf("fake: seq %d holds token %d at %d, the saved segment says %d", op.Seq, v[i].tok, i, op.Tokens[i])
			}
		}
		f.segs[segKey(op.P0, op.Tokens, op.Whole)] = append([]Token(nil), op.Tokens[op.P0:op.P1]...)
		f.segSaves++
	case OpDrop:
		delete(f.segs, segKey(op.P0, op.Tokens, false))
	case OpPrefetch:
		f.prefetches = append(f.prefetches, op)
	case OpRestore:
		if f.async && !f.read[op.Pool] {
			f.reads = append(f.reads, op)
			return ErrTierPending
		}
		delete(f.read, op.Pool)
		toks, ok := f.tier[op.Pool]
		if !ok {
			return fmt.Errorf("fake tier: pool %d not stored", op.Pool)
		}
		if len(f.kv[op.Seq]) != 0 {
			f.t.Errorf("fake: restore into non-empty seq %d", op.Seq)
		}
		inUse := f.cells()
		for _, v := range f.tail {
			inUse += len(v)
		}
		if inUse+len(toks) > f.nCtx {
			// As llama.cpp's state_seq_set_data: it loads into free cells, and refuses
			// when there are too few (the runner answers a rejected miss).
			return fmt.Errorf("fake tier: pool %d's %d cells do not fit: %d of %d in use", op.Pool, len(toks), inUse, f.nCtx)
		}
		var cells []fakeCell
		for _, t := range toks {
			f.nextCell++
			cells = append(cells, fakeCell{id: f.nextCell, tok: t})
		}
		switch {
		case op.D == 0:
			f.kv[op.Seq] = cells
		case f.recurrent:
			f.kv[op.Seq] = append(append([]fakeCell(nil), f.kv[op.Src][:op.D]...), cells...)
		default:
			f.tail[op.Seq] = cells
		}
		f.tierRestores++
	case OpRecord:
		f.records = append(f.records, op)
	}
	return nil
}

type fakeCell struct {
	id  int
	tok Token
}

func newFakeBackend(t *testing.T, nCtx int) *fakeBackend {
	return &fakeBackend{t: t, nCtx: nCtx, kv: map[int][]fakeCell{}, samplers: map[TaskID]bool{}, tier: map[int][]Token{}, tail: map[int][]fakeCell{},
		segs: map[string][]Token{}, missing: map[string]bool{}, keptPools: map[int]bool{},
		grammarTasks: map[TaskID]bool{}, lastDrawn: map[TaskID]Token{}}
}

// cells counts distinct physical cells in use.
func (f *fakeBackend) cells() int {
	seen := map[int]bool{}
	for _, v := range f.kv {
		for _, c := range v {
			seen[c.id] = true
		}
	}
	return len(seen)
}

func (f *fakeBackend) tokens(seq int) []Token {
	var out []Token
	for _, c := range f.kv[seq] {
		out = append(out, c.tok)
	}
	return out
}

func (f *fakeBackend) Decode(batch []BatchEntry) ([]Sampled, error) {
	f.batches = append(f.batches, batch)
	if err := f.failNext; err != nil {
		f.failNext = nil
		return nil, err
	}
	if f.cells()+len(batch) > f.nCtx {
		return nil, fmt.Errorf("fake: no KV slot (%d used + %d > %d)", f.cells(), len(batch), f.nCtx)
	}
	var out []Sampled
	model := f.model
	if model == nil {
		model = fakeNext
	}
	// last is each task's previous sample in this batch: a draft is only sampled when
	// it confirms it (BatchEntry.Draft), as the real backend does.
	last := map[TaskID]Token{}
	for _, e := range batch {
		if e.Pos != len(f.kv[e.Seq]) {
			f.t.Errorf("fake: seq %d gets pos %d but holds %d tokens", e.Seq, e.Pos, len(f.kv[e.Seq]))
		}
		f.nextCell++
		f.kv[e.Seq] = append(f.kv[e.Seq], fakeCell{id: f.nextCell, tok: e.Token})
		if e.Sample {
			if !f.samplers[e.Task] {
				f.t.Errorf("fake: sampling for task %d without a sampler", e.Task)
			}
			if prev, ok := last[e.Task]; e.Draft && (!ok || prev != e.Token) {
				last[e.Task] = NotDrawn
				out = append(out, Sampled{Token: NotDrawn})
				continue
			}
			var tok Token
			if f.sample != nil {
				tok = f.sample(e.Task, f.tokens(e.Seq))
			} else {
				tok = model(f.tokens(e.Seq))
			}
			tok = f.constrain(e.Task, tok)
			f.drawn++
			last[e.Task] = tok
			out = append(out, Sampled{Token: tok})
		}
	}
	return out, nil
}

// fakeRepeater is a fake model whose text repeats, so speculation has something to
// find: mostly the token period positions back, but every fifth position or so (by a
// hash of the whole sequence, so any cache mistake still changes the output) a token
// of its own.
func fakeRepeater(period int) func(seq []Token) Token {
	return func(seq []Token) Token {
		h := uint32(7)
		for _, t := range seq {
			h = h*31 + uint32(t)
		}
		if len(seq) >= period && h%5 != 0 {
			return seq[len(seq)-period]
		}
		return Token(10 + h%50)
	}
}

// fakeNext is the fake model: a token in 10..59 determined by the whole sequence.
func fakeNext(seq []Token) Token {
	h := uint32(7)
	for _, t := range seq {
		h = h*31 + uint32(t)
	}
	return Token(10 + h%50)
}

func (f *fakeBackend) SeqRm(seq, p0, p1 int) bool {
	v := f.kv[seq]
	if p1 < 0 || p1 > len(v) {
		p1 = len(v)
	}
	if p0 < 0 {
		p0 = 0
	}
	if p1 != len(v) {
		f.t.Errorf("fake: seq_rm(%d, %d, %d) would leave a hole", seq, p0, p1)
		return false
	}
	if p0 < len(v) {
		f.kv[seq] = v[:p0]
	}
	return true
}

func (f *fakeBackend) SeqCp(src, dst, p0, p1 int) {
	if p0 != 0 || len(f.kv[dst]) != 0 {
		f.t.Errorf("fake: seq_cp(%d -> %d, %d, %d) onto a non-empty sequence", src, dst, p0, p1)
		return
	}
	if p1 > len(f.kv[src]) {
		f.t.Errorf("fake: seq_cp(%d -> %d, 0, %d) beyond the source's %d cells", src, dst, p1, len(f.kv[src]))
		return
	}
	f.kv[dst] = append([]fakeCell(nil), f.kv[src][:p1]...)
	if t, ok := f.tail[dst]; ok {
		f.kv[dst] = append(f.kv[dst], t...) // a restored child's own cells above its parent's
		delete(f.tail, dst)
	}
}

func (f *fakeBackend) NewSampler(task TaskID, p SamplingParams, logprobs bool, history []Token) {
	if f.samplers[task] {
		f.t.Errorf("fake: sampler for task %d created twice", task)
	}
	f.samplers[task] = true
	f.grammarTasks[task] = p.Grammar != ""
}

func (f *fakeBackend) FreeSampler(task TaskID) {
	if !f.samplers[task] {
		f.t.Errorf("fake: freeing unknown sampler %d", task)
	}
	delete(f.samplers, task)
	delete(f.grammarTasks, task)
	delete(f.lastDrawn, task)
}

// fakeVocab: token 0 is EOG, token n renders as "<n>".
type fakeVocab struct{ pieces map[Token]string }

func (v fakeVocab) Piece(tok Token) []byte {
	if p, ok := v.pieces[tok]; ok {
		return []byte(p)
	}
	return []byte(fmt.Sprintf("<%d>", tok))
}
func (fakeVocab) IsEOG(tok Token) bool { return tok == 0 }

// harness drives a scheduler and a fake backend the way Engine.run does, synchronously.
type harness struct {
	t      *testing.T
	s      *Scheduler
	be     *fakeBackend
	now    time.Time
	events map[TaskID][]Event
	ended  []TaskID // tasks in the order their Done event came
	// mirror, when set (trackResidency), is what the residency reports say each
	// sequence holds, checked against the cell tree after every collect.
	mirror   map[int][]Token
	reported int // tokens reported in all
	// stepCost scripts how long a decode step takes (default 10 ms); a cost that grows
	// with the batch makes per-session tps fall as sessions join, deterministically.
	stepCost func(batch []BatchEntry) time.Duration
	// lookup, when set, answers OpLookup (driver.lookup); nil: at once, nothing found.
	lookup func(op SeqOp) (Found, bool)
	// trace hashes every decision when POLYKV_HARNESS_HASH is set (harnesshash_test.go).
	trace *harnessTrace
}

func newHarness(t *testing.T, cfg Config) *harness {
	t.Helper()
	s, err := NewScheduler(cfg, fakeVocab{})
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, s: s, be: newFakeBackend(t, cfg.NCtx), now: time.Unix(1000, 0), events: map[TaskID][]Event{}, trace: newHarnessTrace(t)}
	h.be.recurrent = cfg.Recurrent
	s.afterAdmit = h.checkLiveness
	s.useBackend(h.be.Caps())
	return h
}

func (h *harness) collect() {
	if h.mirror != nil {
		for _, o := range h.s.Observations() {
			if o.Kind == ObsSeqChange {
				h.applySeqChange(o.Seq)
			}
		}
		h.checkResidency()
	}
	for _, ev := range h.s.Events() {
		h.trace.add("event", ev, ev.Err)
		h.events[ev.Task] = append(h.events[ev.Task], ev)
		if ev.Done {
			h.ended = append(h.ended, ev.Task)
		}
	}
}

func (h *harness) submit(req Request) TaskID {
	h.t.Helper()
	id, err := h.trySubmit(req)
	if err != nil {
		h.t.Fatalf("submit: %v", err)
	}
	h.collect()
	return id
}

// step runs one Plan/Decode/Commit round and returns the batch.
func (h *harness) step() []BatchEntry {
	h.now = h.now.Add(10 * time.Millisecond)
	d := h.driver()
	p := h.s.nextPlan(h.now)
	if len(p.Drafts) > 0 { // the draft round, as the engine loop runs it
		h.trace.add("drafts", p, nil)
		d.settle(h.s, h.now, p, nil)
		p = h.s.nextPlan(h.now)
	}
	h.trace.add("plan", p, nil)
	d.settle(h.s, h.now, p, nil)
	h.collect()
	if len(p.Batch) == 0 {
		if n, last := h.s.Violations(); n > 0 {
			h.t.Fatalf("%d pool lifecycle violations, last: %v", n, last)
		}
		return nil
	}
	sampled, err := h.be.Decode(p.Batch)
	cost := 10 * time.Millisecond
	if h.stepCost != nil {
		cost = h.stepCost(p.Batch)
	}
	h.now = h.now.Add(cost)
	h.trace.add("sampled", sampled, err)
	h.s.Commit(sampled, err, h.now)
	h.collect()
	if n, last := h.s.Violations(); n > 0 {
		h.t.Fatalf("%d pool lifecycle violations, last: %v", n, last)
	}
	return p.Batch
}

// run steps until idle (bounded).
func (h *harness) run() {
	h.t.Helper()
	for i := 0; i < 10000; i++ {
		if h.s.Idle() {
			h.step() // flush the last releases
			return
		}
		h.step()
	}
	h.t.Fatal("scheduler did not go idle")
}

func (h *harness) done(id TaskID) (Event, bool) {
	evs := h.events[id]
	if len(evs) > 0 && evs[len(evs)-1].Done {
		return evs[len(evs)-1], true
	}
	return Event{}, false
}

func (h *harness) text(id TaskID) string {
	s := ""
	for _, ev := range h.events[id] {
		s += ev.Text
	}
	return s
}

func seqTokens(from, n int) []Token {
	out := make([]Token, n)
	for i := range out {
		out[i] = Token(from + i)
	}
	return out
}

// driver is the fake backend's driver, with the harness's lookup.
func (h *harness) driver() driver {
	d := h.be.driver()
	d.lookup = h.lookup
	return d
}

// send hands a message to the scheduler as the engine loop does: through Step, at the
// harness's clock, then runs the operations it needs before its reply.
func (h *harness) send(m Msg) Result {
	r := h.s.Step(h.now, m)
	u := h.s.urgentPlan()
	h.trace.add("urgent", u, nil)
	h.driver().settle(h.s, h.now, u, &r)
	h.trace.add("result", r, r.Err)
	h.collect()
	return r
}

func (h *harness) trySubmit(req Request) (TaskID, error) {
	r := h.send(Submit{Req: req})
	return r.Task, r.Err
}

func (h *harness) submitGated(req Request) (TaskID, Gate, error) {
	r := h.send(Submit{Req: req})
	return r.Task, r.Gate, r.Err
}

func (h *harness) cancel(id TaskID) { h.send(Cancel{Task: id}) }

func (h *harness) tryCreatePool(spec PoolSpec) (int, TaskID, error) {
	r := h.send(CreatePool{Spec: spec})
	return r.Pool, r.Task, r.Err
}

func (h *harness) releasePool(id int) error { return h.send(ReleasePool{Pool: id}).Err }

func (h *harness) pinPool(id int, pin bool) error { return h.send(PinPool{Pool: id, Pin: pin}).Err }

func (h *harness) evictPool(id int) error { return h.send(EvictPool{Pool: id}).Err }

func (h *harness) flushPool(id int) (int, int, error) {
	r := h.send(FlushPool{Pool: id})
	return r.Flushed.Sessions, r.Flushed.Cells, r.Err
}

func (h *harness) setAdmission(id int, p admission.Policy) error {
	return h.send(SetAdmission{Pool: id, Patch: admission.Replace(p)}).Err
}

func (h *harness) capacityOf(id, expected int, session string) (CapacityReport, error) {
	r := h.send(QueryCapacity{Pool: id, ExpectedTokens: expected, Session: session})
	return r.Capacity, r.Err
}

func (h *harness) tryReserve(id int, ttl time.Duration, expected int) (ReservationReport, error) {
	r := h.send(Reserve{Pool: id, TTL: ttl, ExpectedTokens: expected})
	return r.Reservation, r.Err
}

func (h *harness) releaseReservation(id int, rid string) error {
	return h.send(ReleaseReservation{Pool: id, ID: rid}).Err
}

// checkLiveness checks the scheduler's liveness invariant (doc.go) at the end of every
// admission pass (every message and every Plan runs one): a waiting request with
// admissible capacity is scheduled (or refused) within one step. It recomputes
// "admissible" on its own, from the cell tree and the definition of what eviction may
// take, not from the scheduler's fit: the first waiting task in queue order that
// depends on nothing still in progress (its pool or parent being built, a donor still
// prefilling, its own session's running turn, a sequence id only a running task would
// free) must not fit the cells that evicting every idle sequence and evictable pool
// would leave, after what seated prompts are promised. The check is cold (the whole
// prompt, less only what it borrows from the pool it attaches to, which must stay),
// so any placement that shares cells fits too. Tasks behind that first one wait behind
// it by design (FIFO: no starvation). A pool in its grace (resident, not used since it
// became so, within Config.PoolGrace) is not counted, except for a generating request
// on a server where nothing runs (issue 54): no running work will make room for it, so
// the grace must not hold it back.
func (h *harness) checkLiveness() {
	h.t.Helper()
	s := h.s
	var victims, graced kvcache.SeqSet
	freeSeq := false
	for _, sl := range s.slots {
		if sl.task == nil {
			freeSeq = true
			if len(sl.tokens) > 0 {
				victims.Add(sl.seq)
			}
		}
	}
	for _, p := range s.pools.All() {
		// With a tier, user-pinned pools and pools whose children hold no cells are paged
		// too (issue 40).
		pageable := !p.Pinned() || (s.cfg.Tier && p.Pageable())
		if p.State != pool.Resident || !pageable {
			continue
		}
		if p.AwaitsUse && s.now.Sub(p.LastAccess) < s.cfg.PoolGrace {
			graced.Add(p.Seq)
		} else {
			victims.Add(p.Seq)
		}
	}
	promised := 0
	for _, t := range s.running {
		if t.slot != nil && len(t.slot.tokens) < len(t.req.Prompt) {
			promised += len(t.req.Prompt) - len(t.slot.tokens)
		}
	}
	for _, t := range s.queue {
		dep := t.pool
		if t.kind == kindMaterialize {
			dep = t.pool.Parent
		}
		if dep != nil && dep.State != pool.Resident {
			continue
		}
		if s.prefixCached(t) && s.awaitsDonor(t) {
			continue
		}
		if t.wait == WaitFloor {
			// Paced (throttle.go): it waits for its pool's running sessions, which must
			// exist (they end without it), and for no longer than paceMaxHold.
			if !slices.ContainsFunc(s.running, func(r *task) bool { return r.kind == kindGenerate && r.poolID() == t.pool.ID }) ||
				s.now.Sub(t.pacedAt) > paceMaxHold {
				h.t.Fatalf("liveness: task %d paced with no running session of pool %d, or for %s", t.id, t.pool.ID, s.now.Sub(t.pacedAt))
			}
			continue
		}
		if t.kind == kindGenerate {
			if sl, ok := s.bySession[t.req.SessionID]; ok && t.req.SessionID != "" && sl.task != nil {
				continue
			}
			if !freeSeq {
				continue
			}
		}
		need, set := len(t.req.Prompt), victims
		if t.kind == kindGenerate && len(s.running) == 0 {
			graced.Each(func(q int) bool { set.Add(q); return true })
		}
		if t.kind == kindGenerate && t.pool != nil {
			share := attachLen(t.pool, t.req)
			if s.cfg.Recurrent {
				// Only a pool boundary holds recurrent state (Config.Recurrent).
				share = 0
				if b := boundary(t.pool, attachLen(t.pool, t.req)); b != nil && b.State == pool.Resident {
					share = b.L()
				}
			}
			need -= share
			set.Del(t.pool.Seq)
		}
		room := s.cfg.NCtx - s.kv.Used() - promised + s.kv.FreedBy(set, -1, 0)
		if need <= room {
			h.t.Fatalf("liveness: task %d waits for %d cells with room for %d (%d used of %d, %d promised to prefills); queue %d, running %d",
				t.id, need, room, s.kv.Used(), s.cfg.NCtx, promised, len(s.queue), len(s.running))
		}
		return
	}
}
