package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/llama"
)

// The plain-client workloads of issue 12: what agent frameworks send (CrewAI, AutoGen,
// LangGraph with plain ChatOpenAI): no pool_id, no session_id, no PolyKV field at all,
// only ignore_eos, so every agent decodes a fixed number of tokens and the runs compare.
// Each runs in one process against up to three server configurations:
//
//	pool — the explicit-pool run: the prefix is a pool, agents attach with pool_id
//	auto — plain requests, automatic prefix reuse on (the default)
//	off  — plain requests, automatic prefix reuse off (every request prefills its prompt)

// plainMode is one server configuration of the plain-client workloads.
type plainMode string

const (
	modePool plainMode = "pool"
	modeAuto plainMode = "auto"
	modeOff  plainMode = "off"
)

func parseModes(s string, allowed ...plainMode) ([]plainMode, error) {
	var out []plainMode
	for _, f := range strings.Split(s, ",") {
		m := plainMode(strings.TrimSpace(f))
		if !slices.Contains(allowed, m) {
			return nil, fmt.Errorf("bench: unknown server config %q (want some of %v)", f, allowed)
		}
		if !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	return out, nil
}

// benchServer is one in-process server on a loopback port, with a sampler of the peak
// number of KV cells in use (read from the engine's published snapshot, which is
// republished at least every 50 ms while decoding and whenever a task ends).
type benchServer struct {
	a    *app.App
	srv  *http.Server
	base string
	peak atomic.Int64
	stop chan struct{}
	done chan struct{}
}

// serveApp opens an App on cfg and serves its API on a loopback port; the caller
// closes the server, then the App.
func serveApp(cfg app.Config) (*app.App, *http.Server, string, error) {
	a, err := app.Open(cfg, nil)
	if err != nil {
		return nil, nil, "", err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		a.Close()
		return nil, nil, "", err
	}
	srv := &http.Server{Handler: a.API.Handler()}
	go srv.Serve(ln)
	return a, srv, "http://" + ln.Addr().String(), nil
}

func startBenchServer(cfg app.Config) (*benchServer, error) {
	a, srv, base, err := serveApp(cfg)
	if err != nil {
		return nil, err
	}
	b := &benchServer{a: a, srv: srv, base: base, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(b.done)
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			b.sample()
			select {
			case <-b.stop:
				return
			case <-t.C:
			}
		}
	}()
	return b, nil
}

func (b *benchServer) sample() {
	if s := b.a.Engine.Snapshot(); s != nil {
		for {
			cur, old := int64(s.Usage.CellsUsed), b.peak.Load()
			if cur <= old || b.peak.CompareAndSwap(old, cur) {
				return
			}
		}
	}
}

// peakCells is the most KV cells in use seen so far (sessions, pools and cached
// sequences together).
func (b *benchServer) peakCells() int {
	b.sample()
	return int(b.peak.Load())
}

// evictions is how many times the prefix cache gave up cells or a sequence id so far.
func (b *benchServer) evictions() int64 {
	if s := b.a.Engine.Snapshot(); s != nil {
		return s.Usage.CacheEvictions
	}
	return 0
}

func (b *benchServer) Close() {
	close(b.stop)
	<-b.done
	b.srv.Close()
	b.a.Close()
}

// plainUsage is the part of an OpenAI usage object the workloads read.
type plainUsage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// streamUsage sends a streaming request with include_usage and returns the time to the
// first token and the usage chunk.
func streamUsage(url string, body map[string]any) (time.Duration, plainUsage, error) {
	var u plainUsage
	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": true}
	buf, _ := json.Marshal(body)
	t0 := time.Now()
	resp, err := http.Post(url, "application/json", bytes.NewReader(buf))
	if err != nil {
		return 0, u, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		raw, _ := io.ReadAll(resp.Body)
		return 0, u, fmt.Errorf("bench request: %d %s", resp.StatusCode, raw)
	}
	var first time.Duration
	type chunk struct {
		Choices []json.RawMessage `json:"choices"`
		Usage   *plainUsage       `json:"usage"`
	}
	err = eachChunk(resp.Body, func(c *chunk) error {
		if first == 0 && len(c.Choices) > 0 {
			first = time.Since(t0)
		}
		if c.Usage != nil {
			u = *c.Usage
		}
		return nil
	})
	return first, u, err
}

// plainFanout is the fan-out of issue 12 sent by a plain client: a root prefix shared by
// N agents, each adding its own suffix and decoding, all sent at once.
type plainFanout struct {
	fanout
	modes []plainMode
}

type plainFanoutResult struct {
	wall             time.Duration // first request (the pool's creation in pool mode) to the last token
	ttftP50, ttftMax time.Duration
	peakCells        int
	cachedMean       float64 // mean cached_tokens over the agents
	cachedMin        int     // least cached_tokens of any agent but the first to be served
	evictions        int64   // prefix-cache evictions during the run
}

func (f plainFanout) run(cfg app.Config, agents string) error {
	ns, err := parseCounts(agents, 64)
	if err != nil {
		return err
	}
	root, suffixes, err := f.prompts(cfg.ModelPath, ns)
	if err != nil {
		return err
	}
	fmt.Printf("plain-client fan-out: root prefix %d tokens, each agent +%d tokens and %d decoded, all sent at once as /v1/completions\n", f.root, f.suffix, f.gen)
	fmt.Println("without pool_id or session_id (pool: the explicit-pool run; auto: automatic prefix reuse; off: " + cacheReuseOffFlag + ")")
	fmt.Println("TTFT from request to first token; peak cells: most KV cells in use during the run; cached: usage.prompt_tokens_details.cached_tokens")
	fmt.Println()
	fmt.Println("   N  config  TTFT p50 ms  TTFT max ms  peak cells  wall s  cached mean  cached min  evictions  wall/pool  cells/pool")
	var last map[plainMode]plainFanoutResult
	for _, n := range ns {
		c := cfg
		c.Parallel = n
		c.NCtx = n*(f.root+f.suffix+f.gen) + 256
		c.NBatch = max(c.NBatch, n)
		res := map[plainMode]plainFanoutResult{}
		for _, m := range f.modes {
			r, err := f.once(c, m, root, suffixes[:n])
			if err != nil {
				return fmt.Errorf("fan-out N=%d %s: %w", n, m, err)
			}
			res[m] = r
			wallR, cellsR := "-", "-"
			if p, ok := res[modePool]; ok && m != modePool {
				wallR = fmt.Sprintf("%.3f", r.wall.Seconds()/p.wall.Seconds())
				cellsR = fmt.Sprintf("%.3f", float64(r.peakCells)/float64(p.peakCells))
			}
			fmt.Printf("%4d  %-6s  %11.0f  %11.0f  %10d  %6.1f  %11.0f  %10d  %9d  %9s  %10s\n", n, m,
				ms(r.ttftP50), ms(r.ttftMax), r.peakCells, r.wall.Seconds(), r.cachedMean, r.cachedMin, r.evictions, wallR, cellsR)
		}
		last = res
	}
	if a, ok := last[modeAuto]; ok {
		n := ns[len(ns)-1]
		if p, ok := last[modePool]; ok {
			fmt.Printf("\nN = %d: auto/pool wall %.3fx, peak cells %.3fx (target <= 1.1x)\n", n,
				a.wall.Seconds()/p.wall.Seconds(), float64(a.peakCells)/float64(p.peakCells))
		}
		if o, ok := last[modeOff]; ok {
			fmt.Printf("N = %d: auto/off  wall %.3fx, peak cells %.3fx, TTFT p50 %.3fx\n", n,
				a.wall.Seconds()/o.wall.Seconds(), float64(a.peakCells)/float64(o.peakCells), ms(a.ttftP50)/ms(o.ttftP50))
		}
	}
	return nil
}

func (f plainFanout) once(cfg app.Config, mode plainMode, root []int32, suffixes [][]int32) (plainFanoutResult, error) {
	var res plainFanoutResult
	c := cfg
	if mode == modePool {
		c.MaxPools = max(c.MaxPools, 2)
	}
	c = withCacheReuse(c, mode != modeOff)
	s, err := startBenchServer(c)
	if err != nil {
		return res, err
	}
	defer s.Close()
	start := time.Now()
	poolID := 0
	if mode == modePool {
		out, err := postJSON(s.base+"/polykv/pools", map[string]any{"tokens": root})
		if err != nil {
			return res, err
		}
		poolID = int(out["pool_id"].(float64))
	}
	var wg sync.WaitGroup
	ttft := make([]time.Duration, len(suffixes))
	usage := make([]plainUsage, len(suffixes))
	errs := make([]error, len(suffixes))
	for i, suf := range suffixes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			prompt := append(append([]int32{}, root...), suf...)
			body := map[string]any{"prompt": prompt, "max_tokens": f.gen, "temperature": 0, "ignore_eos": true}
			if mode == modePool {
				// The existing pooled run: sessions attached to the pool.
				body["pool_id"] = poolID
				body["session_id"] = fmt.Sprintf("agent-%d", i)
			}
			ttft[i], usage[i], errs[i] = streamUsage(s.base+"/v1/completions", body)
		}()
	}
	wg.Wait()
	res.wall = time.Since(start)
	cached := make([]int, len(suffixes))
	for i := range suffixes {
		if errs[i] != nil {
			return res, errs[i]
		}
		if usage[i].CompletionTokens != f.gen {
			return res, fmt.Errorf("agent %d decoded %d tokens, want %d", i, usage[i].CompletionTokens, f.gen)
		}
		cached[i] = usage[i].PromptTokensDetails.CachedTokens
		res.cachedMean += float64(cached[i]) / float64(len(suffixes))
	}
	res.ttftP50, res.ttftMax = percentile(ttft, 0.5), slices.Max(ttft)
	// The agent served first has nothing to reuse (in auto mode); the least of the others
	// says whether every later agent found the prefix.
	slices.Sort(cached)
	if len(cached) > 1 {
		res.cachedMin = cached[1]
	} else {
		res.cachedMin = cached[0]
	}
	res.peakCells, res.evictions = s.peakCells(), s.evictions()
	return res, nil
}

// percentile is the nearest-rank q-quantile of ds (0.5: the median; for an even count
// the lower middle).
func percentile(ds []time.Duration, q float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func parseCounts(s string, most int) ([]int, error) {
	var ns []int
	for _, a := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(a))
		if err != nil || n < 1 || n > most {
			return nil, fmt.Errorf("bench: bad count %q (1..%d)", a, most)
		}
		ns = append(ns, n)
	}
	return ns, nil
}

// agentLoop is issue 12's agent-loop workload: agents run concurrently, each for a number
// of turns; every turn re-sends the whole chat history (system prompt, task, and every
// earlier reply and tool result) plus a new tool result, as a plain chat client does.
type agentLoop struct {
	agents, turns int
	system        int // tokens of the system prompt every agent shares
	tool          int // tokens of each tool result
	gen           int // tokens decoded per turn
	modes         []plainMode
}

type agentLoopResult struct {
	wall      time.Duration
	peakCells int
	evictions int64
	prompt    [][]int // [agent][turn] prompt_tokens
	cached    [][]int // [agent][turn] cached_tokens
}

func (l agentLoop) run(cfg app.Config) error {
	system, tasks, tools, err := l.texts(cfg.ModelPath)
	if err != nil {
		return err
	}
	fmt.Printf("agent loop: %d agents x %d turns as /v1/chat/completions without session_id; a %d-token system prompt, a task,\n", l.agents, l.turns, l.system)
	fmt.Printf("then each turn re-sends the whole history plus a %d-token tool result and decodes %d tokens (auto: automatic prefix reuse; off: %s)\n\n", l.tool, l.gen, cacheReuseOffFlag)
	c := cfg
	c.Parallel = l.agents
	c.NBatch = max(c.NBatch, l.agents)
	// Room for every agent's whole history twice over, so the runs compare reuse, not eviction.
	c.NCtx = 2*l.agents*(l.system+64+l.turns*(l.tool+l.gen+16)) + 512
	res := map[plainMode]agentLoopResult{}
	for _, m := range l.modes {
		r, err := l.once(c, m, system, tasks, tools)
		if err != nil {
			return fmt.Errorf("agent loop %s: %w", m, err)
		}
		res[m] = r
		// One line as each config ends, so a run cut short still says something.
		fmt.Printf("%s done: wall %.1f s, peak cells %d, prompt tokens %d, cached %d, least cached/prev prompt %.3f\n",
			m, r.wall.Seconds(), r.peakCells, sumAll(r.prompt), sumAll(r.cached), leastReuse(r))
	}
	fmt.Println()
	fmt.Println("cached: mean cached_tokens of the turn; cached/prev: cached_tokens / the agent's previous prompt_tokens, least and mean over agents")
	fmt.Print(" turn  prompt tokens")
	for _, m := range l.modes {
		fmt.Printf("  %11s  %15s  %16s", m+" cached", m+" min cach/prev", m+" mean cach/prev")
	}
	fmt.Println()
	for t := range l.turns {
		ref := res[l.modes[0]]
		fmt.Printf("%5d  %13.0f", t+1, meanAt(ref.prompt, t))
		for _, m := range l.modes {
			r := res[m]
			if t == 0 {
				fmt.Printf("  %11.0f  %15s  %16s", meanAt(r.cached, t), "-", "-")
				continue
			}
			lo, sum := 2.0, 0.0
			for a := range r.prompt {
				f := float64(r.cached[a][t]) / float64(r.prompt[a][t-1])
				lo, sum = min(lo, f), sum+f
			}
			fmt.Printf("  %11.0f  %15.3f  %16.3f", meanAt(r.cached, t), lo, sum/float64(len(r.prompt)))
		}
		fmt.Println()
	}
	fmt.Println()
	fmt.Println("config  wall s  peak cells  prompt tokens  cached tokens  evictions")
	for _, m := range l.modes {
		r := res[m]
		fmt.Printf("%-6s  %6.1f  %10d  %13d  %13d  %9d\n", m, r.wall.Seconds(), r.peakCells, sumAll(r.prompt), sumAll(r.cached), r.evictions)
	}
	if a, ok := res[modeAuto]; ok {
		if o, ok := res[modeOff]; ok {
			fmt.Printf("auto/off: wall %.3fx, peak cells %.3fx\n", a.wall.Seconds()/o.wall.Seconds(), float64(a.peakCells)/float64(o.peakCells))
		}
		if l.turns > 1 {
			fmt.Printf("auto: least cached tokens / previous prompt over all agents and turns 2..%d: %.3f (target >= 0.95)\n", l.turns, leastReuse(a))
		}
	}
	return nil
}

// leastReuse is the least cached_tokens / the previous turn's prompt_tokens over every
// agent and turn after the first (0 with a single turn).
func leastReuse(r agentLoopResult) float64 {
	worst, any := 2.0, false
	for ag := range r.prompt {
		for t := 1; t < len(r.prompt[ag]); t++ {
			worst, any = min(worst, float64(r.cached[ag][t])/float64(r.prompt[ag][t-1])), true
		}
	}
	if !any {
		return 0
	}
	return worst
}

func meanAt(v [][]int, t int) float64 {
	s := 0
	for _, row := range v {
		s += row[t]
	}
	return float64(s) / float64(len(v))
}

func sumAll(v [][]int) int {
	s := 0
	for _, row := range v {
		for _, x := range row {
			s += x
		}
	}
	return s
}

// texts builds the shared system prompt, one task per agent and the tool results
// (one per agent and turn), each cut at a word boundary to about its token budget.
func (l agentLoop) texts(path string) (string, []string, [][]string, error) {
	m, err := llama.LoadModel(path)
	if err != nil {
		return "", nil, nil, err
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
	system, err := grow(l.system, func(j int) string {
		if j == 0 {
			return "You are a research agent. Call tools, read their results, and report. Tools:\n"
		}
		return fmt.Sprintf("- lookup_%d(key: string): the record for key in area %d.\n", j, j*13)
	})
	if err != nil {
		return "", nil, nil, err
	}
	tasks := make([]string, l.agents)
	tools := make([][]string, l.agents)
	for a := range l.agents {
		tasks[a] = fmt.Sprintf("Agent %d: find the records of area %d and summarise what changed.", a, a*7)
		tools[a] = make([]string, l.turns)
		for t := range l.turns {
			if tools[a][t], err = grow(l.tool, func(j int) string {
				if j == 0 {
					return fmt.Sprintf("Tool result for agent %d, call %d:", a, t)
				}
				return fmt.Sprintf(" row %d.%d.%d = %d;", a, t, j, (a*31+t*17+j*7)%1000)
			}); err != nil {
				return "", nil, nil, err
			}
		}
	}
	return system, tasks, tools, nil
}

func (l agentLoop) once(cfg app.Config, mode plainMode, system string, tasks []string, tools [][]string) (agentLoopResult, error) {
	res := agentLoopResult{prompt: make([][]int, l.agents), cached: make([][]int, l.agents)}
	s, err := startBenchServer(withCacheReuse(cfg, mode != modeOff))
	if err != nil {
		return res, err
	}
	defer s.Close()
	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, l.agents)
	for a := range l.agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msgs := []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": tasks[a]}}
			for t := range l.turns {
				var out struct {
					Choices []struct {
						Message struct {
							Content string `json:"content"`
						} `json:"message"`
					} `json:"choices"`
					Usage plainUsage `json:"usage"`
				}
				body := map[string]any{"messages": msgs, "max_tokens": l.gen, "temperature": 0, "ignore_eos": true}
				if err := postInto(s.base+"/v1/chat/completions", body, &out); err != nil {
					errs[a] = fmt.Errorf("agent %d turn %d: %w", a, t+1, err)
					return
				}
				if len(out.Choices) != 1 || out.Usage.CompletionTokens != l.gen {
					errs[a] = fmt.Errorf("agent %d turn %d: %d choices, %d tokens decoded, want 1 and %d", a, t+1, len(out.Choices), out.Usage.CompletionTokens, l.gen)
					return
				}
				res.prompt[a] = append(res.prompt[a], out.Usage.PromptTokens)
				res.cached[a] = append(res.cached[a], out.Usage.PromptTokensDetails.CachedTokens)
				msgs = append(msgs, map[string]any{"role": "assistant", "content": out.Choices[0].Message.Content},
					map[string]any{"role": "user", "content": tools[a][t]})
			}
		}()
	}
	wg.Wait()
	res.wall = time.Since(start)
	for _, err := range errs {
		if err != nil {
			return res, err
		}
	}
	res.peakCells, res.evictions = s.peakCells(), s.evictions()
	return res, nil
}

func postInto(url string, body any, out any) error {
	buf, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(buf))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != 200 {
		return fmt.Errorf("%d %s", resp.StatusCode, raw)
	}
	return json.Unmarshal(raw, out)
}
