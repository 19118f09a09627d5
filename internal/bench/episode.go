package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/tps"
)

// episode is issue 41's episode workload: the design's headline run (§14.4: a team of
// tool-calling workers delivering packages, an orchestrator spawning a worker every
// tick, a tps floor) scaled to this machine, on a fixed amount of work that every
// configuration completes.
//
// P packages of S steps each. A step is one chat turn of a worker: the system prompt
// with the tool definitions (a pool on PolyKV, shared by every worker), the package's
// running transcript, and a fixed number of decoded tokens (ignore_eos, so every
// configuration decodes the same tokens); between turns the worker's "tool call" takes
// a fixed or random (seeded: the same in every configuration) latency and its
// synthetic result, of a fixed size, joins the transcript. An orchestrator ticks every
// T and spawns one worker when the policy lets it: baseline always (up to a maximum),
// gated when the pool grants a reservation (or /capacity says can_admit), holding a
// refused spawn until a later tick. A worker takes the next undelivered package and
// retires when none is left.
//
// Measured every 250 ms: mean_active_tps and each session's experienced tps from
// /polykv/tps (PolyKV), and the same computed client-side from the token stream (every
// server, llama-server included). Reported per run: wall, time under the floor, deep
// sub-floor time (under half the floor), session-seconds under the floor, package
// delivery p50/p90, tokens generated, workers; per second as CSV, and as a PNG of tps
// and workers over time.
type episode struct {
	packages, steps int
	tick            time.Duration
	maxWorkers      int
	gen             int // tokens decoded per turn
	system, tool    int // tokens of the system prompt and of each tool result
	toolLatency     time.Duration
	toolRandom      bool // latency uniform in [0, 2·toolLatency), seeded per package and step
	floor           float64
	floorFrac       float64
	configs         string
	url             string // an OpenAI-compatible server to run the baseline orchestrator against
	llamaServer     string // a llama-server binary to start and run the baseline orchestrator against
	gateKind        string // reserve | capacity
	margin          float64
	maxSkip         float64
	guarantee       int // guarantee_min_sessions of the gated configurations
	settleTokens    int
	settleMs        int64
	out             string
	reps            int
	// quiet: before each run, wait (at most quietWait) until other processes use less
	// than this fraction of a core (0: do not wait).
	quiet     float64
	quietWait time.Duration
	// retries: a run during which other processes used more than quiet of a core on
	// average is shown, discarded and run again, at most this many times.
	retries int
	// Background agents (0: none): sessions of a second pool, with a floor of their own
	// (bgFloorFrac of one worker's speed), decoding bgGen tokens a request back to back
	// for as long as the workers run: the mixed load where some sessions have room
	// above their floor and others do not.
	background  int
	bgGen       int
	bgFloorFrac float64
}

// Episode configurations.
const (
	epBaseline = "baseline" // PolyKV, spawn every tick up to the maximum
	epGated    = "gated"    // PolyKV, spawn when the pool admits (a floor set)
	epThrottle = "throttle" // gated, and the pool's throttle toward the floor on
	epLlama    = "llama"    // llama-server (--episode-llama-server), baseline orchestrator
	epURL      = "url"      // any OpenAI-compatible server (--episode-url), baseline orchestrator
)

// episodeTexts are the workload's texts: one system prompt, a task per package and a
// tool result per package and step.
type episodeTexts struct {
	system string
	tasks  []string
	tools  [][]string
	// The background agents' system prompt and documents.
	bgSystem string
	bgDocs   []string
}

// texts sizes the texts with the model's tokenizer.
func (e episode) texts(path string) (episodeTexts, error) {
	var tx episodeTexts
	m, err := llama.LoadModel(path)
	if err != nil {
		return tx, err
	}
	defer m.Free()
	grow := func(n int, line func(j int) string) (string, error) {
		var b strings.Builder
		for j := 0; ; j++ {
			b.WriteString(line(j))
			toks, err := m.Tokenize(b.String(), false, false)
			if err != nil {
				return "", err
			}
			if len(toks) >= n {
				return b.String(), nil
			}
		}
	}
	tools := []string{"search_inventory", "read_manifest", "check_route", "weigh_parcel", "book_courier", "notify_customer", "scan_label", "update_ledger"}
	if tx.system, err = grow(e.system, func(j int) string {
		if j == 0 {
			return "You are a courier worker agent. Deliver the package you are given, step by step: call one tool per turn, read its result, then decide the next call. Tools:\n"
		}
		name := tools[j%len(tools)]
		return fmt.Sprintf("- %s_%d(id: string, zone: int): returns the %s record of a package in zone %d as JSON.\n", name, j, strings.ReplaceAll(name, "_", " "), j*11%97)
	}); err != nil {
		return tx, err
	}
	tx.bgSystem = "You are a background summarizer agent. Read the document you are given and write a plain summary of it, one paragraph, no lists."
	for k := range 16 {
		doc, err := grow(200, func(j int) string {
			if j == 0 {
				return fmt.Sprintf("Document %d. Shipping log of depot %d:", k, k*5%23)
			}
			return fmt.Sprintf(" on day %d the depot handled %d parcels, %d late, %d returned;", j, (k*37+j*11)%400, (k+j)%9, (k*j)%5)
		})
		if err != nil {
			return tx, err
		}
		tx.bgDocs = append(tx.bgDocs, doc)
	}
	tx.tasks = make([]string, e.packages)
	tx.tools = make([][]string, e.packages)
	for p := range e.packages {
		tx.tasks[p] = fmt.Sprintf("Package %d: collect it from depot %d, check its route to zone %d and deliver it. Report each step briefly.", p, p*7%19, p*13%97)
		tx.tools[p] = make([]string, e.steps)
		for s := range e.steps {
			if tx.tools[p][s], err = grow(e.tool, func(j int) string {
				if j == 0 {
					return fmt.Sprintf("Tool result (package %d, call %d):", p, s+1)
				}
				return fmt.Sprintf(" field_%d=%d;", j, (p*31+s*17+j*7)%1000)
			}); err != nil {
				return tx, err
			}
		}
	}
	return tx, nil
}

// latency is the tool latency after step s of package p: fixed, or uniform in
// [0, 2·toolLatency) from a generator seeded by (p, s), so every configuration waits
// the same.
func (e episode) latency(p, s int) time.Duration {
	if !e.toolRandom {
		return e.toolLatency
	}
	r := rand.New(rand.NewPCG(uint64(p)+1, uint64(s)+1))
	return time.Duration(r.Float64() * 2 * float64(e.toolLatency))
}

// episodeResult is one run.
type episodeResult struct {
	config             string
	rep                int
	wall               time.Duration
	under, deep        time.Duration // mean_active_tps under the floor / under half of it
	sessUnder          time.Duration // session-seconds under the floor
	clientUnder        time.Duration // the same three, measured client-side from the stream
	clientDeep         time.Duration
	clientSessUnder    time.Duration
	delivered          []time.Duration // per package, from the first tick
	tokens             int
	peakWorkers        int
	workerSeconds      float64 // ∫ workers dt
	throttled          int64   // decode steps skipped by the throttle (PolyKV)
	paced              int64   // turns the throttle held in the queue (PolyKV)
	bgTokens           int     // tokens the background agents decoded while the workers ran
	bgTPS, bgClientTPS float64 // their time-weighted mean experienced tps (server, client)
	foreign            float64 // CPU seconds other processes used during the run
	refusedTicks       int     // ticks that held a spawn the policy refused
	samples            []episodeSample
	meanTPS, clientTPS float64 // time-weighted mean of mean_active_tps while sessions decode
}

// episodeSample is one 250 ms reading.
type episodeSample struct {
	t          time.Duration // since the first tick
	serverMean float64       // the workers' warm decoding sessions' mean tps (server)
	serverN    int           // those sessions
	serverLow  int           // of them under the floor
	serverAll  float64       // mean_active_tps: every session, background ones included
	bgMean     float64       // the background sessions' mean tps (server)
	bgN        int
	clientBg   float64 // the background sessions' mean tps (client)
	clientBgN  int
	clientMean float64
	clientN    int
	clientLow  int
	workers    int
	throttled  int // the running turns' skipped steps (server)
	// Each warm decoding session's experienced tps, by session id.
	serverRates, clientRates map[string]float64
}

func (e episode) run(cfg app.Config) error {
	if e.packages < 1 || e.steps < 1 || e.gen < 1 || e.system < 1 || e.tool < 1 || e.maxWorkers < 1 || e.tick <= 0 {
		return fmt.Errorf("bench: --episode-packages, -steps, -gen, -system, -tool, -max-workers and -tick must be positive")
	}
	configs, err := e.parseConfigs()
	if err != nil {
		return err
	}
	tx, err := e.texts(cfg.ModelPath)
	if err != nil {
		return err
	}
	c := cfg
	c.Parallel = e.maxWorkers
	c.MaxPools = max(c.MaxPools, 2)
	// Room for every worker's whole transcript at once beside the pool, so the runs
	// compare scheduling, not eviction.
	c.NCtx = max(cfg.NCtx, e.maxWorkers*e.perWorker()+e.system+512)
	c.NBatch = max(c.NBatch, e.maxWorkers)
	c.QueueTimeout = 0 // every configuration completes all packages: nothing times out
	floor, bgFloor := e.floor, 0.0
	if floor <= 0 || e.background > 0 {
		var single float64
		for try := 0; ; try++ {
			if e.quiet > 0 {
				waitQuiet(e.quiet, e.quietWait)
			}
			cpu0, t0 := readCPU(), time.Now()
			var err error
			if single, err = e.calibrate(c, tx); err != nil {
				return err
			}
			if !e.contaminated(foreignSince(cpu0), time.Since(t0)) || try >= e.retries {
				break
			}
			fmt.Printf("(calibration discarded: %.1f tok/s while other processes used the cores)\n", single)
		}
		if floor <= 0 {
			floor = e.floorFrac * single
		}
		bgFloor = e.bgFloorFrac * single
		fmt.Printf("one worker alone decodes at %.1f tok/s (experienced, median of 5 turns); floor %.1f tok/s (%.0f%%)\n", single, floor, 100*floor/single)
	}
	if e.background > 0 {
		c.Parallel += e.background
		c.NCtx += e.background * (200 + 64 + e.bgGen + 64)
		c.NBatch = max(c.NBatch, c.Parallel)
		fmt.Printf("%d background agents on a pool of their own (floor %.1f tok/s), %d tokens a request, back to back while the workers run\n", e.background, bgFloor, e.bgGen)
	}
	if e.out != "" {
		if err := os.MkdirAll(e.out, 0o755); err != nil {
			return err
		}
	}
	randomLat := "fixed"
	if e.toolRandom {
		randomLat = "uniform in [0, 2x)"
	}
	fmt.Printf("episode: %d packages x %d steps, %d tokens decoded per turn, a %d-token system prompt with tools, %d-token tool results after %s tool latency (%s);\n",
		e.packages, e.steps, e.gen, e.system, e.tool, e.toolLatency, randomLat)
	fmt.Printf("orchestrator tick %s, at most %d workers, floor %.1f tok/s (deep: < %.1f), gate %s, guarantee %d, throttle margin %.2f, max skip %.2f; n_ctx %d, %d threads\n\n",
		e.tick, e.maxWorkers, floor, floor/2, e.gateKind, e.guarantee, e.margin, e.maxSkip, c.NCtx, c.Threads)
	fmt.Println("other CPU s: CPU time other processes used during the run (this machine's cores are shared; a clean run has ~0)")
	fmt.Println("config    rep  wall s  under floor s  deep s  session-s under  client: under  deep  sess-s  delivery p50 s  p90 s  tokens  peak workers  worker-s  held ticks  throttled steps  paced turns  other CPU s")
	var results []episodeResult
	// Alternating: the configurations in order, then reversed (ABC CBA ...), so none
	// always runs first or on the same machine state.
	for rep := range e.reps {
		order := slices.Clone(configs)
		if rep%2 == 1 {
			slices.Reverse(order)
		}
		for _, name := range order {
			var r episodeResult
			for try := 0; ; try++ {
				if e.quiet > 0 {
					if waited, ok := waitQuiet(e.quiet, e.quietWait); !ok {
						fmt.Printf("(the machine did not quieten in %s: other processes kept more than %.0f%% of a core busy)\n", waited.Round(time.Second), 100*e.quiet)
					}
				}
				var err error
				if r, err = e.once(c, name, rep, floor, bgFloor, tx); err != nil {
					return fmt.Errorf("episode %s run %d: %w", name, rep+1, err)
				}
				if !e.contaminated(r.foreign, r.wall) || try >= e.retries {
					break
				}
				fmt.Printf("(discarded: %s run %d, wall %.1f s, under floor %.1f s, while other processes used %.1f CPU s; run again)\n",
					r.config, r.rep+1, r.wall.Seconds(), r.under.Seconds(), r.foreign)
			}
			results = append(results, r)
			fmt.Printf("%-9s %3d  %6.1f  %13.1f  %6.1f  %15.1f  %13.1f  %4.1f  %6.1f  %14.1f  %5.1f  %6d  %12d  %8.0f  %10d  %15d  %11d  %11.1f\n",
				r.config, r.rep+1, r.wall.Seconds(), r.under.Seconds(), r.deep.Seconds(), r.sessUnder.Seconds(),
				r.clientUnder.Seconds(), r.clientDeep.Seconds(), r.clientSessUnder.Seconds(),
				percentile(r.delivered, 0.5).Seconds(), percentile(r.delivered, 0.9).Seconds(), r.tokens, r.peakWorkers,
				r.workerSeconds, r.refusedTicks, r.throttled, r.paced, r.foreign)
			if e.background > 0 {
				fmt.Printf("          background: %d tokens while the workers ran (%.1f tok/s), mean experienced %.1f tok/s (client-side %.1f)\n",
					r.bgTokens, float64(r.bgTokens)/r.wall.Seconds(), r.bgTPS, r.bgClientTPS)
			}
			if e.out != "" {
				if err := e.write(r, floor); err != nil {
					return err
				}
			}
		}
	}
	e.summary(configs, results)
	return nil
}

// contaminated reports a run of wall during which other processes used foreign CPU
// seconds, more than --episode-quiet of a core on average (never with quiet 0).
func (e episode) contaminated(foreign float64, wall time.Duration) bool {
	return e.quiet > 0 && foreign > e.quiet*wall.Seconds()
}

func (e episode) parseConfigs() ([]string, error) {
	var out []string
	for _, f := range strings.Split(e.configs, ",") {
		f = strings.TrimSpace(f)
		switch f {
		case epBaseline, epGated, epThrottle:
		case epLlama:
			if e.llamaServer == "" {
				return nil, fmt.Errorf("bench: episode config llama needs --episode-llama-server")
			}
		case epURL:
			if e.url == "" {
				return nil, fmt.Errorf("bench: episode config url needs --episode-url")
			}
		default:
			return nil, fmt.Errorf("bench: unknown episode config %q (baseline, gated, throttle, llama, url)", f)
		}
		if !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	if e.llamaServer != "" && !slices.Contains(out, epLlama) {
		out = append(out, epLlama)
	}
	if e.url != "" && !slices.Contains(out, epURL) {
		out = append(out, epURL)
	}
	if e.gateKind != "reserve" && e.gateKind != "capacity" {
		return nil, fmt.Errorf("bench: --episode-gate must be reserve or capacity, got %q", e.gateKind)
	}
	return out, nil
}

// perWorker bounds the cells one worker's transcript needs (its own suffix): the
// task, every turn's tokens and tool result, with room for the chat template.
func (e episode) perWorker() int {
	return e.system + 64 + e.steps*(e.gen+e.tool+32)
}

// summary prints each configuration's mean over its runs, and the change against the
// baseline.
func (e episode) summary(configs []string, rs []episodeResult) {
	type agg struct {
		wall, under, deep, sess, cUnder, cDeep, cSess, p50, p90 float64
		n                                                       int
	}
	m := map[string]*agg{}
	for _, r := range rs {
		a := m[r.config]
		if a == nil {
			a = &agg{}
			m[r.config] = a
		}
		a.n++
		a.wall += r.wall.Seconds()
		a.under += r.under.Seconds()
		a.deep += r.deep.Seconds()
		a.sess += r.sessUnder.Seconds()
		a.cUnder += r.clientUnder.Seconds()
		a.cDeep += r.clientDeep.Seconds()
		a.cSess += r.clientSessUnder.Seconds()
		a.p50 += percentile(r.delivered, 0.5).Seconds()
		a.p90 += percentile(r.delivered, 0.9).Seconds()
	}
	fmt.Println()
	fmt.Println("mean of the runs (change against baseline)")
	fmt.Println("config    runs  wall s          under floor s    deep s           session-s under  client under s   client deep s    delivery p50 s   p90 s")
	base := m[epBaseline]
	cell := func(v, b float64, n int, hasBase bool) string {
		v /= float64(n)
		if !hasBase || b == 0 {
			return fmt.Sprintf("%-16s", fmt.Sprintf("%.1f", v))
		}
		return fmt.Sprintf("%-16s", fmt.Sprintf("%.1f (%+.0f%%)", v, 100*(v/b-1)))
	}
	for _, name := range configs {
		a := m[name]
		if a == nil {
			continue
		}
		hb := base != nil
		var b agg
		if hb {
			b = *base
			n := float64(b.n)
			b.wall, b.under, b.deep, b.sess, b.cUnder, b.cDeep, b.cSess, b.p50, b.p90 = b.wall/n, b.under/n, b.deep/n, b.sess/n, b.cUnder/n, b.cDeep/n, b.cSess/n, b.p50/n, b.p90/n
		}
		fmt.Printf("%-9s %4d  %s %s %s %s %s %s %s %s\n", name, a.n, cell(a.wall, b.wall, a.n, hb), cell(a.under, b.under, a.n, hb),
			cell(a.deep, b.deep, a.n, hb), cell(a.sess, b.sess, a.n, hb), cell(a.cUnder, b.cUnder, a.n, hb), cell(a.cDeep, b.cDeep, a.n, hb),
			cell(a.p50, b.p50, a.n, hb), cell(a.p90, b.p90, a.n, hb))
	}
}

// episodeTarget is the server one run talks to.
type episodeTarget struct {
	base   string
	polykv bool // the /polykv routes exist (a pool, admission, /polykv/tps)
	pool   int
	bgPool int // the background agents' pool
	pid    int // a server process it started (0: in-process or not ours)
	stop   func()
}

// start brings up the server of configuration name.
func (e episode) start(c app.Config, name string, floor, bgFloor float64, tx episodeTexts) (*episodeTarget, error) {
	switch name {
	case epURL:
		return &episodeTarget{base: strings.TrimRight(e.url, "/"), stop: func() {}}, nil
	case epLlama:
		args := []string{"-m", c.ModelPath, "-c", strconv.Itoa(c.NCtx), "-np", strconv.Itoa(e.maxWorkers), "-t", strconv.Itoa(c.Threads), "-b", strconv.Itoa(c.NBatch)}
		l, err := startLlamaServer(e.llamaServer, args, "episode")
		if err != nil {
			return nil, err
		}
		return &episodeTarget{base: l.base, pid: l.cmd.Process.Pid, stop: l.stop}, nil
	}
	a, srv, base, err := serveApp(c)
	if err != nil {
		return nil, err
	}
	tg := &episodeTarget{base: base, polykv: true, stop: func() { srv.Close(); a.Close() }}
	out, err := postJSON(base+"/polykv/pools", map[string]any{"messages": []map[string]any{{"role": "system", "content": tx.system}}})
	if err != nil {
		tg.stop()
		return nil, err
	}
	tg.pool = int(out["pool_id"].(float64))
	if e.background > 0 {
		out, err := postJSON(base+"/polykv/pools", map[string]any{"messages": []map[string]any{{"role": "system", "content": tx.bgSystem}}})
		if err != nil {
			tg.stop()
			return nil, err
		}
		tg.bgPool = int(out["pool_id"].(float64))
	}
	if name == epGated || name == epThrottle {
		policy := map[string]any{"target_tps_per_session": floor, "mode": "advisory", "guarantee_min_sessions": e.guarantee}
		if e.settleTokens > 0 {
			policy["settle_tokens"] = e.settleTokens
		}
		if e.settleMs > 0 {
			policy["settle_max_ms"] = e.settleMs
		}
		if name == epThrottle {
			policy["throttle"] = "toward_floor"
			policy["throttle_margin"] = e.margin
			policy["throttle_max_skip"] = e.maxSkip
		}
		if _, err := postJSON(fmt.Sprintf("%s/polykv/pools/%d/admission", base, tg.pool), policy); err != nil {
			tg.stop()
			return nil, err
		}
		if tg.bgPool != 0 {
			policy["target_tps_per_session"] = bgFloor
			if _, err := postJSON(fmt.Sprintf("%s/polykv/pools/%d/admission", base, tg.bgPool), policy); err != nil {
				tg.stop()
				return nil, err
			}
		}
	}
	return tg, nil
}

// calibrate measures one worker alone on its first package's turns (what the floor is
// set from, as the design set 15 tps from its GPU's single-session speed): the median
// of its experienced tps sampled from /polykv/tps while it decodes, the same figure
// the runs compare with the floor, over five turns rather than three (one worker alone
// read 81 to 127 tok/s across this machine's runs, issue 41). The server's decode
// speed (timings' predicted_per_second, decode compute alone) is printed beside it;
// without samples (turns too short to warm the EWMA) the floor falls back to it.
func (e episode) calibrate(c app.Config, tx episodeTexts) (float64, error) {
	tg, err := e.start(c, epBaseline, 0, 0, tx)
	if err != nil {
		return 0, err
	}
	defer tg.stop()
	done := make(chan struct{})
	sampled := make(chan []float64, 1)
	go func() {
		var xs []float64
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				sampled <- xs
				return
			case <-t.C:
			}
			snap, err := getJSON(tg.base + "/polykv/tps?once=1")
			if err != nil {
				continue
			}
			sessions, _ := snap["sessions"].([]any)
			for _, x := range sessions {
				ss, _ := x.(map[string]any)
				if ss["session_id"] == "calibrate" && ss["state"] == "decode" && ss["warming"] != true {
					if rate, _ := ss["tps_ewma"].(float64); rate > 0 {
						xs = append(xs, rate)
					}
				}
			}
		}
	}()
	msgs := []map[string]any{{"role": "system", "content": tx.system}, {"role": "user", "content": tx.tasks[0]}}
	var speeds []float64
	for s := range 5 {
		var out struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
			Timings struct {
				PredictedPerSecond float64 `json:"predicted_per_second"`
			} `json:"timings"`
		}
		body := map[string]any{"messages": msgs, "max_tokens": e.gen, "temperature": 0, "ignore_eos": true, "pool_id": tg.pool, "session_id": "calibrate"}
		if err := postInto(tg.base+"/v1/chat/completions", body, &out); err != nil {
			return 0, err
		}
		if len(out.Choices) != 1 {
			return 0, fmt.Errorf("calibration turn: %d choices", len(out.Choices))
		}
		speeds = append(speeds, out.Timings.PredictedPerSecond)
		msgs = append(msgs, map[string]any{"role": "assistant", "content": out.Choices[0].Message.Content},
			map[string]any{"role": "user", "content": tx.tools[0][s%len(tx.tools[0])]})
	}
	close(done)
	xs := <-sampled
	fmt.Printf("calibration: server decode speed %.1f tok/s (median predicted_per_second of %d turns), experienced %.1f tok/s (median of %d samples of /polykv/tps)\n",
		median(speeds), len(speeds), median(xs), len(xs))
	if len(xs) == 0 {
		return median(speeds), nil
	}
	return median(xs), nil
}

// episodeRun is the shared state of one run.
type episodeRun struct {
	e      episode
	tg     *episodeTarget
	tx     episodeTexts
	name   string
	floor  float64
	start  time.Time
	mu     sync.Mutex
	next   int // the next package no worker has taken
	deliv  []time.Duration
	tokens int
	live   int // workers spawned and not retired
	peak   int
	// turns and bgTurns are the client-side rates of the workers' and the background
	// agents' turns streaming now, by session.
	turns, bgTurns map[string]*tps.EWMA
	bgTokens       int
	errs           []error
}

func (e episode) once(c app.Config, name string, rep int, floor, bgFloor float64, tx episodeTexts) (episodeResult, error) {
	res := episodeResult{config: name, rep: rep}
	tg, err := e.start(c, name, floor, bgFloor, tx)
	if err != nil {
		return res, err
	}
	defer tg.stop()
	r := &episodeRun{e: e, tg: tg, tx: tx, name: name, floor: floor, deliv: make([]time.Duration, e.packages),
		turns: map[string]*tps.EWMA{}, bgTurns: map[string]*tps.EWMA{}}
	cpu0 := readCPU(tg.pid)
	r.start = time.Now()
	done := make(chan struct{})
	sampled := make(chan []episodeSample)
	go func() { sampled <- r.sample(done) }()
	bgCtx, stopBg := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	for i := range e.background {
		bg.Add(1)
		go func() {
			defer bg.Done()
			r.backgroundAgent(bgCtx, i)
		}()
	}
	var workers sync.WaitGroup
	tick := time.NewTicker(e.tick)
	defer tick.Stop()
	spawned := 0
	for {
		r.mu.Lock()
		pending := r.next < e.packages && r.live < e.maxWorkers && len(r.errs) == 0
		delivered := r.next >= e.packages && r.live == 0
		r.mu.Unlock()
		if delivered {
			break
		}
		if pending {
			rid, ok, err := r.admit()
			if err != nil {
				r.fail(err)
			} else if ok {
				r.mu.Lock()
				r.live++
				r.peak = max(r.peak, r.live)
				r.mu.Unlock()
				workers.Add(1)
				go func(id int) {
					defer workers.Done()
					r.worker(id, rid)
				}(spawned)
				spawned++
			} else {
				res.refusedTicks++
			}
		}
		r.mu.Lock()
		failed := len(r.errs) > 0
		r.mu.Unlock()
		if failed {
			break
		}
		<-tick.C
	}
	workers.Wait()
	res.wall = time.Since(r.start)
	res.foreign = foreignSince(cpu0, tg.pid)
	r.mu.Lock()
	res.bgTokens = r.bgTokens // what they decoded while the workers ran
	r.mu.Unlock()
	stopBg()
	bg.Wait()
	close(done)
	res.samples = <-sampled
	if len(r.errs) > 0 {
		return res, r.errs[0]
	}
	res.delivered, res.tokens, res.peakWorkers = r.deliv, r.tokens, r.peak
	res.throttled = r.throttledTotal()
	res.paced = r.metricTotal("polykv_paced_turns_total{")
	res.summarize(floor)
	return res, nil
}

func (r *episodeRun) fail(err error) {
	r.mu.Lock()
	r.errs = append(r.errs, err)
	r.mu.Unlock()
}

// admit asks the policy whether to spawn a worker now: baseline configurations always
// do; gated ones take a reservation (its id goes with the worker's first request) or
// read /capacity.
func (r *episodeRun) admit() (string, bool, error) {
	if r.name != epGated && r.name != epThrottle {
		return "", true, nil
	}
	url := fmt.Sprintf("%s/polykv/pools/%d/", r.tg.base, r.tg.pool)
	if r.e.gateKind == "capacity" {
		out, err := getJSON(url + "capacity")
		if err != nil {
			return "", false, err
		}
		return "", out["can_admit"] == true, nil
	}
	out, err := postJSON(url+"reservations", map[string]any{"ttl_ms": 30000})
	if err != nil {
		return "", false, err
	}
	if out["granted"] != true {
		return "", false, nil
	}
	id, _ := out["reservation_id"].(string)
	return id, true, nil
}

// worker delivers packages until none is left; its first request carries the
// reservation it was spawned with (if any).
func (r *episodeRun) worker(id int, reservation string) {
	session := fmt.Sprintf("worker-%d", id)
	defer func() {
		r.mu.Lock()
		r.live--
		r.mu.Unlock()
	}()
	for {
		r.mu.Lock()
		p := r.next
		if p >= r.e.packages || len(r.errs) > 0 {
			r.mu.Unlock()
			if reservation != "" {
				// Another worker took the last package: give the place back.
				req, _ := http.NewRequest(http.MethodDelete, fmt.Sprintf("%s/polykv/pools/%d/reservations/%s", r.tg.base, r.tg.pool, reservation), nil)
				if resp, err := http.DefaultClient.Do(req); err == nil {
					resp.Body.Close()
				}
			}
			return
		}
		r.next++
		r.mu.Unlock()
		msgs := []map[string]any{{"role": "system", "content": r.tx.system}, {"role": "user", "content": r.tx.tasks[p]}}
		for s := range r.e.steps {
			text, n, err := r.turn(context.Background(), r.tg.pool, session, msgs, reservation, r.e.gen, r.turns)
			reservation = ""
			if err != nil {
				r.fail(fmt.Errorf("%s package %d step %d: %w", session, p, s+1, err))
				return
			}
			r.mu.Lock()
			r.tokens += n
			r.mu.Unlock()
			if s == r.e.steps-1 {
				break
			}
			msgs = append(msgs, map[string]any{"role": "assistant", "content": text})
			time.Sleep(r.e.latency(p, s)) // the tool call
			msgs = append(msgs, map[string]any{"role": "user", "content": r.tx.tools[p][s]})
		}
		r.mu.Lock()
		r.deliv[p] = time.Since(r.start)
		r.mu.Unlock()
	}
}

// backgroundAgent sends background requests back to back until ctx ends.
func (r *episodeRun) backgroundAgent(ctx context.Context, i int) {
	session := fmt.Sprintf("background-%d", i)
	for k := i; ctx.Err() == nil; k += r.e.background {
		msgs := []map[string]any{{"role": "system", "content": r.tx.bgSystem}, {"role": "user", "content": r.tx.bgDocs[k%len(r.tx.bgDocs)]}}
		_, n, err := r.turn(ctx, r.tg.bgPool, session, msgs, "", r.e.bgGen, r.bgTurns)
		if err != nil {
			if ctx.Err() == nil {
				r.fail(fmt.Errorf("%s: %w", session, err))
			}
			return
		}
		r.mu.Lock()
		r.bgTokens += n
		r.mu.Unlock()
	}
}

// turn streams one chat turn of gen tokens and returns its text and completion
// tokens; its client-side rate is in rates (by session) while it streams.
func (r *episodeRun) turn(ctx context.Context, pool int, session string, msgs []map[string]any, reservation string, gen int, rates map[string]*tps.EWMA) (string, int, error) {
	body := map[string]any{"messages": msgs, "max_tokens": gen, "temperature": 0, "ignore_eos": true,
		"stream": true, "stream_options": map[string]any{"include_usage": true}}
	if r.tg.polykv {
		body["pool_id"], body["session_id"] = pool, session
		if reservation != "" {
			body["reservation_id"] = reservation
		}
	}
	buf, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.tg.base+"/v1/chat/completions", bytes.NewReader(buf))
	if err != nil {
		return "", 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		raw, _ := io.ReadAll(resp.Body)
		return "", 0, fmt.Errorf("%d %s", resp.StatusCode, raw)
	}
	ewma := tps.NewEWMA(tps.DefaultTau)
	started := false
	chunks := 0
	var text strings.Builder
	n := -1
	defer func() {
		r.mu.Lock()
		delete(rates, session)
		r.mu.Unlock()
	}()
	type chunk struct {
		Choices []deltaChoice `json:"choices"`
		Usage   *plainUsage   `json:"usage"`
	}
	err = eachChunk(resp.Body, func(c *chunk) error {
		if c.Usage != nil {
			n = c.Usage.CompletionTokens
		}
		if len(c.Choices) == 0 || c.Choices[0].Delta.Content == "" {
			return nil
		}
		text.WriteString(c.Choices[0].Delta.Content)
		chunks++
		now := time.Now()
		r.mu.Lock()
		if !started {
			// As the server's EWMA: measured from the first token, not the prompt.
			ewma.Start(now)
			started = true
			rates[session] = &ewma
		} else {
			ewma.Observe(1, now)
		}
		r.mu.Unlock()
		return nil
	})
	if err != nil {
		return "", 0, err
	}
	if n < 0 {
		// A server that sends no usage: one streamed chunk per token, as llama-server's.
		n = chunks
	}
	return text.String(), n, nil
}

// sample reads the tps picture every 250 ms until done.
func (r *episodeRun) sample(done <-chan struct{}) []episodeSample {
	const every = 250 * time.Millisecond
	t := time.NewTicker(every)
	defer t.Stop()
	var out []episodeSample
	for {
		select {
		case <-done:
			return out
		case <-t.C:
		}
		now := time.Now()
		s := episodeSample{t: now.Sub(r.start)}
		r.mu.Lock()
		s.workers = r.live
		var rates []float64
		s.clientRates, s.serverRates = map[string]float64{}, map[string]float64{}
		for id, ew := range r.turns {
			if ew.Warming() {
				continue
			}
			rate := ew.RateAt(now)
			rates = append(rates, rate)
			s.clientRates[id] = rate
			if rate < r.floor {
				s.clientLow++
			}
		}
		var bgRates []float64
		for id, ew := range r.bgTurns {
			if !ew.Warming() {
				bgRates = append(bgRates, ew.RateAt(now))
				s.clientRates[id] = bgRates[len(bgRates)-1]
			}
		}
		r.mu.Unlock()
		s.clientMean, s.clientN = tps.Mean(rates), len(rates)
		s.clientBg, s.clientBgN = tps.Mean(bgRates), len(bgRates)
		if r.tg.polykv {
			if snap, err := getJSON(r.tg.base + "/polykv/tps?once=1"); err == nil {
				s.serverAll, _ = snap["mean_active_tps"].(float64)
				sessions, _ := snap["sessions"].([]any)
				var mine, theirs []float64
				for _, x := range sessions {
					ss, _ := x.(map[string]any)
					if th, ok := ss["throttled_steps"].(float64); ok {
						s.throttled += int(th)
					}
					if ss["state"] != "decode" || ss["warming"] == true {
						continue
					}
					rate, _ := ss["tps_ewma"].(float64)
					id, _ := ss["session_id"].(string)
					s.serverRates[id] = rate
					if pool, _ := ss["pool_id"].(float64); int(pool) != r.tg.pool {
						theirs = append(theirs, rate)
						continue
					}
					mine = append(mine, rate)
					if rate < r.floor {
						s.serverLow++
					}
				}
				s.serverMean, s.serverN = tps.Mean(mine), len(mine)
				s.bgMean, s.bgN = tps.Mean(theirs), len(theirs)
			}
		}
		out = append(out, s)
	}
}

// throttledTotal reads the throttle's skipped decode steps from /metrics (0 on other
// servers).
func (r *episodeRun) throttledTotal() int64 { return r.metricTotal("polykv_throttled_steps_total{") }

// metricTotal sums a counter's series (prefix: its name and the label brace) from
// /metrics (0 on other servers).
func (r *episodeRun) metricTotal(prefix string) int64 {
	if !r.tg.polykv {
		return 0
	}
	resp, err := http.Get(r.tg.base + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var total int64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		if i := strings.LastIndexByte(line, ' '); i > 0 {
			v, _ := strconv.ParseFloat(line[i+1:], 64)
			total += int64(v)
		}
	}
	return total
}

// summarize computes the run's times under the floor from its samples: each sample
// stands for the interval since the previous one.
func (r *episodeResult) summarize(floor float64) {
	var prev time.Duration
	var wsum, wdt, csum, cdt, bsum, bdt, cbsum, cbdt float64
	for _, s := range r.samples {
		dt := s.t - prev
		prev = s.t
		if s.bgN > 0 {
			bsum += s.bgMean * dt.Seconds()
			bdt += dt.Seconds()
		}
		if s.clientBgN > 0 {
			cbsum += s.clientBg * dt.Seconds()
			cbdt += dt.Seconds()
		}
		r.workerSeconds += float64(s.workers) * dt.Seconds()
		if s.serverN > 0 {
			wsum += s.serverMean * dt.Seconds()
			wdt += dt.Seconds()
			if s.serverMean < floor {
				r.under += dt
			}
			if s.serverMean < floor/2 {
				r.deep += dt
			}
			r.sessUnder += time.Duration(s.serverLow) * dt
		}
		if s.clientN > 0 {
			csum += s.clientMean * dt.Seconds()
			cdt += dt.Seconds()
			if s.clientMean < floor {
				r.clientUnder += dt
			}
			if s.clientMean < floor/2 {
				r.clientDeep += dt
			}
			r.clientSessUnder += time.Duration(s.clientLow) * dt
		}
	}
	if wdt > 0 {
		r.meanTPS = wsum / wdt
	}
	if cdt > 0 {
		r.clientTPS = csum / cdt
	}
	if bdt > 0 {
		r.bgTPS = bsum / bdt
	}
	if cbdt > 0 {
		r.bgClientTPS = cbsum / cbdt
	}
}

// write saves a run's per-second timeline as CSV and its plot as PNG in --episode-out.
func (e episode) write(r episodeResult, floor float64) error {
	stem := filepath.Join(e.out, fmt.Sprintf("episode-%s-%d", r.config, r.rep+1))
	secs := int(math.Ceil(r.wall.Seconds()))
	type bin struct {
		server, client, all, bg float64
		nSrv, nCli, nAll, nBg   int // samples with sessions decoding
		workers, active         int
		throttled               int
	}
	bins := make([]bin, secs+1)
	for _, s := range r.samples {
		i := min(int(s.t.Seconds()), secs)
		b := &bins[i]
		b.workers = max(b.workers, s.workers)
		b.throttled = max(b.throttled, s.throttled)
		if s.serverN > 0 {
			b.server += s.serverMean
			b.nSrv++
			b.active = max(b.active, s.serverN)
		}
		if s.clientN > 0 {
			b.client += s.clientMean
			b.nCli++
			b.active = max(b.active, s.clientN)
		}
		if s.serverN+s.bgN > 0 {
			b.all += s.serverAll
			b.nAll++
		}
		if s.bgN > 0 {
			b.bg += s.bgMean
			b.nBg++
		}
	}
	var csv strings.Builder
	csv.WriteString("second,mean_active_tps,client_mean_tps,workers,decoding,throttled_steps_running,mean_active_tps_all,background_tps\n")
	var tpsSeries, clientSeries, workerSeries, activeSeries, bgSeries []point
	for i, b := range bins {
		srv, cli := math.NaN(), math.NaN()
		if b.nSrv > 0 {
			srv = b.server / float64(b.nSrv)
		}
		if b.nCli > 0 {
			cli = b.client / float64(b.nCli)
		}
		all, bgm := math.NaN(), math.NaN()
		if b.nAll > 0 {
			all = b.all / float64(b.nAll)
		}
		if b.nBg > 0 {
			bgm = b.bg / float64(b.nBg)
		}
		fmt.Fprintf(&csv, "%d,%s,%s,%d,%d,%d,%s,%s\n", i, csvNum(srv), csvNum(cli), b.workers, b.active, b.throttled, csvNum(all), csvNum(bgm))
		bgSeries = append(bgSeries, point{float64(i) + 0.5, bgm})
		x := float64(i) + 0.5
		tpsSeries = append(tpsSeries, point{x, srv})
		clientSeries = append(clientSeries, point{x, cli})
		workerSeries = append(workerSeries, point{float64(i), float64(b.workers)})
		activeSeries = append(activeSeries, point{float64(i), float64(b.active)})
	}
	if err := os.WriteFile(stem+".csv", []byte(csv.String()), 0o644); err != nil {
		return err
	}
	// Every reading's per-session rates, long format.
	var sess strings.Builder
	sess.WriteString("t_s,session,source,tps\n")
	for _, s := range r.samples {
		for _, src := range []struct {
			name  string
			rates map[string]float64
		}{{"server", s.serverRates}, {"client", s.clientRates}} {
			ids := slices.Sorted(maps.Keys(src.rates))
			for _, id := range ids {
				fmt.Fprintf(&sess, "%.2f,%s,%s,%.2f\n", s.t.Seconds(), id, src.name, src.rates[id])
			}
		}
	}
	if err := os.WriteFile(stem+"-sessions.csv", []byte(sess.String()), 0o644); err != nil {
		return err
	}
	top := []plotSeries{{name: "workers' mean tps", pts: tpsSeries, col: colBlue}, {name: "client-side", pts: clientSeries, col: colGrey}}
	polykv := r.config == epBaseline || r.config == epGated || r.config == epThrottle
	if !polykv {
		top = top[1:] // other servers: client-side only
	}
	if e.background > 0 && polykv {
		top = append(top, plotSeries{name: "background", pts: bgSeries, col: colGreen})
	}
	bottom := []plotSeries{{name: "workers", pts: workerSeries, col: colBlack, step: true}, {name: "decoding", pts: activeSeries, col: colOrange, step: true}}
	title := fmt.Sprintf("%s run %d: wall %.0f s, under floor %.0f s, deep %.0f s", r.config, r.rep+1, r.wall.Seconds(), r.under.Seconds(), r.deep.Seconds())
	if !polykv {
		title = fmt.Sprintf("%s run %d: wall %.0f s, under floor %.0f s, deep %.0f s (client-side)", r.config, r.rep+1, r.wall.Seconds(), r.clientUnder.Seconds(), r.clientDeep.Seconds())
	}
	return writePlot(stem+".png", plot{title: title, xMax: float64(secs + 1), top: top, topLines: []hline{{y: floor, name: "floor", col: colRed}, {y: floor / 2, name: "floor/2", col: colPink}},
		topLabel: "tok/s", bottom: bottom, bottomLabel: "agents", bottomMax: float64(e.maxWorkers)})
}

func csvNum(v float64) string {
	if math.IsNaN(v) {
		return ""
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}
