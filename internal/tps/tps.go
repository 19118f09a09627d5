// Package tps is the pure arithmetic of experienced decode speed: a time-based EWMA per
// session and for the whole server, with warming detection. It reads no clock; callers
// pass observation times.
package tps

import (
	"math"
	"time"
)

// DefaultTau is the EWMA time constant: a rate change is 63% absorbed after Tau.
const DefaultTau = 2 * time.Second

// EWMA is an exponentially weighted rate (tokens per second) over time. Each Observe
// adds n tokens that took the interval since the previous observation; the weight of a
// sample grows with its duration (alpha = 1 - exp(-dt/tau)), so irregular step times
// average correctly. The estimate is bias-corrected while young, so it is usable after
// a few samples instead of creeping up from zero.
type EWMA struct {
	Tau     time.Duration
	value   float64       // uncorrected average
	weight  float64       // total weight absorbed: 1 - Π(1 - alpha)
	last    time.Time     // time of the previous observation (or Start)
	elapsed time.Duration // time covered by samples
	tokens  int           // tokens observed
	started bool
}

// NewEWMA returns an EWMA with time constant tau (DefaultTau when <= 0).
func NewEWMA(tau time.Duration) EWMA {
	if tau <= 0 {
		tau = DefaultTau
	}
	return EWMA{Tau: tau}
}

// Start marks the moment measurement begins (e.g. the first sampled token), without a
// sample.
func (e *EWMA) Start(now time.Time) {
	e.last = now
	e.started = true
}

// Observe records n tokens completed at now.
func (e *EWMA) Observe(n int, now time.Time) {
	if !e.started {
		e.Start(now)
		return
	}
	dt := now.Sub(e.last)
	if dt <= 0 {
		e.tokens += n // same instant: fold into the next interval
		return
	}
	rate := float64(n) / dt.Seconds()
	alpha := 1 - math.Exp(-dt.Seconds()/e.Tau.Seconds())
	e.value += alpha * (rate - e.value)
	e.weight += alpha * (1 - e.weight)
	e.last = now
	e.elapsed += dt
	e.tokens += n
}

// Rate is the current estimate in tokens per second (0 before any sample).
func (e *EWMA) Rate() float64 {
	if e.weight == 0 {
		return 0
	}
	return e.value / e.weight
}

// RateAt is the estimate seen at now: it decays toward zero when no token has arrived
// for a while, so a stalled stream does not keep reporting its old speed.
func (e *EWMA) RateAt(now time.Time) float64 {
	r := e.Rate()
	if gap := now.Sub(e.last); e.started && gap > 0 {
		// An interval with no tokens so far, weighed like a sample of rate 0.
		alpha := 1 - math.Exp(-gap.Seconds()/e.Tau.Seconds())
		w := e.weight + alpha*(1-e.weight)
		if w > 0 {
			r = e.value * (1 - alpha) / w
		}
	}
	return r
}

// Last is the time of the latest observation (zero before Start).
func (e *EWMA) Last() time.Time { return e.last }

// Tokens is the number of tokens observed.
func (e *EWMA) Tokens() int { return e.tokens }

// Warming reports that too little has been observed for the rate to mean much: fewer
// than MinWarmTokens tokens. (The bias correction makes a few samples enough.)
func (e *EWMA) Warming() bool { return e.tokens < MinWarmTokens }

// MinWarmTokens is how many decoded tokens a session needs before it counts as warm.
const MinWarmTokens = 4

// Mean is the arithmetic mean of rates (0 for none).
func Mean(rates []float64) float64 {
	if len(rates) == 0 {
		return 0
	}
	s := 0.0
	for _, r := range rates {
		s += r
	}
	return s / float64(len(rates))
}
