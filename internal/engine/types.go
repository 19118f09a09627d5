package engine

import (
	"errors"
	"time"
)

// Token is a model token id.
type Token = int32

// TaskID names one generation request inside the engine.
type TaskID uint64

// SamplingParams selects the sampler chain of one task. Temperature <= 0 is greedy.
type SamplingParams struct {
	Temperature      float32
	TopK             int
	TopP             float32
	MinP             float32
	Seed             uint32
	RepeatPenalty    float32
	RepeatLastN      int
	FrequencyPenalty float32
	PresencePenalty  float32
	Grammar          string // GBNF constraining every sampled token ("" = none)
	// GrammarTriggers make Grammar lazy: free text until a trigger appears, the
	// grammar from there on (tool_choice auto). None: Grammar constrains from the start.
	GrammarTriggers []GrammarTrigger
	// NProbs is how many most likely alternatives to report with each sampled token
	// when the task asks for logprobs (llama.cpp's n_probs; OpenAI's top_logprobs).
	// It changes nothing about the draw.
	NProbs int
}

// GrammarTrigger starts a lazy grammar: Word is literal text anywhere in the output;
// Pattern is a regular expression (ECMAScript) over the whole output so far whose
// first capture group starts the constrained text. One of the two is set.
type GrammarTrigger struct {
	Word    string
	Pattern string
}

// Request is one generation request, already tokenized.
type Request struct {
	Prompt    []Token
	SessionID string // "" = anonymous: the sequence is cleared when the task ends
	Sampling  SamplingParams
	MaxTokens int      // 0 = until EOG, a stop string or the context
	Stop      []string // stop strings; the matched string is not returned
	IgnoreEOS bool     // keep generating past end-of-generation tokens (benchmarks)
	Logprobs  bool     // report the log-probability of every sampled token
	// HasPool attaches the request to pool PoolID: the longest common prefix of the
	// prompt and the pool's tokens (at most SharedPrefixN when set) is borrowed from the
	// pool's cells instead of being prefilled.
	HasPool       bool
	PoolID        int
	SharedPrefixN *int
	Overcommit    bool // skip an enforced pool's admission gate (logged by the API)
	// ReservationID names a granted reservation of the pool (POST
	// /polykv/pools/{id}/reservations): the request uses it instead of the gate.
	ReservationID string
	// PoolKey, when set and HasPool is not, names a pool by content (its prefix hash):
	// the request attaches to the live pool with that key if this replica holds one,
	// and otherwise runs unpooled (never an error: a router may send it anywhere).
	PoolKey *uint64
	// NoPrefixCache: do not start from another sequence's cached prefix, prefill the
	// whole prompt (cache_prompt: false; a cold reference for comparisons).
	NoPrefixCache bool
	// NextTurn is the client's word on when this conversation's next turn comes after
	// this reply (x-polykv-next-turn-ms; 0: not said): its cells are kept ahead of those
	// expected later (issue 40: eviction by expected next use).
	NextTurn time.Duration
	// Spec is the request's own speculative decoding settings (speculative: false,
	// speculative.n_max, speculative.n_min); the zero value follows the server's.
	Spec SpecRequest
}

// Finish reasons, as OpenAI names them.
const (
	FinishStop      = "stop"
	FinishLength    = "length"
	FinishCancelled = "cancelled"
	FinishError     = "error"
)

// Stats are a task's counters and timings, in llama-server's terms.
type Stats struct {
	PromptN     int           // prompt tokens evaluated (not served from cache or the tier)
	CacheN      int           // prompt tokens reused from the KV cache
	RestoredN   int           // prompt tokens loaded from the tier below the cache (issue 40)
	PredictedN  int           // generated tokens
	PromptTime  time.Duration // admission to first sampled token
	PredictTime time.Duration // first sampled token to the end
	Seq         int           // sequence the task ran on
	Pool        int           // pool the sequence is attached to (0: none)
	Shared      int           // leading tokens borrowed from that pool
	// DraftN are the draft tokens proposed for the task and verified (speculative
	// decoding), DraftAccepted those the model agreed with (llama-server's draft_n and
	// draft_n_accepted); accepted drafts are part of PredictedN.
	DraftN, DraftAccepted int
	TPS                   float64    // experienced decode tps (EWMA) at the end
	Ctx                   SessionCtx // the sequence's own context pressure at the end
	// DraftFiltered are draft tokens the task's grammar forbade (DraftChecker), cut
	// from its proposals before they took a batch row; not part of DraftN.
	DraftFiltered int
	// ThrottledSteps are the decode steps the task skipped for its pool's throttle
	// toward the floor (throttle.go).
	ThrottledSteps int
	// Paced is how long the throttle held the turn in the queue while one more session
	// would have slowed its pool's running ones under the floor (throttle.go, paced).
	Paced time.Duration
}

// TokenLogprob is one sampled token with its log-probability and, when the task asked
// for alternatives (SamplingParams.NProbs), the most likely tokens at its position.
type TokenLogprob struct {
	Token   Token
	Logprob float32
	Top     []TokenLogprob // most likely first; Top's own entries have no Top
}

// Event is what the engine tells a task's reader: text as it is produced, then one
// final event with Done set.
type Event struct {
	Task      TaskID
	Text      string         // new text (UTF-8 complete, stop strings withheld)
	Tokens    []TokenLogprob // tokens behind Text, with logprobs when asked
	Done      bool
	Finish    string // with Done
	StopWord  string // with Done and Finish "stop": the stop string that matched ("" for EOG)
	Truncated bool   // with Done: stopped because the context ran out
	Err       error  // with Done: the task failed
	Stats     Stats  // with Done
	// Pool: for a pool's materialization (with Done) the pool id; for a request, the
	// pool its sequence is attached to (0: none), on every event, so a streamed reply
	// can name it in a header before its first chunk (X-Pool-Id).
	Pool int
}

// Sentinel errors, mapped to HTTP statuses by the API layer.
var (
	ErrQueueFull       = errors.New("the request queue is full")
	ErrPromptTooLong   = errors.New("the prompt does not fit the context")
	ErrEmptyPrompt     = errors.New("the prompt is empty")
	ErrEngineClosed    = errors.New("the engine is shut down")
	ErrCancelled       = errors.New("the request was cancelled")
	ErrInvalidToken    = errors.New("token outside the vocabulary")
	ErrDecode          = errors.New("decode failed")
	ErrContextExceeded = errors.New("the context is exhausted")
	// ErrQueueTimeout: the request waited in the queue past Config.QueueTimeout.
	ErrQueueTimeout = errors.New("the request waited too long in the queue")
	// ErrNeverFits: the request needs more cells than the cache can ever give it while
	// the pools pinned now stay pinned (no tier to page them to).
	ErrNeverFits = errors.New("the request cannot fit the cache beside the pinned pools")
)

// BatchEntry is one token of a decode batch.
type BatchEntry struct {
	Token  Token
	Pos    int
	Seq    int
	Sample bool   // sample the next token from this entry's output
	Task   TaskID // whose sampler to use when Sample is set
	// Draft marks a speculative draft token (with Sample set): it is only sampled when
	// the task's previous sampled token in this batch equals Token (every earlier draft
	// of the task was accepted); otherwise its Sampled is NotDrawn and the task's
	// sampler is not touched. A task's entries are in position order.
	Draft bool
}

// Sampled is the token drawn for a batch entry with Sample set.
type Sampled struct {
	Token   Token
	Logprob float32 // log-softmax of Token; only filled when the task asked for logprobs
	// Top are the NProbs most likely tokens under the same log-softmax, most likely
	// first; only filled when the task asked for logprobs.
	Top []TokenLogprob
}

// Backend executes what the scheduler plans. Only the engine goroutine calls it.
type Backend interface {
	// Decode runs the batch and returns one Sampled per entry with Sample set, in order
	// (NotDrawn for a Draft entry past a rejected draft, see BatchEntry.Draft).
	Decode(batch []BatchEntry) ([]Sampled, error)
	// SeqRm removes seq's cells in [p0, p1) (p1 < 0: to the end).
	SeqRm(seq, p0, p1 int) bool
	// SeqCp adds dst to the cells src holds in [p0, p1).
	SeqCp(src, dst, p0, p1 int)
	// NewSampler creates task's sampler; history primes repetition penalties.
	NewSampler(task TaskID, p SamplingParams, logprobs bool, history []Token)
	// FreeSampler drops task's sampler.
	FreeSampler(task TaskID)
	// Caps declares what else the backend can do; the engine asks once, at New.
	Caps() Caps
}

// DraftChecker is a backend's ability (Caps.Check) to check speculative drafts against
// a task's grammar before they are planned (speculative.go): the scheduler cuts a
// grammar request's proposal at the first token its sampler could never draw, so a
// draft the grammar forbids costs no batch row. Without it a grammar request's drafts
// are still verified exactly (the forbidden one is simply rejected).
type DraftChecker interface {
	// DraftFits reports how many of drafts, in order, task's sampler allows right
	// after the tokens it has drawn so far (its grammar's state after the task's
	// next, not yet decoded, token): the index of the first it forbids, or
	// len(drafts). It must not change the sampler, and its answer must depend only
	// on the tokens drawn (so planning stays deterministic).
	DraftFits(task TaskID, drafts []Token) int
}

// Vocab is the read-only view of the tokenizer that text assembly needs.
type Vocab interface {
	Piece(tok Token) []byte
	IsEOG(tok Token) bool
}
