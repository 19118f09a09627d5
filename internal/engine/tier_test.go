package engine

import (
	"slices"
	"testing"

	"github.com/polykv/polykv/internal/admission"
)

func tierCfg() Config {
	c := poolCfg()
	c.Tier = true
	return c
}

// prefilledFor counts the batch entries that prefilled sequence seq since batch from.
func (h *harness) prefilledFor(seq, from int) int {
	n := 0
	for _, b := range h.be.batches[from:] {
		for _, e := range b {
			if e.Seq == seq {
				n++
			}
		}
	}
	return n
}

// An evicted pool is spilled, then restored from the tier on the next attach: no
// prefill of its cells, the same output, cells accounted exactly; a child's own cells
// come back above its parent's shared ones.
func TestTierSpillRestore(t *testing.T) {
	h := newHarness(t, tierCfg())
	root := seqTokens(1, 40)
	r := h.createPool(PoolSpec{Tokens: root})
	childToks := append(slices.Clone(root[:25]), seqTokens(200, 10)...)
	c := h.createPool(PoolSpec{HasParent: true, Parent: r, D: 25, Tokens: childToks})
	for _, tc := range []struct {
		name string
		id   int
		pre  []Token
	}{{"child", c, childToks}} {
		prompt := append(slices.Clone(tc.pre), 7, 8)
		want := expectedText(t, prompt, 4)
		if err := h.evictPool(tc.id); err != nil {
			t.Fatalf("%s: evict: %v", tc.name, err)
		}
		h.step()
		if h.be.tierSpills != 1 {
			t.Fatalf("%s: %d spills", tc.name, h.be.tierSpills)
		}
		from := len(h.be.batches)
		tid := h.submit(Request{Prompt: prompt, HasPool: true, PoolID: tc.id, MaxTokens: 4})
		h.run()
		ev, _ := h.done(tid)
		if got := h.text(tid); ev.Err != nil || got != want || ev.Stats.CacheN != len(tc.pre) {
			t.Fatalf("%s: after restore %q (cache_n %d, err %v), want %q", tc.name, got, ev.Stats.CacheN, ev.Err, want)
		}
		if n := h.prefilledFor(h.poolSeq(tc.id), from); n != 0 {
			t.Fatalf("%s: %d tokens prefilled on the pool's sequence; a restore prefills none", tc.name, n)
		}
		if h.be.tierRestores != 1 || h.s.tierRestores != 1 || h.s.tierMisses != 0 {
			t.Fatalf("%s: restores fake %d scheduler %d misses %d", tc.name, h.be.tierRestores, h.s.tierRestores, h.s.tierMisses)
		}
		if got := h.be.tokens(h.poolSeq(tc.id)); !slices.Equal(got, tc.pre) {
			t.Fatalf("%s: restored sequence holds %v", tc.name, got)
		}
		h.checkAccounting()
	}
	// The child's [0, 25) are the parent's very cells again (shared, not copies).
	rs, cs := h.be.kv[h.poolSeq(r)], h.be.kv[h.poolSeq(c)]
	for i := range 25 {
		if rs[i].id != cs[i].id {
			t.Fatalf("child's cell %d is a copy (%d), not the parent's (%d)", i, cs[i].id, rs[i].id)
		}
	}
}

// On a model with recurrent state the driver shares a restored child's [0, D) itself (a
// seq_cp after the load would replace the child's recurrent state by its parent's): the
// scheduler plans none (the fake refuses a seq_cp onto a non-empty sequence), the
// output is the same, the child's [0, D) are its parent's very cells and the cell tree
// still matches the cache.
func TestTierRecurrentChildRestore(t *testing.T) {
	cfg := tierCfg()
	cfg.Recurrent = true
	h := newHarness(t, cfg)
	root := seqTokens(1, 40)
	r := h.createPool(PoolSpec{Tokens: root})
	childToks := append(slices.Clone(root), seqTokens(200, 10)...)
	c := h.createPool(PoolSpec{HasParent: true, Parent: r, D: len(root), Tokens: childToks})
	prompt := append(slices.Clone(childToks), 7, 8)
	want := expectedText(t, prompt, 4)
	if err := h.evictPool(c); err != nil {
		t.Fatal(err)
	}
	h.step()
	from := len(h.be.batches)
	tid := h.submit(Request{Prompt: prompt, HasPool: true, PoolID: c, MaxTokens: 4})
	h.run()
	ev, _ := h.done(tid)
	if got := h.text(tid); ev.Err != nil || got != want || ev.Stats.CacheN != len(childToks) {
		t.Fatalf("after restore %q (cache_n %d, err %v), want %q", got, ev.Stats.CacheN, ev.Err, want)
	}
	if n := h.prefilledFor(h.poolSeq(c), from); n != 0 || h.be.tierRestores != 1 || h.s.tierMisses != 0 {
		t.Fatalf("%d tokens prefilled on the child's sequence, %d restores, %d misses; want a restore alone", n, h.be.tierRestores, h.s.tierMisses)
	}
	rs, cs := h.be.kv[h.poolSeq(r)], h.be.kv[h.poolSeq(c)]
	for i := range root {
		if rs[i].id != cs[i].id {
			t.Fatalf("child's cell %d is a copy (%d), not the parent's (%d)", i, cs[i].id, rs[i].id)
		}
	}
	h.checkAccounting()
}

// A restore whose bytes are read off the engine goroutine (AsyncTierBackend): while the
// read is pending the pool's request waits and other requests run; once the read is
// done the restore is applied and the request answers what a prefill would, with no
// prefill. A read that comes back when its pool no longer waits is discarded.
func TestTierAsyncRead(t *testing.T) {
	h := newHarness(t, tierCfg())
	h.be.async, h.be.read = true, map[int]bool{}
	root := seqTokens(1, 40)
	r := h.createPool(PoolSpec{Tokens: root})
	prompt := append(slices.Clone(root), 7, 8)
	want := expectedText(t, prompt, 4)
	if err := h.evictPool(r); err != nil {
		t.Fatal(err)
	}
	h.step()
	tid := h.submit(Request{Prompt: prompt, HasPool: true, PoolID: r, MaxTokens: 4})
	other := h.submit(Request{Prompt: seqTokens(500, 6), MaxTokens: 3})
	for range 20 {
		h.step()
	}
	if _, ok := h.done(tid); ok || len(h.be.reads) != 1 {
		t.Fatalf("request on a pool being read: done %v, %d reads; want it waiting on one read", ok, len(h.be.reads))
	}
	if _, ok := h.done(other); !ok {
		t.Fatal("another request did not run while a read was pending")
	}
	op := h.be.reads[0]
	h.be.read[r] = true
	h.send(TierRead{Op: op})
	from := len(h.be.batches)
	h.run()
	ev, _ := h.done(tid)
	if got := h.text(tid); ev.Err != nil || got != want || ev.Stats.CacheN != len(root) {
		t.Fatalf("after the read: %q (cache_n %d, err %v), want %q", got, ev.Stats.CacheN, ev.Err, want)
	}
	if n := h.prefilledFor(h.poolSeq(r), from); n != 0 || h.be.tierRestores != 1 || h.s.tierMisses != 0 {
		t.Fatalf("%d tokens prefilled, %d restores, %d misses; want a restore alone", n, h.be.tierRestores, h.s.tierMisses)
	}
	h.checkAccounting()

	// A read that comes back when its pool no longer waits (a late duplicate; or its
	// sequence reused) is discarded: nothing is loaded again.
	held := len(h.be.kv[op.Seq])
	h.be.read[r] = true
	h.send(TierRead{Op: op})
	if h.be.discarded != 1 || h.be.tierRestores != 1 || len(h.be.kv[op.Seq]) != held {
		t.Fatalf("read of a restore no longer awaited: %d discarded, %d restores, seq %d holds %d cells (had %d); want it discarded, nothing loaded",
			h.be.discarded, h.be.tierRestores, op.Seq, len(h.be.kv[op.Seq]), held)
	}
	h.checkAccounting()
}

// A root evicted under its own eviction message and one lost by the tier: the lost one
// falls back to a prefill (a counted miss) with the same output.
func TestTierMissPrefills(t *testing.T) {
	h := newHarness(t, tierCfg())
	root := seqTokens(1, 30)
	id := h.createPool(PoolSpec{Tokens: root})
	prompt := append(slices.Clone(root), 9)
	want := expectedText(t, prompt, 3)
	if err := h.evictPool(id); err != nil {
		t.Fatal(err)
	}
	h.step()
	clear(h.be.tier) // lost (RAM LRU, a corrupt file, ...)
	from := len(h.be.batches)
	tid := h.submit(Request{Prompt: prompt, HasPool: true, PoolID: id, MaxTokens: 3})
	h.run()
	if got := h.text(tid); got != want {
		t.Fatalf("after a miss %q, want %q", got, want)
	}
	if n := h.prefilledFor(h.poolSeq(id), from); n != 30 || h.s.tierMisses != 1 {
		t.Fatalf("prefilled %d tokens, misses %d; want the whole prefix and one miss", n, h.s.tierMisses)
	}
	// The next eviction spills again (the miss forgot the entry) and restores.
	if err := h.evictPool(id); err != nil {
		t.Fatal(err)
	}
	h.step()
	tid = h.submit(Request{Prompt: prompt, HasPool: true, PoolID: id, MaxTokens: 3})
	h.run()
	if got := h.text(tid); got != want || h.s.tierRestores != 1 {
		t.Fatalf("second restore: %q restores %d", got, h.s.tierRestores)
	}
	h.checkAccounting()
}

// Without the tier nothing is spilled: eviction drops the KV as before.
func TestTierOffNoSpill(t *testing.T) {
	h := newHarness(t, poolCfg())
	id := h.createPool(PoolSpec{Tokens: seqTokens(1, 20)})
	if err := h.evictPool(id); err != nil {
		t.Fatal(err)
	}
	h.step()
	if h.be.tierSpills != 0 || len(h.s.inTier) != 0 {
		t.Fatalf("spilled with the tier off: %d", h.be.tierSpills)
	}
}

// A fork of a pool still materializing waits for it instead of failing (issue 25).
func TestForkWaitsForMaterializingParent(t *testing.T) {
	cfg := poolCfg()
	cfg.MaxPools = 4
	h := newHarness(t, cfg)
	root := seqTokens(1, 100) // > NBatch: several steps to materialize
	r, rt, err := h.tryCreatePool(PoolSpec{Tokens: root})
	if err != nil || rt == 0 {
		t.Fatalf("root: %v task %d", err, rt)
	}
	child := append(slices.Clone(root), 300, 301)
	c, ct, err := h.tryCreatePool(PoolSpec{HasParent: true, Parent: r, D: 100, Tokens: child})
	if err != nil || ct == 0 {
		t.Fatalf("fork of a materializing pool: %v (task %d)", err, ct)
	}
	h.run()
	for _, task := range []TaskID{rt, ct} {
		if ev, ok := h.done(task); !ok || ev.Err != nil {
			t.Fatalf("materialization %d: %+v", task, ev)
		}
	}
	if got := h.be.tokens(h.poolSeq(c)); !slices.Equal(got, child) {
		t.Fatalf("child holds %v", got)
	}
	h.checkAccounting()
	// Cancelling a parent's materialization takes the waiting fork with it.
	r2, rt2, _ := h.tryCreatePool(PoolSpec{Tokens: seqTokens(500, 100)})
	_, ct2, err := h.tryCreatePool(PoolSpec{HasParent: true, Parent: r2, D: 50, Tokens: append(seqTokens(500, 50), 1)})
	if err != nil {
		t.Fatal(err)
	}
	h.cancel(rt2)
	h.run()
	if ev, ok := h.done(ct2); !ok || ev.Err == nil {
		t.Fatalf("fork of a cancelled parent: %+v", ev)
	}
	h.checkAccounting()
}

// Recovered pools (a restart) come back under their ids, evicted; a pinned one is
// restored at once; new ids start above the floor.
func TestRecoverPools(t *testing.T) {
	cfg := tierCfg()
	cfg.TierRecord, cfg.PoolIDFloor = true, 1<<20
	h := newHarness(t, cfg)
	root := seqTokens(1, 30)
	h.be.tier[5] = slices.Clone(root)
	h.be.tier[6] = seqTokens(400, 5)
	if r := h.send(RecoverPool{ID: 5, Tokens: root, Pin: true, InTier: true}); r.Err != nil {
		t.Fatal(r.Err)
	}
	child := append(slices.Clone(root), seqTokens(400, 5)...)
	if r := h.send(RecoverPool{ID: 6, Parent: 5, D: 30, Tokens: child, InTier: true}); r.Err != nil {
		t.Fatal(r.Err)
	}
	if r := h.send(RecoverPool{ID: 7, Parent: 99, Tokens: root}); r.Err == nil {
		t.Fatal("a pool whose parent was not recovered")
	}
	h.run()
	if info, _ := h.s.Pool(5); info.Residency != "resident" || !info.UserPinned {
		t.Fatalf("pinned recovered pool: %+v", info)
	}
	if info, _ := h.s.Pool(6); info.Residency != "evicted" {
		t.Fatalf("unpinned recovered pool: %s", info.Residency)
	}
	prompt := append(slices.Clone(child), 3)
	tid := h.submit(Request{Prompt: prompt, HasPool: true, PoolID: 6, MaxTokens: 3})
	h.run()
	if got, want := h.text(tid), expectedText(t, prompt, 3); got != want || h.s.tierRestores != 2 {
		t.Fatalf("attach to a recovered child: %q, want %q (restores %d)", got, want, h.s.tierRestores)
	}
	if id := h.createPool(PoolSpec{Tokens: seqTokens(900, 4)}); id != 1<<20+1 {
		t.Fatalf("new pool id %d, want above the floor", id)
	}
	h.checkAccounting()
}

// TestRecoverPoolsWithoutKV (issue 45): recorded pools whose KV entries did not verify
// come back all the same and are built again: a pinned root by a prefill, a child whose
// own entry verified by a restore onto the prefilled parent, a child whose entry did
// not by a prefill of its own cells only, from the parent's. Each is recorded again
// (the driver writes the missing entries), with its admission policy when one was set,
// and an attach to each gives the cold text.
func TestRecoverPoolsWithoutKV(t *testing.T) {
	cfg := tierCfg()
	cfg.TierRecord, cfg.PoolIDFloor = true, 1<<20
	h := newHarness(t, cfg)
	root := seqTokens(1, 30)
	c6 := append(slices.Clone(root), seqTokens(400, 5)...)
	c7 := append(slices.Clone(root[:20]), seqTokens(600, 8)...)
	h.be.tier[6] = seqTokens(400, 5)
	for _, m := range []RecoverPool{{ID: 5, Tokens: root, Pin: true}, {ID: 6, Parent: 5, D: 30, Tokens: c6, Pin: true, InTier: true},
		{ID: 7, Parent: 5, D: 20, Tokens: c7, Pin: true}} {
		if r := h.send(m); r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	pol := admission.DefaultPolicy()
	pol.TargetTPS = 4
	if r := h.send(SetAdmission{Pool: 7, Patch: admission.Replace(pol)}); r.Err != nil {
		t.Fatal(r.Err)
	}
	from := len(h.be.batches)
	h.run()
	prefilled := map[int]int{5: 30, 6: 0, 7: 8}
	for id, n := range prefilled {
		p, _ := h.s.pools.Get(id)
		if info, _ := h.s.Pool(id); info.Residency != "resident" || !info.UserPinned {
			t.Fatalf("recovered pool %d: %+v", id, info)
		}
		if got := h.prefilledFor(p.Seq, from); got != n {
			t.Fatalf("pool %d: %d cells prefilled, want %d", id, got, n)
		}
	}
	if h.s.tierRestores != 1 || h.s.tierMisses != 0 {
		t.Fatalf("restores %d misses %d, want the one child's", h.s.tierRestores, h.s.tierMisses)
	}
	recorded := map[int]*admission.Policy{}
	for _, op := range h.be.records {
		recorded[op.Pool] = op.Admission
	}
	if len(recorded) != 3 || recorded[5] != nil || recorded[7] == nil || recorded[7].TargetTPS != 4 {
		t.Fatalf("recorded again: %v", recorded)
	}
	for _, x := range []struct {
		id   int
		toks []Token
	}{{5, root}, {6, c6}, {7, c7}} {
		prompt := append(slices.Clone(x.toks), 3)
		tid := h.submit(Request{Prompt: prompt, HasPool: true, PoolID: x.id, MaxTokens: 3})
		h.run()
		if got, want := h.text(tid), expectedText(t, prompt, 3); got != want {
			t.Fatalf("attach to recovered pool %d: %q, want %q", x.id, got, want)
		}
	}
	h.checkAccounting()
}

// A pool restored beside a decoding request, into exactly the cells that were free: the
// restore writes them before the batch runs, so the decode token must evict a victim
// (an idle cached sequence) for its cell rather than find the cache full in the batch.
// (Plan counted the restore's cells for its first free count, but not when it asked the
// KV-cache manager for more: the manager saw them free, took nothing, and the batch
// failed: "no KV slot".)
func TestDecodeBesideAPendingRestoreEvicts(t *testing.T) {
	cfg := spillCfg()
	cfg.NCtx, cfg.Parallel = 64, 3
	h := newHarness(t, cfg)
	prefix := seqTokens(100, 24)
	id := h.createPool(PoolSpec{Tokens: prefix})
	if err := h.evictPool(id); err != nil { // to the tier
		t.Fatal(err)
	}
	h.turn(Request{Prompt: seqTokens(300, 20), MaxTokens: 1}) // a cached sequence: a victim
	dec := h.submit(Request{Prompt: seqTokens(500, 10), MaxTokens: 30})
	for h.s.kv.Room(0) > len(prefix) {
		h.step()
	}
	att := h.submit(Request{Prompt: append(slices.Clone(prefix), 1), HasPool: true, PoolID: id, MaxTokens: 2})
	h.run()
	for _, x := range []TaskID{dec, att} {
		if ev, ok := h.done(x); !ok || ev.Err != nil {
			t.Fatalf("task %d beside a restore into the last free cells: %+v", x, ev)
		}
	}
	if ev, _ := h.done(dec); ev.Stats.PredictedN != 30 || h.be.tierRestores != 1 {
		t.Fatalf("the decoding request: %+v, %d restores; want all 30 tokens and the pool restored", ev.Stats, h.be.tierRestores)
	}
}
