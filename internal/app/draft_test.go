package app

// A draft model (--model-draft, --spec-type draft-simple; issue 23) on the real model:
// SmolLM2 drafts for itself (every draft it makes is what the target would choose, so
// acceptance is high: the mechanism, not the speed, is under test), and the output is
// the same as without speculation, greedy and seeded, cold, pooled and cached, beside
// other speculating traffic (testSpeculativeSameOutput). A draft model of another
// vocabulary is refused at startup, and the drafter holds no cells once requests end.

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/runner"
	"github.com/polykv/polykv/internal/testmodel"
)

func TestDraftModel(t *testing.T) {
	model := modelPath(t)
	t.Run("same output", func(t *testing.T) {
		testDraftSameOutput(t, Config{NCtx: 2048, Parallel: 3, MaxPools: 1, SpecType: "draft-simple", ModelDraft: model, DraftMax: 8})
	})
	t.Run("pool prefix shared", func(t *testing.T) {
		// Two sessions on one pool: the pool's prefix is decoded once in the draft
		// context (seq_cp to each session), not once per session.
		a, base := startServer(t, Config{NCtx: 2048, Parallel: 2, MaxPools: 1, SpecType: "draft-simple", ModelDraft: model, DraftMax: 8})
		doc := editPrompt(5) + editPrompt(6) + editPrompt(7)
		prompt := tokenize(t, a, doc)
		shared := len(prompt) - 8
		pool := num(createPool(t, base, map[string]any{"tokens": prompt[:shared], "pin": true})["pool_id"])
		before := draftOf(a).Decoded()
		var wg sync.WaitGroup
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := specCompletion(t, base, map[string]any{"prompt": prompt, "pool_id": pool, "max_tokens": 16, "logprobs": 1, "ignore_eos": true, "temperature": 0})
				if r.draftN == 0 {
					t.Error("a pooled session did not draft")
				}
			}()
		}
		wg.Wait()
		if n := draftOf(a).Decoded() - before; n >= int64(2*shared) {
			t.Errorf("the draft model decoded %d tokens for two sessions on a %d-token pool: the prefix was not shared", n, shared)
		} else {
			t.Logf("the draft model decoded %d tokens for two sessions on a %d-token pool", n, shared)
		}
	})
	t.Run("vocabulary mismatch refused", func(t *testing.T) {
		other := testmodel.Arch(t, "llama") // random weights, another tokenizer
		a, err := Open(withDefaults(Config{ModelPath: model, ModelDraft: other, NCtx: 512, Parallel: 1}), nil)
		if err == nil {
			a.Close()
			t.Fatal("a draft model with another vocabulary was accepted")
		}
		if !strings.Contains(err.Error(), "cannot draft for") || !strings.Contains(err.Error(), "vocabulary") {
			t.Errorf("unclear refusal: %v", err)
		}
	})
	t.Run("cells freed", func(t *testing.T) {
		a, base := startServer(t, Config{NCtx: 1024, Parallel: 2, SpecType: "draft-simple", ModelDraft: model, DraftMax: 8, PrefixCache: "off"})
		var wg sync.WaitGroup
		runs := make([]specRun, 2)
		for i := range runs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runs[i] = specCompletion(t, base, map[string]any{"prompt": editPrompt(i), "max_tokens": 24, "logprobs": 1, "ignore_eos": true, "temperature": 0})
			}()
		}
		wg.Wait()
		for i, r := range runs {
			if r.draftN == 0 || r.accepted == 0 || r.accepted > r.draftN {
				t.Errorf("request %d: drafted %d, accepted %d", i, r.draftN, r.accepted)
			}
		}
		// The finished requests' sequences are emptied in the engine's next step.
		deadline := time.Now().Add(5 * time.Second)
		for {
			cells, seqs := draftOf(a).Held()
			if cells == 0 && seqs == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after every request ended the draft context holds %d cells of %d sequences", cells, seqs)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

// testDraftSameOutput is testSpeculativeSameOutput made small enough for a draft model
// that costs what the target does: each measured completion (cold, pooled, cached,
// seeded) runs off and then on beside one other speculating request.
func testDraftSameOutput(t *testing.T, cfg Config) {
	a, base := startServer(t, cfg)
	prompt := tokenize(t, a, editPrompt(17))
	pool := num(createPool(t, base, map[string]any{"tokens": prompt[:len(prompt)-8], "pin": true})["pool_id"])
	drafted, accepted := 0, 0
	for i, v := range []map[string]any{
		{"temperature": 0, "cache_prompt": false},
		{"temperature": 0, "pool_id": pool},
		{"temperature": 0},
		{"temperature": 0.9, "seed": 7, "cache_prompt": false},
	} {
		var runs [2]specRun
		for j, spec := range []bool{false, true} {
			body := map[string]any{"prompt": prompt, "max_tokens": 24, "logprobs": 1, "ignore_eos": true, "speculative": spec}
			for k, x := range v {
				body[k] = x
			}
			done := make(chan struct{})
			go func() { // traffic: another request drafting, prefilling and ending beside it
				defer close(done)
				post(t, base+"/v1/completions", map[string]any{"prompt": otherPrompts[(i+j)%len(otherPrompts)], "max_tokens": 12, "temperature": 0})
			}()
			runs[j] = specCompletion(t, base, body)
			<-done
		}
		off, on := runs[0], runs[1]
		if off.draftN != 0 {
			t.Errorf("%v: speculative false drafted %d tokens", v, off.draftN)
		}
		if !slices.Equal(on.ids, off.ids) || !slices.Equal(on.lps, off.lps) {
			t.Errorf("%v: with the draft model %v (logprobs %v), without %v (logprobs %v)", v, on.ids, on.lps, off.ids, off.lps)
		}
		t.Logf("%v: drafted %d, accepted %d", v, on.draftN, on.accepted)
		drafted += on.draftN
		accepted += on.accepted
	}
	if drafted == 0 || accepted == 0 || accepted > drafted {
		t.Errorf("drafted %d tokens, %d accepted: want some of both", drafted, accepted)
	}
}

// draftOf is a's draft-model drafter (draft-simple; nil: none).
func draftOf(a *App) *runner.Drafter {
	if a.draft == nil {
		return nil
	}
	d, _ := a.draft.drafter.(*runner.Drafter)
	return d
}

// TestModelOpeners: every speculation type the engine's registry says drafts with a
// model has the server's half hung off it (engine.SetModelOpener), and the server reads
// the rest of what it needs from the same entry: the --draft-p-min default and whether
// the served model loads its MTP layers. No model is loaded.
func TestModelOpeners(t *testing.T) {
	n := 0
	for _, d := range engine.Drafters() {
		if d.Model == nil {
			continue
		}
		n++
		if op, ok := d.Model.Opener().(*modelOpener); !ok || op.open == nil {
			t.Errorf("%s: no opener registered", d.Name)
		}
		if got := (Config{DraftPMin: -1}).DraftPMinFor(d.Name); got != d.Model.DraftPMin {
			t.Errorf("%s: --draft-p-min default %v, want the registry's %v", d.Name, got, d.Model.DraftPMin)
		}
	}
	if n == 0 {
		t.Fatal("no model drafters registered")
	}
	for _, c := range []struct {
		spec, draft string
		model       string
		mtp, asst   bool
	}{
		{"ngram-simple", "", "", false, false},
		{"", "d.gguf", engine.SpecDraftSimple, false, false},
		{"ngram-mod," + engine.SpecDraftMTP, "", engine.SpecDraftMTP, true, false},
		{engine.SpecDraftMTP, "a.gguf", engine.SpecDraftMTP, true, true},
	} {
		cfg := Config{SpecType: c.spec, ModelDraft: c.draft, DraftPMin: -1}
		p, err := cfg.specPlan()
		if err != nil {
			t.Fatalf("%q %q: %v", c.spec, c.draft, err)
		}
		if p.model.Name != c.model || p.mtpLayers() != c.mtp || p.assistant(cfg) != c.asst {
			t.Errorf("%q %q: model %q, MTP layers %v, assistant %v; want %q, %v, %v", c.spec, c.draft, p.model.Name, p.mtpLayers(), p.assistant(cfg), c.model, c.mtp, c.asst)
		}
	}
	if _, err := (Config{SpecType: engine.SpecDraftSimple + "," + engine.SpecDraftMTP, ModelDraft: "d.gguf", DraftPMin: -1}).specPlan(); err == nil || !strings.Contains(err.Error(), "cannot both run") {
		t.Errorf("two model drafters: %v, want refused", err)
	}
}
