package app

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/testmodel"
	"github.com/polykv/polykv/internal/tier"
)

// greedyLogprobs completes prompt tokens greedily, optionally attached to a pool, and
// returns the generated token ids, their logprobs and the cache_n the server reported.
// Without a pool it is a cold reference: the whole prompt is prefilled (cache_prompt
// false), never started from a prefix the prefix cache holds.
// checkRestored fails unless prefix+question answered from pool id (restored from the
// tier) reuses the whole prefix and gives the greedy tokens and logprobs of a cold
// prefill of the same prompt.
func checkRestored(t *testing.T, base, name string, id int, prefix, question []int32) {
	t.Helper()
	prompt := append(slices.Clone(prefix), question...)
	gotIDs, gotLP, cacheN := greedyLogprobs(t, base, prompt, id, 8)
	wantIDs, wantLP, _ := greedyLogprobs(t, base, prompt, 0, 8)
	if cacheN != len(prefix) || !slices.Equal(gotIDs, wantIDs) || !slices.Equal(gotLP, wantLP) {
		t.Fatalf("%s: cache_n %d (want %d); tokens %v logprobs %v, a cold prefill gives %v %v", name, cacheN, len(prefix), gotIDs, gotLP, wantIDs, wantLP)
	}
}

func greedyLogprobs(t testing.TB, base string, prompt []int32, poolID, n int) ([]int, []float64, int) {
	t.Helper()
	body := map[string]any{"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "ignore_eos": true, "cache_prompt": false}
	if poolID > 0 {
		body["pool_id"] = poolID
	}
	return completionLogprobs(t, base, body)
}

// completionLogprobs posts a completion that asks for logprobs and returns its token
// ids, their logprobs and cache_n.
func completionLogprobs(t testing.TB, base string, body map[string]any) ([]int, []float64, int) {
	t.Helper()
	code, out := post(t, base+"/v1/completions", body)
	if code != 200 {
		t.Fatalf("completion: %d %v", code, out)
	}
	lp := out["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)
	var ids []int
	var lps []float64
	for i, v := range lp["token_ids"].([]any) {
		ids = append(ids, num(v))
		lps = append(lps, lp["token_logprobs"].([]any)[i].(float64))
	}
	return ids, lps, num(out["timings"].(map[string]any)["cache_n"])
}

// evict evicts a pool and waits until the spill the eviction planned has run (the
// engine performs it before its next batch, after answering the command): with a tier
// the entry then says ram or disk.
func evict(t testing.TB, base string, id int) {
	t.Helper()
	code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/evict", base, id), map[string]any{})
	if code != 200 {
		t.Fatalf("evict %d: %d %v", id, code, out)
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if info := poolEntry(t, base, id); info.Residency != "evicted" || info.RestoreCost == nil {
			return // in the tier, or no tier at all
		}
	}
}

func poolEntry(t testing.TB, base string, id int) wire.PoolInfo {
	t.Helper()
	var info wire.PoolInfo
	if code := get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info); code != 200 {
		t.Fatalf("GET pool %d: %d", id, code)
	}
	return info
}

func tierProps(t testing.TB, base string) *wire.PoolTierProps {
	t.Helper()
	var props wire.Props
	get(t, base+"/props", &props)
	return props.PolyKV.PoolTier
}

// TestTierRestoreEqualsPrefill: greedy tokens and logprobs after a pool is evicted and
// restored from RAM or from disk equal a cold full prefill's, for a root, a child
// (whose own cells sit above its parent's shared ones) and a fork of a restored pool,
// with f16 and q8_0 caches. On Gemma 3 (sliding window) the root is longer than a
// window and a half, so its state takes two chunks and the branch forked below its last
// window needs SWA cells a single sequence state would have left out.
func TestTierRestoreEqualsPrefill(t *testing.T) {
	for _, ct := range []string{"f16", "q8_0"} {
		for _, where := range []string{"ram", "disk"} {
			t.Run(ct+"/"+where, func(t *testing.T) {
				// The prefix cache off: a cold reference's sequence must not stay behind as a
				// donor that makes the restore unnecessary (a seq_cp is preferred to a load).
				cfg := Config{NCtx: 2048, Parallel: 2, MaxPools: 4, CacheTypeK: ct, CacheTypeV: ct, PoolGrace: time.Nanosecond, PrefixCache: "off"}
				if where == "disk" {
					cfg.PoolRAMMB, cfg.PoolDir = 1, t.TempDir() // entries of several MB skip a 1 MiB RAM tier
				}
				forEachModel(t, cfg, func(t *testing.T, cfg Config) {
					checkRestoreEqualsPrefill(t, cfg, where)
				})
			})
		}
	}
}

func checkRestoreEqualsPrefill(t *testing.T, cfg Config, where string) {
	a, base := startServer(t, cfg)
	if props := tierProps(t, base); props == nil || !props.Enabled {
		t.Fatalf("tier props %+v, want enabled", props)
	}
	n := 150
	if w := a.Model.NSWA(); w > 0 {
		n = w + w/2 + 40
	}
	rootToks := tokenize(t, a, longSystem(t, a, n))
	question := suffixTokens(t, a, " Question: what should the team do first? Answer:")
	root := num(createPool(t, base, map[string]any{"tokens": rootToks})["pool_id"])
	check := func(name string, id int, prefix []int32) {
		t.Helper()
		checkRestored(t, base, name, id, prefix, question)
	}
	// Evict the root and restore it by attaching.
	evict(t, base, root)
	info := poolEntry(t, base, root)
	if info.Residency != where || info.RestoreCost == nil || info.RestoreCost.From != where || info.RestoreCost.Bytes <= 0 {
		t.Fatalf("evicted root: residency %q restore_cost %+v, want %s", info.Residency, info.RestoreCost, where)
	}
	check("root restored", root, rootToks)
	if info := poolEntry(t, base, root); info.Residency != "resident" {
		t.Fatalf("root after attach: %s", info.Residency)
	}
	// A child of the restored root, then the child evicted and restored: its own cells
	// come back above the root's shared ones.
	childToks := append(slices.Clone(rootToks), suffixTokens(t, a, " Task: summarise the findings on topic 14.")...)
	code, out := forkPool(t, base, root, len(rootToks), map[string]any{"tokens": childToks})
	if code != 201 {
		t.Fatalf("fork: %d %v", code, out)
	}
	child := num(out["pool_id"])
	check("fork of a restored pool", child, childToks)
	evict(t, base, child)
	check("child restored", child, childToks)
	branchToks := append(slices.Clone(rootToks[:len(rootToks)/2]), suffixTokens(t, a, " A different toolset: calculator(expression: string).")...)
	code, out = forkPool(t, base, root, len(rootToks)/2, map[string]any{"tokens": branchToks})
	if code != 201 {
		t.Fatalf("branch: %d %v", code, out)
	}
	branch := num(out["pool_id"])
	evict(t, base, branch)
	check("branch child restored", branch, branchToks)
	props := tierProps(t, base)
	// On "disk" a 1 MiB RAM tier still takes the entries that fit it (small children,
	// q8_0); the root's does not.
	if props.Restores["ram"]+props.Restores["disk"] != 3 || props.Restores[where] < 1 || len(props.Misses) != 0 || props.Spills != 3 {
		t.Fatalf("tier counters %+v, want 3 spills and 3 restores (the root's from %s), no miss", props, where)
	}
}

// TestTierFaults: a truncated file, a flipped byte, a file from another cache type and
// a removed one each give a clean prefill with the cold output and a counted miss.
func TestTierFaults(t *testing.T) {
	for _, fault := range []string{"truncated", "flipped", "foreign", "removed"} {
		t.Run(fault, func(t *testing.T) {
			dir := t.TempDir()
			a, base := startServer(t, Config{NCtx: 2048, Parallel: 2, MaxPools: 2, PoolRAMMB: 1, PoolDir: dir, PoolGrace: time.Nanosecond, PrefixCache: "off"})
			toks := tokenize(t, a, longSystem(t, a, 120))
			id := num(createPool(t, base, map[string]any{"tokens": toks})["pool_id"])
			evict(t, base, id)
			a.Tier.Flush()
			files, _ := filepath.Glob(filepath.Join(dir, "*.kv"))
			if len(files) != 1 {
				t.Fatalf("%d entry files, want 1", len(files))
			}
			b, err := os.ReadFile(files[0])
			if err != nil {
				t.Fatal(err)
			}
			reason := map[string]string{"truncated": "truncated", "flipped": "corrupt", "foreign": "foreign", "removed": "absent"}[fault]
			switch fault {
			case "truncated":
				b = b[:len(b)*2/3]
			case "flipped":
				b[len(b)/2] ^= 0x04
			case "foreign":
				// The same prefix written by a server with a q8_0 cache, under this name.
				other, obase := startServer(t, Config{NCtx: 2048, Parallel: 2, MaxPools: 2, PoolRAMMB: 1, PoolDir: t.TempDir(), CacheTypeK: "q8_0", PoolGrace: time.Nanosecond, PrefixCache: "off"})
				oid := num(createPool(t, obase, map[string]any{"tokens": toks})["pool_id"])
				evict(t, obase, oid)
				other.Tier.Flush()
				of, _ := filepath.Glob(filepath.Join(other.Config.PoolDir, "*.kv"))
				if len(of) != 1 {
					t.Fatalf("other server wrote %d files", len(of))
				}
				if b, err = os.ReadFile(of[0]); err != nil {
					t.Fatal(err)
				}
			}
			if fault == "removed" {
				_ = os.Remove(files[0])
			} else if err := os.WriteFile(files[0], b, 0o644); err != nil {
				t.Fatal(err)
			}
			prompt := append(slices.Clone(toks), suffixTokens(t, a, " Answer:")...)
			gotIDs, gotLP, _ := greedyLogprobs(t, base, prompt, id, 8)
			wantIDs, wantLP, _ := greedyLogprobs(t, base, prompt, 0, 8)
			if !slices.Equal(gotIDs, wantIDs) || !slices.Equal(gotLP, wantLP) {
				t.Fatalf("after a %s entry: %v, cold %v", fault, gotIDs, wantIDs)
			}
			props := tierProps(t, base)
			if props.Misses[reason] != 1 || len(props.Restores) != 0 {
				t.Fatalf("after a %s entry: misses %v restores %v, want one %q miss", fault, props.Misses, props.Restores, reason)
			}
			if info := poolEntry(t, base, id); info.Residency != "resident" {
				t.Fatalf("pool after the fallback prefill: %s", info.Residency)
			}
		})
	}
}

// TestTierRestart: pinned pools recorded under --pool-dir are back after a restart with
// the same ids, tree and prefix_hash, restored from disk (not prefilled), with the cold
// output; new ids never repeat old ones. On Gemma 3 the root is longer than a window
// (its record is saved in two chunks).
func TestTierRestart(t *testing.T) {
	forEachModel(t, Config{NCtx: 2048, Parallel: 2, MaxPools: 4, PrefixCache: "off"}, checkTierRestart)
}

func checkTierRestart(t *testing.T, cfg Config) {
	dir := t.TempDir()
	cfg.PoolDir = dir
	cfg = withDefaults(cfg)
	a, err := Open(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(a.API.Handler())
	base := ts.URL
	n := 120
	if w := a.Model.NSWA(); w > 0 {
		n = w + 100
	}
	rootToks := tokenize(t, a, longSystem(t, a, n))
	root := createPool(t, base, map[string]any{"tokens": rootToks, "pin": true})
	childToks := append(slices.Clone(rootToks), suffixTokens(t, a, " Task: plan the week.")...)
	code, child := forkPool(t, base, num(root["pool_id"]), len(rootToks), map[string]any{"tokens": childToks, "pin": true})
	if code != 201 {
		t.Fatalf("fork: %d %v", code, child)
	}
	unpinned := createPool(t, base, map[string]any{"prompt": "Not recorded."})
	var before wire.PoolsStatus
	get(t, base+"/polykv/pools", &before)
	ts.Close()
	a.Close() // queued disk writes finish

	a2, base2 := startServer(t, cfg)
	var after wire.PoolsStatus
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		after = wire.PoolsStatus{}
		get(t, base2+"/polykv/pools", &after)
		if len(after.Pools) == 2 && after.Pools[0].Residency == "resident" && after.Pools[1].Residency == "resident" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("recovered pools not resident: %+v", after.Pools)
		}
	}
	for i, p := range after.Pools {
		b := before.Pools[i]
		if p.PoolID != b.PoolID || p.PrefixHash != b.PrefixHash || p.BranchPos != b.BranchPos || !slices.Equal(p.Children, b.Children) || !p.UserPinned {
			t.Fatalf("pool %d after the restart: %+v, before %+v", b.PoolID, p, b)
		}
	}
	if props := tierProps(t, base2); props.Restores["disk"] != 2 || len(props.Misses) != 0 {
		t.Fatalf("restart restores %v misses %v, want 2 from disk", props.Restores, props.Misses)
	}
	prompt := append(slices.Clone(childToks), suffixTokens(t, a2, " Answer:")...)
	gotIDs, gotLP, cacheN := greedyLogprobs(t, base2, prompt, num(child["pool_id"]), 8)
	wantIDs, wantLP, _ := greedyLogprobs(t, base2, prompt, 0, 8)
	if cacheN != len(childToks) || !slices.Equal(gotIDs, wantIDs) || !slices.Equal(gotLP, wantLP) {
		t.Fatalf("attach to a recovered pool: cache_n %d, %v vs cold %v", cacheN, gotIDs, wantIDs)
	}
	fresh := createPool(t, base2, map[string]any{"prompt": "A new root."})
	if id := num(fresh["pool_id"]); id <= num(unpinned["pool_id"]) {
		t.Fatalf("new pool id %d repeats an earlier run's (up to %d)", id, num(unpinned["pool_id"]))
	}
}

// TestSlotSaveRestoreErase: llama-server's slot actions. A session's slot is saved to a
// file, erased, restored into another slot, and a request for the same prompt then
// starts from the restored cells with the cold output; bad input answers 400/501. On
// Gemma 3 the slot holds more than a window (its state is saved in chunks).
func TestSlotSaveRestoreErase(t *testing.T) {
	forEachModel(t, Config{NCtx: 2048, Parallel: 2, MaxPools: 1}, checkSlotSaveRestoreErase)
}

func checkSlotSaveRestoreErase(t *testing.T, cfg Config) {
	dir := t.TempDir()
	cfg.SlotSavePath = dir
	a, base := startServer(t, cfg)
	n := 100
	if w := a.Model.NSWA(); w > 0 {
		n = w + 100
	}
	toks := tokenize(t, a, longSystem(t, a, n))
	prompt := append(slices.Clone(toks), suffixTokens(t, a, " Answer:")...)
	code, out := post(t, base+"/v1/completions", map[string]any{"prompt": toks, "max_tokens": 1, "session_id": "s", "temperature": 0})
	if code != 200 {
		t.Fatalf("session turn: %d %v", code, out)
	}
	src, held := sessionSlot(t, base, "s")
	slotURL := func(id int, action string) string { return slotAction(base, id, action) }
	code, out = post(t, slotURL(src, "save"), map[string]any{"filename": "s.bin"})
	if code != 200 || num(out["n_saved"]) != held {
		t.Fatalf("save: %d %v (slot holds %d)", code, out, held)
	}
	for _, bad := range []string{"", "../x", "a/b", ".."} {
		if code, out := post(t, slotURL(src, "save"), map[string]any{"filename": bad}); code != 400 {
			t.Fatalf("filename %q: %d %v", bad, code, out)
		}
	}
	if code, out := post(t, slotURL(src, "bogus"), map[string]any{}); code != 400 {
		t.Fatalf("bad action: %d %v", code, out)
	}
	if code, out := post(t, slotURL(9, "erase"), map[string]any{}); code != 400 {
		t.Fatalf("bad slot: %d %v", code, out)
	}
	code, out = post(t, slotURL(src, "erase"), map[string]any{})
	if code != 200 || num(out["n_erased"]) != held {
		t.Fatalf("erase: %d %v", code, out)
	}
	dst := 1 - src
	code, out = post(t, slotURL(dst, "restore"), map[string]any{"filename": "s.bin"})
	if code != 200 || num(out["n_restored"]) != held {
		t.Fatalf("restore: %d %v", code, out)
	}
	// A request for the prompt starts from the restored cells (prefix cache) and
	// answers what a cold prefill does.
	gotIDs, gotLP, cacheN := completionLogprobs(t, base, map[string]any{"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "ignore_eos": true})
	if cacheN < len(toks) {
		t.Fatalf("cache_n %d after restoring %d tokens", cacheN, held)
	}
	wantIDs, wantLP, _ := greedyLogprobs(t, base, prompt, 0, 8)
	if !slices.Equal(gotIDs, wantIDs) || !slices.Equal(gotLP, wantLP) {
		t.Fatalf("from the restored slot %v, cold %v", gotIDs, wantIDs)
	}
	// A corrupt file is refused, never loaded.
	path := filepath.Join(dir, "s.bin")
	b, _ := os.ReadFile(path)
	b[len(b)/2] ^= 1
	_ = os.WriteFile(path, b, 0o644)
	if code, out := post(t, slotURL(dst, "restore"), map[string]any{"filename": "s.bin"}); code != 400 || !strings.Contains(fmt.Sprint(out), "checksum") {
		t.Fatalf("corrupt file: %d %v", code, out)
	}
	// Without --slot-save-path: 501.
	_, base2 := startServer(t, Config{ModelPath: cfg.ModelPath, ChatTemplate: cfg.ChatTemplate, NCtx: 512, Parallel: 1, MaxPools: 1})
	if code, out := post(t, fmt.Sprintf("%s/slots/0?action=save", base2), map[string]any{"filename": "x"}); code != 501 {
		t.Fatalf("no slot path: %d %v", code, out)
	}
}

// sessionSlot is the slot holding the session id and how many tokens it holds.
func sessionSlot(t *testing.T, base, id string) (slot, held int) {
	t.Helper()
	var slots []wire.Slot
	get(t, base+"/slots", &slots)
	slot = slices.IndexFunc(slots, func(s wire.Slot) bool { return s.SessionID == id })
	if slot < 0 {
		t.Fatalf("no slot holds session %q: %+v", id, slots)
	}
	return slot, slots[slot].NPast
}

// slotAction is the URL of llama-server's slot action on slot id.
func slotAction(base string, id int, action string) string {
	return fmt.Sprintf("%s/slots/%d?action=%s", base, id, action)
}

// TestTierArchsRestoreEqualsPrefill: on models with recurrent state (Qwen3.5's gated
// delta-net and LFM2's short convolutions, both beside attention layers, Qwen3.5's with
// a sliding window; random weights) an evicted pool comes back from the tier with its
// recurrent state at its boundary: a root, an extend fork of the restored root and that
// child restored (its state its own, not its parent's) give a fully prefilled request's
// greedy tokens and logprobs, from RAM and from disk, f16 and q8_0 caches. Gemma 4's
// test model (interleaved 32-position window, layers sharing KV) runs the same story
// through the window-chunked save Gemma 3 uses: its 120-token root spans four windows.
func TestTierArchsRestoreEqualsPrefill(t *testing.T) {
	for _, arch := range []string{"qwen35", "lfm2", "gemma4"} {
		for _, c := range []struct{ ct, where string }{{"f16", "ram"}, {"q8_0", "disk"}} {
			t.Run(arch+"/"+c.ct+"/"+c.where, func(t *testing.T) {
				cfg := withDefaults(Config{ModelPath: testmodel.Arch(t, arch), NCtx: 1024, Parallel: 2, MaxPools: 4, Threads: 2,
					CacheTypeK: c.ct, CacheTypeV: c.ct, PoolGrace: time.Nanosecond})
				if c.where == "disk" {
					cfg.PoolRAMMB, cfg.PoolDir = 0, t.TempDir()
				}
				a, base := openServer(t, cfg)
				if props := tierProps(t, base); props == nil || !props.Enabled {
					t.Fatalf("tier props %+v, want enabled on %s", props, arch)
				}
				question := archTokens(a, 3, 9)
				check := func(name string, id int, prefix []int32) {
					t.Helper()
					checkRestored(t, base, name, id, prefix, question)
				}
				rootToks := archTokens(a, 1, 120)
				L := len(rootToks)
				root := num(createPool(t, base, map[string]any{"tokens": rootToks})["pool_id"])
				evict(t, base, root)
				if info := poolEntry(t, base, root); info.Residency != c.where {
					t.Fatalf("evicted root: residency %q, want %s", info.Residency, c.where)
				}
				check("root restored", root, rootToks)
				childToks := append(slices.Clone(rootToks), archTokens(a, 2, 30)...)
				code, out := forkPool(t, base, root, L, map[string]any{"tokens": childToks})
				if code != 201 {
					t.Fatalf("extend fork: %d %v", code, out)
				}
				child := num(out["pool_id"])
				check("extend fork of the restored root", child, childToks)
				evict(t, base, child)
				check("child restored", child, childToks)
				check("root after its child's restore", root, rootToks)
				// On Gemma 4 (no recurrent state) the evicted child is whole in the cells a
				// session of its check left resident, so it is shared from there (a seq_cp is
				// cheaper than any load); a recurrent child's state lives in no other
				// sequence, so it comes from the tier.
				restores := int64(2)
				if arch == "gemma4" {
					restores = 1
				}
				// The pools' own counters: the checks' plain requests, displaced on the way,
				// spill and load their segments too (kind cached, issue 40).
				props := tierProps(t, base)
				pk := props.Kinds["pool"]
				if pk.Restores != restores || pk.Spills != 2 || len(props.Misses) != 0 || props.Restores[c.where] < restores {
					t.Fatalf("tier counters %+v, want 2 pool spills and %d pool restores from %s, no miss", props, restores, c.where)
				}
			})
		}
	}
}

// TestTierServerKill9: the whole server (a child process running this package's
// TestTierServerHelper) is killed with SIGKILL at three moments made certain by
// tier.CrashPoint (the helper stops there, touches a file, and is killed once the file
// is seen): while a spill is written to disk (its temporary file complete, not renamed),
// during a restart's Open (the manifest's new id floor in its temporary file), and while
// the recovered pools are being restored (an entry about to be read back). The server
// started after that comes back clean: no temporary file left, the three pinned pools
// recorded before the first kill back under their ids and resident, each giving a cold
// prefill's greedy tokens and logprobs, no miss, and new pool ids above the killed runs'.
func TestTierServerKill9(t *testing.T) {
	if os.Getenv("POLYKV_TIER_SERVER") != "" {
		return
	}
	tk, _ := startServer(t, Config{NCtx: 512, Parallel: 1, MaxPools: 1}) // a tokenizer
	dir := t.TempDir()
	// start runs the helper server, stopping at the hold-th call of tier.CrashPoint with
	// point and a name ending in suffix (counted once the file arm exists, when given).
	type helper struct {
		cmd       *exec.Cmd
		url, held string
	}
	start := func(point, suffix string, hold int, arm string) *helper {
		t.Helper()
		tmp := t.TempDir()
		h := &helper{url: filepath.Join(tmp, "url"), held: filepath.Join(tmp, "held")}
		h.cmd = exec.Command(os.Args[0], "-test.run=^TestTierServerHelper$")
		h.cmd.Env = append(os.Environ(), "POLYKV_TIER_SERVER="+dir, "POLYKV_TIER_SERVER_URL="+h.url,
			fmt.Sprintf("POLYKV_TIER_HOLD=%s:%s:%d", point, suffix, hold), "POLYKV_TIER_HELD="+h.held, "POLYKV_TIER_ARM="+arm)
		if err := h.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return h
	}
	kill := func(h *helper) {
		_ = h.cmd.Process.Signal(syscall.SIGKILL)
		_ = h.cmd.Wait()
	}
	// wait polls file until it has content, or kills h and fails after a minute.
	wait := func(h *helper, file, what string) string {
		t.Helper()
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if b, err := os.ReadFile(file); err == nil && len(b) > 0 {
				return string(b)
			}
			if time.Now().After(deadline) {
				kill(h)
				t.Fatalf("helper server: %s never came", what)
			}
		}
	}
	tmpFiles := func() []string {
		tmps, _ := filepath.Glob(filepath.Join(dir, ".tmp-*"))
		return tmps
	}
	// killHeld waits until h stops at its crash point, kills it there and returns what the
	// point was and the temporary files in the directory at the kill.
	killHeld := func(h *helper) (string, []string) {
		t.Helper()
		at := wait(h, h.held, "the crash point")
		tmps := tmpFiles()
		kill(h)
		if after := tmpFiles(); !slices.Equal(after, tmps) {
			t.Fatalf("temporary files changed at the kill at %q: %v, then %v (the helper did not stop there)", at, tmps, after)
		}
		return at, tmps
	}
	recorded := func() int {
		var m struct{ Recorded []int }
		b, _ := os.ReadFile(filepath.Join(dir, "pools.json"))
		_ = json.Unmarshal(b, &m)
		return len(m.Recorded)
	}

	// 1. Pinned pools recorded, then four spills to disk; killed while spill n (1..4) is in
	// its temporary file.
	arm := filepath.Join(t.TempDir(), "arm")
	n := 1 + rand.IntN(4)
	h := start("write", ".kv", n, arm)
	base := wait(h, h.url, "the URL")
	pinned := map[int][]int32{}
	for i := range 3 {
		toks := tokenize(t, tk, fmt.Sprintf("Team %d. ", i)+longSystem(t, tk, 120))
		pinned[num(createPool(t, base, map[string]any{"tokens": toks, "pin": true})["pool_id"])] = toks
	}
	// Recorded means listed in pools.json with a record; each pinned pool's KV entry is
	// written beside it by the store's writer, after. The crash point counts .kv writes
	// from the arming on, so it is armed only once the three entries are on disk.
	entries := func() int {
		kvs, _ := filepath.Glob(filepath.Join(dir, "*.kv"))
		return len(kvs)
	}
	for deadline := time.Now().Add(30 * time.Second); recorded() < 3 || entries() < 3; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			kill(h)
			t.Fatalf("pinned pools not recorded: pools.json lists %d, %d entries on disk", recorded(), entries())
		}
	}
	if err := os.WriteFile(arm, []byte("1"), 0o644); err != nil {
		t.Fatal(err)
	}
	var spare []int
	for i := range 4 {
		spare = append(spare, num(createPool(t, base, map[string]any{"tokens": tokenize(t, tk, fmt.Sprintf("Spare %d. ", i)+longSystem(t, tk, 200))})["pool_id"]))
	}
	for _, id := range spare {
		if code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/evict", base, id), map[string]any{}); code != 200 {
			kill(h)
			t.Fatalf("evict %d: %d %v", id, code, out)
		}
	}
	at, tmps := killHeld(h)
	kvs, _ := filepath.Glob(filepath.Join(dir, "*.kv"))
	t.Logf("killed at %s (spill %d of 4): %d entries and temporary files %v on disk", at, n, len(kvs), tmps)
	if !strings.HasPrefix(at, "write ") || !strings.HasSuffix(at, ".kv") || len(tmps) != 1 || len(kvs) != 3+n-1 {
		t.Fatalf("kill while spilling: at %q, temporary files %v, %d entries (want one temporary file, the 3 pinned entries and %d spills)", at, tmps, len(kvs), n-1)
	}

	// 2. Killed while a restart reloads: during Open, with the manifest's new id floor in
	// its temporary file (the spill's was removed by then) ...
	spillTmp := tmps[0]
	at, tmps = killHeld(start("write", "pools.json", 1, ""))
	if at != "write pools.json" || len(tmps) != 1 || tmps[0] == spillTmp || strings.HasPrefix(filepath.Base(tmps[0]), ".tmp-probe-") {
		t.Fatalf("kill during Open: at %q with temporary files %v, want the manifest's alone", at, tmps)
	}
	// ... then while restoring recovered pool k (1..3): Open has not returned, so the
	// helper never wrote its URL.
	k := 1 + rand.IntN(3)
	h = start("read", ".kv", k, "")
	at, _ = killHeld(h)
	if _, err := os.Stat(h.url); !strings.HasPrefix(at, "read ") || err == nil {
		t.Fatalf("kill while restoring: at %q, URL file %v (want a read inside Open)", at, err)
	}
	t.Logf("killed in Open at the manifest write, then at the read of recovered pool %d of 3", k)

	// 3. A clean restart.
	cfg := withDefaults(Config{ModelPath: modelPath(t), NCtx: 2048, Parallel: 2, MaxPools: 8, PoolDir: dir, PrefixCache: "off"})
	cfg.PoolRAMMB = 0
	a, base := openServer(t, cfg)
	if tmps := tmpFiles(); len(tmps) != 0 {
		t.Fatalf("temporary files left after a restart: %v", tmps)
	}
	var after wire.PoolsStatus
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		after = wire.PoolsStatus{}
		get(t, base+"/polykv/pools", &after)
		if len(after.Pools) == 3 && !slices.ContainsFunc(after.Pools, func(p wire.PoolInfo) bool { return p.Residency != "resident" }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("recovered pools: %+v, want the 3 pinned ones resident", after.Pools)
		}
	}
	question := suffixTokens(t, a, " Question: which tool first? Answer:")
	for _, p := range after.Pools {
		toks, ok := pinned[p.PoolID]
		if !ok {
			t.Fatalf("recovered pool %d was not one of the pinned %v", p.PoolID, pinned)
		}
		prompt := append(slices.Clone(toks), question...)
		gotIDs, gotLP, cacheN := greedyLogprobs(t, base, prompt, p.PoolID, 8)
		wantIDs, wantLP, _ := greedyLogprobs(t, base, prompt, 0, 8)
		if cacheN != len(toks) || !slices.Equal(gotIDs, wantIDs) || !slices.Equal(gotLP, wantLP) {
			t.Fatalf("pool %d after the kills: cache_n %d, %v vs cold %v", p.PoolID, cacheN, gotIDs, wantIDs)
		}
	}
	if props := tierProps(t, base); props.Restores["disk"] != 3 || len(props.Misses) != 0 {
		t.Fatalf("restores %v misses %v, want the 3 pinned pools from disk", props.Restores, props.Misses)
	}
	if id := num(createPool(t, base, map[string]any{"prompt": "A new root."})["pool_id"]); id <= spare[len(spare)-1] {
		t.Fatalf("new pool id %d repeats a killed run's (up to %d)", id, spare[len(spare)-1])
	}
}

// TestTierServerHelper is the server TestTierServerKill9 kills: SmolLM2 with its pools
// on disk only, serving until it dies. POLYKV_TIER_HOLD (point:suffix:n) stops it for
// good at the n-th tier.CrashPoint call with that point and a name ending in suffix
// (counted once the file POLYKV_TIER_ARM exists, when named), after writing where it
// stopped to the file POLYKV_TIER_HELD: the parent kills it there.
func TestTierServerHelper(t *testing.T) {
	dir := os.Getenv("POLYKV_TIER_SERVER")
	if dir == "" {
		t.Skip("helper process of TestTierServerKill9")
	}
	var point, suffix string
	var hold int
	if spec := strings.SplitN(os.Getenv("POLYKV_TIER_HOLD"), ":", 3); len(spec) == 3 {
		point, suffix = spec[0], spec[1]
		hold, _ = strconv.Atoi(spec[2])
	}
	arm, held := os.Getenv("POLYKV_TIER_ARM"), os.Getenv("POLYKV_TIER_HELD")
	var calls atomic.Int32
	tier.CrashPoint = func(p, name string) {
		if p != point || !strings.HasSuffix(name, suffix) {
			return
		}
		if arm != "" {
			if _, err := os.Stat(arm); err != nil {
				return
			}
		}
		if int(calls.Add(1)) != hold {
			return
		}
		if err := tier.WriteFileAtomic(filepath.Dir(held), filepath.Base(held), []byte(p+" "+name)); err != nil {
			panic(err)
		}
		select {} // until the SIGKILL
	}
	cfg := withDefaults(Config{ModelPath: modelPath(t), NCtx: 2048, Parallel: 2, MaxPools: 8, PoolDir: dir, PoolGrace: time.Nanosecond, PrefixCache: "off"})
	cfg.PoolRAMMB = 0 // every spill is a disk write
	a, err := Open(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(a.API.Handler())
	if err := tier.WriteFileAtomic(filepath.Dir(os.Getenv("POLYKV_TIER_SERVER_URL")), filepath.Base(os.Getenv("POLYKV_TIER_SERVER_URL")), []byte(ts.URL)); err != nil {
		t.Fatal(err)
	}
	select {}
}

// openServer opens an App with cfg exactly as given (startServer would give zero fields
// their defaults: a RAM tier of 0 MiB, for one) and serves it until the test ends.
func openServer(t testing.TB, cfg Config) (*App, string) {
	t.Helper()
	a, err := Open(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	return a, serve(t, a)
}
