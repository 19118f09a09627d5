package bench

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/engine"
)

// specBench is issue 23's speculative decoding benchmark. Two workloads: edit (each of N
// agents gets a JSON document of about 600 tokens and asks for it back with one field
// changed: an answer that mostly copies its context, which is what agents' tool-call
// arguments and file edits look like) and chat (N agents ask for a short story: little
// to copy). Every request is greedy. One server per N runs with speculation on; each
// round runs the workload with speculative false and then with speculation, so both see
// the same machine state, and the outputs of the two must be identical.
type specBench struct {
	agents    string // agent counts N
	workloads string // edit, chat
	types     string // --spec-type for the benchmark when the server flag is none
	chatGen   int    // tokens each chat agent decodes
	// llamaServer, when set, is a llama-server binary run on the same workloads: one
	// instance without speculation, one with --spec-type ngram-mod (its defaults).
	llamaServer string
}

// specResult is one run of one workload in one mode.
type specResult struct {
	texts            []string
	predicted        int           // generated tokens, all agents
	span             time.Duration // the longest decode phase (first token to end)
	drafted, accepts int
}

// decodeTPS is the run's aggregate decode speed: generated tokens over the longest
// agent's decode phase (the agents start together, so the decode phases overlap; for
// one agent it is its predicted_per_second). Prefill is left out: both modes share it.
func (r specResult) decodeTPS() float64 {
	if r.span <= 0 {
		return 0
	}
	return float64(r.predicted) / r.span.Seconds()
}

// specDoc is agent i's JSON document: a service configuration of about 600 tokens
// (SmolLM2's tokenizer), with a "status" field the edit changes.
func specDoc(i int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "{\n  \"service\": \"billing-api-%d\",\n  \"version\": \"2.%d.0\",\n  \"status\": \"active\",\n", i, 10+i)
	fmt.Fprintf(&b, "  \"owner\": {\"team\": \"payments\", \"email\": \"payments-%d@example.com\", \"oncall\": \"pager-%d\"},\n", i, i%7)
	b.WriteString("  \"regions\": [\"eu-west-1\", \"us-east-2\", \"ap-south-1\"],\n  \"features\": [\n")
	names := []string{"invoices", "refunds", "disputes", "ledger", "payouts", "webhooks", "reports", "exports", "alerts", "audit", "tax", "currency"}
	for j, name := range names {
		sep := ","
		if j == len(names)-1 {
			sep = ""
		}
		fmt.Fprintf(&b, "    {\"name\": \"%s\", \"enabled\": %v, \"rollout\": %d, \"timeout_ms\": %d, \"retries\": %d}%s\n",
			name, (i+j)%3 != 0, (j*17+i*5)%100, 250*(1+(i+j)%8), (i+j)%4, sep)
	}
	b.WriteString("  ],\n  \"limits\": {\"requests_per_minute\": 1200, \"burst\": 200, \"max_body_bytes\": 1048576},\n")
	fmt.Fprintf(&b, "  \"database\": {\"host\": \"db-%d.internal\", \"port\": 5432, \"pool_size\": %d, \"replicas\": 2}\n}", i, 10+i%5)
	return b.String()
}

// specPrompts is how many distinct requests specMessages has per workload.
const specPrompts = 256

// specMessages is request k (< specPrompts) in workload w: k = round·N + agent, so no
// two requests a server sees in one row are the same. A drafter that remembers across requests
// (ngram-mod's table, shared by all sessions, in PolyKV and in llama-server) would
// otherwise replay the previous round's greedy answer to the very same prompt: that
// measured a cache of answers (llama-server's chat at N = 1: 92% of drafts accepted,
// 2.1×, on a short story), not speculation on a new request.
func specMessages(w string, k int) []map[string]any {
	if w == "edit" {
		return []map[string]any{
			{"role": "system", "content": "You are a precise JSON editor."},
			{"role": "user", "content": "Here is a JSON document:\n```json\n" + specDoc(k) +
				"\n```\nReturn the same JSON document with \"status\" changed to \"archived\". Output only the JSON, nothing else."},
		}
	}
	topics := []string{"a lighthouse keeper", "a lost robot", "a baker in Paris", "a dragon who hates gold", "two rival chess players",
		"a city under the sea", "a time-travelling cat", "the last tree on Mars"}
	places := []string{"in a small mountain village", "on a night train", "during a thunderstorm", "at the edge of the desert",
		"in a crowded market", "on a frozen lake", "inside an old library", "aboard a fishing boat"}
	moods := []string{"", " Make it funny.", " Make it sad.", " Make it hopeful."}
	return []map[string]any{
		{"role": "system", "content": "You are a helpful assistant."},
		{"role": "user", "content": "Write a short story about " + topics[k%len(topics)] + " " +
			places[k/len(topics)%len(places)] + "." + moods[k/(len(topics)*len(places))%len(moods)]},
	}
}

func (sb specBench) run(cfg app.Config, reps int) error {
	ns, err := parseCounts(sb.agents, maxBenchSessions)
	if err != nil {
		return err
	}
	types, err := engine.ParseSpecTypes(cfg.SpecType)
	if err != nil {
		return err
	}
	if len(types) == 0 {
		cfg.SpecType = sb.types
	}
	workloads := strings.Split(sb.workloads, ",")
	for _, w := range workloads {
		if w != "edit" && w != "chat" {
			return fmt.Errorf("bench: unknown spec workload %q (edit, chat)", w)
		}
	}
	if maxN := slices.Max(ns); reps*maxN > specPrompts {
		return fmt.Errorf("bench: --reps %d × %d agents asks for %d distinct prompts, the spec workloads have %d", reps, maxN, reps*maxN, specPrompts)
	}
	fmt.Printf("speculative decoding: %s, --spec-type %s, --draft-max %d, --draft-min %d, --spec-ngram-min %d, --spec-step-cost %s, %d threads; decode tok/s = generated tokens / longest decode phase; %d rounds, each with new prompts (prefilled untimed), off and on alternating (ABBA): medians, and the range of the per-round on/off ratios\n\n",
		cfg.ModelPath, cfg.SpecType, cfg.DraftMax, cfg.DraftMin, cfg.SpecNgramMin, stepCost(cfg.SpecStepCost), cfg.Threads, reps)
	if cfg.ModelDraft != "" {
		fmt.Printf("draft model %s, --draft-p-min %g\n\n", cfg.ModelDraft, cfg.DraftPMinFor(engine.SpecDraftSimple))
	}
	fmt.Println("server       workload   N  off tok/s  on tok/s  on/off  range      drafted  accepted  accept%  tokens  same output")
	for _, n := range ns {
		c := cfg
		c.Parallel = n
		// Every agent's prompt and answer fit at once, twice over (the prefix cache keeps
		// the finished ones).
		c.NCtx = max(cfg.NCtx, 2*n*1600)
		a, srv, base, err := serveApp(c)
		if err != nil {
			return err
		}
		for _, w := range workloads {
			if err := sb.compare("polykv", base, base, w, n, reps); err != nil {
				srv.Close()
				a.Close()
				return err
			}
		}
		srv.Close()
		a.Close()
		if sb.llamaServer != "" {
			if err := sb.llama(c, workloads, n, reps); err != nil {
				return err
			}
		}
	}
	return nil
}

// llama runs the workloads on llama-server: one instance without speculation and one
// with --spec-type ngram-mod, as many slots as agents, the same context and threads.
// Each instance's log goes to a file; where a workload fails, the error names the
// files and quotes their last lines (an instance that drops a connection says why
// there, not in the HTTP error).
func (sb specBench) llama(c app.Config, workloads []string, n, reps int) error {
	// Room in a batch for every slot's sampled token and a full ngram-mod draft (its
	// n_max is 64): with less, b11434's llama-server aborts ("batch must be large
	// enough to hold the sampled and draft tokens", server-context.cpp) once all slots
	// draft at once — what ended its chat row at N = 8 on an EOF in earlier runs.
	nb := max(c.NBatch, n*(llamaNgramModMax+1))
	args := []string{"-m", c.ModelPath, "-c", strconv.Itoa(c.NCtx), "-np", strconv.Itoa(n), "-t", strconv.Itoa(c.Threads), "-b", strconv.Itoa(nb)}
	off, err := startLlamaServer(sb.llamaServer, args, "off")
	if err != nil {
		return err
	}
	defer off.stop()
	on, err := startLlamaServer(sb.llamaServer, append(args, "--spec-type", "ngram-mod"), "ngram-mod")
	if err != nil {
		return err
	}
	defer on.stop()
	for _, w := range workloads {
		if err := sb.compare("llama-server", off.base, on.base, w, n, reps); err != nil {
			// Stopped first: an instance flushes its log as it exits.
			off.stop()
			on.stop()
			return fmt.Errorf("%w\n%s\n%s", err, off.tail(), on.tail())
		}
	}
	return nil
}

// llamaNgramModMax is b11434's ngram-mod n_max default (common/arg.cpp).
const llamaNgramModMax = 64

// llamaServer is a running llama-server and the file its output goes to.
type llamaServer struct {
	cmd  *exec.Cmd
	base string
	log  *os.File
}

// tail names the server's log file and quotes its last lines.
func (l *llamaServer) tail() string {
	data, err := os.ReadFile(l.log.Name())
	if err != nil {
		return fmt.Sprintf("(log %s: %v)", l.log.Name(), err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return fmt.Sprintf("last lines of %s:\n%s", l.log.Name(), strings.Join(lines[max(len(lines)-8, 0):], "\n"))
}

// stop ends the server (once; later calls do nothing).
func (l *llamaServer) stop() {
	if l.cmd.ProcessState == nil {
		stopProcess(l.cmd)
	}
	l.log.Close()
}

// startLlamaServer starts bin with args on a free loopback port, its output in a
// temporary file named after name, and waits until its /health answers.
func startLlamaServer(bin string, args []string, name string) (*llamaServer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	log, err := os.CreateTemp("", "polykv-bench-llama-server-"+name+"-*.log")
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, append(args, "--host", "127.0.0.1", "--port", strconv.Itoa(port))...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, err
	}
	l := &llamaServer{cmd: cmd, base: fmt.Sprintf("http://127.0.0.1:%d", port), log: log}
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if resp, err := http.Get(l.base + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return l, nil
			}
		}
	}
	l.stop()
	return nil, fmt.Errorf("bench: %s did not become healthy; %s", bin, l.tail())
}

func stopProcess(cmd *exec.Cmd) {
	_ = cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// compare runs workload w with N agents reps times in each mode and prints one row: off
// on offBase (with speculative false), on on onBase (PolyKV: the same server;
// llama-server: a second instance with speculation). The modes alternate in ABBA order
// (off, on, on, off, ...), so neither always runs first; each round's prompts are new
// (specMessages) and both modes get the same ones. The row gives the median
// of the rounds' tok/s in each mode and the median of the per-round on/off ratios with
// their range (drafted and accepted: all the rounds' together; tokens: one round's):
// on a shared machine a single run swings by ±20%, and a round's two runs,
// back to back, see the most similar load.
func (sb specBench) compare(server, offBase, onBase, w string, n, reps int) error {
	var tps [2][]float64
	var ratios []float64
	var drafted, accepts int
	same, tokens := true, 0
	for rep := range reps {
		// Each round asks new questions (specMessages); an untimed one-token run of them
		// first fills the prefix caches, so neither mode pays a prefill the other does not.
		for _, base := range slices.Compact([]string{offBase, onBase}) {
			if _, err := sb.once(base, w, n, rep, true, 1); err != nil {
				return err
			}
		}
		var res [2]specResult
		order := []int{0, 1}
		if rep%2 == 1 {
			order = []int{1, 0}
		}
		for _, m := range order {
			base := offBase
			if m == 1 {
				base = onBase
			}
			r, err := sb.once(base, w, n, rep, m == 1, 0)
			if err != nil {
				return err
			}
			res[m] = r
			tps[m] = append(tps[m], r.decodeTPS())
		}
		if res[0].decodeTPS() > 0 {
			ratios = append(ratios, res[1].decodeTPS()/res[0].decodeTPS())
		}
		for i := range res[0].texts {
			same = same && res[0].texts[i] == res[1].texts[i]
		}
		tokens = res[1].predicted
		drafted += res[1].drafted
		accepts += res[1].accepts
	}
	acc := 0.0
	if drafted > 0 {
		acc = 100 * float64(accepts) / float64(drafted)
	}
	slices.Sort(ratios)
	lo, hi := 0.0, 0.0
	if len(ratios) > 0 {
		lo, hi = ratios[0], ratios[len(ratios)-1]
	}
	fmt.Printf("%-12s %-8s %3d  %9.1f  %8.1f  %6.2f  %4.2f-%4.2f  %7d  %8d  %6.1f%%  %6d  %v\n", server, w, n, median(tps[0]), median(tps[1]), median(ratios),
		lo, hi, drafted, accepts, acc, tokens, same)
	return nil
}

// median of xs (0 for none); xs is not changed.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// once runs round rep of workload w: N agents at once, greedy, with speculation on or
// off; maxTokens 0 is the workload's own length.
func (sb specBench) once(base, w string, n, rep int, on bool, maxTokens int) (specResult, error) {
	if maxTokens == 0 {
		maxTokens = sb.chatGen
		if w == "edit" {
			maxTokens = 900 // past the end of the document: the model stops at its end
		}
	}
	type reply struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Timings struct {
			PredictedN     int     `json:"predicted_n"`
			PredictedMs    float64 `json:"predicted_ms"`
			DraftN         int     `json:"draft_n"`
			DraftNAccepted int     `json:"draft_n_accepted"`
		} `json:"timings"`
	}
	out := make([]reply, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := map[string]any{"messages": specMessages(w, rep*n+i), "max_tokens": maxTokens, "temperature": 0, "speculative": on}
			errs[i] = postInto(base+"/v1/chat/completions", body, &out[i])
		}()
	}
	wg.Wait()
	var r specResult
	for i := range n {
		if errs[i] != nil {
			return r, errs[i]
		}
		tm := out[i].Timings
		if len(out[i].Choices) > 0 {
			r.texts = append(r.texts, out[i].Choices[0].Message.Content)
		}
		r.predicted += tm.PredictedN
		r.span = max(r.span, time.Duration(tm.PredictedMs*float64(time.Millisecond)))
		r.drafted += tm.DraftN
		r.accepts += tm.DraftNAccepted
	}
	return r, nil
}

// stepCost prints --spec-step-cost as the engine applies it.
func stepCost(v float64) string {
	switch {
	case v == 0:
		return fmt.Sprintf("%g (default)", engine.DefaultStepCost)
	case v < 0:
		return fmt.Sprintf("%g (no limit)", v)
	}
	return fmt.Sprintf("%g", v)
}
