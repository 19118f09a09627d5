package bench

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
)

// tenantsBench is issue 24's workload: what other tenants' resident cells cost a
// request that never reads them. Idle pinned pools hold 0, then more, cells; at each
// size (a) --tenants-clients clients send short unpooled requests (a 20-token prompt,
// 4 tokens out, greedy) for --tenants-requests requests each, and (b) one session decodes
// --tenants-gen tokens after its own --tenants-own-token prompt. Each cache type runs with
// --kv-compaction auto (cells stay where llama.cpp put them) and always (the cache
// compacted after every free, as before), alternating per size; each figure is the best
// of --reps.
type tenantsBench struct {
	sizes         []int
	cacheTypes    []string
	clients, reqs int
	own, gen      int
	compareAlways bool
	reps          int
}

func (tb tenantsBench) run(cfg app.Config) error {
	maxSize := slices.Max(tb.sizes)
	lines, err := tenantTokens(cfg.ModelPath, maxSize+tb.own+64)
	if err != nil {
		return err
	}
	c := cfg
	c.PrefixCache, c.PoolGrace = "off", 0
	c.Parallel = max(c.Parallel, tb.clients+1)
	c.MaxPools = max(c.MaxPools, len(tb.sizes)+1)
	c.NCtx = max(c.NCtx, maxSize+tb.own+tb.gen+tb.clients*32+4096) // headroom, as the issue's -c 20096 for a 16,000-token pool
	fmt.Printf("tenants: idle pinned pools hold N cells; (a) %d clients × %d short unpooled requests (20-token prompt, 4 out, greedy); (b) one session decoding %d tokens after %d tokens of its own; n_ctx %d, %d threads\n",
		tb.clients, tb.reqs, tb.gen, tb.own, c.NCtx, c.Threads)
	modes := []string{"auto"}
	if tb.compareAlways {
		modes = append(modes, "always")
	}
	for _, ct := range tb.cacheTypes {
		if err := tb.cacheType(c, ct, modes, lines, maxSize); err != nil {
			return err
		}
	}
	return nil
}

// cacheType runs every size with the K/V cache type ct, one server per compaction mode.
func (tb tenantsBench) cacheType(c app.Config, ct string, modes []string, lines []int32, maxSize int) error {
	fmt.Printf("\ncache %s: compaction auto vs always (the pre-#24 policy), alternating per size\n", ct)
	fmt.Println("held cells  compaction  (a) req/s  p50 ms  (a)/empty  (b) tok/s  (b)/empty  compactions  compaction s")
	apps := map[string]*app.App{}
	for _, mode := range modes {
		cc := c
		cc.CacheTypeK, cc.CacheTypeV, cc.KVCompaction = ct, ct, mode
		a, err := app.Open(cc, nil)
		if err != nil {
			return err
		}
		defer a.Close()
		apps[mode] = a
	}
	// Warm-up, not reported: a fresh server's first requests pay for page faults in the
	// model and the cache buffers.
	for _, mode := range modes {
		if _, _, err := tb.short(apps[mode]); err != nil {
			return err
		}
		if _, err := tb.decode(apps[mode], lines[maxSize:maxSize+tb.own]); err != nil {
			return err
		}
	}
	empty := map[string][2]float64{}
	held := 0
	for _, size := range tb.sizes {
		for _, mode := range modes {
			a := apps[mode]
			if size > held {
				// Grow the idle tenants to size: one more pinned pool, tokens distinct
				// from every request's.
				if _, _, err := a.Engine.CreatePool(context.Background(), engine.PoolSpec{Tokens: lines[held:size], Pin: true}); err != nil {
					return fmt.Errorf("tenants: pool of %d tokens: %w", size-held, err)
				}
			}
			// Best of reps, interleaved: this box's two cores are shared, and a busy
			// moment should not pass for a cost of the held cells.
			rps, p50, tps := 0.0, time.Duration(0), 0.0
			for range tb.reps {
				r, p, err := tb.short(a)
				if err != nil {
					return err
				}
				if r > rps {
					rps, p50 = r, p
				}
				t, err := tb.decode(a, lines[maxSize:maxSize+tb.own])
				if err != nil {
					return err
				}
				tps = max(tps, t)
			}
			if size == 0 {
				empty[mode] = [2]float64{rps, tps}
			}
			n, d := a.Compactions()
			e := empty[mode]
			fmt.Printf("%10d  %10s  %9.2f  %6.0f  %9.2f  %9.1f  %9.2f  %11d  %12.2f\n", size, mode, rps, ms(p50), rps/e[0], tps, tps/e[1], n, d.Seconds())
		}
		held = size
	}
	return nil
}

// short runs the clients' short requests and returns requests per second and the
// median latency.
func (tb tenantsBench) short(a *app.App) (float64, time.Duration, error) {
	var mu sync.Mutex
	var lat []time.Duration
	var firstErr error
	var wg sync.WaitGroup
	start := time.Now()
	for cl := range tb.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range tb.reqs {
				prompt := make([]int32, 20)
				for j := range prompt {
					prompt[j] = int32(1000 + (cl*7919+i*104729+j*31)%20000) // distinct prompts: nothing shared
				}
				t0 := time.Now()
				st, _, err := a.Engine.Submit(context.Background(), engine.Request{Prompt: prompt, MaxTokens: 4, IgnoreEOS: true})
				if err == nil {
					var evs []engine.Event
					evs, err = st.Collect(context.Background())
					if err == nil && evs[len(evs)-1].Err != nil {
						err = evs[len(evs)-1].Err
					}
				}
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				lat = append(lat, time.Since(t0))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return 0, 0, firstErr
	}
	el := time.Since(start)
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return float64(len(lat)) / el.Seconds(), lat[len(lat)/2], nil
}

// decode has one session prefill own (its own context, unpooled) and decode tb.gen
// greedy tokens; it returns the decode tokens per second.
func (tb tenantsBench) decode(a *app.App, own []int32) (float64, error) {
	st, _, err := a.Engine.Submit(context.Background(), engine.Request{Prompt: own, MaxTokens: tb.gen, IgnoreEOS: true})
	if err != nil {
		return 0, err
	}
	evs, err := st.Collect(context.Background())
	if err != nil {
		return 0, err
	}
	last := evs[len(evs)-1]
	if last.Err != nil {
		return 0, last.Err
	}
	if last.Stats.PredictedN < 2 {
		return 0, fmt.Errorf("tenants: decoded %d tokens", last.Stats.PredictedN)
	}
	return float64(last.Stats.PredictedN-1) / last.Stats.PredictTime.Seconds(), nil
}

// tenantTokens is n tokens of varied text (tool descriptions), tokenized line by line so
// that a long prompt costs linear time.
func tenantTokens(path string, n int) ([]int32, error) {
	m, err := llama.LoadModel(path)
	if err != nil {
		return nil, err
	}
	defer m.Free()
	var out []int32
	for i := 0; len(out) < n; i++ {
		line := fmt.Sprintf("Tool %d: fetch_%d(id: string, fields: list) returns the record of area %d with %s.\n", i, i, i*17, strings.Repeat("detail ", 1+i%5))
		toks, err := m.Tokenize(line, false, true)
		if err != nil {
			return nil, err
		}
		out = append(out, toks...)
	}
	return out[:n], nil
}

// parseInts parses a comma-separated list of non-negative integers.
func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 0 {
			return nil, fmt.Errorf("bad number %q", f)
		}
		out = append(out, n)
	}
	return out, nil
}
