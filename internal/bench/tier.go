package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/tier"
)

// tierBench is issue 25's workload: a pool of --tier-tokens evicted and attached again,
// its KV restored from RAM and from disk against a full prefill; then a restart with
// --tier-pinned pinned pools, timed until the first attach is served from restored KV.
type tierBench struct {
	tokens, pinned int
}

func (tb tierBench) run(cfg app.Config, reps int) error {
	root, _, err := fanout{root: tb.tokens}.prompts(cfg.ModelPath, nil)
	if err != nil {
		return err
	}
	c := cfg
	c.PrefixCache, c.MaxPools, c.PoolGrace = "off", max(tb.pinned, 2), 0
	c.NCtx = max(c.NCtx, (tb.pinned+1)*(tb.tokens+64))
	fmt.Printf("tier: a %d-token pool evicted, then attached (1 decoded token); best of %d; the disk file was just written (page cache warm unless dropped)\n\n", tb.tokens, reps)
	fmt.Println("source    restore ms  attach ms  prefill ms  prefill/restore")
	for _, where := range []tier.Location{tier.RAM, tier.Disk} {
		c := c
		c.PoolDir = ""
		if where == tier.Disk {
			dir, err := os.MkdirTemp("", "polykv-tier-bench-")
			if err != nil {
				return err
			}
			defer os.RemoveAll(dir)
			c.PoolRAMMB, c.PoolDir = 0, dir
		}
		restore, attach, prefill := time.Duration(1<<62), time.Duration(1<<62), time.Duration(1<<62)
		for range reps {
			r, a, p, err := tb.once(c, root, where)
			if err != nil {
				return err
			}
			restore, attach, prefill = min(restore, r), min(attach, a), min(prefill, p)
		}
		fmt.Printf("%-8s  %10.1f  %9.1f  %10.1f  %15.1f\n", where, ms(restore), ms(attach), ms(prefill), ms(prefill)/ms(restore))
	}
	return tb.restart(c, root)
}

// once creates the pool (timing its prefill), evicts it, attaches and reads the tier's
// own restore time (read, verify, load into llama.cpp).
func (tb tierBench) once(c app.Config, root []int32, where tier.Location) (time.Duration, time.Duration, time.Duration, error) {
	a, err := app.Open(c, nil)
	if err != nil {
		return 0, 0, 0, err
	}
	defer a.Close()
	if a.Tier == nil {
		return 0, 0, 0, fmt.Errorf("bench: the tier is off for this model: %s", a.TierOff)
	}
	ctx := context.Background()
	start := time.Now()
	id, _, err := a.Engine.CreatePool(ctx, engine.PoolSpec{Tokens: root})
	if err != nil {
		return 0, 0, 0, err
	}
	prefill := time.Since(start)
	if res, err := a.Engine.Send(ctx, engine.EvictPool{Pool: id}); err != nil || res.Err != nil {
		return 0, 0, 0, fmt.Errorf("evict: %v %v", err, res.Err)
	}
	a.Tier.Flush()
	before := a.Tier.Stats()
	start = time.Now()
	if err := attachOne(ctx, a, id, root); err != nil {
		return 0, 0, 0, err
	}
	attach := time.Since(start)
	after := a.Tier.Stats()
	if after.Restores[where] != before.Restores[where]+1 {
		return 0, 0, 0, fmt.Errorf("bench: the attach was not restored from %s (restores %v, misses %v)", where, after.Restores, after.Misses)
	}
	secs := after.RestoreSeconds[where] - before.RestoreSeconds[where]
	return time.Duration(secs * float64(time.Second)), attach, prefill, nil
}

func attachOne(ctx context.Context, a *app.App, id int, prefix []int32) error {
	st, _, err := a.Engine.Submit(ctx, engine.Request{Prompt: append(slices.Clone(prefix), 13), HasPool: true, PoolID: id, MaxTokens: 1, IgnoreEOS: true})
	if err != nil {
		return err
	}
	evs, err := st.Collect(ctx)
	if err != nil {
		return err
	}
	if last := evs[len(evs)-1]; last.Err != nil || last.Stats.CacheN != len(prefix) {
		return fmt.Errorf("bench: attach: %v, cache_n %d of %d", last.Err, last.Stats.CacheN, len(prefix))
	}
	return nil
}

// restart records --tier-pinned pinned pools, closes the server and opens it again on
// the same --pool-dir: the time from Open until the first attach is served from KV
// restored from disk, against prefilling one pool.
func (tb tierBench) restart(c app.Config, root []int32) error {
	dir, err := os.MkdirTemp("", "polykv-tier-restart-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	c.PoolDir = dir
	a, err := app.Open(c, nil)
	if err != nil {
		return err
	}
	ctx := context.Background()
	var ids []int
	var prefill time.Duration
	for i := range tb.pinned {
		toks := slices.Clone(root)
		toks[len(toks)-1] = int32(100 + i) // distinct prefixes
		start := time.Now()
		id, _, err := a.Engine.CreatePool(ctx, engine.PoolSpec{Tokens: toks, Pin: true})
		if err != nil {
			a.Close()
			return err
		}
		prefill = time.Since(start)
		ids = append(ids, id)
	}
	a.Close()
	start := time.Now()
	b, err := app.Open(c, nil)
	if err != nil {
		return err
	}
	defer b.Close()
	opened := time.Since(start)
	toks := slices.Clone(root)
	toks[len(toks)-1] = 100
	if err := attachOne(ctx, b, ids[0], toks); err != nil {
		return err
	}
	first := time.Since(start)
	st := b.Tier.Stats()
	fmt.Printf("\nrestart: %d pinned pools of %d tokens; Open (model load, manifest and entry checks) %.0f ms; first attach served %.0f ms after Open began (restores from disk so far: %d, misses %v); prefilling one pool instead: %.0f ms\n",
		tb.pinned, tb.tokens, ms(opened), ms(first), st.Restores[tier.Disk], st.Misses, ms(prefill))
	return nil
}
