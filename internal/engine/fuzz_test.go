package engine

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/pool"
)

// FuzzSchedulerInvariants drives the scheduler with a random sequence of messages
// (submits with and without sessions and pools, cancels, pool creation, forks,
// releases, evictions, pins, flushes, admission policies, reservations, steps and
// clock jumps) against the fake backend,
// which fails any batch that breaks position contiguity or overflows the cache. After
// every step: ownership accounting equals the physical cells, no lifecycle verb was
// refused, sequence ids stay in range, every request the admission gate holds is a
// live task that holds no sequence, every pool's state agrees with what its sequence
// holds in the cell tree, and a pinned resident pool was not evicted. At the end, with everything cancelled, released
// and expired: no cell, session, sampler, task or pool is left.
func FuzzSchedulerInvariants(f *testing.F) {
	f.Add([]byte{4, 20, 0, 2, 0, 0, 8, 3, 1, 1, 9, 8, 8, 2, 0, 1, 5, 0, 10, 6, 0, 8, 8, 9, 3})
	f.Add([]byte{1, 0, 30, 1, 1, 30, 1, 2, 30, 1, 0, 30, 8, 8, 8, 8, 3, 0, 8})
	f.Add([]byte{4, 10, 0, 5, 0, 10, 5, 0, 3, 7, 1, 6, 0, 6, 1, 2, 0, 12, 8, 8, 9, 9, 8, 6, 0})
	f.Add([]byte{0, 60, 0, 61, 0, 62, 0, 63, 0, 64, 0, 65, 8, 8, 8, 3, 2, 3, 0, 8})
	// An enforced queue pool: a reservation is granted; A is held (the reservation is
	// an unmeasured session), B uses the reservation, C is held behind B's settle.
	f.Add([]byte{4, 0, 20, 0, 7, 0, 4, 1, 2, 0, 1, 5, 2, 1, 8, 1, 7, 0, 5, 2, 10, 0, 0, 30, 1, 0, 7, 0, 0, 0, 1,
		0, 0, 30, 1, 0, 7, 1, 0, 0, 0, 0, 8, 3, 0, 0, 30, 1, 0, 7, 2, 0, 0, 1, 8, 3, 9, 3, 8, 3, 8, 3})
	f.Fuzz(func(t *testing.T, data []byte) {
		// Every input runs without and with the prefix cache (issue 12), and in a roomy
		// and a tight cache: in 96 cells three idle sequences of up to 60 tokens and a
		// pool or two fill it, so requests wait on cells that only eviction can give.
		// And with speculative decoding (issue 23) on a model that repeats itself, so
		// drafts take cells and budget beside everything else and rejected ones go.
		// The tight cache runs again with a tier below it (issue 40): what eviction takes
		// is spilled and loaded back, and pinned pools are paged.
		for _, cache := range []bool{false, true} {
			for _, c := range []struct {
				nctx int
				tier bool
			}{{256, false}, {96, false}, {96, true}} {
				for _, spec := range []bool{false, true} {
					fuzzScheduler(t, slices.Clone(data), cache, c.nctx, spec, c.tier)
				}
			}
		}
	})
}

func fuzzScheduler(t *testing.T, data []byte, cache bool, nctx int, spec, tier bool) {
	{
		cfg := Config{NCtx: nctx, Parallel: 3, MaxPools: 3, NBatch: 16, MaxQueue: 4,
			SessionTTL: time.Minute, PoolGrace: time.Second, BytesPerCell: 10, PrefixCache: cache,
			QueueTimeout: 3 * time.Second, Tier: tier, TierChunk: 8}
		if spec {
			cfg.Spec = Spec{Types: []string{SpecNgramSimple, SpecNgramMod}, DraftMax: 6, ModN: 3}
		}
		h := newHarness(t, cfg)
		h.trackResidency()
		model, maxTok := fakeNext, 8
		if spec {
			// Longer answers: drafts need some output to repeat.
			model, maxTok = fakeRepeater(4), 24
			h.be.model = model
		}
		prompts := map[TaskID][]Token{}
		families := [][]Token{seqTokens(100, 60), seqTokens(300, 60), append(seqTokens(100, 20), seqTokens(500, 40)...)}
		var pools []int
		var tasks, mats []TaskID
		var rsv []string // reservation ids granted
		next := func() int {
			if len(data) == 0 {
				return 0
			}
			b := int(data[0])
			data = data[1:]
			return b
		}
		prompt := func() []Token {
			fam, n, tail := families[next()%len(families)], 1+next()%50, next()%4
			p := slices.Clone(fam[:min(n, len(fam))])
			for i := range tail {
				p = append(p, Token(900+i+next()%7))
			}
			return p
		}
		pick := func() int {
			if len(pools) == 0 {
				return 1 + next()%5 // ids that may never have existed
			}
			return pools[next()%len(pools)]
		}
		for steps := 0; len(data) > 0 && steps < 200; steps++ {
			switch next() % 10 {
			case 0, 1, 2:
				req := Request{Prompt: prompt(), MaxTokens: 1 + next()%maxTok}
				k := next() % 5
				if k < 4 {
					req.SessionID = string(rune('A' + k))
				}
				if next()%2 == 0 {
					req.HasPool, req.PoolID = true, pick()
					if len(rsv) > 0 && next()%2 == 0 {
						req.ReservationID = rsv[next()%len(rsv)]
					}
				} else if k%2 == 0 && len(pools) > 0 {
					// Named by its content key, as a router sends it (issue 30): a pool
					// that is still materializing, or whose creation is cancelled.
					if info, err := h.s.Pool(pools[k/2%len(pools)]); err == nil {
						key := pool.RollingHash(info.Tokens)[len(info.Tokens)-1]
						req.PoolKey = &key
					}
				}
				if id, err := h.trySubmit(req); err == nil {
					tasks = append(tasks, id)
					prompts[id] = req.Prompt
				}
			case 3:
				// A request, or a pool's materialization (its creator gone).
				if all := append(slices.Clone(tasks), mats...); len(all) > 0 {
					h.cancel(all[next()%len(all)])
				}
			case 4:
				if id, task, err := h.tryCreatePool(PoolSpec{Tokens: prompt()}); err == nil {
					pools = append(pools, id)
					if task != 0 {
						mats = append(mats, task)
					}
				}
			case 5:
				parent := pick()
				if info, err := h.s.Pool(parent); err == nil && len(info.Tokens) > 0 {
					d := next() % (len(info.Tokens) + 1)
					toks := append(slices.Clone(info.Tokens[:d]), Token(700+next()%5), Token(710))
					if id, _, err := h.tryCreatePool(PoolSpec{HasParent: true, Parent: parent, D: d, Tokens: toks}); err == nil {
						pools = append(pools, id)
					}
				}
			case 6:
				_ = h.releasePool(pick())
			case 7:
				id := pick()
				switch next() % 6 {
				case 0:
					_ = h.evictPool(id)
				case 1:
					_ = h.pinPool(id, true)
				case 2:
					_ = h.pinPool(id, false)
				case 3:
					_, _, _ = h.flushPool(id)
				case 4:
					p := admission.DefaultPolicy()
					p.Mode = []string{admission.ModeAdvisory, admission.ModeEnforced, admission.ModeEnforced}[next()%3]
					p.OnSaturation = []string{admission.OnReject, admission.OnWarn, admission.OnQueue}[next()%3]
					p.TargetTPS = float64(next() % 80)
					p.GuaranteeMinSessions = next() % 3
					p.SettleTokens, p.SettleMaxMs, p.QueueTimeoutMs = next()%8, int64(next()%4)*500, int64(next()%4)*1000
					if next()%2 == 0 { // throttle toward the floor (issue 41)
						p.Throttle = admission.ThrottleTowardFloor
						p.ThrottleMargin, p.ThrottleMaxSkip = float64(next()%3)*0.2, []float64{0.25, 0.5, 0.9}[next()%3]
					}
					_ = h.setAdmission(id, p)
				case 5:
					if r, err := h.tryReserve(id, time.Duration(next()%4)*time.Second, next()%40); err == nil && r.Granted {
						rsv = append(rsv, *r.ReservationID)
					}
				}
			case 8:
				for range 1 + next()%4 {
					h.checkStep(cfg)
				}
			case 9:
				h.now = h.now.Add(time.Duration(next()%4) * 700 * time.Millisecond)
			}
			h.collect() // accounting is checked after steps: a message's sequence ops run at the next Plan
		}
		// Drain: cancel everything, release every pool, let sessions expire.
		for _, id := range tasks {
			h.cancel(id)
		}
		// Children before parents (a parent with live children refuses), and a pool
		// still materializing refuses until it is resident: retry across steps. The
		// clock moves past the grace time, so released pools are reclaimed and one
		// materializing in a tight cache gets their cells (three pools that fit only
		// one at a time take about as many grace times).
		for i := 0; i < 20 || (i < 200 && h.s.pools.Len() > 0); i++ {
			for _, id := range pools {
				_ = h.releasePool(id)
			}
			h.checkStep(cfg)
			h.now = h.now.Add(cfg.PoolGrace / 4)
		}
		for range 4 {
			h.now = h.now.Add(2 * time.Minute)
			h.checkStep(cfg)
		}
		if c, u := h.be.cells(), h.s.Usage(); c != 0 || u.Sessions != 0 || u.Pools != 0 || u.Running != 0 || u.Waiting != 0 {
			t.Fatalf("leaked after drain: %d cells, usage %+v, pools %+v, tracked %v", c, u, h.s.Pools().Pools, pools)
		}
		if len(h.be.samplers) != 0 || len(h.s.tasks) != 0 || h.s.adm.Held() != 0 {
			t.Fatalf("leaked after drain: %d samplers, %d tasks, %d held", len(h.be.samplers), len(h.s.tasks), h.s.adm.Held())
		}
		// Greedy output never depends on what was shared: every task's text is a prefix
		// of what a cold prefill of its prompt generates (the fake model's next token
		// depends on every token its sequence holds), all of it when it ran to max_tokens.
		for id, prompt := range prompts {
			ev, ok := h.done(id)
			if !ok {
				t.Fatalf("task %d never ended", id)
			}
			got, want := h.text(id), coldText(model, prompt, maxTok)
			if !strings.HasPrefix(want, got) {
				t.Fatalf("cache=%v: task %d (prompt %v, cache_n %d) generated %q, a cold prefill %q", cache, id, prompt, ev.Stats.CacheN, got, want)
			}
		}
	}
}

// coldText is what model generates for prompt, n tokens, on an empty cache.
func coldText(model func([]Token) Token, prompt []Token, n int) string {
	seq := slices.Clone(prompt)
	var b strings.Builder
	for range n {
		tok := model(seq)
		fmt.Fprintf(&b, "<%d>", tok)
		seq = append(seq, tok)
	}
	return b.String()
}

// checkStep runs one step and checks that every planned sequence id is in range and,
// once the operations that Commit queued for the next step have run, that the
// ownership accounting matches the cache.
func (h *harness) checkStep(cfg Config) {
	h.t.Helper()
	// Eviction never loses a pinned pool: one resident and pinned by the user before a
	// step (which carries no message: no release, no explicit evict) still is after,
	// or, with a tier (issue 40), was paged out to it, kept (OpSpill.Pinned).
	var pinned []*pool.Pool
	for _, p := range h.s.pools.All() {
		if p.UserPinned && p.State == pool.Resident {
			pinned = append(pinned, p)
		}
	}
	defer func() {
		for _, p := range pinned {
			if cfg.Tier && p.State != pool.Resident && p.State != pool.Released && h.be.keptPools[p.ID] && slices.Equal(h.be.tier[p.ID], p.Tokens[p.D:]) {
				// Paged out (evicted), or already being restored from the tier.
				continue
			}
			if p.State != pool.Resident || p.Filled() != p.L() {
				h.t.Fatalf("pinned pool %d is %s holding %d of %d positions after a step", p.ID, p.State, p.Filled(), p.L())
			}
		}
	}()
	for _, e := range h.step() {
		if e.Seq < 0 || e.Seq >= cfg.Parallel+cfg.MaxPools {
			h.t.Fatalf("batch entry on sequence %d, outside [0, %d)", e.Seq, cfg.Parallel+cfg.MaxPools)
		}
	}
	// Until nothing is left: an answer (a load's or a restore's, stepped as the engine
	// loop steps it) may plan more operations (the admission it lets through).
	for len(h.s.samplers)+len(h.s.ops) > 0 {
		ops := Plan{Samplers: h.s.samplers, SeqOps: h.s.ops}
		h.s.samplers, h.s.ops = nil, nil
		for _, m := range apply(h.be, ops) {
			h.s.Step(h.now, m)
		}
	}
	h.checkAccounting()
	// No wait outlives its deadline (issues 30, 40): Plan refused every task that waited
	// past it with no progress on the server's work. (A root pool waiting at the head
	// for cells its peer's child pins, the child queued behind it, is a cycle only the
	// deadline breaks.)
	for _, t := range h.s.queue {
		since := t.queued
		if h.s.progressAt.After(since) {
			since = h.s.progressAt
		}
		if waited := h.s.planAt.Sub(since); waited >= cfg.QueueTimeout {
			h.t.Fatalf("task %d has waited %s, past the queue timeout %s (%s)", t.id, waited, cfg.QueueTimeout, t.wait)
		}
	}
	for _, key := range h.s.adm.HeldKeys() {
		if t, ok := h.s.tasks[TaskID(key)]; !ok || t.slot != nil || slices.Contains(h.s.queue, t) {
			h.t.Fatalf("held request %d is not a waiting task outside the queue", key)
		}
	}
	// No cell a sequence holds was removed or shifted under it: the cache holds exactly
	// what each sequence's slot says (a borrower's cells included), and so does the tree.
	for _, sl := range h.s.slots {
		if got := h.be.tokens(sl.seq); !slices.Equal(got, sl.tokens) {
			h.t.Fatalf("seq %d holds %v in the cache, the scheduler thinks %v", sl.seq, got, sl.tokens)
		}
		if got := h.s.kv.Cells().Tokens(sl.seq); !slices.Equal(got, sl.tokens) {
			h.t.Fatalf("seq %d holds %v in the cell tree, the scheduler thinks %v", sl.seq, got, sl.tokens)
		}
	}
	// A pool is a name on a path of the cell tree: what its sequence holds there is a
	// prefix of its tokens, the cache agrees, and its state agrees with the tree
	// (resident: all of [0, L); evicted: nothing).
	for _, p := range h.s.pools.All() {
		n := p.Filled()
		if n > p.L() || !slices.Equal(h.s.kv.Cells().Tokens(p.Seq), p.Tokens[:n]) {
			h.t.Fatalf("pool %d (seq %d, %s) holds %v in the cell tree, want a prefix of %v", p.ID, p.Seq, p.State, h.s.kv.Cells().Tokens(p.Seq), p.Tokens)
		}
		if got := h.be.tokens(p.Seq); !slices.Equal(got, p.Tokens[:n]) {
			h.t.Fatalf("pool %d (seq %d, %s) holds %v in the cache, want its first %d tokens", p.ID, p.Seq, p.State, got, n)
		}
		if (p.State == pool.Resident && n != p.L()) || (p.State == pool.Evicted && n != 0) {
			h.t.Fatalf("pool %d is %s but its sequence holds %d of %d positions", p.ID, p.State, n, p.L())
		}
		// The branch contract is a fact of the tree: a child that holds cells shares its
		// parent's very cells [0, D), never copies of them.
		if par := p.Parent; par != nil && p.D > 0 && n > 0 && !h.s.kv.Cells().Shares(p.Seq, par.Seq, p.D-1) {
			h.t.Fatalf("pool %d (D %d, holding %d) does not share its parent %d's cells [0, %d) (parent %s, holding %d)", p.ID, p.D, n, par.ID, p.D, par.State, par.Filled())
		}
	}
}
