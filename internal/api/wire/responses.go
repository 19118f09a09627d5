package wire

import "encoding/json"

// ResponsesRequest is POST /v1/responses (OpenAI's Responses API). It embeds the
// chat-completion generation fields, so PolyKV's extensions (pool_id, pool_key,
// session_id, seed, top_k, ...) read the same as on /v1/chat/completions; the
// Responses names (max_output_tokens, text.format, reasoning.effort) are translated
// onto them by the handler.
type ResponsesRequest struct {
	GenParams
	// Input is a string (one user message) or an array of ResponseInputItem.
	Input              json.RawMessage    `json:"input"`
	Instructions       *string            `json:"instructions"`
	Tools              []ResponseTool     `json:"tools"`
	ToolChoice         json.RawMessage    `json:"tool_choice"` // "auto" | "none" | "required" | {type: "function", name}
	ParallelToolCalls  *bool              `json:"parallel_tool_calls"`
	Text               *ResponseText      `json:"text"`
	Reasoning          *ResponseReasoning `json:"reasoning"`
	MaxOutputTokens    *int               `json:"max_output_tokens"`
	Store              *bool              `json:"store"`
	PreviousResponseID *string            `json:"previous_response_id"`
	Metadata           map[string]string  `json:"metadata"`
	// Include lists extra output to return; "reasoning.encrypted_content" returns each
	// reasoning item's text in a form the client sends back (store: false clients).
	Include []string `json:"include"`
	// PromptCacheKey (Codex sends its conversation id) is the PolyKV session when
	// session_id and x-session-id name none.
	PromptCacheKey *string `json:"prompt_cache_key"`
}

// ResponseInputItem is one item of a Responses input array, all item types in one
// struct: a message (type "message", or no type with a role), a function_call, a
// function_call_output or a reasoning item. The handler checks which members the
// type needs.
type ResponseInputItem struct {
	Type    string          `json:"type"`
	ID      string          `json:"id"`
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"` // message: a string or parts; reasoning: reasoning_text parts
	// function_call and function_call_output
	CallID    string          `json:"call_id"`
	Name      string          `json:"name"`
	Namespace string          `json:"namespace"` // a function of a namespace tool
	Arguments string          `json:"arguments"`
	Output    json.RawMessage `json:"output"` // a string or input_text parts
	// reasoning
	Summary          []ResponseInputPart `json:"summary"`
	EncryptedContent string              `json:"encrypted_content"`
}

// ResponseInputPart is one content part of an input item (input_text, output_text,
// reasoning_text, summary_text; only text parts are supported).
type ResponseInputPart struct {
	Type string  `json:"type"`
	Text *string `json:"text"`
}

// ResponseTool is one entry of tools: a function, or a namespace of functions (Tools);
// built-in tools (web_search, ...) are read for their type and left out of the prompt.
type ResponseTool struct {
	Type        string          `json:"type"`
	Name        string          `json:"name,omitempty"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
	Strict      *bool           `json:"strict,omitempty"`
	Tools       []ResponseTool  `json:"tools,omitempty"` // a namespace's functions
}

// ResponseText is the text member: the output's format.
type ResponseText struct {
	Format *ResponseTextFormat `json:"format,omitempty"`
}

// ResponseTextFormat is text.format: text, json_object or json_schema (with its name
// and schema inline, unlike chat's response_format).
type ResponseTextFormat struct {
	Type        string          `json:"type"`
	Name        string          `json:"name,omitempty"`
	Description string          `json:"description,omitempty"`
	Schema      json.RawMessage `json:"schema,omitempty"`
	Strict      *bool           `json:"strict,omitempty"`
}

// ResponseReasoning is the reasoning member; effort reaches the chat template as
// reasoning_effort.
type ResponseReasoning struct {
	Effort  *string `json:"effort,omitempty"`
	Summary *string `json:"summary,omitempty"`
}

// Response is a Responses API response object: the answer of POST /v1/responses and
// GET /v1/responses/{id}, and the payload of the lifecycle stream events. After
// OpenAI's members come PolyKV's (session_id, pool_id, context, timings), as on chat
// completions.
type Response struct {
	ID                 string               `json:"id"`
	Object             string               `json:"object"` // "response"
	CreatedAt          int64                `json:"created_at"`
	Status             string               `json:"status"` // in_progress | completed | incomplete | failed
	Error              *ResponseError       `json:"error"`
	IncompleteDetails  *IncompleteDetails   `json:"incomplete_details"`
	Instructions       *string              `json:"instructions"`
	MaxOutputTokens    *int                 `json:"max_output_tokens"`
	Metadata           map[string]string    `json:"metadata"`
	Model              string               `json:"model"`
	Output             []ResponseOutputItem `json:"output"`
	ParallelToolCalls  bool                 `json:"parallel_tool_calls"`
	PreviousResponseID *string              `json:"previous_response_id"`
	Reasoning          ResponseReasoning    `json:"reasoning"`
	Store              bool                 `json:"store"`
	Temperature        *float64             `json:"temperature"`
	Text               ResponseText         `json:"text"`
	ToolChoice         json.RawMessage      `json:"tool_choice"`
	Tools              []ResponseTool       `json:"tools"`
	TopP               *float64             `json:"top_p"`
	Truncation         string               `json:"truncation"`
	Usage              *ResponseUsage       `json:"usage"`
	// PolyKV's members: the chain's session and what it reused.
	SessionID string      `json:"session_id,omitempty"`
	PoolID    int         `json:"pool_id,omitempty"`
	Context   *SessionCtx `json:"context,omitempty"`
	Timings   *Timings    `json:"timings,omitempty"`
}

// ResponseError is a failed response's error.
type ResponseError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// IncompleteDetails says why a response is incomplete (max_output_tokens).
type IncompleteDetails struct {
	Reason string `json:"reason"`
}

// ResponseOutputItem is one item of a response's output: a *ResponseMessage, a
// *ResponseFunctionCall or a *ResponseReasoningItem.
type ResponseOutputItem interface {
	OutputType() string
}

// ResponseMessage is an assistant message output item.
type ResponseMessage struct {
	ID      string               `json:"id"`
	Type    string               `json:"type"` // "message"
	Status  string               `json:"status"`
	Role    string               `json:"role"`
	Content []ResponseOutputText `json:"content"`
}

// OutputType is "message".
func (*ResponseMessage) OutputType() string { return "message" }

// ResponseOutputText is a message's output_text part. Annotations and logprobs are
// always empty arrays: the SDK reads both.
type ResponseOutputText struct {
	Type        string `json:"type"` // "output_text"
	Text        string `json:"text"`
	Annotations []any  `json:"annotations"`
	Logprobs    []any  `json:"logprobs"`
}

// ResponseFunctionCall is a function_call output item: id names the item, call_id the
// call that a function_call_output answers.
type ResponseFunctionCall struct {
	ID        string `json:"id"`
	Type      string `json:"type"` // "function_call"
	Status    string `json:"status"`
	CallID    string `json:"call_id"`
	Name      string `json:"name"`
	Namespace string `json:"namespace,omitempty"` // the namespace tool the function belongs to
	Arguments string `json:"arguments"`
}

// OutputType is "function_call".
func (*ResponseFunctionCall) OutputType() string { return "function_call" }

// ResponseReasoningItem is a reasoning output item: the model's reasoning as
// reasoning_text content (open-weight models show it; there is no summary).
type ResponseReasoningItem struct {
	ID      string              `json:"id"`
	Type    string              `json:"type"` // "reasoning"
	Status  string              `json:"status"`
	Summary []ResponseInputPart `json:"summary"`
	Content []ResponseInputPart `json:"content"`
	// EncryptedContent, when the request's include asks for it, carries the reasoning
	// for a client that stores nothing on the server and sends it back next turn.
	EncryptedContent *string `json:"encrypted_content,omitempty"`
}

// OutputType is "reasoning".
func (*ResponseReasoningItem) OutputType() string { return "reasoning" }

// ResponseUsage is a response's token usage. input_tokens_details.cached_tokens are
// the input tokens reused from the KV cache: a chain continued by
// previous_response_id reuses its session's cells.
type ResponseUsage struct {
	InputTokens         int                 `json:"input_tokens"`
	InputTokensDetails  InputTokensDetails  `json:"input_tokens_details"`
	OutputTokens        int                 `json:"output_tokens"`
	OutputTokensDetails OutputTokensDetails `json:"output_tokens_details"`
	TotalTokens         int                 `json:"total_tokens"`
}

// InputTokensDetails is usage.input_tokens_details: cached_tokens were reused from the
// KV cache, cache_write_tokens prefilled into a session that keeps them for the next
// turn (0 when the response runs on no session).
type InputTokensDetails struct {
	CacheWriteTokens int `json:"cache_write_tokens"`
	CachedTokens     int `json:"cached_tokens"`
}

// OutputTokensDetails is usage.output_tokens_details.
type OutputTokensDetails struct {
	ReasoningTokens int `json:"reasoning_tokens"`
}

// ResponseEvent is one event of a streamed response; the SSE event name is its type.
// Members are set per type (pointers: present even when zero or empty, absent when
// the type has no such member), in the order OpenAI sends them.
type ResponseEvent struct {
	Type           string             `json:"type"`
	SequenceNumber int                `json:"sequence_number"`
	Response       *Response          `json:"response,omitempty"`
	OutputIndex    *int               `json:"output_index,omitempty"`
	ItemID         string             `json:"item_id,omitempty"`
	ContentIndex   *int               `json:"content_index,omitempty"`
	Item           ResponseOutputItem `json:"item,omitempty"`
	Part           any                `json:"part,omitempty"`
	Delta          *string            `json:"delta,omitempty"`
	Text           *string            `json:"text,omitempty"`
	Name           string             `json:"name,omitempty"`
	Arguments      *string            `json:"arguments,omitempty"`
	Logprobs       *[]any             `json:"logprobs,omitempty"`
}

// EventName is the SSE event name: the event's type.
func (e ResponseEvent) EventName() string { return e.Type }

// ResponseDeleted is DELETE /v1/responses/{id}.
type ResponseDeleted struct {
	ID      string `json:"id"`
	Object  string `json:"object"` // "response.deleted"
	Deleted bool   `json:"deleted"`
}
