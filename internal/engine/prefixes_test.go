package engine

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/pool"
)

// prefixLog records PrefixObserver calls as "+pool" / "-pool".
type prefixLog struct{ calls []string }

func (l *prefixLog) PrefixStored(c PrefixChange) {
	l.calls = append(l.calls, fmt.Sprintf("+%d@%d/%d", c.Pool, c.D, len(c.Tokens)))
}
func (l *prefixLog) PrefixRemoved(c PrefixChange) {
	l.calls = append(l.calls, fmt.Sprintf("-%d@%d/%d", c.Pool, c.D, len(c.Tokens)))
}

func TestPrefixObserverFollowsResidency(t *testing.T) {
	cfg := poolCfg()
	log := &prefixLog{}
	h := newHarness(t, cfg)
	h.prefixes = log
	root := seqTokens(1, 40)
	p0 := h.createPool(PoolSpec{Tokens: root})
	p1 := h.createPool(PoolSpec{HasParent: true, Parent: p0, D: 40, Tokens: append(slices.Clone(root), seqTokens(500, 20)...)})
	want := []string{fmt.Sprintf("+%d@0/40", p0), fmt.Sprintf("+%d@40/60", p1)}
	if !slices.Equal(log.calls, want) {
		t.Fatalf("after create: %v, want %v", log.calls, want)
	}
	// Release the child: reported removed at once (nothing new may attach), and not
	// again when its cells are reclaimed after the grace time.
	if err := h.releasePool(p1); err != nil {
		t.Fatal(err)
	}
	want = append(want, fmt.Sprintf("-%d@40/60", p1))
	if !slices.Equal(log.calls, want) {
		t.Fatalf("after release: %v, want %v", log.calls, want)
	}
	h.now = h.now.Add(2 * time.Second)
	h.step()
	if _, err := h.s.Pool(p1); err == nil || !slices.Equal(log.calls, want) {
		t.Fatalf("after reclaim (pool gone: %v): %v, want %v", err, log.calls, want)
	}
	// Evict the root, then attach: removed, then stored again when restored.
	if err := h.evictPool(p0); err != nil {
		t.Fatal(err)
	}
	want = append(want, fmt.Sprintf("-%d@0/40", p0))
	if !slices.Equal(log.calls, want) {
		t.Fatalf("after evict: %v, want %v", log.calls, want)
	}
	h.submit(Request{Prompt: append(slices.Clone(root), 7), HasPool: true, PoolID: p0, MaxTokens: 2})
	h.run()
	want = append(want, fmt.Sprintf("+%d@0/40", p0))
	if !slices.Equal(log.calls, want) {
		t.Fatalf("after restore: %v, want %v", log.calls, want)
	}
	// A pool whose materialization is cancelled was never stored and is never removed.
	_, task, err := h.tryCreatePool(PoolSpec{Tokens: seqTokens(900, 100)})
	if err != nil {
		t.Fatal(err)
	}
	h.step()
	h.cancel(task)
	h.step()
	if !slices.Equal(log.calls, want) {
		t.Fatalf("abandoned pool reported: %v, want %v", log.calls, want)
	}
}

func TestPoolKeyAttachesOrRunsUnpooled(t *testing.T) {
	h := newHarness(t, poolCfg())
	root := seqTokens(1, 30)
	id := h.createPool(PoolSpec{Tokens: root})
	key := pool.RollingHash(root)[len(root)-1]
	prompt := append(slices.Clone(root), 5, 6)
	hit := h.submit(Request{Prompt: prompt, PoolKey: &key, MaxTokens: 3})
	h.run()
	ev, _ := h.done(hit)
	if ev.Err != nil || ev.Stats.Pool != id || ev.Stats.CacheN != 30 {
		t.Fatalf("pool key hit: pool %d cached %d err %v; want pool %d, 30 cached", ev.Stats.Pool, ev.Stats.CacheN, ev.Err, id)
	}
	other := key + 1 // a prefix this replica does not hold
	miss := h.submit(Request{Prompt: prompt, PoolKey: &other, MaxTokens: 3})
	h.run()
	ev2, _ := h.done(miss)
	if ev2.Err != nil || ev2.Stats.Pool != 0 || ev2.Stats.CacheN != 0 || ev2.Stats.PromptN != len(prompt) {
		t.Fatalf("unknown key: %+v; want an unpooled run prefilling all %d tokens", ev2.Stats, len(prompt))
	}
	if h.text(hit) != h.text(miss) || h.text(hit) != expectedText(t, prompt, 3) {
		t.Fatalf("pooled %q vs unpooled %q", h.text(hit), h.text(miss))
	}
	h.checkAccounting()
}
