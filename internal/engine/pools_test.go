package engine

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/pool"
)

func poolCfg() Config {
	return Config{NCtx: 1024, Parallel: 4, MaxPools: 3, NBatch: 32, MaxQueue: 8, PoolGrace: time.Second, BytesPerCell: 100}
}

// poolSeq is the KV sequence a pool lives on (its public id is a different number).
func (h *harness) poolSeq(id int) int {
	h.t.Helper()
	p, err := h.s.pools.Get(id)
	if err != nil {
		h.t.Fatal(err)
	}
	return p.Seq
}

// createPool creates a pool and steps until it is materialized.
func (h *harness) createPool(spec PoolSpec) int {
	h.t.Helper()
	id, task, err := h.tryCreatePool(spec)
	if err != nil {
		h.t.Fatalf("create pool: %v", err)
	}
	h.collect()
	if task == 0 {
		return id
	}
	for i := 0; i < 1000; i++ {
		if ev, ok := h.done(task); ok {
			if ev.Err != nil || ev.Pool != id {
				h.t.Fatalf("materialize: %+v", ev)
			}
			return id
		}
		h.step()
	}
	h.t.Fatal("pool never materialized")
	return 0
}

// checkAccounting asserts that the scheduler's ownership count equals the physical
// cells of the fake cache: every shared cell counted once.
func (h *harness) checkAccounting() {
	h.t.Helper()
	if got, want := h.s.kv.Used(), h.be.cells(); got != want {
		h.t.Fatalf("ownership accounting says %d cells, the cache holds %d", got, want)
	}
	st := h.s.Pools()
	var own int64
	for _, p := range st.Pools {
		own += p.OwnKVBytes
		for _, ss := range p.Sessions {
			own += ss.MarginalKVBytes
		}
	}
	for _, sl := range h.s.Slots() {
		if sl.PoolID == nil {
			own += int64(sl.Own) * st.BytesPerCell
		}
	}
	if own != int64(h.be.cells())*st.BytesPerCell {
		h.t.Fatalf("Σ own bytes %d != cells %d × %d", own, h.be.cells(), st.BytesPerCell)
	}
}

func TestPoolMaterializesWithoutSampling(t *testing.T) {
	h := newHarness(t, poolCfg())
	prefix := seqTokens(1, 70)
	id := h.createPool(PoolSpec{Tokens: prefix})
	if seq := h.poolSeq(id); id != 1 || seq != 4 {
		t.Fatalf("first pool: id %d on sequence %d, want id 1 on sequence 4 (the first above the 4 session sequences)", id, seq)
	}
	for _, b := range h.be.batches {
		for _, e := range b {
			if e.Sample {
				t.Fatalf("materialization sampled: %+v", e)
			}
		}
	}
	if len(h.be.batches) != 3 { // 70 tokens in chunks of 32
		t.Fatalf("prefilled in %d steps, want 3 chunks", len(h.be.batches))
	}
	if got := h.be.tokens(h.poolSeq(id)); !slices.Equal(got, prefix) {
		t.Fatalf("pool sequence holds %v", got)
	}
	info, _ := h.s.Pool(id)
	if info.State != "resident" || info.PrefixLen != 70 || info.OwnKVBytes != 7000 || info.Parent != nil {
		t.Fatalf("pool info %+v", info)
	}
	h.checkAccounting()
}

func TestAttachSharesCellsAndMatchesUnpooled(t *testing.T) {
	h := newHarness(t, poolCfg())
	prefix := seqTokens(1, 60)
	id := h.createPool(PoolSpec{Tokens: prefix})
	var ids []TaskID
	var prompts [][]Token
	for i := range 3 {
		prompt := append(slices.Clone(prefix), Token(100+i), Token(200+i))
		prompts = append(prompts, prompt)
		ids = append(ids, h.submit(Request{Prompt: prompt, HasPool: true, PoolID: id, SessionID: "s" + string(rune('a'+i)), MaxTokens: 5}))
	}
	h.step()
	h.checkAccounting()
	h.run()
	for i, tid := range ids {
		ev, _ := h.done(tid)
		if ev.Stats.CacheN != 60 || ev.Stats.PromptN != 2 || ev.Stats.Pool != id {
			t.Fatalf("session %d stats %+v, want cache 60, prompt 2 on pool %d", i, ev.Stats, id)
		}
		if got, want := h.text(tid), expectedText(t, prompts[i], 5); got != want {
			t.Fatalf("pooled output %q differs from unpooled %q", got, want)
		}
	}
	// 60 pool cells + 3 × (2 prompt + 4 decoded) own cells; a copy per session would be 3 × 60 more.
	if got := h.be.cells(); got != 60+3*6 {
		t.Fatalf("%d physical cells, want %d", got, 60+18)
	}
	h.checkAccounting()
	info, _ := h.s.Pool(id)
	if len(info.Sessions) != 3 || info.SubtreeKVBytes != (60+18)*100 || !info.Pinned || info.UserPinned {
		t.Fatalf("pool status %+v", info)
	}
}

func TestAutoPDivergenceAndExplicitP(t *testing.T) {
	h := newHarness(t, poolCfg())
	prefix := seqTokens(1, 40)
	id := h.createPool(PoolSpec{Tokens: prefix})
	diverge := append(slices.Clone(prefix[:25]), 999, 998)
	a := h.submit(Request{Prompt: diverge, HasPool: true, PoolID: id, MaxTokens: 3})
	h.run()
	if ev, _ := h.done(a); ev.Stats.CacheN != 25 {
		t.Fatalf("diverging at 25: cache_n %d", ev.Stats.CacheN)
	}
	if got, want := h.text(a), expectedText(t, diverge, 3); got != want {
		t.Fatalf("branch-point attach output %q, want %q", got, want)
	}
	exact := slices.Clone(prefix)
	b := h.submit(Request{Prompt: exact, HasPool: true, PoolID: id, MaxTokens: 3})
	h.run()
	if ev, _ := h.done(b); ev.Stats.CacheN != 39 {
		t.Fatalf("prompt equal to the pool: cache_n %d, want L-1 = 39 (the last token is decoded for logits)", ev.Stats.CacheN)
	}
	ten := 10
	c := h.submit(Request{Prompt: append(slices.Clone(prefix), 5), HasPool: true, PoolID: id, SharedPrefixN: &ten, MaxTokens: 2})
	h.run()
	if ev, _ := h.done(c); ev.Stats.CacheN != 10 {
		t.Fatalf("explicit P 10: cache_n %d", ev.Stats.CacheN)
	}
	tooMany := 30
	if _, err := h.trySubmit(Request{Prompt: diverge, HasPool: true, PoolID: id, SharedPrefixN: &tooMany}); !errors.Is(err, pool.ErrBadRequest) {
		t.Fatalf("explicit P beyond the match: %v", err)
	}
	if _, err := h.trySubmit(Request{Prompt: diverge, HasPool: true, PoolID: 77}); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("unknown pool: %v", err)
	}
	h.checkAccounting()
}

func TestForkExtendAndBranch(t *testing.T) {
	h := newHarness(t, poolCfg())
	root := seqTokens(1, 50)
	p0 := h.createPool(PoolSpec{Tokens: root})
	ext := append(slices.Clone(root), seqTokens(300, 20)...)
	before := len(h.be.batches)
	p1 := h.createPool(PoolSpec{HasParent: true, Parent: p0, D: 50, Tokens: ext})
	if first := h.be.batches[before][0]; first.Pos != 50 || first.Seq != h.poolSeq(p1) {
		t.Fatalf("extend child prefilled from %+v, want position 50 on its own sequence", first)
	}
	branch := append(slices.Clone(root[:30]), seqTokens(500, 10)...)
	p2 := h.createPool(PoolSpec{HasParent: true, Parent: p0, D: 30, Tokens: branch})
	// Physical cells: root 50 + extend's 20 + branch's 10; the shared parts are not copied.
	if got := h.be.cells(); got != 80 {
		t.Fatalf("%d cells, want 80", got)
	}
	h.checkAccounting()
	st := h.s.Pools()
	if st.TreeDepth != 2 || len(st.Pools) != 3 {
		t.Fatalf("tree %+v", st)
	}
	r, _ := h.s.Pool(p0)
	if !slices.Equal(r.Children, []int{p1, p2}) || !r.Pinned {
		t.Fatalf("root children %v pinned %v", r.Children, r.Pinned)
	}
	b, _ := h.s.Pool(p2)
	if *b.Parent != p0 || b.BranchPos != 30 || b.PrefixLen != 40 || b.OwnLen != 10 {
		t.Fatalf("branch info %+v", b)
	}
	// Sessions on both children produce what unpooled prompts produce.
	for _, c := range []struct {
		id     int
		prompt []Token
	}{{p1, append(slices.Clone(ext), 7)}, {p2, append(slices.Clone(branch), 7)}} {
		tid := h.submit(Request{Prompt: c.prompt, HasPool: true, PoolID: c.id, MaxTokens: 4})
		h.run()
		ev, _ := h.done(tid)
		if ev.Stats.CacheN != len(c.prompt)-1 {
			t.Fatalf("attach to child %d: cache_n %d", c.id, ev.Stats.CacheN)
		}
		if got, want := h.text(tid), expectedText(t, c.prompt, 4); got != want {
			t.Fatalf("child %d output %q, want %q", c.id, got, want)
		}
	}
	// Contract violations leave nothing behind.
	bad := slices.Clone(branch)
	bad[12] = 4242
	_, _, err := h.tryCreatePool(PoolSpec{HasParent: true, Parent: p0, D: 30, Tokens: bad})
	if !errors.Is(err, pool.ErrPrefixMismatch) || !strings.Contains(err.Error(), "token 12") {
		t.Fatalf("mismatch at 12: %v", err)
	}
	for _, spec := range []PoolSpec{
		{HasParent: true, Parent: p0, D: 51, Tokens: ext},
		{HasParent: true, Parent: p0, D: -1, Tokens: ext},
		{HasParent: true, Parent: p0, D: 50, Tokens: root},
		{Tokens: nil},
	} {
		if _, _, err := h.tryCreatePool(spec); !errors.Is(err, pool.ErrBadRequest) {
			t.Fatalf("spec D=%d len=%d: %v", spec.D, len(spec.Tokens), err)
		}
	}
	if h.s.Pools().SeqIDsUsed != 3+0 || h.s.pools.FreeIDs() != 0 {
		t.Fatalf("a failed fork leaked a sequence id: %+v", h.s.Pools())
	}
	h.checkAccounting()
}

func TestReleaseOrderReclaimAndSeqExhaustion(t *testing.T) {
	h := newHarness(t, poolCfg())
	root := seqTokens(1, 20)
	p0 := h.createPool(PoolSpec{Tokens: root})
	p1 := h.createPool(PoolSpec{HasParent: true, Parent: p0, D: 20, Tokens: append(slices.Clone(root), 9, 9)})
	p2 := h.createPool(PoolSpec{Tokens: seqTokens(400, 10)})
	if _, _, err := h.tryCreatePool(PoolSpec{Tokens: seqTokens(1, 5)}); !errors.Is(err, pool.ErrNoSeqIDs) {
		t.Fatalf("4th pool with max 3: %v", err)
	}
	if err := h.releasePool(p0); !errors.Is(err, pool.ErrHasChildren) {
		t.Fatalf("release of a parent: %v", err)
	}
	if err := h.releasePool(p1); err != nil {
		t.Fatal(err)
	}
	if _, err := h.trySubmit(Request{Prompt: append(slices.Clone(root), 9, 9, 1), HasPool: true, PoolID: p1}); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("attach to a released pool: %v", err)
	}
	h.step()
	if h.be.cells() != 32 {
		t.Fatalf("released pool reclaimed before its grace time: %d cells", h.be.cells())
	}
	h.now = h.now.Add(2 * time.Second)
	h.step()
	if h.be.cells() != 30 {
		t.Fatalf("after grace: %d cells, want 30", h.be.cells())
	}
	if err := h.releasePool(p0); err != nil {
		t.Fatalf("release root after its child: %v", err)
	}
	h.now = h.now.Add(2 * time.Second)
	h.step()
	if h.be.cells() != 10 {
		t.Fatalf("root not reclaimed: %d cells", h.be.cells())
	}
	// The freed sequence ids and cells are reusable; the public ids are not, so an id a
	// client kept can never silently name a different prefix.
	seq0 := 4 // p0 took the first pool sequence
	p3 := h.createPool(PoolSpec{Tokens: seqTokens(700, 12)})
	if p3 == p0 || p3 == p1 || p3 == p2 || h.poolSeq(p3) != seq0 {
		t.Fatalf("new pool got id %d on sequence %d; want a fresh id on the lowest freed sequence %d", p3, h.poolSeq(p3), seq0)
	}
	for _, stale := range []int{p0, p1} {
		if _, err := h.s.Pool(stale); !errors.Is(err, pool.ErrNotFound) {
			t.Fatalf("stale pool id %d: %v, want not found", stale, err)
		}
		if _, err := h.trySubmit(Request{Prompt: append(slices.Clone(root), 9, 9, 1), HasPool: true, PoolID: stale}); !errors.Is(err, pool.ErrNotFound) {
			t.Fatalf("attach by stale id %d: %v, want not found", stale, err)
		}
	}
	h.checkAccounting()
}

func TestReleasedPoolWaitsForRunningSession(t *testing.T) {
	h := newHarness(t, poolCfg())
	root := seqTokens(1, 20)
	id := h.createPool(PoolSpec{Tokens: root})
	tid := h.submit(Request{Prompt: append(slices.Clone(root), 3), HasPool: true, PoolID: id, SessionID: "x", MaxTokens: 6})
	h.step()
	h.step()
	if err := h.releasePool(id); err != nil {
		t.Fatal(err)
	}
	h.now = h.now.Add(5 * time.Second)
	h.step()
	if _, err := h.s.Pool(id); err != nil {
		t.Fatalf("pool reclaimed under a running session: %v", err)
	}
	h.run()
	ev, _ := h.done(tid)
	if ev.Err != nil || ev.Stats.PredictedN != 6 {
		t.Fatalf("session on a released pool: %+v", ev)
	}
	if got, want := h.text(tid), expectedText(t, append(slices.Clone(root), 3), 6); got != want {
		t.Fatalf("output %q, want %q", got, want)
	}
	h.now = h.now.Add(5 * time.Second)
	h.step()
	if _, err := h.s.Pool(id); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("pool not reclaimed after its last session: %v", err)
	}
	if h.be.cells() != 0 {
		t.Fatalf("%d cells leaked", h.be.cells())
	}
}

func TestPinEvictFlushRestore(t *testing.T) {
	h := newHarness(t, poolCfg())
	root := seqTokens(1, 30)
	id := h.createPool(PoolSpec{Tokens: root, Pin: true})
	prompt := append(slices.Clone(root), 5, 6)
	h.submit(Request{Prompt: prompt, HasPool: true, PoolID: id, SessionID: "s", MaxTokens: 2})
	h.run()
	if err := h.evictPool(id); !errors.Is(err, pool.ErrConflict) {
		t.Fatalf("evict of a pinned pool: %v", err)
	}
	if err := h.pinPool(id, false); err != nil {
		t.Fatal(err)
	}
	if err := h.evictPool(id); !errors.Is(err, pool.ErrConflict) {
		t.Fatalf("evict with an attached session: %v", err)
	}
	n, cells, err := h.flushPool(id)
	if err != nil || n != 1 || cells != 3 {
		t.Fatalf("flush: %d sessions %d cells %v", n, cells, err)
	}
	if err := h.evictPool(id); err != nil {
		t.Fatal(err)
	}
	h.step()
	if h.be.cells() != 0 {
		t.Fatalf("evicted pool holds %d cells", h.be.cells())
	}
	if info, _ := h.s.Pool(id); info.Residency != "evicted" || len(info.Tokens) != 30 {
		t.Fatalf("evicted info %+v", info)
	}
	// Attaching restores it transparently, and the output is unchanged.
	tid := h.submit(Request{Prompt: prompt, HasPool: true, PoolID: id, MaxTokens: 4})
	h.run()
	ev, _ := h.done(tid)
	if ev.Err != nil || ev.Stats.CacheN != 30 {
		t.Fatalf("attach after evict: %+v", ev)
	}
	if got, want := h.text(tid), expectedText(t, prompt, 4); got != want {
		t.Fatalf("output after restore %q, want %q", got, want)
	}
	h.checkAccounting()
}

func TestFromSessionZeroCopyAndSurvivesSession(t *testing.T) {
	h := newHarness(t, poolCfg())
	a := h.submit(Request{Prompt: seqTokens(1, 25), SessionID: "main", MaxTokens: 5})
	h.run()
	_ = a
	cellsBefore, batchesBefore := h.be.cells(), len(h.be.batches)
	id := h.createPool(PoolSpec{FromSession: "main"})
	if h.be.cells() != cellsBefore || len(h.be.batches) != batchesBefore {
		t.Fatal("from_session copied or prefilled")
	}
	h.step() // applies the seq_cp
	info, _ := h.s.Pool(id)
	if info.PrefixLen != 29 || info.Parent != nil || len(info.Sessions) != 1 || info.Sessions[0].SuffixNTokens != 0 {
		t.Fatalf("snapshot info %+v", info)
	}
	h.checkAccounting()
	// Fork from the session again after it decoded more: zero-copy child at D = 29.
	snap := info.Tokens
	b := h.submit(Request{Prompt: append(slices.Clone(snap), 77), SessionID: "main", HasPool: true, PoolID: id, MaxTokens: 3})
	h.run()
	_ = b
	child := h.createPool(PoolSpec{HasParent: true, Parent: id, D: 29, FromSession: "main"})
	h.step()
	ci, _ := h.s.Pool(child)
	if *ci.Parent != id || ci.BranchPos != 29 || ci.OwnLen != ci.PrefixLen-29 {
		t.Fatalf("child from session %+v", ci)
	}
	h.checkAccounting()
	// The session goes away; the pools stay and serve a new session correctly.
	h.s.evictSlot(h.s.bySession["main"])
	h.step()
	prompt := append(slices.Clone(ci.Tokens), 8)
	tid := h.submit(Request{Prompt: prompt, HasPool: true, PoolID: child, MaxTokens: 3})
	h.run()
	ev, _ := h.done(tid)
	if ev.Stats.CacheN != len(prompt)-1 {
		t.Fatalf("attach to snapshot pool: %+v", ev.Stats)
	}
	if got, want := h.text(tid), expectedText(t, prompt, 3); got != want {
		t.Fatalf("output %q, want %q", got, want)
	}
	h.checkAccounting()
	if _, _, err := h.tryCreatePool(PoolSpec{FromSession: "nobody"}); !errors.Is(err, ErrSessionNotFound) {
		t.Fatalf("unknown session: %v", err)
	}
}

func TestCancelMaterializationLeavesNothing(t *testing.T) {
	h := newHarness(t, poolCfg())
	id, task, err := h.tryCreatePool(PoolSpec{Tokens: seqTokens(1, 100)})
	if err != nil {
		t.Fatal(err)
	}
	h.step()
	h.cancel(task)
	h.collect()
	h.step()
	if _, err := h.s.Pool(id); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("cancelled pool still exists: %v", err)
	}
	if h.be.cells() != 0 || h.s.pools.FreeIDs() != 3 {
		t.Fatalf("cancel leaked: %d cells, %d free ids", h.be.cells(), h.s.pools.FreeIDs())
	}
}

func TestPressureEvictsIdleUnpinnedPoolsOnly(t *testing.T) {
	cfg := poolCfg()
	cfg.NCtx = 100
	h := newHarness(t, cfg)
	pinned := h.createPool(PoolSpec{Tokens: seqTokens(1, 30), Pin: true})
	loose := h.createPool(PoolSpec{Tokens: seqTokens(100, 30)})
	h.now = h.now.Add(2 * time.Second) // past the grace time
	tid := h.submit(Request{Prompt: seqTokens(500, 50), MaxTokens: 2})
	h.run()
	if ev, _ := h.done(tid); ev.Err != nil {
		t.Fatalf("request under pressure: %+v", ev)
	}
	pi, _ := h.s.Pool(pinned)
	li, _ := h.s.Pool(loose)
	if pi.Residency != "resident" || li.Residency != "evicted" {
		t.Fatalf("pinned %s, unpinned %s: only the unpinned pool may be evicted", pi.Residency, li.Residency)
	}
	h.checkAccounting()
}

// Released children wait only for their grace time or last session; they must not make
// the parent's release answer 409 meanwhile. Everything is reclaimed in the end.
func TestReleasedChildrenDoNotBlockParentRelease(t *testing.T) {
	h := newHarness(t, poolCfg())
	root := seqTokens(1, 20)
	p0 := h.createPool(PoolSpec{Tokens: root})
	p1 := h.createPool(PoolSpec{HasParent: true, Parent: p0, D: 20, Tokens: append(slices.Clone(root), 7, 8)})
	p2 := h.createPool(PoolSpec{HasParent: true, Parent: p0, D: 10, Tokens: append(slices.Clone(root[:10]), 9)})
	if err := h.releasePool(p1); err != nil {
		t.Fatal(err)
	}
	if err := h.releasePool(p0); !errors.Is(err, pool.ErrHasChildren) || !strings.Contains(err.Error(), fmt.Sprint([]int{p2})) {
		t.Fatalf("release with a live child %d: %v, want 409 naming only the live child", p2, err)
	}
	if err := h.releasePool(p2); err != nil {
		t.Fatal(err)
	}
	if err := h.releasePool(p0); err != nil {
		t.Fatalf("release of a root whose children are all released: %v", err)
	}
	h.step()
	if h.be.cells() != 23 {
		t.Fatalf("reclaimed within the grace time: %d cells, want 23", h.be.cells())
	}
	h.now = h.now.Add(2 * time.Second)
	h.step()
	h.step() // children first, then the parent on the next pass
	if h.be.cells() != 0 || h.s.pools.Len() != 0 || h.s.pools.FreeIDs() != 3 {
		t.Fatalf("after grace: %d cells, %d pools, %d free sequence ids", h.be.cells(), h.s.pools.Len(), h.s.pools.FreeIDs())
	}
}

// Fork answers like attach: a released parent is not found, an evicted one is restored
// transparently before the child is built on it.
func TestForkReleasedIsNotFoundForkEvictedRestores(t *testing.T) {
	h := newHarness(t, poolCfg())
	root := seqTokens(1, 30)
	p0 := h.createPool(PoolSpec{Tokens: root})
	gone := h.createPool(PoolSpec{Tokens: seqTokens(100, 5)})
	if err := h.releasePool(gone); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.tryCreatePool(PoolSpec{HasParent: true, Parent: gone, D: 5, Tokens: append(seqTokens(100, 5), 1)}); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("fork of a released pool: %v, want not found", err)
	}
	if err := h.evictPool(p0); err != nil {
		t.Fatal(err)
	}
	h.step()
	if h.be.cells() != 5 {
		t.Fatalf("evicted root still holds cells: %d", h.be.cells())
	}
	child := append(slices.Clone(root), 40, 41, 42)
	c := h.createPool(PoolSpec{HasParent: true, Parent: p0, D: 30, Tokens: child})
	if got := h.be.tokens(h.poolSeq(c)); !slices.Equal(got, child) {
		t.Fatalf("child of a restored pool holds %v, want %v", got, child)
	}
	if info, _ := h.s.Pool(p0); info.Residency != "resident" {
		t.Fatalf("parent after fork: %s, want resident (restored)", info.Residency)
	}
	tid := h.submit(Request{Prompt: append(slices.Clone(child), 5), HasPool: true, PoolID: c, MaxTokens: 3})
	h.run()
	if got, want := h.text(tid), expectedText(t, append(slices.Clone(child), 5), 3); got != want {
		t.Fatalf("attach to the fork: %q, want %q", got, want)
	}
	h.checkAccounting()
}

// TestEventsNameThePool: every event of a request attached to a pool names the pool
// (issue 30: a streamed reply sends X-Pool-Id with its headers, before its first
// chunk, so it must know the pool from the first event on); an unpooled request's
// events name none.
func TestEventsNameThePool(t *testing.T) {
	h := newHarness(t, poolCfg())
	id := h.createPool(PoolSpec{Tokens: seqTokens(1, 20)})
	pooled := h.submit(Request{Prompt: append(seqTokens(1, 20), 99), HasPool: true, PoolID: id, MaxTokens: 3})
	plain := h.submit(Request{Prompt: seqTokens(200, 10), MaxTokens: 3})
	h.run()
	for task, want := range map[TaskID]int{pooled: id, plain: 0} {
		evs := h.events[task]
		if len(evs) < 2 {
			t.Fatalf("task %d: %d events, want tokens and an end", task, len(evs))
		}
		for i, ev := range evs {
			if ev.Err != nil || ev.Pool != want {
				t.Fatalf("task %d event %d: pool %d, err %v; want pool %d", task, i, ev.Pool, ev.Err, want)
			}
		}
	}
}

// TestPoolByKeyPrefersResident: two live pools with one prefix (created twice, the
// first since evicted): the key names the resident one, so a pool_key request attaches
// at once instead of restoring the evicted one.
func TestPoolByKeyPrefersResident(t *testing.T) {
	h := newHarness(t, poolCfg())
	toks := seqTokens(1, 20)
	old := h.createPool(PoolSpec{Tokens: toks})
	if err := h.evictPool(old); err != nil {
		t.Fatal(err)
	}
	fresh := h.createPool(PoolSpec{Tokens: toks})
	key := pool.RollingHash(toks)[len(toks)-1]
	if id, ok := h.s.PoolByKey(key); !ok || id != fresh {
		t.Fatalf("PoolByKey: %d %v, want the resident pool %d (not the evicted %d)", id, ok, fresh, old)
	}
	task := h.submit(Request{Prompt: append(slices.Clone(toks), 99), PoolKey: &key, MaxTokens: 1})
	h.run()
	if ev, _ := h.done(task); ev.Err != nil || ev.Stats.Pool != fresh || ev.Stats.CacheN != 20 {
		t.Fatalf("key request: %+v, want attached to pool %d with 20 cached", ev, fresh)
	}
	if p, _ := h.s.pools.Get(old); p.State != pool.Evicted {
		t.Fatalf("the evicted pool was %s, want it left evicted", p.State)
	}
}

// TestRecurrentStateBytesReported: on a model with recurrent state (Config.
// RecurrentBytesPerSeq from llama.cpp's recurrent cache) every sequence holding tokens
// reports one copy — a resident pool, a session attached to it (its own copy, unlike the
// pool's KV cells it shares), a /slots entry — beside its KV bytes; an evicted pool holds
// none.
func TestRecurrentStateBytesReported(t *testing.T) {
	cfg := poolCfg()
	cfg.RecurrentBytesPerSeq = 5000
	h := newHarness(t, cfg)
	prefix := seqTokens(1, 40)
	id := h.createPool(PoolSpec{Tokens: prefix})
	spare := h.createPool(PoolSpec{Tokens: seqTokens(2, 20)})
	h.submit(Request{Prompt: append(slices.Clone(prefix), 100, 101), HasPool: true, PoolID: id, SessionID: "s", MaxTokens: 3})
	h.run()
	if err := h.evictPool(spare); err != nil {
		t.Fatal(err)
	}
	h.step()
	st := h.s.Pools()
	if st.RecurrentBytesPerSeq != 5000 {
		t.Fatalf("recurrent bytes per sequence %d", st.RecurrentBytesPerSeq)
	}
	for _, p := range st.Pools {
		want := int64(5000)
		if p.PoolID == spare {
			want = 0
		}
		if p.RecurrentStateBytes != want {
			t.Fatalf("pool %d (%s): recurrent state %d bytes, want %d", p.PoolID, p.Residency, p.RecurrentStateBytes, want)
		}
		for _, ss := range p.Sessions {
			if ss.RecurrentStateBytes != 5000 {
				t.Fatalf("session %s: recurrent state %d bytes, want 5000", ss.SessionID, ss.RecurrentStateBytes)
			}
		}
	}
	slots := h.s.Slots()
	if len(slots) != 1 || slots[0].RecurrentStateBytes != 5000 || slots[0].Own == 0 || slots[0].OwnKVBytes != int64(slots[0].Own)*100 {
		t.Fatalf("slots %+v", slots)
	}
	h.checkAccounting()
}
