package engine

import "slices"

// Drafting with a model (--model-draft, --spec-type draft-simple; issue 23). A draft
// model is I/O: it decodes in its own llama.cpp context, which only the engine
// goroutine may touch, while the scheduler plans without I/O. So drafting is a round
// before each plan, through the one door: Ready first hands out a plan holding only
// Drafts, the sessions that would draft this step and how many tokens each may use
// (draftWants, pure); the driver has the backend's drafter decode them, batched over
// all those sessions, and steps the proposals back as a typed message (Drafted), which
// the plan Ready hands out next then verifies like an n-gram proposal. The plan stays
// a deterministic function of the scheduler's state and its inputs, and the fake
// backend can draft in tests.
//
// The drafter is pluggable: anything that turns a session's context into a proposal
// (a draft model, MTP heads over the target's hidden states) is a DraftBackend behind
// its own --spec-type, whose registry line (drafter.go) declares that it drafts with a
// model (DrafterType.Model); the scheduler gives it a backendDrafter and only sees
// DraftWant and DraftProposal.

// SpecDraftSimple drafts with a second, smaller model of the same vocabulary
// (--model-draft), greedily (llama-server's draft-simple).
const SpecDraftSimple = "draft-simple"

// SpecDraftMTP drafts with the served model's own MTP (NextN) head over the target's
// hidden states (llama-server's draft-mtp); the model must have MTP layers.
const SpecDraftMTP = "draft-mtp"

// DefaultDraftPMin is --draft-p-min's default for a draft model (draft-simple): a
// session's draft stops at the first token the draft model gives less. It is
// llama.cpp's former default; the pinned b11434's is 0 (draft up to n_max every step).
// PolyKV keeps 0.75 for draft models because each drafted token costs a decode of the
// draft model whether or not it is used; the measurements in docs/speculative.md were
// taken with it.
const DefaultDraftPMin = 0.75

// DefaultMTPPMin is --draft-p-min's default for the MTP head (draft-mtp): 0, b11434's
// default, as llama-server drafts with MTP (the head costs one block per token, and
// its probabilities run low while its first token is often right).
const DefaultMTPPMin = 0.0

// DraftWant asks the drafter for a proposal continuing one session.
type DraftWant struct {
	Task TaskID
	// Seq is the session's sequence in the target; the drafter keys its own state by it.
	Seq int
	// Tokens are the session's whole context (the tokens it borrows from its pool too)
	// followed by its next token, not decoded yet: the proposal continues them. The
	// drafter must not keep the slice.
	Tokens []Token
	// K is the most tokens worth proposing.
	K int
	// Shared > 0: Tokens[:Shared] are borrowed from the pool on target sequence From,
	// whose draft the drafter may prefill once and share (seq_cp) instead of
	// prefilling them for every session.
	From, Shared int
}

// DraftProposal is the drafter's answer for one DraftWant: Tokens (possibly none)
// continue the want's Tokens, whose length was At.
type DraftProposal struct {
	Task   TaskID
	At     int
	Tokens []Token
}

// DraftBackend is a backend's drafter (a draft model or MTP heads; Caps.Draft). The
// engine calls Draft once per step, before the plan, for the sessions draftWants
// names, and DraftSeqRm when a target sequence is emptied, so that the drafter frees
// its own cells for it (it syncs the rest by token prefix on its next Draft).
type DraftBackend interface {
	// Draft returns a proposal per want it could draft for (a failure is no proposal:
	// drafting is never needed for correctness).
	Draft(wants []DraftWant) []DraftProposal
	// DraftSeqRm drops what the drafter holds for the target's sequence seq.
	DraftSeqRm(seq int)
}

// backendDrafter is the scheduler's side of every speculation type that drafts with a
// model (a draft model, MTP heads: DrafterType.Model): its sessions propose what the
// backend's drafter offered for them in this step's draft round (offerDrafts). How the
// backend drafts is the runner's (runner.ModelDrafter) and how it is opened the server's
// (ModelDraft.Opener).
type backendDrafter struct{}

// NewSession implements Drafter.
func (backendDrafter) NewSession() DraftSession { return &backendSession{} }

// backendSession holds the backend's proposal for the next plan (offerDrafts).
type backendSession struct{ offered []Token }

// Propose implements DraftSession: the backend's proposal cut to k tokens (nil when
// none), used once.
func (b *backendSession) Propose(_ []Token, _ Token, k int, _ bool) []Token {
	d := b.offered
	b.offered = nil
	return d[:min(len(d), k)]
}

// Verified implements DraftSession.
func (b *backendSession) Verified(int, int) {}

// EndStep implements DraftSession.
func (b *backendSession) EndStep() {}

// backendDrafts reports whether a drafter outside the scheduler (one that drafts with a
// model) is configured.
func (s *Scheduler) backendDrafts() bool {
	for i := range s.drafters {
		if s.modelDrafterAt(i) {
			return true
		}
	}
	return false
}

// draftWants names the sessions that would draft with the backend in the next plan and
// how many tokens each may propose: a decoding task with speculation on, not backing
// off, whose earlier drafters (in --spec-type order) propose nothing, and whose drafts
// the cost-aware limit lets through as things stand (Plan decides again with the
// step's real room; a proposal longer than it allows is cut).
func (s *Scheduler) draftWants() []DraftWant {
	if !s.backendDrafts() {
		return nil
	}
	decoders := 0
	for _, t := range s.running {
		if t.status == statusDecoding {
			decoders++
		}
	}
	var out []DraftWant
	for _, t := range s.running {
		if t.status != statusDecoding || !s.specOn(t) || t.spec.wait > 0 {
			continue
		}
		k := min(s.specBudget(t), t.spec.cap)
		if c := s.specCostCap(t, k, float64(decoders), float64(decoders)); c > 0 {
			k = c
		} else if t.spec.idle >= specProbeEvery {
			k = min(k, specProbeLen)
		} else {
			k = 0
		}
		if minN := s.draftMin(t); k < minN || s.pureDraft(t, k, minN) {
			continue
		}
		toks := make([]Token, 0, len(t.slot.tokens)+1)
		toks = append(append(toks, t.slot.tokens...), t.next)
		w := DraftWant{Task: t.id, Seq: t.slot.seq, Tokens: toks, K: k}
		if b := t.slot.base; b != nil && t.slot.shared > 0 {
			w.From, w.Shared = b.Seq, t.slot.shared
		}
		out = append(out, w)
	}
	return out
}

// pureDraft reports whether a drafter listed before the first backend drafter proposes
// for t (then the backend is not asked).
func (s *Scheduler) pureDraft(t *task, k, minN int) bool {
	for i := range s.drafters {
		if s.modelDrafterAt(i) {
			return false
		}
		// (ngram-simple keeps its match for Plan's ask.)
		if p := t.spec.drafters[i].Propose(t.slot.tokens, t.next, k, false); len(p) >= max(minN, 1) {
			return true
		}
	}
	return false
}

// offerDrafts hands the drafter's proposals for wants to the scheduler for the next
// plan; earlier ones not used are dropped. A proposal for a task that has moved on since
// (another length) is ignored. A want the drafter had nothing for (its model was not
// sure enough of the first token) backs off as a wholly rejected proposal does (1, 2,
// 4 … steps without asking): a draft model's decode costs a step's time whether or not
// it proposes, and the cost-aware limit only sees verified drafts.
func (s *Scheduler) offerDrafts(wants []DraftWant, props []DraftProposal) {
	for _, t := range s.running {
		if b := t.spec.model; b != nil {
			b.offered = nil
		}
	}
	got := map[TaskID]bool{}
	for _, p := range props {
		t := s.byID(p.Task)
		if t == nil || t.status != statusDecoding || p.At != len(t.slot.tokens)+1 || len(p.Tokens) == 0 {
			continue
		}
		if b := t.spec.model; b != nil {
			b.offered = slices.Clone(p.Tokens)
		}
		got[p.Task] = true
	}
	for _, w := range wants {
		if t := s.byID(w.Task); t != nil && !got[w.Task] {
			t.spec.backOff()
		}
	}
}

// byID is the running task id, or nil.
func (s *Scheduler) byID(id TaskID) *task {
	for _, t := range s.running {
		if t.id == id {
			return t
		}
	}
	return nil
}

// draftRequest is the draft round ahead of the next plan: the wants to hand the
// backend's drafter (Plan.Drafts), or none when the backend has no drafter, this plan's
// round has been answered, or no session wants drafts (earlier proposals not used are
// then dropped at once).
func (s *Scheduler) draftRequest() []DraftWant {
	if !s.modelDrafts || s.draftsIn {
		return nil
	}
	w := s.draftWants()
	if len(w) == 0 {
		s.offerDrafts(nil, nil)
		return nil
	}
	s.draftAsked = w
	return w
}

// drafted takes the drafter's answer to the draft round (message Drafted) for the next
// plan.
func (s *Scheduler) drafted(m Drafted) {
	s.offerDrafts(s.draftAsked, m.Props) // also drops proposals an earlier plan did not use
	s.draftAsked, s.draftsIn = nil, true
}
