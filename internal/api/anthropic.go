package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

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
	creq, ignored, e := messagesChat(req)
	if e != nil {
		writeAnthropicError(w, e)
		return
	}
	ignoredToolsHeader(w, ignored)
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
	creq, _, e := messagesChat(&req)
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
// naming the field. Server tools (a tool whose type names one of Anthropic's own, such
// as web_search_20250305) cannot run here: they are left out of the prompt and named in
// ignored, for the X-PolyKV-Ignored-Tools header.
func messagesChat(req *wire.MessagesRequest) (creq *wire.ChatRequest, ignored []string, e *apiError) {
	system, e := anthropicSystem(req.System)
	if e != nil {
		return nil, nil, e
	}
	if isNull(req.Messages) {
		return nil, nil, invalidParam("messages", "messages: Field required")
	}
	var msgs []wire.AnthropicMessage
	if err := json.Unmarshal(req.Messages, &msgs); err != nil || len(msgs) == 0 {
		return nil, nil, invalidParam("messages", "messages: expected a non-empty array of {role, content}")
	}
	keepFrom, e := thinkingKeptFrom(req.ContextManagement, msgs)
	if e != nil {
		return nil, nil, e
	}
	c := newConvo(nil, nil)
	for _, i := range hoistSystem(msgs) {
		if e := anthropicMessage(c, i, msgs[i], i >= keepFrom); e != nil {
			return nil, nil, e
		}
	}
	creq = &wire.ChatRequest{GenParams: req.GenParams, Messages: chatMessages(&system, c.msgs)}
	if req.StopSequences != nil {
		creq.Stop, _ = json.Marshal(req.StopSequences)
	}
	tools := make([]chatToolFunc, 0, len(req.Tools))
	for i, t := range req.Tools {
		if t.Type != "" && t.Type != "custom" {
			ignored = append(ignored, t.Type)
			continue
		}
		if !toolNameRE.MatchString(t.Name) {
			return nil, nil, invalidParam(fmt.Sprintf("tools.%d.name", i), "tools.%d.name: %q must be 1-64 letters, digits, _ or -", i, t.Name)
		}
		tools = append(tools, chatToolFunc{Name: t.Name, Description: t.Description, Parameters: t.InputSchema})
	}
	creq.Tools = chatTools(tools)
	if creq.ToolChoice, e = anthropicToolChoice(req.ToolChoice); e != nil {
		return nil, nil, e
	}
	if t := req.Thinking; t != nil {
		switch t.Type {
		case "enabled", "adaptive":
			creq.ChatTemplateKwargs = json.RawMessage(`{"enable_thinking": true}`)
		case "disabled":
			creq.ChatTemplateKwargs = json.RawMessage(`{"enable_thinking": false}`)
		default:
			return nil, nil, invalidParam("thinking.type", "thinking.type: %q is not one of enabled, adaptive, disabled", t.Type)
		}
	}
	if oc := req.OutputConfig; oc != nil && oc.Effort != "" {
		switch oc.Effort {
		case "low", "medium", "high":
			creq.ReasoningEffort = &oc.Effort
		case "max":
			high := "high" // the templates' highest effort
			creq.ReasoningEffort = &high
		default:
			return nil, nil, invalidParam("output_config.effort", "output_config.effort: %q is not one of low, medium, high, max", oc.Effort)
		}
	}
	if sid := claudeCodeSession(req.Metadata); creq.SessionID == nil && sid != "" {
		thread := threadSession(sid, system, c.msgs)
		creq.SessionID = &thread
	}
	return creq, ignored, nil
}

// hoistSystem is the order messages are rendered in: the system messages that come
// before the first assistant turn first (in their order), then the rest as sent. Claude
// Code sends its environment block (~2k tokens: working directory, deferred tools,
// agent types, skills) as a system message after the first user message, which holds
// the task: as sent, every session of a team re-prefills that block after its own task,
// though within one project it is the same for all of them. Ahead of the task it joins
// the prefix the team shares (measured by TestClaudeCodeTeamSharesPrefix). Nothing is
// dropped or reworded, and a later system message stays where it stands.
func hoistSystem(msgs []wire.AnthropicMessage) []int {
	order := make([]int, 0, len(msgs))
	first := len(msgs)
	for i, m := range msgs {
		if m.Role == "assistant" {
			first = i
			break
		}
	}
	for i := range first {
		if msgs[i].Role == "system" {
			order = append(order, i)
		}
	}
	for i := range msgs {
		if i >= first || msgs[i].Role != "system" {
			order = append(order, i)
		}
	}
	return order
}

// billingHeaderPrefix starts the system block Claude Code puts before everything else
// in every request ("x-anthropic-billing-header: cc_version=2.1.328.28b; cc_entrypoint=
// ..."). It is metadata for Anthropic's billing, not prompt, and its last part changes
// from run to run: kept, it would be the first tokens of every prompt and no two
// sessions would share more than the template's first few tokens (measured in
// TestAgentFixturesReplay; docs/api.md). It is dropped before rendering.
const billingHeaderPrefix = "x-anthropic-billing-header:"

// anthropicSystem joins the system member (a string or text blocks), leaving out
// Claude Code's billing header block.
func anthropicSystem(raw json.RawMessage) (string, *apiError) {
	var blocks []wire.AnthropicBlock
	if json.Unmarshal(raw, &blocks) == nil {
		var b strings.Builder
		for i, bl := range blocks {
			if bl.Type != "text" || bl.Text == nil {
				return "", invalidParam(fmt.Sprintf("system.%d.type", i), "system: expected a string or text blocks, got a block of type %q", bl.Type)
			}
			if strings.HasPrefix(*bl.Text, billingHeaderPrefix) {
				continue
			}
			b.WriteString(*bl.Text)
		}
		return b.String(), nil
	}
	system, bad, ok := textParts(raw, "text")
	if !ok {
		return "", invalidParam("system", "system: expected a string or text blocks, got a block of type %q", bad)
	}
	return system, nil
}

// thinkingKeptFrom reads context_management: with clear_thinking_20251015, the thinking
// blocks of all but the last keep assistant turns are left out of the prompt (keep: one
// turn when absent, "all", or {type: thinking_turns, value: N}). It returns the index of
// the first message whose thinking is kept. Other edit types are refused: clearing tool
// results needs token thresholds PolyKV does not implement, and ignoring the edit would
// send a prompt other than the one the client asked for.
func thinkingKeptFrom(cm *wire.AnthropicContextManagement, msgs []wire.AnthropicMessage) (int, *apiError) {
	if cm == nil {
		return 0, nil
	}
	from := 0
	for i, ed := range cm.Edits {
		field := fmt.Sprintf("context_management.edits.%d", i)
		if ed.Type != "clear_thinking_20251015" {
			return 0, invalidParam(field+".type", "%s.type: %q is not supported (clear_thinking_20251015 is)", field, ed.Type)
		}
		keep := 1
		var all string
		var turns struct {
			Type  string `json:"type"`
			Value *int   `json:"value"`
		}
		switch {
		case isNull(ed.Keep):
		case json.Unmarshal(ed.Keep, &all) == nil && all == "all":
			continue
		case json.Unmarshal(ed.Keep, &turns) == nil && turns.Type == "thinking_turns" && turns.Value != nil && *turns.Value >= 1:
			keep = *turns.Value
		default:
			return 0, invalidParam(field+".keep", `%s.keep: expected "all" or {"type": "thinking_turns", "value": N >= 1}`, field)
		}
		// Fewer assistant turns than kept: nothing is cleared.
		seen := 0
		for j := len(msgs) - 1; j >= 0; j-- {
			if msgs[j].Role == "assistant" {
				if seen++; seen == keep {
					from = max(from, j)
					break
				}
			}
		}
	}
	return from, nil
}

// claudeCodeSession is the session Claude Code names in metadata.user_id, a JSON string
// {"device_id": ..., "account_uuid": ..., "session_id": ...}: "" when there is none.
// Any other user_id is an opaque end-user id, not a session.
func claudeCodeSession(metadata json.RawMessage) string {
	var md struct {
		UserID string `json:"user_id"`
	}
	if json.Unmarshal(metadata, &md) != nil || md.UserID == "" {
		return ""
	}
	var id struct {
		SessionID string `json:"session_id"`
	}
	if json.Unmarshal([]byte(md.UserID), &id) != nil {
		return ""
	}
	return id.SessionID
}

// anthropicMessage adds one message: a user turn's tool_result blocks become tool
// messages (before its text), an assistant turn's thinking, text and tool_use blocks
// one assistant message.
func anthropicMessage(c *convo, i int, m wire.AnthropicMessage, keepThinking bool) *apiError {
	if m.Role == "system" {
		// Claude Code sends its environment block this way, after the first user
		// message. It stays a system message where it stands: the template renders it
		// there, or refuses the conversation (a 400 naming the template).
		text, bad, ok := textParts(m.Content, "text")
		if !ok {
			return invalidParam(fmt.Sprintf("messages.%d.content", i), "messages.%d.content: a system message takes a string or text blocks, got a block of type %q", i, bad)
		}
		c.say("system", text)
		return nil
	}
	if m.Role != "user" && m.Role != "assistant" {
		return invalidParam(fmt.Sprintf("messages.%d.role", i), "messages.%d.role: %q is not one of user, assistant, system", i, m.Role)
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
			if b.Thinking != nil && keepThinking {
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
