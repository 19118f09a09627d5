package bench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/llama"
)

// fanout is the multi-agent workload: a root prefix shared by N agents, each adding its
// own suffix and decoding. It runs once with the prefix as a pool the agents attach to,
// once with every agent prefilling the whole prompt itself (automatic prefix reuse off:
// the cost without sharing; plain-fanout compares reuse with the pool), in the same
// process.
type fanout struct {
	root, suffix, gen int
}

type fanoutResult struct {
	wall      time.Duration // from the first request (pool creation included) to the last token
	ttftMean  time.Duration // mean time to first token of the agents
	cells     int           // KV cells in use once every agent has finished (sessions keep theirs)
	poolBuild time.Duration
}

func (f fanout) run(cfg app.Config, agents string) error {
	var ns []int
	for _, a := range strings.Split(agents, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(a))
		if err != nil || n < 1 || n > 64 {
			return fmt.Errorf("bench: bad agent count %q", a)
		}
		ns = append(ns, n)
	}
	root, suffixes, err := f.prompts(cfg.ModelPath, ns)
	if err != nil {
		return err
	}
	fmt.Printf("fan-out: root prefix %d tokens, each agent +%d tokens and %d decoded; pooled vs unpooled (--prefix-cache off), otherwise the same server settings\n\n", f.root, f.suffix, f.gen)
	fmt.Println("   N  TTFT pooled ms  TTFT unpooled ms  TTFT ratio  cells pooled  cells unpooled  cells ratio  wall pooled s  wall unpooled s  wall ratio")
	for _, n := range ns {
		c := cfg
		c.Parallel = n
		c.MaxPools = 2
		c.NCtx = n*(f.root+f.suffix+f.gen) + 256
		c.NBatch = max(c.NBatch, n)
		pooled, err := f.once(c, root, suffixes[:n], true)
		if err != nil {
			return err
		}
		unpooled, err := f.once(c, root, suffixes[:n], false)
		if err != nil {
			return err
		}
		fmt.Printf("%4d  %14.0f  %16.0f  %10.3f  %12d  %14d  %11.3f  %13.1f  %15.1f  %10.3f\n", n,
			ms(pooled.ttftMean), ms(unpooled.ttftMean), ms(pooled.ttftMean)/ms(unpooled.ttftMean),
			pooled.cells, unpooled.cells, float64(pooled.cells)/float64(unpooled.cells),
			pooled.wall.Seconds(), unpooled.wall.Seconds(), pooled.wall.Seconds()/unpooled.wall.Seconds())
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// prompts builds an exact-length root prefix and one exact-length suffix per agent.
func (f fanout) prompts(path string, ns []int) ([]int32, [][]int32, error) {
	m, err := llama.LoadModel(path)
	if err != nil {
		return nil, nil, err
	}
	defer m.Free()
	var b strings.Builder
	b.WriteString("You are the lead agent. Tools available:\n")
	var root []int32
	for i := 0; len(root) < f.root; i++ {
		fmt.Fprintf(&b, "Tool %d: lookup_%d(key: string) -> record; use it for questions about area %d.\n", i, i, i*13)
		if root, err = m.Tokenize(b.String(), true, true); err != nil {
			return nil, nil, err
		}
	}
	root = root[:f.root]
	maxN := 0
	for _, n := range ns {
		maxN = max(maxN, n)
	}
	suffixes := make([][]int32, maxN)
	for i := range suffixes {
		var sb strings.Builder
		var toks []int32
		for j := 0; len(toks) < f.suffix; j++ {
			fmt.Fprintf(&sb, " Sub-agent %d, step %d: check record %d and report.", i, j, i*100+j)
			if toks, err = m.Tokenize(sb.String(), false, true); err != nil {
				return nil, nil, err
			}
		}
		suffixes[i] = toks[:f.suffix]
	}
	return root, suffixes, nil
}

func (f fanout) once(cfg app.Config, root []int32, suffixes [][]int32, pooled bool) (fanoutResult, error) {
	var res fanoutResult
	if !pooled {
		cfg.PrefixCache = "off"
	}
	a, srv, base, err := serveApp(cfg)
	if err != nil {
		return res, err
	}
	defer a.Close()
	defer srv.Close()
	start := time.Now()
	poolID := 0
	if pooled {
		out, err := postJSON(base+"/polykv/pools", map[string]any{"tokens": root})
		if err != nil {
			return res, err
		}
		poolID = int(out["pool_id"].(float64))
		res.poolBuild = time.Since(start)
	}
	var wg sync.WaitGroup
	ttft := make([]time.Duration, len(suffixes))
	errs := make([]error, len(suffixes))
	for i, suf := range suffixes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			prompt := append(append([]int32{}, root...), suf...)
			body := map[string]any{"prompt": prompt, "max_tokens": f.gen, "temperature": 0, "ignore_eos": true,
				"stream": true, "session_id": fmt.Sprintf("agent-%d", i)}
			if pooled {
				body["pool_id"] = poolID
			}
			ttft[i], errs[i] = streamTTFT(base+"/v1/completions", body)
		}()
	}
	wg.Wait()
	res.wall = time.Since(start)
	var sum time.Duration
	for i := range suffixes {
		if errs[i] != nil {
			return res, errs[i]
		}
		sum += ttft[i]
	}
	res.ttftMean = sum / time.Duration(len(suffixes))
	props, err := getJSON(base + "/props")
	if err != nil {
		return res, err
	}
	res.cells = int(props["usage"].(map[string]any)["kv_cells_used"].(float64))
	return res, nil
}

// streamTTFT sends a streaming completion, returns when it ends, and reports when the
// first token arrived.
func streamTTFT(url string, body any) (time.Duration, error) {
	buf, _ := json.Marshal(body)
	t0 := time.Now()
	resp, err := http.Post(url, "application/json", bytes.NewReader(buf))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		raw, _ := io.ReadAll(resp.Body)
		return 0, fmt.Errorf("bench request: %d %s", resp.StatusCode, raw)
	}
	var first time.Duration
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if first == 0 && strings.HasPrefix(sc.Text(), "data: {") {
			first = time.Since(t0)
		}
	}
	return first, sc.Err()
}

func postJSON(url string, body any) (map[string]any, error) {
	buf, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(buf))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, err
	}
	if resp.StatusCode >= 300 {
		return nil, fmt.Errorf("%s: %d %v", url, resp.StatusCode, out)
	}
	return out, nil
}

func getJSON(url string) (map[string]any, error) {
	resp, err := http.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var out map[string]any
	return out, json.NewDecoder(resp.Body).Decode(&out)
}
