package app

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/tier"
)

// Issue 45: a recorded pool's record lives apart from its KV entry, so a damaged entry
// costs a prefill, never the pool, and a damaged record is reported, never skipped.

// damageFile breaks a file as a bad disk would: a flipped byte, cut to a third, or
// removed.
func damageFile(t *testing.T, path, how string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	switch how {
	case "flip":
		b[len(b)/2] ^= 0x10
	case "truncate":
		b = b[:len(b)/3]
	case "delete":
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		return
	default:
		t.Fatalf("damage %q", how)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// recordedIDs is what dir's pools.json lists.
func recordedIDs(dir string) []int {
	var m struct{ Recorded []int }
	b, _ := os.ReadFile(filepath.Join(dir, "pools.json"))
	_ = json.Unmarshal(b, &m)
	return m.Recorded
}

// poolWithTokens is GET /polykv/pools/{id} (tokens included); the status code too.
func poolWithTokens(t *testing.T, base string, id int) (wire.PoolInfo, int) {
	t.Helper()
	var info wire.PoolInfo
	code := get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
	return info, code
}

// waitResident polls /polykv/pools until every pool in ids is resident.
func waitResident(t *testing.T, base string, ids []int) wire.PoolsStatus {
	t.Helper()
	for deadline := time.Now().Add(120 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var st wire.PoolsStatus
		get(t, base+"/polykv/pools", &st)
		n := 0
		for _, p := range st.Pools {
			if slices.Contains(ids, p.PoolID) && p.Residency == "resident" {
				n++
			}
		}
		if n == len(ids) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("pools %v not all resident: %+v", ids, st.Pools)
		}
	}
}

// TestTierDamagedKVAfterKill9: a server (TestTierServerHelper, pools on disk only)
// records four pinned roots and a pinned fork of each, and is killed with SIGKILL. Then
// the KV entries of the first root and its child get a flipped byte, the second pair's
// are cut to a third, the third pair's are removed, and the fourth root's is flipped
// while its child's is left whole. The restarted server lists all eight pools under
// their ids with their tokens, parent, branch_pos, prefix_hash and pin, none lost; each
// damaged entry is one counted miss of its reason; the damaged pools are prefilled in
// the background (a damaged child from its parent's prefilled cells; the whole child's
// entry restored onto them) until all are resident; greedy tokens and logprobs through
// each equal a cold prefill's; and every entry is on disk again, whole.
func TestTierDamagedKVAfterKill9(t *testing.T) {
	if os.Getenv("POLYKV_TIER_SERVER") != "" {
		return
	}
	tk, _ := startServer(t, Config{NCtx: 512, Parallel: 1, MaxPools: 1}) // a tokenizer, and the model key
	key, err := modelKey(tk.Config, tk.Model)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	urlFile := filepath.Join(t.TempDir(), "url")
	cmd := exec.Command(os.Args[0], "-test.run=^TestTierServerHelper$")
	cmd.Env = append(os.Environ(), "POLYKV_TIER_SERVER="+dir, "POLYKV_TIER_SERVER_URL="+urlFile)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	kill := func() {
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_ = cmd.Wait()
	}
	defer kill()
	var base string
	for deadline := time.Now().Add(60 * time.Second); base == ""; time.Sleep(10 * time.Millisecond) {
		if b, err := os.ReadFile(urlFile); err == nil && len(b) > 0 {
			base = string(b)
		} else if time.Now().After(deadline) {
			t.Fatal("helper server did not start")
		}
	}

	type pinned struct {
		id     int
		d      int
		tokens []int32
		damage string // "" : left whole
	}
	var pools []pinned
	for i, how := range []string{"flip", "truncate", "delete", "flip"} {
		root := tokenize(t, tk, fmt.Sprintf("Team %d. ", i)+longSystem(t, tk, 120))
		rid := num(createPool(t, base, map[string]any{"tokens": root, "pin": true})["pool_id"])
		child := append(slices.Clone(root), suffixTokens(t, tk, fmt.Sprintf(" Task: plan step %d of the week.", i))...)
		code, out := forkPool(t, base, rid, len(root), map[string]any{"tokens": child, "pin": true})
		if code != 201 {
			t.Fatalf("fork: %d %v", code, out)
		}
		childHow := how
		if i == 3 {
			childHow = ""
		}
		pools = append(pools, pinned{rid, 0, root, how}, pinned{num(out["pool_id"]), len(root), child, childHow})
	}
	entry := func(p pinned) string { return filepath.Join(dir, tier.MakeKey(key, p.d, p.tokens).String()+".kv") }
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		onDisk := 0
		for _, p := range pools {
			if _, err := os.Stat(entry(p)); err == nil {
				onDisk++
			}
		}
		if onDisk == len(pools) && len(recordedIDs(dir)) == len(pools) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pinned pools not recorded: %d entries on disk, pools.json lists %v", onDisk, recordedIDs(dir))
		}
	}
	before := map[int]wire.PoolInfo{}
	for _, p := range pools {
		before[p.id], _ = poolWithTokens(t, base, p.id)
	}
	kill()
	for _, p := range pools {
		if p.damage != "" {
			damageFile(t, entry(p), p.damage)
		}
	}

	cfg := withDefaults(Config{ModelPath: modelPath(t), NCtx: 2048, Parallel: 2, MaxPools: 8, PoolDir: dir, PrefixCache: "off"})
	cfg.PoolRAMMB = 0
	a, base2 := openServer(t, cfg)
	var ids []int
	for _, p := range pools {
		ids = append(ids, p.id)
	}
	st := waitResident(t, base2, ids)
	if len(st.Pools) != len(pools) || len(st.LostPools) != 0 {
		t.Fatalf("after the restart: %d pools, lost %+v; want the %d recorded, none lost", len(st.Pools), st.LostPools, len(pools))
	}
	for _, p := range pools {
		got, code := poolWithTokens(t, base2, p.id)
		b := before[p.id]
		if code != 200 || got.PrefixHash != b.PrefixHash || !slices.Equal(got.Tokens, p.tokens) || !slices.Equal(got.Tokens, b.Tokens) ||
			got.BranchPos != b.BranchPos || parentID(got) != parentID(b) || !got.UserPinned {
			t.Fatalf("pool %d (entry %q) after the restart: %d %+v, before %+v", p.id, p.damage, code, got, b)
		}
	}
	props := tierProps(t, base2)
	if want := map[string]int64{"corrupt": 3, "truncated": 2, "absent": 2}; !mapsEqual(props.Misses, want) || props.Restores["disk"] != 1 {
		t.Fatalf("misses %v restores %v, want misses %v and the one whole child restored", props.Misses, props.Restores, want)
	}
	question := suffixTokens(t, a, " Question: which tool first? Answer:")
	for _, p := range pools {
		checkRestored(t, base2, fmt.Sprintf("pool %d (entry %q)", p.id, p.damage), p.id, p.tokens, question)
	}
	// The prefilled pools were recorded again: their entries are back, whole.
	a.Tier.Flush()
	for _, p := range pools {
		b, err := os.ReadFile(entry(p))
		if err != nil {
			t.Fatalf("pool %d's entry not written again: %v", p.id, err)
		}
		if m, _, err := tier.DecodeFile(b, key); err != nil || m.D != p.d || !slices.Equal(m.Tokens, p.tokens) {
			t.Fatalf("pool %d's entry written again: %v (d %d)", p.id, err, m.D)
		}
	}
}

// parentID is a pool's parent (0: a root).
func parentID(p wire.PoolInfo) int {
	if p.Parent == nil {
		return 0
	}
	return *p.Parent
}

func mapsEqual(a map[string]int64, b map[string]int64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// syncBuffer is a log sink tests can read while the server writes to it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestTierDamagedRecordReported: of five pinned pools, the record of a root gets a
// flipped byte, another root's is cut to a third and a third root's is removed; the
// restarted server reports each of the three by id and reason in its log, in /metrics
// (polykv_pool_tier_lost_pools) and in /polykv/pools's lost_pools, and their ids answer
// 404. The child of the flipped root, whose own record is whole, comes back as a root
// under its id with its tokens and prefix_hash and gives a cold prefill's output; the
// fifth pool comes back restored from disk with the admission policy it was given.
func TestTierDamagedRecordReported(t *testing.T) {
	dir := t.TempDir()
	cfg := withDefaults(Config{ModelPath: modelPath(t), NCtx: 2048, Parallel: 2, MaxPools: 6, PoolDir: dir, PrefixCache: "off"})
	a, err := Open(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(a.API.Handler())
	base := ts.URL
	sys := longSystem(t, a, 120)
	ids := map[string]int{}
	toks := map[string][]int32{}
	for _, name := range []string{"flip", "truncate", "delete", "policy"} {
		toks[name] = tokenize(t, a, name+". "+sys)
		ids[name] = num(createPool(t, base, map[string]any{"tokens": toks[name], "pin": true})["pool_id"])
	}
	toks["child"] = append(slices.Clone(toks["flip"]), suffixTokens(t, a, " Task: review the plan.")...)
	code, out := forkPool(t, base, ids["flip"], len(toks["flip"]), map[string]any{"tokens": toks["child"], "pin": true})
	if code != 201 {
		t.Fatalf("fork: %d %v", code, out)
	}
	ids["child"] = num(out["pool_id"])
	if code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/admission", base, ids["policy"]), map[string]any{"target_tps_per_session": 3.5}); code != 200 {
		t.Fatalf("admission: %d %v", code, out)
	}
	childBefore, _ := poolWithTokens(t, base, ids["child"])
	record := func(id int) string { return filepath.Join(dir, fmt.Sprintf("pool-%d.rec", id)) }
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		b, _ := os.ReadFile(record(ids["policy"]))
		if len(recordedIDs(dir)) == len(ids) && bytes.Contains(b, []byte(`"TargetTPS":3.5`)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pools not recorded: pools.json lists %v", recordedIDs(dir))
		}
	}
	ts.Close()
	a.Close()
	for _, how := range []string{"flip", "truncate", "delete"} {
		damageFile(t, record(ids[how]), how)
	}

	var logs syncBuffer
	a2, err := Open(cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a2.Close)
	base2 := serve(t, a2)
	st := waitResident(t, base2, []int{ids["child"], ids["policy"]})
	want := map[int]string{ids["flip"]: "corrupt", ids["truncate"]: "truncated", ids["delete"]: "absent"}
	if len(st.LostPools) != len(want) {
		t.Fatalf("lost_pools %+v, want %v", st.LostPools, want)
	}
	for _, l := range st.LostPools {
		if want[l.PoolID] != l.Reason || l.Error == "" {
			t.Fatalf("lost_pools %+v, want %v", st.LostPools, want)
		}
		if _, code := poolWithTokens(t, base2, l.PoolID); code != 404 {
			t.Fatalf("lost pool %d answers %d", l.PoolID, code)
		}
		if line := fmt.Sprintf("recorded pool lost: it is not back after the restart and its id answers 404\" pool=%d reason=%s", l.PoolID, l.Reason); !strings.Contains(logs.String(), line) {
			t.Fatalf("the log does not report pool %d (%s):\n%s", l.PoolID, l.Reason, logs.String())
		}
	}
	series := map[int]string{}
	if f := scrapeMetrics(t, base2)["polykv_pool_tier_lost_pools"]; f != nil {
		for _, m := range f.GetMetric() {
			var id int
			var reason string
			for _, lp := range m.GetLabel() {
				switch lp.GetName() {
				case "pool":
					_, _ = fmt.Sscan(lp.GetValue(), &id)
				case "reason":
					reason = lp.GetValue()
				}
			}
			if m.GetGauge().GetValue() == 1 {
				series[id] = reason
			}
		}
	}
	if fmt.Sprint(series) != fmt.Sprint(want) {
		t.Fatalf("/metrics polykv_pool_tier_lost_pools %v, want %v", series, want)
	}
	child, code := poolWithTokens(t, base2, ids["child"])
	if code != 200 || child.Parent != nil || child.BranchPos != 0 || child.PrefixHash != childBefore.PrefixHash || !slices.Equal(child.Tokens, toks["child"]) || !child.UserPinned {
		t.Fatalf("child of the lost root: %d %+v, before %+v", code, child, childBefore)
	}
	checkRestored(t, base2, "child of a lost root", ids["child"], toks["child"], suffixTokens(t, a2, " Answer:"))
	var adm wire.PoolAdmission
	if get(t, fmt.Sprintf("%s/polykv/pools/%d/admission", base2, ids["policy"]), &adm); adm.Admission.TargetTPS != 3.5 {
		t.Fatalf("recovered pool's admission policy: %+v", adm)
	}
	if props := tierProps(t, base2); props.Restores["disk"] != 1 || len(props.Misses) != 0 {
		t.Fatalf("restores %v misses %v: want the whole pool restored from disk, no miss", props.Restores, props.Misses)
	}
}
