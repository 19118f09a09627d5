package wire

import "encoding/json"

// GenParams are the generation fields shared by chat and text completions. Fields that
// accept several JSON types stay raw here; internal/api validates them.
type GenParams struct {
	Model               string          `json:"model"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	TopP                *float64        `json:"top_p"`
	TopK                *int            `json:"top_k"`
	MinP                *float64        `json:"min_p"`
	Seed                *int64          `json:"seed"`
	Stop                json.RawMessage `json:"stop"` // a string or an array of strings
	Stream              bool            `json:"stream"`
	StreamOptions       *StreamOptions  `json:"stream_options"`
	N                   *int            `json:"n"`
	PresencePenalty     *float64        `json:"presence_penalty"`
	FrequencyPenalty    *float64        `json:"frequency_penalty"`
	RepeatPenalty       *float64        `json:"repeat_penalty"`
	RepeatLastN         *int            `json:"repeat_last_n"`
	IgnoreEOS           bool            `json:"ignore_eos"`
	Logprobs            json.RawMessage `json:"logprobs"` // chat: a boolean; legacy: a count
	TopLogprobs         *int            `json:"top_logprobs"`
	SessionID           *string         `json:"session_id"`
	PoolID              json.RawMessage `json:"pool_id"` // an integer or its string
	SharedPrefixN       *int            `json:"shared_prefix_n_tokens"`
	PoolKey             *string         `json:"pool_key"`
	Overcommit          bool            `json:"overcommit"`
	ReservationID       *string         `json:"reservation_id"`
	// NextTurnMs (PolyKV's; header x-polykv-next-turn-ms): when this conversation's next
	// turn comes after the reply, so its KV is kept ahead of conversations expected later.
	NextTurnMs *int64 `json:"next_turn_ms"`
	// CachePrompt false (llama-server's name): prefill the whole prompt rather than
	// start from a cached prefix of another sequence (a cold reference).
	CachePrompt *bool `json:"cache_prompt"`
	// Speculative is false to turn speculative decoding off for the request, or an
	// object {"n_max", "n_min"} bounding its drafts; SpecNMax and SpecNMin are
	// llama-server's flat fields speculative.n_max and speculative.n_min.
	Speculative json.RawMessage `json:"speculative"`
	SpecNMax    *int            `json:"speculative.n_max"`
	SpecNMin    *int            `json:"speculative.n_min"`
}

// Params returns the generation fields themselves. Every request type that embeds
// GenParams has it too, so internal/api decodes all of them with one generic function.
func (g *GenParams) Params() *GenParams { return g }

// StreamOptions is OpenAI's stream_options.
type StreamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// ChatRequest is POST /v1/chat/completions (and the chat render route).
type ChatRequest struct {
	GenParams
	Messages          json.RawMessage `json:"messages"` // []ChatMessage, validated by the handler
	Tools             json.RawMessage `json:"tools"`
	ToolChoice        json.RawMessage `json:"tool_choice"` // "auto" | "none" | "required" | ToolChoiceFunction
	ParallelToolCalls *bool           `json:"parallel_tool_calls"`
	ResponseFormat    json.RawMessage `json:"response_format"` // ResponseFormat
	TemplateOptions
}

// TemplateOptions are the chat-request fields that reach the template itself.
type TemplateOptions struct {
	// ChatTemplateKwargs are extra template variables (llama-server's
	// chat_template_kwargs, e.g. {"enable_thinking": false} for Qwen3).
	ChatTemplateKwargs json.RawMessage `json:"chat_template_kwargs"`
	// ReasoningEffort is given to templates as reasoning_effort (GPT-OSS reads it),
	// unless chat_template_kwargs sets it already.
	ReasoningEffort *string `json:"reasoning_effort"`
	// ReasoningFormat is llama-server's reasoning_format: "none" leaves a thinking
	// model's reasoning in content; "deepseek" and "auto" (default) return it as
	// reasoning_content.
	ReasoningFormat *string `json:"reasoning_format"`
}

// ChatMessage is one message of a chat request (tool calls and results included).
type ChatMessage struct {
	Role             string          `json:"role"`
	Content          json.RawMessage `json:"content"` // a string, content parts or null
	Name             string          `json:"name"`
	ReasoningContent string          `json:"reasoning_content"`
	ToolCallID       string          `json:"tool_call_id"`
	ToolCalls        []InToolCall    `json:"tool_calls"`
}

// ContentPart is one OpenAI content part (only type "text" is supported).
type ContentPart struct {
	Type string  `json:"type"`
	Text *string `json:"text"`
}

// InToolCall is a tool call an assistant message of the request carries.
type InToolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments"` // a JSON string (OpenAI) or an object
	} `json:"function"`
}

// ToolChoiceFunction is tool_choice naming one function.
type ToolChoiceFunction struct {
	Type     string `json:"type"`
	Function struct {
		Name string `json:"name"`
	} `json:"function"`
}

// ResponseFormat is OpenAI's response_format.
type ResponseFormat struct {
	Type       string `json:"type"` // text | json_object | json_schema
	JSONSchema *struct {
		Name   string          `json:"name"`
		Schema json.RawMessage `json:"schema"`
	} `json:"json_schema"`
}

// CompletionRequest is POST /v1/completions (and its render route).
type CompletionRequest struct {
	GenParams
	Prompt json.RawMessage `json:"prompt"` // a string, [string] or token ids
}

// Completion is a finished chat or text completion; C is ChatChoice or TextChoice.
// The llama-server and PolyKV members (context, pool_id, session_id, timings,
// truncated) follow OpenAI's.
type Completion[C any] struct {
	Choices   []C        `json:"choices"`
	Context   SessionCtx `json:"context"` // the session's own context pressure at the end
	Created   int64      `json:"created"`
	ID        string     `json:"id"`
	Model     string     `json:"model"`
	Object    string     `json:"object"` // chat.completion | text_completion
	PoolID    int        `json:"pool_id,omitempty"`
	SessionID string     `json:"session_id"`
	Timings   Timings    `json:"timings"`
	Truncated bool       `json:"truncated,omitempty"`
	Usage     Usage      `json:"usage"`
}

// ChatCompletion is /v1/chat/completions' answer.
type ChatCompletion = Completion[ChatChoice]

// TextCompletion is /v1/completions' answer.
type TextCompletion = Completion[TextChoice]

// ChatChoice is a chat completion's one choice.
type ChatChoice struct {
	FinishReason string        `json:"finish_reason"` // stop | length | tool_calls
	Index        int           `json:"index"`
	Logprobs     *ChatLogprobs `json:"logprobs"`
	Message      Message       `json:"message"`
}

// TextChoice is a text completion's one choice.
type TextChoice struct {
	FinishReason string        `json:"finish_reason"` // stop | length
	Index        int           `json:"index"`
	Logprobs     *TextLogprobs `json:"logprobs"`
	Text         string        `json:"text"`
}

// Message is the assistant's reply. Content is null when the reply is only tool calls
// (or a forced call that was cut short).
type Message struct {
	Content          *string    `json:"content"`
	ReasoningContent string     `json:"reasoning_content,omitempty"`
	Role             string     `json:"role"`
	ToolCalls        []ToolCall `json:"tool_calls,omitempty"`
}

// ToolCall is one call in message.tool_calls.
type ToolCall struct {
	Function ToolCallFunction `json:"function"`
	ID       string           `json:"id"`
	Type     string           `json:"type"` // "function"
}

// ToolCallFunction is a call's function and its arguments (a JSON text).
type ToolCallFunction struct {
	Arguments string `json:"arguments"`
	Name      string `json:"name"`
}

// Usage is OpenAI's token usage. Add members here (alphabetical order keeps the wire).
type Usage struct {
	CompletionTokens    int                 `json:"completion_tokens"`
	PromptTokens        int                 `json:"prompt_tokens"`
	PromptTokensDetails PromptTokensDetails `json:"prompt_tokens_details"`
	TotalTokens         int                 `json:"total_tokens"`
}

// PromptTokensDetails is usage.prompt_tokens_details.
type PromptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"` // prompt tokens reused from the KV cache
}

// Timings are llama-server's timings plus PolyKV's tps_ewma. Add members here
// (alphabetical order keeps the wire).
type Timings struct {
	CacheN              int     `json:"cache_n"`
	PredictedMs         float64 `json:"predicted_ms"`
	PredictedN          int     `json:"predicted_n"`
	PredictedPerSecond  float64 `json:"predicted_per_second"`
	PredictedPerTokenMs float64 `json:"predicted_per_token_ms"`
	PromptMs            float64 `json:"prompt_ms"`
	PromptN             int     `json:"prompt_n"`
	PromptPerSecond     float64 `json:"prompt_per_second"`
	PromptPerTokenMs    float64 `json:"prompt_per_token_ms"`
	TPSEWMA             float64 `json:"tps_ewma"`
	// RestoredN (PolyKV's): prompt tokens loaded from the tier below the cache instead of
	// prefilled (issue 40); only when nonzero. prompt_n counts neither these nor cache_n.
	RestoredN int `json:"restored_n,omitempty"`
	// DraftN and DraftNAccepted (llama-server's names): speculative draft tokens
	// verified for the request and those accepted; only when it drafted any.
	DraftN         *int `json:"draft_n,omitempty"`
	DraftNAccepted *int `json:"draft_n_accepted,omitempty"`
	// DraftNFiltered (PolyKV's): draft tokens a grammar-constrained request's grammar
	// forbade, cut from its proposals before they were verified; only when nonzero.
	DraftNFiltered int `json:"draft_n_filtered,omitempty"`
	// ThrottledSteps (PolyKV's): decode steps the request skipped because its pool
	// throttles sessions toward the floor; only when nonzero.
	ThrottledSteps int `json:"throttled_steps,omitempty"`
	// PacedMs (PolyKV's): how long the request waited in the queue because its pool's
	// throttle paces turns at the floor; only when nonzero.
	PacedMs float64 `json:"paced_ms,omitempty"`
}

// SessionCtx is one session's own context pressure: what its sequence holds against
// what it can still grow into.
type SessionCtx struct {
	SessionID         string  `json:"session_id,omitempty"`
	PoolID            *int    `json:"pool_id"` // the pool its sequence is attached to (null: none)
	CtxUsed           int     `json:"ctx_used"`
	CtxHeadroomTokens int     `json:"ctx_headroom_tokens"`
	CtxPressure       float64 `json:"ctx_pressure"`
}

// Chunk is one event of a streamed completion; C is ChatChunkChoice or
// TextChunkChoice.
// The last chunk with a finish_reason also carries context, session_id and timings
// (and pool_id, truncated); with stream_options.include_usage one more chunk follows
// with no choices and the usage.
type Chunk[C any] struct {
	Choices   []C         `json:"choices"`
	Context   *SessionCtx `json:"context,omitempty"`
	Created   int64       `json:"created"`
	ID        string      `json:"id"`
	Model     string      `json:"model"`
	Object    string      `json:"object"` // chat.completion.chunk | text_completion
	PoolID    int         `json:"pool_id,omitempty"`
	SessionID *string     `json:"session_id,omitempty"`
	Timings   *Timings    `json:"timings,omitempty"`
	Truncated bool        `json:"truncated,omitempty"`
	Usage     *Usage      `json:"usage,omitempty"`
}

// ChatChunk is one event of a streamed chat completion.
type ChatChunk = Chunk[ChatChunkChoice]

// TextChunk is one event of a streamed text completion.
type TextChunk = Chunk[TextChunkChoice]

// ChatChunkChoice is a chat chunk's choice: the new piece of the reply as a delta.
type ChatChunkChoice struct {
	Delta        Delta         `json:"delta"`
	FinishReason *string       `json:"finish_reason"` // null until the last chunk
	Index        int           `json:"index"`
	Logprobs     *ChatLogprobs `json:"logprobs"`
}

// TextChunkChoice is a text chunk's choice.
type TextChunkChoice struct {
	FinishReason *string       `json:"finish_reason"` // null until the last chunk
	Index        int           `json:"index"`
	Logprobs     *TextLogprobs `json:"logprobs"`
	Text         string        `json:"text"`
}

// Delta is a chat chunk's new piece: the first chunk has role and an empty content,
// later ones content, reasoning_content or one tool-call piece, the last none.
type Delta struct {
	Content          *string         `json:"content,omitempty"`
	ReasoningContent string          `json:"reasoning_content,omitempty"`
	Role             string          `json:"role,omitempty"`
	ToolCalls        []ToolCallDelta `json:"tool_calls,omitempty"`
}

// ToolCallDelta is a piece of a streamed tool call, as OpenAI streams them: the first
// piece of a call has its id, type and name, later ones only arguments.
type ToolCallDelta struct {
	Function ToolCallFunctionDelta `json:"function"`
	ID       string                `json:"id,omitempty"`
	Index    int                   `json:"index"`
	Type     string                `json:"type,omitempty"`
}

// ToolCallFunctionDelta is a call piece's function: the name once, then arguments.
type ToolCallFunctionDelta struct {
	Arguments string `json:"arguments"`
	Name      string `json:"name,omitempty"`
}

// ChatLogprobs are a chat choice's logprobs (OpenAI's chat shape).
type ChatLogprobs struct {
	Content []TokenLogprob `json:"content"`
}

// TokenLogprob is one generated token with its most likely alternatives.
type TokenLogprob struct {
	Bytes       []int        `json:"bytes"`
	ID          int32        `json:"id"`
	Logprob     float32      `json:"logprob"`
	Token       string       `json:"token"`
	TopLogprobs []TopLogprob `json:"top_logprobs"`
}

// TopLogprob is one alternative at a token's position.
type TopLogprob struct {
	Bytes   []int   `json:"bytes"`
	Logprob float32 `json:"logprob"`
	Token   string  `json:"token"`
}

// TextLogprobs are a text choice's logprobs (the legacy completions shape):
// parallel arrays, one entry per token. A piece that is not valid UTF-8 is spelled
// "bytes:\xNN..."; text_offset counts characters (code points) before each token.
type TextLogprobs struct {
	TextOffset    []int                `json:"text_offset"`
	TokenIDs      []int32              `json:"token_ids"`
	TokenLogprobs []float32            `json:"token_logprobs"`
	Tokens        []string             `json:"tokens"`
	TopLogprobs   []map[string]float32 `json:"top_logprobs"`
}
