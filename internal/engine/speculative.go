package engine

import (
	"fmt"
	"math"
	"slices"
	"strings"
)

// Speculative decoding (issue 23). Each decoding session may propose draft tokens that
// continue its own context; the step verifies every proposal in the same batch as the
// other sessions' decode tokens and prefill chunks, and the session keeps the drafts the
// model agrees with plus the token the model chose after them.
//
// The batch holds, for a session at position n, its next token at n (Sample set, as
// without drafts) and then draft d_0..d_{k-1} at n+1..n+k, each with Sample and Draft
// set. The backend samples the entries of one task in order, and samples a Draft entry
// only if the task's previous sample equals that entry's token (the draft so far is
// accepted); past the first mismatch it returns NotDrawn and does not touch the
// sampler. So the sampler (its RNG, penalty history, grammar) sees exactly the tokens it
// would have seen one step at a time, and with batch-invariant logits every sample is
// the one a plain decode would have drawn: greedy and seeded sampling alike give the
// same output with and without speculation. With sampling this is standard speculative
// sampling for a draft that is a point mass: a draft is kept with the model's
// probability of it, and on a rejection the token drawn is the model's draw conditioned
// on not being the draft, so the output distribution is the model's.
//
// Drafting is pure: tokens in, a proposal out (ngramMatch and ngramFrom, ngramMod), all state in
// the scheduler. The cells of rejected drafts are removed (an OpSeqRm planned with the
// next step) and never enter the cell tree.

// Speculation types (--spec-type), named as llama-server names its n-gram drafters.
const (
	// SpecNgramSimple looks the end of the session's own context (its prompt, the
	// tokens it borrows from its pool, what it generated) up in that context and
	// proposes what followed the longest most recent match (prompt lookup decoding).
	SpecNgramSimple = "ngram-simple"
	// SpecNgramMod is llama.cpp's ngram-mod: one hashed table of n-gram → next token
	// shared by every session (what one agent wrote drafts for another), fed with each
	// session's context.
	SpecNgramMod = "ngram-mod"
	// SpecNone turns speculation off.
	SpecNone = "none"
)

// SpecTypes are the drafters the engine implements, in the order flag help lists them.
var SpecTypes = []string{SpecNgramSimple, SpecNgramMod, SpecDraftSimple, SpecDraftMTP}

// Spec configures speculative decoding (Config.Spec).
type Spec struct {
	// Types are the drafters tried, in order, for every decoding session in every step:
	// the first proposal of at least DraftMin tokens is verified. Empty: off.
	Types []string
	// DraftMax is the most tokens a session proposes in one step; DraftMin the fewest
	// worth verifying (a shorter proposal is dropped).
	DraftMax, DraftMin int
	// NgramMin is the shortest suffix of the context ngram-simple matches (default
	// 3); NgramMax the longest it tries to extend a match to (DefaultNgramMax).
	NgramMin, NgramMax int
	// ModN is ngram-mod's n-gram length (llama.cpp's n_match; default 24).
	ModN int
	// StepCost is what a step costs besides its batch rows, counted in rows (the
	// fixed part of a step: the weights read once, the graph, the sampling), for the
	// cost-aware draft limit (specCostCap): a draft row is planned only where its
	// expected accepted tokens raise the step's tokens per unit of cost. Small on a
	// compute-bound CPU, large where a step is bound by reading the weights (a GPU).
	// 0: DefaultStepCost; negative: no limit (every proposal the drafter makes, up
	// to the adaptive cap, is verified).
	StepCost float64
}

// Spec defaults. DraftMax 16: on a CPU a verification's cost grows with its tokens, so
// a long run of rejected drafts is not free; the adaptive cap (task.draftCap) halves it
// after rejections anyway.
const (
	DefaultDraftMax = 16
	DefaultNgramMin = 3
	// DefaultNgramMax 64: a match is extended that far before the longest, most recent
	// one is taken. Text that repeats with a period (a model looping over a list of
	// JSON objects, a table, code with repeated blocks) holds the same 16-token run
	// several times per period with different continuations; a cap of 16 then takes
	// the most recent of them, often at the wrong phase, where a longer match finds the
	// previous period's same place. On the edit benchmark's reply (SmolLM2 loops with a
	// period of 82 tokens) replaying the scheduler's drafting over the recorded tokens
	// gave 74.9% of drafts accepted and 3.80 tokens per step at 16, 91.2% and 5.14 at
	// 32 or more; the other replies were unchanged (docs/speculative.md). The scan
	// stops at a match of this length, and costs the same where none is found.
	DefaultNgramMax = 64
	DefaultModN     = 24
	// DefaultStepCost is StepCost's default, measured on SmolLM2-135M Q4_1 with 2
	// threads (docs/speculative.md): a step of R rows took about (DefaultStepCost+R)
	// times one row's share.
	DefaultStepCost = 2.0
	// MaxDraft bounds --draft-max and a request's speculative.n_max.
	MaxDraft = 256
	// modSize is ngram-mod's table (entries of 4 bytes): llama.cpp uses 4M entries;
	// one million suffice for the 25% occupancy at which the table is reset.
	modSize = 1 << 20
)

// On reports whether any drafter is configured.
func (sp Spec) On() bool { return len(sp.Types) > 0 }

// ParseSpecTypes reads a comma-separated --spec-type list ("none" or empty: off).
func ParseSpecTypes(v string) ([]string, error) {
	var out []string
	for _, name := range strings.Split(v, ",") {
		name = strings.TrimSpace(name)
		switch {
		case name == "" || name == SpecNone:
			continue
		case !slices.Contains(SpecTypes, name):
			return nil, fmt.Errorf("unknown speculation type %q: want none or a comma-separated list of %s", name, strings.Join(SpecTypes, ", "))
		case slices.Contains(out, name):
			return nil, fmt.Errorf("speculation type %q listed twice", name)
		}
		out = append(out, name)
	}
	if strings.Contains(","+v+",", ","+SpecNone+",") && len(out) > 0 {
		return nil, fmt.Errorf("speculation type none cannot be combined with others (%q)", v)
	}
	return out, nil
}

// withDefaults fills the zero fields.
func (sp Spec) withDefaults() Spec {
	if sp.DraftMax == 0 {
		sp.DraftMax = DefaultDraftMax
	}
	if sp.NgramMin == 0 {
		sp.NgramMin = DefaultNgramMin
	}
	if sp.NgramMax == 0 {
		sp.NgramMax = DefaultNgramMax
	}
	if sp.ModN == 0 {
		sp.ModN = DefaultModN
	}
	if sp.StepCost == 0 {
		sp.StepCost = DefaultStepCost
	}
	return sp
}

// validate checks a configuration (with defaults filled).
func (sp Spec) validate() error {
	for _, t := range sp.Types {
		if !slices.Contains(SpecTypes, t) {
			return fmt.Errorf("unknown speculation type %q (want %s)", t, strings.Join(SpecTypes, ", "))
		}
	}
	switch {
	case sp.DraftMax < 1 || sp.DraftMax > MaxDraft:
		return fmt.Errorf("draft max must be in 1..%d, got %d", MaxDraft, sp.DraftMax)
	case sp.DraftMin < 0 || sp.DraftMin > sp.DraftMax:
		return fmt.Errorf("draft min must be in 0..draft max (%d), got %d", sp.DraftMax, sp.DraftMin)
	case sp.NgramMin < 1 || sp.NgramMax < sp.NgramMin:
		return fmt.Errorf("n-gram lengths must satisfy 1 <= min <= max, got %d and %d", sp.NgramMin, sp.NgramMax)
	case sp.ModN < 1:
		return fmt.Errorf("ngram-mod length must be positive, got %d", sp.ModN)
	case math.IsNaN(sp.StepCost):
		return fmt.Errorf("step cost must be a number")
	}
	return nil
}

// SpecRequest is a request's own speculation settings (llama-server's speculative.*
// request fields).
type SpecRequest struct {
	Off bool // speculative: false
	// NMax, NMin override the server's DraftMax and DraftMin when set (NMax 0: off).
	NMax, NMin *int
}

// NotDrawn is the token of a Sampled for a Draft entry the backend did not sample: an
// earlier draft of the same task was rejected.
const NotDrawn Token = -1

// specDraft is the proposal for t, whose next token (t.next, not yet decoded) will sit
// at position len(t.slot.tokens), of at most k tokens; nil when none is worth verifying.
// A probe (a session the cost-aware limit keeps from drafting) asks ngram-simple for a
// match of at least specProbeMatch tokens: its drafts are paid for at odds the limit
// already judged too low, and a short match in prose (three tokens recurring) lands
// far less often than a long one in a quote.
func (s *Scheduler) specDraft(t *task, k int, probe bool) []Token {
	sp := s.cfg.Spec
	ngramMin := sp.NgramMin
	if probe {
		ngramMin = min(max(ngramMin, specProbeMatch), sp.NgramMax)
	}
	minN := s.draftMin(t)
	k = min(k, t.draftCap)
	if k < minN {
		return nil
	}
	ctx := t.slot.tokens
	for _, typ := range sp.Types {
		var d []Token
		switch typ {
		case SpecNgramSimple:
			d = s.ngramSimple(t, ngramMin, k)
		case SpecNgramMod:
			s.modFeed(t)
			d = s.mod.draft(ctx, t.next, k)
		case SpecDraftSimple, SpecDraftMTP:
			d = t.takeModelDraft(k) // the draft model's or MTP head's, from draftRound (draft.go)
		}
		if len(d) > 0 && t.req.Sampling.Grammar != "" && s.draftCheck != nil {
			// Cut at the first token the grammar forbids: the sampler could never
			// draw it, so it and every draft after it would be rejected anyway.
			n := s.draftCheck.DraftFits(t.id, d)
			t.draftFiltered += len(d) - n
			d = d[:n]
		}
		if len(d) >= minN {
			return d
		}
	}
	return nil
}

// draftMin is the fewest drafts t verifies (--draft-min, or the request's; at least 1):
// a shorter proposal is dropped.
func (s *Scheduler) draftMin(t *task) int {
	if t.req.Spec.NMin != nil {
		return max(*t.req.Spec.NMin, 1)
	}
	return max(s.cfg.Spec.DraftMin, 1)
}

// draftRoom evicts up to n cells for drafts when too few are free: from the tails of
// idle sequences (cached anonymous ones, idle sessions), least recently used first, as a
// decode token does when the cache is full, but never a pool, which goes whole. It
// returns the cells freed. Without it a server whose cache had filled (its steady state
// under varied traffic: cached sequences and idle sessions keep their cells until they
// are wanted) never drafted again. It costs little: a draft's cells come back after its
// step (rejected ones are removed; accepted ones are tokens the session would have
// decoded, which evict as decode tokens do), so the drafts of a session take a window
// of cells once, not new ones every step; a session that loses tail tokens to it
// prefills them again on its next turn.
func (s *Scheduler) draftRoom(n int) int {
	before := s.kv.room(0)
	for _, v := range s.kv.victims(s.now, nil) {
		left := n - (s.kv.room(0) - before)
		if left <= 0 {
			break
		}
		if v.sl == nil {
			continue
		}
		if x := s.kv.cells.Exclusive(v.sl.seq, 0); x > 0 {
			s.evictVictim(v, min(x, left))
		}
	}
	return s.kv.room(0) - before
}

// specOn reports whether t drafts: a generating task of a server with speculation on
// that did not turn it off. Grammar-constrained requests (tools, JSON schema, lazy
// tool grammars) speculate too: verification samples the drafts in order through the
// task's sampler, grammar included, so a draft the grammar forbids is rejected like
// any other mismatch and the output is the one plain decoding gives; and with a
// DraftChecker backend such drafts are cut before they cost a row (specDraft).
func (s *Scheduler) specOn(t *task) bool {
	if !s.cfg.Spec.On() || t.kind != kindGenerate || t.req.Spec.Off {
		return false
	}
	return t.req.Spec.NMax == nil || *t.req.Spec.NMax > 0
}

// specBudget is the most tokens t may draft now: its cap, what max_tokens leaves after
// the token this step samples anyway, and the context (no position reaches n_ctx).
func (s *Scheduler) specBudget(t *task) int {
	k := s.cfg.Spec.DraftMax
	if t.req.Spec.NMax != nil {
		k = *t.req.Spec.NMax
	}
	if t.req.MaxTokens > 0 {
		k = min(k, t.req.MaxTokens-t.generated-1)
	}
	// t.next sits at len(tokens); draft i at len(tokens)+1+i must stay below n_ctx.
	return min(k, s.cfg.NCtx-1-len(t.slot.tokens))
}

// specAccepted is how many of drafts the samples confirm: sample i is the model's token
// after draft i-1 (after the decoded token for i = 0), so draft i stands when sample i
// equals it and every earlier draft stood.
func specAccepted(drafts []Token, smp []Sampled) int {
	a := 0
	for a < len(drafts) && a < len(smp) && smp[a].Token == drafts[a] {
		a++
	}
	return a
}

// specMaxWait bounds the backoff after wholly rejected proposals (task.specWait).
const specMaxWait = 32

// The cost-aware draft limit (specCostCap). A session's drafts are modelled as
// accepted one after another with probability p each (conditional on the earlier ones
// holding), so draft i lands with probability p^i. A step of R rows costs StepCost+R
// and yields G tokens (its decoders' plus the drafts expected to land); one more draft
// row raises tokens per cost iff p^i·(StepCost+R) > G. p is the session's own history
// (specHits/specTrials, decayed by specDecay per trial, starting at specPrior), so a
// session whose drafts rarely land stops drafting once other sessions fill the step,
// and one copying its context (p near 1) keeps long proposals.
const (
	// specDecay weighs a session's past trials: about the last 1/(1-specDecay) draft
	// positions verified count, so a session that stops copying soon stops drafting.
	specDecay = 0.95
	// specPriorHits/specPriorTrials: a new session's p (0.75, worth two trials), so
	// a lone session drafts from its first step and one early rejection does not stop
	// it; among eight decoders it only probes until its drafts have landed.
	specPriorHits, specPriorTrials = 1.5, 2.0
	// specProbeEvery: a session the limit keeps from drafting still proposes after
	// that many steps without a draft (its p would never change otherwise), at most
	// specProbeLen tokens, so a session that starts copying is found again.
	specProbeEvery = 16
	specProbeLen   = 4
	// specProbeMatch is the shortest context match an ngram-simple probe drafts from
	// (specDraft): on SmolLM2's chat at N = 8 probes from 3-token matches landed
	// 19-60% of their drafts (docs/speculative.md).
	specProbeMatch = 8
)

// specP is t's estimated probability that a draft lands given the earlier ones did.
func (t *task) specP() float64 { return t.specHits / t.specTrials }

// specCostCap is how many of at most k drafts pay for their rows in a step that so far
// yields gain tokens from rows rows (specDecay's comment has the model); k when the
// limit is off (StepCost < 0).
func (s *Scheduler) specCostCap(t *task, k int, gain, rows float64) int {
	c := s.cfg.Spec.StepCost
	if c < 0 {
		return k
	}
	p, q := t.specP(), 1.0
	n := 0
	for n < k {
		q *= p
		if q*(c+rows) <= gain {
			break
		}
		gain += q
		rows++
		n++
	}
	return n
}

// specExpected is what n drafts of t add to the step's expected tokens.
func (t *task) specExpected(n int) float64 {
	p, q, e := t.specP(), 1.0, 0.0
	for range n {
		q *= p
		e += q
	}
	return e
}

// specLearn folds one verification into t's history: a accepted of k proposed is a
// successful trials and, if a < k, one failed one (drafts after a rejection are not
// tried).
func (t *task) specLearn(k, a int) {
	for i := 0; i < a; i++ {
		t.specHits = t.specHits*specDecay + 1
		t.specTrials = t.specTrials*specDecay + 1
	}
	if a < k {
		t.specHits *= specDecay
		t.specTrials = t.specTrials*specDecay + 1
	}
}

// specAdapt updates t's draft cap from one verification: a fully accepted proposal
// doubles it (up to DraftMax), a rejected one shrinks it to what was accepted plus one,
// so a session whose text stopped repeating soon proposes little, and one copying text
// grows back to long proposals within a few steps.
func (s *Scheduler) specAdapt(t *task, k, a int) {
	if k == 0 {
		return
	}
	t.specLearn(k, a)
	if a == k {
		t.draftCap = min(max(t.draftCap, 1)*2, s.cfg.Spec.DraftMax)
	} else {
		t.draftCap = max(a+1, 1)
	}
	// Wholly rejected proposals back off: 1, 2, 4, ... up to specMaxWait steps without
	// drafting, until a proposal gets a token accepted. Text that does not repeat its
	// context (plain chat) then rarely pays for a verification.
	if a == 0 {
		t.specMisses++
		t.specWait = min(1<<min(t.specMisses-1, 10), specMaxWait)
	} else {
		t.specMisses = 0
	}
	if s.mod != nil {
		// llama.cpp's ngram-mod: a session whose proposals keep failing (under a
		// quarter accepted, five times running) resets the shared table, which has
		// filled with n-grams that no longer predict anything.
		if 4*a < k {
			t.modLow++
			if t.modLow >= 5 {
				s.mod.reset()
				for _, r := range s.running {
					r.modFed = 0
				}
				t.modLow = 0
			}
		} else {
			t.modLow = 0
		}
	}
}

// ngramMatch finds the longest suffix (up to maxN tokens) of ctx followed by last that
// occurs earlier in it, the most recent such occurrence: its length and where that
// occurrence ends. The scan over the context is ngram-simple's whole cost; neither
// minN nor k changes which match it finds (ngramFrom applies them), so one match
// serves every caller in a step (ngramSimple).
func ngramMatch(ctx []Token, last Token, maxN int) (best, end int) {
	n := len(ctx) + 1
	at := func(i int) Token {
		if i == len(ctx) {
			return last
		}
		return ctx[i]
	}
	best, end = 0, -1
	// j is where an earlier occurrence of the suffix ends (it is followed by j+1).
	for j := n - 2; j >= 0 && best < maxN; j-- {
		if ctx[j] != last {
			continue
		}
		m := 1
		for m < maxN && j-m >= 0 && ctx[j-m] == at(n-1-m) {
			m++
		}
		if m > best {
			best, end = m, j
		}
	}
	return best, end
}

// ngramFrom is the proposal of a match found by ngramMatch: up to k tokens after the
// occurrence ending at end, or nil when the match is shorter than minN.
func ngramFrom(ctx []Token, last Token, best, end, minN, k int) []Token {
	if best < minN {
		return nil
	}
	out := make([]Token, 0, k)
	for i := end + 1; i < len(ctx)+1 && len(out) < k; i++ {
		if i == len(ctx) {
			out = append(out, last)
		} else {
			out = append(out, ctx[i])
		}
	}
	return out
}

// ngramMemo is a task's ngram-simple match in the current step, for the context it was
// found in (its length and next token).
type ngramMemo struct {
	ok        bool
	n         int
	next      Token
	best, end int
}

// ngramSimple is ngram-simple's proposal for t (at least minN matched, at most k
// tokens). The match is looked up once per step: DraftWants asks whether ngram-simple
// proposes before it asks a draft model (pureDraft) and Plan asks again for the
// proposal to verify, with another minN (a probe's) or k (the step's real room), which
// only ngramFrom uses. Plan clears the memo.
func (s *Scheduler) ngramSimple(t *task, minN, k int) []Token {
	ctx, m := t.slot.tokens, &t.ngram
	if s.ngramNoMemo || !m.ok || m.n != len(ctx) || m.next != t.next {
		best, end := ngramMatch(ctx, t.next, s.cfg.Spec.NgramMax)
		*m = ngramMemo{ok: true, n: len(ctx), next: t.next, best: best, end: end}
		s.ngramLookups++
	}
	return ngramFrom(ctx, t.next, m.best, m.end, minN, k)
}

// ngramMod is llama.cpp's common_ngram_mod: a fixed table indexed by a hash of n
// tokens, holding the token that last followed them (collisions overwrite).
type ngramMod struct {
	n       int
	entries []Token
	used    int
}

func newNgramMod(n int) *ngramMod {
	m := &ngramMod{n: n, entries: make([]Token, modSize)}
	m.reset()
	return m
}

func (m *ngramMod) reset() {
	for i := range m.entries {
		m.entries[i] = NotDrawn
	}
	m.used = 0
}

// idx hashes n tokens as llama.cpp does.
func (m *ngramMod) idx(toks []Token) int {
	var h uint64
	for _, t := range toks[:m.n] {
		h = h*6364136223846793005 + uint64(int64(t))
	}
	return int(h % uint64(len(m.entries)))
}

// add records that toks[n] followed toks[:n].
func (m *ngramMod) add(toks []Token) {
	i := m.idx(toks)
	if m.entries[i] == NotDrawn {
		m.used++
	}
	m.entries[i] = toks[m.n]
}

// draft chains lookups from the last n tokens of ctx+last, up to k tokens.
func (m *ngramMod) draft(ctx []Token, last Token, k int) []Token {
	if len(ctx)+1 < m.n {
		return nil
	}
	win := make([]Token, 0, m.n+k)
	win = append(win, ctx[len(ctx)-(m.n-1):]...)
	win = append(win, last)
	for range k {
		tok := m.entries[m.idx(win[len(win)-m.n:])]
		if tok == NotDrawn {
			break
		}
		win = append(win, tok)
	}
	return win[m.n:]
}

// modFeed adds the n-grams of t's context it has not added yet (the whole prompt on the
// first call: its pool's tokens too), and resets the table past a quarter full as
// llama.cpp does (collisions would make most proposals wrong).
func (s *Scheduler) modFeed(t *task) {
	m, ctx := s.mod, t.slot.tokens
	for ; t.modFed+m.n < len(ctx); t.modFed++ {
		m.add(ctx[t.modFed : t.modFed+m.n+1])
	}
	if 4*m.used > len(m.entries) {
		m.reset()
		for _, r := range s.running {
			r.modFed = 0
		}
	}
}
