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
// TestToyDrafter adds one in a test file. A drafter that needs the model (a second
// model, MTP heads) is a backendDrafter here: its proposals come from the backend
// (draft.go), whose runner and app halves say how it drafts and how it is opened.

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

// drafterType is a registry entry: a speculation type's name, how its Drafter is made
// from the (defaulted, validated) Spec, and, where it has options of its own in Spec,
// how they default and what they must satisfy (nil: none).
type drafterType struct {
	name     string
	new      func(sp Spec) Drafter
	defaults func(sp *Spec)
	check    func(sp Spec) error
}

// drafters is the registry of speculation types, in the order flag help lists them.
var drafters = []drafterType{
	{SpecNgramSimple, newNgramSimple, ngramSimpleDefaults, ngramSimpleCheck},
	{SpecNgramMod, newNgramModDrafter, ngramModDefaults, ngramModCheck},
	{SpecDraftSimple, newBackendDrafter, nil, nil},
	{SpecDraftMTP, newBackendDrafter, nil, nil},
}

// SpecTypes are the speculation types the engine knows, in the order flag help lists
// them (the registry's).
var SpecTypes = func() []string {
	var out []string
	for _, d := range drafters {
		out = append(out, d.name)
	}
	return out
}()

// lookupDrafter returns the registry entry of type name.
func lookupDrafter(name string) (drafterType, bool) {
	for _, d := range drafters {
		if d.name == name {
			return d, true
		}
	}
	return drafterType{}, false
}

// specNames is the registry's names, for error messages (the registry may have grown
// since SpecTypes was made: tests add drafters).
func specNames() string {
	var out []string
	for _, d := range drafters {
		out = append(out, d.name)
	}
	return strings.Join(out, ", ")
}

// ParseSpecTypes reads a comma-separated --spec-type list ("none" or empty: off).
func ParseSpecTypes(v string) ([]string, error) {
	var out []string
	for _, name := range strings.Split(v, ",") {
		name = strings.TrimSpace(name)
		_, known := lookupDrafter(name)
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
		if d, ok := lookupDrafter(name); ok {
			out = append(out, d.new(sp))
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
}

// newSpecSession is a new decoding session's speculation state.
func (s *Scheduler) newSpecSession() specSession {
	ss := specSession{cap: s.cfg.Spec.DraftMax, hits: specPriorHits, trials: specPriorTrials, idle: specProbeEvery}
	for _, d := range s.drafters {
		ss.drafters = append(ss.drafters, d.NewSession())
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
