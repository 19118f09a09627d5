package api

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/polykv/polykv/internal/api/wire"
)

// Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens),
// translated onto chat completions (translate.go): system and messages with text,
// thinking, tool_use and tool_result blocks become chat messages, tools and
// tool_choice chat's, stop_sequences stop strings. Errors answer in Anthropic's shape.

func (s *Server) handleMessages(w http.ResponseWriter, r *http.Request) {
	req, ok := decodeGen[wire.MessagesRequest](s, w, r, writeAnthropicError)
	if !ok {
		return
	}
	if req.MaxTokens == nil {
		writeAnthropicError(w, invalidParam("max_tokens", "max_tokens: Field required"))
		return
	}
	creq, e := messagesChat(req)
	if e != nil {
		writeAnthropicError(w, e)
		return
	}
	s.submitChat(w, r, creq, generation{k: kindChat, id: newID("msg_"), shape: &anthropicShape{s: s}})
}

// handleCountTokens answers how many tokens the request's prompt is, rendered as
// /v1/messages would render it (nothing is generated).
func (s *Server) handleCountTokens(w http.ResponseWriter, r *http.Request) {
	var req wire.MessagesRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		writeAnthropicError(w, e)
		return
	}
	creq, e := messagesChat(&req)
	if e != nil {
		writeAnthropicError(w, e)
		return
	}
	toks, _, e := s.chatPrompt(creq)
	if e != nil {
		writeAnthropicError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, wire.TokenCount{InputTokens: len(toks)})
}

// messagesChat translates a Messages request into a chat request. Errors are 400s
// naming the field.
func messagesChat(req *wire.MessagesRequest) (*wire.ChatRequest, *apiError) {
	system, bad, ok := textParts(req.System, "text")
	if !ok {
		return nil, invalidParam("system", "system: expected a string or text blocks, got a block of type %q", bad)
	}
	if isNull(req.Messages) {
		return nil, invalidParam("messages", "messages: Field required")
	}
	var msgs []wire.AnthropicMessage
	if err := json.Unmarshal(req.Messages, &msgs); err != nil || len(msgs) == 0 {
		return nil, invalidParam("messages", "messages: expected a non-empty array of {role, content}")
	}
	c := newConvo(nil, nil)
	for i, m := range msgs {
		if e := anthropicMessage(c, i, m); e != nil {
			return nil, e
		}
	}
	creq := &wire.ChatRequest{GenParams: req.GenParams, Messages: chatMessages(&system, c.msgs)}
	if req.StopSequences != nil {
		creq.Stop, _ = json.Marshal(req.StopSequences)
	}
	tools := make([]chatToolFunc, len(req.Tools))
	for i, t := range req.Tools {
		if t.Type != "" && t.Type != "custom" {
			return nil, invalidParam(fmt.Sprintf("tools.%d.type", i), "tools.%d: server tool %q is not supported (client tools only)", i, t.Type)
		}
		if !toolNameRE.MatchString(t.Name) {
			return nil, invalidParam(fmt.Sprintf("tools.%d.name", i), "tools.%d.name: %q must be 1-64 letters, digits, _ or -", i, t.Name)
		}
		tools[i] = chatToolFunc{Name: t.Name, Description: t.Description, Parameters: t.InputSchema}
	}
	creq.Tools = chatTools(tools)
	var e *apiError
	if creq.ToolChoice, e = anthropicToolChoice(req.ToolChoice); e != nil {
		return nil, e
	}
	if t := req.Thinking; t != nil {
		switch t.Type {
		case "enabled":
			creq.ChatTemplateKwargs = json.RawMessage(`{"enable_thinking": true}`)
		case "disabled":
			creq.ChatTemplateKwargs = json.RawMessage(`{"enable_thinking": false}`)
		default:
			return nil, invalidParam("thinking.type", "thinking.type: %q is not one of enabled, disabled", t.Type)
		}
	}
	return creq, nil
}

// anthropicMessage adds one message: a user turn's tool_result blocks become tool
// messages (before its text), an assistant turn's thinking, text and tool_use blocks
// one assistant message.
func anthropicMessage(c *convo, i int, m wire.AnthropicMessage) *apiError {
	if m.Role != "user" && m.Role != "assistant" {
		return invalidParam(fmt.Sprintf("messages.%d.role", i), "messages.%d.role: %q is not one of user, assistant", i, m.Role)
	}
	var text string
	if json.Unmarshal(m.Content, &text) == nil {
		c.say(m.Role, text)
		return nil
	}
	var blocks []wire.AnthropicBlock
	if err := json.Unmarshal(m.Content, &blocks); err != nil {
		return invalidParam(fmt.Sprintf("messages.%d.content", i), "messages.%d.content: expected a string or an array of content blocks", i)
	}
	var said []string
	for j, b := range blocks {
		field := fmt.Sprintf("messages.%d.content.%d", i, j)
		switch {
		case b.Type == "text" && b.Text != nil:
			said = append(said, *b.Text)
		case b.Type == "thinking" && m.Role == "assistant":
			if b.Thinking != nil {
				c.think(*b.Thinking)
			}
		case b.Type == "redacted_thinking" && m.Role == "assistant":
		case b.Type == "tool_use" && m.Role == "assistant":
			if b.ID == "" || !toolNameRE.MatchString(b.Name) {
				return invalidParam(field, "%s: a tool_use block needs an id and a valid name", field)
			}
			args := string(b.Input)
			if isNull(b.Input) {
				args = "{}"
			}
			c.say("assistant", joinText(said))
			said = nil
			c.call(b.ID, b.Name, args)
		case b.Type == "tool_result" && m.Role == "user":
			out, bad, ok := textParts(b.Content, "text")
			if !ok {
				return invalidParam(field+".content", "%s.content: expected a string or text blocks, got a block of type %q", field, bad)
			}
			if !c.result(b.ToolUseID, out) {
				return invalidParam(field+".tool_use_id", "%s.tool_use_id: unexpected `tool_use_id` found in `tool_result` blocks: %s. Each `tool_result` block must have a corresponding `tool_use` block in a previous message.", field, b.ToolUseID)
			}
		default:
			return invalidParam(field+".type", "%s.type: block type %q is not supported in a %s message", field, b.Type, m.Role)
		}
	}
	if len(said) > 0 || m.Role == "user" && len(blocks) == 0 {
		c.say(m.Role, joinText(said))
	} else if m.Role == "assistant" {
		c.assistant() // thinking alone still makes the turn
	}
	return nil
}

func joinText(parts []string) string {
	out := ""
	for _, p := range parts {
		out += p
	}
	return out
}

// anthropicToolChoice converts tool_choice: auto, any (chat's required), tool (a named
// function) and none.
func anthropicToolChoice(raw json.RawMessage) (json.RawMessage, *apiError) {
	if isNull(raw) {
		return nil, nil
	}
	var tc wire.AnthropicToolChoice
	if err := json.Unmarshal(raw, &tc); err != nil {
		return nil, invalidParam("tool_choice", "tool_choice: expected an object {type: auto | any | tool | none}")
	}
	switch tc.Type {
	case "auto", "none":
		return json.RawMessage(`"` + tc.Type + `"`), nil
	case "any":
		return json.RawMessage(`"required"`), nil
	case "tool":
		if tc.Name == "" {
			return nil, invalidParam("tool_choice.name", "tool_choice.name: Field required")
		}
		return namedChoice(tc.Name), nil
	}
	return nil, invalidParam("tool_choice.type", "tool_choice.type: %q is not one of auto, any, tool, none", tc.Type)
}

// anthropicErrorTypes maps PolyKV's error types to Anthropic's.
var anthropicErrorTypes = map[int]string{
	http.StatusBadRequest: "invalid_request_error", http.StatusUnauthorized: "authentication_error",
	http.StatusNotFound: "not_found_error", http.StatusRequestEntityTooLarge: "request_too_large",
	http.StatusTooManyRequests: "rate_limit_error", http.StatusServiceUnavailable: "overloaded_error",
	http.StatusConflict: "invalid_request_error", http.StatusMethodNotAllowed: "invalid_request_error",
}

// anthropicError is e in Anthropic's error shape.
func anthropicError(e *apiError) wire.AnthropicError {
	typ, ok := anthropicErrorTypes[e.status]
	if !ok {
		typ = "api_error"
	}
	return wire.AnthropicError{Type: "error", Error: wire.AnthropicErrorDet{Type: typ, Message: e.msg}}
}

// writeAnthropicError answers e in Anthropic's shape, with its status and headers.
func writeAnthropicError(w http.ResponseWriter, e *apiError) {
	for k, v := range e.headers {
		w.Header().Set(k, v)
	}
	writeJSON(w, e.status, anthropicError(e))
}
