package engine

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestNgramLookup(t *testing.T) {
	for _, c := range []struct {
		ctx        []Token
		last       Token
		minN, maxN int
		k          int
		want       []Token
	}{
		// "1 2 3" recurs: what followed it the first time is proposed.
		{ctx: []Token{1, 2, 3, 4, 5, 9, 1, 2}, last: 3, minN: 3, maxN: 8, k: 4, want: []Token{4, 5, 9, 1}},
		// k bounds the proposal.
		{ctx: []Token{1, 2, 3, 4, 5, 9, 1, 2}, last: 3, minN: 3, maxN: 8, k: 2, want: []Token{4, 5}},
		// Too short a match: nothing.
		{ctx: []Token{1, 2, 3, 4, 5, 9, 7, 2}, last: 3, minN: 3, maxN: 8, k: 4, want: nil},
		// The longest match wins over a more recent shorter one: "7 2 3" (twice) beats
		// "2 3" after 8.
		{ctx: []Token{7, 2, 3, 40, 41, 8, 2, 3, 50, 7, 2}, last: 3, minN: 2, maxN: 8, k: 2, want: []Token{40, 41}},
		// Among equally long matches the most recent: "2 3" followed by 50, not 40.
		{ctx: []Token{2, 3, 40, 2, 3, 50, 2}, last: 3, minN: 2, maxN: 8, k: 1, want: []Token{50}},
		// A run: the longest match ends just before last, so the proposal is last
		// itself (what followed the match), no further.
		{ctx: []Token{5, 5, 5}, last: 5, minN: 2, maxN: 8, k: 3, want: []Token{5}},
	} {
		got := ngramLookup(c.ctx, c.last, c.minN, c.maxN, c.k)
		if !slices.Equal(got, c.want) {
			t.Errorf("ngramLookup(%v, %d, %d, %d, %d) = %v, want %v", c.ctx, c.last, c.minN, c.maxN, c.k, got, c.want)
		}
	}
}

// TestNgramPeriodicPhase: a reply that loops with a period (SmolLM2 on the edit
// benchmark repeats 82 tokens) holds a 20-token run twice per period with different
// continuations. Matching at most 16 tokens takes the most recent of the two, at the
// wrong phase; the default length reaches back past the run's start and takes the
// previous period's same place, so the proposal is what the loop writes next.
func TestNgramPeriodicPhase(t *testing.T) {
	run := make([]Token, 20) // `", "timeout_ms": 250, "` and the like: the same in both halves
	for i := range run {
		run[i] = Token(100 + i)
	}
	var period []Token
	period = append(period, 1, 2, 3) // first half's head
	period = append(period, run...)
	period = append(period, 10, 11, 12) // first half's continuation
	period = append(period, 4, 5, 6)    // second half's head
	period = append(period, run...)
	period = append(period, 20, 21, 22) // second half's continuation
	var ctx []Token
	for range 3 {
		ctx = append(ctx, period...)
	}
	// Now in the first half of the fourth period, the run written up to its last token.
	ctx = append(ctx, 1, 2, 3)
	ctx = append(ctx, run[:len(run)-1]...)
	last := run[len(run)-1]
	if got := ngramLookup(ctx, last, DefaultNgramMin, DefaultNgramMax, 3); !slices.Equal(got, []Token{10, 11, 12}) {
		t.Errorf("default match length %d: proposal %v, want the first half's continuation [10 11 12]", DefaultNgramMax, got)
	}
	if got := ngramLookup(ctx, last, DefaultNgramMin, 16, 3); !slices.Equal(got, []Token{20, 21, 22}) {
		t.Errorf("match length 16: proposal %v; the case no longer shows the wrong phase (want [20 21 22])", got)
	}
}

func TestNgramMod(t *testing.T) {
	m := newNgramMod(3)
	text := []Token{1, 2, 3, 4, 5, 6, 7}
	for i := 0; i+3 < len(text); i++ {
		m.add(text[i : i+4])
	}
	// The last three tokens are 3 4 5: 6 followed them, then 7 followed 4 5 6.
	if got := m.draft([]Token{9, 3, 4}, 5, 4); !slices.Equal(got, []Token{6, 7}) {
		t.Errorf("draft after 3 4 5 = %v, want [6 7] (then nothing: 5 6 7 was never followed)", got)
	}
	if got := m.draft([]Token{9, 9}, 9, 4); len(got) != 0 {
		t.Errorf("draft after an unseen n-gram = %v, want none", got)
	}
	m.reset()
	if got := m.draft([]Token{9, 3, 4}, 5, 4); len(got) != 0 || m.used != 0 {
		t.Errorf("after reset: draft %v, used %d", got, m.used)
	}
}

func TestParseSpecTypes(t *testing.T) {
	for in, want := range map[string]string{
		"":                       "[]",
		"none":                   "[]",
		"ngram-mod":              "[ngram-mod]",
		"ngram-simple,ngram-mod": "[ngram-simple ngram-mod]",
		"ngram-cache":            "error",
		"ngram-mod,ngram-mod":    "error",
		"none,ngram-mod":         "error",
	} {
		got, err := ParseSpecTypes(in)
		s := fmt.Sprint(got)
		if err != nil {
			s = "error"
		}
		if s != want {
			t.Errorf("ParseSpecTypes(%q) = %s (%v), want %s", in, s, err, want)
		}
	}
	if err := (Config{NCtx: 64, Parallel: 1, NBatch: 8, Spec: Spec{Types: []string{SpecNgramMod}, DraftMax: 4, DraftMin: 5}}).Validate(); err == nil {
		t.Error("draft min above draft max validated")
	}
	if err := (Config{NCtx: 64, Parallel: 1, NBatch: 8, Recurrent: true, Spec: Spec{Types: []string{SpecNgramMod}}}).Validate(); err == nil {
		t.Error("speculation on a recurrent model without rollback validated")
	}
	// With rollback (llama.cpp's n_rs_seq) as deep as the longest draft it is allowed.
	rc := Config{NCtx: 64, Parallel: 1, NBatch: 8, Recurrent: true, Rollback: 4, Spec: Spec{Types: []string{SpecNgramMod}, DraftMax: 4}}
	if err := rc.Validate(); err != nil {
		t.Errorf("speculation on a recurrent model with rollback 4, drafts of 4: %v", err)
	}
	if rc.Spec.DraftMax = 5; rc.Validate() == nil {
		t.Error("drafts longer than the recurrent rollback validated")
	}
}

// specRun is one run of specWorkload: each task's text, finish and counters.
type specRun struct {
	texts          []string
	finish         []string
	predicted      []int
	draftN, accept int
	drawn          int
	mixed          bool // some batch held drafts beside a prefill chunk
}

// specWorkload runs the same traffic with the given speculation: four sessions on a
// repeating fake model, one attached to a pool, two anonymous ones (prefix cache on),
// one session that comes back for a second turn, and a request that arrives while the
// others decode, so its prefill shares batches with their drafts.
func specWorkload(t *testing.T, spec Spec) specRun {
	r, _ := specWorkloadH(t, spec)
	return r
}

// specWorkloadH is specWorkload that also returns its harness (for what the backend
// holds afterwards).
func specWorkloadH(t *testing.T, spec Spec) (specRun, *harness) {
	return specWorkloadWith(t, spec, nil)
}

// specWorkloadWith is specWorkloadH with setup run on the harness before the first
// request.
func specWorkloadWith(t *testing.T, spec Spec, setup func(*harness)) (specRun, *harness) {
	cfg := poolCfg()
	cfg.PrefixCache = true
	cfg.Spec = spec
	h := newHarness(t, cfg)
	if setup != nil {
		setup(h)
	}
	h.be.model = fakeRepeater(9)
	pid := h.createPool(PoolSpec{Tokens: seqTokens(100, 40)})
	var ids []TaskID
	submit := func(req Request) { ids = append(ids, h.submit(req)) }
	submit(Request{Prompt: append(seqTokens(100, 40), seqTokens(1, 12)...), HasPool: true, PoolID: pid, MaxTokens: 60})
	submit(Request{Prompt: seqTokens(200, 30), MaxTokens: 45})
	submit(Request{Prompt: seqTokens(200, 25), MaxTokens: 70})
	submit(Request{Prompt: seqTokens(300, 20), SessionID: "s", MaxTokens: 33})
	for range 6 {
		h.step()
	}
	submit(Request{Prompt: seqTokens(400, 90), MaxTokens: 20})
	h.run()
	// The session's second turn continues its own cells.
	prompt := append(seqTokens(300, 20), Token(77))
	submit(Request{Prompt: prompt, SessionID: "s", MaxTokens: 40})
	h.run()
	h.checkAccounting()
	var r specRun
	for _, id := range ids {
		ev, ok := h.done(id)
		if !ok {
			t.Fatalf("task %d did not end", id)
		}
		if ev.Err != nil {
			t.Fatalf("task %d: %v", id, ev.Err)
		}
		r.texts = append(r.texts, h.text(id))
		r.finish = append(r.finish, ev.Finish)
		r.predicted = append(r.predicted, ev.Stats.PredictedN)
		r.draftN += ev.Stats.DraftN
		r.accept += ev.Stats.DraftAccepted
	}
	r.drawn = h.be.drawn
	for _, b := range h.be.batches {
		drafts, prefill := false, false
		for _, e := range b {
			drafts = drafts || e.Draft
			prefill = prefill || !e.Sample
		}
		r.mixed = r.mixed || drafts && prefill
	}
	return r, h
}

// TestSpeculativeLossless: the fake model's output is the same with and without
// speculation, for each drafter, with and without the cost-aware draft limit (drafts
// beside prefill chunks are required without it: the limit may leave none), pooled,
// cached, in sessions and beside prefills; the
// drafts are verified beside prefill chunks, many are accepted, rejected drafts' cells
// are gone (the fake cache and the accounting agree, and the fake fails a batch whose
// positions skip), and the backend never draws more samples than plain decoding does.
func TestSpeculativeLossless(t *testing.T) {
	base := specWorkload(t, Spec{})
	if base.draftN != 0 {
		t.Fatalf("speculation off proposed %d drafts", base.draftN)
	}
	for _, types := range [][]string{{SpecNgramSimple}, {SpecNgramMod}, {SpecNgramMod, SpecNgramSimple}} {
		for _, dmax := range []int{1, 4, 16} {
			for _, cost := range []float64{-1, 0} {
				t.Run(fmt.Sprintf("%v/max%d/stepcost%g", types, dmax, cost), func(t *testing.T) {
					sp := Spec{Types: types, DraftMax: dmax, StepCost: cost}
					if slices.Contains(types, SpecNgramMod) {
						sp.ModN = 4 // the fake's texts are short
					}
					r := specWorkload(t, sp)
					for i := range base.texts {
						if r.texts[i] != base.texts[i] || r.finish[i] != base.finish[i] || r.predicted[i] != base.predicted[i] {
							t.Errorf("task %d: with speculation %q (%s, %d tokens), without %q (%s, %d tokens)",
								i, r.texts[i], r.finish[i], r.predicted[i], base.texts[i], base.finish[i], base.predicted[i])
						}
					}
					if r.draftN == 0 || r.accept == 0 || r.accept > r.draftN {
						t.Errorf("drafted %d, accepted %d: want some of each", r.draftN, r.accept)
					}
					if r.drawn != base.drawn {
						t.Errorf("the backend drew %d samples, %d without speculation", r.drawn, base.drawn)
					}
					if !r.mixed && cost < 0 {
						t.Error("no batch verified drafts beside a prefill chunk")
					}
					t.Logf("drafted %d, accepted %d (%.0f%%)", r.draftN, r.accept, 100*float64(r.accept)/float64(r.draftN))
				})
			}
		}
	}
}

// TestSpeculationOffPerRequest: speculative false, or n_max 0, proposes nothing.
func TestSpeculationOffPerRequest(t *testing.T) {
	zero := 0
	for name, req := range map[string]Request{
		"off":   {Spec: SpecRequest{Off: true}},
		"nmax0": {Spec: SpecRequest{NMax: &zero}},
	} {
		cfg := poolCfg()
		cfg.Spec = Spec{Types: []string{SpecNgramSimple}}
		h := newHarness(t, cfg)
		h.be.model = fakeRepeater(5)
		req.Prompt, req.MaxTokens = seqTokens(1, 20), 30
		id := h.submit(req)
		h.run()
		ev, _ := h.done(id)
		if ev.Stats.PredictedN != 30 || ev.Stats.DraftN != 0 {
			t.Errorf("%s: predicted %d, drafted %d; want 30 and none", name, ev.Stats.PredictedN, ev.Stats.DraftN)
		}
	}
}

// TestSpeculationBounds: drafts never run past max_tokens (no wasted verification)
// nor take the decode token or the cell another session needs.
func TestSpeculationBounds(t *testing.T) {
	cfg := poolCfg()
	cfg.NBatch = 4 // four sessions decode: no room for any draft
	cfg.Spec = Spec{Types: []string{SpecNgramSimple}, DraftMax: 8}
	h := newHarness(t, cfg)
	h.be.model = fakeRepeater(3)
	var ids []TaskID
	for i := range 4 {
		// One-token prompts: all four prefill in the first step, then decode together.
		ids = append(ids, h.submit(Request{Prompt: seqTokens(10*i+1, 1), MaxTokens: 10}))
	}
	h.run()
	for _, id := range ids {
		if ev, _ := h.done(id); ev.Stats.DraftN != 0 || ev.Stats.PredictedN != 10 {
			t.Errorf("task %d: drafted %d, predicted %d with a full batch", id, ev.Stats.DraftN, ev.Stats.PredictedN)
		}
	}
	cfg.NBatch = 32
	h = newHarness(t, cfg)
	h.be.model = fakeRepeater(3)
	id := h.submit(Request{Prompt: seqTokens(1, 6), MaxTokens: 7})
	h.run()
	if ev, _ := h.done(id); ev.Stats.PredictedN != 7 {
		t.Fatalf("predicted %d, want 7", ev.Stats.PredictedN)
	}
	for _, b := range h.be.batches {
		for _, e := range b {
			if e.Pos >= 6+7-1 {
				t.Errorf("entry at position %d: past the last token max_tokens needs decoded (%d)", e.Pos, 6+7-2)
			}
		}
	}
}

// TestSpeculationReported: a running task's proposals and accepted drafts show in
// /slots (Slots) and /polykv/tps (TPS) while it runs, and its tps counts every
// accepted token: with every draft accepted the aggregate rate is several tokens per
// step.
func TestSpeculationReported(t *testing.T) {
	cfg := poolCfg()
	cfg.Spec = Spec{Types: []string{SpecNgramSimple}, DraftMax: 8}
	h := newHarness(t, cfg)
	h.be.model = func(seq []Token) Token { return seq[len(seq)-4] } // copies exactly
	h.submit(Request{Prompt: seqTokens(1, 12), MaxTokens: 200})
	for range 12 {
		h.step()
	}
	sl := h.s.Slots()[0]
	ts := h.s.TPS(h.now).Sessions[0]
	if sl.DraftN == 0 || sl.DraftAccepted != sl.DraftN || ts.DraftN != sl.DraftN || ts.DraftAccepted != sl.DraftAccepted {
		t.Fatalf("slots %+v, tps %+v: want the same nonzero draft counts, all accepted", sl, ts)
	}
	// A harness step takes 20 ms (10 to plan, 10 to decode): one token a step is
	// 50 tok/s.
	if r := h.s.TPS(h.now).AggregateTPS; r < 150 {
		t.Fatalf("aggregate tps %.0f with every draft accepted, want well above 50", r)
	}
	if sl.Decoded <= 12 {
		t.Fatalf("%d tokens decoded in 12 steps", sl.Decoded)
	}
}

// TestSpeculativeSamplingDistribution is the statistical check of speculation with
// sampling: a stochastic fake model (each task its own seeded RNG: the token four back
// with probability 0.6, else one of 10..19 uniformly) whose repeats ngram-simple
// drafts eagerly. If verification kept a draft the model did not draw, the share of
// repeated tokens would rise above the model's; it must match the model's expected
// share within four standard deviations, with and without speculation, and each seed
// gives the same tokens either way.
func TestSpeculativeSamplingDistribution(t *testing.T) {
	const tasks, gen = 300, 24
	run := func(spec bool) ([]string, float64, float64, int) {
		cfg := poolCfg()
		if spec {
			cfg.Spec = Spec{Types: []string{SpecNgramSimple}, DraftMax: 8, NgramMin: 2}
		}
		h := newHarness(t, cfg)
		rngs := map[TaskID]*rand.Rand{}
		h.be.sample = func(task TaskID, seq []Token) Token {
			r := rngs[task]
			if r.Float64() < 0.6 {
				return seq[len(seq)-4]
			}
			return Token(10 + r.IntN(10))
		}
		var ids []TaskID
		for i := range tasks {
			id := h.submit(Request{Prompt: []Token{1, 2, 3, 4, 15, 16}, MaxTokens: gen, Sampling: SamplingParams{Temperature: 1, Seed: uint32(i)}})
			rngs[id] = rand.New(rand.NewPCG(uint64(i), 23))
			ids = append(ids, id)
			if i%4 == 3 {
				h.run()
			}
		}
		h.run()
		var texts []string
		obs, exp, variance, drafted := 0.0, 0.0, 0.0, 0
		for _, id := range ids {
			ev, _ := h.done(id)
			drafted += ev.Stats.DraftN
			texts = append(texts, h.text(id))
			seq := []Token{1, 2, 3, 4, 15, 16}
			for _, ev := range h.events[id] {
				var tok Token
				if _, err := fmt.Sscanf(ev.Text, "<%d>", &tok); err != nil {
					continue
				}
				back := seq[len(seq)-4]
				p := 0.6
				if back >= 10 && back < 20 {
					p += 0.4 / 10
				}
				if tok == back {
					obs++
				}
				exp += p
				variance += p * (1 - p)
				seq = append(seq, tok)
			}
		}
		return texts, obs - exp, math.Sqrt(variance), drafted
	}
	offTexts, offDev, offSD, _ := run(false)
	onTexts, onDev, onSD, drafted := run(true)
	if drafted == 0 {
		t.Fatal("nothing was drafted")
	}
	if math.Abs(offDev) > 4*offSD || math.Abs(onDev) > 4*onSD {
		t.Fatalf("repeated tokens off the model's share: without speculation %.1f (σ %.1f), with %.1f (σ %.1f)", offDev, offSD, onDev, onSD)
	}
	if !slices.Equal(offTexts, onTexts) {
		t.Fatal("a seed gave other tokens with speculation")
	}
	t.Logf("drafted %d; deviation from the model's expected repeats: off %.1f, on %.1f (σ %.1f)", drafted, offDev, onDev, onSD)
}

// TestSpecCostCap: the cost-aware limit's arithmetic (specCostCap). With one decoder a
// step's fixed cost dominates, so even an even-odds draft pays; with eight, a session
// whose drafts land half the time proposes nothing and one copying its context (p near
// 1) still proposes long drafts; a negative StepCost turns the limit off.
func TestSpecCostCap(t *testing.T) {
	s := &Scheduler{cfg: Config{Spec: Spec{StepCost: DefaultStepCost}}}
	for _, c := range []struct {
		p         float64
		decoders  float64
		k, wantLo int
		wantHi    int
	}{
		{p: 0.5, decoders: 1, k: 16, wantLo: 1, wantHi: 1},
		{p: 0.95, decoders: 1, k: 16, wantLo: 5, wantHi: 9},
		{p: 0.995, decoders: 1, k: 16, wantLo: 16, wantHi: 16},
		{p: 0.5, decoders: 8, k: 16, wantLo: 0, wantHi: 0},
		{p: 0.7, decoders: 8, k: 16, wantLo: 0, wantHi: 0},
		{p: 0.98, decoders: 8, k: 16, wantLo: 8, wantHi: 16},
		{p: 0.98, decoders: 8, k: 3, wantLo: 3, wantHi: 3},
	} {
		tk := &task{spec: specSession{hits: c.p, trials: 1}}
		got := s.specCostCap(tk, c.k, c.decoders, c.decoders)
		if got < c.wantLo || got > c.wantHi {
			t.Errorf("p %.2f, %v decoders, k %d: cap %d, want %d..%d", c.p, c.decoders, c.k, got, c.wantLo, c.wantHi)
		}
	}
	s.cfg.Spec.StepCost = -1
	if got := s.specCostCap(&task{spec: specSession{hits: 0.1, trials: 1}}, 7, 8, 8); got != 7 {
		t.Errorf("limit off: cap %d, want 7", got)
	}
	// A session's history: a wholly rejected proposal lowers p, an accepted run raises it.
	tk := &task{spec: specSession{hits: specPriorHits, trials: specPriorTrials}}
	tk.spec.learn(4, 0)
	if p := tk.spec.p(); p >= 0.5 {
		t.Errorf("p %.3f after a rejection, want below 0.5", p)
	}
	tk.spec.learn(16, 16)
	if p := tk.spec.p(); p < 0.9 {
		t.Errorf("p %.3f after 16 accepted, want at least 0.9", p)
	}
}

// fakeMixed is a fake model for two kinds of sessions, told apart by their first token:
// below 2000 a copier (the token period back, as an agent returning its context), from
// 2000 on a chatter whose text repeats three tokens in four, so n-gram drafts find
// matches and some land, most not far.
func fakeMixed(period int) func(seq []Token) Token {
	return func(seq []Token) Token {
		h := uint32(7)
		for _, t := range seq {
			h = h*31 + uint32(t)
		}
		if len(seq) >= period && (seq[0] < 2000 || h%4 != 0) {
			return seq[len(seq)-period]
		}
		return Token(10 + h%50)
	}
}

// TestSpeculativeCostLimit: eight sessions decode together, four copying their context
// and four chatting. Against speculation without the limit (StepCost -1), the cost-aware
// limit keeps the output identical, cuts the chatters' drafts to half or less (the
// ones left are probes and drafts once fewer sessions decode) at no lower acceptance, keeps most
// of the copiers' accepted drafts, and raises the step model's tokens per cost (a step
// of R rows costing DefaultStepCost+R: the model the limit optimizes).
func TestSpeculativeCostLimit(t *testing.T) {
	type group struct{ drafted, accepted int }
	run := func(stepCost float64) (texts []string, copier, chatter group, tokPerCost float64) {
		cfg := poolCfg()
		cfg.Parallel, cfg.MaxQueue = 8, 8
		cfg.Spec = Spec{Types: []string{SpecNgramSimple}, StepCost: stepCost}
		h := newHarness(t, cfg)
		h.be.model = fakeMixed(7)
		var ids []TaskID
		for i := range 8 {
			ids = append(ids, h.submit(Request{Prompt: seqTokens(1000*(1+i%2)+100*i, 14), MaxTokens: 80}))
		}
		h.run()
		h.checkAccounting()
		var tokens int
		for i, id := range ids {
			ev, ok := h.done(id)
			if !ok || ev.Err != nil {
				t.Fatalf("task %d: ended %v, %v", id, ok, ev.Err)
			}
			texts = append(texts, h.text(id))
			tokens += ev.Stats.PredictedN
			g := &copier
			if i%2 == 1 {
				g = &chatter
			}
			g.drafted += ev.Stats.DraftN
			g.accepted += ev.Stats.DraftAccepted
		}
		cost := 0.0
		for _, b := range h.be.batches {
			cost += DefaultStepCost + float64(len(b))
		}
		return texts, copier, chatter, float64(tokens) / cost
	}
	offTexts, offCopier, offChatter, offRate := run(-1)
	texts, copier, chatter, rate := run(0)
	if !slices.Equal(texts, offTexts) {
		t.Fatalf("the limit changed the output:\n%q\n%q", texts, offTexts)
	}
	t.Logf("no limit: copiers %+v, chatters %+v, %.3f tokens/cost; limit: copiers %+v, chatters %+v, %.3f tokens/cost",
		offCopier, offChatter, offRate, copier, chatter, rate)
	if offChatter.drafted == 0 || 2*chatter.drafted > offChatter.drafted {
		t.Errorf("chatters drafted %d with the limit, %d without: want at most half", chatter.drafted, offChatter.drafted)
	}
	if chatter.accepted*offChatter.drafted < offChatter.accepted*chatter.drafted {
		t.Errorf("chatters' acceptance %d/%d with the limit, %d/%d without: want no lower", chatter.accepted, chatter.drafted, offChatter.accepted, offChatter.drafted)
	}
	if 10*copier.accepted < 7*offCopier.accepted {
		t.Errorf("copiers' accepted drafts fell from %d to %d with the limit: want at least 70%%", offCopier.accepted, copier.accepted)
	}
	if rate <= offRate {
		t.Errorf("tokens per modelled cost %.3f with the limit, %.3f without: want higher", rate, offRate)
	}
}

// fakeGrammar is the fake backend's grammar in TestSpeculativeGrammar: no two tokens in
// a row whose sum is a multiple of 3.
func fakeGrammar(prev, tok Token) bool { return prev < 0 || (prev+tok)%3 != 0 }

// TestSpeculativeGrammar: grammar-constrained requests speculate, losslessly, and the
// plan cuts their drafts at the first token the grammar forbids (DraftChecker). Three
// requests with a (fake) grammar and one without decode together on a repeating model
// whose draws the grammar masks. With speculation, with or without the check, every
// text is the one plain decoding gives and the backend draws as many samples; with the
// check no planned draft of a grammar request breaks the grammar, the cut tokens are
// counted (Stats.DraftFiltered), the draft rows fall and acceptance rises; the request
// without a grammar is not filtered.
func TestSpeculativeGrammar(t *testing.T) {
	type result struct {
		texts                              []string
		drafted, accepted, filtered, drawn int
		plainFiltered                      int
	}
	run := func(spec, check bool) result {
		cfg := poolCfg()
		if spec {
			cfg.Spec = Spec{Types: []string{SpecNgramSimple}, DraftMax: 8, StepCost: -1}
		}
		h := newHarness(t, cfg)
		h.be.model = fakeRepeater(9)
		h.be.grammar = fakeGrammar
		if check {
			h.be.checkDrafts = true
			h.s.useBackend(h.be.Caps())
		}
		var ids []TaskID
		for i := range 4 {
			req := Request{Prompt: seqTokens(100*i+1, 20), MaxTokens: 80}
			if i < 3 {
				req.Sampling.Grammar = "root ::= fake"
			}
			ids = append(ids, h.submit(req))
		}
		h.run()
		h.checkAccounting()
		var r result
		for i, id := range ids {
			ev, ok := h.done(id)
			if !ok || ev.Err != nil {
				t.Fatalf("task %d: ended %v, %v", id, ok, ev.Err)
			}
			r.texts = append(r.texts, h.text(id))
			r.drafted += ev.Stats.DraftN
			r.accepted += ev.Stats.DraftAccepted
			if i < 3 {
				r.filtered += ev.Stats.DraftFiltered
			} else {
				r.plainFiltered += ev.Stats.DraftFiltered
			}
		}
		r.drawn = h.be.drawn
		if check {
			// Every draft of a grammar task may follow the entry before it.
			for _, b := range h.be.batches {
				prev := map[TaskID]Token{}
				for _, e := range b {
					if p, ok := prev[e.Task]; ok && e.Draft && e.Task != ids[3] && !fakeGrammar(p, e.Token) {
						t.Errorf("task %d: draft %d planned after %d, which the grammar forbids", e.Task, e.Token, p)
					}
					prev[e.Task] = e.Token
				}
			}
		}
		return r
	}
	base := run(false, false)
	unchecked := run(true, false)
	checked := run(true, true)
	for name, r := range map[string]result{"unchecked": unchecked, "checked": checked} {
		if !slices.Equal(r.texts, base.texts) {
			t.Errorf("%s speculation changed the output:\n%q\n%q", name, r.texts, base.texts)
		}
		if r.drawn != base.drawn {
			t.Errorf("%s: the backend drew %d samples, %d without speculation", name, r.drawn, base.drawn)
		}
		if r.accepted == 0 {
			t.Errorf("%s: no draft accepted", name)
		}
	}
	t.Logf("unchecked: drafted %d, accepted %d; checked: drafted %d, accepted %d, cut %d", unchecked.drafted, unchecked.accepted, checked.drafted, checked.accepted, checked.filtered)
	if checked.filtered == 0 || unchecked.filtered != 0 || checked.plainFiltered != 0 {
		t.Errorf("cut tokens: %d checked (grammar requests), %d unchecked, %d of the plain request: want some, none, none", checked.filtered, unchecked.filtered, checked.plainFiltered)
	}
	if checked.drafted >= unchecked.drafted || checked.accepted*unchecked.drafted <= unchecked.accepted*checked.drafted {
		t.Errorf("checked drafts %d (%d accepted), unchecked %d (%d): want fewer at higher acceptance", checked.drafted, checked.accepted, unchecked.drafted, unchecked.accepted)
	}
}

// ngramLookup proposes up to k tokens continuing ctx followed by last: it finds the
// longest suffix of that sequence (at least minN tokens, at most maxN) that also occurs
// earlier in it, the most recent such occurrence, and proposes the tokens that followed
// it. nil when no suffix of minN tokens recurs.
// (A test helper: the scheduler asks an ngramSession, which keeps the match for the step.)
func ngramLookup(ctx []Token, last Token, minN, maxN, k int) []Token {
	best, end := ngramMatch(ctx, last, maxN)
	return ngramFrom(ctx, last, best, end, minN, k)
}
