package app

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// claudeCodeBody is Claude Code's first request (internal/api/testdata/agents, recorded
// from the CLI pinned in scripts/agents) as another session of it would send it: its
// billing header, session and working directory are the session's own. Replies are
// greedy and short, so the test measures what the prompt costs.
func claudeCodeBody(t *testing.T, session, billing, cwd, task string) map[string]any {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "api", "testdata", "agents", "claude-code", "01.json"))
	if err != nil {
		t.Fatal(err)
	}
	var v map[string]any
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	sys := v["system"].([]any)
	sys[0].(map[string]any)["text"] = "x-anthropic-billing-header: cc_version=2.1.328." + billing + "; cc_entrypoint=sdk-cli;"
	v["metadata"] = map[string]any{"user_id": `{"device_id":"d","account_uuid":"","session_id":"` + session + `"}`}
	for _, m := range v["messages"].([]any) {
		msg := m.(map[string]any)
		b, _ := json.Marshal(msg["content"]) // a string or text blocks
		text := strings.ReplaceAll(string(b), "/tmp/TestClaudeCodeToolRoundTrip", cwd)
		text = strings.ReplaceAll(text, "Which files are in this directory? Use a tool to look.", task)
		var c any
		if err := json.Unmarshal([]byte(text), &c); err != nil {
			t.Fatal(err)
		}
		msg["content"] = c
	}
	v["stream"], v["max_tokens"], v["temperature"] = false, 8, 0
	return v
}

// usage reads a Messages reply's token accounting.
type usage struct {
	input, cached, prefilled, reused int
	promptMs                         float64
	text                             string
}

func messagesUsage(t *testing.T, base string, body map[string]any) usage {
	t.Helper()
	code, out := post(t, base+"/v1/messages", body)
	if code != 200 {
		t.Fatalf("%d %v", code, out)
	}
	u := out["usage"].(map[string]any)
	tm := out["timings"].(map[string]any)
	var text strings.Builder
	for _, b := range out["content"].([]any) {
		if s, ok := b.(map[string]any)["text"].(string); ok {
			text.WriteString(s)
		}
	}
	return usage{input: int(u["input_tokens"].(float64)), cached: int(u["cache_read_input_tokens"].(float64)),
		prefilled: int(tm["prompt_n"].(float64)), reused: int(tm["cache_n"].(float64)), promptMs: tm["prompt_ms"].(float64), text: text.String()}
}

// A team of Claude Code sessions on one server (issue 53): a second session in the same
// project with another task, whose billing header and session differ, starts from the
// first's cells for the system prompt, the tools and the environment block (at most 5%
// of that prefix prefilled), its reported cached tokens are exactly what the engine
// reused, and its greedy reply is the one the same request gets fully prefilled on a
// fresh server. Gemma 3 270M at -c 32768: Claude Code's tools rendered as PolyKV
// describes them (the Gemma template cannot show tools) are ~10k tokens, over SmolLM2's
// 8k training context.
func TestClaudeCodeTeamSharesPrefix(t *testing.T) {
	cfg := Config{ModelPath: gemmaPath(t), ChatTemplate: "gemma", NCtx: 32768, Parallel: 2}
	_, base := startServer(t, cfg)
	a := messagesUsage(t, base, claudeCodeBody(t, "session-a", "28b", "/work/team", "Which files are in this directory? Use a tool to look."))
	bBody := claudeCodeBody(t, "session-b", "e01", "/work/team", "Find where the server reads its flags and list them.")
	b := messagesUsage(t, base, bBody)
	// The prefix the sessions share: the system prompt, the tools and the environment
	// block, up to the first user message (the same request with a one-word user
	// message, less that message).
	prefixBody := claudeCodeBody(t, "session-p", "000", "/work/team", "x")
	var env any
	for _, m := range prefixBody["messages"].([]any) {
		if m.(map[string]any)["role"] == "system" {
			env = m
		}
	}
	prefixBody["messages"] = []any{env, map[string]any{"role": "user", "content": "x"}}
	code, out := post(t, base+"/v1/messages/count_tokens", prefixBody)
	if code != 200 {
		t.Fatalf("count_tokens: %d %v", code, out)
	}
	shared := int(out["input_tokens"].(float64)) - 8 // the turn's markup and "x"
	_, out = post(t, base+"/v1/messages/count_tokens", bBody)
	total := int(out["input_tokens"].(float64))
	t.Logf("session a: %d tokens, %d cached, prompt %.0f ms; session b: %d tokens, %d cached, %d prefilled, prompt %.0f ms (%.3fx); shared system+tools prefix %d tokens",
		a.input+a.cached, a.cached, a.promptMs, b.input+b.cached, b.cached, b.input, b.promptMs, b.promptMs/a.promptMs, shared)
	if a.cached != 0 || b.input+b.cached != total {
		t.Fatalf("token accounting: a %+v, b %+v, count_tokens %d", a, b, total)
	}
	if b.input != b.prefilled || b.cached != b.reused {
		t.Fatalf("reported usage is not what the engine did: input %d prefilled %d, cached %d reused %d", b.input, b.prefilled, b.cached, b.reused)
	}
	if b.cached < shared*95/100 {
		t.Fatalf("the second session reused %d tokens of the %d-token shared prefix (want >= 95%%)", b.cached, shared)

	}
	// The same request, fully prefilled on a fresh server: the same greedy reply.
	_, fresh := startServer(t, cfg)
	cold := messagesUsage(t, fresh, bBody)
	if cold.cached != 0 || cold.text != b.text {
		t.Fatalf("shared prefix changed the reply: %q, fully prefilled %q (cached %d)", b.text, cold.text, cold.cached)
	}
}
