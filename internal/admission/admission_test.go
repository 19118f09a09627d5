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
