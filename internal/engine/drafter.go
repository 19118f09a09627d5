package engine

import (
	"fmt"
	"slices"
	"strings"
)

// Drafters (issue 43). A speculation type (--spec-type) is a Drafter: the scheduler
// makes one per configured type, in --spec-type order, from the Spec (each reads its own
// options there), and every decoding session gets a DraftSession of each. A session's
// drafters are asked in order every step it may draft; the first proposal of at least
// the session's draft minimum is verified (speculative.go). What a drafter keeps, shared
// by all sessions (ngram-mod's table) or per session (ngram-simple's match, a backend
// proposal), is its own: the scheduler knows only that a session may have drafts, how
// many it may propose (the adaptive cap, the cost-aware limit, the back-off) and how
// they fared.
//
// Adding a drafter is one file (spec_<name>.go: the Drafter, its DraftSession, its
// options) and one line in drafters below (docs/speculative.md "Adding a drafter");
// TestToyDrafter adds one in a test file. A drafter that needs a model (a second model,
// MTP heads) declares it in its line (DrafterType.Model) instead of a Drafter: its
// proposals come from the backend (draft.go), whose runner half says how it drafts, and
// the server's half, how it is opened, hangs off the same line (SetModelOpener).

// A Drafter is one speculation type: it makes each decoding session's drafting state.
type Drafter interface {
	// NewSession makes the state of a session that starts decoding (a task from its
	// admission to its end).
	NewSession() DraftSession
}

// A DraftSession is one drafter's state for one decoding session.
type DraftSession interface {
	// Propose returns at most k tokens that continue ctx (the session's tokens, its pool's
	// included) followed by next (sampled, not decoded yet), or nil. It may be asked more
	// than once in a step (draftWants asks whether a drafter before a backend one
	// proposes; Plan asks for the proposal it verifies), with another k. probe: the
	// cost-aware limit keeps the session from drafting and this is its periodic probe
	// (specProbeEvery), whose drafts are paid for at odds already judged too low; a
	// drafter may ask more of its proposal then. ctx must not be kept.
	Propose(ctx []Token, next Token, k int, probe bool) []Token
	// Verified reports a verification of k of the session's drafts (whichever of its
	// drafters proposed them), a of them accepted. Called only with k > 0.
	Verified(k, a int)
	// EndStep: the step's plan is made and the session's context moves on.
	EndStep()
}

// A DrafterType is a registry entry: one speculation type and everything the server
// needs to know of it. Name is its --spec-type; Defaults and Check are how its options in
// Spec default and what they must satisfy (nil: it has none). A type that drafts within
// the scheduler (from the tokens) gives New, which makes its Drafter from the
// (defaulted, validated) Spec; a type that drafts with a model gives Model instead, and
// its Drafter is the engine's backendDrafter (draft.go), whose sessions propose what the
// backend's drafter (Caps.Draft) offered.
type DrafterType struct {
	Name     string
	New      func(sp Spec) Drafter
	Defaults func(sp *Spec)
	Check    func(sp Spec) error
	// Model is set for a type that drafts with a model (a draft model, MTP heads).
	Model *ModelDraft
}

// A ModelDraft is what a speculation type that drafts with a model declares beside its
// name: what the server reads before it opens anything, and the server's half of the
// type (SetModelOpener), which opens it over the served model.
type ModelDraft struct {
	// DraftPMin is --draft-p-min's default for it (the runner stops a session's draft at
	// the first token its drafter gives less).
	DraftPMin float64
	// MTPLayers: the served model is loaded with its MTP (NextN) layers, which draft.
	MTPLayers bool
	// opener is the server's half, opaque here (Opener).
	opener any
}

// Opener is the server's half of the type, as SetModelOpener registered it (nil: none).
func (m *ModelDraft) Opener() any { return m.opener }

// drafters is the registry of speculation types, in the order flag help lists them: the
// only list of them. The server's halves of the model types (how each is checked and
// opened over the served model, which needs llama and runner, below which the engine
// sits) hang off these entries (SetModelOpener) rather than a second list keyed by name,
// so a type is added, named and described in one place.
var drafters = []DrafterType{
	{Name: SpecNgramSimple, New: newNgramSimple, Defaults: ngramSimpleDefaults, Check: ngramSimpleCheck},
	{Name: SpecNgramMod, New: newNgramModDrafter, Defaults: ngramModDefaults, Check: ngramModCheck},
	{Name: SpecDraftSimple, Model: &ModelDraft{DraftPMin: DefaultDraftPMin}},
	{Name: SpecDraftMTP, Model: &ModelDraft{DraftPMin: DefaultMTPPMin, MTPLayers: true}},
}

// SpecTypes are the speculation types the engine knows, in the order flag help lists
// them (the registry's).
var SpecTypes = func() []string {
	var out []string
	for _, d := range drafters {
		out = append(out, d.Name)
	}
	return out
}()

// Drafters is the registry, in its order (a copy; the entries' Model is shared).
func Drafters() []DrafterType { return slices.Clone(drafters) }

// LookupDrafter returns the registry entry of type name.
func LookupDrafter(name string) (DrafterType, bool) {
	for _, d := range drafters {
		if d.Name == name {
			return d, true
		}
	}
	return DrafterType{}, false
}

// SetModelOpener hangs the server's half of model type name (opener: what the server
// checks and opens for it; the engine never reads it) off its registry entry. The server
// calls it once per model type when it starts (its init); a second call for a type, or
// a type that is unknown or drafts without a model, is a programming error and panics.
func SetModelOpener(name string, opener any) {
	d, ok := LookupDrafter(name)
	switch {
	case !ok || d.Model == nil:
		panic(fmt.Sprintf("engine.SetModelOpener: %q is not a speculation type that drafts with a model", name))
	case d.Model.opener != nil:
		panic(fmt.Sprintf("engine.SetModelOpener: %q already has an opener", name))
	}
	d.Model.opener = opener
}

// newDrafter makes the type's Drafter from sp.
func (d DrafterType) newDrafter(sp Spec) Drafter {
	if d.Model != nil {
		return backendDrafter{}
	}
	return d.New(sp)
}

// modelDrafterAt reports whether the scheduler's i-th drafter drafts with a model: the
// registry's word for its type (s.drafters follows the validated Spec.Types).
func (s *Scheduler) modelDrafterAt(i int) bool {
	if i >= len(s.cfg.Spec.Types) {
		return false
	}
	d, ok := LookupDrafter(s.cfg.Spec.Types[i])
	return ok && d.Model != nil
}

// specNames is the registry's names, for error messages (the registry may have grown
// since SpecTypes was made: tests add drafters).
func specNames() string {
	var out []string
	for _, d := range drafters {
		out = append(out, d.Name)
	}
	return strings.Join(out, ", ")
}

// ParseSpecTypes reads a comma-separated --spec-type list ("none" or empty: off).
func ParseSpecTypes(v string) ([]string, error) {
	var out []string
	for _, name := range strings.Split(v, ",") {
		name = strings.TrimSpace(name)
		_, known := LookupDrafter(name)
		switch {
		case name == "" || name == SpecNone:
			continue
		case !known:
			return nil, fmt.Errorf("unknown speculation type %q: want none or a comma-separated list of %s", name, specNames())
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

// newDrafters makes the Drafters of sp's types, in order (sp validated: every type is
// registered).
func newDrafters(sp Spec) []Drafter {
	var out []Drafter
	for _, name := range sp.Types {
		if d, ok := LookupDrafter(name); ok {
			out = append(out, d.newDrafter(sp))
		}
	}
	return out
}

// specSession is a decoding session's speculation: what the scheduler itself keeps (the
// adaptive cap, the back-off, the history behind the cost-aware limit, the totals) and
// the session of each of the server's drafters, in --spec-type order.
type specSession struct {
	// cap is the most drafts proposed next (adapted to how the last ones fared: specAdapt).
	cap int
	// wait is how many more steps the session decodes without drafting after proposals
	// that were wholly rejected (misses of them in a row): a back-off, since every
	// rejection costs a verification and the removal of its cells.
	wait, misses int
	// hits/trials: the decayed draft history for the cost-aware limit (specCostCap);
	// idle counts steps since the session last drafted (its probes).
	hits, trials float64
	idle         int
	// drafted, accepted: the totals proposed and accepted (Stats.DraftN); filtered: draft
	// tokens the grammar cut before planning (Stats.DraftFiltered).
	drafted, accepted, filtered int
	drafters                    []DraftSession
	// model is the session of the first drafter that drafts with a model, which takes
	// the backend's proposals (offerDrafts), or nil.
	model *backendSession
}

// newSpecSession is a new decoding session's speculation state.
func (s *Scheduler) newSpecSession() specSession {
	ss := specSession{cap: s.cfg.Spec.DraftMax, hits: specPriorHits, trials: specPriorTrials, idle: specProbeEvery}
	for i, d := range s.drafters {
		if !s.modelDrafterAt(i) {
			ss.drafters = append(ss.drafters, d.NewSession())
			continue
		}
		b := &backendSession{}
		if ss.model == nil {
			ss.model = b
		}
		ss.drafters = append(ss.drafters, b)
	}
	return ss
}

// backOff counts a miss (a wholly rejected proposal, or a backend drafter that had
// nothing) and waits 1, 2, 4 … up to specMaxWait steps before the session drafts again.
func (ss *specSession) backOff() {
	ss.misses++
	ss.wait = min(1<<min(ss.misses-1, 10), specMaxWait)
}

// endStep tells every drafter that the step's plan is made.
func (ss *specSession) endStep() {
	for _, d := range ss.drafters {
		d.EndStep()
	}
}
