package engine

import (
	"fmt"
	"math"
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
// Who drafts is a Drafter per --spec-type (drafter.go: ngram-simple and ngram-mod in
// spec_*.go, drafters with a model of their own through the backend in draft.go); this
// file is what every drafter shares: the configuration, how many drafts a session may
// propose (its adaptive cap, the cost-aware limit, the back-off), and how a verification
// is taken back. The cells of rejected drafts are removed (an OpSeqRm planned with the
// next step) and never enter the cell tree.

// SpecNone turns speculation off (--spec-type none).
const SpecNone = "none"

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
// a long run of rejected drafts is not free; the adaptive cap (specSession.cap) halves it
// after rejections anyway. (Each drafter's own defaults are in its file.)
const (
	DefaultDraftMax = 16
	// DefaultStepCost is StepCost's default, measured on SmolLM2-135M Q4_1 with 2
	// threads (docs/speculative-log.md): a step of R rows took about (DefaultStepCost+R)
	// times one row's share.
	DefaultStepCost = 2.0
	// MaxDraft bounds --draft-max and a request's speculative.n_max.
	MaxDraft = 256
)

// On reports whether any drafter is configured.
func (sp Spec) On() bool { return len(sp.Types) > 0 }

// withDefaults fills the zero fields: the shared ones here, each drafter's own in its
// file (DrafterType.Defaults, applied for every registered drafter whether or not it is
// configured, so a Spec reads the same whichever types it lists).
func (sp Spec) withDefaults() Spec {
	if sp.DraftMax == 0 {
		sp.DraftMax = DefaultDraftMax
	}
	for _, d := range drafters {
		if d.Defaults != nil {
			d.Defaults(&sp) // each drafter's own options (every registered one's)
		}
	}
	if sp.StepCost == 0 {
		sp.StepCost = DefaultStepCost
	}
	return sp
}

// validate checks a configuration (with defaults filled): the shared fields, then each
// registered drafter's own options (DrafterType.Check).
func (sp Spec) validate() error {
	for _, t := range sp.Types {
		if _, ok := LookupDrafter(t); !ok {
			return fmt.Errorf("unknown speculation type %q (want %s)", t, specNames())
		}
	}
	switch {
	case sp.DraftMax < 1 || sp.DraftMax > MaxDraft:
		return fmt.Errorf("draft max must be in 1..%d, got %d", MaxDraft, sp.DraftMax)
	case sp.DraftMin < 0 || sp.DraftMin > sp.DraftMax:
		return fmt.Errorf("draft min must be in 0..draft max (%d), got %d", sp.DraftMax, sp.DraftMin)
	}
	for _, d := range drafters {
		if d.Check == nil {
			continue
		}
		if err := d.Check(sp); err != nil {
			return err
		}
	}
	if math.IsNaN(sp.StepCost) {
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
// at position len(t.slot.tokens), of at most k tokens: the first of its drafters' (in
// --spec-type order) with at least the session's minimum, after the grammar's cut; nil
// when none is worth verifying. probe: the cost-aware limit keeps t from drafting and
// this is its periodic probe (DraftSession.Propose).
func (s *Scheduler) specDraft(t *task, k int, probe bool) []Token {
	minN := s.draftMin(t)
	k = min(k, t.spec.cap)
	if k < minN {
		return nil
	}
	for _, ds := range t.spec.drafters {
		d := ds.Propose(t.slot.tokens, t.next, k, probe)
		if len(d) > 0 && t.req.Sampling.Grammar != "" && s.draftCheck != nil {
			// Cut at the first token the grammar forbids: the sampler could never
			// draw it, so it and every draft after it would be rejected anyway.
			n := s.draftCheck.DraftFits(t.id, d)
			t.spec.filtered += len(d) - n
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

// draftRoom frees up to n cells for drafts when too few are free, and returns the
// cells freed: a request to the KV-cache manager (kvcache.DraftRoom), which alone
// evicts; each victim's loss is taken as any eviction's (evictVictim).
func (s *Scheduler) draftRoom(n int) int { return s.kv.DraftRoom(s.now, n, s.take) }

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

// specMaxWait bounds the backoff after wholly rejected proposals (specSession.wait).
const specMaxWait = 32

// The cost-aware draft limit (specCostCap). A session's drafts are modelled as
// accepted one after another with probability p each (conditional on the earlier ones
// holding), so draft i lands with probability p^i. A step of R rows costs StepCost+R
// and yields G tokens (its decoders' plus the drafts expected to land); one more draft
// row raises tokens per cost iff p^i·(StepCost+R) > G. p is the session's own history
// (specSession.hits/trials, decayed by specDecay per trial, starting at specPrior), so a
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
)

// p is the session's estimated probability that a draft lands given the earlier ones did.
func (ss *specSession) p() float64 { return ss.hits / ss.trials }

// specCostCap is how many of at most k drafts pay for their rows in a step that so far
// yields gain tokens from rows rows (specDecay's comment has the model); k when the
// limit is off (StepCost < 0).
func (s *Scheduler) specCostCap(t *task, k int, gain, rows float64) int {
	c := s.cfg.Spec.StepCost
	if c < 0 {
		return k
	}
	p, q := t.spec.p(), 1.0
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

// expected is what n drafts of the session add to the step's expected tokens.
func (ss *specSession) expected(n int) float64 {
	p, q, e := ss.p(), 1.0, 0.0
	for range n {
		q *= p
		e += q
	}
	return e
}

// learn folds one verification into the session's history: a accepted of k proposed is
// a successful trials and, if a < k, one failed one (drafts after a rejection are not
// tried).
func (ss *specSession) learn(k, a int) {
	for i := 0; i < a; i++ {
		ss.hits = ss.hits*specDecay + 1
		ss.trials = ss.trials*specDecay + 1
	}
	if a < k {
		ss.hits *= specDecay
		ss.trials = ss.trials*specDecay + 1
	}
}

// specAdapt updates t's draft cap from one verification: a fully accepted proposal
// doubles it (up to DraftMax), a rejected one shrinks it to what was accepted plus one,
// so a session whose text stopped repeating soon proposes little, and one copying text
// grows back to long proposals within a few steps. Then each of t's drafters hears how
// the proposal fared.
func (s *Scheduler) specAdapt(t *task, k, a int) {
	if k == 0 {
		return
	}
	ss := &t.spec
	ss.learn(k, a)
	if a == k {
		ss.cap = min(max(ss.cap, 1)*2, s.cfg.Spec.DraftMax)
	} else {
		ss.cap = max(a+1, 1)
	}
	// Wholly rejected proposals back off: 1, 2, 4, ... up to specMaxWait steps without
	// drafting, until a proposal gets a token accepted. Text that does not repeat its
	// context (plain chat) then rarely pays for a verification.
	if a == 0 {
		ss.backOff()
	} else {
		ss.misses = 0
	}
	for _, d := range ss.drafters {
		d.Verified(k, a)
	}
}
