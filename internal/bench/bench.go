// Package bench holds the workloads of "polykv bench": decode (the server against a raw
// loop over the binding), prefill, fan-out, spawn ramp, the plain-client workloads,
// the pool tier, tenants and speculative decoding (docs/benchmarks.md has the commands
// and the figures). cmd/polykv parses the flags (Options.Register beside the server's)
// and calls Run; speed is measured here, never by timed unit tests.
package bench

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/llama"
)

// benchPrompts are short, distinct prompts so every session decodes its own sequence.
var benchPrompts = []string{
	"Once upon a time", "The history of Rome", "In a distant galaxy", "The recipe calls for",
	"Dear diary, today", "The stock market", "Deep in the forest", "The first rule of",
	"My grandfather told me", "At the edge of the sea", "The engineer opened", "Long ago, people",
	"The city at night", "A letter arrived", "The scientist said", "On the mountain top",
}

// Options are the benchmark's own flags (its workloads and their sizes); the server's
// flags (model, context, kernels) are the app.Config that Run gets beside them.
type Options struct {
	sizes      *string
	nGen       *int
	reps       *int
	cpuProfile *string
	workload   *string
	fanN       *string
	plainN     *string
	plainModes *string
	loopModes  *string
	tnSizes    *string
	tnTypes    *string
	pf         prefillBench
	fo         fanout
	tb         tierBench
	ft         fleetTier
	tn         tenantsBench
	rp         ramp
	lp         agentLoop
	sb         specBench
	ab         agentsBench
	ep         episode
	ca         codingAgents
}

// Register binds the benchmark's flags to o (cmd/polykv parses them with the server's).
func (o *Options) Register(fs *flag.FlagSet) {
	o.sizes = fs.String("sessions", "1,4,8,16", "concurrent sessions B to measure")
	o.nGen = fs.Int("n", 128, "tokens each session decodes")
	o.reps = fs.Int("reps", 2, "repetitions per measurement (best is reported; spec: alternating rounds, medians reported)")
	o.cpuProfile = fs.String("cpuprofile", "", "write a Go CPU profile of the server runs to this file")
	o.workload = fs.String("workload", "all", "decode (server vs raw loop), prefill (tok/s per model, cache type and prompt length), fanout (pooled vs unpooled agents), ramp (spawn ramp, admission off/on), plain-fanout and agent-loop (plain OpenAI client: automatic prefix reuse vs off vs explicit pool), plain (both plain-client workloads), tier (evicted pool restored from RAM / disk vs prefill; restart with pinned pools), fleet-tier (two replicas sharing --tier-shared-dir: B serves a prompt A served; not part of all), tenants (short requests and one session's decode beside idle pools of other tenants, compaction auto vs always), spec (speculative decoding off vs on: edit and chat agents; not part of all), episode (a team of tool-calling workers delivering packages under an orchestrator: baseline, admission-gated, gated with throttle-toward-floor, llama-server; not part of all), agents (a team of tool-calling agents whose contexts outgrow the cache, beside llama-server with --agents-llama-server; not part of all), coding-agents (Claude Code and Codex sessions of a team replayed from their recorded requests, beside llama-server with --coding-llama-server; not part of all) or all")
	fs.StringVar(&o.pf.models, "prefill-models", "", "prefill: comma-separated GGUF files (default: -m); missing files are skipped")
	fs.StringVar(&o.pf.types, "prefill-cache-types", "f16,q8_0,q4_0", "prefill: KV cache types (K and V alike)")
	fs.StringVar(&o.pf.lengths, "prefill-tokens", "128,2000", "prefill: prompt lengths")
	fs.StringVar(&o.pf.baseline, "prefill-baseline", "", "prefill: path of a llama-bench binary built from llama.cpp; each measurement alternates with it and the ratio is printed")
	fs.IntVar(&o.pf.decode, "prefill-decode", 0, "prefill: also time N single-token decode steps of one sequence after an untimed prompt of --prefill-decode-depth tokens, per model and cache type (tgN rows, alternating likewise; 0: off)")
	fs.IntVar(&o.pf.depth, "prefill-decode-depth", 16, "prefill: tokens of context (prefilled untimed) before the timed decode steps of --prefill-decode")
	fs.IntVar(&o.fo.root, "fanout-root", 2000, "fan-out: tokens of the shared root prefix")
	fs.IntVar(&o.fo.suffix, "fanout-suffix", 100, "fan-out: tokens each agent adds")
	fs.IntVar(&o.fo.gen, "fanout-gen", 128, "fan-out: tokens each agent decodes")
	o.fanN = fs.String("fanout-agents", "1,4,8,16", "fan-out: agent counts N")
	o.plainN = fs.String("plain-agents", "1,4,8,16", "plain-fanout: agent counts N (root, suffix and decoded tokens as --fanout-*)")
	o.plainModes = fs.String("plain-configs", "pool,auto,off", "plain-fanout: server configs to run: pool (explicit pool), auto (automatic prefix reuse), off (reuse off)")
	fs.IntVar(&o.lp.agents, "loop-agents", 8, "agent-loop: agents")
	fs.IntVar(&o.lp.turns, "loop-turns", 6, "agent-loop: turns per agent")
	fs.IntVar(&o.lp.system, "loop-system", 500, "agent-loop: tokens of the shared system prompt")
	fs.IntVar(&o.lp.tool, "loop-tool", 60, "agent-loop: tokens of each turn's tool result")
	fs.IntVar(&o.lp.gen, "loop-gen", 64, "agent-loop: tokens decoded per turn")
	o.loopModes = fs.String("loop-configs", "auto,off", "agent-loop: server configs to run: auto, off")
	fs.IntVar(&o.tb.tokens, "tier-tokens", 2000, "tier: tokens of the evicted pool")
	fs.IntVar(&o.tb.pinned, "tier-pinned", 8, "tier: pinned pools recorded before the restart")
	fs.IntVar(&o.ft.tokens, "fleet-tier-tokens", 2000, "fleet-tier: tokens of the prompt replica A serves and replica B serves again")
	fs.IntVar(&o.ft.gen, "fleet-tier-gen", 16, "fleet-tier: tokens each replica decodes (compared with a cold replica's)")
	fs.StringVar(&o.ft.remote, "fleet-tier-remote", "", "fleet-tier: the replicas share this remote level (--tier-remote, redis://host:port/db) instead of a local directory; the bench flushes nothing there, so give it a database of its own")
	o.tnSizes = fs.String("tenants-sizes", "0,4000,16000,30000", "tenants: cells held by idle pinned pools, ascending from 0")
	o.tnTypes = fs.String("tenants-cache-types", "f16,f32", "tenants: K/V cache types to run")
	fs.IntVar(&o.tn.clients, "tenants-clients", 4, "tenants: clients sending short requests")
	fs.IntVar(&o.tn.reqs, "tenants-requests", 25, "tenants: short requests per client and size")
	fs.IntVar(&o.tn.own, "tenants-own-tokens", 1000, "tenants: own context of the decoding session")
	fs.IntVar(&o.tn.gen, "tenants-gen", 64, "tenants: tokens the session decodes")
	fs.BoolVar(&o.tn.compareAlways, "tenants-compare", true, "tenants: also run with --kv-compaction always, alternating")
	fs.StringVar(&o.sb.agents, "spec-agents", "1,8", "spec: agent counts N")
	fs.StringVar(&o.sb.workloads, "spec-workloads", "edit,chat", "spec: workloads: edit (return a ~600-token JSON document with one field changed), chat (a short story)")
	fs.StringVar(&o.sb.types, "spec-bench-type", "ngram-simple", "spec: the drafters to measure when --spec-type is none")
	fs.IntVar(&o.sb.chatGen, "spec-chat-gen", 256, "spec: tokens each chat agent decodes at most")
	fs.StringVar(&o.sb.llamaServer, "spec-llama-server", "", "spec: also run the workloads on this llama-server binary (make llama-tools), without speculation and with --spec-type ngram-mod")
	fs.IntVar(&o.rp.agents, "ramp-agents", 10, "spawn ramp: agents that ask to join")
	fs.DurationVar(&o.rp.interval, "ramp-interval", 2*time.Second, "spawn ramp: time between join requests")
	fs.IntVar(&o.rp.gen, "ramp-gen", 256, "spawn ramp: tokens each agent decodes")
	fs.Float64Var(&o.rp.floorFr, "ramp-floor", 0.6, "spawn ramp: floor as a fraction of one session's tps")
	o.ab.register(fs)
	o.ca.register(fs)
	fs.IntVar(&o.ep.packages, "episode-packages", 6, "episode: packages to deliver")
	fs.IntVar(&o.ep.steps, "episode-steps", 8, "episode: steps (chat turns) per package")
	fs.DurationVar(&o.ep.tick, "episode-tick", 2*time.Second, "episode: the orchestrator's tick (one spawn at most per tick)")
	fs.IntVar(&o.ep.maxWorkers, "episode-max-workers", 6, "episode: most workers at once (the baseline spawns up to it)")
	fs.IntVar(&o.ep.gen, "episode-gen", 48, "episode: tokens decoded per turn (ignore_eos: every configuration does the same work)")
	fs.IntVar(&o.ep.system, "episode-system", 400, "episode: tokens of the system prompt with the tool definitions (a pool on PolyKV)")
	fs.IntVar(&o.ep.tool, "episode-tool", 120, "episode: tokens of each synthetic tool result")
	fs.DurationVar(&o.ep.toolLatency, "episode-tool-latency", time.Second, "episode: a tool call's latency between turns")
	fs.BoolVar(&o.ep.toolRandom, "episode-tool-random", false, "episode: tool latency uniform in [0, 2 x --episode-tool-latency), seeded per package and step (the same in every configuration)")
	fs.Float64Var(&o.ep.floor, "episode-floor", 0, "episode: the tps floor (0: --episode-floor-frac of one worker's measured speed)")
	fs.Float64Var(&o.ep.floorFrac, "episode-floor-frac", 0.4, "episode: the floor as a fraction of one worker's speed, when --episode-floor is 0 (the design's 15 of 38 tps)")
	fs.StringVar(&o.ep.configs, "episode-configs", "baseline,gated,throttle", "episode: configurations, run alternating (ABC CBA ...): baseline, gated, throttle (gated + throttle toward the floor), llama (needs --episode-llama-server), url (needs --episode-url)")
	fs.StringVar(&o.ep.url, "episode-url", "", "episode: also run the baseline orchestrator against this OpenAI-compatible server (client-side tps only)")
	fs.StringVar(&o.ep.llamaServer, "episode-llama-server", "", "episode: also run the baseline orchestrator against this llama-server binary (make llama-tools), started with the same model, context, threads and batch")
	fs.StringVar(&o.ep.gateKind, "episode-gate", "reserve", "episode: how the gated orchestrator asks: reserve (POST reservations; the id goes with the worker's first request) or capacity (GET /capacity)")
	fs.Float64Var(&o.ep.margin, "episode-throttle-margin", 0.2, "episode: throttle_margin of the throttle configuration")
	fs.Float64Var(&o.ep.maxSkip, "episode-throttle-max-skip", 0.5, "episode: throttle_max_skip of the throttle configuration")
	fs.IntVar(&o.ep.guarantee, "episode-guarantee", 1, "episode: guarantee_min_sessions of the gated configurations")
	fs.IntVar(&o.ep.settleTokens, "episode-settle-tokens", 0, "episode: settle_tokens of the gated configurations (0: the server's default)")
	fs.Int64Var(&o.ep.settleMs, "episode-settle-ms", 0, "episode: settle_max_ms of the gated configurations (0: the server's default)")
	fs.Float64Var(&o.ep.quiet, "episode-quiet", 0, "episode: before each run, wait until other processes use less than this fraction of a core over 3 s (a shared machine; 0: do not wait)")
	fs.DurationVar(&o.ep.quietWait, "episode-quiet-wait", 5*time.Minute, "episode: the longest --episode-quiet waits before running anyway")
	fs.IntVar(&o.ep.retries, "episode-retries", 2, "episode: with --episode-quiet, a run (or the calibration) during which other processes used more than that fraction of a core is shown, discarded and run again, at most this many times")
	fs.IntVar(&o.ep.background, "episode-background", 0, "episode: background agents on a second pool, decoding back to back while the workers run (a mixed load: their floor is lower)")
	fs.IntVar(&o.ep.bgGen, "episode-background-gen", 128, "episode: tokens a background request decodes")
	fs.Float64Var(&o.ep.bgFloorFrac, "episode-background-floor-frac", 0.15, "episode: the background pool's floor as a fraction of one worker's speed (gated and throttle configurations)")
	fs.StringVar(&o.ep.out, "episode-out", "episode-out", "episode: directory for each run's per-second CSV and PNG plot (empty: none)")
}

// Run runs the workload o names on the server cfg configures (resolved), printing its
// tables to stdout (docs/benchmarks.md has the commands and the figures).
func Run(cfg app.Config, o *Options) error {
	var err error
	pfo := plainFanout{fanout: o.fo}
	if pfo.modes, err = parseModes(*o.plainModes, modePool, modeAuto, modeOff); err != nil {
		return err
	}
	if o.lp.modes, err = parseModes(*o.loopModes, modeAuto, modeOff); err != nil {
		return err
	}
	if o.lp.agents < 1 || o.lp.turns < 1 || o.lp.system < 1 || o.lp.tool < 1 || o.lp.gen < 1 {
		return fmt.Errorf("bench: --loop-* sizes must be at least 1")
	}
	plain := func() error {
		if err := pfo.run(cfg, *o.plainN); err != nil {
			return err
		}
		fmt.Println()
		return o.lp.run(cfg)
	}
	if err := printDevice(os.Stdout, cfg); err != nil {
		return err
	}
	switch *o.workload {
	case "fanout":
		return o.fo.run(cfg, *o.fanN)
	case "plain-fanout":
		return pfo.run(cfg, *o.plainN)
	case "agent-loop":
		return o.lp.run(cfg)
	case "plain":
		return plain()
	case "ramp":
		return o.rp.run(cfg)
	case "prefill":
		return o.pf.run(cfg, *o.reps)
	case "tier":
		return o.tb.run(cfg, *o.reps)
	case "fleet-tier":
		if o.ft.tokens < 32 || o.ft.gen < 1 {
			return fmt.Errorf("bench: --fleet-tier-tokens must be at least 32 and --fleet-tier-gen at least 1")
		}
		return o.ft.run(cfg, *o.reps)
	case "tenants":
		if o.tn.sizes, err = parseInts(*o.tnSizes); err != nil || len(o.tn.sizes) == 0 || o.tn.sizes[0] != 0 || !slices.IsSorted(o.tn.sizes) {
			return fmt.Errorf("bench: --tenants-sizes must be ascending from 0, got %q", *o.tnSizes)
		}
		o.tn.cacheTypes = strings.Split(*o.tnTypes, ",")
		if o.tn.clients < 1 || o.tn.reqs < 1 || o.tn.own < 1 || o.tn.gen < 2 {
			return fmt.Errorf("bench: --tenants-clients, -requests, -own-tokens must be at least 1 and --tenants-gen at least 2")
		}
		o.tn.reps = max(1, *o.reps)
		stop, err := startCPUProfile(*o.cpuProfile)
		if err != nil {
			return err
		}
		defer stop()
		return o.tn.run(cfg)
	case "agents":
		return o.ab.run(cfg)
	case "coding-agents":
		return o.ca.run(cfg, *o.reps)
	case "episode":
		o.ep.reps = max(1, *o.reps)
		return o.ep.run(cfg)
	case "spec":
		stop, err := startCPUProfile(*o.cpuProfile)
		if err != nil {
			return err
		}
		defer stop()
		return o.sb.run(cfg, *o.reps)
	}
	if *o.workload != "decode" && *o.workload != "all" {
		return fmt.Errorf("bench: unknown workload %q", *o.workload)
	}
	var bs []int
	for _, f := range strings.Split(*o.sizes, ",") {
		b, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || b < 1 || b > maxBenchSessions {
			return fmt.Errorf("bench: bad session count %q (1..%d)", f, maxBenchSessions)
		}
		bs = append(bs, b)
	}
	fmt.Printf("polykv bench: %s, %d threads, n_ctx %d, %d tokens per session, best of %d\n\n",
		cfg.ModelPath, cfg.Threads, cfg.NCtx, *o.nGen, *o.reps)
	fmt.Println("   B  raw loop tok/s  server tok/s  server/raw")
	for _, b := range bs {
		raw, srv := 0.0, 0.0
		for range *o.reps {
			r, err := rawLoop(cfg, b, *o.nGen)
			if err != nil {
				return err
			}
			s, err := serverRun(cfg, b, *o.nGen, *o.cpuProfile)
			if err != nil {
				return err
			}
			raw, srv = max(raw, r), max(srv, s)
		}
		fmt.Printf("%4d  %14.1f  %12.1f  %10.3f\n", b, raw, srv, srv/raw)
	}
	if *o.workload == "all" {
		fmt.Println()
		if err := o.pf.run(cfg, *o.reps); err != nil {
			return err
		}
		fmt.Println()
		if err := o.fo.run(cfg, *o.fanN); err != nil {
			return err
		}
		fmt.Println()
		if err := o.rp.run(cfg); err != nil {
			return err
		}
		fmt.Println()
		return plain()
	}
	return nil
}

// rawLoop measures B sessions decoding nGen greedy tokens each straight over the
// binding: one prefill batch, then one batch of B tokens per step. No scheduler, no HTTP.
func rawLoop(cfg app.Config, b, nGen int) (float64, error) {
	model, _, err := app.LoadModel(cfg)
	if err != nil {
		return 0, err
	}
	defer model.Free()
	fa := app.FlashAttn(cfg.FlashAttn)
	ctx, err := llama.NewContext(model, llama.ContextParams{FlashAttn: fa, NCtx: cfg.NCtx, NBatch: cfg.NBatch, NUBatch: cfg.NUBatch, NSeqMax: b, NThreads: cfg.Threads, KVUnified: true,
		AttnKernel: llama.KernelNamed(cfg.FAKernel)})
	if err != nil {
		return 0, err
	}
	defer ctx.Free()
	samplers := make([]*llama.Sampler, b)
	for i := range samplers {
		if samplers[i], err = llama.NewSampler(model, llama.SamplerParams{}); err != nil {
			return 0, err
		}
		defer samplers[i].Free()
	}
	start := time.Now()
	ctx.BatchClear()
	pos := make([]int, b)
	idx := make([]int, b)
	for s := range b {
		toks, err := model.Tokenize(benchPrompt(s), true, true)
		if err != nil {
			return 0, err
		}
		for j, t := range toks {
			i, err := ctx.BatchAdd(t, j, s, j == len(toks)-1)
			if err != nil {
				return 0, err
			}
			idx[s] = i
		}
		pos[s] = len(toks)
	}
	if err := ctx.Decode(); err != nil {
		return 0, err
	}
	next := make([]llama.Token, b)
	for s := range b {
		if next[s], err = samplers[s].Sample(ctx, idx[s]); err != nil {
			return 0, err
		}
	}
	for step := 1; step < nGen; step++ {
		ctx.BatchClear()
		for s := range b {
			i, err := ctx.BatchAdd(next[s], pos[s], s, true)
			if err != nil {
				return 0, err
			}
			idx[s] = i
			pos[s]++
		}
		if err := ctx.Decode(); err != nil {
			return 0, err
		}
		for s := range b {
			if next[s], err = samplers[s].Sample(ctx, idx[s]); err != nil {
				return 0, err
			}
		}
	}
	return float64(b*nGen) / time.Since(start).Seconds(), nil
}

// serverRun measures the same workload through the full server: B concurrent HTTP
// completions on loopback, each generating nGen tokens.
func serverRun(cfg app.Config, b, nGen int, profile string) (float64, error) {
	c := cfg
	c.Parallel = b
	a, err := app.Open(c, nil)
	if err != nil {
		return 0, err
	}
	defer a.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	srv := &http.Server{Handler: a.API.Handler()}
	go srv.Serve(ln)
	defer srv.Close()
	url := "http://" + ln.Addr().String() + "/v1/completions"
	stop, err := startCPUProfile(profile)
	if err != nil {
		return 0, err
	}
	defer stop()
	var wg sync.WaitGroup
	errs := make([]error, b)
	got := make([]int, b)
	start := time.Now()
	for s := range b {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body, _ := json.Marshal(map[string]any{"prompt": benchPrompt(s), "max_tokens": nGen, "temperature": 0, "ignore_eos": true})
			resp, err := http.Post(url, "application/json", bytes.NewReader(body))
			if err != nil {
				errs[s] = err
				return
			}
			defer resp.Body.Close()
			raw, _ := io.ReadAll(resp.Body)
			var out struct {
				Usage struct {
					CompletionTokens int `json:"completion_tokens"`
				} `json:"usage"`
			}
			if resp.StatusCode != 200 || json.Unmarshal(raw, &out) != nil {
				errs[s] = fmt.Errorf("bench request: %d %s", resp.StatusCode, raw)
				return
			}
			got[s] = out.Usage.CompletionTokens
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	total := 0
	for s := range b {
		if errs[s] != nil {
			return 0, errs[s]
		}
		total += got[s]
	}
	return float64(total) / elapsed.Seconds(), nil
}

// startCPUProfile starts a Go CPU profile written to path (--cpuprofile) and returns
// the function that stops and closes it; with path empty it does nothing.
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}
