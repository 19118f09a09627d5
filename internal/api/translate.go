package api

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"net/http"
	"strings"

	"github.com/polykv/polykv/internal/api/wire"
)

// The Responses and Messages routes are translations onto chat completions: each
// builds a wire.ChatRequest (messages, tools, tool_choice, response_format, template
// options) and hands it to submitChat, so a conversation renders, constrains and
// parses exactly as it would on /v1/chat/completions. convo is their shared
// conversation builder.

// chatTurnMsg is a chat-completions message as the translations write it: only the
// members a chat client sends (the template sees each key that is present), so the
// template sees what it would for the same conversation sent as chat.
type chatTurnMsg struct {
	Role             string          `json:"role"`
	Content          *string         `json:"content"` // null: an assistant turn that only calls tools
	ReasoningContent string          `json:"reasoning_content,omitempty"`
	ToolCalls        []wire.ToolCall `json:"tool_calls,omitempty"`
	ToolCallID       string          `json:"tool_call_id,omitempty"`
	Name             string          `json:"name,omitempty"`
}

// convo builds a chat conversation from another API's turns: reasoning waits for the
// assistant turn it belongs to, calls join the assistant turn they follow, and a tool
// result must answer a call made earlier in the conversation.
type convo struct {
	msgs      []chatTurnMsg
	calls     map[string]string // call id -> function name
	reasoning strings.Builder   // reasoning not yet given to an assistant turn
}

func newConvo(history []chatTurnMsg, calls map[string]string) *convo {
	c := &convo{msgs: append([]chatTurnMsg(nil), history...), calls: map[string]string{}}
	for id, name := range calls {
		c.calls[id] = name
	}
	return c
}

// say adds a user, system or developer message, or assistant text (which joins an
// assistant turn just before it).
func (c *convo) say(role, text string) {
	if role != "assistant" {
		c.msgs = append(c.msgs, chatTurnMsg{Role: role, Content: &text})
		return
	}
	m := c.assistant()
	if m.Content == nil {
		m.Content = &text
	} else {
		joined := *m.Content + text
		m.Content = &joined
	}
}

// think keeps reasoning for the next assistant turn.
func (c *convo) think(text string) { c.reasoning.WriteString(text) }

// call adds a tool call to the current assistant turn.
func (c *convo) call(id, name, args string) {
	m := c.assistant()
	m.ToolCalls = append(m.ToolCalls, wire.ToolCall{ID: id, Type: "function", Function: wire.ToolCallFunction{Name: name, Arguments: args}})
	c.calls[id] = name
}

// result adds a tool's result; false when no earlier call has that id.
func (c *convo) result(id, text string) bool {
	name, ok := c.calls[id]
	if !ok {
		return false
	}
	c.msgs = append(c.msgs, chatTurnMsg{Role: "tool", Content: &text, ToolCallID: id, Name: name})
	return true
}

// assistant is the assistant turn being written: the last message when it is one,
// else a new one (content null until text comes), with any reasoning waiting for it.
func (c *convo) assistant() *chatTurnMsg {
	if n := len(c.msgs); n == 0 || c.msgs[n-1].Role != "assistant" {
		c.msgs = append(c.msgs, chatTurnMsg{Role: "assistant"})
	}
	m := &c.msgs[len(c.msgs)-1]
	if c.reasoning.Len() > 0 {
		m.ReasoningContent += c.reasoning.String()
		c.reasoning.Reset()
	}
	return m
}

// chatMessages is the conversation as a chat request's messages, after system (when
// not empty).
func chatMessages(system *string, msgs []chatTurnMsg) json.RawMessage {
	all := msgs
	if system != nil && *system != "" {
		all = append([]chatTurnMsg{{Role: "system", Content: system}}, msgs...)
	}
	b, _ := json.Marshal(nonNil(all))
	return b
}

// chatTools is a tool list in chat's shape ({type, function: {name, description,
// parameters}}), for planTools and the template.
func chatTools(tools []chatToolFunc) json.RawMessage {
	if len(tools) == 0 {
		return nil
	}
	type tool struct {
		Type     string       `json:"type"`
		Function chatToolFunc `json:"function"`
	}
	out := make([]tool, len(tools))
	for i, t := range tools {
		out[i] = tool{Type: "function", Function: t}
	}
	b, _ := json.Marshal(out)
	return b
}

// chatToolFunc is a function tool's description in chat's shape.
type chatToolFunc struct {
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
}

// namedChoice is chat's tool_choice naming one function.
func namedChoice(name string) json.RawMessage {
	var c wire.ToolChoiceFunction
	c.Type, c.Function.Name = "function", name
	b, _ := json.Marshal(c)
	return b
}

// textParts joins a string or an array of text parts of the given types (the
// Responses and Messages shapes of message content). ok is false for anything else;
// bad names the first part that is not text.
func textParts(raw json.RawMessage, types ...string) (text string, bad string, ok bool) {
	if isNull(raw) {
		return "", "", true
	}
	if json.Unmarshal(raw, &text) == nil {
		return text, "", true
	}
	var parts []wire.ResponseInputPart
	if json.Unmarshal(raw, &parts) != nil {
		return "", "", false
	}
	var b strings.Builder
	for _, p := range parts {
		if !contains(types, p.Type) || p.Text == nil {
			return "", p.Type, false
		}
		b.WriteString(*p.Text)
	}
	return b.String(), "", true
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// IgnoredToolsHeader names the built-in tools of a Messages or Responses request that
// the server cannot run (web_search, computer use, ...): they are left out of the prompt
// and named here, rather than the request refused, so a client that offers them still
// works with the tools it runs itself.
const IgnoredToolsHeader = "X-PolyKV-Ignored-Tools"

// ignoredToolsHeader sets IgnoredToolsHeader when some tools were left out.
func ignoredToolsHeader(w http.ResponseWriter, ignored []string) {
	if len(ignored) > 0 {
		w.Header().Set(IgnoredToolsHeader, strings.Join(ignored, ", "))
	}
}

// threadSession is the PolyKV session of one conversation thread of a client's session.
// Claude Code names one session_id (Codex one prompt_cache_key) for its main agent, its
// sub-agents and its side requests, and several of them run at once; a PolyKV session
// holds one sequence, so as one session they would wait for each other and each would
// cut the others' KV down to their common prefix. A thread is known by how it starts:
// the system text and the messages before its first assistant turn (a growing
// conversation keeps them; a sub-agent's task differs from its parent's even where, as
// in Codex, their first user message, the environment, is the same). So each turn of a
// thread continues on its own session while the threads share their common prefix
// (system prompt, tools, environment) through the prefix cache.
func threadSession(client, system string, msgs []chatTurnMsg) string {
	h := fnv.New64a()
	h.Write([]byte(system))
	for _, m := range msgs {
		if m.Role == "assistant" {
			break
		}
		b, _ := json.Marshal(m)
		h.Write(b)
	}
	return fmt.Sprintf("%s/%016x", client, h.Sum64())
}
