package engine

import (
	"fmt"
	"time"

	"github.com/polykv/polykv/internal/engine/kvcache"
)

// Config sizes the scheduler.
type Config struct {
	NCtx         int           // KV cells in the unified cache
	Parallel     int           // session sequences (ids 0..Parallel-1)
	MaxPools     int           // pool sequences (ids Parallel..Parallel+MaxPools-1)
	NBatch       int           // tokens per decode step (decode tokens + prefill chunks)
	MaxQueue     int           // waiting requests beyond the running ones; past it: ErrQueueFull
	SessionTTL   time.Duration // idle sessions older than this lose their KV (0 = never)
	PoolGrace    time.Duration // a pool just made is kept this long for its first use (kvcache.GraceRule); a released one is reclaimed this long after its last
	BytesPerCell int64         // KV bytes of one cell, for status reports
	// RecurrentBytesPerSeq is the recurrent state of one sequence (hybrid and recurrent
	// models; 0 otherwise), for status reports: unlike KV cells, which a pool's sessions
	// share zero-copy, every sequence holding tokens has its own copy.
	RecurrentBytesPerSeq int64
	// Recurrent: the model keeps per-sequence recurrent state (recurrent or hybrid
	// layers: Qwen3.5's gated delta-net, LFM2's short convolutions, Mamba). That state is
	// one value for the whole sequence, not a cell per position, so a sequence can be
	// extended or dropped but never cut back: truncate drops it whole, a session keeps its
	// cells only when the next prompt extends all of them, and a fork or attach extends a
	// pool at the full length of that pool or of an ancestor (a pool boundary, where the
	// ancestor's own sequence holds the state), otherwise ErrRecurrentBranch.
	Recurrent bool
	TPSTau    time.Duration // EWMA time constant of experienced tps (default 2 s)
	// PrefixCache turns on automatic prefix sharing (issue 12): a new request without a
	// pool (and without a known session) starts from the longest prefix any resident
	// sequence holds, by seq_cp, and finished anonymous sequences stay resident as cache
	// until their cells or sequence ids are needed. Off: such requests prefill their
	// whole prompt and free their cells when they end (the server's --prefix-cache off).
	PrefixCache bool
	// Tier (issue 25): an evicted pool's KV is spilled to a tier below the cache (the
	// plan's OpSpill, before its cells are removed) and restored from there (OpRestore)
	// when it is needed again, falling back to a prefill when the tier misses (the
	// driver answers each restore with a Restored message). Off: eviction drops the KV.
	Tier bool
	// TierRecord: user-pinned pools are also recorded for restarts (OpRecord, OpForget;
	// a disk tier).
	TierRecord bool
	// TierChunk is the tokens per stored segment of a session's or cached sequence's
	// cells (spill.go; 0: DefaultTierChunk). Used with Tier.
	TierChunk int
	// NoSequenceSpill keeps the tier to pools: sessions' and cached sequences' cells are
	// dropped when evicted, as before issue 40 (a backend whose cells another context
	// mirrors cell for cell, the MTP head's, cannot load them back alone).
	NoSequenceSpill bool
	// TierWriteThrough (issue 44): when a request ends, the chunks of its prompt that
	// the tier lacks are saved (OpSave) though its cells stay: with a level other
	// replicas share, what one computed any of them can load. Used with Tier.
	TierWriteThrough bool
	// TierFleet: the tier has a level other replicas write (a shared directory, a remote
	// store), which reports nothing of what they write: a request that waited in the
	// queue asks it again when it is seated (OpLookup), so what another replica wrote
	// meanwhile is loaded, not prefilled. Used with Tier.
	TierFleet bool
	// TierIndexTokens bounds the tokens the index of what lives below the cells holds
	// (kvcache.Below: about the tier's capacity in tokens; 0: 4M).
	TierIndexTokens int
	// PoolIDFloor: pool ids start above it (ids an earlier run may have used).
	PoolIDFloor int
	// QueueTimeout bounds every wait in the queue (issue 30): a request waiting for a
	// sequence, cells or its pool longer than this fails with ErrQueueTimeout (HTTP 503
	// with Retry-After), a pool's creation waiting for cells is abandoned with it. 0:
	// no deadline (benchmarks that queue on purpose). Requests held by an enforced
	// pool's admission gate have that policy's queue_timeout_ms until they are let in.
	QueueTimeout time.Duration
	// AttachMin is the least a request naming a pool by its key (pool_key) must share
	// with the pool's prefix to attach to it as a session (which pins the pool while the
	// session lives); below it the request runs unpooled (issue 30). A request naming a
	// pool by id attaches whatever it shares: its client asked for the pool.
	AttachMin int
	// Spec turns on speculative decoding (issue 23, speculative.go): every decoding
	// session proposes drafts that the step verifies beside everything else.
	// On a recurrent model only with Rollback ≥ Spec.DraftMax.
	Spec Spec
	// Rollback is, on a recurrent model (Recurrent), how many trailing positions the
	// backend can cut off a sequence right after a decode (llama.cpp's n_rs_seq
	// snapshots), which is what removing a rejected draft needs: speculation on such a
	// model needs Spec.DraftMax ≤ Rollback. Unused without Recurrent.
	Rollback int
}

// MaxSeqs is the largest n_seq_max llama.cpp accepts.
const MaxSeqs = kvcache.MaxSeqs

// Validate checks a configuration.
func (c Config) Validate() error {
	switch {
	case c.NCtx < 8:
		return fmt.Errorf("context size %d is too small", c.NCtx)
	case c.Parallel < 1:
		return fmt.Errorf("parallel must be at least 1, got %d", c.Parallel)
	case c.MaxPools < 0:
		return fmt.Errorf("max pools must not be negative, got %d", c.MaxPools)
	case c.Parallel+c.MaxPools > MaxSeqs:
		return fmt.Errorf("parallel (%d) + max pools (%d) exceeds llama.cpp's %d sequences", c.Parallel, c.MaxPools, MaxSeqs)
	case c.NBatch < c.Parallel:
		return fmt.Errorf("batch size %d must be at least parallel (%d): every running session decodes one token per step", c.NBatch, c.Parallel)
	case c.MaxQueue < 0:
		return fmt.Errorf("queue bound must not be negative, got %d", c.MaxQueue)
	case c.AttachMin < 0:
		return fmt.Errorf("attach minimum must not be negative, got %d", c.AttachMin)
	case c.QueueTimeout < 0:
		return fmt.Errorf("queue timeout must not be negative, got %s", c.QueueTimeout)
	case c.Spec.On() && c.Recurrent && c.Spec.withDefaults().DraftMax > c.Rollback:
		return fmt.Errorf("speculative decoding needs sequences that can be cut back after a rejected draft; this model's recurrent state can drop %d positions, --draft-max is %d", c.Rollback, c.Spec.withDefaults().DraftMax)
	}
	if c.Spec.On() {
		return c.Spec.withDefaults().validate()
	}
	return nil
}
