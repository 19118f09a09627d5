// Command fleetbench runs an agent workload through a PolyKV fleet (or one server) and
// prints what routing made of it: teams of agents, each team sharing a long system
// prompt, each agent a session (x-session-id) of several turns whose history grows
// with the replies, sent as plain streamed OpenAI chat requests. It reports the time to
// first token (median, P90), the prefix-cache hit ratio (cached prompt tokens / prompt
// tokens, from each reply's usage), failed attempts (a failed turn is retried, after a
// wait, as a client would) and turns lost after every retry, how many requests each
// replica served (from the replicas' polykv_queries_total before and after), and the
// prompt tokens each replica prefilled and restored from the tier below its cache
// (each reply's timings prompt_n and restored_n, attributed to the replica that the
// gateway's x-polykv-replica header names: deploy/local/envoy.yaml adds it).
//
//	fleetbench -url http://127.0.0.1:8081 -label precise -replicas 127.0.0.2:8000,127.0.0.3:8000,127.0.0.4:8000
//
// With -fault, -fault-replica names the replica the fault command kills and restarts: a
// second line says how it served the turns whose last attempt started after the
// command began (from its cells, restored from the tier, prefilled): once the command
// has killed the replica, every reply from that address is the restarted process's.
// -records writes every turn as a JSON line.
//
// Everything about the workload is deterministic (team texts, questions, order of
// submission); only timing and routing vary between runs.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

type config struct {
	url, model, label string
	replicas          []string
	teams, agents     int
	teamBase          int // the first team's number: another base, other system prompts
	turns             int
	systemWords       int
	maxTokens         int
	stagger           time.Duration
	timeout           time.Duration
	retries           int           // attempts after a failed one
	retryWait         time.Duration // before each retry, as a client backs off
	during            func()        // called once, halfway through the requests (faults)
	faultReplica      string        // the replica during restarts, for the after-fault line
}

// replicaHeader names the replica that answered; the gateway adds it
// (deploy/local/envoy.yaml), a replica alone does not.
const replicaHeader = "x-polykv-replica"

// result is one turn's outcome: its last attempt, and how many attempts failed.
type result struct {
	ttft           time.Duration
	prompt, cached int
	// From the reply's timings: prompt tokens taken from the replica's cells (cache_n),
	// loaded from the tier below them (restored_n) and prefilled (prompt_n).
	fromCells, restored, prefilled int
	replica                        string // the x-polykv-replica header, "" when absent
	err                            error
	failed                         int
	// Where the turn sits in the run: its session and turn number, when its last
	// attempt started (since the run's start), and whether that was after the fault
	// command began. (Not after it returned: a retry can reach a restarted replica
	// before the command's own health check sees it up, and those first requests are
	// the ones a restart scenario is about.)
	session    string
	turn       int
	start      time.Duration
	afterFault bool
}

// systemPrompt is team t's shared instructions: about words words, different from
// the first word on (so teams share nothing but the chat template's opening tokens).
func systemPrompt(t, words int) string {
	topics := []string{"billing", "search", "inventory", "routing", "weather", "travel", "medicine", "law"}
	topic := topics[t%len(topics)]
	var b strings.Builder
	fmt.Fprintf(&b, "Team %d handles %s requests. ", t, topic)
	for i := 0; b.Len()/6 < words; i++ {
		fmt.Fprintf(&b, "Rule %d for the %s team: when a user mentions item %d, check record %d, answer briefly and cite rule %d. ",
			i+1, topic, (i*7+t)%97, (i*13+t*5)%89, i+1)
	}
	return b.String()
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// ask sends one streamed chat request and reads it to the end.
func ask(ctx context.Context, c config, session string, msgs []message) (string, result) {
	body, _ := json.Marshal(map[string]any{
		"model": c.model, "messages": msgs, "max_tokens": c.maxTokens, "temperature": 0,
		"stream": true, "stream_options": map[string]any{"include_usage": true},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return "", result{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("x-session-id", session)
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", result{err: err}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return "", result{err: fmt.Errorf("HTTP %d: %s", resp.StatusCode, raw)}
	}
	r := result{replica: resp.Header.Get(replicaHeader)}
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens int `json:"prompt_tokens"`
				Details      struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
			// The finishing chunk's timings (PolyKV's, after llama-server's).
			Timings *struct {
				CacheN    int `json:"cache_n"`
				PromptN   int `json:"prompt_n"`
				RestoredN int `json:"restored_n"`
			} `json:"timings"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			return "", result{err: fmt.Errorf("chunk %q: %w", data, err)}
		}
		if r.ttft == 0 && len(chunk.Choices) > 0 {
			r.ttft = time.Since(start) // the first token's chunk
		}
		for _, ch := range chunk.Choices {
			text.WriteString(ch.Delta.Content)
		}
		if chunk.Usage != nil {
			r.prompt, r.cached = chunk.Usage.PromptTokens, chunk.Usage.Details.CachedTokens
		}
		if t := chunk.Timings; t != nil {
			r.fromCells, r.prefilled, r.restored = t.CacheN, t.PromptN, t.RestoredN
		}
	}
	if err := sc.Err(); err != nil {
		return "", result{err: err}
	}
	if r.prompt == 0 {
		return "", result{err: fmt.Errorf("no usage in the stream")}
	}
	return text.String(), r
}

// queries reads a replica's polykv_queries_total (all pools), -1 when unreachable.
func queries(addr string) float64 {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return -1
	}
	sum := 0.0
	if f := fams["polykv_queries_total"]; f != nil {
		for _, m := range f.GetMetric() {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

func percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(p*float64(len(s)-1) + 0.5)
	return s[i]
}

func run(c config, records string) int {
	before := make([]float64, len(c.replicas))
	for i, r := range c.replicas {
		before[i] = queries(r)
	}
	results := collect(c)
	if records != "" {
		f, err := os.Create(records)
		if err == nil {
			err = writeRecords(f, c, results)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "records: %v\n", err)
			return 1
		}
	}
	return report(c, results, before)
}

// collect runs every agent's turns and returns each turn's outcome.
func collect(c config) []result {
	total := c.teams * c.agents * c.turns
	var (
		mu         sync.Mutex
		results    []result
		wg         sync.WaitGroup
		once       sync.Once
		faultBegan time.Duration // since begin, when the fault command began; guarded by mu
	)
	ctx := context.Background()
	begin := time.Now()
	for a := range c.agents {
		for t := range c.teams {
			wg.Add(1)
			go func() {
				defer wg.Done()
				team := c.teamBase + t
				session := fmt.Sprintf("%s-team%d-agent%d", c.label, team, a)
				msgs := []message{{Role: "system", Content: systemPrompt(team, c.systemWords)}}
				for turn := range c.turns {
					msgs = append(msgs, message{Role: "user", Content: fmt.Sprintf(
						"Agent %d, turn %d: what should I do about item %d?", a, turn, (a*31+turn*17+team)%97)})
					var reply string
					var r result
					for attempt := 0; ; attempt++ {
						start := time.Since(begin)
						mu.Lock()
						after := faultBegan > 0 && start >= faultBegan
						mu.Unlock()
						rctx, cancel := context.WithTimeout(ctx, c.timeout)
						reply, r = ask(rctx, c, session, msgs)
						cancel()
						r.failed, r.start, r.afterFault, r.session, r.turn = attempt, start, after, session, turn
						if r.err == nil || attempt == c.retries {
							break
						}
						fmt.Fprintf(os.Stderr, "%s turn %d attempt %d: %v\n", session, turn, attempt+1, r.err)
						time.Sleep(c.retryWait)
					}
					if r.err != nil {
						r.failed++
					}
					mu.Lock()
					results = append(results, r)
					n := len(results)
					mu.Unlock()
					if n == total/2 && c.during != nil {
						once.Do(func() {
							mu.Lock()
							faultBegan = time.Since(begin)
							mu.Unlock()
							c.during()
						})
					}
					if r.err != nil {
						fmt.Fprintf(os.Stderr, "%s turn %d lost: %v\n", session, turn, r.err)
						reply = "(no answer)"
					}
					msgs = append(msgs, message{Role: "assistant", Content: reply})
				}
			}()
			// Agents of a team start one after another, as a team's workers would.
			time.Sleep(c.stagger)
		}
	}
	wg.Wait()
	return results
}

// report prints one table row (and the after-fault line with -fault-replica), or
// returns 1 when every turn was lost.
func report(c config, results []result, before []float64) int {
	var spread []string
	for i, r := range c.replicas {
		after := queries(r)
		if before[i] < 0 || after < 0 {
			spread = append(spread, "down")
			continue
		}
		spread = append(spread, fmt.Sprintf("%.0f", after-before[i]))
	}
	fmt.Println(row(c, results, spread))
	if c.faultReplica != "" {
		fmt.Println(afterFault(c, results, 3))
	}
	for _, r := range results {
		if r.err == nil {
			return 0
		}
	}
	return 1
}

// header is the table's header, row's columns.
const header = "| config | turns | failed attempts | lost turns | TTFT median (s) | TTFT P90 (s) | hit ratio | requests per replica | prefilled tokens per replica | restored tokens per replica |\n" +
	"|---|---|---|---|---|---|---|---|---|---|"

// row is the table row of a run: spread is each replica's requests served.
func row(c config, results []result, spread []string) string {
	var ttft []time.Duration
	prompt, cached, failed, lost := 0, 0, 0, 0
	for _, r := range results {
		failed += r.failed
		if r.err != nil {
			lost++
			continue
		}
		ttft = append(ttft, r.ttft)
		prompt += r.prompt
		cached += r.cached
	}
	ratio := 0.0
	if prompt > 0 {
		ratio = float64(cached) / float64(prompt)
	}
	prefilled, restored := perReplica(c, results)
	return fmt.Sprintf("| %s | %d | %d | %d | %.2f | %.2f | %.3f | %s | %s | %s |", c.label, len(results), failed, lost,
		percentile(ttft, 0.5).Seconds(), percentile(ttft, 0.9).Seconds(), ratio, strings.Join(spread, " / "),
		prefilled, restored)
}

// replicaOf is the replica that served r: the gateway's header, or the only replica.
func replicaOf(c config, r result) string {
	if r.replica == "" && len(c.replicas) == 1 {
		return c.replicas[0]
	}
	return r.replica
}

// perReplica sums the answered turns' prefilled and restored prompt tokens by the
// replica that served them, in -replicas order ("a / b / c"); turns served by no
// listed replica (no header) are summed after them as "other".
func perReplica(c config, results []result) (prefilled, restored string) {
	pre, res := make([]int, len(c.replicas)+1), make([]int, len(c.replicas)+1)
	for _, r := range results {
		if r.err != nil {
			continue
		}
		i := slices.Index(c.replicas, replicaOf(c, r))
		if i < 0 {
			i = len(c.replicas)
		}
		pre[i] += r.prefilled
		res[i] += r.restored
	}
	join := func(n []int) string {
		var parts []string
		for _, v := range n[:len(c.replicas)] {
			parts = append(parts, fmt.Sprint(v))
		}
		if n[len(c.replicas)] > 0 || len(c.replicas) == 0 {
			parts = append(parts, fmt.Sprintf("other %d", n[len(c.replicas)]))
		}
		return strings.Join(parts, " / ")
	}
	return join(pre), join(res)
}

// afterFault says how c.faultReplica served the turns whose last attempt started after
// the fault command began: the first first of them one by one (in order of start),
// then all of them together.
func afterFault(c config, results []result, first int) string {
	var on []result
	for _, r := range results {
		if r.err == nil && r.afterFault && replicaOf(c, r) == c.faultReplica {
			on = append(on, r)
		}
	}
	slices.SortFunc(on, func(a, b result) int { return int(a.start - b.start) })
	var b strings.Builder
	fmt.Fprintf(&b, "after the fault, %s served %d turns", c.faultReplica, len(on))
	if len(on) == 0 {
		return b.String()
	}
	b.WriteString("; first:")
	prompt, cells, restored, prefilled := 0, 0, 0, 0
	for i, r := range on {
		if i < first {
			fmt.Fprintf(&b, " [%s turn %d at %.1fs: prompt %d = cells %d + restored %d + prefilled %d, TTFT %.2fs]",
				r.session, r.turn, r.start.Seconds(), r.prompt, r.fromCells, r.restored, r.prefilled, r.ttft.Seconds())
		}
		prompt += r.prompt
		cells += r.fromCells
		restored += r.restored
		prefilled += r.prefilled
	}
	fmt.Fprintf(&b, "; all: prompt %d = cells %d + restored %d + prefilled %d", prompt, cells, restored, prefilled)
	return b.String()
}

// record is one turn as -records writes it (a JSON line).
type record struct {
	Session    string  `json:"session"`
	Turn       int     `json:"turn"`
	Replica    string  `json:"replica"`
	StartS     float64 `json:"start_s"`
	AfterFault bool    `json:"after_fault"`
	TTFTS      float64 `json:"ttft_s"`
	Prompt     int     `json:"prompt"`
	Cached     int     `json:"cached"`
	FromCells  int     `json:"cache_n"`
	Restored   int     `json:"restored_n"`
	Prefilled  int     `json:"prompt_n"`
	Failed     int     `json:"failed_attempts"`
	Err        string  `json:"error,omitempty"`
}

// writeRecords writes every turn as a JSON line, in order of start.
func writeRecords(w io.Writer, c config, results []result) error {
	sorted := slices.Clone(results)
	slices.SortStableFunc(sorted, func(a, b result) int { return int(a.start - b.start) })
	enc := json.NewEncoder(w)
	for _, r := range sorted {
		rec := record{Session: r.session, Turn: r.turn, Replica: replicaOf(c, r), StartS: r.start.Seconds(),
			AfterFault: r.afterFault, TTFTS: r.ttft.Seconds(), Prompt: r.prompt, Cached: r.cached,
			FromCells: r.fromCells, Restored: r.restored, Prefilled: r.prefilled, Failed: r.failed}
		if r.err != nil {
			rec.Err = r.err.Error()
		}
		if err := enc.Encode(rec); err != nil {
			return err
		}
	}
	return nil
}

func main() {
	var c config
	var replicas, faultCmd, records string
	flag.StringVar(&c.url, "url", "http://127.0.0.1:8081", "base URL: the gateway, or one server")
	flag.StringVar(&c.model, "model", "smollm2", "model name (the replicas' --alias)")
	flag.StringVar(&c.label, "label", "fleet", "name of this configuration in the output (and in session ids)")
	flag.StringVar(&replicas, "replicas", "", "comma-separated host:port of the replicas, for the per-replica spread")
	flag.IntVar(&c.teams, "teams", 3, "teams (each shares one system prompt)")
	flag.IntVar(&c.teamBase, "team-base", 0, "number of the first team (teams of another base share no system prompt with these)")
	flag.IntVar(&c.agents, "agents", 3, "agents per team (each one session)")
	flag.IntVar(&c.turns, "turns", 3, "turns per agent")
	flag.IntVar(&c.systemWords, "system-words", 350, "approximate length of each team's system prompt, in words")
	flag.IntVar(&c.maxTokens, "max-tokens", 16, "tokens generated per turn")
	flag.DurationVar(&c.stagger, "stagger", 500*time.Millisecond, "delay between starting agents")
	flag.DurationVar(&c.timeout, "timeout", 5*time.Minute, "per-request timeout")
	flag.IntVar(&c.retries, "retries", 3, "retries of a failed turn")
	flag.DurationVar(&c.retryWait, "retry-wait", time.Second, "wait before each retry")
	flag.StringVar(&faultCmd, "fault", "", "shell command run once when half the requests are done (e.g. kill a replica)")
	flag.StringVar(&c.faultReplica, "fault-replica", "", "host:port of the replica the -fault command kills and restarts: print how it served the turns that started after the command began")
	flag.StringVar(&records, "records", "", "file to write every turn to, one JSON line each (session, turn, replica, start, TTFT, tokens)")
	withHeader := flag.Bool("header", false, "print the table header first")
	headerOnly := flag.Bool("header-only", false, "print the table header and exit")
	flag.Parse()
	if replicas != "" {
		c.replicas = strings.Split(replicas, ",")
	}
	if faultCmd != "" {
		c.during = func() {
			fmt.Fprintf(os.Stderr, "fault: %s\n", faultCmd)
			if err := shell(faultCmd); err != nil {
				fmt.Fprintf(os.Stderr, "fault command: %v\n", err)
			}
		}
	}
	if *withHeader || *headerOnly {
		fmt.Println(header)
	}
	if *headerOnly {
		return
	}
	os.Exit(run(c, records))
}

// shell runs cmd with bash, its output on stderr.
func shell(cmd string) error {
	c := exec.Command("bash", "-c", cmd)
	c.Stdout, c.Stderr = os.Stderr, os.Stderr
	return c.Run()
}
