package engine

import (
	"slices"
	"testing"

	"github.com/polykv/polykv/internal/pool"
)

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
