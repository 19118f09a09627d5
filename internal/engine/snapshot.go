package engine

import (
	"cmp"
	"fmt"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
)

// SlotInfo is a copy of one sequence's state for /slots.
type SlotInfo struct {
	Seq       int
	SessionID string
	State     string // idle | prefill | decode | cached
	NPast     int
	Decoded   int
	Task      uint64
	PoolID    *int
	Shared    int // leading tokens borrowed from the pool
	// Own is the cells attributed to this sequence by ownership (Σ over sequences and
	// pools == cells in use); the rest of NPast it shares with a pool or with the
	// sequence it copied a cached prefix from.
	Own int
	// OwnKVBytes is Own's KV bytes; RecurrentStateBytes the sequence's own copy of the
	// recurrent state (hybrid and recurrent models), which is never shared.
	OwnKVBytes, RecurrentStateBytes int64
	TPSEWMA                         float64
	CtxUsed                         int
	CtxTotal                        int
	Headroom                        int
	Pressure                        float64 // the session's own context pressure
	// DraftN, DraftAccepted: the running task's speculative proposals and accepted
	// draft tokens so far.
	DraftN, DraftAccepted int
	// Restored: the running task's prompt tokens loaded from the tier (issue 40);
	// Loading: its load is still awaited.
	Restored int
	Loading  bool
}

func slotState(sl *slot) string {
	switch {
	case sl.task == nil && sl.session == "" && len(sl.tokens) > 0:
		return "cached" // a finished anonymous request's sequence, kept as prefix cache
	case sl.task == nil:
		return "idle"
	case sl.task.loading(false), sl.task.status == statusLookup:
		return "load" // loading its prompt's KV from the tier (issue 40)
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
		info := SlotInfo{Seq: sl.seq, SessionID: sl.session, State: slotState(sl), NPast: len(sl.tokens), Shared: sl.shared, Own: s.kv.Owned(sl.seq),
			OwnKVBytes: int64(s.kv.Owned(sl.seq)) * s.cfg.BytesPerCell, RecurrentStateBytes: s.slotRecurrentBytes(sl),
			TPSEWMA: st.TPSEWMA, CtxUsed: st.CtxUsed, CtxTotal: st.CtxTotal, Headroom: st.CtxHeadroomTokens, Pressure: st.CtxPressure}
		if sl.base != nil {
			id := sl.base.ID
			info.PoolID = &id
		}
		if t := sl.task; t != nil {
			info.Task = uint64(t.id)
			info.Decoded = t.generated
			info.DraftN, info.DraftAccepted = t.spec.drafted, t.spec.accepted
			info.Restored, info.Loading = t.restoredN, t.loading(false)
		}
		out = append(out, info)
	}
	return out
}

// WaitInfo is one request that holds no sequence yet (issue 30: every wait is visible):
// /slots lists it as a "waiting" entry, and /metrics counts waits by Reason.
type WaitInfo struct {
	Task      uint64
	SessionID string
	PoolID    *int // the pool it will attach to (nil: none)
	PromptN   int
	// Reason is why it still waited after the last admission pass (a Wait* constant;
	// WaitAdmission: held by an enforced pool's gate).
	Reason string
	Waited time.Duration // since it was submitted
	// Where its prompt's KV lives now (kvcache.Manager.Residency, up to its last token,
	// which is always decoded): the longest prefix in cells, then, continuing it, the
	// tokens the index of what lives below the cells finds in this replica's tier and
	// on the fleet's level. What is in neither is what it will prefill, as things stand.
	InCells, InTier, InFleet int
}

// residencyEvery is how often a waiting request's residency (WaitInfo.InCells, ...) is
// measured again: it walks the request's whole prompt, and snapshots come every 50 ms
// while the engine decodes, so measuring every waiting request's in each one would cost
// the decode loop in proportion to the queue; a figure up to a second old is as good
// to a reader of /slots.
const residencyEvery = time.Second

// Waiting lists the requests waiting at now for a sequence, cells or their pool, in
// queue order, then those an enforced pool's admission gate holds. Pool
// materializations are not requests (GET /polykv/pools shows them as materializing).
func (s *Scheduler) Waiting(now time.Time) []WaitInfo {
	s.now = now
	out := []WaitInfo{}
	add := func(t *task, reason string) {
		w := WaitInfo{Task: uint64(t.id), SessionID: t.req.SessionID, PromptN: len(t.req.Prompt), Reason: reason, Waited: s.now.Sub(t.submitted)}
		if t.kvAt.IsZero() || s.now.Sub(t.kvAt) >= residencyEvery {
			t.kv, t.kvAt = s.kv.Residency(t.req.Prompt, len(t.req.Prompt)-1), s.now
		}
		w.InCells, w.InTier, w.InFleet = t.kv.Cells, t.kv.Local, t.kv.Fleet
		if t.pool != nil {
			id := t.pool.ID
			w.PoolID = &id
		}
		out = append(out, w)
	}
	for _, t := range s.queue {
		if t.kind == kindGenerate {
			add(t, cmp.Or(t.wait, WaitQueue))
		}
	}
	for _, key := range s.adm.HeldKeys() {
		if t, ok := s.tasks[TaskID(key)]; ok {
			add(t, WaitAdmission)
		}
	}
	return out
}

// Usage is a copy of the engine's load.
type Usage struct {
	CellsUsed int
	CellsMax  int
	// CellsEvictable are the cells in use that eviction would free for a new request:
	// those only idle sequences (sessions, cached anonymous ones) and evictable pools
	// (unpinned, or pinned with a tier; not one in its grace: just made and not used
	// yet) hold. CellsUsed - CellsEvictable is what no
	// new request can get: the KV usage a router should read (issue 30).
	CellsEvictable int
	Running        int
	Waiting        int
	Sessions       int
	Pools          int
	// Prefix cache (issue 12): prompt tokens served from cached prefixes so far, the
	// cells only finished anonymous sequences kept as cache hold (what dropping the
	// cache would free), those sequences, and how often one lost cells under pressure.
	CacheHitTokens int64
	CacheCells     int
	CacheSeqs      int
	CacheEvictions int64
	// Evictions under cell or sequence-id pressure by kind of victim (one least
	// recently used order over all kinds): idle sessions that lost cells, and pools
	// whose own cells were dropped. Anonymous ones are CacheEvictions.
	SessionEvictions int64
	PoolEvictions    int64
	// QueueTimeouts counts waits that ran past Config.QueueTimeout (requests refused
	// with ErrQueueTimeout, pool creations and restores abandoned).
	QueueTimeouts int64
	// Tier is the sequence tier's work (issue 40: segments saved, loads, misses).
	Tier TierStats
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
	u := Usage{CellsUsed: s.kv.Used(), CellsMax: s.cfg.NCtx, Running: running, Waiting: waiting, Sessions: len(s.bySession), Pools: s.pools.Len(),
		CacheHitTokens: s.cacheHits, CacheEvictions: s.cacheEvictions,
		SessionEvictions: s.sessionEvictions, PoolEvictions: s.poolEvictions, QueueTimeouts: s.queueTimeouts, Tier: s.TierStats()}
	for _, sl := range s.slots {
		if s.cachedSlot(sl.seq) != nil {
			u.CacheSeqs++
		}
	}
	u.CacheCells = s.cacheOnlyCells()
	u.CellsEvictable = s.kv.Evictable(s.now, -1)
	return u
}

// cacheOnlyCells counts the cells that only finished anonymous sequences kept as cache
// hold: what dropping the prefix cache would free.
func (s *Scheduler) cacheOnlyCells() int {
	var cached kvcache.SeqSet
	for _, sl := range s.slots {
		if s.cachedSlot(sl.seq) != nil {
			cached.Add(sl.seq)
		}
	}
	return s.kv.FreedBy(cached, -1, 0)
}

// Snapshot is an immutable copy of everything the HTTP layer reads: the engine
// goroutine publishes one after every message and, while decoding, at most every
// snapshotEvery, so handlers never wait for (or touch) the engine goroutine to read.
// Nothing in it may be modified.
type Snapshot struct {
	At         time.Time
	Slots      []SlotInfo
	Usage      Usage
	Floors     map[string]float64
	Pools      PoolsStatus
	TPS        TPSSnapshot
	Metrics    []PoolMetric
	Waiting    []WaitInfo
	Violations int
	// tokens holds each pool's prefix: pool prefixes are immutable, so the snapshot
	// shares them instead of copying.
	tokens    map[int][]Token
	admission map[int]admission.Policy
}

// Snapshot copies out the observable state at now.
func (s *Scheduler) Snapshot(now time.Time) *Snapshot {
	s.now = now
	metrics, usage := s.Metrics(now)
	sn := &Snapshot{At: now, Slots: s.Slots(), Usage: usage, Floors: s.Floors(), Pools: s.Pools(), TPS: s.TPS(now),
		Metrics: metrics, Waiting: s.Waiting(now), Violations: s.violations, tokens: map[int][]Token{}, admission: map[int]admission.Policy{}}
	for _, p := range s.pools.All() {
		sn.tokens[p.ID] = p.Tokens
		sn.admission[p.ID] = s.adm.Policy(p.ID)
	}
	return sn
}

// Pool returns one pool's status with its tokens (GET /polykv/pools/{id}).
func (sn *Snapshot) Pool(id int) (PoolInfo, error) {
	for _, p := range sn.Pools.Pools {
		if p.PoolID == id {
			p.Tokens = sn.tokens[id]
			return p, nil
		}
	}
	return PoolInfo{}, fmt.Errorf("%w: pool %d does not exist (never created, or released and reclaimed)", pool.ErrNotFound, id)
}

// Admission returns a live pool's admission policy.
func (sn *Snapshot) Admission(id int) (admission.Policy, error) {
	info, err := sn.Pool(id)
	if err != nil {
		return admission.Policy{}, err
	}
	if info.State == pool.Released.String() {
		return admission.Policy{}, fmt.Errorf("%w: pool %d was released", pool.ErrNotFound, id)
	}
	return sn.admission[id], nil
}
