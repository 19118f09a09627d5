package bench

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/llama"
)

// agentsBench is issue 40's workload: a team of tool-calling agents whose contexts add
// up to several times the cache. Every agent has the team's system prompt (tool
// definitions), its own task, and runs turns: a streamed reply of a fixed length, a
// tool pause, a tool result appended, the next turn. All agents start at once. Plain
// chat requests (with sessions: an x-session-id per agent as well), so any
// OpenAI-compatible server runs the same client: PolyKV in this process, llama-server
// from the same pinned llama.cpp (--agents-llama-server), or a server at a URL.
//
// Reported per server: wall time, TTFT p50/p90, turns served (a turn fails on an HTTP
// error or an error in the stream), and the prompt tokens the server prefilled, loaded
// from a tier below its cache and took from its cache, against the work's minimum: the
// tokens of every prompt past the longest prefix any earlier prompt had (the shared
// system prompt once, each task once, each turn's new text once), rendered with the
// model's chat template by PolyKV after the runs.
type agentsBench struct {
	agents, turns      int
	system, task       int // tokens
	reply, tool        int // tokens
	pauseMin, pauseMax time.Duration
	np, llamaNP        string // PolyKV's and llama-server's --parallel values to run
	llamaServer, url   string
	sessions           string // off, on or both
	reps               int
	seed               uint64
	turnTimeout        time.Duration
	llamaExtra         string
}

// register binds the workload's flags.
func (ab *agentsBench) register(fs *flag.FlagSet) {
	fs.IntVar(&ab.agents, "agents-count", 12, "agents: agents running at once")
	fs.IntVar(&ab.turns, "agents-turns", 6, "agents: turns per agent")
	fs.IntVar(&ab.system, "agents-system", 1200, "agents: tokens of the team's shared system prompt (tool definitions)")
	fs.IntVar(&ab.task, "agents-task", 520, "agents: tokens of each agent's own task")
	fs.IntVar(&ab.reply, "agents-reply", 48, "agents: tokens each reply streams (ignore_eos)")
	fs.IntVar(&ab.tool, "agents-tool", 300, "agents: tokens of each tool result")
	fs.DurationVar(&ab.pauseMin, "agents-pause-min", 200*time.Millisecond, "agents: shortest tool pause")
	fs.DurationVar(&ab.pauseMax, "agents-pause-max", 2*time.Second, "agents: longest tool pause")
	fs.StringVar(&ab.np, "agents-np", "4", "agents: PolyKV --parallel values to run (comma-separated; \"\": none)")
	fs.StringVar(&ab.llamaNP, "agents-llama-np", "2,4", "agents: llama-server -np values to run with --agents-llama-server")
	fs.StringVar(&ab.llamaServer, "agents-llama-server", "", "agents: also run llama-server (this binary; make llama-tools) with --kv-unified, the same -c and -t")
	fs.StringVar(&ab.llamaExtra, "agents-llama-args", "", "agents: extra llama-server arguments (space-separated)")
	fs.StringVar(&ab.url, "agents-url", "", "agents: run the client against this OpenAI-compatible server only (its base URL)")
	fs.StringVar(&ab.sessions, "agents-sessions", "both", "agents: name a session per agent (x-session-id): on, off or both")
	fs.IntVar(&ab.reps, "agents-reps", 1, "agents: runs of each configuration (alternating)")
	fs.Uint64Var(&ab.seed, "agents-seed", 1, "agents: seed of the texts and tool pauses")
	fs.DurationVar(&ab.turnTimeout, "agents-turn-timeout", 10*time.Minute, "agents: a turn that takes longer than this counts as not served")
}

// agentsRun is one run's outcome.
type agentsRun struct {
	name                        string
	wall                        time.Duration
	ttft                        []time.Duration
	served, failed              int
	prefilled, restored, cached int
	minimum                     int
	firstErr                    string
	convs                       [][][]chatMsg // per agent, per turn: the messages sent
}

type chatMsg struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// agentsWorkload holds the texts every run sends: the same for every server.
type agentsWorkload struct {
	system string
	tasks  []string
	tools  [][]string // per agent, per turn
	pauses [][]time.Duration
}

func (ab agentsBench) validate() error {
	switch {
	case ab.agents < 1 || ab.turns < 1 || ab.system < 1 || ab.task < 1 || ab.reply < 1 || ab.tool < 1:
		return fmt.Errorf("bench: --agents-* sizes must be at least 1")
	case ab.pauseMin < 0 || ab.pauseMax < ab.pauseMin:
		return fmt.Errorf("bench: --agents-pause-min must be between 0 and --agents-pause-max")
	case ab.sessions != "on" && ab.sessions != "off" && ab.sessions != "both":
		return fmt.Errorf("bench: --agents-sessions must be on, off or both, got %q", ab.sessions)
	case ab.reps < 1:
		return fmt.Errorf("bench: --agents-reps must be at least 1")
	}
	return nil
}

// words builds text of about n tokens from a seeded vocabulary of plain words, measured
// with the model's tokenizer.
func words(model *llama.Model, r *rand.Rand, prefix string, n int) (string, error) {
	vocab := strings.Fields("the team tool result field value record ledger account invoice report summary table column row query search filter agent plan step status error retry update version schema index cache shard region user order item price total date owner review approve reject merge branch deploy metric latency budget quota region alpha beta gamma delta north south east west")
	var b strings.Builder
	b.WriteString(prefix)
	for {
		for range 16 {
			fmt.Fprintf(&b, " %s", vocab[r.IntN(len(vocab))])
			if r.IntN(9) == 0 {
				fmt.Fprintf(&b, " %d.", r.IntN(10000))
			}
		}
		toks, err := model.Tokenize(b.String(), false, false)
		if err != nil {
			return "", err
		}
		if len(toks) >= n {
			return b.String(), nil
		}
	}
}

func (ab agentsBench) workload(modelPath string) (agentsWorkload, error) {
	var w agentsWorkload
	model, err := llama.LoadModel(modelPath)
	if err != nil {
		return w, err
	}
	defer model.Free()
	r := rand.New(rand.NewPCG(ab.seed, 40))
	var sys strings.Builder
	sys.WriteString("You are one agent of a team. Work on your task with these tools and report each step.\n")
	for i := 0; ; i++ {
		fmt.Fprintf(&sys, "Tool %d: lookup_%d(query: string, limit: int) returns ledger rows about topic %d, newest first.\n", i, i, i*13)
		toks, err := model.Tokenize(sys.String(), false, false)
		if err != nil {
			return w, err
		}
		if len(toks) >= ab.system {
			break
		}
	}
	w.system = sys.String()
	for a := range ab.agents {
		task, err := words(model, r, fmt.Sprintf("Task of agent %d:", a), ab.task)
		if err != nil {
			return w, err
		}
		w.tasks = append(w.tasks, task)
		var tools []string
		var pauses []time.Duration
		for k := range ab.turns {
			tr, err := words(model, r, fmt.Sprintf("Tool result %d for agent %d:", k, a), ab.tool)
			if err != nil {
				return w, err
			}
			tools = append(tools, tr)
			pauses = append(pauses, ab.pauseMin+time.Duration(r.Int64N(int64(ab.pauseMax-ab.pauseMin)+1)))
		}
		w.tools = append(w.tools, tools)
		w.pauses = append(w.pauses, pauses)
	}
	return w, nil
}

// run is the whole workload: each configuration in turn (alternating over reps), then
// the minimum of each run, then the table.
func (ab agentsBench) run(cfg app.Config) error {
	if err := ab.validate(); err != nil {
		return err
	}
	w, err := ab.workload(cfg.ModelPath)
	if err != nil {
		return err
	}
	sessModes := map[string][]bool{"on": {true}, "off": {false}, "both": {false, true}}[ab.sessions]
	type config struct {
		name  string
		start func() (base string, stop func(), err error)
		sess  bool
	}
	var configs []config
	if ab.url != "" {
		for _, s := range sessModes {
			configs = append(configs, config{name: ab.url + sessName(s), sess: s, start: func() (string, func(), error) { return strings.TrimRight(ab.url, "/"), func() {}, nil }})
		}
	} else {
		for _, np := range splitCSV(ab.np) {
			n, err := strconv.Atoi(np)
			if err != nil || n < 1 {
				return fmt.Errorf("bench: bad --agents-np %q", np)
			}
			for _, s := range sessModes {
				c := cfg
				c.Parallel = n
				configs = append(configs, config{name: fmt.Sprintf("PolyKV -np %d%s", n, sessName(s)), sess: s, start: func() (string, func(), error) {
					a, srv, base, err := serveApp(c)
					if err != nil {
						return "", nil, err
					}
					return base, func() { srv.Close(); a.Close() }, nil
				}})
			}
		}
		if ab.llamaServer != "" {
			for _, np := range splitCSV(ab.llamaNP) {
				n, err := strconv.Atoi(np)
				if err != nil || n < 1 {
					return fmt.Errorf("bench: bad --agents-llama-np %q", np)
				}
				args := []string{"-m", cfg.ModelPath, "-c", strconv.Itoa(cfg.NCtx), "-np", np, "-t", strconv.Itoa(cfg.Threads), "--kv-unified"}
				args = append(args, strings.Fields(ab.llamaExtra)...)
				// llama-server has no sessions (x-session-id means nothing to it): once.
				{
					s := false
					configs = append(configs, config{name: fmt.Sprintf("llama-server -np %d", n), sess: s, start: func() (string, func(), error) {
						l, err := startLlamaServer(ab.llamaServer, args, "agents-np"+np)
						if err != nil {
							return "", nil, err
						}
						return l.base, l.stop, nil
					}})
				}
			}
		}
	}
	fmt.Printf("agents: %d agents × %d turns; system %d, task %d, reply %d, tool result %d tokens; tool pause %s–%s; -c %d, -t %d\n",
		ab.agents, ab.turns, ab.system, ab.task, ab.reply, ab.tool, ab.pauseMin, ab.pauseMax, cfg.NCtx, cfg.Threads)
	var runs []agentsRun
	for rep := range ab.reps {
		order := slices.Clone(configs)
		if rep%2 == 1 {
			slices.Reverse(order) // alternate which configuration runs first
		}
		for _, c := range order {
			base, stop, err := c.start()
			if err != nil {
				return fmt.Errorf("bench: %s: %w", c.name, err)
			}
			r := ab.once(base, w, c.sess)
			stop()
			r.name = c.name
			runs = append(runs, r)
			fmt.Printf("  ran %s: %s, %d of %d turns\n", c.name, r.wall.Round(100*time.Millisecond), r.served, r.served+r.failed)
		}
	}
	// The minimum, from the rendered prompts of every run (their replies differ).
	rc := cfg
	rc.NCtx, rc.Parallel, rc.MaxPools, rc.PoolRAMMB = 512, 1, 1, 0
	a, srv, base, err := serveApp(rc)
	if err != nil {
		return err
	}
	for i := range runs {
		if runs[i].minimum, err = minimumPrefill(base, runs[i].convs); err != nil {
			srv.Close()
			a.Close()
			return err
		}
	}
	srv.Close()
	a.Close()
	fmt.Println()
	fmt.Println("| server, flags | wall | TTFT p50 / p90 | turns served | prefilled | restored | cached | work's minimum | prefilled / minimum |")
	fmt.Println("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range runs {
		fmt.Printf("| %s | %.0f s | %.1f / %.1f s | %d of %d | %d | %d | %d | %d | %.2f× |\n", r.name, r.wall.Seconds(),
			percentile(r.ttft, 0.5).Seconds(), percentile(r.ttft, 0.9).Seconds(), r.served, r.served+r.failed,
			r.prefilled, r.restored, r.cached, r.minimum, float64(r.prefilled)/float64(max(r.minimum, 1)))
	}
	for _, r := range runs {
		if r.firstErr != "" {
			fmt.Printf("%s: first failed turn: %s\n", r.name, r.firstErr)
		}
	}
	return nil
}

func sessName(on bool) string {
	if on {
		return ", x-session-id per agent"
	}
	return ""
}

func splitCSV(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// once runs every agent against base and waits for all of them.
func (ab agentsBench) once(base string, w agentsWorkload, sess bool) agentsRun {
	var mu sync.Mutex
	r := agentsRun{convs: make([][][]chatMsg, ab.agents)}
	client := &http.Client{Timeout: ab.turnTimeout}
	var wg sync.WaitGroup
	t0 := time.Now()
	for a := range ab.agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msgs := []chatMsg{{"system", w.system}, {"user", w.tasks[a]}}
			for k := range ab.turns {
				sent := slices.Clone(msgs)
				out, err := agentTurnHTTP(client, base, sent, ab.reply, a, sess)
				mu.Lock()
				r.convs[a] = append(r.convs[a], sent)
				if err != nil {
					r.failed++
					if r.firstErr == "" {
						r.firstErr = fmt.Sprintf("agent %d turn %d: %v", a, k, err)
					}
				} else {
					r.served++
					r.ttft = append(r.ttft, out.ttft)
					r.prefilled += out.promptN
					r.restored += out.restoredN
					r.cached += out.cacheN
				}
				mu.Unlock()
				if err != nil {
					// The agent goes on as a framework would after a failed call: it
					// retries nothing, the turn is lost, the next one carries on.
					out.text = "(the call failed)"
				}
				time.Sleep(w.pauses[a][k])
				msgs = append(msgs, chatMsg{"assistant", out.text}, chatMsg{"user", w.tools[a][k]})
			}
		}()
	}
	wg.Wait()
	r.wall = time.Since(t0)
	return r
}

// turnOut is one streamed reply.
type turnOut struct {
	text                       string
	ttft                       time.Duration
	promptN, cacheN, restoredN int
}

// agentTurnHTTP streams one chat turn: a greedy reply of exactly n tokens.
func agentTurnHTTP(client *http.Client, base string, msgs []chatMsg, n, agent int, sess bool) (turnOut, error) {
	var out turnOut
	body, _ := json.Marshal(map[string]any{"messages": msgs, "max_tokens": n, "temperature": 0, "ignore_eos": true, "stream": true,
		"stream_options": map[string]any{"include_usage": true}})
	req, err := http.NewRequest("POST", base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return out, err
	}
	req.Header.Set("Content-Type", "application/json")
	if sess {
		req.Header.Set("X-Session-Id", fmt.Sprintf("agent-%d", agent))
	}
	t0 := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return out, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		raw, _ := io.ReadAll(resp.Body)
		return out, fmt.Errorf("%d %s", resp.StatusCode, bytes.TrimSpace(raw))
	}
	var text strings.Builder
	type chunk struct {
		Choices []deltaChoice `json:"choices"`
		Timings *struct {
			PromptN   int `json:"prompt_n"`
			CacheN    int `json:"cache_n"`
			RestoredN int `json:"restored_n"`
		} `json:"timings"`
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	err = eachChunk(resp.Body, func(c *chunk) error {
		if c.Error != nil {
			return fmt.Errorf("in the stream: %s", c.Error.Message)
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != "" && out.ttft == 0 {
				out.ttft = time.Since(t0)
			}
			text.WriteString(ch.Delta.Content)
		}
		if c.Timings != nil {
			out.promptN, out.cacheN, out.restoredN = c.Timings.PromptN, c.Timings.CacheN, c.Timings.RestoredN
		}
		return nil
	})
	if err != nil {
		return out, err
	}
	if out.ttft == 0 {
		out.ttft = time.Since(t0) // a reply with no text (all whitespace tokens, say)
	}
	out.text = text.String()
	return out, nil
}

// minimumPrefill renders every prompt of a run with the chat template (base: a PolyKV
// server of the same model) and counts the tokens past the longest prefix any earlier
// prompt had: what any server must prefill at least, with everything kept.
func minimumPrefill(base string, convs [][][]chatMsg) (int, error) {
	type item struct {
		agent, turn int
	}
	var order []item
	for a, turns := range convs {
		for k := range turns {
			order = append(order, item{a, k})
		}
	}
	// Turn by turn: turn k of every agent before turn k+1 of any (the order the work
	// arrives in, near enough; the count only needs every earlier prefix).
	slices.SortStableFunc(order, func(x, y item) int { return x.turn - y.turn })
	seen := &tokenTrie{}
	total := 0
	for _, it := range order {
		var out struct {
			TokenIDs []int32 `json:"token_ids"`
		}
		if err := postInto(base+"/v1/chat/completions/render", map[string]any{"messages": convs[it.agent][it.turn]}, &out); err != nil {
			return 0, err
		}
		total += len(out.TokenIDs) - seen.insert(out.TokenIDs)
	}
	return total, nil
}

// tokenTrie is a set of token sequences; insert adds one and returns how long a prefix
// of it was already there.
type tokenTrie struct {
	next map[int32]*tokenTrie
}

func (t *tokenTrie) insert(toks []int32) int {
	known := 0
	found := true
	for _, tok := range toks {
		if t.next == nil {
			t.next = map[int32]*tokenTrie{}
		}
		n, ok := t.next[tok]
		if !ok {
			n = &tokenTrie{}
			t.next[tok] = n
			found = false
		}
		if found {
			known++
		}
		t = n
	}
	return known
}
