package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/tier"
)

// fleetTier is issue 44's workload, part (a): two replicas share a directory
// (--tier-shared-dir). Replica A serves a --fleet-tier-tokens prompt and writes its
// chunks through to the directory; replica B, which never saw it, serves the same
// prompt. Reported: B's prefilled and restored tokens, B's time to first token against
// a cold replica's full prefill, whether B's greedy tokens and logprobs equal the cold
// one's, and what write-through costs A (how long after its reply the chunks are on
// the shared level, and a short request's latency right after that reply, against the
// same on a replica without a shared level). Each B is a fresh replica, once with the
// shared files in the page cache (replicas on one host) and once with them dropped
// from it (read from the device, as from a network file system's cold cache).
type fleetTier struct {
	tokens, gen int
	remote      string // share a remote level (--tier-remote) instead of a directory
}

// fleetRun is one request's outcome.
type fleetRun struct {
	ttft, total         time.Duration
	promptN, restoredN  int
	tokens              []engine.Token
	logprobs            []float32
	sharedReads, misses int64
}

// serve runs prompt greedily on a (logprobs on) and times its first token.
func (fb fleetTier) serve(a *app.App, prompt []int32, gen int) (fleetRun, error) {
	ctx := context.Background()
	start := time.Now()
	st, _, err := a.Engine.Submit(ctx, engine.Request{Prompt: slices.Clone(prompt), MaxTokens: gen, IgnoreEOS: true, Logprobs: true})
	if err != nil {
		return fleetRun{}, err
	}
	var r fleetRun
	for {
		ev, ok, err := st.Next(ctx)
		if err != nil {
			return fleetRun{}, err
		}
		if !ok {
			return fleetRun{}, errors.New("bench: the stream ended without a Done event")
		}
		for _, tl := range ev.Tokens {
			if r.ttft == 0 {
				r.ttft = time.Since(start)
			}
			r.tokens = append(r.tokens, tl.Token)
			r.logprobs = append(r.logprobs, tl.Logprob)
		}
		if ev.Done {
			if ev.Err != nil {
				return fleetRun{}, ev.Err
			}
			r.total = time.Since(start)
			r.promptN, r.restoredN = ev.Stats.PromptN, ev.Stats.RestoredN
			if a.Tier != nil {
				ts := a.Tier.Stats()
				r.sharedReads, r.misses = ts.Restores[a.Tier.SharedLocation()], 0
				for _, n := range ts.Misses {
					r.misses += n
				}
			}
			return r, nil
		}
	}
}

func (fb fleetTier) run(cfg app.Config, reps int) error {
	prompt, _, err := fanout{root: fb.tokens}.prompts(cfg.ModelPath, nil)
	if err != nil {
		return err
	}
	if fb.remote != "" {
		// A prompt of its own in the remote store (which outlives the run): entries an
		// earlier run left there would let A restore instead of prefilling and writing
		// through.
		prompt[1] = int32(time.Now().UnixNano()%1000) + 1000
	}
	probe, _, err := fanout{root: 16}.prompts(cfg.ModelPath, nil)
	if err != nil {
		return err
	}
	probe[len(probe)-1] = 7 // not a prefix of prompt
	reps = max(1, reps)
	base := cfg
	base.NCtx = max(base.NCtx, len(prompt)+fb.gen+64)
	base.PoolRAMMB, base.PoolDir, base.SharedDir = 0, "", ""
	base.PrefixCache = "on"
	level := "their --tier-shared-dir a local directory"
	if fb.remote != "" {
		level = "their --tier-remote " + fb.remote
	}
	fmt.Printf("fleet-tier: replica B serves a %d-token prompt that replica A served before, %s; %d tokens decoded greedily; best of %d (each B a fresh replica)\n\n", len(prompt), level, fb.gen, reps)

	// The cold reference: a replica without a shared level, prefilling all of it.
	var cold fleetRun
	var coldProbe time.Duration
	for range reps {
		c, err := app.Open(base, nil)
		if err != nil {
			return err
		}
		r, err := fb.serve(c, prompt, fb.gen)
		if err == nil {
			var p fleetRun
			if p, err = fb.serve(c, probe, 1); err == nil && (coldProbe == 0 || p.total < coldProbe) {
				coldProbe = p.total
			}
		}
		c.Close()
		if err != nil {
			return err
		}
		if cold.ttft == 0 || r.ttft < cold.ttft {
			cold = r
		}
	}

	shared := base
	dir := ""
	if fb.remote != "" {
		shared.RemoteTier = fb.remote
	} else {
		if dir, err = os.MkdirTemp("", "polykv-fleet-tier-"); err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		shared.SharedDir = dir
	}
	// Replica A serves the prompt and writes it through.
	a, err := app.Open(shared, nil)
	if err != nil {
		return err
	}
	defer a.Close()
	if a.Tier == nil {
		return fmt.Errorf("bench: the tier is off for this model: %s", a.TierOff)
	}
	ra, err := fb.serve(a, prompt, fb.gen)
	if err != nil {
		return err
	}
	replied := time.Now()
	chunks := int64((len(prompt) + shared.TierChunk - 1) / shared.TierChunk)
	sharedLevel := func() tier.LevelStats { return a.Tier.Stats().Level(a.Tier.SharedLocation()) }
	written := make(chan time.Duration, 1)
	go func() { // when the chunks are on the shared level, timed while the probe runs
		for sharedLevel().Writes < chunks && time.Since(replied) < time.Minute {
			time.Sleep(time.Millisecond)
		}
		written <- time.Since(replied)
	}()
	pa, err := fb.serve(a, probe, 1) // queued behind the saves planned at A's end (engine goroutine)
	if err != nil {
		return err
	}
	onShared := <-written
	if n := sharedLevel().Writes; n < chunks {
		return fmt.Errorf("bench: A wrote %d of %d chunks to the shared level", n, chunks)
	}
	sharedBytes := sharedLevel().Bytes

	row := func(name string, r fleetRun) {
		same := "yes"
		if !slices.Equal(r.tokens, cold.tokens) || !slices.Equal(r.logprobs, cold.logprobs) {
			same = "NO"
		}
		fmt.Printf("%-22s  %8.1f  %9d  %8d  %9.1f%%  %9.3f  %s\n", name, ms(r.ttft), r.promptN, r.restoredN,
			100*float64(r.promptN)/float64(len(prompt)), float64(r.ttft)/float64(cold.ttft), same)
	}
	fmt.Println("replica                 TTFT ms  prefilled  restored  prefilled/prompt  TTFT/cold  output = cold")
	row("cold (no shared level)", cold)
	row("A (writes through)", ra)
	caches := []string{"page cache", "disk-cold"}
	if fb.remote != "" {
		caches = []string{"remote"}
	}
	for _, cache := range caches {
		var best fleetRun
		for range reps {
			if cache == "disk-cold" {
				if r, n, err := dropPageCache(dir); err != nil || r > 0 {
					return fmt.Errorf("bench: dropping the shared files from the page cache: %v (%d of %d pages still resident)", err, r, n)
				}
			}
			b, err := app.Open(shared, nil)
			if err != nil {
				return err
			}
			r, err := fb.serve(b, prompt, fb.gen)
			b.Close()
			if err != nil {
				return err
			}
			if r.misses > 0 || r.sharedReads == 0 {
				return fmt.Errorf("bench: B read %d entries from the shared level, %d misses", r.sharedReads, r.misses)
			}
			if best.ttft == 0 || r.ttft < best.ttft {
				best = r
			}
		}
		row("B ("+cache+")", best)
	}
	fmt.Printf("\nwrite-through on A: %d chunks (%.1f MB) on the shared level %.1f ms after A's reply; a %d-token request sent right after it: %.1f ms (%.1f ms on the cold replica)\n",
		chunks, float64(sharedBytes)/(1<<20), ms(onShared), len(probe), ms(pa.total), ms(coldProbe))
	return nil
}
