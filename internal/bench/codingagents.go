package bench

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/app"
)

// codingAgents (--workload coding-agents, issue 53) replays what the agent CLIs send:
// the request bodies Claude Code and Codex sent in a recorded run (internal/api/
// testdata/agents, the CLIs pinned in scripts/agents), as N concurrent sessions of a
// team working in one project. Each session is its own CLI session: its own billing
// header and session id (Claude Code), prompt_cache_key (Codex), and its own task; its
// turns are the recorded ones (the first turn, then the turn that carries the tool's
// result), sent streamed after a tool pause, each reply cut at --coding-gen tokens (the
// prompt is what is measured). The same traffic runs on PolyKV and, with
// --coding-llama-server, on llama-server started with the same model, context and
// threads, alternating which runs first.
type codingAgents struct {
	sessions    int
	clients     string
	traffic     string
	gen         int
	pause       time.Duration
	llamaServer string
	llamaNP     int
	llamaCtx    int
	llamaExtra  string
	url         string
}

func (ca *codingAgents) register(fs *flag.FlagSet) {
	fs.IntVar(&ca.sessions, "coding-sessions", 8, "coding-agents: concurrent sessions")
	fs.StringVar(&ca.clients, "coding-clients", "claude-code-team,codex-team", "coding-agents: whose recorded traffic each session replays, sessions alternating between them: claude-code-team and codex-team (a main agent that spawns a sub-agent, each with a tool round trip), claude-code and codex (one agent, one tool round trip)")
	fs.StringVar(&ca.traffic, "coding-traffic", "internal/api/testdata/agents", "coding-agents: the recorded request bodies, one directory per client")
	fs.IntVar(&ca.gen, "coding-gen", 16, "coding-agents: tokens each reply decodes at most (max_tokens / max_output_tokens)")
	fs.DurationVar(&ca.pause, "coding-tool-pause", time.Second, "coding-agents: the pause between a reply and the session's next turn (the client running its tool)")
	fs.StringVar(&ca.llamaServer, "coding-llama-server", "", "coding-agents: also run the traffic on this llama-server binary (make llama-tools)")
	fs.IntVar(&ca.llamaNP, "coding-llama-np", 0, "coding-agents: llama-server's -np (0: one slot per session)")
	fs.IntVar(&ca.llamaCtx, "coding-llama-ctx", 0, "coding-agents: llama-server's -c (0: the same as PolyKV's; without prefix sharing across slots it needs room for every session's prompt)")
	fs.StringVar(&ca.llamaExtra, "coding-llama-extra", "", "coding-agents: more llama-server flags (e.g. --cache-ram 8192)")
	fs.StringVar(&ca.url, "coding-url", "", "coding-agents: run the traffic against this server instead (Anthropic and Responses routes)")
}

// codingTurn is one recorded request: its route and body.
type codingTurn struct {
	route string
	body  map[string]any
}

// codingResult is one session's turn as the client saw it.
type codingResult struct {
	session, turn  int
	client         string
	lead           bool // the first session of its client, started alone
	status         int
	ttft, total    time.Duration
	prompt, cached int // as the server reported them (-1: not reported)
	err            string
}

// traffic reads the recorded turns of each client.
func (ca codingAgents) recorded() (map[string][]codingTurn, error) {
	out := map[string][]codingTurn{}
	for _, c := range splitCSV(ca.clients) {
		var route string
		switch {
		case strings.HasPrefix(c, "claude-code"):
			route = "/v1/messages"
		case strings.HasPrefix(c, "codex"):
			route = "/v1/responses"
		default:
			return nil, fmt.Errorf("bench: --coding-clients: unknown client %q (claude-code[-team], codex[-team])", c)
		}
		files, _ := filepath.Glob(filepath.Join(ca.traffic, c, "*.json"))
		if len(files) == 0 {
			return nil, fmt.Errorf("bench: no recorded traffic in %s (run from the repository root, or set --coding-traffic)", filepath.Join(ca.traffic, c))
		}
		slices.Sort(files)
		for _, f := range files {
			raw, err := os.ReadFile(f)
			if err != nil {
				return nil, err
			}
			var body map[string]any
			if err := json.Unmarshal(raw, &body); err != nil {
				return nil, fmt.Errorf("%s: %w", f, err)
			}
			out[c] = append(out[c], codingTurn{route: route, body: body})
		}
	}
	return out, nil
}

// personalize makes a recorded body session i's: its billing header and session
// (Claude Code), its prompt_cache_key (Codex), its task, and the reply's length.
func (ca codingAgents) personalize(client string, body map[string]any, i int) ([]byte, error) {
	raw, _ := json.Marshal(body)
	task := "Which files are in this directory?"
	s := strings.ReplaceAll(string(raw), task, fmt.Sprintf("Session %d: which files are in this directory, and which of them changed last?", i))
	var v map[string]any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		return nil, err
	}
	v["stream"] = true
	switch {
	case strings.HasPrefix(client, "claude-code"):
		if sys, ok := v["system"].([]any); ok && len(sys) > 0 {
			if b, ok := sys[0].(map[string]any); ok && strings.HasPrefix(fmt.Sprint(b["text"]), "x-anthropic-billing-header:") {
				b["text"] = fmt.Sprintf("x-anthropic-billing-header: cc_version=2.1.328.%03x; cc_entrypoint=sdk-cli;", 0x100+i)
			}
		}
		v["metadata"] = map[string]any{"user_id": fmt.Sprintf(`{"device_id":"bench","account_uuid":"","session_id":"bench-session-%d"}`, i)}
		v["max_tokens"] = ca.gen
	case strings.HasPrefix(client, "codex"):
		v["prompt_cache_key"] = fmt.Sprintf("bench-thread-%d", i)
		v["max_output_tokens"] = ca.gen
	}
	return json.Marshal(v)
}

// send streams one turn: the time to the first generated piece, the end, and the
// usage the server reported.
func sendCodingTurn(client *http.Client, base, route string, body []byte) (r codingResult) {
	start := time.Now()
	r.prompt, r.cached = -1, -1
	resp, err := client.Post(base+route, "application/json", bytes.NewReader(body))
	if err != nil {
		r.err = err.Error()
		return r
	}
	defer resp.Body.Close()
	r.status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		r.err = fmt.Sprintf("%d %.300s", resp.StatusCode, b.String())
		return r
	}
	// A stream event: its type and, wherever the route puts it, the usage so far
	// (Messages: message_start's message and message_delta; Responses: the response).
	type usage struct {
		InputTokens  *int `json:"input_tokens"`
		CacheRead    *int `json:"cache_read_input_tokens"`
		InputDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
	}
	type event struct {
		Type     string `json:"type"`
		Usage    *usage `json:"usage"`
		Response *struct {
			Usage *usage `json:"usage"`
		} `json:"response"`
	}
	err = eachChunk(resp.Body, func(ev *event) error {
		// The first generated piece: a *_delta (Messages) or *.delta (Responses) event.
		if r.ttft == 0 && (strings.HasSuffix(ev.Type, "_delta") || strings.HasSuffix(ev.Type, ".delta")) {
			r.ttft = time.Since(start)
		}
		u := ev.Usage
		if ev.Response != nil && ev.Response.Usage != nil {
			u = ev.Response.Usage
		}
		switch {
		case u == nil || u.InputTokens == nil:
		case u.InputDetails != nil: // Responses: input_tokens counts the cached ones
			r.prompt, r.cached = *u.InputTokens, u.InputDetails.CachedTokens
		case u.CacheRead != nil: // Messages: input_tokens are the uncached ones
			r.prompt, r.cached = *u.InputTokens+*u.CacheRead, *u.CacheRead
		default:
			r.prompt = *u.InputTokens
		}
		return nil
	})
	if err != nil {
		r.err = err.Error()
	}
	r.total = time.Since(start)
	return r
}

// once runs the sessions against base as a team starts: the first session of each
// client alone (its first turn is cold, as a main agent's), the others once those
// first turns are answered (as the agents it spawns), all then concurrently.
func (ca codingAgents) once(base string, rec map[string][]codingTurn) ([]codingResult, time.Duration) {
	clients := splitCSV(ca.clients)
	client := &http.Client{Timeout: 30 * time.Minute}
	var mu sync.Mutex
	var out []codingResult
	var wg sync.WaitGroup
	var leadsDone sync.WaitGroup
	start := time.Now()
	for i := range ca.sessions {
		c := clients[i%len(clients)]
		lead := i < len(clients)
		if lead {
			leadsDone.Add(1)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if !lead {
				leadsDone.Wait()
			}
			for k, t := range rec[c] {
				if k > 0 {
					time.Sleep(ca.pause)
				}
				body, err := ca.personalize(c, t.body, i)
				r := codingResult{status: 0, err: fmt.Sprint(err)}
				if err == nil {
					r = sendCodingTurn(client, base, t.route, body)
				}
				r.session, r.turn, r.client, r.lead = i, k, c, lead
				mu.Lock()
				out = append(out, r)
				mu.Unlock()
				if lead && k == 0 {
					leadsDone.Done()
				}
			}
		}()
	}
	wg.Wait()
	return out, time.Since(start)
}

func (ca codingAgents) run(cfg app.Config, reps int) error {
	if ca.sessions < 1 || ca.gen < 1 {
		return fmt.Errorf("bench: --coding-sessions and --coding-gen must be at least 1")
	}
	rec, err := ca.recorded()
	if err != nil {
		return err
	}
	type config struct {
		name  string
		start func() (string, func(), error)
	}
	var configs []config
	if ca.url != "" {
		configs = append(configs, config{name: ca.url, start: func() (string, func(), error) { return strings.TrimRight(ca.url, "/"), func() {}, nil }})
	} else {
		configs = append(configs, config{name: fmt.Sprintf("PolyKV -np %d", cfg.Parallel), start: func() (string, func(), error) {
			a, srv, base, err := serveApp(cfg)
			if err != nil {
				return "", nil, err
			}
			return base, func() { srv.Close(); a.Close() }, nil
		}})
		if ca.llamaServer != "" {
			np := ca.llamaNP
			if np == 0 {
				np = ca.sessions
			}
			nctx := cfg.NCtx
			if ca.llamaCtx > 0 {
				nctx = ca.llamaCtx
			}
			args := []string{"-m", cfg.ModelPath, "-c", strconv.Itoa(nctx), "-np", strconv.Itoa(np), "-t", strconv.Itoa(cfg.Threads), "--kv-unified", "--jinja"}
			// The same template as PolyKV's, so both render the same prompt.
			switch {
			case cfg.ChatTemplateFile != "":
				args = append(args, "--chat-template-file", cfg.ChatTemplateFile)
			case cfg.ChatTemplate != "":
				args = append(args, "--chat-template", cfg.ChatTemplate)
			}
			args = append(args, strings.Fields(ca.llamaExtra)...)
			configs = append(configs, config{name: "llama-server " + strings.Join(args[2:], " "), start: func() (string, func(), error) {
				l, err := startLlamaServer(ca.llamaServer, args, "coding-agents")
				if err != nil {
					return "", nil, err
				}
				return l.base, l.stop, nil
			}})
		}
	}
	fmt.Printf("coding-agents: %d sessions (%s, recorded in %s), turns per client %v, replies <= %d tokens, tool pause %s; -c %d, -t %d\n",
		ca.sessions, ca.clients, ca.traffic, turnCounts(rec), ca.gen, ca.pause, cfg.NCtx, cfg.Threads)
	type run struct {
		name string
		rs   []codingResult
		wall time.Duration
	}
	var runs []run
	for rep := range max(1, reps) {
		order := slices.Clone(configs)
		if rep%2 == 1 {
			slices.Reverse(order)
		}
		for _, c := range order {
			base, stop, err := c.start()
			if err != nil {
				return fmt.Errorf("bench: %s: %w", c.name, err)
			}
			rs, wall := ca.once(base, rec)
			stop()
			runs = append(runs, run{name: c.name, rs: rs, wall: wall})
			fmt.Printf("  ran %s: %s\n", c.name, wall.Round(100*time.Millisecond))
		}
	}
	fmt.Println()
	fmt.Println("| server, flags | wall | 2xx | first turn TTFT: lead sessions (cold) / others p50 / p90 | later turns TTFT p50 / p90 | prompt tokens | cached | prefilled | others' first turns prefilled |")
	fmt.Println("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range runs {
		var leads, firsts, laters []time.Duration
		othersPrefilled := 0
		ok, prompt, cached, reported := 0, 0, 0, true
		for _, x := range r.rs {
			if x.status >= 200 && x.status < 300 && x.err == "" {
				ok++
			}
			if x.prompt < 0 {
				reported = false
			} else {
				prompt += x.prompt
				cached += max(x.cached, 0)
			}
			switch {
			case x.turn > 0:
				laters = append(laters, x.ttft)
			case x.lead:
				leads = append(leads, x.ttft)
			default:
				firsts = append(firsts, x.ttft)
				othersPrefilled += x.prompt - max(x.cached, 0)
			}
		}
		tok := fmt.Sprintf("%d | %d | %d | %d", prompt, cached, prompt-cached, othersPrefilled)
		if !reported {
			tok = "not reported | | | "
		}
		fmt.Printf("| %s | %.1f s | %d of %d | %s / %.1f / %.1f s | %.1f / %.1f s | %s |\n", r.name, r.wall.Seconds(), ok, len(r.rs),
			durations(leads), percentile(firsts, 0.5).Seconds(), percentile(firsts, 0.9).Seconds(),
			percentile(laters, 0.5).Seconds(), percentile(laters, 0.9).Seconds(), tok)
	}
	for _, r := range runs {
		for _, x := range r.rs {
			if x.err != "" {
				fmt.Printf("%s: session %d (%s) turn %d failed: %s\n", r.name, x.session, x.client, x.turn, x.err)
				break
			}
		}
	}
	return nil
}

func turnCounts(rec map[string][]codingTurn) map[string]int {
	out := map[string]int{}
	for c, ts := range rec {
		out[c] = len(ts)
	}
	return out
}

// durations lists ds in seconds, one decimal.
func durations(ds []time.Duration) string {
	var parts []string
	for _, d := range ds {
		parts = append(parts, fmt.Sprintf("%.1f", d.Seconds()))
	}
	return strings.Join(parts, ", ") + " s"
}
