package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/app"
)

// ramp is the spawn-ramp workload: a new agent asks to join a pool every interval and
// decodes gen tokens; the floor is a fraction of one session's speed. It runs with
// admission off (everyone joins), advisory (the agent asks /capacity first) and
// enforced (the server answers 429), and reports how long the mean experienced tps of
// the active sessions spent under the floor.
type ramp struct {
	agents   int
	interval time.Duration
	gen      int
	floorFr  float64
}

type rampResult struct {
	underFloor time.Duration
	dip        float64
	admitted   int
	refused    int
	wall       time.Duration
}

func (rp ramp) run(cfg app.Config) error {
	c := cfg
	c.Parallel = rp.agents + 1
	c.MaxPools = 2
	single, err := rp.calibrate(c)
	if err != nil {
		return err
	}
	floor := rp.floorFr * single
	fmt.Printf("spawn ramp: %d agents asking every %s, %d tokens each; one session alone: %.1f tok/s, floor %.1f tok/s (%.0f%%)\n",
		rp.agents, rp.interval, rp.gen, single, floor, rp.floorFr*100)
	fmt.Println("  admission  under floor s  deepest dip tok/s  admitted  refused  wall s")
	for _, mode := range []string{"off", "advisory", "enforced"} {
		r, err := rp.once(c, mode, floor)
		if err != nil {
			return err
		}
		fmt.Printf("  %9s  %13.1f  %17.1f  %8d  %7d  %6.1f\n", mode, r.underFloor.Seconds(), r.dip, r.admitted, r.refused, r.wall.Seconds())
	}
	return nil
}

type rampServer struct {
	a    *app.App
	srv  *http.Server
	base string
	pool int
	root []int32
}

func startRamp(cfg app.Config) (*rampServer, error) {
	a, srv, base, err := serveApp(cfg)
	if err != nil {
		return nil, err
	}
	rs := &rampServer{a: a, srv: srv, base: base}
	out, err := postJSON(rs.base+"/polykv/pools", map[string]any{"prompt": "You are one of many worker agents. Work step by step and report briefly."})
	if err != nil {
		rs.close()
		return nil, err
	}
	rs.pool = int(out["pool_id"].(float64))
	info, err := getJSON(fmt.Sprintf("%s/polykv/pools/%d", rs.base, rs.pool))
	if err != nil {
		rs.close()
		return nil, err
	}
	for _, t := range info["tokens"].([]any) {
		rs.root = append(rs.root, int32(t.(float64)))
	}
	return rs, nil
}

func (rs *rampServer) close() {
	rs.srv.Close()
	rs.a.Close()
}

func (rs *rampServer) agent(i, gen int) (int, error) {
	prompt := append(append([]int32{}, rs.root...), int32(1000+i))
	buf, _ := json.Marshal(map[string]any{"prompt": prompt, "pool_id": rs.pool, "session_id": fmt.Sprintf("ramp-%d", i),
		"max_tokens": gen, "ignore_eos": true, "temperature": 0})
	resp, err := http.Post(rs.base+"/v1/completions", "application/json", bytesReader(buf))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, nil
}

// calibrate measures one session's decode speed on the pool.
func (rp ramp) calibrate(cfg app.Config) (float64, error) {
	rs, err := startRamp(cfg)
	if err != nil {
		return 0, err
	}
	defer rs.close()
	prompt := append(append([]int32{}, rs.root...), 7)
	out, err := postJSON(rs.base+"/v1/completions", map[string]any{"prompt": prompt, "pool_id": rs.pool, "max_tokens": rp.gen, "ignore_eos": true})
	if err != nil {
		return 0, err
	}
	return out["timings"].(map[string]any)["predicted_per_second"].(float64), nil
}

func (rp ramp) once(cfg app.Config, mode string, floor float64) (rampResult, error) {
	var res rampResult
	rs, err := startRamp(cfg)
	if err != nil {
		return res, err
	}
	defer rs.close()
	if mode != "off" {
		// Two guaranteed sessions let the server measure the real drop per admit; with one,
		// the conservative n/(n+1) model alone would refuse every second agent at a 60% floor.
		policy := map[string]any{"target_tps_per_session": floor, "mode": "advisory", "settle_tokens": 32, "settle_max_ms": 2000, "guarantee_min_sessions": 2}
		if mode == "enforced" {
			policy["mode"], policy["on_saturation"] = "enforced", "reject"
		}
		if _, err := postJSON(fmt.Sprintf("%s/polykv/pools/%d/admission", rs.base, rs.pool), policy); err != nil {
			return res, err
		}
	}
	start := time.Now()
	done := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Add(1)
	res.dip = math.Inf(1)
	go func() { // sample the mean experienced tps of the active sessions
		defer sampler.Done()
		const every = 200 * time.Millisecond
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			snap, err := getJSON(rs.base + "/polykv/tps?once=1")
			if err != nil {
				continue
			}
			if snap["n_active"].(float64) == 0 {
				continue
			}
			mean := snap["mean_active_tps"].(float64)
			res.dip = min(res.dip, mean)
			if mean < floor {
				res.underFloor += every
			}
		}
	}()
	var agents sync.WaitGroup
	var mu sync.Mutex
	for i := range rp.agents {
		if i > 0 {
			time.Sleep(rp.interval)
		}
		if mode == "advisory" {
			capRep, err := getJSON(fmt.Sprintf("%s/polykv/pools/%d/capacity", rs.base, rs.pool))
			if err == nil && capRep["can_admit"] != true {
				res.refused++
				continue
			}
		}
		agents.Add(1)
		go func() {
			defer agents.Done()
			code, err := rs.agent(i, rp.gen)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && code == 200:
				res.admitted++
			case err == nil && code == 429:
				res.refused++
			}
		}()
	}
	agents.Wait()
	close(done)
	sampler.Wait()
	res.wall = time.Since(start)
	if math.IsInf(res.dip, 1) {
		res.dip = 0
	}
	return res, nil
}

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }
