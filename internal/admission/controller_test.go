package admission

import (
	"errors"
	"testing"
	"time"
)

// The controller is pure: these tests hand it facts and times and read its verdicts,
// with no scheduler, model or clock.

var t0 = time.Unix(1000, 0)

const pid = 1

// controller returns a controller whose pool pid has policy p.
func controller(t *testing.T, p Policy) *Controller {
	t.Helper()
	c := NewController()
	if _, err := c.SetPolicy(pid, Replace(p)); err != nil {
		t.Fatal(err)
	}
	return c
}

// facts is a pool with the given warm sessions' rates, lots of free cells.
func facts(rates ...float64) Facts {
	return Facts{Sessions: len(rates), Rates: rates, FreeCells: 4000, TotalCells: 4096, MarginalCells: 100}
}

// warming is a pool whose one session has just started: its rate is not measured yet.
func warming() Facts {
	return Facts{Sessions: 1, Warming: 1, FreeCells: 4000, TotalCells: 4096, MarginalCells: 100}
}

func enforced(onSat string, floor float64) Policy {
	p := DefaultPolicy()
	p.Mode, p.OnSaturation, p.TargetTPS = ModeEnforced, onSat, floor
	p.SettleTokens, p.SettleMaxMs = 10, 2000
	return p
}

func TestControllerPolicy(t *testing.T) {
	c := NewController()
	if c.Policy(pid) != DefaultPolicy() {
		t.Fatalf("an unknown pool's policy: %+v", c.Policy(pid))
	}
	floor := 12.5
	p, err := c.SetPolicy(pid, Patch{TargetTPS: &floor})
	if err != nil || p.TargetTPS != floor || p.Mode != ModeAdvisory || c.Floors()[pid] != floor {
		t.Fatalf("patch: %+v %v floors %v", p, err, c.Floors())
	}
	bad := "strict"
	if _, err := c.SetPolicy(pid, Patch{Mode: &bad}); err == nil || c.Policy(pid).Mode != ModeAdvisory {
		t.Fatalf("an invalid patch was applied: %v %+v", err, c.Policy(pid))
	}
	c.Forget(pid)
	if c.Policy(pid) != DefaultPolicy() || len(c.Floors()) != 0 {
		t.Fatalf("a forgotten pool keeps its policy: %+v", c.Policy(pid))
	}
}

func TestSettleWindowOpensAndCloses(t *testing.T) {
	p := DefaultPolicy()
	p.SettleTokens, p.SettleMaxMs = 10, 2000
	c := controller(t, p)
	if v := c.Verdict(t0, pid, facts()); v.Settling {
		t.Fatalf("settling before any admit: %+v", v)
	}
	c.Seated(t0, pid, 7, nil)
	if w := c.Windows(); len(w) != 1 || w[0] != (Window{Pool: pid, Key: 7}) {
		t.Fatalf("windows: %+v", w)
	}
	at := t0.Add(500 * time.Millisecond)
	v := c.Verdict(at, pid, facts(50))
	if !v.Settling || v.CanAdmit || v.Reason != ReasonSettling || v.SettleRemainingMs != 1500 || v.RetryAfterS != 2 {
		t.Fatalf("open window: %+v", v)
	}
	// Nine tokens: still open. The tenth closes it.
	if c.Progress(at, pid, 9, false, []float64{50}) || len(c.Windows()) != 1 {
		t.Fatal("window closed before settle_tokens")
	}
	if !c.Progress(at, pid, 10, false, []float64{50}) || len(c.Windows()) != 0 {
		t.Fatal("window still open after settle_tokens")
	}
	if v := c.Verdict(at, pid, facts(50)); v.Settling || !v.CanAdmit {
		t.Fatalf("after the window: %+v", v)
	}
	// settle_max_ms closes a window whose session decodes nothing; so does its end.
	c.Seated(at, pid, 8, nil)
	if c.Progress(at.Add(1999*time.Millisecond), pid, 0, false, nil) {
		t.Fatal("closed before settle_max_ms")
	}
	if !c.Progress(at.Add(2*time.Second), pid, 0, false, nil) {
		t.Fatal("open after settle_max_ms")
	}
	c.Seated(at, pid, 9, nil)
	if !c.Progress(at, pid, 0, true, nil) {
		t.Fatal("open after its session ended")
	}
	// A pending admit (let in, not seated) keeps the pool settling with no window open.
	f := facts(50)
	f.Pending = 1
	if v := c.Verdict(at, pid, f); !v.Settling || v.NPoolSessions != 2 {
		t.Fatalf("pending admit: %+v", v)
	}
}

func TestMeasuredDropAgainstFloor(t *testing.T) {
	p := DefaultPolicy()
	p.TargetTPS, p.SettleTokens = 15, 10
	c := controller(t, p)
	// Before any measured drop, the model projection (30·2/3 = 20) clears the floor.
	if v := c.Verdict(t0, pid, facts(30, 30)); !v.CanAdmit || v.DropPerAdmitEWMA != nil || *v.ProjectedIfAdmitted != 20 {
		t.Fatalf("model projection: %+v", v)
	}
	// One session decoded at 50 when the second was seated; settled, both decode at 30.
	c.Seated(t0, pid, 1, []float64{50})
	c.Progress(t0.Add(time.Second), pid, 10, false, []float64{30, 30})
	v := c.Verdict(t0.Add(time.Second), pid, facts(30, 30))
	if v.DropPerAdmitEWMA == nil || *v.DropPerAdmitEWMA != 20 || *v.ProjectedMeasured != 10 || *v.ProjectedIfAdmitted != 10 {
		t.Fatalf("measured drop: %+v", v)
	}
	if v.CanAdmit || v.Reason != ReasonFloor {
		t.Fatalf("the measured drop (30 - 20 < 15) must refuse: %+v", v)
	}
	// The next settle folds into the EWMA: 0.7·20 + 0.3·(30-26) = 15.2.
	c.Seated(t0.Add(2*time.Second), pid, 2, []float64{30, 30})
	c.Progress(t0.Add(3*time.Second), pid, 10, false, []float64{26, 26, 26})
	if v := c.Verdict(t0.Add(3*time.Second), pid, facts(26, 26, 26)); abs(*v.DropPerAdmitEWMA-15.2) > 1e-9 {
		t.Fatalf("folded drop %v, want 15.2", *v.DropPerAdmitEWMA)
	}
	// Between turns (no session decoding) the settled mean stands in while fresh.
	idle := Facts{Sessions: 3, FreeCells: 4000, TotalCells: 4096}
	if v := c.Verdict(t0.Add(4*time.Second), pid, idle); !v.ProjectedIdleEstimate || v.CanAdmit || v.Reason != ReasonFloorIdle {
		t.Fatalf("idle estimate: %+v", v)
	}
	if v := c.Verdict(t0.Add(3*time.Second+IdleFreshness), pid, idle); v.ProjectedIdleEstimate || !v.CanAdmit {
		t.Fatalf("stale settled mean still used: %+v", v)
	}
}

func TestHoldThenRelease(t *testing.T) {
	c := controller(t, enforced(OnReject, 10))
	c.Seated(t0, pid, 1, nil) // the first session (guaranteed) opens a window
	d := c.Gate(t0, pid, warming())
	if d.Action != Hold || !d.Checked || d.Verdict.Reason != ReasonSettling || !d.Until.Equal(t0.Add(3*time.Second)) {
		t.Fatalf("second session while settling: %+v", d)
	}
	if c.Held() != 0 {
		t.Fatal("Gate recorded a hold by itself")
	}
	c.Hold(2, pid, d.Until)
	c.Hold(3, pid, d.Until)
	if c.Held() != 2 || len(c.HeldKeys()) != 2 || c.HeldKeys()[0] != 2 {
		t.Fatalf("held: %v", c.HeldKeys())
	}
	if d := c.Review(t0.Add(time.Second), 2, facts(50)); d.Action != Hold || c.Held() != 2 {
		t.Fatalf("released while settling: %+v", d)
	}
	c.Progress(t0.Add(time.Second), pid, 10, false, []float64{50})
	if d := c.Review(t0.Add(time.Second), 2, facts(50)); d.Action != Admit || c.Held() != 1 {
		t.Fatalf("not released after the settle: %+v", d)
	}
	// The one let in is pending: the next stays held (a second admit is not measured yet).
	f := facts(50)
	f.Pending = 1
	if d := c.Review(t0.Add(time.Second), 3, f); d.Action != Hold {
		t.Fatalf("second held request let in beside a pending admit: %+v", d)
	}
	// Its wait runs out.
	if d := c.Review(d.Until, 3, f); d.Action != Refuse || c.Held() != 0 {
		t.Fatalf("deadline: %+v held %d", d, c.Held())
	}
	// Unhold (a cancel) forgets a held request.
	c.Hold(4, pid, t0.Add(time.Hour))
	if !c.Unhold(4) || c.Unhold(4) || c.Held() != 0 {
		t.Fatal("unhold")
	}
}

func TestHeldForSettleThenRefusedByFloor(t *testing.T) {
	c := controller(t, enforced(OnReject, 45))
	c.Seated(t0, pid, 1, nil)
	d := c.Gate(t0, pid, warming())
	c.Hold(2, pid, d.Until)
	c.Progress(t0.Add(time.Second), pid, 10, false, []float64{50})
	// Measured: 50·1/2 = 25 < 45. A reject pool answers at once, before the deadline.
	if d := c.Review(t0.Add(time.Second), 2, facts(50)); d.Action != Refuse || d.Verdict.Reason != ReasonFloor || c.Held() != 0 {
		t.Fatalf("held for the settle, then under the floor: %+v", d)
	}
	// A queue pool keeps holding it until queue_timeout_ms.
	p := enforced(OnQueue, 45)
	p.QueueTimeoutMs = 5000
	c = controller(t, p)
	d = c.Gate(t0, pid, facts(50))
	if d.Action != Hold || d.Verdict.Reason != ReasonFloor || !d.Until.Equal(t0.Add(5*time.Second)) {
		t.Fatalf("queue pool under the floor: %+v", d)
	}
	c.Hold(3, pid, d.Until)
	if d := c.Review(t0.Add(4*time.Second), 3, facts(50)); d.Action != Hold {
		t.Fatalf("queue pool refused before its timeout: %+v", d)
	}
	if d := c.Review(t0.Add(4*time.Second), 3, facts()); d.Action != Admit {
		t.Fatalf("queue pool did not admit once the session left: %+v", d)
	}
}

func TestSaturatedVerdict(t *testing.T) {
	c := controller(t, enforced(OnReject, 40))
	d := c.Gate(t0, pid, facts(50)) // 50·1/2 = 25 < 40
	if d.Action != Refuse || d.Verdict.CanAdmit || d.Verdict.Reason != ReasonFloor || d.Verdict.RetryAfterS != 2 {
		t.Fatalf("saturated: %+v", d)
	}
	f := facts(50)
	f.FreeCells = 99 // less than one session's marginal 100 cells
	c = controller(t, enforced(OnReject, 0))
	if d := c.Gate(t0, pid, f); d.Action != Refuse || d.Verdict.Reason != ReasonKV {
		t.Fatalf("kv saturated: %+v", d)
	}
	c = controller(t, enforced(OnWarn, 40))
	if d := c.Gate(t0, pid, facts(50)); d.Action != Warn || !d.Checked || d.Verdict.Reason != ReasonFloor {
		t.Fatalf("warn: %+v", d)
	}
	// An advisory pool never gates: no verdict computed.
	p := enforced(OnReject, 40)
	p.Mode = ModeAdvisory
	c = controller(t, p)
	if d := c.Gate(t0, pid, facts(50)); d.Action != Admit || d.Checked {
		t.Fatalf("advisory: %+v", d)
	}
}

func TestReservationTTLAndUse(t *testing.T) {
	c := controller(t, DefaultPolicy())
	if err := CheckReservation(-time.Millisecond, 0); err == nil {
		t.Fatal("negative ttl accepted")
	}
	if err := CheckReservation(MaxReservationTTL+time.Millisecond, 0); err == nil {
		t.Fatal("ttl over the maximum accepted")
	}
	if err := CheckReservation(0, -1); err == nil {
		t.Fatal("negative expected_tokens accepted")
	}
	g, err := c.Reserve(t0, pid, 0, facts())
	if err != nil || g.ID != "rsv-1-1" || g.TTL != DefaultReservationTTL || !g.Verdict.CanAdmit || g.Verdict.Reason != ReasonGuaranteed {
		t.Fatalf("first reservation: %+v %v", g, err)
	}
	// A granted reservation is a warming session: it takes the guaranteed place, keeps
	// the pool settling and takes its cells (here 300 expected tokens) from the headroom.
	f := facts()
	f.Expected = 300
	g2, err := c.Reserve(t0, pid, time.Second, f)
	if err != nil || g2.ID != "" || g2.Verdict.Reason != ReasonSettling || g2.Verdict.NReserved != 1 || g2.Verdict.NWarming != 1 {
		t.Fatalf("second reservation beside the first: %+v %v", g2, err)
	}
	// Used once, then gone.
	if !c.UseReservation(t0, pid, g.ID) || c.UseReservation(t0, pid, g.ID) || c.Reservations(t0, pid) != 0 {
		t.Fatal("a reservation is used exactly once")
	}
	if c.UseReservation(t0, pid, "") || c.UseReservation(t0, 2, g.ID) {
		t.Fatal("no id, or another pool's, used a reservation")
	}
	// Cells: a live reservation with expected tokens takes them from the free cells.
	g3, err := c.Reserve(t0, pid, time.Second, f)
	if err != nil || g3.ID != "rsv-1-2" || g3.TTL != time.Second {
		t.Fatalf("third reservation: %+v %v", g3, err)
	}
	if v := c.Verdict(t0, pid, facts()); v.FreeCells != 3700 || v.NPoolSessions != 1 || !v.Settling {
		t.Fatalf("reservation counted: %+v", v)
	}
	// TTL: live until just before its expiry, gone at it.
	if c.Reservations(t0.Add(999*time.Millisecond), pid) != 1 {
		t.Fatal("expired early")
	}
	if c.UseReservation(t0.Add(time.Second), pid, g3.ID) || c.Reservations(t0.Add(time.Second), pid) != 0 {
		t.Fatal("an expired reservation was used")
	}
	if v := c.Verdict(t0.Add(time.Second), pid, facts()); v.FreeCells != 4000 || v.Settling || v.NReserved != 0 {
		t.Fatalf("an expired reservation still counts: %+v", v)
	}
	if err := c.ReleaseReservation(t0.Add(time.Second), pid, g3.ID); !errors.Is(err, ErrReservationNotFound) {
		t.Fatalf("release of an expired reservation: %v", err)
	}
	g4, _ := c.Reserve(t0.Add(time.Second), pid, 0, facts())
	if err := c.ReleaseReservation(t0.Add(time.Second), pid, g4.ID); err != nil || c.Reservations(t0.Add(time.Second), pid) != 0 {
		t.Fatalf("release: %v", err)
	}
}

func TestReservationLimit(t *testing.T) {
	p := DefaultPolicy()
	p.GuaranteeMinSessions = MaxReservationsPerPool + 1 // every one guaranteed: only the limit refuses
	c := controller(t, p)
	for i := range MaxReservationsPerPool {
		if g, err := c.Reserve(t0, pid, 0, facts()); err != nil || g.ID == "" {
			t.Fatalf("reservation %d: %+v %v", i, g, err)
		}
	}
	if _, err := c.Reserve(t0, pid, 0, facts()); !errors.Is(err, ErrReservationLimit) {
		t.Fatalf("past the limit: %v", err)
	}
	// Expired ones make room again.
	if g, err := c.Reserve(t0.Add(DefaultReservationTTL), pid, 0, facts()); err != nil || g.ID == "" {
		t.Fatalf("after expiry: %+v %v", g, err)
	}
}

func abs(x float64) float64 { return max(x, -x) }

func TestKnownSessions(t *testing.T) {
	c := NewController()
	if c.Known("A") {
		t.Fatal("a session known before it was seated")
	}
	c.SessionSeated("", t0) // anonymous requests are never continuations
	c.SessionSeated("A", t0)
	c.SessionSeated("B", t0.Add(time.Minute))
	if !c.Known("A") || !c.Known("B") || c.Known("") {
		t.Fatal("seated sessions not known")
	}
	c.ForgetSessions(t0.Add(time.Hour+time.Second), time.Hour)
	if c.Known("A") || !c.Known("B") {
		t.Fatal("forgetting: A was last seated over an hour ago, B not")
	}
}
