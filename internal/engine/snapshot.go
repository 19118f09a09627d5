package engine

// SlotInfo is a copy of one sequence's state for /slots.
type SlotInfo struct {
	Seq       int     `json:"id"`
	SessionID string  `json:"session_id"`
	State     string  `json:"state"` // idle | prefill | decode
	NPast     int     `json:"n_past"`
	Decoded   int     `json:"n_decoded"`
	Task      uint64  `json:"task_id,omitempty"`
	PoolID    *int    `json:"pool_id"`
	Shared    int     `json:"n_shared"` // leading tokens borrowed from the pool
	TPSEWMA   float64 `json:"tps_ewma"`
	CtxUsed   int     `json:"ctx_used"`
	CtxTotal  int     `json:"ctx_total"`
	Headroom  int     `json:"ctx_headroom_tokens"`
	Pressure  float64 `json:"ctx_pressure"` // the session's own context pressure
}

func slotState(sl *slot) string {
	switch {
	case sl.task == nil:
		return "idle"
	case sl.task.prefilling():
		return "prefill"
	}
	return "decode"
}

// Slots copies out every session sequence in use (holding cells or running a task).
func (s *Scheduler) Slots() []SlotInfo {
	out := []SlotInfo{}
	free := s.freeForNew()
	for _, sl := range s.slots {
		if sl.task == nil && len(sl.tokens) == 0 {
			continue
		}
		st := s.sessionTPS(sl, free)
		info := SlotInfo{Seq: sl.seq, SessionID: sl.session, State: slotState(sl), NPast: len(sl.tokens), Shared: sl.shared,
			TPSEWMA: st.TPSEWMA, CtxUsed: st.CtxUsed, CtxTotal: st.CtxTotal, Headroom: st.CtxHeadroomTokens, Pressure: st.CtxPressure}
		if sl.base != nil {
			id := sl.base.ID
			info.PoolID = &id
		}
		if t := sl.task; t != nil {
			info.Task = uint64(t.id)
			info.Decoded = t.generated
		}
		out = append(out, info)
	}
	return out
}

// Usage is a copy of the engine's load.
type Usage struct {
	CellsUsed int `json:"kv_cells_used"`
	CellsMax  int `json:"kv_cells_max"`
	Running   int `json:"requests_running"`
	Waiting   int `json:"requests_waiting"`
	Sessions  int `json:"sessions"`
	Pools     int `json:"pools"`
}

// Usage reports the current load.
func (s *Scheduler) Usage() Usage {
	running := 0
	for _, t := range s.running {
		if t.kind == kindGenerate {
			running++
		}
	}
	waiting := 0
	for _, t := range s.queue {
		if t.kind == kindGenerate {
			waiting++
		}
	}
	return Usage{CellsUsed: s.usedCells(), CellsMax: s.cfg.NCtx, Running: running, Waiting: waiting, Sessions: len(s.bySession), Pools: s.pools.Len()}
}
