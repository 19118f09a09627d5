package wire

import (
	"encoding/json"
	"unicode/utf8"
)

// Health is GET /health.
type Health struct {
	Status string `json:"status"`
}

// ModelList is GET /v1/models.
type ModelList struct {
	Data   []Model `json:"data"`
	Object string  `json:"object"` // "list"
}

// Model is one served model.
type Model struct {
	Created int64     `json:"created"`
	ID      string    `json:"id"`
	Meta    ModelMeta `json:"meta"`
	Object  string    `json:"object"` // "model"
	OwnedBy string    `json:"owned_by"`
}

// ModelMeta is llama-server's model metadata.
type ModelMeta struct {
	Desc      string `json:"desc"`
	NCtxTrain int    `json:"n_ctx_train"`
	NVocab    int    `json:"n_vocab"`
}

// Props is GET /props: llama-server's fields, the engine's load and PolyKV's settings.
type Props struct {
	BOSToken string `json:"bos_token"`
	// BuildInfo is the linked llama.cpp, b<build>-<source id>, as llama-server reports it.
	BuildInfo         string `json:"build_info"`
	ChatTemplate      string `json:"chat_template"`
	ChatTemplateError string `json:"chat_template_error,omitempty"` // why the template cannot render
	ChatTemplatePath  string `json:"chat_template_path"`
	// Compute is where the model runs (app.Offload, which spells its own JSON).
	Compute        any         `json:"compute"`
	EOSToken       string      `json:"eos_token"`
	KVUnified      bool        `json:"kv_unified"`
	Model          string      `json:"model"`
	ModelDesc      string      `json:"model_desc"`
	ModelPath      string      `json:"model_path"`
	NBatch         int         `json:"n_batch"`
	NCtx           int         `json:"n_ctx"`
	NCtxTrain      int         `json:"n_ctx_train"`
	Parallel       int         `json:"parallel"`
	PolyKV         PolyKVProps `json:"polykv"`
	ToolCallFormat string      `json:"tool_call_format"`
	TotalSlots     int         `json:"total_slots"`
	Usage          EngineUsage `json:"usage"`
}

// PolyKVProps are PolyKV's settings in /props.
type PolyKVProps struct {
	AdmissionDefault Policy `json:"admission_default"`
	// CPUFeatures are the x86 features llama.cpp's CPU backend was built with.
	CPUFeatures    []string           `json:"cpu_features"`
	Floors         map[string]float64 `json:"floors"` // pool id -> tps floor, for pools with one
	KVBytesPerCell int64              `json:"kv_bytes_per_cell"`
	// KVOrdered: attention sums each query's cells in position order wherever they sit
	// (PolyKV's kernel), so the cache is never compacted; false: compacted after frees.
	KVOrdered   bool  `json:"kv_ordered_attention"`
	MaxPools    int   `json:"max_pools"`
	NSeqMax     int   `json:"n_seq_max"`
	PoolGraceMs int64 `json:"pool_grace_ms"`
	// PoolsSupported is always true and PoolsUnsupported always empty: every model the
	// server loads has pools (one with recurrent state at pool boundaries only:
	// runner.Policy). Both stay on the wire for clients that read them.
	PoolsSupported   bool   `json:"pools_supported"`
	PoolsUnsupported string `json:"pools_unsupported"`
	// PoolTier is the tier below the cache (--pool-ram-mb, --pool-dir): absent when
	// not asked for.
	PoolTier    *PoolTierProps   `json:"pool_tier,omitempty"`
	PrefixCache PrefixCacheProps `json:"prefix_cache"`
	TPS         TPSProps         `json:"tps"`
	// Speculative is the speculative decoding in force (--spec-type): absent when off.
	Speculative *SpeculativeProps `json:"speculative,omitempty"`
}

// SpeculativeProps describe speculative decoding in /props.
type SpeculativeProps struct {
	Types    []string `json:"types"` // drafters, tried in order
	DraftMax int      `json:"draft_max"`
	DraftMin int      `json:"draft_min"`
}

// PrefixCacheProps describe automatic prefix sharing (--prefix-cache) in /props.
type PrefixCacheProps struct {
	Enabled         bool  `json:"enabled"`
	HitTokens       int64 `json:"hit_tokens"`      // prompt tokens served from cached prefixes so far
	ResidentTokens  int   `json:"resident_tokens"` // cells only cached sequences hold
	CachedSequences int   `json:"cached_sequences"`
	Evictions       int64 `json:"evictions"`
}

// TPSProps describe the tps measurement.
type TPSProps struct {
	EWMA                    string `json:"ewma"`
	StreamIntervalMsDefault int    `json:"stream_interval_ms_default"`
	TauMs                   int64  `json:"tau_ms"`
	WarmMinTokens           int    `json:"warm_min_tokens"`
}

// EngineUsage is the engine's load (in /props).
type EngineUsage struct {
	KVCellsUsed int `json:"kv_cells_used"`
	KVCellsMax  int `json:"kv_cells_max"`
	// KVCellsEvictable: of the cells used, those eviction would free for a new request
	// (idle sessions, cached sequences, unpinned idle pools).
	KVCellsEvictable int `json:"kv_cells_evictable"`
	RequestsRunning  int `json:"requests_running"`
	RequestsWaiting  int `json:"requests_waiting"`
	Sessions         int `json:"sessions"`
	Pools            int `json:"pools"`
	// The prefix cache (engine.Usage's Cache* fields).
	PrefixCacheHitTokens int64 `json:"prefix_cache_hit_tokens"`
	PrefixCacheCells     int   `json:"prefix_cache_cells"`
	PrefixCacheSequences int   `json:"prefix_cache_sequences"`
	PrefixCacheEvictions int64 `json:"prefix_cache_evictions"`
}

// Slot is one session sequence in use, in GET /slots (an array of them).
type Slot struct {
	ID         int    `json:"id"`
	SessionID  string `json:"session_id"`
	State      string `json:"state"` // idle | prefill | decode | cached
	NPast      int    `json:"n_past"`
	NDecoded   int    `json:"n_decoded"`
	TaskID     uint64 `json:"task_id,omitempty"`
	PoolID     *int   `json:"pool_id"`
	NShared    int    `json:"n_shared"`     // leading tokens borrowed from the pool
	NOwnCells  int    `json:"n_own_cells"`  // cells attributed to it by ownership
	OwnKVBytes int64  `json:"own_kv_bytes"` // those cells' KV bytes
	// RecurrentStateBytes is the sequence's own recurrent state (hybrid and recurrent
	// models; 0 otherwise): copied, never shared.
	RecurrentStateBytes int64   `json:"recurrent_state_bytes"`
	TPSEWMA             float64 `json:"tps_ewma"`
	CtxUsed             int     `json:"ctx_used"`
	CtxTotal            int     `json:"ctx_total"`
	CtxHeadroomTokens   int     `json:"ctx_headroom_tokens"`
	CtxPressure         float64 `json:"ctx_pressure"` // the session's own context pressure
	// DraftN, DraftNAccepted: the running request's speculative draft tokens verified
	// and accepted so far (only once it drafted any).
	DraftN         *int `json:"draft_n,omitempty"`
	DraftNAccepted *int `json:"draft_n_accepted,omitempty"`
	// NRestored (PolyKV's): the running request's prompt tokens loaded from the tier
	// instead of prefilled (issue 40); only when nonzero.
	NRestored int `json:"n_restored,omitempty"`
	// A waiting request (state "waiting", id -1: no sequence yet) says why it waits
	// (pool, prefix, session, sequence, cells, queue, admission), since when, and how
	// long its prompt is.
	NPromptTokens int    `json:"n_prompt_tokens,omitempty"`
	WaitingReason string `json:"waiting_reason,omitempty"`
	WaitingMs     *int64 `json:"waiting_ms,omitempty"`
	// KV (a waiting request): where its prompt's KV lives now.
	KV *KVResidency `json:"kv,omitempty"`
}

// KVResidency is where a waiting request's prompt's KV lives now (PolyKV's): the
// longest prefix in KV cells, then, continuing it, the tokens this replica's tier
// (RAM, --pool-dir) and the fleet's shared level hold, as the server's index knows them.
// The rest of the prompt is what it will prefill, as things stand.
type KVResidency struct {
	Cells int `json:"cells"`
	Tier  int `json:"tier"`
	Fleet int `json:"fleet"`
}

// TokenizeRequest is POST /tokenize.
type TokenizeRequest struct {
	Content      *string `json:"content"`
	AddSpecial   bool    `json:"add_special"`
	ParseSpecial *bool   `json:"parse_special"` // default true
	WithPieces   bool    `json:"with_pieces"`
}

// Tokens is /tokenize's answer without pieces.
type Tokens struct {
	Tokens []int32 `json:"tokens"`
}

// TokenPieces is /tokenize's answer with_pieces.
type TokenPieces struct {
	Tokens []TokenPiece `json:"tokens"`
}

// TokenPiece is one token with its piece.
type TokenPiece struct {
	ID    int32 `json:"id"`
	Piece Piece `json:"piece"`
}

// Piece is a token's bytes as llama-server's /tokenize spells them: a string when they
// are valid UTF-8, else an array of byte values. A string would turn a piece of a
// multi-byte character into U+FFFD, and the pieces would no longer join back.
type Piece []byte

// MarshalJSON implements json.Marshaler.
func (p Piece) MarshalJSON() ([]byte, error) {
	if utf8.Valid(p) {
		return json.Marshal(string(p))
	}
	out := make([]int, len(p))
	for i, c := range p {
		out[i] = int(c)
	}
	return json.Marshal(out)
}

// UnmarshalJSON implements json.Unmarshaler (both spellings).
func (p *Piece) UnmarshalJSON(b []byte) error {
	var s string
	if json.Unmarshal(b, &s) == nil {
		*p = Piece(s)
		return nil
	}
	var bs []int
	if err := json.Unmarshal(b, &bs); err != nil {
		return err
	}
	*p = make(Piece, len(bs))
	for i, c := range bs {
		(*p)[i] = byte(c)
	}
	return nil
}

// DetokenizeRequest is POST /detokenize.
type DetokenizeRequest struct {
	Tokens *[]int32 `json:"tokens"`
}

// Detokenized is /detokenize's answer.
type Detokenized struct {
	Content string `json:"content"`
}

// ApplyTemplateRequest is POST /apply-template: a chat body, nothing generated.
type ApplyTemplateRequest struct {
	Messages            json.RawMessage `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	ToolChoice          json.RawMessage `json:"tool_choice"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"` // default true
	TemplateOptions
}

// AppliedTemplate is /apply-template's answer.
type AppliedTemplate struct {
	Prompt string `json:"prompt"`
}

// Rendered is one prompt's token ids, as the render routes answer them
// (/v1/completions/render answers an array of them, one per prompt, as vLLM does).
type Rendered struct {
	TokenIDs []int32 `json:"token_ids"`
}

// PoolTierProps describe the pool tier in /props: Enabled, or Off with the reason
// (a sliding-window model), and its sizes and counters.
type PoolTierProps struct {
	Enabled     bool             `json:"enabled"`
	Off         string           `json:"off,omitempty"`
	RAMBytes    int64            `json:"ram_bytes"`
	RAMEntries  int64            `json:"ram_entries"`
	DiskBytes   int64            `json:"disk_bytes"`
	DiskEntries int64            `json:"disk_entries"`
	Spills      int64            `json:"spills"`
	Restores    map[string]int64 `json:"restores"`
	Misses      map[string]int64 `json:"misses"`
	DiskErrors  int64            `json:"disk_errors"`
	// Kinds splits the work by kind of holder (pool, session, cached: issue 40).
	Kinds map[string]TierKind `json:"kinds,omitempty"`
}

// TierKind is the tier's work for one kind of holder.
type TierKind struct {
	Spills         int64   `json:"spills"`
	SpillBytes     int64   `json:"spill_bytes"`
	Restores       int64   `json:"restores"`
	RestoreBytes   int64   `json:"restore_bytes"`
	RestoreSeconds float64 `json:"restore_seconds"`
	Misses         int64   `json:"misses"`
}
