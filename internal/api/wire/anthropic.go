package wire

import "encoding/json"

// MessagesRequest is POST /v1/messages and /v1/messages/count_tokens (Anthropic's
// Messages API). It embeds the chat-completion generation fields, so max_tokens,
// temperature, top_p, top_k, stream and PolyKV's extensions (pool_id, pool_key,
// session_id, ...) read as on /v1/chat/completions; stop_sequences, system, tools and
// tool_choice are translated by the handler.
type MessagesRequest struct {
	GenParams
	System        json.RawMessage    `json:"system"`   // a string or text blocks
	Messages      json.RawMessage    `json:"messages"` // []AnthropicMessage
	Tools         []AnthropicTool    `json:"tools"`
	ToolChoice    json.RawMessage    `json:"tool_choice"` // AnthropicToolChoice
	StopSequences []string           `json:"stop_sequences"`
	Thinking      *AnthropicThinking `json:"thinking"`
	// Metadata is {user_id}: Claude Code sends a JSON string there holding its
	// session_id, which becomes the PolyKV session when nothing else names one.
	Metadata json.RawMessage `json:"metadata"`
	// OutputConfig is {effort: low | medium | high | max}: the reasoning effort, given
	// to the template as reasoning_effort (max as high).
	OutputConfig *AnthropicOutputConfig `json:"output_config"`
	// ContextManagement is {edits: [...]}: clear_thinking_20251015 drops the thinking of
	// older assistant turns before the prompt is rendered.
	ContextManagement *AnthropicContextManagement `json:"context_management"`
}

// AnthropicOutputConfig is a Messages request's output_config.
type AnthropicOutputConfig struct {
	Effort string `json:"effort"`
}

// AnthropicContextManagement is a Messages request's context_management.
type AnthropicContextManagement struct {
	Edits []AnthropicContextEdit `json:"edits"`
}

// AnthropicContextEdit is one context edit: its type and, for clear_thinking_20251015,
// keep ("all" or {type: thinking_turns, value: N}; one turn when absent).
type AnthropicContextEdit struct {
	Type string          `json:"type"`
	Keep json.RawMessage `json:"keep"`
}

// AnthropicMessage is one message of a Messages request.
type AnthropicMessage struct {
	Role    string          `json:"role"`    // user | assistant | system (Claude Code's mid-conversation system text)
	Content json.RawMessage `json:"content"` // a string or []AnthropicBlock
}

// AnthropicBlock is one content block of a request message, all block types in one
// struct: text, tool_use, tool_result, thinking, redacted_thinking.
type AnthropicBlock struct {
	Type string  `json:"type"`
	Text *string `json:"text"`
	// tool_use
	ID    string          `json:"id"`
	Name  string          `json:"name"`
	Input json.RawMessage `json:"input"`
	// tool_result
	ToolUseID string          `json:"tool_use_id"`
	Content   json.RawMessage `json:"content"` // a string or text blocks
	IsError   bool            `json:"is_error"`
	// thinking
	Thinking  *string `json:"thinking"`
	Signature string  `json:"signature"`
}

// AnthropicTool is one client tool: a name, a description and its input's JSON schema.
type AnthropicTool struct {
	Type        string          `json:"type,omitempty"`
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	InputSchema json.RawMessage `json:"input_schema"`
}

// AnthropicToolChoice is tool_choice: auto, any (some tool), tool (the named one) or
// none.
type AnthropicToolChoice struct {
	Type                   string `json:"type"`
	Name                   string `json:"name"`
	DisableParallelToolUse bool   `json:"disable_parallel_tool_use"`
}

// AnthropicThinking is the thinking member: enabled (with a token budget), adaptive
// (the model decides how much) or disabled. It reaches the chat template as
// enable_thinking (adaptive: true). Display ("summarized" | "omitted") is accepted; the
// reasoning is returned as it was generated.
type AnthropicThinking struct {
	Type         string `json:"type"`
	BudgetTokens int    `json:"budget_tokens"`
	Display      string `json:"display"`
}

// AnthropicReply is a Messages answer (and, with empty content, the message of a
// stream's message_start). PolyKV's members follow Anthropic's, as on chat completions.
type AnthropicReply struct {
	ID           string             `json:"id"`
	Type         string             `json:"type"` // "message"
	Role         string             `json:"role"` // "assistant"
	Model        string             `json:"model"`
	Content      []AnthropicContent `json:"content"`
	StopReason   *string            `json:"stop_reason"` // end_turn | max_tokens | stop_sequence | tool_use
	StopSequence *string            `json:"stop_sequence"`
	Usage        AnthropicUsage     `json:"usage"`
	SessionID    string             `json:"session_id,omitempty"`
	PoolID       int                `json:"pool_id,omitempty"`
	Context      *SessionCtx        `json:"context,omitempty"`
	Timings      *Timings           `json:"timings,omitempty"`
}

// AnthropicContent is one content block of a reply: text, tool_use or thinking
// (pointers: the members a block type has are present even when empty).
type AnthropicContent struct {
	Type      string          `json:"type"`
	Text      *string         `json:"text,omitempty"`
	ID        string          `json:"id,omitempty"`
	Name      string          `json:"name,omitempty"`
	Input     json.RawMessage `json:"input,omitempty"`
	Thinking  *string         `json:"thinking,omitempty"`
	Signature *string         `json:"signature,omitempty"`
}

// AnthropicUsage is a reply's token usage in Anthropic's terms: input_tokens are the
// prompt tokens prefilled, cache_read_input_tokens those reused from the KV cache.
type AnthropicUsage struct {
	InputTokens              int `json:"input_tokens"`
	CacheCreationInputTokens int `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int `json:"cache_read_input_tokens"`
	OutputTokens             int `json:"output_tokens"`
}

// AnthropicEvent is one event of a streamed Messages reply; the SSE event name is its
// type (message_start, content_block_start, content_block_delta, content_block_stop,
// message_delta, message_stop, error).
type AnthropicEvent struct {
	Type         string             `json:"type"`
	Message      *AnthropicReply    `json:"message,omitempty"`
	Index        *int               `json:"index,omitempty"`
	ContentBlock *AnthropicContent  `json:"content_block,omitempty"`
	Delta        *AnthropicDelta    `json:"delta,omitempty"`
	Usage        *AnthropicUsage    `json:"usage,omitempty"`
	Error        *AnthropicErrorDet `json:"error,omitempty"`
}

// EventName is the SSE event name: the event's type.
func (e AnthropicEvent) EventName() string { return e.Type }

// AnthropicDelta is a content_block_delta's delta (text_delta, input_json_delta,
// thinking_delta) or a message_delta's (stop_reason, stop_sequence).
type AnthropicDelta struct {
	Type         string  `json:"type,omitempty"`
	Text         *string `json:"text,omitempty"`
	PartialJSON  *string `json:"partial_json,omitempty"`
	Thinking     *string `json:"thinking,omitempty"`
	StopReason   *string `json:"stop_reason,omitempty"`
	StopSequence *string `json:"stop_sequence,omitempty"`
}

// AnthropicError is every error reply of the Messages routes, in Anthropic's shape.
type AnthropicError struct {
	Type  string            `json:"type"` // "error"
	Error AnthropicErrorDet `json:"error"`
}

// AnthropicErrorDet is an error's detail: invalid_request_error, authentication_error,
// not_found_error, request_too_large, rate_limit_error, api_error or
// overloaded_error.
type AnthropicErrorDet struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

// TokenCount is POST /v1/messages/count_tokens.
type TokenCount struct {
	InputTokens int `json:"input_tokens"`
}
