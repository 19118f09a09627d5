package engine

import (
	"slices"
	"testing"
)

// A toy drafter, added the way docs/speculative.md ("Adding a drafter") says: this one
// file and one registry line (in TestToyDrafter; a real drafter's goes in drafters). It
// proposes a fixed token, k times, and keeps per session how many of its drafts were
// verified and accepted.
const specToyFixed = "toy-fixed"

// toyToken is what the toy always proposes; toyModel writes it often.
const toyToken Token = 42

type toyDrafter struct{ sessions []*toySession }

func newToyDrafter(Spec) Drafter { return &toyDrafter{} }

func (d *toyDrafter) NewSession() DraftSession {
	s := &toySession{}
	d.sessions = append(d.sessions, s)
	return s
}

type toySession struct{ verified, accepted int }

func (s *toySession) Propose(_ []Token, _ Token, k int, _ bool) []Token {
	return slices.Repeat([]Token{toyToken}, k)
}
func (s *toySession) Verified(k, a int) { s.verified, s.accepted = s.verified+k, s.accepted+a }
func (s *toySession) EndStep()          {}

// toyModel is a fake model that writes toyToken two times in three.
func toyModel(seq []Token) Token {
	if h := fakeNext(seq); h%3 != 0 {
		return toyToken
	}
	return fakeNext(seq)
}

// TestToyDrafter: a drafter registered with one line is a --spec-type like the built-in
// ones (parsed, validated, tried in order after another drafter), its sessions' drafts
// are verified and its per-session state hears how each fared, and the output is the
// one plain decoding gives.
func TestToyDrafter(t *testing.T) {
	saved := drafters
	drafters = append(drafters, DrafterType{Name: specToyFixed, New: newToyDrafter}) // the registry line
	t.Cleanup(func() { drafters = saved })

	types, err := ParseSpecTypes(SpecNgramSimple + "," + specToyFixed)
	if err != nil || !slices.Equal(types, []string{SpecNgramSimple, specToyFixed}) {
		t.Fatalf("ParseSpecTypes: %v, %v", types, err)
	}
	run := func(spec Spec) (texts []string, drafted, accepted int, h *harness) {
		cfg := poolCfg()
		cfg.Spec = spec
		h = newHarness(t, cfg)
		h.be.model = toyModel
		var ids []TaskID
		for i := range 4 {
			ids = append(ids, h.submit(Request{Prompt: seqTokens(100*i+1, 20), MaxTokens: 50}))
		}
		h.run()
		h.checkAccounting()
		for _, id := range ids {
			ev, ok := h.done(id)
			if !ok || ev.Err != nil {
				t.Fatalf("task %d: ended %v, %v", id, ok, ev.Err)
			}
			texts = append(texts, h.text(id))
			drafted += ev.Stats.DraftN
			accepted += ev.Stats.DraftAccepted
		}
		return texts, drafted, accepted, h
	}
	base, _, _, _ := run(Spec{})
	for _, types := range [][]string{{specToyFixed}, types} {
		texts, drafted, accepted, h := run(Spec{Types: types, DraftMax: 4, StepCost: -1})
		if !slices.Equal(texts, base) {
			t.Errorf("%v: the toy drafter changed the output:\n%q\n%q", types, texts, base)
		}
		if drafted == 0 || accepted == 0 || accepted == drafted {
			t.Errorf("%v: drafted %d, accepted %d: want the drafts verified, some accepted and some not", types, drafted, accepted)
		}
		var toy *toyDrafter
		for _, d := range h.s.drafters {
			if x, ok := d.(*toyDrafter); ok {
				toy = x
			}
		}
		if toy == nil || len(toy.sessions) != 4 {
			t.Fatalf("%v: toy drafter %v: want one session per request", types, toy)
		}
		v, a := 0, 0
		for _, s := range toy.sessions {
			v, a = v+s.verified, a+s.accepted
		}
		// Every verification reaches every drafter of the session (ngram-simple's drafts
		// too), so the toy's sessions heard of all of them.
		if v != drafted || a != accepted {
			t.Errorf("%v: the toy's sessions heard of %d drafts, %d accepted; the requests report %d, %d", types, v, a, drafted, accepted)
		}
		t.Logf("%v: drafted %d, accepted %d", types, drafted, accepted)
	}
}
