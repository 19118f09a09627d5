package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/api"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
	"github.com/polykv/polykv/internal/testmodel"
)

// The agent CLIs people run, unmodified and headless, against the API over a model
// played by the fake backend: the first turn calls the client's shell tool, the client
// runs it (ls in a directory holding a marker file), and the turn that carries the
// tool's result gets a reply naming what the result held. So the test sees every
// request the client sends answered, the client's tool round trip, and the client
// exiting 0 with the reply, the same on every run (a real tiny model does not call
// tools reliably; internal/app's agent tests run the real model on these requests).
// The CLIs are the versions pinned in scripts/agents (make agents). Each request body
// is written to $POLYKV_AGENTS_FIXTURES/<client>/ when that is set, which is how the
// fixtures in testdata/agents were made.

// marker is the file the tool lists: it reaches the model only through a tool result.
const marker = "polykv-marker-7f3a.txt"

// agentCLI is the path of an installed agent CLI, or the test skips (fails under make
// test, which installs them).
func agentCLI(t *testing.T, name string) string {
	t.Helper()
	dir := os.Getenv("POLYKV_AGENTS")
	if dir == "" {
		dir = filepath.Join(testmodel.Cache(), "agents")
	}
	p := filepath.Join(dir, "node_modules", ".bin", name)
	if _, err := os.Stat(p); err != nil {
		testmodel.SkipOrFail(t, fmt.Sprintf("agent CLI %s not installed in %s (make agents)", name, dir))
	}
	return p
}

// exchange is one request a client sent and the status it got.
type exchange struct {
	method, path string
	status       int
	body         []byte
}

// exchangeLog serves h and keeps every exchange.
type exchangeLog struct {
	h    http.Handler
	mu   sync.Mutex
	seen []exchange
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(s int) { w.status = s; w.ResponseWriter.WriteHeader(s) }
func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (rec *exchangeLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytes.NewReader(body))
	sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
	rec.h.ServeHTTP(sw, r)
	rec.mu.Lock()
	rec.seen = append(rec.seen, exchange{method: r.Method, path: r.URL.Path, status: sw.status, body: body})
	rec.mu.Unlock()
}

func (rec *exchangeLog) exchanges() []exchange {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]exchange(nil), rec.seen...)
}

// serveScripted serves the API over a fake model that answers by pick, recording every
// exchange. The context holds the CLIs' prompts in the fake's byte tokens.
func serveScripted(t *testing.T, pick func(prompt string) []engine.Token) (string, *exchangeLog) {
	t.Helper()
	cfg := engine.Config{NCtx: 262144, Parallel: 4, MaxPools: 2, NBatch: 8192, MaxQueue: 16, BytesPerCell: 1024, PrefixCache: true}
	sched, err := engine.NewScheduler(cfg, enginetest.Vocab{})
	if err != nil {
		t.Fatal(err)
	}
	eng := engine.New(sched, enginetest.NewBackendFunc(pick), nil)
	srv := api.New(eng, enginetest.Vocab{}, renderer{}, api.Info{ModelID: "fake", NCtx: cfg.NCtx, Parallel: cfg.Parallel,
		NBatch: cfg.NBatch, NVocab: enginetest.NVocab, MaxPools: cfg.MaxPools, BytesPerCell: cfg.BytesPerCell}, nil, nil)
	rec := &exchangeLog{h: srv.Handler()}
	ts := httptest.NewServer(rec)
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	return ts.URL, rec
}

// toolThenAnswer plays a model that calls call until a tool result holding the marker
// is in the prompt, then says so.
func toolThenAnswer(call string) func(string) []engine.Token {
	return func(prompt string) []engine.Token {
		if strings.Contains(prompt, marker) {
			return append(enginetest.Bytes("DONE: the directory holds "+marker+"."), enginetest.EOG)
		}
		return append(enginetest.Bytes("<tool_call>"+call+"</tool_call>"), enginetest.EOG)
	}
}

// workdir is a directory holding the marker file.
func workdir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, marker), []byte("x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// runCLI runs a client to its end (at most 5 minutes), returning its output.
func runCLI(t *testing.T, dir string, env []string, bin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir, cmd.Env, cmd.Stdin = dir, append(os.Environ(), env...), nil
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", filepath.Base(bin), args, err, out)
	}
	return string(out)
}

// runClaude runs Claude Code headless in a directory holding the marker, against base,
// allowed the tools named, with a home of its own; it returns the output (JSON).
func runClaude(t *testing.T, bin, base, prompt, tools string) string {
	t.Helper()
	return runCLI(t, workdir(t), []string{"HOME=" + t.TempDir(), "ANTHROPIC_BASE_URL=" + base, "ANTHROPIC_API_KEY=sk-local",
		"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1", "DISABLE_AUTOUPDATER=1", "DISABLE_TELEMETRY=1"},
		bin, "-p", prompt, "--model", "fake", "--output-format", "json", "--allowedTools", tools)
}

// runCodex runs codex exec in a directory holding the marker, with a config naming base
// as a Responses provider (the README's setup), without a sandbox (ls only).
func runCodex(t *testing.T, bin, base, prompt string) string {
	t.Helper()
	home := t.TempDir()
	config := fmt.Sprintf("model = \"fake\"\nmodel_provider = \"polykv\"\n\n[model_providers.polykv]\nname = \"PolyKV\"\nbase_url = %q\nwire_api = \"responses\"\nenv_key = \"POLYKV_API_KEY\"\n", base+"/v1")
	if err := os.WriteFile(filepath.Join(home, "config.toml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	return runCLI(t, workdir(t), []string{"CODEX_HOME=" + home, "POLYKV_API_KEY=local"},
		bin, "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", prompt)
}

// checkExchanges asserts every request was answered 2xx, and that the conversation's
// last request carries the tool's result (the marker): the client ran the tool the
// model called and sent what it printed back. It writes the bodies as fixtures when
// asked to.
func checkExchanges(t *testing.T, client, route string, rec *exchangeLog) []exchange {
	t.Helper()
	all := rec.exchanges()
	var gen []exchange
	for _, x := range all {
		if x.status < 200 || x.status > 299 {
			t.Errorf("%s %s answered %d:\n%.2000s", x.method, x.path, x.status, x.body)
		}
		if x.path == route {
			gen = append(gen, x)
		}
	}
	if len(gen) < 2 {
		t.Fatalf("%s sent %d %s requests, want a tool call turn and the turn after it", client, len(gen), route)
	}
	if last := gen[len(gen)-1]; !bytes.Contains(last.body, []byte(marker)) {
		t.Fatalf("%s's last request carries no tool result with %s:\n%.3000s", client, marker, last.body)
	}
	if dir := os.Getenv("POLYKV_AGENTS_FIXTURES"); dir != "" {
		out := filepath.Join(dir, client)
		if err := os.MkdirAll(out, 0o755); err != nil {
			t.Fatal(err)
		}
		for i, x := range gen {
			var v any
			if err := json.Unmarshal(x.body, &v); err != nil {
				t.Fatal(err)
			}
			b, _ := json.MarshalIndent(v, "", " ")
			if err := os.WriteFile(filepath.Join(out, fmt.Sprintf("%02d.json", i+1)), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return gen
}

func TestClaudeCodeToolRoundTrip(t *testing.T) {
	bin := agentCLI(t, "claude")
	base, rec := serveScripted(t, toolThenAnswer(`{"name": "Bash", "arguments": {"command": "ls", "description": "List the files"}}`))
	out := runClaude(t, bin, base, "Which files are in this directory? Use a tool to look.", "Bash")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var res struct {
		IsError bool   `json:"is_error"`
		Result  string `json:"result"`
		Turns   int    `json:"num_turns"`
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil {
		t.Fatalf("claude's result is not JSON: %v\n%s", err, out)
	}
	if res.IsError || !strings.Contains(res.Result, "DONE") || res.Turns < 2 {
		t.Fatalf("claude's result: %+v\n%s", res, out)
	}
	gen := checkExchanges(t, "claude-code", "/v1/messages", rec)
	// What Claude Code sends that a server must take: a system message inside messages,
	// adaptive thinking, context management, output_config, its session in metadata.
	var first map[string]json.RawMessage
	if err := json.Unmarshal(gen[0].body, &first); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"thinking", "context_management", "output_config", "metadata", "tools", "system"} {
		if _, ok := first[k]; !ok {
			t.Errorf("Claude Code's request has no %q: the fixtures no longer show what it sends", k)
		}
	}
}

func TestCodexToolRoundTrip(t *testing.T) {
	bin := agentCLI(t, "codex")
	base, rec := serveScripted(t, toolThenAnswer(`{"name": "exec_command", "arguments": {"cmd": "ls"}}`))
	out := runCodex(t, bin, base, "Which files are in this directory? Use a tool to look.")
	if !strings.Contains(out, "DONE: the directory holds "+marker) {
		t.Fatalf("codex did not print the reply:\n%s", out)
	}
	gen := checkExchanges(t, "codex", "/v1/responses", rec)
	var first map[string]json.RawMessage
	if err := json.Unmarshal(gen[0].body, &first); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"prompt_cache_key", "include", "store", "tools", "input"} {
		if _, ok := first[k]; !ok {
			t.Errorf("Codex's request has no %q: the fixtures no longer show what it sends", k)
		}
	}
	if !bytes.Contains(first["tools"], []byte(`"namespace"`)) {
		t.Errorf("Codex's tools hold no namespace tool: %.500s", first["tools"])
	}
}

// fixtures are the request bodies of one client's recorded run (testdata/agents).
func fixtures(t *testing.T, client string) [][]byte {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join("testdata", "agents", client, "*.json"))
	if len(files) < 2 {
		t.Fatalf("testdata/agents/%s holds %d fixtures", client, len(files))
	}
	var out [][]byte
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, b)
	}
	return out
}

// postUsage sends body (as non-streamed) and returns the status and the usage's
// prompt tokens and cached tokens, in the route's own names.
func postUsage(t *testing.T, url string, body []byte, edit func(map[string]any)) (int, int, int, map[string]any) {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatal(err)
	}
	v["stream"] = false
	if edit != nil {
		edit(v)
	}
	rep := do(t, "POST", url, v)
	r := rep.body
	u, _ := r["usage"].(map[string]any)
	num := func(m map[string]any, k string) int { f, _ := m[k].(float64); return int(f) }
	if d, ok := u["input_tokens_details"].(map[string]any); ok { // Responses
		return rep.code, num(u, "input_tokens"), num(d, "cached_tokens"), r
	}
	return rep.code, num(u, "input_tokens") + num(u, "cache_read_input_tokens"), num(u, "cache_read_input_tokens"), r
}

// The recorded requests of both clients, replayed without the CLIs: each answers 2xx;
// a thread's next turn continues on its session's cells (cached tokens: its whole
// earlier prompt up to where the recorded reply differs from this model's); and another
// Claude Code session, whose billing header differs, shares the system prompt's cells.
func TestAgentFixturesReplay(t *testing.T) {
	for _, tc := range []struct{ client, route string }{{"claude-code", "/v1/messages"}, {"codex", "/v1/responses"}} {
		t.Run(tc.client, func(t *testing.T) {
			base, _ := serveScripted(t, toolThenAnswer(`{"name": "nothing", "arguments": {}}`))
			var prev int
			var session string
			for i, body := range fixtures(t, tc.client) {
				status, prompt, cached, r := postUsage(t, base+tc.route, body, nil)
				if status != 200 {
					t.Fatalf("fixture %d: %d %v", i+1, status, r)
				}
				if s, _ := r["session_id"].(string); s == "" || (session != "" && s != session) {
					t.Fatalf("fixture %d runs on session %q, the thread's first on %q", i+1, s, session)
				} else {
					session = s
				}
				if i > 0 && (cached < prev*9/10 || cached >= prompt) {
					t.Errorf("fixture %d: %d of %d prompt tokens cached; the previous turn's prompt was %d", i+1, cached, prompt, prev)
				}
				prev = prompt
			}
		})
	}
	// A team's requests (a main agent that spawns a sub-agent): each answers 2xx, and
	// the sub-agent's thread runs on a session of its own.
	for _, tc := range []struct{ client, route string }{{"claude-code-team", "/v1/messages"}, {"codex-team", "/v1/responses"}} {
		t.Run(tc.client, func(t *testing.T) {
			base, _ := serveScripted(t, toolThenAnswer(`{"name": "nothing", "arguments": {}}`))
			sessions := map[bool]map[string]bool{true: {}, false: {}}
			for i, body := range fixtures(t, tc.client) {
				status, _, _, r := postUsage(t, base+tc.route, body, nil)
				if status != 200 {
					t.Fatalf("fixture %d: %d %v", i+1, status, r)
				}
				sub := bytes.Contains(body, []byte(subtask)) && !bytes.Contains(body, []byte("Ask a sub-agent"))
				sessions[sub][r["session_id"].(string)] = true
			}
			if len(sessions[true]) != 1 || len(sessions[false]) != 1 {
				t.Fatalf("sessions: sub-agent %v, main %v; want one each", sessions[true], sessions[false])
			}
			for s := range sessions[true] {
				if sessions[false][s] {
					t.Fatalf("the sub-agent runs on the main thread's session %s", s)
				}
			}
		})
	}
	t.Run("claude-code other session", func(t *testing.T) {
		base, _ := serveScripted(t, toolThenAnswer(`{"name": "nothing", "arguments": {}}`))
		bodies := fixtures(t, "claude-code")
		_, _, _, first := postUsage(t, base+"/v1/messages", bodies[0], nil)
		var systemLen int
		status, prompt, cached, r := postUsage(t, base+"/v1/messages", bodies[0], func(v map[string]any) {
			sys := v["system"].([]any)
			hdr := sys[0].(map[string]any)
			if !strings.HasPrefix(hdr["text"].(string), "x-anthropic-billing-header:") {
				t.Fatalf("the fixture's first system block is not the billing header: %v", hdr)
			}
			hdr["text"] = "x-anthropic-billing-header: cc_version=2.1.328.fff; cc_entrypoint=sdk-cli;"
			for _, b := range sys[1:] {
				systemLen += len(b.(map[string]any)["text"].(string))
			}
			v["metadata"] = map[string]any{"user_id": `{"device_id":"d2","account_uuid":"","session_id":"another-session"}`}
		})
		if status != 200 || r["session_id"] == first["session_id"] {
			t.Fatalf("%d, session %v (first %v)", status, r["session_id"], first["session_id"])
		}
		if cached < systemLen || cached >= prompt {
			t.Fatalf("another session's first turn: %d of %d prompt tokens cached, the system prompt alone is %d", cached, prompt, systemLen)
		}
	})
}

// subtask marks the prompt of a sub-agent the scripted model spawned.
const subtask = "SUBTASK: run ls here and report the files."

// teamScript plays a model that spawns a sub-agent (spawn calls the client's spawn
// tool with subtask), whose thread calls the shell tool (shell) and reports what it
// saw; the spawning thread then waits for it where the client needs that (wait, given
// the id the spawn returned) and answers with the sub-agent's report.
func teamScript(spawn, shell string, wait func(id string) string) func(string) []engine.Token {
	idRE := regexp.MustCompile(`"agent_id"\s*:\s*"([^"]+)"`)
	say := func(s string) []engine.Token { return append(enginetest.Bytes(s), enginetest.EOG) }
	return func(p string) []engine.Token {
		sub := strings.Contains(p, subtask)
		last := p[strings.LastIndex(p, "\ntool: ")+1:]
		switch {
		case sub && strings.Contains(last, marker):
			return say("DONE: the directory holds " + marker + ".")
		case sub:
			return say("<tool_call>" + shell + "</tool_call>")
		case strings.Contains(p, marker):
			return say("DONE: the sub-agent found " + marker + ".")
		case strings.Contains(last, "tool: ") && wait != nil:
			if m := idRE.FindStringSubmatch(last); m != nil {
				return say("<tool_call>" + wait(m[1]) + "</tool_call>")
			}
		}
		return say("<tool_call>" + spawn + "</tool_call>")
	}
}

// Codex spawns a sub-agent through its namespace tool (multi_agent_v1.spawn_agent),
// which PolyKV flattened for the model and returned with its namespace: the client runs
// it (collab: SpawnAgent), the sub-agent's own thread calls the shell tool on its own
// PolyKV session, and the main thread waits for it and answers.
func TestCodexSubAgent(t *testing.T) {
	bin := agentCLI(t, "codex")
	base, rec := serveScripted(t, teamScript(`{"name": "spawn_agent", "arguments": {"message": "`+subtask+`"}}`,
		`{"name": "exec_command", "arguments": {"cmd": "ls"}}`,
		func(id string) string {
			return `{"name": "wait_agent", "arguments": {"targets": ["` + id + `"], "timeout_ms": 60000}}`
		}))
	out := runCodex(t, bin, base, "Which files are in this directory? Ask a sub-agent.")
	if !strings.Contains(out, "collab: SpawnAgent") || !strings.Contains(out, "DONE: the sub-agent found "+marker) {
		t.Fatalf("codex did not run the sub-agent and answer:\n%s", out)
	}
	checkTeam(t, "codex-team", "/v1/responses", rec)
}

// Claude Code spawns a sub-agent with its Agent tool: the sub-agent (another system
// prompt and task, its own PolyKV session) calls Bash, and the main agent answers with
// its report.
func TestClaudeCodeSubAgent(t *testing.T) {
	bin := agentCLI(t, "claude")
	base, rec := serveScripted(t, teamScript(`{"name": "Agent", "arguments": {"description": "List the files", "prompt": "`+subtask+`", "subagent_type": "general-purpose", "run_in_background": false}}`,
		`{"name": "Bash", "arguments": {"command": "ls", "description": "List the files"}}`, nil))
	out := runClaude(t, bin, base, "Which files are in this directory? Ask a sub-agent.", "Bash,Agent")
	if !strings.Contains(out, "DONE: the sub-agent found "+marker) {
		t.Fatalf("claude did not answer with the sub-agent's report:\n%s", out)
	}
	checkTeam(t, "claude-code-team", "/v1/messages", rec)
}

// checkTeam asserts a team run's exchanges: all 2xx, and a tool round trip in the
// sub-agent's thread and in the main thread (TestMessagesThreadSessions shows that the
// threads run on sessions of their own); and keeps the bodies as fixtures when asked to.
func checkTeam(t *testing.T, client, route string, rec *exchangeLog) {
	t.Helper()
	gen := checkExchanges(t, client, route, rec)
	sub, main := 0, 0
	for _, x := range gen {
		if bytes.Contains(x.body, []byte(subtask)) && !bytes.Contains(x.body, []byte("Ask a sub-agent")) {
			sub++
		} else {
			main++
		}
	}
	if sub < 2 || main < 2 {
		t.Fatalf("%s: %d requests of the sub-agent's thread and %d of the main thread, want a tool round trip in each", client, sub, main)
	}
}

// opencode (npm opencode-ai) through its OpenAI-compatible provider on
// /v1/chat/completions: the model calls its bash tool, opencode runs it, and the turn
// carrying the result is answered.
func TestOpencodeToolRoundTrip(t *testing.T) {
	bin := agentCLI(t, "opencode")
	base, rec := serveScripted(t, toolThenAnswer(`{"name": "bash", "arguments": {"command": "ls", "description": "List the files"}}`))
	home := t.TempDir()
	config := fmt.Sprintf(`{"$schema": "https://opencode.ai/config.json", "autoupdate": false, "share": "disabled",
  "provider": {"polykv": {"npm": "@ai-sdk/openai-compatible", "name": "PolyKV", "options": {"baseURL": %q, "apiKey": "local"},
    "models": {"fake": {"name": "fake", "tool_call": true}}}},
  "model": "polykv/fake"}`, base+"/v1")
	cfgPath := filepath.Join(home, "opencode.json")
	if err := os.WriteFile(cfgPath, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := workdir(t) // opencode reads PWD, not its working directory: --dir names it
	out := runCLI(t, dir, []string{"HOME=" + home, "PWD=" + dir, "XDG_CONFIG_HOME=" + filepath.Join(home, ".config"), "XDG_DATA_HOME=" + filepath.Join(home, ".local"),
		"XDG_CACHE_HOME=" + filepath.Join(home, ".cache"), "OPENCODE_CONFIG=" + cfgPath, "OPENCODE_DISABLE_AUTOUPDATE=1"},
		bin, "run", "--dir", dir, "--model", "polykv/fake", "--auto", "Which files are in this directory? Use a tool to look.")
	if !strings.Contains(out, "DONE: the directory holds "+marker) {
		t.Fatalf("opencode did not print the reply:\n%s", out)
	}
	checkExchanges(t, "opencode", "/v1/chat/completions", rec)
}
