package api

import (
	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

// Conversions from the engine's and admission's status values (which carry no JSON
// tags) to the wire. Slices keep their nil-ness: a nil slice is null on the wire and
// an empty one [], as they were when the engine types were marshalled directly.

func mapSlice[T, U any](in []T, f func(T) U) []U {
	if in == nil {
		return nil
	}
	out := make([]U, len(in))
	for i, v := range in {
		out[i] = f(v)
	}
	return out
}

func wirePolicy(p admission.Policy) wire.Policy {
	return wire.Policy{TargetTPS: p.TargetTPS, Mode: p.Mode, OnSaturation: p.OnSaturation,
		GuaranteeMinSessions: p.GuaranteeMinSessions, SettleTokens: p.SettleTokens, SettleMaxMs: p.SettleMaxMs,
		QueueTimeoutMs: p.QueueTimeoutMs, Throttle: p.Throttle, ThrottleMargin: p.ThrottleMargin, ThrottleMaxSkip: p.ThrottleMaxSkip}
}

func wireVerdict(v admission.Verdict) wire.Verdict {
	return wire.Verdict{CanAdmit: v.CanAdmit, Reason: v.Reason, MeanActiveTPS: v.MeanActiveTPS,
		ProjectedIfAdmitted: v.ProjectedIfAdmitted, ProjectedModel: v.ProjectedModel, ProjectedMeasured: v.ProjectedMeasured,
		DropPerAdmitEWMA: v.DropPerAdmitEWMA, HeadroomSessions: v.HeadroomSessions, KVHeadroomPct: v.KVHeadroomPct,
		KVCellsFree: v.FreeCells, Settling: v.Settling, SettleRemainingMs: v.SettleRemainingMs, NWarming: v.NWarming,
		NActive: v.NActive, NPoolSessions: v.NPoolSessions, NReserved: v.NReserved, Guaranteed: v.Guaranteed,
		ProjectedIdleEstimate: v.ProjectedIdleEstimate, CompactionPressure: v.CompactionPressure,
		KnownSession: v.KnownSession, TargetTPS: v.TargetTPS, Mode: v.Mode, RetryAfterS: v.RetryAfterS}
}

func wireSessionCtx(c engine.SessionCtx) wire.SessionCtx {
	return wire.SessionCtx{SessionID: c.SessionID, PoolID: c.PoolID, CtxUsed: c.CtxUsed,
		CtxHeadroomTokens: c.CtxHeadroomTokens, CtxPressure: c.CtxPressure}
}

func wireUsage(u engine.Usage) wire.EngineUsage {
	return wire.EngineUsage{KVCellsUsed: u.CellsUsed, KVCellsMax: u.CellsMax, KVCellsEvictable: u.CellsEvictable, RequestsRunning: u.Running,
		RequestsWaiting: u.Waiting, Sessions: u.Sessions, Pools: u.Pools,
		PrefixCacheHitTokens: u.CacheHitTokens, PrefixCacheCells: u.CacheCells, PrefixCacheSequences: u.CacheSeqs,
		PrefixCacheEvictions: u.CacheEvictions}
}

func wireSlot(s engine.SlotInfo) wire.Slot {
	w := wire.Slot{ID: s.Seq, SessionID: s.SessionID, State: s.State, NPast: s.NPast, NDecoded: s.Decoded,
		TaskID: s.Task, PoolID: s.PoolID, NShared: s.Shared, NOwnCells: s.Own, OwnKVBytes: s.OwnKVBytes,
		RecurrentStateBytes: s.RecurrentStateBytes, TPSEWMA: s.TPSEWMA, CtxUsed: s.CtxUsed,
		CtxTotal: s.CtxTotal, CtxHeadroomTokens: s.Headroom, CtxPressure: s.Pressure}
	w.DraftN, w.DraftNAccepted = drafts(s.DraftN, s.DraftAccepted)
	w.NRestored = s.Restored
	return w
}

// drafts are llama-server's draft_n and draft_n_accepted: present once a request
// drafted anything (speculative decoding), absent otherwise, as llama-server shows them.
func drafts(n, accepted int) (*int, *int) {
	if n == 0 {
		return nil, nil
	}
	return &n, &accepted
}

// wireWaiting is a waiting request as a /slots entry.
func wireWaiting(w engine.WaitInfo) wire.Slot {
	ms := w.Waited.Milliseconds()
	return wire.Slot{ID: -1, SessionID: w.SessionID, State: "waiting", TaskID: w.Task, PoolID: w.PoolID,
		NPromptTokens: w.PromptN, WaitingReason: w.Reason, WaitingMs: &ms,
		KV: &wire.KVResidency{Cells: w.InCells, Tier: w.InTier, Fleet: w.InFleet}}
}

func wirePoolSession(s engine.PoolSession) wire.PoolSession {
	return wire.PoolSession{SessionID: s.SessionID, SeqID: s.Seq, SuffixNTokens: s.SuffixNTokens,
		MarginalKVBytes: s.MarginalKVBytes, RecurrentStateBytes: s.RecurrentStateBytes, State: s.State, TaskID: s.Task}
}

func wirePool(p engine.PoolInfo) wire.PoolInfo {
	return wire.PoolInfo{PoolID: p.PoolID, Parent: p.Parent, BranchPos: p.BranchPos, PrefixLen: p.PrefixLen,
		OwnLen: p.OwnLen, OwnKVBytes: p.OwnKVBytes, SubtreeKVBytes: p.SubtreeKVBytes,
		RecurrentStateBytes: p.RecurrentStateBytes, Residency: p.Residency,
		State: p.State, Pinned: p.Pinned, UserPinned: p.UserPinned, OrphanedPin: p.OrphanedPin,
		LastAccessTS: p.LastAccessTS, Children: p.Children, Sessions: mapSlice(p.Sessions, wirePoolSession),
		TreeDepth: p.Depth, PrefixHash: p.PrefixHash, Tokens: p.Tokens}
}

func wirePools(st engine.PoolsStatus) wire.PoolsStatus {
	return wire.PoolsStatus{Pools: mapSlice(st.Pools, wirePool), TreeDepth: st.TreeDepth, SeqIDsUsed: st.SeqIDsUsed,
		SeqIDsMax: st.SeqIDsMax, PoolsMax: st.PoolsMax, KVCellsUsed: st.KVCellsUsed, KVCellsMax: st.KVCellsMax,
		KVBytesPerCell: st.BytesPerCell, RecurrentStateBytesPerSeq: st.RecurrentBytesPerSeq, LostPools: []wire.LostPool{}}
}

func wireCapacity(c engine.CapacityReport) wire.Capacity {
	out := wire.Capacity{PoolID: c.PoolID, Verdict: wireVerdict(c.Verdict), SessionPressure: c.SessionPressure}
	if c.Session != nil {
		sc := wireSessionCtx(*c.Session)
		out.Session = &sc
	}
	return out
}

func wireReservation(r engine.ReservationReport) wire.Reservation {
	return wire.Reservation{PoolID: r.PoolID, ReservationID: r.ReservationID, Granted: r.Granted,
		ExpiresInMs: r.ExpiresInMs, Verdict: wireVerdict(r.Verdict)}
}

func wireSessionTPS(s engine.SessionTPS) wire.SessionTPS {
	w := wire.SessionTPS{SessionID: s.SessionID, SeqID: s.Seq, PoolID: s.PoolID, State: s.State, TPSEWMA: s.TPSEWMA,
		Warming: s.Warming, NDecoded: s.Decoded, CtxUsed: s.CtxUsed, CtxTotal: s.CtxTotal,
		CtxHeadroomTokens: s.CtxHeadroomTokens, CtxPressure: s.CtxPressure, ThrottledSteps: s.ThrottledSteps}
	w.DraftN, w.DraftNAccepted = drafts(s.DraftN, s.DraftAccepted)
	return w
}

func wireTPS(t engine.TPSSnapshot) wire.TPS {
	return wire.TPS{TS: t.TS, AggregateTPS: t.AggregateTPS, PromptTPS: t.PromptTPS, MeanActiveTPS: t.MeanActiveTPS,
		NActive: t.NActive, NWarming: t.NWarming, ThrottledStepsTotal: t.ThrottledSteps, PacedTurnsTotal: t.PacedTurns, Sessions: mapSlice(t.Sessions, wireSessionTPS)}
}

// wireUsageOf is OpenAI's usage of a finished generation of promptN prompt tokens.
func wireUsageOf(promptN int, st engine.Stats) wire.Usage {
	return wire.Usage{PromptTokens: promptN, CompletionTokens: st.PredictedN, TotalTokens: promptN + st.PredictedN,
		PromptTokensDetails: wire.PromptTokensDetails{CachedTokens: st.CacheN + st.RestoredN}}
}

// wireTimings are llama-server's timings of a finished generation, with tps_ewma.
func wireTimings(st engine.Stats) wire.Timings {
	pms := float64(st.PromptTime.Microseconds()) / 1000
	gms := float64(st.PredictTime.Microseconds()) / 1000
	t := wire.Timings{CacheN: st.CacheN, PromptN: st.PromptN, PromptMs: pms, PredictedN: st.PredictedN,
		PredictedMs: gms, TPSEWMA: st.TPS, RestoredN: st.RestoredN}
	if st.PromptN > 0 && pms > 0 {
		t.PromptPerTokenMs = pms / float64(st.PromptN)
		t.PromptPerSecond = 1000 * float64(st.PromptN) / pms
	}
	if st.PredictedN > 0 && gms > 0 {
		t.PredictedPerTokenMs = gms / float64(st.PredictedN)
		t.PredictedPerSecond = 1000 * float64(st.PredictedN) / gms
	}
	t.DraftN, t.DraftNAccepted = drafts(st.DraftN, st.DraftAccepted)
	t.DraftNFiltered = st.DraftFiltered
	t.ThrottledSteps = st.ThrottledSteps
	t.PacedMs = float64(st.Paced.Microseconds()) / 1000
	return t
}
