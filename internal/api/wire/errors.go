package wire

// ErrorBody is every error reply: {"error": {...}} with the HTTP status repeated in
// code. Streams send it as an event when a generation fails after the headers.
type ErrorBody struct {
	Error Error `json:"error"`
}

// Error is an error's detail (keys in alphabetical order). The optional members add
// context to some errors: param names the offending field (OpenAI's shape), n_ctx and
// n_prompt_tokens come with exceed_context_size_error (llama-server's), pool_id and
// capacity with pool_saturated_error.
type Error struct {
	Capacity      *Verdict `json:"capacity,omitempty"`
	Code          int      `json:"code"`
	Message       string   `json:"message"`
	NCtx          *int     `json:"n_ctx,omitempty"`
	NPromptTokens *int     `json:"n_prompt_tokens,omitempty"`
	Param         string   `json:"param,omitempty"`
	PoolID        *int     `json:"pool_id,omitempty"`
	Type          string   `json:"type"`
}
