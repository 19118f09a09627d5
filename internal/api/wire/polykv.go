package wire

import "encoding/json"

// PoolRequest is the body of POST /polykv/pools (create) and
// POST /polykv/pools/{id}/fork: exactly one prefix source.
type PoolRequest struct {
	Tokens      *[]int32        `json:"tokens"`
	Prompt      *string         `json:"prompt"`
	Messages    json.RawMessage `json:"messages"`
	Tools       json.RawMessage `json:"tools"` // with messages: rendered as a chat with these tools renders its start
	FromSession *string         `json:"from_session"`
	BranchPos   *int            `json:"branch_pos"` // fork only
	Pin         bool            `json:"pin"`
}

// PoolCreated is the 201 of create and fork: the pool's status, with the headline
// members repeated at the top and what the materialization cost.
type PoolCreated struct {
	BranchPos       int      `json:"branch_pos"`
	MaterializeMs   float64  `json:"materialize_ms"`
	OwnLen          int      `json:"own_len"`
	Parent          *int     `json:"parent"`
	Pool            PoolInfo `json:"pool"`
	PoolID          int      `json:"pool_id"`
	PrefilledTokens int      `json:"prefilled_tokens"`
	PrefixHash      string   `json:"prefix_hash"`
	PrefixLen       int      `json:"prefix_len"`
	State           string   `json:"state"`
	ZeroCopy        bool     `json:"zero_copy"` // built from cells already resident (a session's, or a cached prefix), nothing prefilled
}

// PoolCommand is the answer of pin, unpin, evict and flush: the pool's status after
// it, and for flush what it freed.
type PoolCommand struct {
	FlushedSessions *int     `json:"flushed_sessions,omitempty"`
	FreedKVBytes    *int64   `json:"freed_kv_bytes,omitempty"`
	Pool            PoolInfo `json:"pool"`
}

// PoolReleased is DELETE /polykv/pools/{id}: reclaimed says whether its cells are
// gone already (else after the grace time, once nothing uses them).
type PoolReleased struct {
	PoolID    int  `json:"pool_id"`
	Reclaimed bool `json:"reclaimed"`
	Released  bool `json:"released"`
}

// PoolsStatus is GET /polykv/pools: the whole tree.
type PoolsStatus struct {
	Pools          []PoolInfo `json:"pools"`
	TreeDepth      int        `json:"tree_depth"`
	SeqIDsUsed     int        `json:"seq_ids_used"`
	SeqIDsMax      int        `json:"seq_ids_max"`
	PoolsMax       int        `json:"pools_max"`
	KVCellsUsed    int        `json:"kv_cells_used"`
	KVCellsMax     int        `json:"kv_cells_max"`
	KVBytesPerCell int64      `json:"kv_bytes_per_cell"`
	// RecurrentStateBytesPerSeq is one sequence's recurrent state (hybrid and recurrent
	// models; 0 otherwise): every pool and session holding tokens has its own copy.
	RecurrentStateBytesPerSeq int64 `json:"recurrent_state_bytes_per_seq"`
	// LostPools lists the pools recorded under --pool-dir that are not back after this
	// start (their record did not verify, or the server refused them): their ids answer
	// 404. Empty otherwise.
	LostPools []LostPool `json:"lost_pools"`
}

// LostPool is a recorded pool that did not come back after a restart.
type LostPool struct {
	PoolID int    `json:"pool_id"`
	Reason string `json:"reason"` // absent | truncated | corrupt | foreign | io | refused
	Error  string `json:"error"`
}

// PoolInfo is one pool's status (docs/design.md §4.2); GET /polykv/pools/{id} adds tokens.
type PoolInfo struct {
	PoolID         int   `json:"pool_id"`
	Parent         *int  `json:"parent"`
	BranchPos      int   `json:"branch_pos"`
	PrefixLen      int   `json:"prefix_len"`
	OwnLen         int   `json:"own_len"`
	OwnKVBytes     int64 `json:"own_kv_bytes"`
	SubtreeKVBytes int64 `json:"subtree_kv_bytes"`
	// RecurrentStateBytes is the recurrent state the pool holds at its boundary (0 when
	// evicted or without recurrent layers), beside its KV bytes.
	RecurrentStateBytes int64         `json:"recurrent_state_bytes"`
	Residency           string        `json:"residency"`
	State               string        `json:"state"`
	Pinned              bool          `json:"pinned"`
	UserPinned          bool          `json:"user_pinned"`
	OrphanedPin         bool          `json:"orphaned_pin"`
	LastAccessTS        float64       `json:"last_access_ts"`
	Children            []int         `json:"children"`
	Sessions            []PoolSession `json:"sessions"`
	TreeDepth           int           `json:"tree_depth"` // 1 for a root; the same name as the list's (the deepest)
	PrefixHash          string        `json:"prefix_hash"`
	Tokens              []int32       `json:"tokens,omitempty"`
	// RestoreCost is what attaching to an evicted pool will cost (with a pool tier).
	RestoreCost *RestoreCost `json:"restore_cost,omitempty"`
}

// RestoreCost says where an evicted pool's KV will come from: "ram" or "disk" (the
// pool tier: Bytes to load, EstMs at the restore rate measured so far, when there is
// one) or "prefill" (PrefillTokens to compute again).
type RestoreCost struct {
	From          string   `json:"from"`
	Bytes         int64    `json:"bytes,omitempty"`
	EstMs         *float64 `json:"est_ms,omitempty"`
	PrefillTokens int      `json:"prefill_tokens,omitempty"`
}

// PoolSession is a sequence attached to a pool.
type PoolSession struct {
	SessionID       string `json:"session_id"`
	SeqID           int    `json:"seq_id"`
	SuffixNTokens   int    `json:"suffix_n_tokens"`
	MarginalKVBytes int64  `json:"marginal_kv_bytes"`
	// RecurrentStateBytes is the session's own copy of the recurrent state.
	RecurrentStateBytes int64   `json:"recurrent_state_bytes"`
	State               string  `json:"state"`
	TaskID              *uint64 `json:"task_id,omitempty"`
}

// Policy is a pool's admission policy.
type Policy struct {
	TargetTPS            float64 `json:"target_tps_per_session"`
	Mode                 string  `json:"mode"`          // advisory | enforced
	OnSaturation         string  `json:"on_saturation"` // reject | warn | queue
	GuaranteeMinSessions int     `json:"guarantee_min_sessions"`
	SettleTokens         int     `json:"settle_tokens"`
	SettleMaxMs          int64   `json:"settle_max_ms"`
	QueueTimeoutMs       int64   `json:"queue_timeout_ms"`
	// Throttle toward the floor (issue 41): off | toward_floor, the margin above the
	// floor a session must decode at to be throttled, and the most of its steps it skips.
	Throttle        string  `json:"throttle"`
	ThrottleMargin  float64 `json:"throttle_margin"`
	ThrottleMaxSkip float64 `json:"throttle_max_skip"`
}

// PolicyPatch is POST /polykv/pools/{id}/admission: the members given are merged
// into the pool's current policy.
type PolicyPatch struct {
	TargetTPS            *float64 `json:"target_tps_per_session"`
	Mode                 *string  `json:"mode"`
	OnSaturation         *string  `json:"on_saturation"`
	GuaranteeMinSessions *int     `json:"guarantee_min_sessions"`
	SettleTokens         *int     `json:"settle_tokens"`
	SettleMaxMs          *int64   `json:"settle_max_ms"`
	QueueTimeoutMs       *int64   `json:"queue_timeout_ms"`
	Throttle             *string  `json:"throttle"`
	ThrottleMargin       *float64 `json:"throttle_margin"`
	ThrottleMaxSkip      *float64 `json:"throttle_max_skip"`
}

// PoolAdmission is GET and POST /polykv/pools/{id}/admission: the policy in force.
type PoolAdmission struct {
	Admission Policy `json:"admission"`
	PoolID    int    `json:"pool_id"`
}

// Verdict is an admission decision: whether a new session can join a pool now, why,
// and the measurements behind it.
type Verdict struct {
	CanAdmit              bool     `json:"can_admit"`
	Reason                string   `json:"reason"`
	MeanActiveTPS         *float64 `json:"mean_active_tps"`
	ProjectedIfAdmitted   *float64 `json:"projected_mean_tps_if_admitted"`
	ProjectedModel        *float64 `json:"projected_mean_tps_model"`
	ProjectedMeasured     *float64 `json:"projected_mean_tps_measured"`
	DropPerAdmitEWMA      *float64 `json:"drop_per_admit_ewma"`
	HeadroomSessions      int      `json:"headroom_sessions"`
	KVHeadroomPct         float64  `json:"kv_headroom_pct"`
	KVCellsFree           int      `json:"kv_cells_free"`
	Settling              bool     `json:"settling"`
	SettleRemainingMs     int64    `json:"settle_remaining_ms"`
	NWarming              int      `json:"n_warming"`
	NActive               int      `json:"n_active"`
	NPoolSessions         int      `json:"n_pool_sessions"`
	NReserved             int      `json:"n_reserved"`
	Guaranteed            bool     `json:"guaranteed"`
	ProjectedIdleEstimate bool     `json:"projected_idle_estimate"`
	CompactionPressure    float64  `json:"compaction_pressure"`
	KnownSession          *bool    `json:"known_session,omitempty"`
	TargetTPS             float64  `json:"target_tps_per_session"`
	Mode                  string   `json:"mode"`
	RetryAfterS           int      `json:"retry_after_s"`
}

// Capacity is GET /polykv/pools/{id}/capacity: the pool's verdict now; with a
// session_id that holds a sequence also that session's own context pressure.
type Capacity struct {
	PoolID int `json:"pool_id"`
	Verdict
	SessionPressure *float64    `json:"session_pressure,omitempty"`
	Session         *SessionCtx `json:"session,omitempty"`
}

// ReservationRequest is POST /polykv/pools/{id}/reservations (the body is optional).
type ReservationRequest struct {
	TTLMs          *int64 `json:"ttl_ms"`
	ExpectedTokens *int   `json:"expected_tokens"`
}

// Reservation is the answer of POST /polykv/pools/{id}/reservations.
type Reservation struct {
	PoolID        int     `json:"pool_id"`
	ReservationID *string `json:"reservation_id"` // null when not granted
	Granted       bool    `json:"granted"`
	ExpiresInMs   int64   `json:"expires_in_ms,omitempty"`
	Verdict       Verdict `json:"verdict"` // the verdict it was decided by (before counting it)
}

// ReservationReleased is DELETE /polykv/pools/{id}/reservations/{rid}.
type ReservationReleased struct {
	PoolID        int    `json:"pool_id"`
	Released      bool   `json:"released"`
	ReservationID string `json:"reservation_id"`
}

// TPS is one event of GET /polykv/tps (or its answer with once=1).
type TPS struct {
	TS            float64 `json:"ts"`
	AggregateTPS  float64 `json:"aggregate_tps"`
	PromptTPS     float64 `json:"prompt_tps"`
	MeanActiveTPS float64 `json:"mean_active_tps"`
	NActive       int     `json:"n_active"`
	NWarming      int     `json:"n_warming"`
	// ThrottledStepsTotal counts every decode step a session skipped for its pool's
	// throttle since the server started (issue 41).
	ThrottledStepsTotal int64 `json:"throttled_steps_total"`
	// PacedTurnsTotal counts every turn a throttle held in the queue because one more
	// session would have slowed its pool's running ones under the floor.
	PacedTurnsTotal int64        `json:"paced_turns_total"`
	Sessions        []SessionTPS `json:"sessions"`
}

// SessionTPS is one session in the tps stream.
type SessionTPS struct {
	SessionID         string  `json:"session_id"`
	SeqID             int     `json:"seq_id"`
	PoolID            *int    `json:"pool_id"`
	State             string  `json:"state"`
	TPSEWMA           float64 `json:"tps_ewma"`
	Warming           bool    `json:"warming"`
	NDecoded          int     `json:"n_decoded"`
	CtxUsed           int     `json:"ctx_used"`
	CtxTotal          int     `json:"ctx_total"`
	CtxHeadroomTokens int     `json:"ctx_headroom_tokens"`
	CtxPressure       float64 `json:"ctx_pressure"` // the session's own pressure
	// DraftN, DraftNAccepted: the running request's speculative draft tokens verified
	// and accepted so far (only once it drafted any).
	DraftN         *int `json:"draft_n,omitempty"`
	DraftNAccepted *int `json:"draft_n_accepted,omitempty"`
	// ThrottledSteps: decode steps the running request skipped so far because its pool
	// throttles sessions decoding well above the floor (issue 41).
	ThrottledSteps int `json:"throttled_steps"`
}
