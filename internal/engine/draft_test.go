package engine

import (
	"fmt"
	"slices"
	"testing"
)

// fakeDraft is the fake backend's draft model (DraftBackend): it proposes what the
// fake model itself would generate, except that it gets a token wrong wherever a hash
// of the context says so (about one in four), so proposals are partly accepted. held
// is what it keeps per target sequence, as a real drafter keeps cells.
type fakeDraft struct {
	held  map[int][]Token
	wants int
}

// Draft implements DraftBackend.
func (f *fakeBackend) Draft(wants []DraftWant) []DraftProposal {
	model := f.model
	if model == nil {
		model = fakeNext
	}
	if f.draft.held == nil {
		f.draft.held = map[int][]Token{}
	}
	var out []DraftProposal
	for _, w := range wants {
		f.draft.wants++
		// The want is the session's real context: its sequence holds it (plus, before
		// this plan's removals run, the last step's rejected drafts).
		if ctx := w.Tokens[:len(w.Tokens)-1]; !slices.Equal(f.tokens(w.Seq)[:min(len(ctx), len(f.kv[w.Seq]))], ctx) {
			f.t.Errorf("draft want for seq %d: context %v, the sequence holds %v", w.Seq, ctx, f.tokens(w.Seq))
		}
		toks := slices.Clone(w.Tokens)
		for range w.K {
			nx := model(toks)
			if h := fakeNext(toks); h%4 == 0 {
				nx = 10 + (nx-9)%50 // a wrong guess
			}
			toks = append(toks, nx)
		}
		d := toks[len(w.Tokens):]
		f.draft.held[w.Seq] = toks[:len(toks)-1]
		out = append(out, DraftProposal{Task: w.Task, At: len(w.Tokens), Tokens: d})
	}
	return out
}

// DraftSeqRm implements DraftBackend.
func (f *fakeBackend) DraftSeqRm(seq int) { delete(f.draft.held, seq) }

// checkDraftHeld fails when the drafter holds state for a sequence the target emptied.
func (h *harness) checkDraftHeld() {
	h.t.Helper()
	for seq := range h.be.draft.held {
		if len(h.be.kv[seq]) == 0 {
			h.t.Errorf("the drafter holds %d tokens for seq %d, which the target emptied", len(h.be.draft.held[seq]), seq)
		}
	}
}

// TestDraftModelLossless: with a draft model (alone, and after ngram-simple; and as the
// MTP head: the engine sees the same DraftBackend, only the type differs) the
// workload's output is the same as without speculation, pooled, cached, in sessions and
// beside prefills; the model was asked, some drafts land and some do not, and the
// drafter holds nothing for sequences the target emptied.
func TestDraftModelLossless(t *testing.T) {
	base := specWorkload(t, Spec{})
	for _, types := range [][]string{{SpecDraftSimple}, {SpecNgramSimple, SpecDraftSimple}, {SpecDraftMTP}} {
		for _, cost := range []float64{-1, 0} {
			t.Run(fmt.Sprintf("%v/stepcost%g", types, cost), func(t *testing.T) {
				r, h := specWorkloadH(t, Spec{Types: types, DraftMax: 6, StepCost: cost})
				for i := range base.texts {
					if r.texts[i] != base.texts[i] || r.finish[i] != base.finish[i] || r.predicted[i] != base.predicted[i] {
						t.Errorf("task %d: with the draft model %q (%s, %d tokens), without %q (%s, %d tokens)",
							i, r.texts[i], r.finish[i], r.predicted[i], base.texts[i], base.finish[i], base.predicted[i])
					}
				}
				if h.be.draft.wants == 0 || r.draftN == 0 || r.accept == 0 || r.accept == r.draftN {
					t.Errorf("%d wants, drafted %d, accepted %d: want some of each, not all accepted", h.be.draft.wants, r.draftN, r.accept)
				}
				if r.drawn != base.drawn {
					t.Errorf("the backend drew %d samples, %d without speculation", r.drawn, base.drawn)
				}
				h.checkDraftHeld()
				t.Logf("%d wants, drafted %d, accepted %d", h.be.draft.wants, r.draftN, r.accept)
			})
		}
	}
}

// TestDraftModelFreed: a cancelled request's and finished requests' draft state is
// dropped with their sequences (prefix cache off: nothing is kept), and a stale
// proposal (for a task that moved on) is not verified.
func TestDraftModelFreed(t *testing.T) {
	cfg := poolCfg()
	cfg.Spec = Spec{Types: []string{SpecDraftSimple}, DraftMax: 4, StepCost: -1}
	h := newHarness(t, cfg)
	a := h.submit(Request{Prompt: seqTokens(100, 20), MaxTokens: 40})
	b := h.submit(Request{Prompt: seqTokens(200, 20), MaxTokens: 40})
	for range 4 {
		h.step()
	}
	if len(h.be.draft.held) != 2 {
		t.Fatalf("drafter holds %d sequences while two decode", len(h.be.draft.held))
	}
	h.cancel(a)
	h.step()
	h.checkDraftHeld()
	if len(h.be.draft.held) != 1 {
		t.Errorf("after the cancel the drafter holds %d sequences, want 1", len(h.be.draft.held))
	}
	// A proposal for another position than the task's is dropped.
	tb := h.s.byID(b)
	h.s.offerDrafts(nil, []DraftProposal{{Task: b, At: len(tb.slot.tokens), Tokens: []Token{1, 2}}})
	if tb.spec.model.offered != nil {
		t.Error("a stale proposal was kept")
	}
	h.run()
	if _, ok := h.done(b); !ok {
		t.Fatal("b did not end")
	}
	h.checkDraftHeld()
	if len(h.be.draft.held) != 0 {
		t.Errorf("after every request ended the drafter holds %d sequences", len(h.be.draft.held))
	}
}

// TestNgramLookupOncePerStep: with ngram-simple before draft-simple, draftWants looks
// the n-grams up to decide whether to ask the model and Plan looks again for the
// proposal it verifies; the match is kept on the task between the two (ngramSession),
// so each session's context is scanned at most once per step, and every batch is the
// one the two separate scans planned.
func TestNgramLookupOncePerStep(t *testing.T) {
	for _, cost := range []float64{-1, 0} {
		t.Run(fmt.Sprintf("stepcost%g", cost), func(t *testing.T) {
			spec := Spec{Types: []string{SpecNgramSimple, SpecDraftSimple}, DraftMax: 6, StepCost: cost}
			r, h := specWorkloadH(t, spec)
			rTwice, hTwice := specWorkloadWith(t, spec, func(h *harness) { ngramOf(h.s).noMemo = true })
			if len(h.be.batches) != len(hTwice.be.batches) {
				t.Fatalf("%d batches with the kept match, %d with two scans per step", len(h.be.batches), len(hTwice.be.batches))
			}
			for i := range h.be.batches {
				if !slices.Equal(h.be.batches[i], hTwice.be.batches[i]) {
					t.Fatalf("batch %d differs: with the kept match %v, with two scans %v", i, h.be.batches[i], hTwice.be.batches[i])
				}
			}
			// A session scans at most once in a step in which it decodes (a sampled
			// entry that is not a draft; prefills' last entries count too, so this
			// bounds from above).
			decoding := 0
			for _, b := range h.be.batches {
				for _, e := range b {
					if e.Sample && !e.Draft {
						decoding++
					}
				}
			}
			once, twice := ngramOf(h.s).lookups, ngramOf(hTwice.s).lookups
			if once == 0 || once > decoding || once >= twice {
				t.Errorf("%d scans with the kept match, %d with two per step, %d decode entries: want 0 < kept ≤ entries, kept < two", once, twice, decoding)
			}
			if h.be.draft.wants == 0 || r.draftN == 0 || r.draftN != rTwice.draftN {
				t.Errorf("%d wants, drafted %d (%d with two scans): want the model asked and the same drafts", h.be.draft.wants, r.draftN, rTwice.draftN)
			}
			t.Logf("ngram-simple scans: %d with the match kept, %d with two per step; %d decode entries, %d model wants", once, twice, decoding, h.be.draft.wants)
		})
	}
}

// ngramOf is s's ngram-simple drafter (nil when not configured).
func ngramOf(s *Scheduler) *ngramSimple {
	for _, d := range s.drafters {
		if n, ok := d.(*ngramSimple); ok {
			return n
		}
	}
	return nil
}

// TestDrafterRegistry: the registry is the one word on which speculation types draft
// with a model. Each entry gives either a Drafter of its own or a Model; a model type's
// drafter is the backend's (its session takes the backend's proposals, the first such
// session of a task is the one offered them) and a scheduler asks the backend to draft
// exactly when one is configured; the server's half hangs off a model type once.
func TestDrafterRegistry(t *testing.T) {
	for _, d := range Drafters() {
		if (d.New == nil) == (d.Model == nil) {
			t.Errorf("%s: want exactly one of New and Model", d.Name)
		}
	}
	for _, c := range []struct {
		types   []string
		backend bool
		model   int // the index of the session offered the backend's proposals (-1: none)
	}{
		{[]string{SpecNgramSimple, SpecNgramMod}, false, -1},
		{[]string{SpecDraftSimple}, true, 0},
		{[]string{SpecNgramMod, SpecDraftMTP}, true, 1},
		{[]string{SpecNgramSimple, SpecDraftSimple, SpecDraftMTP}, true, 1},
	} {
		cfg := poolCfg()
		cfg.Spec = Spec{Types: c.types}
		h := newHarness(t, cfg)
		if got := h.s.backendDrafts(); got != c.backend {
			t.Errorf("%v: backendDrafts %v, want %v", c.types, got, c.backend)
		}
		ss := h.s.newSpecSession()
		if len(ss.drafters) != len(c.types) {
			t.Fatalf("%v: %d sessions, want %d", c.types, len(ss.drafters), len(c.types))
		}
		if c.model < 0 && ss.model != nil || c.model >= 0 && ss.model != ss.drafters[c.model] {
			t.Errorf("%v: the backend's proposals go to %v, want session %d", c.types, ss.model, c.model)
		}
	}

	saved := drafters
	t.Cleanup(func() { drafters = saved })
	drafters = []DrafterType{{Name: SpecNgramSimple, New: newNgramSimple}, {Name: SpecDraftSimple, Model: &ModelDraft{}}}
	panics := func(name string, opener any) (p bool) {
		defer func() { p = recover() != nil }()
		SetModelOpener(name, opener)
		return false
	}
	if !panics(SpecNgramSimple, 1) || !panics("no-such-type", 1) {
		t.Error("an opener for a type that drafts without a model was taken")
	}
	if panics(SpecDraftSimple, 1) || !panics(SpecDraftSimple, 2) {
		t.Error("want the first opener of a model type taken and a second refused")
	}
	if d, _ := LookupDrafter(SpecDraftSimple); d.Model.Opener() != 1 {
		t.Errorf("the opener is %v, want 1", d.Model.Opener())
	}
}
