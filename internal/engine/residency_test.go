package engine

import (
	"slices"
	"testing"
	"time"
)

// trackResidency turns on the residency reports and the harness's mirror of them.
func (h *harness) trackResidency() {
	h.s.ReportResidency()
	h.mirror = map[int][]Token{}
}

// applySeqChange applies one report to the mirror as a KV-event publisher would.
func (h *harness) applySeqChange(c SeqChange) {
	h.t.Helper()
	old := h.mirror[c.Seq]
	if c.Keep > len(old) {
		h.t.Fatalf("seq %d: keep %d of the %d tokens reported", c.Seq, c.Keep, len(old))
	}
	if c.Keep == len(old) && len(c.Tokens) == 0 {
		h.t.Fatalf("seq %d: an empty report (nothing changed)", c.Seq)
	}
	h.reported += len(c.Tokens)
	n := append(slices.Clone(old[:c.Keep]), c.Tokens...)
	if len(n) == 0 {
		delete(h.mirror, c.Seq)
		return
	}
	h.mirror[c.Seq] = n
}

// checkResidency: after every step the reports describe exactly what the cell tree
// holds in every reusable sequence, and nothing else. (The tree leads the fake cache by
// the operations planned but not yet applied; the fuzz harness checks the two agree
// where they must.)
func (h *harness) checkResidency() {
	h.t.Helper()
	for q := range MaxSeqs {
		var want []Token
		if h.s.reportable(q) {
			want = h.s.kv.Cells().Tokens(q)
		}
		if got := h.mirror[q]; !slices.Equal(got, want) {
			h.t.Fatalf("seq %d: reported %d tokens %v, the cache holds %d: %v", q, len(got), got, len(want), want)
		}
	}
}

// TestResidencyReportsEveryReusablePrefix: with the prefix cache on, agents sharing a
// system prompt, a session's next turn, a pool and sequences evicted under cell
// pressure are all reported as they change (the harness checks the mirror after every
// step); a session's next turn reports only what it adds, not the whole sequence again.
func TestResidencyReportsEveryReusablePrefix(t *testing.T) {
	cfg := Config{NCtx: 200, Parallel: 3, MaxPools: 1, NBatch: 32, MaxQueue: 8, SessionTTL: time.Hour, PoolGrace: time.Second, PrefixCache: true}
	h := newHarness(t, cfg)
	h.trackResidency()
	system := seqTokens(1, 40)
	for i := range 3 {
		h.submit(Request{Prompt: append(slices.Clone(system), Token(500+i)), MaxTokens: 6, SessionID: string(rune('A' + i))})
	}
	h.run()
	if len(h.mirror) != 3 {
		t.Fatalf("after three agents: %d sequences reported, want 3", len(h.mirror))
	}
	for q, toks := range h.mirror {
		if !slices.Equal(toks[:40], system) || len(toks) != 41+5 {
			t.Fatalf("seq %d reported %v, want the system prompt, the question and 5 decoded tokens", q, toks)
		}
	}
	a := h.s.bySession["A"].seq
	lenA, before := len(h.mirror[a]), h.reported
	h.submit(Request{Prompt: append(slices.Clone(h.mirror[a]), 700, 701), MaxTokens: 4, SessionID: "A"})
	h.run()
	if added := h.reported - before; len(h.mirror[a]) != lenA+2+3 || added != 2+3 {
		t.Fatalf("A's second turn: %d tokens reported in all, A holds %d; want 5 new tokens after %d", added, len(h.mirror[a]), lenA)
	}
	// A pool over the system prompt, then a long prompt that needs most of the cache:
	// idle sequences are evicted and reported gone.
	h.createPool(PoolSpec{Tokens: seqTokens(1, 60)})
	h.run()
	if p := h.mirror[cfg.Parallel]; len(p) != 60 {
		t.Fatalf("pool sequence reported with %d tokens, want 60", len(p))
	}
	h.submit(Request{Prompt: seqTokens(900, 150), MaxTokens: 2})
	h.run()
	held := 0
	for _, toks := range h.mirror {
		held += len(toks)
	}
	if held > cfg.NCtx+3*len(system) {
		t.Fatalf("%d tokens reported resident in a %d-cell cache", held, cfg.NCtx)
	}
	if h.s.cacheEvictions == 0 && len(h.mirror) == 5 {
		t.Fatal("the long prompt evicted nothing; the test does not exercise removal")
	}
}

// TestResidencyWithoutPrefixCacheReportsPoolsOnly: with the prefix cache off a
// session's cells serve only that session, so only pools are reported, from the moment
// they are fully built until they are released.
func TestResidencyWithoutPrefixCacheReportsPoolsOnly(t *testing.T) {
	cfg := Config{NCtx: 256, Parallel: 2, MaxPools: 2, NBatch: 16, MaxQueue: 8, SessionTTL: time.Hour, PoolGrace: time.Second}
	h := newHarness(t, cfg)
	h.trackResidency()
	h.submit(Request{Prompt: seqTokens(1, 30), MaxTokens: 3, SessionID: "S"})
	h.run()
	if len(h.mirror) != 0 {
		t.Fatalf("a session reported without the prefix cache: %v", h.mirror)
	}
	id := h.createPool(PoolSpec{Tokens: seqTokens(1, 40)})
	h.run()
	p, err := h.s.pools.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	seq := p.Seq
	if got := h.mirror[seq]; !slices.Equal(got, seqTokens(1, 40)) {
		t.Fatalf("pool reported as %v", got)
	}
	if err = h.releasePool(id); err != nil {
		t.Fatal(err)
	}
	h.step()
	if _, ok := h.mirror[seq]; ok {
		t.Fatal("a released pool is still reported")
	}
}
