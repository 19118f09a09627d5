package tps

import (
	"math"
	"testing"
	"time"
)

func TestSteadyRate(t *testing.T) {
	e := NewEWMA(2 * time.Second)
	t0 := time.Unix(0, 0)
	e.Start(t0)
	for i := 1; i <= 50; i++ {
		e.Observe(1, t0.Add(time.Duration(i)*20*time.Millisecond)) // 50 tok/s
	}
	if r := e.Rate(); math.Abs(r-50) > 1e-6 {
		t.Fatalf("steady 50 tok/s estimated as %f", r)
	}
	if e.Warming() {
		t.Fatal("still warming after 1 s and 50 tokens")
	}
}

func TestBiasCorrectionEarly(t *testing.T) {
	e := NewEWMA(2 * time.Second)
	t0 := time.Unix(0, 0)
	e.Start(t0)
	e.Observe(1, t0.Add(10*time.Millisecond))
	if r := e.Rate(); math.Abs(r-100) > 1e-6 {
		t.Fatalf("first sample of 100 tok/s estimated as %f (no creep from zero)", r)
	}
	if !e.Warming() {
		t.Fatal("one token is not warm")
	}
	for i := 2; i <= MinWarmTokens; i++ {
		e.Observe(1, t0.Add(time.Duration(i)*10*time.Millisecond))
	}
	if e.Warming() {
		t.Fatalf("still warming after %d tokens", MinWarmTokens)
	}
}

func TestTracksChangeWithTau(t *testing.T) {
	e := NewEWMA(time.Second)
	t0 := time.Unix(0, 0)
	e.Start(t0)
	now := t0
	for range 1000 { // 10 s at 100 tok/s
		now = now.Add(10 * time.Millisecond)
		e.Observe(1, now)
	}
	for range 50 { // 1 s (= tau) at 50 tok/s
		now = now.Add(20 * time.Millisecond)
		e.Observe(1, now)
	}
	want := 50 + 50*math.Exp(-1) // 63% of the step absorbed after tau
	if r := e.Rate(); math.Abs(r-want) > 0.5 {
		t.Fatalf("after one tau: %f, want %f", r, want)
	}
}

func TestIrregularStepsWeighByDuration(t *testing.T) {
	e := NewEWMA(10 * time.Second)
	t0 := time.Unix(0, 0)
	e.Start(t0)
	// 1 token in 10 ms, then 1 token in 90 ms: 2 tokens per 100 ms = 20 tok/s overall.
	now := t0
	for range 100 {
		now = now.Add(10 * time.Millisecond)
		e.Observe(1, now)
		now = now.Add(90 * time.Millisecond)
		e.Observe(1, now)
	}
	if r := e.Rate(); math.Abs(r-20)/20 > 0.05 {
		t.Fatalf("irregular steps: %f, want about 20", r)
	}
}

func TestRateAtDecaysWhenStalled(t *testing.T) {
	e := NewEWMA(time.Second)
	t0 := time.Unix(0, 0)
	e.Start(t0)
	now := t0
	for range 100 {
		now = now.Add(10 * time.Millisecond)
		e.Observe(1, now)
	}
	if r := e.RateAt(now.Add(3 * time.Second)); r > 100*math.Exp(-3)+1 {
		t.Fatalf("stalled 3 tau: %f", r)
	}
	if Mean([]float64{1, 2, 3}) != 2 || Mean(nil) != 0 {
		t.Fatal("mean")
	}
}
