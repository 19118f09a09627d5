package app

// MTP drafting in the server (--spec-type draft-mtp; issue 23) on the qwen35 test model
// with one NextN block (scripts/qwen35mtp-testmodel.cpp): a hybrid target, so rejected
// drafts are rolled back through llama.cpp's recurrent snapshots, and an MTP context
// that mirrors every target decode and cell operation (runner.MTP).

import (
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/polykv/polykv/internal/testmodel"
)

// TestMTPServed: greedy and seeded output with MTP drafts equal the output without,
// cold and pooled, beside other traffic (one client pooled); the head drafts, some
// drafts are accepted and some rejected; the MTP context's cells stay the target's
// after every operation, no entry is decoded without its hidden state, and nothing of
// a finished request is left in it.
func TestMTPServed(t *testing.T) {
	cfg := Config{ModelPath: testmodel.Arch(t, "qwen35mtp"), NCtx: 2048, Parallel: 4, MaxPools: 2,
		Threads: 2, SpecType: "draft-mtp", DraftMax: 3, SpecStepCost: -1}
	a, base := startServer(t, cfg)
	if a.draft == nil || a.draft.mtp == nil {
		t.Fatal("draft-mtp asked for, no MTP drafter")
	}
	mtp := a.draft.mtp
	nSeq := cfg.Parallel + cfg.MaxPools
	mtp.CheckMirror(nSeq)

	rootToks := archTokens(a, 1, 60)
	root := num(createPool(t, base, map[string]any{"tokens": rootToks})["pool_id"])

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				p := archTokens(a, uint64(200+10*w+i), 15+10*w)
				body := map[string]any{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": true}
				if w == 1 {
					body["prompt"], body["pool_id"] = append(slices.Clone(rootToks), p...), root
				}
				post(t, base+"/v1/completions", body)
			}
		}()
	}
	stopped := false
	stopTraffic := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	defer stopTraffic()

	drafted, accepted := 0, 0
	for _, c := range []struct {
		name   string
		pool   int
		prompt []int32
		extra  map[string]any
	}{
		{"unpooled", 0, append(slices.Clone(rootToks), archTokens(a, 3, 9)...), nil},
		{"pooled", root, append(slices.Clone(rootToks), archTokens(a, 4, 9)...), nil},
		{"short", 0, archTokens(a, 6, 5), nil},
		{"seeded unpooled", 0, append(slices.Clone(rootToks), archTokens(a, 5, 9)...), map[string]any{"temperature": 0.7, "seed": 7}},
		{"seeded pooled", root, append(slices.Clone(rootToks), archTokens(a, 5, 9)...), map[string]any{"temperature": 0.7, "seed": 7}},
	} {
		run := func(spec bool) specRun {
			body := map[string]any{"prompt": c.prompt, "max_tokens": 40, "logprobs": 1, "ignore_eos": true,
				"temperature": 0, "speculative": spec}
			for k, v := range c.extra {
				body[k] = v
			}
			if c.pool > 0 {
				body["pool_id"] = c.pool
			} else {
				body["cache_prompt"] = false
			}
			return specCompletion(t, base, body)
		}
		off, on := run(false), run(true)
		if off.draftN != 0 {
			t.Errorf("%s: speculative false drafted %d tokens", c.name, off.draftN)
		}
		checkSpecSame(t, c.name, on, off)
		drafted += on.draftN
		accepted += on.accepted
		t.Logf("%s: drafted %d accepted %d, largest logprob difference %.2g", c.name, on.draftN, on.accepted, lpDiff(on, off))
	}
	stopTraffic()
	t.Logf("MTP head: %d drafted, %d accepted; mirror decoded %d entries, %d gaps", drafted, accepted, mtp.Decoded(), mtp.Gaps())
	if drafted == 0 || accepted == 0 || accepted == drafted {
		t.Errorf("drafted %d tokens, %d accepted: want both accepted and rejected drafts", drafted, accepted)
	}
	if n, first := mtp.Mismatches(); n > 0 {
		t.Errorf("the MTP context's cells left the target's %d times; first %s", n, first)
	}
	if g := mtp.Gaps(); g > 0 {
		t.Errorf("%d entries mirrored without the target's hidden state of the position before", g)
	}
}

// TestMTPRefused: draft-mtp on a model without MTP layers, or beside a draft model, is
// refused at start with the reason.
func TestMTPRefused(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{ModelPath: testmodel.Arch(t, "qwen35"), SpecType: "draft-mtp"}, "no MTP (NextN) layers"},
		{Config{ModelPath: testmodel.Arch(t, "qwen35mtp"), SpecType: "draft-mtp,draft-simple", ModelDraft: testmodel.Arch(t, "llama")}, "cannot both run"},
	} {
		cfg := withDefaults(c.cfg)
		cfg.NCtx, cfg.Parallel, cfg.Threads = 512, 1, 2
		a, err := Open(cfg, nil)
		if err == nil {
			a.Close()
			t.Errorf("%s: started", cfg.SpecType)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", cfg.SpecType, err, c.want)
		}
	}
}
