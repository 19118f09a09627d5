// Package admission decides whether a pool can take one more session (docs/design.md §4.4, §6,
// §13.3, §14). Decide is a pure function of a pool's snapshot; the Controller
// (controller.go) holds all admission state between decisions (policies, settle
// windows, the measured-drop forecast, held requests, reservations) and reads no clock.
// The scheduler feeds it facts on the engine goroutine and acts on its decisions, and
// the same verdict serves the advisory /capacity route, reservations and the enforced
// gate.
package admission

import (
	"fmt"
	"math"
	"time"
)

// Modes and saturation behaviours.
const (
	ModeAdvisory = "advisory"
	ModeEnforced = "enforced"

	OnReject = "reject"
	OnWarn   = "warn"
	OnQueue  = "queue"
)

// Reasons reported by Decide.
const (
	ReasonOK             = "ok"
	ReasonNoFloor        = "no tps floor set"
	ReasonContinuation   = "continuation of a known session"
	ReasonGuaranteed     = "guaranteed minimum"
	ReasonSettling       = "measurement settling"
	ReasonContext        = "context headroom exhausted"
	ReasonKV             = "kv headroom exhausted"
	ReasonFloor          = "projected mean tps below floor"
	ReasonFloorIdle      = "projected mean tps below floor (idle estimate)"
	ReasonNoMeasurements = "no measurements yet"
)

// Throttle settings (issue 41, the design's §4.4 banked step, Andes' idea).
const (
	ThrottleOff         = "off"
	ThrottleTowardFloor = "toward_floor"
	// MaxThrottleSkip bounds throttle_max_skip: a throttled session decodes at least
	// one step in ten, whatever the policy says.
	MaxThrottleSkip = 0.9
)

// Policy is a pool's admission policy, as set by POST /polykv/pools/{id}/admission.
type Policy struct {
	TargetTPS            float64
	Mode                 string
	OnSaturation         string
	GuaranteeMinSessions int
	SettleTokens         int
	SettleMaxMs          int64
	QueueTimeoutMs       int64
	// Throttle toward the floor (ThrottleTowardFloor; needs TargetTPS): a session of the
	// pool decoding above TargetTPS·(1+ThrottleMargin) skips decode steps while another
	// session near or under its floor, or a prompt the step's token budget cuts, gains
	// from it; at most ThrottleMaxSkip of its steps (the skips never starve it). Without
	// a floor the throttle does nothing.
	Throttle        string
	ThrottleMargin  float64
	ThrottleMaxSkip float64
}

// DefaultPolicy is the policy of a pool nobody configured: advisory, no floor.
func DefaultPolicy() Policy {
	return Policy{Mode: ModeAdvisory, OnSaturation: OnReject, GuaranteeMinSessions: 1, SettleTokens: 48, SettleMaxMs: 5000, QueueTimeoutMs: 30000,
		Throttle: ThrottleOff, ThrottleMargin: 0.2, ThrottleMaxSkip: 0.5}
}

// Throttles reports whether the pool's sessions may be throttled toward its floor.
func (p Policy) Throttles() bool {
	return p.Throttle == ThrottleTowardFloor && p.TargetTPS > 0 && p.ThrottleMaxSkip > 0
}

// Validate checks a policy.
func (p Policy) Validate() error {
	switch {
	case p.TargetTPS < 0 || math.IsNaN(p.TargetTPS) || math.IsInf(p.TargetTPS, 0):
		return fmt.Errorf("target_tps_per_session must be a non-negative number, got %v", p.TargetTPS)
	case p.Mode != ModeAdvisory && p.Mode != ModeEnforced:
		return fmt.Errorf("mode must be %q or %q, got %q", ModeAdvisory, ModeEnforced, p.Mode)
	case p.OnSaturation != OnReject && p.OnSaturation != OnWarn && p.OnSaturation != OnQueue:
		return fmt.Errorf("on_saturation must be reject, warn or queue, got %q", p.OnSaturation)
	case p.GuaranteeMinSessions < 0:
		return fmt.Errorf("guarantee_min_sessions must not be negative, got %d", p.GuaranteeMinSessions)
	case p.SettleTokens < 0 || p.SettleTokens > 100000:
		return fmt.Errorf("settle_tokens must be in [0, 100000], got %d", p.SettleTokens)
	case p.SettleMaxMs < 0 || p.SettleMaxMs > 600000:
		return fmt.Errorf("settle_max_ms must be in [0, 600000], got %d", p.SettleMaxMs)
	case p.QueueTimeoutMs < 0 || p.QueueTimeoutMs > 3600000:
		return fmt.Errorf("queue_timeout_ms must be in [0, 3600000], got %d", p.QueueTimeoutMs)
	case p.Throttle != ThrottleOff && p.Throttle != ThrottleTowardFloor:
		return fmt.Errorf("throttle must be %q or %q, got %q", ThrottleOff, ThrottleTowardFloor, p.Throttle)
	case !(p.ThrottleMargin >= 0 && p.ThrottleMargin <= 10):
		return fmt.Errorf("throttle_margin must be in [0, 10], got %v", p.ThrottleMargin)
	case !(p.ThrottleMaxSkip >= 0 && p.ThrottleMaxSkip <= MaxThrottleSkip):
		return fmt.Errorf("throttle_max_skip must be in [0, %g], got %v", MaxThrottleSkip, p.ThrottleMaxSkip)
	}
	return nil
}

// Enforced reports whether the gate applies to new sessions.
func (p Policy) Enforced() bool { return p.Mode == ModeEnforced }

// Input is a pool's snapshot, gathered by the engine.
type Input struct {
	Policy        Policy
	Now           time.Time
	PoolSessions  int       // sequences attached to the pool (decoding or idle)
	ActiveTPS     []float64 // experienced tps of the pool's warm decoding sessions
	NWarming      int       // decoding sessions whose EWMA is still cold
	Settling      bool
	SettleLeft    time.Duration
	DropEWMA      float64
	HasDrop       bool
	SettledMean   float64 // mean at the last completed settle
	SettledAt     time.Time
	FreeCells     int
	TotalCells    int
	MarginalCells float64 // mean own cells of the pool's sessions (0: unknown)
	Expected      int     // expected_tokens of the caller (0: not given)
	KnownSession  *bool   // set when the caller named a session
	Pressure      float64 // compaction pressure, 0..1
	Reserved      int     // granted, unused reservations (already in PoolSessions and NWarming)
}

// IdleFreshness is how long a settled mean stays good for the idle-gap estimate.
const IdleFreshness = 30 * time.Second

// Verdict is /capacity's answer.
type Verdict struct {
	CanAdmit              bool
	Reason                string
	MeanActiveTPS         *float64
	ProjectedIfAdmitted   *float64
	ProjectedModel        *float64
	ProjectedMeasured     *float64
	DropPerAdmitEWMA      *float64
	HeadroomSessions      int
	KVHeadroomPct         float64
	FreeCells             int
	Settling              bool
	SettleRemainingMs     int64
	NWarming              int
	NActive               int
	NPoolSessions         int
	NReserved             int
	Guaranteed            bool
	ProjectedIdleEstimate bool
	CompactionPressure    float64
	KnownSession          *bool
	TargetTPS             float64
	Mode                  string
	RetryAfterS           int
}

func ptr(v float64) *float64 { return &v }

// DefaultMarginalCells is the per-session cost assumed before any session has run.
const DefaultMarginalCells = 256

// Decide computes the verdict. Arms, in order: the context arm (hard: cells are
// physical), continuation, the guaranteed minimum, settling, KV headroom, the tps floor.
func Decide(in Input) Verdict {
	v := Verdict{
		FreeCells: in.FreeCells, NWarming: in.NWarming, NActive: len(in.ActiveTPS), NPoolSessions: in.PoolSessions, NReserved: in.Reserved,
		Settling: in.Settling, KnownSession: in.KnownSession, TargetTPS: in.Policy.TargetTPS, Mode: in.Policy.Mode,
		CompactionPressure: clamp01(in.Pressure),
	}
	if in.Settling {
		v.SettleRemainingMs = max(0, in.SettleLeft.Milliseconds())
	}
	if in.TotalCells > 0 {
		v.KVHeadroomPct = 100 * float64(in.FreeCells) / float64(in.TotalCells)
	}
	marginal := in.MarginalCells
	if marginal <= 0 {
		marginal = DefaultMarginalCells
	}
	if in.Expected > 0 {
		marginal = max(marginal, float64(in.Expected))
	}
	v.HeadroomSessions = int(float64(in.FreeCells) / marginal)
	if in.HasDrop {
		v.DropPerAdmitEWMA = ptr(in.DropEWMA)
	}
	// Projection from the live mean, or from a fresh settled mean when every session is
	// between turns (the idle gap would otherwise read as free capacity).
	n := len(in.ActiveTPS)
	switch {
	case n > 0:
		mean := mean(in.ActiveTPS)
		v.MeanActiveTPS = ptr(mean)
		v.ProjectedModel = ptr(mean * float64(n) / float64(n+1))
		if in.HasDrop {
			v.ProjectedMeasured = ptr(max(0, mean-in.DropEWMA))
		}
	case in.PoolSessions > 0 && in.SettledMean > 0 && in.Now.Sub(in.SettledAt) < IdleFreshness:
		v.ProjectedIdleEstimate = true
		np := float64(in.PoolSessions)
		v.ProjectedModel = ptr(in.SettledMean * np / (np + 1))
		if in.HasDrop {
			v.ProjectedMeasured = ptr(max(0, in.SettledMean-in.DropEWMA))
		}
	}
	v.ProjectedIfAdmitted = v.ProjectedModel
	if v.ProjectedMeasured != nil {
		v.ProjectedIfAdmitted = v.ProjectedMeasured
	}
	v.CanAdmit, v.Reason = decide(in, v)
	v.Guaranteed = v.Reason == ReasonGuaranteed
	if !v.CanAdmit {
		v.RetryAfterS = retryAfter(in, v)
	}
	return v
}

func decide(in Input, v Verdict) (bool, string) {
	if in.Expected > 0 && in.Expected > in.FreeCells {
		return false, ReasonContext
	}
	if in.KnownSession != nil && *in.KnownSession {
		return true, ReasonContinuation
	}
	if in.PoolSessions < in.Policy.GuaranteeMinSessions {
		return true, ReasonGuaranteed
	}
	if in.Settling {
		return false, ReasonSettling
	}
	if v.HeadroomSessions < 1 {
		return false, ReasonKV
	}
	if in.Policy.TargetTPS <= 0 {
		return true, ReasonNoFloor
	}
	if v.ProjectedIfAdmitted == nil {
		return true, ReasonNoMeasurements
	}
	if *v.ProjectedIfAdmitted < in.Policy.TargetTPS {
		if v.ProjectedIdleEstimate {
			return false, ReasonFloorIdle
		}
		return false, ReasonFloor
	}
	return true, ReasonOK
}

// retryAfter estimates when asking again could succeed, in whole seconds (≥ 1).
func retryAfter(in Input, v Verdict) int {
	switch v.Reason {
	case ReasonSettling:
		return max(1, int(math.Ceil(float64(v.SettleRemainingMs)/1000)))
	case ReasonFloor, ReasonFloorIdle, ReasonKV:
		// A session must end or the measurement move: one settle window is the natural beat.
		return max(1, int(math.Ceil(float64(in.Policy.SettleMaxMs)/1000)))
	}
	return 1
}

// SettleDone reports whether a settle window that began at start, with decoded tokens
// of the admitted session since, is over.
func SettleDone(p Policy, start, now time.Time, decoded int, ended bool) bool {
	return ended || decoded >= p.SettleTokens || now.Sub(start) >= time.Duration(p.SettleMaxMs)*time.Millisecond
}

// FoldDrop folds one measured post-admit drop into the per-pool EWMA (alpha 0.3).
func FoldDrop(ewma float64, has bool, meanAtAdmit, meanSettled float64) float64 {
	drop := max(0, meanAtAdmit-meanSettled)
	if !has {
		return drop
	}
	return 0.7*ewma + 0.3*drop
}

func mean(xs []float64) float64 {
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

func clamp01(x float64) float64 { return min(1, max(0, x)) }

// Patch changes the fields of a policy it sets (non-nil) and keeps the others, so a
// client can change one setting without a read-modify-write race against another.
type Patch struct {
	TargetTPS            *float64
	Mode                 *string
	OnSaturation         *string
	GuaranteeMinSessions *int
	SettleTokens         *int
	SettleMaxMs          *int64
	QueueTimeoutMs       *int64
	Throttle             *string
	ThrottleMargin       *float64
	ThrottleMaxSkip      *float64
}

// Apply returns p with the patch's fields set.
func (pt Patch) Apply(p Policy) Policy {
	set(&p.TargetTPS, pt.TargetTPS)
	set(&p.Mode, pt.Mode)
	set(&p.OnSaturation, pt.OnSaturation)
	set(&p.GuaranteeMinSessions, pt.GuaranteeMinSessions)
	set(&p.SettleTokens, pt.SettleTokens)
	set(&p.SettleMaxMs, pt.SettleMaxMs)
	set(&p.QueueTimeoutMs, pt.QueueTimeoutMs)
	set(&p.Throttle, pt.Throttle)
	set(&p.ThrottleMargin, pt.ThrottleMargin)
	set(&p.ThrottleMaxSkip, pt.ThrottleMaxSkip)
	return p
}

// Replace is the patch that sets every field to p's.
func Replace(p Policy) Patch {
	return Patch{&p.TargetTPS, &p.Mode, &p.OnSaturation, &p.GuaranteeMinSessions, &p.SettleTokens, &p.SettleMaxMs, &p.QueueTimeoutMs,
		&p.Throttle, &p.ThrottleMargin, &p.ThrottleMaxSkip}
}

func set[T any](dst *T, v *T) {
	if v != nil {
		*dst = *v
	}
}
