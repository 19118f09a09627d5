package app

// A fleet of three replicas on loopback addresses, as llm-d's router sees them: KV
// events over ZMQ, render endpoints, pool keys, x-session-id and protocol metrics.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/kvevents"
)

type replica struct {
	ip, base, zmq string
	app           *App
	srv           *httptest.Server
	sub           *subscriber
	view          *routerView
}

// routerView is one replica's blocks as llm-d's event pool indexes them
// (llm-d-router pkg/kvevents/pool.go): a BlockStored must name a parent already held
// (the router drops it otherwise), its keys are recomputed from its tokens, chained from
// the parent or the model's init hash, and each hash is counted, removed at zero.
type routerView struct {
	topic string
	model string
	late  bool   // joined mid-stream: the first message sets seq
	seq   uint64 // the next sequence number expected
	index map[uint64]int
	// tier counts the blocks announced with the tier's medium (issue 44: what the
	// replica's tier below the cache holds, scored below cells); index the cells'.
	tier map[uint64]int
}

// medium is the count an event's medium goes to.
func (v *routerView) medium(ev kvevents.Event) map[uint64]int {
	if ev.Medium != kvevents.MediumTier {
		return v.index
	}
	if v.tier == nil {
		v.tier = map[uint64]int{}
	}
	return v.tier
}

// apply checks and applies one message.
func (v *routerView) apply(t *testing.T, m kvevents.Message) {
	t.Helper()
	if m.Topic != v.topic {
		t.Fatalf("topic %q, want %q", m.Topic, v.topic)
	}
	if v.late {
		v.seq, v.late = m.Seq, false
	}
	if m.Seq != v.seq {
		t.Fatalf("sequence number %d, want %d (consecutive from 0)", m.Seq, v.seq)
	}
	v.seq++
	for _, ev := range m.Events {
		switch ev.Tag {
		case kvevents.TagAllBlocksCleared:
			v.index, v.tier = map[uint64]int{}, map[uint64]int{}
		case kvevents.TagBlockRemoved:
			idx := v.medium(ev)
			for _, h := range ev.Hashes {
				if idx[h]--; idx[h] <= 0 {
					delete(idx, h)
				}
			}
		case kvevents.TagBlockStored:
			parent := kvevents.InitHash("", v.model)
			if ev.Parent != nil {
				parent = *ev.Parent
				if v.index[parent] == 0 && v.tier[parent] == 0 {
					t.Fatalf("BlockStored with a parent %#x never announced: the router would drop it", parent)
				}
			}
			if ev.BlockSize != 16 || len(ev.Tokens) != len(ev.Hashes)*16 {
				t.Fatalf("BlockStored breaks the full-block rule: %d hashes, %d tokens, block size %d", len(ev.Hashes), len(ev.Tokens), ev.BlockSize)
			}
			if keys := kvevents.BlockHashes(parent, ev.Tokens, 16); !slices.Equal(keys, ev.Hashes) {
				t.Fatalf("announced %#x, the router's keys for those tokens are %#x", ev.Hashes, keys)
			}
			idx := v.medium(ev)
			for _, h := range ev.Hashes {
				idx[h]++
			}
		}
	}
}

// holds is how many leading full blocks of tokens the router finds in this replica's
// cells.
func (v *routerView) holds(tokens []int32) int { return v.count(v.index, tokens) }

// tierHolds is how many leading full blocks of tokens the router finds in this
// replica's tier.
func (v *routerView) tierHolds(tokens []int32) int { return v.count(v.tier, tokens) }

func (v *routerView) count(idx map[uint64]int, tokens []int32) int {
	n := 0
	for _, h := range kvevents.BlockHashes(kvevents.InitHash("", v.model), tokens, 16) {
		if idx[h] == 0 {
			break
		}
		n++
	}
	return n
}

// await applies r's events until cond holds (failing after 20 s without one).
func (r *replica) await(t *testing.T, what string, cond func(v *routerView) bool) {
	t.Helper()
	for !cond(r.view) {
		select {
		case m := <-r.sub.msgs:
			r.view.apply(t, m)
		case err := <-r.sub.errs:
			t.Fatalf("%s: kv events do not decode: %v", r.ip, err)
		case <-time.After(20 * time.Second):
			t.Fatalf("%s: %s: not seen within 20 s (router view holds %d blocks)", r.ip, what, len(r.view.index))
		}
	}
}

// drain applies what has arrived, waiting until nothing comes for 300 ms.
func (r *replica) drain(t *testing.T) {
	t.Helper()
	for {
		select {
		case m := <-r.sub.msgs:
			r.view.apply(t, m)
		case <-time.After(300 * time.Millisecond):
			return
		}
	}
}

// subscriber receives one replica's KV events, decoded as llm-d decodes them.
type subscriber struct {
	cancel context.CancelFunc
	msgs   chan kvevents.Message
	errs   chan error
}

func subscribe(t *testing.T, endpoint string) *subscriber {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sock := zmq4.NewSub(ctx)
	if err := sock.Dial(endpoint); err != nil {
		cancel()
		t.Fatalf("dial %s: %v", endpoint, err)
	}
	if err := sock.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	s := &subscriber{cancel: cancel, msgs: make(chan kvevents.Message, 256), errs: make(chan error, 1)}
	go func() {
		defer sock.Close()
		for {
			msg, err := sock.Recv()
			if err != nil {
				return // cancelled
			}
			m, err := kvevents.Decode(msg.Frames)
			if err != nil {
				s.errs <- err
				return
			}
			s.msgs <- m
		}
	}()
	t.Cleanup(cancel)
	return s
}

func startReplica(t *testing.T, ip, zmqEndpoint string) *replica {
	t.Helper()
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Skipf("cannot listen on %s (loopback aliases are Linux's 127.0.0.0/8): %v", ip, err)
	}
	if zmqEndpoint == "" {
		zmqEndpoint = "tcp://" + ip + ":0"
	}
	// One thread each: three engines share the cores, and ggml spins at its barriers.
	cfg := Config{ModelPath: modelPath(t), NCtx: 1024, Parallel: 2, MaxPools: 4, PoolGrace: time.Nanosecond, Threads: 1,
		KVEventsEndpoint: zmqEndpoint, KVEventsPodID: ln.Addr().String()}
	a, err := Open(withDefaults(cfg), nil)
	if err != nil {
		ln.Close()
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(a.API.Handler())
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	r := &replica{ip: ip, base: srv.URL, zmq: "tcp://" + a.KVEvents.Addr(), app: a, srv: srv,
		view: &routerView{topic: "kv@" + ln.Addr().String() + "@SmolLM2-135M-Instruct.Q4_1", model: "SmolLM2-135M-Instruct.Q4_1", index: map[uint64]int{}}}
	r.sub = subscribe(t, r.zmq)
	t.Cleanup(r.stop)
	return r
}

func (r *replica) stop() {
	if r.srv != nil {
		r.srv.Close()
		r.app.Close()
		r.srv = nil
	}
}

func postHeaders(t *testing.T, url string, body any, hdr map[string]string) (int, http.Header, map[string]any) {
	t.Helper()
	buf, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(string(buf)))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("%s: %d %q", url, resp.StatusCode, raw)
	}
	return resp.StatusCode, resp.Header, out
}

func tokenIDs(t *testing.T, out map[string]any) []int32 {
	t.Helper()
	raw, ok := out["token_ids"].([]any)
	if !ok {
		t.Fatalf("no token_ids in %v", out)
	}
	ids := make([]int32, len(raw))
	for i, v := range raw {
		ids[i] = int32(v.(float64))
	}
	return ids
}

func TestFleetKVEventsRenderAndPoolKeys(t *testing.T) {
	ips := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	var reps []*replica
	for _, ip := range ips {
		reps = append(reps, startReplica(t, ip, ""))
	}
	a, b, c := reps[0], reps[1], reps[2]
	// Every replica starts its stream with AllBlocksCleared at sequence 0.
	for _, r := range reps {
		r.await(t, "the first snapshot", func(v *routerView) bool { return v.seq > 0 })
	}

	system := longSystem(t, a.app, 100)
	chatBody := map[string]any{"messages": []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": "Which tool finds documents about topic 14?"}},
		"max_tokens": 8, "temperature": 0}
	// Render: the chat request's prompt tokens, the same on every replica.
	code, _, out := postHeaders(t, a.base+"/v1/chat/completions/render", chatBody, nil)
	if code != 200 {
		t.Fatalf("render: %d %v", code, out)
	}
	rendered := tokenIDs(t, out)
	_, _, outC := postHeaders(t, c.base+"/v1/chat/completions/render", chatBody, nil)
	if !slices.Equal(tokenIDs(t, outC), rendered) {
		t.Fatal("render differs between replicas")
	}
	// Text render equals /tokenize with special tokens (what /v1/completions prefills).
	// It is an array with one entry per prompt, as vLLM's (what llm-d decodes).
	buf, _ := json.Marshal(map[string]any{"prompt": "Hello fleet", "model": "any"})
	resp, err := http.Post(a.base+"/v1/completions/render", "application/json", strings.NewReader(string(buf)))
	if err != nil {
		t.Fatal(err)
	}
	var outT []map[string]any
	err = json.NewDecoder(resp.Body).Decode(&outT)
	resp.Body.Close()
	if err != nil || len(outT) != 1 {
		t.Fatalf("completions render: %v, %d entries; want an array of one", err, len(outT))
	}
	if want := tokenize(t, a.app, "Hello fleet"); !slices.Equal(tokenIDs(t, outT[0]), want) {
		t.Fatalf("completions render %v, want %v", tokenIDs(t, outT[0]), want)
	}

	// A pool on A over the chat's system block: the router then finds the rendered
	// prompt's leading full blocks on A, under its own keys.
	created := createPool(t, a.base, map[string]any{"messages": []map[string]any{{"role": "system", "content": system}}})
	poolA := num(created["pool_id"])
	var info wire.PoolInfo
	get(t, fmt.Sprintf("%s/polykv/pools/%d", a.base, poolA), &info)
	L := len(info.Tokens)
	if L < 32 || !slices.Equal(rendered[:L], info.Tokens) {
		t.Fatalf("pool prefix (%d tokens) is not a prefix of the rendered chat", L)
	}
	a.await(t, "the pool's blocks", func(v *routerView) bool { return v.holds(rendered) == L/16 })
	// A child extending the pool: its own blocks chain to the root's (the view checks
	// every parent was announced before).
	childToks := append(slices.Clone(info.Tokens), suffixTokens(t, a.app, " The user asks about search tools and rankings, in detail, with examples.")...)
	code, fork := forkPool(t, a.base, poolA, L, map[string]any{"tokens": childToks})
	if code != 201 {
		t.Fatalf("fork: %d %v", code, fork)
	}
	if len(childToks)/16 <= L/16 {
		t.Fatalf("the child (%d tokens) must own a full block past the root's %d", len(childToks), L)
	}
	a.await(t, "the child's blocks", func(v *routerView) bool { return v.holds(childToks) == len(childToks)/16 })

	// A plain request on C, no pool anywhere: its prompt stays as prefix cache and the
	// router finds it there (issue 27: cached sequences are announced, not only pools).
	codeC0, _, outC0 := postHeaders(t, c.base+"/v1/chat/completions", chatBody, nil)
	if codeC0 != 200 {
		t.Fatalf("plain request on C: %d %v", codeC0, outC0)
	}
	c.await(t, "the cached request's blocks", func(v *routerView) bool { return v.holds(rendered) == len(rendered)/16 })
	b.drain(t)
	if n := b.view.holds(rendered); n != 0 {
		t.Fatalf("B served nothing but the router finds %d blocks there", n)
	}

	// The same system block as a pool on B announces the same keys: a fleet-wide name.
	createdB := createPool(t, b.base, map[string]any{"messages": []map[string]any{{"role": "system", "content": system}}})
	if createdB["prefix_hash"] != created["prefix_hash"] {
		t.Fatalf("prefix_hash differs across replicas: %v vs %v", createdB["prefix_hash"], created["prefix_hash"])
	}
	b.await(t, "B's pool blocks", func(v *routerView) bool { return v.holds(rendered) == L/16 })

	// pool_key with x-session-id: A attaches, C (no such pool) borrows its cached prefix
	// and answers the same greedy tokens.
	key := created["prefix_hash"].(string)
	keyed := withFields(chatBody, map[string]any{"pool_key": key})
	codeA, hA, outA := postHeaders(t, a.base+"/v1/chat/completions", keyed, map[string]string{"x-session-id": "agent-7"})
	codeC, hC, outC2 := postHeaders(t, c.base+"/v1/chat/completions", keyed, map[string]string{"x-session-id": "agent-7"})
	if codeA != 200 || codeC != 200 {
		t.Fatalf("pool_key requests: A %d %v, C %d %v", codeA, outA, codeC, outC2)
	}
	if got, _ := strconv.Atoi(hA.Get("X-Cached-Prefix-Tokens")); got != L || hA.Get("X-Pool-Id") != strconv.Itoa(poolA) {
		t.Fatalf("A: X-Cached-Prefix-Tokens %q, X-Pool-Id %q; want %d from pool %d", hA.Get("X-Cached-Prefix-Tokens"), hA.Get("X-Pool-Id"), L, poolA)
	}
	if hC.Get("X-Pool-Id") != "" {
		t.Fatalf("C lacks the pool: X-Pool-Id %q; want none", hC.Get("X-Pool-Id"))
	}
	msg := func(o map[string]any) string {
		return o["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	}
	if msg(outA) != msg(outC2) {
		t.Fatalf("pooled reply %q differs from the unpooled one %q", msg(outA), msg(outC2))
	}
	if outA["session_id"] != "agent-7" || outC2["session_id"] != "agent-7" {
		t.Fatalf("x-session-id not used as the session: %v / %v", outA["session_id"], outC2["session_id"])
	}
	// A second turn of the session on C reuses its own cells.
	_, hC2, _ := postHeaders(t, c.base+"/v1/chat/completions", keyed, map[string]string{"x-session-id": "agent-7"})
	if n, _ := strconv.Atoi(hC2.Get("X-Cached-Prefix-Tokens")); n < len(rendered)-1 {
		t.Fatalf("second turn of agent-7 on C reused %d tokens, want at least %d", n, len(rendered)-1)
	}
	// Streamed, what was reused follows the body as a trailer.
	buf, _ = json.Marshal(withFields(keyed, map[string]any{"stream": true}))
	resp, err = http.Post(a.base+"/v1/chat/completions", "application/json", strings.NewReader(string(buf)))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if got := resp.Trailer.Get("X-Cached-Prefix-Tokens"); got != strconv.Itoa(L) {
		t.Fatalf("streamed X-Cached-Prefix-Tokens trailer %q, want %d", got, L)
	}
	if code, _, out := postHeaders(t, a.base+"/v1/chat/completions", withFields(keyed, map[string]any{"pool_id": poolA}), nil); code != 400 {
		t.Fatalf("pool_id with pool_key: %d %v, want 400", code, out)
	}

	// Evict B's pool: its blocks leave the router's view of B's cells (nothing else held
	// them) and are announced in B's tier, where the pool's KV went (issue 44: the
	// router scores them there, below cells).
	if code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/evict", b.base, num(createdB["pool_id"])), map[string]any{}); code != 200 {
		t.Fatalf("evict: %d %v", code, out)
	}
	b.await(t, "the evicted pool's removal from the cells", func(v *routerView) bool { return v.holds(rendered) == 0 })
	b.await(t, "the evicted pool in the tier", func(v *routerView) bool { return v.tierHolds(rendered) == L/16 })

	// A second router subscribing to A while the first listens gets the whole state.
	// Both then hold the same blocks: the first router got the snapshot too.
	late := &replica{ip: a.ip, sub: subscribe(t, a.zmq), view: &routerView{topic: a.view.topic, model: a.view.model, late: true, index: map[uint64]int{}}}
	late.await(t, "the late subscriber's snapshot", func(v *routerView) bool { return v.holds(childToks) == len(childToks)/16 })
	a.await(t, "the snapshot, again", func(v *routerView) bool { return v.seq == late.view.seq })
	if !maps.Equal(a.view.index, late.view.index) || !maps.Equal(a.view.tier, late.view.tier) {
		t.Fatalf("the first router holds %d blocks of A, the late one %d", len(a.view.index), len(late.view.index))
	}

	// Restart C on the same endpoint: a new stream from sequence 0, AllBlocksCleared
	// first (the router forgets the old run's blocks).
	zmqC := c.zmq
	c.stop()
	c2 := startReplica(t, "127.0.0.4", zmqC)
	c2.await(t, "the restarted replica's snapshot", func(v *routerView) bool { return v.seq > 0 })
	if n := c2.view.holds(rendered); n != 0 {
		t.Fatalf("a fresh replica announces %d blocks", n)
	}

	// Protocol metrics parse with Prometheus' parser, under the names the shipped
	// engineConfigs name.
	a.drain(t)
	checkProtocolMetrics(t, a.base, a.view.seq, 2)
}

// withFields returns a copy of base with extra set.
func withFields(base, extra map[string]any) map[string]any {
	out := map[string]any{}
	for k, v := range base {
		out[k] = v
	}
	for k, v := range extra {
		out[k] = v
	}
	return out
}

func checkProtocolMetrics(t *testing.T, base string, received uint64, snapshots float64) {
	t.Helper()
	families := scrapeMetrics(t, base)
	cfgYAML, err := os.ReadFile("../../deploy/engine-configs.yaml")
	if err != nil {
		t.Fatal(err)
	}
	specs := regexp.MustCompile(`(\w+Spec): "([^"]+)"`).FindAllStringSubmatch(string(cfgYAML), -1)
	if len(specs) != 4 {
		t.Fatalf("deploy/engine-configs.yaml: %d specs, want 4", len(specs))
	}
	for _, s := range specs {
		f := families[s[2]]
		if f == nil || len(f.GetMetric()) != 1 || f.GetType().String() != "GAUGE" {
			t.Fatalf("%s names %s, which /metrics does not carry as one gauge: %v", s[1], s[2], f)
		}
	}
	usage := families["polykv_kv_usage_ratio"].GetMetric()[0].GetGauge().GetValue()
	if usage <= 0 || usage > 1 {
		t.Fatalf("kv usage %g, want a fraction in (0, 1] with a pool resident", usage)
	}
	counter := func(name string) float64 {
		f := families[name]
		if f == nil || len(f.GetMetric()) != 1 {
			t.Fatalf("%s missing", name)
		}
		return f.GetMetric()[0].GetCounter().GetValue()
	}
	if sent := counter("polykv_kv_events_messages_total"); sent != float64(received) {
		t.Fatalf("polykv_kv_events_messages_total %g, the subscriber received %d", sent, received)
	}
	if counter("polykv_kv_events_snapshots_total") != snapshots || counter("polykv_kv_events_dropped_total") != 0 {
		t.Fatalf("snapshots %g, dropped %g; want %g (one a subscriber) and none", counter("polykv_kv_events_snapshots_total"), counter("polykv_kv_events_dropped_total"), snapshots)
	}
	labels := map[string]string{}
	for _, l := range families["polykv_cache_config_info"].GetMetric()[0].GetLabel() {
		labels[l.GetName()] = l.GetValue()
	}
	if labels["block_size"] != "16" || labels["num_gpu_blocks"] != "64" {
		t.Fatalf("cache config info %v, want block_size 16 and num_gpu_blocks 1024/16 = 64", labels)
	}
}
