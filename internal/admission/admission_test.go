package admission

import (
	"testing"
	"time"
)

func TestValidate(t *testing.T) {
	if err := DefaultPolicy().Validate(); err != nil {
		t.Fatal(err)
	}
	for _, mut := range []func(*Policy){
		func(p *Policy) { p.TargetTPS = -1 },
		func(p *Policy) { p.Mode = "strict" },
		func(p *Policy) { p.OnSaturation = "drop" },
		func(p *Policy) { p.GuaranteeMinSessions = -1 },
		func(p *Policy) { p.SettleMaxMs = -5 },
		func(p *Policy) { p.Throttle = "on" },
		func(p *Policy) { p.ThrottleMargin = -0.1 },
		func(p *Policy) { p.ThrottleMaxSkip = 0.95 },
		func(p *Policy) { p.ThrottleMaxSkip = -1 },
	} {
		p := DefaultPolicy()
		mut(&p)
		if p.Validate() == nil {
			t.Fatalf("invalid policy accepted: %+v", p)
		}
	}
}

func TestDecideArmsInOrder(t *testing.T) {
	base := Input{Policy: DefaultPolicy(), Now: time.Unix(100, 0), PoolSessions: 2, ActiveTPS: []float64{30, 30},
		FreeCells: 1000, TotalCells: 2000, MarginalCells: 100}
	base.Policy.TargetTPS = 25
	v := Decide(base)
	if v.CanAdmit || v.Reason != ReasonFloor || *v.ProjectedModel != 20 || v.HeadroomSessions != 10 || v.KVHeadroomPct != 50 {
		t.Fatalf("floor arm: %+v", v)
	}
	in := base
	in.HasDrop, in.DropEWMA = true, 2 // measured: 30 - 2 = 28 >= 25
	if v := Decide(in); !v.CanAdmit || *v.ProjectedIfAdmitted != 28 {
		t.Fatalf("measured projection: %+v", v)
	}
	in = base
	in.FreeCells = 50
	if v := Decide(in); v.CanAdmit || v.Reason != ReasonKV {
		t.Fatalf("kv arm: %+v", v)
	}
	in = base
	in.Settling, in.SettleLeft = true, 2500*time.Millisecond
	if v := Decide(in); v.CanAdmit || v.Reason != ReasonSettling || v.RetryAfterS != 3 {
		t.Fatalf("settling: %+v", v)
	}
	in = base
	in.PoolSessions = 0
	in.Expected = 5000
	if v := Decide(in); v.CanAdmit || v.Reason != ReasonContext {
		t.Fatalf("context arm beats the guarantee: %+v", v)
	}
	known := true
	in = base
	in.KnownSession = &known
	if v := Decide(in); !v.CanAdmit || v.Reason != ReasonContinuation {
		t.Fatalf("continuation: %+v", v)
	}
}

func TestFoldDropAndSettle(t *testing.T) {
	if d := FoldDrop(0, false, 40, 30); d != 10 {
		t.Fatalf("first drop %f", d)
	}
	if d := FoldDrop(10, true, 30, 28); d != 0.7*10+0.3*2 {
		t.Fatalf("folded %f", d)
	}
	if d := FoldDrop(0, false, 30, 35); d != 0 {
		t.Fatalf("a rise is no drop: %f", d)
	}
	p := DefaultPolicy()
	start := time.Unix(0, 0)
	if SettleDone(p, start, start.Add(time.Second), 10, false) {
		t.Fatal("settled early")
	}
	if !SettleDone(p, start, start.Add(time.Second), 48, false) || !SettleDone(p, start, start.Add(6*time.Second), 0, false) || !SettleDone(p, start, start, 0, true) {
		t.Fatal("settle conditions")
	}
}

// The throttle applies only with a floor and a skip allowance, and a patch changes
// its fields alone.
func TestThrottlePolicy(t *testing.T) {
	p := DefaultPolicy()
	if p.Throttle != ThrottleOff || p.Throttles() {
		t.Fatalf("default policy throttles: %+v", p)
	}
	on, margin := ThrottleTowardFloor, 0.3
	p = Patch{Throttle: &on, ThrottleMargin: &margin}.Apply(p)
	if p.Throttles() {
		t.Fatal("throttles without a floor")
	}
	floor := 20.0
	p = Patch{TargetTPS: &floor}.Apply(p)
	if !p.Throttles() || p.ThrottleMargin != 0.3 || p.ThrottleMaxSkip != 0.5 || p.Validate() != nil {
		t.Fatalf("with a floor: %+v", p)
	}
	zero := 0.0
	if q := (Patch{ThrottleMaxSkip: &zero}).Apply(p); q.Throttles() {
		t.Fatal("throttles with max skip 0")
	}
	c := NewController()
	if c.Throttling() {
		t.Fatal("a new controller throttles")
	}
	if _, err := c.SetPolicy(3, Replace(p)); err != nil || !c.Throttling() {
		t.Fatalf("set: %v, throttling %v", err, c.Throttling())
	}
	c.Forget(3)
	if c.Throttling() {
		t.Fatal("a forgotten pool still throttles")
	}
}
