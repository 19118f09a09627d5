package engine

import (
	"math"
	"slices"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/admission"
)

// affineCost makes a step cost 5 ms plus 10 ms per decode row (a sampled entry) plus
// 1 ms per other prompt token: a fixed part, as on a real machine, so skipping rows
// frees a little more than their share. With the 10 ms the harness adds before each
// plan, three decoding sessions run at ~22 tok/s and one at ~40.
func affineCost(batch []BatchEntry) time.Duration {
	d := 5 * time.Millisecond
	for _, e := range batch {
		if e.Sample {
			d += 10 * time.Millisecond
		} else {
			d += time.Millisecond
		}
	}
	return d
}

// throttleScene is two pools on one scheduler: fast (a low floor, and the policy under
// test) and slow (a floor its session cannot reach beside the others), two sessions on
// fast and one on slow, each decoding n tokens.
type throttleScene struct {
	h          *harness
	fast, slow int
	prefix     []Token
	a1, a2, b  TaskID
	// absent counts, per fast session, the steps it was running but not in the batch,
	// and the longest run of them.
	absent, longest map[TaskID]int
}

func newThrottleScene(t *testing.T, fastPolicy admission.Policy, n int) *throttleScene {
	t.Helper()
	cfg := poolCfg()
	cfg.Parallel = 6
	cfg.NCtx = 4096
	h := newHarness(t, cfg)
	h.stepCost = affineCost
	sc := &throttleScene{h: h, prefix: seqTokens(1, 20), absent: map[TaskID]int{}, longest: map[TaskID]int{}}
	sc.fast = h.createPool(PoolSpec{Tokens: sc.prefix})
	sc.slow = h.createPool(PoolSpec{Tokens: seqTokens(200, 20)})
	if err := h.setAdmission(sc.fast, fastPolicy); err != nil {
		t.Fatal(err)
	}
	slowPolicy := admission.DefaultPolicy()
	slowPolicy.TargetTPS = 40
	if err := h.setAdmission(sc.slow, slowPolicy); err != nil {
		t.Fatal(err)
	}
	sc.a1 = h.submit(agentReq(sc.prefix, sc.fast, "a1", n))
	sc.a2 = h.submit(Request{Prompt: append(slices.Clone(sc.prefix), 98), HasPool: true, PoolID: sc.fast, SessionID: "a2", MaxTokens: n})
	sc.b = h.submit(agentReq(seqTokens(200, 20), sc.slow, "b", n))
	return sc
}

// run steps until every task ended, recording the fast sessions' absences.
func (sc *throttleScene) run(t *testing.T) {
	t.Helper()
	run := map[TaskID]int{}
	for i := 0; !sc.h.s.Idle(); i++ {
		if i > 5000 {
			t.Fatal("not idle after 5000 steps")
		}
		batch := sc.h.step()
		for _, id := range []TaskID{sc.a1, sc.a2} {
			tk, ok := sc.h.s.tasks[id]
			if !ok || !tk.decoding() {
				continue
			}
			if slices.ContainsFunc(batch, func(e BatchEntry) bool { return e.Task == id }) {
				run[id] = 0
				continue
			}
			sc.absent[id]++
			run[id]++
			sc.longest[id] = max(sc.longest[id], run[id])
		}
	}
	sc.h.step()
}

func (sc *throttleScene) done(t *testing.T, id TaskID) Event {
	t.Helper()
	ev, ok := sc.h.done(id)
	if !ok || ev.Err != nil {
		t.Fatalf("task %d: %+v", id, ev)
	}
	return ev
}

func throttlePolicy(floor float64) admission.Policy {
	p := admission.DefaultPolicy()
	p.TargetTPS = floor
	p.Throttle = admission.ThrottleTowardFloor
	return p
}

// A session far above its floor skips steps while a session under its own floor runs
// beside it: the slow session gets shorter steps, the fast ones stay above their
// floor, skips are bounded (never two in a row at max skip 0.5), and every output is
// the one the unthrottled run gives.
func TestThrottleGivesSkippedStepsToSessionUnderFloor(t *testing.T) {
	const n = 200
	off := newThrottleScene(t, func() admission.Policy { p := throttlePolicy(10); p.Throttle = admission.ThrottleOff; return p }(), n)
	off.run(t)
	on := newThrottleScene(t, throttlePolicy(10), n)
	on.run(t)
	for _, sc := range []*throttleScene{off, on} {
		for _, id := range []TaskID{sc.a1, sc.a2, sc.b} {
			sc.done(t, id)
		}
	}
	for _, pair := range [][2]TaskID{{off.a1, on.a1}, {off.a2, on.a2}, {off.b, on.b}} {
		if a, b := off.h.text(pair[0]), on.h.text(pair[1]); a != b {
			t.Fatalf("throttled output differs:\n off %q\n on  %q", a, b)
		}
	}
	if n := off.done(t, off.a1).Stats.ThrottledSteps + off.done(t, off.a2).Stats.ThrottledSteps; n != 0 {
		t.Fatalf("throttle off: %d steps skipped", n)
	}
	offB, onB := off.done(t, off.b).Stats, on.done(t, on.b).Stats
	if onB.ThrottledSteps != 0 {
		t.Fatalf("the slow pool has no throttle, yet its session skipped %d steps", onB.ThrottledSteps)
	}
	// The slow session's decode took ~45 ms a token beside both fast ones; throttled,
	// every other step has one row instead of three.
	if onB.PredictTime > offB.PredictTime*85/100 {
		t.Fatalf("the session under its floor decoded in %s throttled, %s not: no faster", onB.PredictTime, offB.PredictTime)
	}
	for _, id := range []TaskID{on.a1, on.a2} {
		st := on.done(t, id).Stats
		if st.ThrottledSteps == 0 {
			t.Fatalf("fast session %d was never throttled", id)
		}
		if st.ThrottledSteps != on.absent[id] {
			t.Fatalf("fast session %d: %d throttled steps reported, %d steps out of the batch seen", id, st.ThrottledSteps, on.absent[id])
		}
		// At most half its steps (plus the one credit it may start a skip with), never
		// two in a row.
		if steps := st.PredictedN + st.ThrottledSteps; st.ThrottledSteps > steps/2+1 || on.longest[id] > 1 {
			t.Fatalf("fast session %d skipped %d of %d steps, %d in a row", id, st.ThrottledSteps, steps, on.longest[id])
		}
		// Still well above its floor of 10 tok/s.
		if rate := float64(st.PredictedN) / st.PredictTime.Seconds(); rate < 12 {
			t.Fatalf("fast session %d throttled down to %.1f tok/s, under floor·(1+margin)", id, rate)
		}
	}
	if got := on.h.s.ThrottledSteps()[on.fast]; got != int64(on.absent[on.a1]+on.absent[on.a2]) {
		t.Fatalf("per-pool counter %d, want %d", got, on.absent[on.a1]+on.absent[on.a2])
	}
}

// With nobody near or under a floor and no prompt cut by the budget, nothing is
// throttled: the same batches as with the throttle off.
func TestThrottleIdleWithoutBeneficiary(t *testing.T) {
	plans := func(p admission.Policy) ([][]BatchEntry, string) {
		cfg := poolCfg()
		cfg.Parallel = 4
		cfg.NCtx = 2048
		h := newHarness(t, cfg)
		h.stepCost = affineCost
		prefix := seqTokens(1, 20)
		id := h.createPool(PoolSpec{Tokens: prefix})
		if err := h.setAdmission(id, p); err != nil {
			t.Fatal(err)
		}
		// A session of a pool without a floor beside them: it has no floor to be near,
		// so it is no reason to throttle either (and it keeps the batch from emptying).
		other := h.createPool(PoolSpec{Tokens: seqTokens(200, 20)})
		a := h.submit(agentReq(prefix, id, "a", 80))
		b := h.submit(Request{Prompt: append(slices.Clone(prefix), 98), HasPool: true, PoolID: id, SessionID: "b", MaxTokens: 80})
		c := h.submit(agentReq(seqTokens(200, 20), other, "c", 100))
		var out [][]BatchEntry
		for i := 0; !h.s.Idle() && i < 1000; i++ {
			out = append(out, h.step())
		}
		return out, h.text(a) + "|" + h.text(b) + "|" + h.text(c)
	}
	on := throttlePolicy(5) // both sessions far above 5 tok/s, nobody under
	offP := on
	offP.Throttle = admission.ThrottleOff
	gotOn, textOn := plans(on)
	gotOff, textOff := plans(offP)
	if textOn != textOff || len(gotOn) != len(gotOff) {
		t.Fatalf("without a beneficiary the throttle changed the run: %d vs %d steps", len(gotOn), len(gotOff))
	}
	for i := range gotOn {
		if !slices.Equal(gotOn[i], gotOff[i]) {
			t.Fatalf("step %d differs: %v vs %v", i, gotOn[i], gotOff[i])
		}
	}
	// A pool with the throttle on and no floor is never throttled either.
	noFloor := throttlePolicy(0)
	if noFloor.Throttles() {
		t.Fatal("a pool without a floor throttles")
	}
}

// A prompt the step's token budget cuts is a reason to throttle: the skipped rows'
// tokens go to it, and it reaches its first token in fewer steps.
func TestThrottleFeedsBudgetCutPrefill(t *testing.T) {
	firstToken := func(p admission.Policy) (int, int) {
		cfg := poolCfg()
		cfg.Parallel = 8
		cfg.NBatch = 8
		cfg.NCtx = 4096
		h := newHarness(t, cfg)
		h.stepCost = affineCost
		prefix := seqTokens(1, 20)
		id := h.createPool(PoolSpec{Tokens: prefix})
		if err := h.setAdmission(id, p); err != nil {
			t.Fatal(err)
		}
		var fast []TaskID
		for i := range 6 {
			fast = append(fast, h.submit(Request{Prompt: append(slices.Clone(prefix), Token(90+i)), HasPool: true, PoolID: id, SessionID: string(rune('a' + i)), MaxTokens: 400}))
		}
		h.steps(60) // all six decoding and warm, at ~13 tok/s
		long := h.submit(Request{Prompt: seqTokens(500, 60), MaxTokens: 4})
		for i := 1; i < 200; i++ {
			h.step()
			if tk, ok := h.s.tasks[long]; !ok || !tk.firstTok.IsZero() {
				skipped := 0
				for _, f := range fast {
					if tk, ok := h.s.tasks[f]; ok {
						skipped += tk.throttled
					}
				}
				return i, skipped
			}
		}
		t.Fatal("the long prompt never got its first token")
		return 0, 0
	}
	offP := throttlePolicy(4)
	offP.Throttle = admission.ThrottleOff
	offSteps, offSkipped := firstToken(offP)
	onSteps, onSkipped := firstToken(throttlePolicy(4))
	if offSkipped != 0 || onSkipped == 0 {
		t.Fatalf("skips: off %d, on %d", offSkipped, onSkipped)
	}
	if onSteps >= offSteps {
		t.Fatalf("the budget-cut prompt took %d steps throttled, %d not", onSteps, offSteps)
	}
}

// Admission reads the unthrottled rates: with the throttle holding the fast pool's
// sessions near floor·(1+margin), /capacity still projects what they would decode
// unthrottled, so a third session is admitted as it is without the throttle (the gate
// does not refuse the room the throttle makes), while /polykv/tps reports what the
// sessions experience. The slow pool, which skips nothing, is judged by what its
// session experiences: the capacity the fast pool's skips give it counts.
func TestThrottleAdmissionCountsFreedCapacity(t *testing.T) {
	type reading struct {
		fast, slow admission.Verdict
		fastSeen   float64 // the fast sessions' mean experienced tps
		slowSeen   float64
	}
	verdict := func(p admission.Policy) reading {
		sc := newThrottleScene(t, p, 2000)
		sc.h.steps(400)
		r := reading{fast: sc.h.capacity(sc.fast).Verdict, slow: sc.h.capacity(sc.slow).Verdict}
		for _, st := range sc.h.s.TPS(sc.h.now).Sessions {
			switch {
			case st.PoolID != nil && *st.PoolID == sc.fast:
				r.fastSeen += st.TPSEWMA / 2
			case st.PoolID != nil && *st.PoolID == sc.slow:
				r.slowSeen = st.TPSEWMA
			}
		}
		return r
	}
	// Floor 14: unthrottled the two fast sessions decode at ~22 tok/s, a third is
	// projected at 22·2/3 ≈ 14.8.
	offP := throttlePolicy(14)
	offP.Throttle = admission.ThrottleOff
	offR, onR := verdict(offP), verdict(throttlePolicy(14))
	off, offSeen, on, onSeen := offR.fast, offR.fastSeen, onR.fast, onR.fastSeen
	if m := *onR.slow.MeanActiveTPS; math.Abs(m-onR.slowSeen) > 0.01*onR.slowSeen || m < *offR.slow.MeanActiveTPS*1.1 {
		t.Fatalf("slow pool: admission reads %.1f tok/s, its session experiences %.1f, unthrottled run %.1f", m, onR.slowSeen, *offR.slow.MeanActiveTPS)
	}
	if !off.CanAdmit {
		t.Fatalf("unthrottled: %+v", off)
	}
	if onSeen > offSeen*0.9 {
		t.Fatalf("throttled sessions experience %.1f tok/s, unthrottled %.1f: not throttled", onSeen, offSeen)
	}
	if !on.CanAdmit || on.MeanActiveTPS == nil || *on.MeanActiveTPS < *off.MeanActiveTPS*0.9 || *on.MeanActiveTPS > *off.MeanActiveTPS*1.1 {
		t.Fatalf("throttled: verdict %+v (mean %v), unthrottled mean %v, experienced %.1f", on, on.MeanActiveTPS, *off.MeanActiveTPS, onSeen)
	}
}

func TestRowCostFit(t *testing.T) {
	var c rowCost
	if c.marginal() != 0 {
		t.Fatal("a cost before any step")
	}
	for range 10 {
		c.observe(4, 45*time.Millisecond) // 5 ms + 10 ms a row, rows never varying
	}
	if got := c.marginal(); got < 11*time.Millisecond || got > 12*time.Millisecond {
		t.Fatalf("rows never varied: %s, want the mean per row 11.25 ms", got)
	}
	for i := range 40 {
		rows := 1 + i%4
		c.observe(rows, time.Duration(5+10*rows)*time.Millisecond)
	}
	if got := c.marginal(); got < 9900*time.Microsecond || got > 10100*time.Microsecond {
		t.Fatalf("slope %s, want 10 ms", got)
	}
	var flat rowCost
	for i := range 40 {
		flat.observe(1+i%4, 40*time.Millisecond) // a fixed cost only: at least half the mean
	}
	if got, mean := flat.marginal(), 40*time.Millisecond/time.Duration(2); got < mean/2 {
		t.Fatalf("flat steps: %s, below half the mean per row", got)
	}
}

// paceHarness is a scheduler with room for six sessions and affineCost's step times.
func paceHarness(t *testing.T) *harness {
	cfg := poolCfg()
	cfg.Parallel, cfg.NCtx, cfg.MaxQueue = 6, 4096, 16
	h := newHarness(t, cfg)
	h.stepCost = affineCost
	return h
}

// paceScene is one pool with a floor of 30 tok/s and the given throttle, and a
// session a1 decoding alone at 40 tok/s (affineCost: 15 ms a step of one row, plus the
// harness's 10 ms), measured (past warming) before anything else is submitted.
func paceScene(t *testing.T, throttle string, n int) (*harness, int, []Token, TaskID) {
	t.Helper()
	h := paceHarness(t)
	prefix := seqTokens(1, 20)
	id := h.createPool(PoolSpec{Tokens: prefix})
	p := throttlePolicy(30)
	p.Throttle = throttle
	if err := h.setAdmission(id, p); err != nil {
		t.Fatal(err)
	}
	a1 := h.submit(agentReq(prefix, id, "a1", n))
	h.steps(60) // 1.5 s: a1 decodes, measured
	if tk := h.s.tasks[a1]; tk == nil || !tk.decoding() || tk.ewma.Warming() {
		t.Fatal("a1 is not decoding past warming after 60 steps")
	}
	return h, id, prefix, a1
}

// seatedAt steps until task id holds a sequence (or ends), and returns when.
func seatedAt(t *testing.T, h *harness, id TaskID) time.Time {
	t.Helper()
	for i := 0; i < 5000; i++ {
		if tk, ok := h.s.tasks[id]; !ok || tk.slot != nil {
			return h.now
		}
		h.step()
	}
	t.Fatalf("task %d never seated", id)
	return time.Time{}
}

// Pacing: a new turn of a throttled pool waits (reason "floor") while one more
// session would slow the step's sessions under the floor (a1 alone at 40 tok/s, two
// at ~20 projected, floor·1.2 = 36), and goes when a1 ends, with the output it has
// unpaced; with the throttle off it goes at once. A pool with no running session is
// never held (a1 itself went).
func TestThrottlePacesTurnsAtTheFloor(t *testing.T) {
	texts := map[string]string{}
	for _, mode := range []string{admission.ThrottleOff, admission.ThrottleTowardFloor} {
		h, id, prefix, a1 := paceScene(t, mode, 100)
		a2 := h.submit(Request{Prompt: append(slices.Clone(prefix), 98), HasPool: true, PoolID: id, SessionID: "a2", MaxTokens: 20})
		h.step()
		waiting := h.s.Waiting(h.now)
		// a1's own next turn waits for a1 (reason session), not for the floor.
		if mode == admission.ThrottleTowardFloor {
			next := h.submit(Request{Prompt: append(slices.Clone(prefix), 99, 7), HasPool: true, PoolID: id, SessionID: "a1", MaxTokens: 1})
			h.step()
			w := h.s.Waiting(h.now)
			i := slices.IndexFunc(w, func(x WaitInfo) bool { return x.Task == uint64(next) })
			if len(w) != 2 || i < 0 || w[i].Reason != WaitSession || !h.s.tasks[next].pacedAt.IsZero() {
				t.Fatalf("waiting %+v: want a1's next turn waiting for its session, not paced", w)
			}
			h.cancel(next)
			waiting = h.s.Waiting(h.now)
		}
		if mode == admission.ThrottleOff {
			if len(waiting) != 0 || h.s.pacedTotal != 0 {
				t.Fatalf("throttle off: %+v waiting, %d paced", waiting, h.s.pacedTotal)
			}
		} else {
			if len(waiting) != 1 || waiting[0].Task != uint64(a2) || waiting[0].Reason != WaitFloor {
				t.Fatalf("toward_floor: waiting %+v, want a2 waiting for the floor", waiting)
			}
			at := seatedAt(t, h, a2)
			if _, running := h.s.tasks[a1]; running {
				t.Fatalf("a2 seated at %s while a1 still runs", at)
			}
			if h.s.pacedTotal != 1 {
				t.Fatalf("%d turns paced, want 1", h.s.pacedTotal)
			}
		}
		h.run()
		texts[mode] = h.text(a1) + "|" + h.text(a2)
	}
	if texts[admission.ThrottleOff] != texts[admission.ThrottleTowardFloor] {
		t.Fatalf("paced output differs:\n off %q\n on  %q", texts[admission.ThrottleOff], texts[admission.ThrottleTowardFloor])
	}
}

// A paced turn waits at most paceMaxHold, however long the running session decodes.
func TestThrottlePaceBounded(t *testing.T) {
	h, id, prefix, a1 := paceScene(t, admission.ThrottleTowardFloor, 1000) // 25 s of decoding
	a2 := h.submit(Request{Prompt: append(slices.Clone(prefix), 98), HasPool: true, PoolID: id, SessionID: "a2", MaxTokens: 5})
	h.step()
	held := h.s.tasks[a2].pacedAt
	if held.IsZero() {
		t.Fatal("a2 was not paced")
	}
	at := seatedAt(t, h, a2)
	if _, running := h.s.tasks[a1]; !running {
		t.Fatal("a1 ended before a2 went: the bound was not what let it go")
	}
	if w := at.Sub(held); w < paceMaxHold || w > paceMaxHold+100*time.Millisecond {
		t.Fatalf("a2 held %s, want paceMaxHold (%s)", w, paceMaxHold)
	}
}

// Among a throttled pool's paced turns the conversation furthest along goes first
// (pacedPeers), where the queue otherwise takes the least attained service first
// (TestContinuationsBeforeFirstTurns): when the busy session ends, the long
// conversation's turn is seated and the short one's waits on (two sessions would run
// at ~33 tok/s by the row-cost fit, under the floor·1.2 of 38.4).
func TestThrottlePacedMostAttainedFirst(t *testing.T) {
	h := paceHarness(t)
	prefix := seqTokens(1, 20)
	id := h.createPool(PoolSpec{Tokens: prefix})
	req := func(session string, extra []Token, n int) Request {
		return Request{Prompt: append(slices.Clone(prefix), extra...), HasPool: true, PoolID: id, SessionID: session, MaxTokens: n}
	}
	h.turn(req("short", seqTokens(500, 2), 2))
	h.turn(req("long", seqTokens(600, 60), 2))
	if err := h.setAdmission(id, throttlePolicy(32)); err != nil {
		t.Fatal(err)
	}
	busy := h.submit(req("busy", seqTokens(900, 2), 100))
	h.steps(60)
	short := h.submit(req("short", append(seqTokens(500, 2), 1, 2), 3))
	long := h.submit(req("long", append(seqTokens(600, 60), 1, 2), 3))
	h.step()
	if w := h.s.Waiting(h.now); len(w) != 2 || w[0].Reason != WaitFloor || w[1].Reason != WaitFloor {
		t.Fatalf("waiting %+v, want both turns paced", w)
	}
	seatedAt(t, h, long)
	if _, running := h.s.tasks[busy]; running {
		t.Fatal("the long conversation's turn went while the busy session ran")
	}
	if tk := h.s.tasks[short]; tk == nil || tk.slot != nil {
		t.Fatal("the short conversation's turn went with the long one's: want it paced behind it")
	}
	h.run()
	if h.tasksDone(busy, short, long) != 3 {
		t.Fatal("not every turn ended")
	}
}

// A throttled pool with nothing running is never paced, however slow the step its
// turn would join: another pool's session decoding beside it does not hold it, even
// under a floor nobody reaches.
func TestThrottlePaceNeverHoldsIdlePool(t *testing.T) {
	h := paceHarness(t)
	busyPrefix, prefix := seqTokens(200, 20), seqTokens(1, 20)
	other := h.createPool(PoolSpec{Tokens: busyPrefix})
	id := h.createPool(PoolSpec{Tokens: prefix})
	if err := h.setAdmission(id, throttlePolicy(1e6)); err != nil {
		t.Fatal(err)
	}
	busy := h.submit(agentReq(busyPrefix, other, "busy", 200))
	h.steps(60)
	a := h.submit(agentReq(prefix, id, "a", 5))
	h.step()
	if tk := h.s.tasks[a]; tk == nil || tk.slot == nil || !tk.pacedAt.IsZero() {
		t.Fatalf("the idle pool's turn waits (%+v) beside another pool's session", h.s.Waiting(h.now))
	}
	h.run()
	if h.tasksDone(busy, a) != 2 {
		t.Fatal("not every turn ended")
	}
}
