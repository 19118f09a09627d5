package api

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/api/wire"
)

// messagesReq decodes a Messages body as the handler does.
func messagesReq(t *testing.T, body string) *wire.MessagesRequest {
	t.Helper()
	var req wire.MessagesRequest
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	return &req
}

// chatMsgsOf is a translated request's messages.
func chatMsgsOf(t *testing.T, creq *wire.ChatRequest) []chatTurnMsg {
	t.Helper()
	var out []chatTurnMsg
	if err := json.Unmarshal(creq.Messages, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// Claude Code's first system block changes from run to run: two sessions that differ
// only there must render the same messages (and so share their prefix).
func TestMessagesBillingHeaderDropped(t *testing.T) {
	var got [2]string
	for i, hdr := range []string{"cc_version=2.1.328.28b", "cc_version=2.1.328.e01"} {
		req := messagesReq(t, `{"max_tokens": 8, "system": [{"type": "text", "text": "x-anthropic-billing-header: `+hdr+`; cc_entrypoint=sdk-cli;"},
			{"type": "text", "text": "You are an agent."}, {"type": "text", "text": "\nBe brief."}], "messages": [{"role": "user", "content": "hi"}]}`)
		creq, _, e := messagesChat(req)
		if e != nil {
			t.Fatal(e.msg)
		}
		got[i] = string(creq.Messages)
	}
	if got[0] != got[1] {
		t.Fatalf("the billing header reached the prompt:\n%s\n%s", got[0], got[1])
	}
	if strings.Contains(got[0], "billing") || !strings.Contains(got[0], `"You are an agent.\nBe brief."`) {
		t.Fatalf("system: %s", got[0])
	}
}

// A system message inside messages stays a system message, ahead of the task; the
// session comes from metadata.user_id; adaptive thinking turns the reasoning switch on
// and effort max reads as high.
func TestMessagesClaudeCodeFields(t *testing.T) {
	req := messagesReq(t, `{"max_tokens": 32000, "system": "S", "messages": [{"role": "user", "content": "reminder"},
		{"role": "system", "content": [{"type": "text", "text": "# Environment"}]}, {"role": "user", "content": "task"}],
		"thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "max"},
		"metadata": {"user_id": "{\"device_id\":\"d\",\"account_uuid\":\"\",\"session_id\":\"s-1\"}"}}`)
	creq, _, e := messagesChat(req)
	if e != nil {
		t.Fatal(e.msg)
	}
	msgs := chatMsgsOf(t, creq)
	roles := ""
	for _, m := range msgs {
		roles += m.Role + " "
	}
	// The system message before the first assistant turn is rendered ahead of the
	// first user message (hoistSystem), so a team's shared prefix runs through it.
	if roles != "system system user user " || *msgs[1].Content != "# Environment" {
		t.Fatalf("messages: %s", creq.Messages)
	}
	if creq.SessionID == nil || !strings.HasPrefix(*creq.SessionID, "s-1/") {
		t.Fatalf("session: %v", creq.SessionID)
	}
	if string(creq.ChatTemplateKwargs) != `{"enable_thinking": true}` || creq.ReasoningEffort == nil || *creq.ReasoningEffort != "high" {
		t.Fatalf("thinking %s, effort %v", creq.ChatTemplateKwargs, creq.ReasoningEffort)
	}
	// The body's session_id wins over metadata; a user_id that is not Claude Code's JSON
	// names no session.
	req = messagesReq(t, `{"max_tokens": 8, "session_id": "mine", "messages": [{"role": "user", "content": "x"}],
		"metadata": {"user_id": "{\"session_id\":\"s-1\"}"}}`)
	if creq, _, _ = messagesChat(req); *creq.SessionID != "mine" {
		t.Fatalf("session: %v", *creq.SessionID)
	}
	req = messagesReq(t, `{"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": "user-42"}}`)
	if creq, _, _ = messagesChat(req); creq.SessionID != nil {
		t.Fatalf("session from an opaque user_id: %v", *creq.SessionID)
	}
}

// clear_thinking_20251015 keeps the thinking of the last keep assistant turns only;
// keep "all" keeps every turn's.
func TestMessagesClearThinking(t *testing.T) {
	turns := `[{"role": "user", "content": "a"},
		{"role": "assistant", "content": [{"type": "thinking", "thinking": "T1", "signature": ""}, {"type": "text", "text": "A1"}]},
		{"role": "user", "content": "b"},
		{"role": "assistant", "content": [{"type": "thinking", "thinking": "T2", "signature": ""}, {"type": "text", "text": "A2"}]},
		{"role": "user", "content": "c"},
		{"role": "assistant", "content": [{"type": "thinking", "thinking": "T3", "signature": ""}, {"type": "text", "text": "A3"}]},
		{"role": "user", "content": "d"}]`
	for _, tc := range []struct{ cm, want string }{
		{`null`, "T1 T2 T3 "},
		{`{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}`, "T1 T2 T3 "},
		{`{"edits": [{"type": "clear_thinking_20251015"}]}`, "- - T3 "},
		{`{"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}]}`, "- T2 T3 "},
		{`{"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 5}}]}`, "T1 T2 T3 "},
	} {
		creq, _, e := messagesChat(messagesReq(t, `{"max_tokens": 8, "messages": `+turns+`, "context_management": `+tc.cm+`}`))
		if e != nil {
			t.Fatal(e.msg)
		}
		got := ""
		for _, m := range chatMsgsOf(t, creq) {
			if m.Role == "assistant" {
				if m.ReasoningContent == "" {
					got += "- "
				} else {
					got += m.ReasoningContent + " "
				}
			}
		}
		if got != tc.want {
			t.Errorf("context_management %s: kept %q, want %q", tc.cm, got, tc.want)
		}
	}
	_, _, e := messagesChat(messagesReq(t, `{"max_tokens": 8, "messages": `+turns+`, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]}}`))
	if e == nil || e.status != 400 || !strings.Contains(e.msg, "keep") {
		t.Fatalf("keep 0: %+v", e)
	}
}

// Codex's tools: a namespace's functions are flattened beside the function tools (with
// namespace__name where a name is taken twice) and calls map back to the namespace and
// name the client declared; built-in tools are left out and named.
func TestResponsesToolsFlattened(t *testing.T) {
	var tools []wire.ResponseTool
	if err := json.Unmarshal([]byte(`[{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
		{"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
			{"type": "function", "name": "spawn_agent", "description": "Spawn one.", "parameters": {"type": "object"}},
			{"type": "function", "name": "exec_command", "parameters": {"type": "object"}}]},
		{"type": "web_search", "external_web_access": false}]`), &tools); err != nil {
		t.Fatal(err)
	}
	set, e := responseTools(tools)
	if e != nil {
		t.Fatal(e.msg)
	}
	var names []string
	for _, f := range set.chat {
		names = append(names, f.Name)
	}
	if strings.Join(names, " ") != "exec_command spawn_agent multi_agent_v1__exec_command" || set.chat[1].Description != "Sub-agents. Spawn one." {
		t.Fatalf("tools for the model: %v %+v", names, set.chat)
	}
	if strings.Join(set.ignored, ",") != "web_search" {
		t.Fatalf("ignored: %v", set.ignored)
	}
	for _, tc := range []struct{ model, ns, name string }{
		{"spawn_agent", "multi_agent_v1", "spawn_agent"}, {"multi_agent_v1__exec_command", "multi_agent_v1", "exec_command"}, {"exec_command", "", "exec_command"},
	} {
		if ns, name := set.clientName(tc.model); ns != tc.ns || name != tc.name {
			t.Errorf("%s -> %s/%s", tc.model, ns, name)
		}
		if got := set.modelName(tc.ns, tc.name); got != tc.model {
			t.Errorf("%s/%s -> %s", tc.ns, tc.name, got)
		}
	}
}

// encrypted_content round-trips the reasoning, and only PolyKV's own is read.
func TestReasoningSeal(t *testing.T) {
	text := "first <b>think</b>\nthen act"
	got, ok := openReasoning(sealReasoning(text))
	if !ok || got != text {
		t.Fatalf("round trip: %q %v", got, ok)
	}
	for _, bad := range []string{"gAAAAABn", reasoningSeal + "!!!", ""} {
		if _, ok := openReasoning(bad); ok {
			t.Errorf("read %q", bad)
		}
	}
}

// One Claude Code session_id, three threads: the main agent's next turn continues its
// own PolyKV session; a sub-agent (another system prompt and task) and a side request
// (same system, another first message) each get their own, so none waits for another's
// sequence or cuts its KV.
func TestMessagesThreadSessions(t *testing.T) {
	md := `"metadata": {"user_id": "{\"session_id\":\"cc-1\"}"}`
	session := func(body string) string {
		creq, _, e := messagesChat(messagesReq(t, body))
		if e != nil {
			t.Fatal(e.msg)
		}
		return *creq.SessionID
	}
	turn1 := session(`{"max_tokens": 8, "system": "main", "messages": [{"role": "user", "content": "fix the bug"}], ` + md + `}`)
	turn2 := session(`{"max_tokens": 8, "system": "main", "messages": [{"role": "user", "content": "fix the bug"},
		{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]},
		{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.go"}]}], ` + md + `}`)
	sub := session(`{"max_tokens": 8, "system": "explore agent", "messages": [{"role": "user", "content": "find the bug"}], ` + md + `}`)
	side := session(`{"max_tokens": 8, "system": "main", "messages": [{"role": "user", "content": "write a title"}], ` + md + `}`)
	if turn1 != turn2 || !strings.HasPrefix(turn1, "cc-1/") {
		t.Fatalf("the main thread's turns: %s then %s", turn1, turn2)
	}
	if sub == turn1 || side == turn1 || sub == side {
		t.Fatalf("threads share a session: main %s, sub-agent %s, side %s", turn1, sub, side)
	}
}

// max_tokens: --n-predict when the request names none, the request's own otherwise,
// capped at the context (Claude Code asks for 32,000 whatever the server's context).
func TestMaxTokensDefaultAndCap(t *testing.T) {
	s := &Server{info: Info{NCtx: 100, NPredict: 5}}
	for _, tc := range []struct {
		g    wire.GenParams
		want int
	}{
		{wire.GenParams{}, 5},
		{wire.GenParams{MaxTokens: ptr(7)}, 7},
		{wire.GenParams{MaxTokens: ptr(32000)}, 100},
		{wire.GenParams{MaxCompletionTokens: ptr(-1)}, 0},
	} {
		if n, e := s.maxTokens(&tc.g); e != nil || n != tc.want {
			t.Errorf("%+v: %d %v, want %d", tc.g, n, e, tc.want)
		}
	}
	if _, e := s.maxTokens(&wire.GenParams{MaxTokens: ptr(0)}); e == nil || e.status != 400 {
		t.Fatalf("max_tokens 0: %+v", e)
	}
}
