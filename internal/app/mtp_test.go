package app

// MTP drafting in the server (--spec-type draft-mtp; issue 23) on the qwen35 test model
// with one NextN block (scripts/qwen35mtp-testmodel.cpp): a hybrid target, so rejected
// drafts are rolled back through llama.cpp's recurrent snapshots, and an MTP context
// that mirrors every target decode and cell operation (runner.MTP). On the attention-only
// glm4moe one (scripts/glm4moemtp-testmodel.cpp) the prefix cache and the pool tier run
// beside it; the deepseek2 one (scripts/deepseek2mtp-testmodel.cpp) has multi-head latent
// attention, DeepSeek V3's.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/runner"
	"github.com/polykv/polykv/internal/testmodel"
)

// TestMTPServed: greedy and seeded output with MTP drafts equal the output without,
// cold and pooled, beside other traffic (one client pooled, one churning pools and
// cancelling its requests mid-answer); the head drafts, some drafts are accepted and
// some rejected; the MTP context's cells stay the target's after every operation, no
// entry is decoded without its hidden state, and nothing of a finished, cancelled or
// deleted one is left in it. On the hybrid qwen35 target, the MLA deepseek2 one and the
// sliding-window cohere2moe one (whose MTP context's cells need the target's SWA shadows:
// without them it lost positions out of the window and drafted about half as much).
//
// gemma4q (the Gemma 4 test model in Q4_1) drafts with its assistant
// (scripts/gemma4assistant-testmodel.cpp, a model file of its own that reads the target's
// cells: --model-draft), which has no cells to mirror.
func TestMTPServed(t *testing.T) {
	for _, model := range []string{"qwen35mtp", "deepseek2mtp", "cohere2moemtp", "gemma4q", "mimo2mtp"} {
		t.Run(model, func(t *testing.T) { testMTPServed(t, model) })
	}
}

// mtpConfig is a draft-mtp server's configuration on test model model: its own MTP
// layers, or for gemma4q its assistant (--model-draft).
func mtpConfig(t *testing.T, model string, cfg Config) Config {
	cfg.ModelPath, cfg.SpecType, cfg.DraftMax, cfg.SpecStepCost = testmodel.Arch(t, model), "draft-mtp", 3, -1
	if model == "gemma4q" {
		cfg.ModelDraft = testmodel.Arch(t, "gemma4assistant")
	}
	return cfg
}

func testMTPServed(t *testing.T, model string) {
	cfg := mtpConfig(t, model, Config{NCtx: 2048, Parallel: 4, MaxPools: 3, Threads: 2})
	a, base := startServer(t, cfg)
	mtp := mtpOf(a)
	if mtp == nil {
		t.Fatal("draft-mtp asked for, no MTP drafter")
	}
	nSeq := cfg.Parallel + cfg.MaxPools
	mtp.CheckMirror(nSeq)

	rootToks := archTokens(a, 1, 60)
	root := num(createPool(t, base, map[string]any{"tokens": rootToks})["pool_id"])

	stopTraffic := archTraffic(t, a, base, rootToks, root, 200, 24, nil)
	defer stopTraffic()
	stopChurn := mtpChurn(a, base)
	defer stopChurn()

	drafted, accepted := 0, 0
	for _, c := range []struct {
		name   string
		pool   int
		prompt []int32
		extra  map[string]any
	}{
		{"unpooled", 0, append(slices.Clone(rootToks), archTokens(a, 3, 9)...), nil},
		{"pooled", root, append(slices.Clone(rootToks), archTokens(a, 4, 9)...), nil},
		{"short", 0, archTokens(a, 6, 5), nil},
		{"seeded unpooled", 0, append(slices.Clone(rootToks), archTokens(a, 5, 9)...), map[string]any{"temperature": 0.7, "seed": 7}},
		{"seeded pooled", root, append(slices.Clone(rootToks), archTokens(a, 5, 9)...), map[string]any{"temperature": 0.7, "seed": 7}},
		// Longer than a window-sized SWA cache holds for all sequences (on cohere2moemtp,
		// 32 × 15 + 512 cells): the MTP context's SWA cache must be full-size, as the
		// target's, for its shadows to keep every position.
		{"long", 0, archTokens(a, 9, 1200), nil},
	} {
		run := func(spec bool) specRun {
			body := map[string]any{"prompt": c.prompt, "max_tokens": 40, "logprobs": 1, "ignore_eos": true,
				"temperature": 0, "speculative": spec}
			for k, v := range c.extra {
				body[k] = v
			}
			if c.pool > 0 {
				body["pool_id"] = c.pool
			} else {
				body["cache_prompt"] = false
			}
			return specCompletion(t, base, body)
		}
		off, on := run(false), run(true)
		if off.draftN != 0 {
			t.Errorf("%s: speculative false drafted %d tokens", c.name, off.draftN)
		}
		checkSpecSame(t, c.name, on, off)
		drafted += on.draftN
		accepted += on.accepted
		t.Logf("%s: drafted %d accepted %d, largest logprob difference %.2g", c.name, on.draftN, on.accepted, lpDiff(on, off))
	}
	stopTraffic()
	if n := stopChurn(); n == 0 {
		t.Error("the churning client never got a pool to cancel a request on")
	} else {
		t.Logf("churn: %d pools created, a request on each cancelled, deleted", n)
	}
	checkMTPRun(t, mtp, drafted, accepted)
	if n := mtp.NoRoom(); n > 0 {
		// The context has a cell per session beyond the scheduler's for the assistant's
		// entries (Open): without them the long prompt filled the cache and stopped its drafts.
		t.Errorf("%d draft decodes found the target's cache full", n)
	}
}

// TestMTPRefused: draft-mtp on a model without MTP layers (Gemma 4: told to give its
// assistant), beside a draft model, or with a --model-draft that is not an assistant for
// the served model, is refused at start with the reason; an assistant is refused as a
// draft-simple model.
func TestMTPRefused(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{ModelPath: testmodel.Arch(t, "qwen35"), SpecType: "draft-mtp"}, "no MTP (NextN) layers"},
		{Config{ModelPath: testmodel.Arch(t, "gemma4"), SpecType: "draft-mtp"}, "Gemma 4's MTP drafter is a separate assistant model (gemma-4-*-assistant); give it with --model-draft"},
		// An assistant for another architecture, a plain model as the assistant, an
		// assistant beside a model's own MTP layers, an assistant as a draft-simple model.
		{Config{ModelPath: testmodel.Arch(t, "qwen35"), SpecType: "draft-mtp", ModelDraft: testmodel.Arch(t, "gemma4assistant")}, "a gemma4-assistant assistant drafts for gemma4 models, not qwen35"},
		{Config{ModelPath: testmodel.Arch(t, "gemma4"), SpecType: "draft-mtp", ModelDraft: testmodel.Arch(t, "llama")}, "its architecture is llama, not an MTP assistant"},
		{Config{ModelPath: testmodel.Arch(t, "qwen35mtp"), SpecType: "draft-mtp", ModelDraft: testmodel.Arch(t, "gemma4assistant")}, "has MTP layers of its own"},
		{Config{ModelPath: testmodel.Arch(t, "gemma4"), SpecType: "draft-simple", ModelDraft: testmodel.Arch(t, "gemma4assistant")}, "run it with --spec-type draft-mtp --model-draft"},
		{Config{ModelPath: testmodel.Arch(t, "qwen35mtp"), SpecType: "draft-mtp,draft-simple", ModelDraft: testmodel.Arch(t, "llama")}, "cannot both run"},
	} {
		cfg := withDefaults(c.cfg)
		cfg.NCtx, cfg.Parallel, cfg.Threads = 512, 1, 2
		a, err := Open(cfg, nil)
		if err == nil {
			a.Close()
			t.Errorf("%s: started", cfg.SpecType)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", cfg.SpecType, err, c.want)
		}
	}
}

// TestMTPPrefixCacheAndTier: on an attention-only MTP model (glm4moemtp), where the
// prefix cache and the pool tier are on, MTP drafts keep the output of the same request
// without speculation fully prefilled, both for requests that start from part of an
// earlier request's cells (the prefix cache: a copy from the middle of a sequence, whose
// hidden-state row at the cut the mirror must still have) and for sessions of pools
// evicted to the tier (RAM and disk) and restored, a root and a child (whose parent's
// cells are shared back after the load), whose MTP cells and rows come back with the
// target's: such sessions are drafted for. The MTP context holds the target's positions
// after every operation and no entry is mirrored without its row. The hybrid qwen35mtp
// (prefix cache off) runs the tier part: its restore shares the parent's cells before
// the state is loaded. deepseek2mtp runs it all on multi-head latent attention,
// cohere2moemtp on sliding-window attention (the MTP part saved window by window), gemma4q
// with its assistant (no MTP part: the assistant reads the target's restored cells).
func TestMTPPrefixCacheAndTier(t *testing.T) {
	for _, c := range []struct {
		model, where string
		prefixCache  bool
	}{{"glm4moemtp", "ram", true}, {"glm4moemtp", "disk", true}, {"qwen35mtp", "ram", false}, {"deepseek2mtp", "disk", true}, {"cohere2moemtp", "disk", true}, {"gemma4q", "disk", true}, {"mimo2mtp", "disk", true}} {
		t.Run(c.model+"/"+c.where, func(t *testing.T) {
			where := c.where
			cfg := withDefaults(mtpConfig(t, c.model, Config{NCtx: 2048, Parallel: 4, MaxPools: 2, Threads: 2, PoolGrace: time.Nanosecond}))
			if where == "disk" {
				cfg.PoolRAMMB, cfg.PoolDir = 0, t.TempDir()
			}
			a, base := openServer(t, cfg)
			mtp := mtpOf(a)
			if mtp == nil {
				t.Fatal("draft-mtp asked for, no MTP drafter")
			}
			if props := tierProps(t, base); props == nil || !props.Enabled {
				t.Fatalf("tier props %+v, want the tier on", props)
			}
			mtp.CheckMirror(cfg.Parallel + cfg.MaxPools)
			drafted, accepted := 0, 0
			// run completes prompt with speculation (from whatever the prefix cache or pool
			// holds) and without it, cold, and checks both give the same output.
			run := func(name string, prompt []int32, pool, wantCacheN int) specRun {
				t.Helper()
				body := map[string]any{"prompt": prompt, "max_tokens": 32, "logprobs": 1, "ignore_eos": true, "temperature": 0}
				if pool > 0 {
					body["pool_id"] = pool
				}
				code, out := post(t, base+"/v1/completions", body)
				if code != 200 {
					t.Fatalf("%s: %d %v", name, code, out)
				}
				on := specFromJSON(out)
				if n := num(out["timings"].(map[string]any)["cache_n"]); n != wantCacheN {
					t.Errorf("%s: cache_n %d, want %d", name, n, wantCacheN)
				}
				off := specCompletion(t, base, map[string]any{"prompt": prompt, "max_tokens": 32, "logprobs": 1, "ignore_eos": true,
					"temperature": 0, "speculative": false, "cache_prompt": false})
				checkSpecSame(t, name, on, off)
				drafted += on.draftN
				accepted += on.accepted
				t.Logf("%s: drafted %d accepted %d (gaps so far %d)", name, on.draftN, on.accepted, mtp.Gaps())
				return on
			}
			// The prefix cache: the second request shares the first's first 40 tokens (a
			// copy from the middle of its sequence), the third extends the first whole.
			if c.prefixCache {
				first := append(archTokens(a, 1, 60), archTokens(a, 2, 8)...)
				run("cold", first, 0, 0)
				run("prefix of an earlier request", append(slices.Clone(first[:40]), archTokens(a, 3, 9)...), 0, 40)
				run("extends an earlier request", append(slices.Clone(first), archTokens(a, 4, 6)...), 0, len(first))
			}
			// The tier: a pool evicted before any session used it is restored from the tier
			// (no other sequence holds its cells), and its sessions draft.
			poolToks := archTokens(a, 5, 70)
			pool := num(createPool(t, base, map[string]any{"tokens": poolToks})["pool_id"])
			evict(t, base, pool)
			if info := poolEntry(t, base, pool); info.Residency != where {
				t.Fatalf("evicted pool: residency %q, want %s", info.Residency, where)
			}
			r := run("session of a restored pool", append(slices.Clone(poolToks), archTokens(a, 6, 9)...), pool, len(poolToks))
			if r.draftN == 0 {
				t.Errorf("no drafts for a session of a pool restored from the tier")
			}
			run("second session of the restored pool", append(slices.Clone(poolToks), archTokens(a, 7, 9)...), pool, len(poolToks))
			// A child of the restored pool, evicted before use: restored above its parent's
			// shared cells.
			childToks := append(slices.Clone(poolToks), archTokens(a, 8, 12)...)
			code, out := forkPool(t, base, pool, len(poolToks), map[string]any{"tokens": childToks})
			if code != 201 {
				t.Fatalf("fork: %d %v", code, out)
			}
			child := num(out["pool_id"])
			evict(t, base, child)
			r = run("session of a restored child", append(slices.Clone(childToks), archTokens(a, 10, 9)...), child, len(childToks))
			if r.draftN == 0 {
				t.Errorf("no drafts for a session of a child pool restored from the tier")
			}
			// Two pools restored (with an MTP assistant, whose cells are the target's,
			// cached requests' segments are spilled and loaded too: counted apart).
			if props := tierProps(t, base); props.Kinds["pool"].Restores != 2 || props.Restores[where] < 2 || len(props.Misses) != 0 {
				t.Errorf("tier counters %+v, want 2 pool restores from %s, no miss", props, where)
			}
			checkMTPRun(t, mtp, drafted, accepted)
		})
	}
}

// TestMTPSlotSaveRestore: llama-server's slot save and restore on a draft-mtp server
// (glm4moemtp: attention only, so a later request reuses the restored slot through the
// prefix cache). The slot file carries the MTP context's cells and rows with the
// target's, so after erase and restore into another slot the MTP context holds what
// the target holds (no mismatch: without the MTP part it held nothing there), and a
// request continuing the restored prompt is drafted for, with no gap, and answers what
// a cold prefill without speculation does. Then a pool's KV bytes: they count the MTP
// part of each cell too.
func TestMTPSlotSaveRestore(t *testing.T) {
	dir := t.TempDir()
	cfg := withDefaults(Config{ModelPath: testmodel.Arch(t, "glm4moemtp"), NCtx: 2048, Parallel: 2, MaxPools: 1,
		Threads: 2, SpecType: "draft-mtp", DraftMax: 3, SpecStepCost: -1, SlotSavePath: dir})
	a, base := openServer(t, cfg)
	mtp := mtpOf(a)
	mtp.CheckMirror(cfg.Parallel + cfg.MaxPools)
	toks := archTokens(a, 11, 70)
	if code, out := post(t, base+"/v1/completions", map[string]any{"prompt": toks, "max_tokens": 4, "session_id": "s",
		"temperature": 0, "ignore_eos": true}); code != 200 {
		t.Fatalf("session turn: %d %v", code, out)
	}
	src, held := sessionSlot(t, base, "s")
	if code, out := post(t, slotAction(base, src, "save"), map[string]any{"filename": "s.bin"}); code != 200 || num(out["n_saved"]) != held {
		t.Fatalf("save: %d %v (slot holds %d)", code, out, held)
	}
	if code, out := post(t, slotAction(base, src, "erase"), map[string]any{}); code != 200 {
		t.Fatalf("erase: %d %v", code, out)
	}
	dst := 1 - src
	if code, out := post(t, slotAction(base, dst, "restore"), map[string]any{"filename": "s.bin"}); code != 200 || num(out["n_restored"]) != held {
		t.Fatalf("restore: %d %v", code, out)
	}
	drafted, accepted := 0, 0
	for i := range 4 {
		prompt := append(slices.Clone(toks), archTokens(a, uint64(12+i), 9)...)
		code, out := post(t, base+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 32, "logprobs": 1,
			"ignore_eos": true, "temperature": 0})
		if code != 200 {
			t.Fatalf("from the restored slot: %d %v", code, out)
		}
		on := specFromJSON(out)
		if n := num(out["timings"].(map[string]any)["cache_n"]); n < len(toks) {
			t.Errorf("cache_n %d: the request did not start from the %d restored tokens", n, len(toks))
		}
		off := specCompletion(t, base, map[string]any{"prompt": prompt, "max_tokens": 32, "logprobs": 1, "ignore_eos": true,
			"temperature": 0, "speculative": false, "cache_prompt": false})
		checkSpecSame(t, "from the restored slot", on, off)
		drafted += on.draftN
		accepted += on.accepted
	}
	checkMTPRun(t, mtp, drafted, accepted)

	// A pool's KV bytes count the MTP context's cell and the row kept beside each of its
	// cells: 40 cells cost 40 × (the target's bytes per cell + the MTP part).
	mtpPerCell := a.draft.bytesPerCell
	if mtpPerCell <= 4*int64(a.Model.NEmbdOut()) {
		t.Fatalf("MTP bytes per cell %d: want the row (%d) and the MTP context's KV", mtpPerCell, 4*a.Model.NEmbdOut())
	}
	pool := num(createPool(t, base, map[string]any{"tokens": archTokens(a, 20, 40)})["pool_id"])
	want := 40 * (a.Model.KVBytesPerCellTyped("f16", "f16") + mtpPerCell)
	if got := poolEntry(t, base, pool).OwnKVBytes; got != want {
		t.Errorf("pool of 40 cells: own_kv_bytes %d, want %d (target %d + MTP %d per cell)", got, want, a.Model.KVBytesPerCellTyped("f16", "f16"), mtpPerCell)
	}
}

// TestMTPTierEntriesAcrossServers: pool tier entries written without MTP (a server not
// drafting) still restore on a draft-mtp server, whose sessions of that pool are then
// not drafted for (the MTP context has no cells for them) while others are, and
// entries written with the MTP part restore on a server without MTP; every attached
// request gives the output of the same prompt fully prefilled. The pools are pinned, so
// recorded on disk and recovered by the next server on the same --pool-dir.
func TestMTPTierEntriesAcrossServers(t *testing.T) {
	dir := t.TempDir()
	plain := Config{ModelPath: testmodel.Arch(t, "glm4moemtp"), NCtx: 1024, Parallel: 2, MaxPools: 4, Threads: 2, PoolDir: dir}
	mtpCfg := plain
	mtpCfg.SpecType, mtpCfg.DraftMax, mtpCfg.SpecStepCost = "draft-mtp", 3, -1
	// open serves cfg until the next open (or the test's end) and waits for the pools an
	// earlier server recorded to be back.
	closePrev := func() {}
	t.Cleanup(func() { closePrev() })
	open := func(cfg Config, want int) (*App, string) {
		t.Helper()
		closePrev()
		a, err := Open(withDefaults(cfg), nil)
		if err != nil {
			t.Fatal(err)
		}
		ts := httptest.NewServer(a.API.Handler())
		closePrev = func() { ts.Close(); a.Close() }
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			var st wire.PoolsStatus
			get(t, ts.URL+"/polykv/pools", &st)
			n := 0
			for _, p := range st.Pools {
				if p.Residency == "resident" {
					n++
				}
			}
			if n == want {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("recovered pools: %+v, want %d resident", st.Pools, want)
			}
		}
		return a, ts.URL
	}
	// attach completes poolToks+question on pool id and checks the output against the
	// same prompt prefilled cold; it returns the tokens drafted for it.
	attach := func(a *App, base, name string, id int, poolToks []int32) int {
		t.Helper()
		prompt := append(slices.Clone(poolToks), archTokens(a, 9, 7)...)
		on := specCompletion(t, base, map[string]any{"prompt": prompt, "pool_id": id, "max_tokens": 24, "logprobs": 1, "ignore_eos": true, "temperature": 0})
		off := specCompletion(t, base, map[string]any{"prompt": prompt, "max_tokens": 24, "logprobs": 1, "ignore_eos": true,
			"temperature": 0, "speculative": false, "cache_prompt": false})
		checkSpecSame(t, name, on, off)
		return on.draftN
	}

	a, base := open(plain, 0)
	oldToks := archTokens(a, 11, 50)
	oldPool := num(createPool(t, base, map[string]any{"tokens": oldToks, "pin": true})["pool_id"])

	a, base = open(mtpCfg, 1)
	if n := attach(a, base, "entry without MTP, draft-mtp server", oldPool, oldToks); n != 0 {
		t.Errorf("a pool restored without MTP cells: %d tokens drafted for its session, want none", n)
	}
	if n := specCompletion(t, base, map[string]any{"prompt": archTokens(a, 12, 30), "max_tokens": 24, "logprobs": 1, "ignore_eos": true,
		"temperature": 0, "cache_prompt": false}).draftN; n == 0 {
		t.Errorf("no drafts for a request without a pool beside it")
	}
	newToks := archTokens(a, 13, 50)
	newPool := num(createPool(t, base, map[string]any{"tokens": newToks, "pin": true})["pool_id"])

	a, base = open(mtpCfg, 2)
	if n := attach(a, base, "entry with MTP, draft-mtp server", newPool, newToks); n == 0 {
		t.Errorf("a pool recovered with its MTP cells: no drafts for its session")
	}
	a, base = open(plain, 2)
	attach(a, base, "entry with MTP, server without", newPool, newToks)
	attach(a, base, "entry without MTP, server without", oldPool, oldToks)
	if props := tierProps(t, base); len(props.Misses) != 0 {
		t.Errorf("tier misses %v, want none", props.Misses)
	}
}

// checkMTPRun checks what every MTP server test asks of a run: drafts both accepted and
// rejected, the MTP context's cells the target's after every mirrored operation, and no
// entry mirrored without the target's hidden state of the position before.
func checkMTPRun(t *testing.T, mtp *runner.MTP, drafted, accepted int) {
	t.Helper()
	t.Logf("MTP head: %d drafted, %d accepted; mirror decoded %d entries, %d gaps", drafted, accepted, mtp.Decoded(), mtp.Gaps())
	if drafted == 0 || accepted == 0 || accepted == drafted {
		t.Errorf("drafted %d tokens, %d accepted: want both accepted and rejected drafts", drafted, accepted)
	}
	if n, first := mtp.Mismatches(); n > 0 {
		t.Errorf("the MTP context's cells left the target's %d times; first %s", n, first)
	}
	if g := mtp.Gaps(); g > 0 {
		t.Errorf("%d entries mirrored without the target's hidden state of the position before", g)
	}
}

// mtpChurn runs a client until the function it returns is called (once; it returns the
// rounds done): each round creates a pool, streams a request on it that it cancels
// mid-answer, and deletes the pool. Errors (a pool refused while all ids are taken, a
// delete refused while the cancelled request still holds the pool) only skip a round.
func mtpChurn(a *App, base string) func() int {
	stop, done := make(chan struct{}), make(chan int)
	go func() {
		n := 0
		defer func() { done <- n }()
		do := func(req *http.Request) (int, []byte) {
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return 0, nil
			}
			defer resp.Body.Close()
			raw, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, raw
		}
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			poolToks := archTokens(a, uint64(500+i), 30)
			body, _ := json.Marshal(map[string]any{"tokens": poolToks})
			req, _ := http.NewRequest(http.MethodPost, base+"/polykv/pools", bytes.NewReader(body))
			code, raw := do(req)
			var out struct {
				PoolID int `json:"pool_id"`
			}
			if code != http.StatusCreated || json.Unmarshal(raw, &out) != nil {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			body, _ = json.Marshal(map[string]any{"prompt": append(poolToks, archTokens(a, uint64(600+i), 5)...),
				"pool_id": out.PoolID, "max_tokens": 200, "ignore_eos": true, "temperature": 0, "stream": true})
			ctx, cancel := context.WithTimeout(context.Background(), 40*time.Millisecond)
			req, _ = http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
			do(req)
			cancel()
			for range 20 {
				req, _ = http.NewRequest(http.MethodDelete, fmt.Sprintf("%s/polykv/pools/%d", base, out.PoolID), nil)
				if code, _ := do(req); code == 200 || code == 204 || code == 404 {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			n++
		}
	}()
	var n int
	var once sync.Once
	return func() int {
		once.Do(func() {
			close(stop)
			n = <-done
		})
		return n
	}
}

// TestDraftArchRefused: llama.cpp's draft heads that read the target's state (Gemma 4
// assistants, EAGLE3, DFlash) are refused as --model-draft with what they are; plain
// architectures pass. (No such model file is reachable here, so the check is tested on
// the architecture names the GGUF carries.)
func TestDraftArchRefused(t *testing.T) {
	for arch, want := range map[string]string{"gemma4-assistant": "Gemma 4 assistant", "eagle3": "architecture is eagle3, a draft head", "dflash": "architecture is dflash, a draft head"} {
		if err := draftArchRefused(arch); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error naming %q", arch, err, want)
		}
	}
	for _, arch := range []string{"llama", "qwen3", "gemma3", "gemma4"} {
		if err := draftArchRefused(arch); err != nil {
			t.Errorf("%s refused: %v", arch, err)
		}
	}
}

// mtpOf is a's MTP drafter (nil: none).
func mtpOf(a *App) *runner.MTP {
	if a.draft == nil {
		return nil
	}
	m, _ := a.draft.drafter.(*runner.MTP)
	return m
}
