// Package runner adapts the llama binding to the engine's Backend and Vocab interfaces.
package runner

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/tier"
)

// Backend drives one llama.cpp context. Only the engine goroutine may call it.
type Backend struct {
	ctx      *llama.Context
	model    *llama.Model
	samplers map[engine.TaskID]*sampler
	log      *slog.Logger

	// holes is set when cells were removed since the last compaction: the next Decode
	// compacts the cache first unless attention is ordered by position (see settle).
	holes bool
	// compactions and compactNanos count cache compactions and the time spent in them;
	// atomic so /metrics can read them while the engine goroutine runs.
	compactions, compactNanos atomic.Int64
	// alwaysCompact compacts after frees even where attention is ordered (AlwaysCompact).
	alwaysCompact bool
	// GrammarFailures counts tasks whose grammar failed while sampling and that went
	// on unconstrained (see dropGrammar; read by tests).
	GrammarFailures int

	// anchor >= 0 turns on SWA anchors (see EnableSWAAnchors): sequence q's anchor is
	// q + anchor.
	anchor int

	// store is the tier below the cache (EnableTier; nil: none).
	store *tier.Store
	// ready and prefetched: restores whose entries are read off the engine goroutine
	// (see restore); mu guards prefetched, which the readers fill.
	ready      chan engine.SeqOp
	mu         sync.Mutex
	prefetched map[int]prefetch
	// loadsRead: a load's segments read off the engine goroutine, by task (see Load).
	loadsRead map[engine.TaskID][]prefetch
	// scratch is a sequence id no engine sequence uses, empty between calls, through
	// which the tier saves and loads state where a sequence's own state cannot be taken
	// as it is (EnableScratch; -1: none).
	scratch int
	// drafter drafts with a model of its own (EnableDrafter; nil: none); follower is
	// the same drafter where its contexts mirror the target's cells (follower.go), and
	// otherwise noFollower, which keeps nothing.
	drafter  ModelDrafter
	follower Follower
	// rolled holds the sequences whose recurrent state was rolled back (a rejected
	// draft cut off through llama.cpp's n_rs_seq snapshots) and not decoded since.
	// llama.cpp keeps such a state in a snapshot plane chosen by a per-sequence index
	// that the next decode consumes; a seq_cp from the sequence before then would give
	// the copy the cell's unrolled plane (see SeqCp). nil unless the context has
	// rollback.
	rolled map[int]bool
}

// EnableScratch gives the backend sequence id seq, which the engine never uses, to save
// and load a sliding-window or recurrent model's pools through (see saveChunks and
// saveRecurrent). The context must have seq+1 sequence ids at least.
func (b *Backend) EnableScratch(seq int) { b.scratch = seq }

// Compactions is the number of whole-cache compactions so far and the time they took
// (safe from any goroutine).
func (b *Backend) Compactions() (int64, time.Duration) {
	return b.compactions.Load(), time.Duration(b.compactNanos.Load())
}

// AlwaysCompact makes every Decode after a free compact the cache, even where attention
// is ordered by position: the behaviour before PolyKV's kernel ordered cells, kept so the
// benchmark can measure what it cost.
func (b *Backend) AlwaysCompact(on bool) { b.alwaysCompact = on }

// settle compacts the cache if cells were removed since the last compaction and this
// context's attention does not sum cells in position order by itself (a quantized cache
// or llama.cpp's kernel: see Decode). The compaction copies every used cell, so its cost
// grows with what every tenant holds; with ordered attention nothing is copied.
func (b *Backend) settle() error {
	if !b.holes || (!b.alwaysCompact && b.ctx.OrderedAttention()) {
		return nil
	}
	start := time.Now()
	if err := b.ctx.Compact(); err != nil {
		b.log.Error("KV cache compaction failed; cached sequences may be lost", "err", err)
		return err
	}
	b.holes = false
	b.compactions.Add(1)
	b.compactNanos.Add(int64(time.Since(start)))
	return nil
}

// EnableSWAAnchors makes every cell of a sliding-window model's cache non-reusable
// while its sequence holds it. llama.cpp's SWA cache hands out a cell held by a single
// sequence as soon as its position falls out of that sequence's window; a pool's cells
// would then be overwritten although a fork or an attach at an earlier branch point
// still needs them, and a running sequence's next cell could land below its newer ones
// (see Decode). A cell with two members is never reused, so each sequence q gets a
// shadow sequence q+offset that holds exactly q's cells: SeqRm and SeqCp are mirrored
// on it and Decode adds it to q's new cells. The engine's ids are 0..offset-1; the
// context needs 2×offset sequence ids. Nothing is computed for the shadows.
func (b *Backend) EnableSWAAnchors(offset int) { b.anchor = offset }

type sampler struct {
	s        *llama.Sampler
	logprobs bool
	nProbs   int // alternatives reported with each token (with logprobs)
	// lazy is a lazy grammar still waiting for its trigger (see watchFreeText).
	lazy *lazyGrammar
}

// lazyGrammar is a grammar that starts at a trigger, watched here rather than by
// llama.cpp: llama.cpp matches its trigger regexes against all the output so far after
// every token with std::regex, whose libstdc++ matcher recurses once per character and
// overflows the stack (a crash no exception handler sees) somewhere between 20,000 and
// 50,000 characters of free text. Here words are looked for in each token's text and
// patterns run on a triggerMatcher fed only the new text, so a trigger after any
// length of free text starts the grammar (llama.Sampler.StartGrammar) from the token it
// begins in, at the cost of the token's own length.
type lazyGrammar struct {
	grammar  string
	triggers []engine.GrammarTrigger
	pats     []*triggerMatcher // per trigger: its pattern (nil for a word)
	res      []*regexp.Regexp  // a pattern triggerMatcher cannot run, anchored
	text     []byte            // the output so far
	toks     []llama.Token     // its tokens
	offs     []int             // where each token's text starts in text
}

// newLazyGrammar compiles the triggers; one Go cannot compile never fires (the
// grammar then never starts: the reply is free text, which the parser reads as ever).
func newLazyGrammar(grammar string, triggers []engine.GrammarTrigger) *lazyGrammar {
	lg := &lazyGrammar{grammar: grammar, triggers: triggers, pats: make([]*triggerMatcher, len(triggers)), res: make([]*regexp.Regexp, len(triggers))}
	for i, t := range triggers {
		if t.Pattern == "" {
			continue
		}
		if m, ok := newTriggerMatcher(t.Pattern); ok {
			lg.pats[i] = m
		} else {
			// Quadratic over long output, but correct: only for patterns with
			// assertions, which the chat package never writes.
			lg.res[i], _ = regexp.Compile(`^(?:` + t.Pattern + `)$`)
		}
	}
	return lg
}

// push adds a token of output and returns where the grammar starts in the output
// (llama.cpp's rule: the first trigger in order that fires, at its word or its first
// non-empty capture group), or -1 while none has fired.
func (lg *lazyGrammar) push(tok llama.Token, piece []byte) int {
	lg.offs = append(lg.offs, len(lg.text))
	lg.toks = append(lg.toks, tok)
	lg.text = append(lg.text, piece...)
	// Every matcher reads every piece, so each stays in step with the text.
	starts := make([]int, len(lg.triggers))
	for i, m := range lg.pats {
		starts[i] = -1
		if m != nil {
			starts[i] = m.push(piece)
		}
	}
	for i, t := range lg.triggers {
		if lg.pats[i] != nil {
			if starts[i] >= 0 {
				return starts[i]
			}
			continue
		}
		if t.Word != "" {
			// The text before this token held no word: only a match ending in it is new.
			from := max(0, len(lg.text)-len(piece)-len(t.Word)+1)
			if j := bytes.Index(lg.text[from:], []byte(t.Word)); j >= 0 {
				return from + j
			}
			continue
		}
		if lg.res[i] == nil {
			continue
		}
		if m := lg.res[i].FindSubmatchIndex(lg.text); m != nil {
			for g := 2; g+1 < len(m); g += 2 {
				if m[g] >= 0 && m[g+1] > m[g] {
					return m[g]
				}
			}
			return m[0]
		}
	}
	return -1
}

// from returns the index of the token whose text holds byte start, and start's offset
// in that token's text.
func (lg *lazyGrammar) from(start int) (int, int) {
	for k := len(lg.offs) - 1; k >= 0; k-- {
		end := len(lg.text)
		if k+1 < len(lg.offs) {
			end = lg.offs[k+1]
		}
		if lg.offs[k] <= start && start < end {
			return k, start - lg.offs[k]
		}
	}
	return len(lg.toks) - 1, 0
}

var _ engine.Backend = (*Backend)(nil)

// NewBackend wraps ctx (a context of model).
func NewBackend(model *llama.Model, ctx *llama.Context, log *slog.Logger) *Backend {
	if log == nil {
		log = slog.Default()
	}
	b := &Backend{ctx: ctx, model: model, samplers: map[engine.TaskID]*sampler{}, log: log, scratch: -1, follower: noFollower{}}
	if ctx != nil && ctx.RSSeq() > 0 { // (tests build samplers-only backends without a context)
		b.rolled = map[int]bool{}
	}
	return b
}

// Decode implements engine.Backend.
//
// Greedy output must not depend on other traffic, yet llama.cpp puts a running
// sequence's next tokens into the first free cells, possibly in a hole below its older
// ones. Where the context's attention sums each query's cells in position order
// (llama.Context.OrderedAttention: PolyKV's kernel over an f16/f32 cache) that changes
// nothing and no cell moves. Elsewhere (quantized caches, llama.cpp's own kernel) the
// cache is compacted first when cells were removed since the last batch, so cell order
// stays position order (see settle).
func (b *Backend) Decode(batch []engine.BatchEntry) ([]engine.Sampled, error) {
	if err := b.settle(); err != nil {
		return nil, err
	}
	parts := b.decodeParts(batch)
	if parts == nil {
		return b.decodePart(batch, nil, nil)
	}
	// One llama_decode per part, each part's rows sampled before the next decode
	// overwrites the logits; the samples go back in batch order.
	got := make(map[int]engine.Sampled, len(batch))
	for _, idx := range parts {
		part := make([]engine.BatchEntry, len(idx))
		for j, i := range idx {
			part[j] = batch[i]
		}
		if _, err := b.decodePart(part, idx, got); err != nil {
			return nil, err
		}
	}
	var out []engine.Sampled
	for i, e := range batch {
		if e.Sample {
			out = append(out, got[i])
		}
	}
	return out, nil
}

// decodeParts splits a batch that verifies drafts on a context with recurrent
// rollback (n_rs_seq) into the llama_decode calls it must run as: first the entries of
// every sequence without drafts, then each drafting sequence alone, in batch order
// (nil: one call for the whole batch). llama.cpp writes a sequence's rollback snapshots
// at the state cell the sequence holds when its micro-batch runs, but a later
// micro-batch of several sequences in the same decode may swap cells to make its own
// contiguous (llama_memory_recurrent::find_slot), moving the sequence's current state
// and leaving its snapshots behind: the rollback after a rejected draft then restores
// another cell's snapshot (found by TestArchsDraftModel on lfm2: logprobs off by
// ~1e-3 beside other traffic). A decode of one sequence has single-sequence
// micro-batches, which swap nothing, and nothing runs after it in that call.
func (b *Backend) decodeParts(batch []engine.BatchEntry) [][]int {
	if b.rolled == nil {
		return nil
	}
	drafting := map[int]bool{}
	for _, e := range batch {
		if e.Draft {
			drafting[e.Seq] = true
		}
	}
	if len(drafting) == 0 {
		return nil
	}
	var rest []int
	bySeq := map[int][]int{}
	var order []int
	for i, e := range batch {
		if !drafting[e.Seq] {
			rest = append(rest, i)
			continue
		}
		if _, ok := bySeq[e.Seq]; !ok {
			order = append(order, e.Seq)
		}
		bySeq[e.Seq] = append(bySeq[e.Seq], i)
	}
	if len(rest) == 0 && len(order) == 1 {
		return nil
	}
	var parts [][]int
	if len(rest) > 0 {
		parts = append(parts, rest)
	}
	for _, seq := range order {
		parts = append(parts, bySeq[seq])
	}
	return parts
}

// decodePart decodes entries in one llama_decode and samples them. With idx nil it
// returns the samples in order; otherwise entry j's sample is stored in got[idx[j]].
func (b *Backend) decodePart(batch []engine.BatchEntry, idx []int, got map[int]engine.Sampled) ([]engine.Sampled, error) {
	b.ctx.BatchClear()
	for _, e := range batch {
		if _, err := b.ctx.BatchAdd(e.Token, e.Pos, e.Seq, e.Sample); err != nil {
			return nil, err
		}
	}
	if err := b.ctx.Decode(); err != nil {
		return nil, err
	}
	b.follower.mirror(batch) // its cells follow the target's; it may read this decode's outputs
	if len(b.rolled) > 0 {
		for _, e := range batch {
			delete(b.rolled, e.Seq) // the decode consumed its rollback index
		}
	}
	if b.anchor > 0 {
		b.anchorNewCells(batch)
	}
	var out []engine.Sampled
	// last is each task's previous sample in this batch: a speculative draft is only
	// sampled when that sample confirms it, so the sampler (its RNG, penalty history,
	// grammar) advances over exactly the tokens plain decoding would give it. (A task's
	// entries are always in one part: parts split by sequence.)
	last := map[engine.TaskID]llama.Token{}
	put := func(j int, s engine.Sampled) {
		if idx == nil {
			out = append(out, s)
		} else {
			got[idx[j]] = s
		}
	}
	for i, e := range batch {
		if !e.Sample {
			continue
		}
		if e.Draft {
			if prev, ok := last[e.Task]; !ok || prev != e.Token {
				last[e.Task] = engine.NotDrawn
				put(i, engine.Sampled{Token: engine.NotDrawn})
				continue
			}
		}
		smp, ok := b.samplers[e.Task]
		if !ok {
			return nil, fmt.Errorf("no sampler for task %d", e.Task)
		}
		tok, err := smp.s.Sample(b.ctx, i)
		if err != nil {
			if tok, err = b.dropGrammar(e.Task, smp, i, tok, err); err != nil {
				return nil, err
			}
		}
		if smp.lazy != nil {
			b.watchFreeText(e.Task, smp, tok)
		}
		last[e.Task] = tok
		s := engine.Sampled{Token: tok}
		if smp.logprobs {
			s.Logprob, s.Top = logprobs(b.ctx.Logits(i), tok, smp.nProbs)
		}
		put(i, s)
	}
	return out, nil
}

// logprobs is log p(tok) and the n most likely tokens with their log p, under the raw
// logits: a log-softmax over the whole vocabulary before any sampler transformation
// (penalties, top-k, temperature, grammar), as llama-server reports n_probs. So the
// numbers describe the model, not the sampler, and a greedy token is always top[0].
// Ties are ordered by token id so the list is deterministic.
func logprobs(logits []float32, tok llama.Token, n int) (float32, []engine.TokenLogprob) {
	if len(logits) == 0 {
		return float32(math.Inf(-1)), nil
	}
	mx := logits[0]
	for _, l := range logits {
		mx = max(mx, l)
	}
	var sum float64
	for _, l := range logits {
		sum += math.Exp(float64(l - mx))
	}
	lse := float64(mx) + math.Log(sum)
	lp := float32(math.Inf(-1))
	if tok >= 0 && int(tok) < len(logits) {
		lp = float32(float64(logits[tok]) - lse)
	}
	if n <= 0 {
		return lp, nil
	}
	// A sorted insertion into n slots: n is at most 20, and almost every logit fails
	// the first comparison, so this is one pass over the vocabulary.
	top := make([]engine.TokenLogprob, 0, min(n, len(logits)))
	for id, l := range logits {
		if len(top) == n && l <= top[n-1].Logprob {
			continue
		}
		j := len(top)
		if j < n {
			top = append(top, engine.TokenLogprob{})
		} else {
			j = n - 1
		}
		for ; j > 0 && top[j-1].Logprob < l; j-- {
			top[j] = top[j-1]
		}
		top[j] = engine.TokenLogprob{Token: llama.Token(id), Logprob: l}
	}
	for i := range top {
		top[i].Logprob = float32(float64(top[i].Logprob) - lse)
	}
	return lp, top
}

// SeqRm implements engine.Backend. Removing cells that seq holds leaves a hole (see
// settle).
func (b *Backend) SeqRm(seq, p0, p1 int) bool {
	defer b.follower.seqRm(seq, p0, p1) // after the rollback bookkeeping below (its check reads it)
	if hi := b.ctx.SeqPosMax(seq); hi >= 0 && hi >= p0 && (p1 < 0 || b.ctx.SeqPosMin(seq) < p1) {
		b.holes = true
	}
	if b.rolled == nil {
		if b.anchor > 0 {
			b.ctx.SeqRm(seq+b.anchor, p0, p1)
		}
		return b.ctx.SeqRm(seq, p0, p1)
	}
	// A recurrent rollback: the sequence itself first. Its shadow (SWA anchors) shares
	// its recurrent cell (anchorNewCells' seq_cp); cut first, the shadow would take the
	// single rollback and leave the sequence's own index unset. After the sequence's
	// cut the shared cell already ends at p0-1, so the shadow's only drops its
	// attention cells.
	hi := b.ctx.SeqPosMax(seq)
	ok := b.ctx.SeqRm(seq, p0, p1)
	if b.anchor > 0 {
		b.ctx.SeqRm(seq+b.anchor, p0, p1)
	}
	switch {
	case p0 <= 0:
		delete(b.rolled, seq) // emptied: llama.cpp resets its rollback index
	case !ok:
		// A trailing cut the snapshots do not cover (more than n_rs_seq positions, or
		// a second cut since the last decode): the engine plans only cuts of the last
		// step's rejected drafts, so this is a bug, and the sequence is unchanged.
		b.log.Error("recurrent rollback refused", "seq", seq, "p0", p0, "pos_max", hi)
	case hi >= p0 && b.anchor > 0:
		// The cell is still shared with the shadow, whose index is 0: llama.cpp's
		// compaction (settle) would abort on it ("different rollback indices"), so
		// the sequence gets its own cell with the rolled-back state now.
		b.settleRollback(seq)
	case hi >= p0:
		b.rolled[seq] = true
	}
	return ok
}

// settleRollback writes seq's rolled-back recurrent state into the state's current
// plane: llama.cpp's seq_cp shares the cell, not the per-sequence snapshot index, so a
// copy taken before seq's next decode (a zero-copy pool snapshot of a session that just
// rejected a draft) would get the state as it was before the cut. Reading the state
// out (which honours the index) and back (which resets it) is llama.cpp's own way to
// move it. Without SWA anchors that happens only in that rare case; with them (a
// hybrid with sliding-window layers) after every rollback (see SeqRm).
//
// On such a hybrid llama.cpp's "partial" state is not only the recurrent one:
// llama_memory_hybrid_iswa passes the flag to its attention cache, where it means "the
// SWA layers only", so the read-back also moves seq's SWA cells to fresh cells, which
// its shadow does not hold. Unanchored cells are what the anchors exist to prevent
// (llama.cpp hands a cell held by one sequence to another once it falls out of that
// sequence's window), and it showed: speculating requests beside speculating traffic on
// the lfm2 test model had single-token logprob deviations of 4e-5–2e-4 in 6 and 9 runs
// of 16 (TestArchsDraftModel), none in 24 once the shadow was re-anchored here. So the
// shadow is dropped and copied afresh from seq: it holds exactly seq's cells again
// (and shares its recurrent cell, as after any decode). The read-back costs a copy of
// seq's SWA cells as well as its recurrent state on such models.
func (b *Backend) settleRollback(seq int) {
	delete(b.rolled, seq)
	data, err := b.ctx.SeqPartialStateGet(seq)
	if err == nil {
		err = b.ctx.SeqPartialStateSet(seq, data)
	}
	if err != nil {
		b.log.Error("settling a recurrent rollback failed; the sequence is dropped", "seq", seq, "err", err)
		b.SeqRm(seq, -1, -1)
		return
	}
	if b.anchor > 0 {
		b.ctx.SeqRm(seq+b.anchor, -1, -1)
		b.ctx.SeqCp(seq, seq+b.anchor, -1, -1)
		b.holes = true // the shadow's old cells are free now
	}
}

// anchorNewCells adds each sequence's shadow to the cells the batch just wrote (the
// batch's positions of a sequence are new to it: the engine never rewrites a position
// it holds).
func (b *Backend) anchorNewCells(batch []engine.BatchEntry) {
	type span struct{ lo, hi int }
	spans := map[int]span{}
	var order []int
	for _, e := range batch {
		sp, ok := spans[e.Seq]
		if !ok {
			sp = span{e.Pos, e.Pos}
			order = append(order, e.Seq)
		}
		sp.lo, sp.hi = min(sp.lo, e.Pos), max(sp.hi, e.Pos)
		spans[e.Seq] = sp
	}
	for _, q := range order {
		b.ctx.SeqCp(q, q+b.anchor, spans[q].lo, spans[q].hi+1)
	}
}

// SeqCp implements engine.Backend.
func (b *Backend) SeqCp(src, dst, p0, p1 int) {
	if b.rolled[src] {
		b.settleRollback(src)
	}
	b.ctx.SeqCp(src, dst, p0, p1)
	if b.anchor > 0 {
		b.ctx.SeqCp(src, dst+b.anchor, p0, p1)
	}
	b.follower.seqCp(src, dst, p0, p1)
}

// NewSampler implements engine.Backend.
func (b *Backend) NewSampler(task engine.TaskID, p engine.SamplingParams, logprobs bool, history []engine.Token) {
	var lazy *lazyGrammar
	if p.Grammar != "" && len(p.GrammarTriggers) > 0 {
		// The triggers are watched here (lazyGrammar); the chain starts without the
		// grammar, checked now so that a bad one fails as a non-lazy one would.
		if err := b.model.CheckGrammar(p.Grammar); err == nil {
			lazy = newLazyGrammar(p.Grammar, p.GrammarTriggers)
		}
		p.Grammar, p.GrammarTriggers = "", nil
		if lazy == nil {
			b.log.Error("sampler grammar rejected; sampling unconstrained", "task", task)
		}
	}
	s, err := llama.NewSampler(b.model, samplerParams(p))
	if err != nil {
		// The API checks grammars before submitting, so this is a bug; sample freely
		// rather than fail a request mid-flight.
		b.log.Error("sampler grammar rejected; sampling unconstrained", "task", task, "err", err)
		p.Grammar = ""
		s, _ = llama.NewSampler(b.model, samplerParams(p))
	}
	// Prompt tokens prime the penalties, never a grammar (it constrains output only).
	if p.Grammar == "" && (p.RepeatPenalty != 0 && p.RepeatPenalty != 1 || p.FrequencyPenalty != 0 || p.PresencePenalty != 0) {
		for _, t := range history {
			_ = s.Accept(t) // no grammar in the chain: nothing to fail
		}
	}
	b.samplers[task] = &sampler{s: s, logprobs: logprobs, nProbs: p.NProbs, lazy: lazy}
}

// watchFreeText adds tok (drawn and accepted without a grammar) to a lazy grammar's
// output; once a trigger has fired the grammar starts, fed the output from the trigger
// on, and constrains the next token. When that output does not fit the grammar, the
// task goes on unconstrained, as with a grammar that fails later (dropGrammar).
func (b *Backend) watchFreeText(task engine.TaskID, smp *sampler, tok llama.Token) {
	lg := smp.lazy
	start := lg.push(tok, b.model.TokenPiece(tok, true))
	if start < 0 {
		return
	}
	smp.lazy = nil
	k, skip := lg.from(start)
	if err := smp.s.StartGrammar(b.model, lg.grammar, skip, lg.toks[k:]); err != nil {
		b.GrammarFailures++
		b.log.Warn("grammar failed; the task continues unconstrained", "task", task, "err", err)
	}
}

// dropGrammar handles a grammar failure of task's sampler at batch index i: llama.cpp
// found that the output no longer fits the grammar (with a lazy grammar: the text that
// completed the trigger does not start a well-formed call), and the grammar can only be
// freed. The task goes on with its chain alone (RNG and penalty history intact),
// keeping the token already drawn (drawn >= 0: a grammar failing on accept means the
// trigger fired inside that very token, drawn from the unmasked distribution; the
// chain has accepted it) or drawing again from the same logits.
//
// Why not end the request: a lazy grammar constrains free text only once a call has
// started, so what the model wrote so far is valid output, and the reply parser keeps
// anything that does not form a well-formed call as content, never as a call; ending
// here would cut the reply mid-sentence and could leave half a call tag in content.
// Only this task's sampler changes: other sequences in the batch keep theirs.
func (b *Backend) dropGrammar(task engine.TaskID, smp *sampler, i int, drawn llama.Token, cause error) (llama.Token, error) {
	if !errors.Is(cause, llama.ErrGrammar) {
		return -1, cause
	}
	b.GrammarFailures++
	b.log.Warn("grammar failed; the task continues unconstrained", "task", task, "err", cause)
	smp.s.DropGrammar()
	if drawn >= 0 {
		return drawn, nil
	}
	return smp.s.Sample(b.ctx, i)
}

// DraftFits implements engine.DraftChecker: how many of drafts task's grammar allows
// after the tokens its sampler has drawn (llama.Sampler.GrammarFits). A lazy grammar
// still waiting for its trigger constrains nothing yet: every draft fits, and a
// trigger inside the drafts is met by the verification itself (watchFreeText starts
// the grammar between two draft samples, as between two steps).
func (b *Backend) DraftFits(task engine.TaskID, drafts []engine.Token) int {
	smp, ok := b.samplers[task]
	if !ok {
		return len(drafts)
	}
	return smp.s.GrammarFits(b.model, drafts)
}

// samplerParams is the part of the engine's parameters that builds the llama.cpp chain
// (NProbs only asks for a report and is handled here, in Decode).
func samplerParams(p engine.SamplingParams) llama.SamplerParams {
	return llama.SamplerParams{
		Temperature: p.Temperature, TopK: p.TopK, TopP: p.TopP, MinP: p.MinP, Seed: p.Seed,
		RepeatPenalty: p.RepeatPenalty, RepeatLastN: p.RepeatLastN,
		FrequencyPenalty: p.FrequencyPenalty, PresencePenalty: p.PresencePenalty, Grammar: p.Grammar,
		GrammarTriggers: triggers(p.GrammarTriggers),
	}
}

func triggers(ts []engine.GrammarTrigger) []llama.GrammarTrigger {
	var out []llama.GrammarTrigger
	for _, t := range ts {
		out = append(out, llama.GrammarTrigger{Word: t.Word, Pattern: t.Pattern})
	}
	return out
}

// Caps implements engine.Backend: the runner has every ability. Drafting without a
// drafter (EnableDrafter) proposes nothing, and the tier's operations without a store
// (EnableTier) do nothing and load nothing.
func (b *Backend) Caps() engine.Caps {
	return engine.Caps{Draft: b, Check: b, Tier: b, SeqTier: b, AsyncTier: b, Slots: b, Probe: b}
}

// FreeSampler implements engine.Backend.
func (b *Backend) FreeSampler(task engine.TaskID) {
	if s, ok := b.samplers[task]; ok {
		s.s.Free()
		delete(b.samplers, task)
	}
}

// Vocab exposes the model's tokenizer to the engine.
type Vocab struct{ M *llama.Model }

// Piece implements engine.Vocab.
func (v Vocab) Piece(tok engine.Token) []byte { return v.M.TokenPiece(tok, false) }

// IsEOG implements engine.Vocab.
func (v Vocab) IsEOG(tok engine.Token) bool { return v.M.IsEOG(tok) }

// NewChatRenderer renders with source (the model's Jinja template or a command-line
// override) the way transformers does. There is no llama_chat_apply_template fallback:
// it would silently drop tools and tool turns, so an unusable template is a 400.
func NewChatRenderer(m *llama.Model, source string) *chat.Renderer {
	return chat.NewRenderer(source, string(m.TokenPiece(m.BOS(), true)), string(m.TokenPiece(m.EOS(), true)))
}

// ProbeFits reports whether n more cells can be written to the cache right now, by
// decoding n placeholder tokens into the empty sequence seq and removing them again.
// It measures free cells from llama.cpp itself, independent of PolyKV's accounting;
// tests use it to check that accounting. seq must hold nothing.
func (b *Backend) ProbeFits(seq, n int, tok llama.Token) (bool, error) {
	if b.ctx.SeqPosMax(seq) >= 0 {
		return false, fmt.Errorf("probe: sequence %d is not empty", seq)
	}
	defer b.SeqRm(seq, 0, -1)
	for pos := 0; pos < n; {
		b.ctx.BatchClear()
		for ; pos < n && b.ctx.BatchLen() < b.ctx.BatchCap(); pos++ {
			if _, err := b.ctx.BatchAdd(tok, pos, seq, false); err != nil {
				return false, err
			}
		}
		if err := b.ctx.Decode(); err != nil {
			if err == llama.ErrNoKVSlot {
				return false, nil
			}
			return false, err
		}
	}
	return true, nil
}
