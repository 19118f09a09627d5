package app

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/polykv/polykv/internal/engine"
)

// tool_choice auto on SmolLM2: over several prompts, greedy and sampled, each reply is
// either plain text or well-formed calls of declared tools whose arguments validate
// against their schemas; never a broken call left in content (the lazy grammar
// constrains a call once it starts, so a call the model begins is a call it finishes).
// The requests run concurrently: the engine batches them, which keeps the test short.
func TestAutoToolChoiceNeverMalformed(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 8192, Parallel: 8})
	user := func(q string) []any { return []any{map[string]any{"role": "user", "content": q}} }
	// The tiny model does not call tools of its own accord, but it copies text: asked
	// to repeat a call, it starts one, which is the path the grammar constrains. Two of
	// the calls to copy break their tool's schema (an undeclared argument, a string for
	// an integer): the grammar must turn them into valid calls (without it the parser
	// would return them as they are).
	copyCall := func(call string) []any { return user("Reply with exactly this text and nothing else:\n" + call) }
	conversations := [][]any{
		copyCall(`<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}</tool_call>`),
		copyCall(`<tool_call>{"name": "get_weather", "arguments": {"town": "Berlin"}}</tool_call>`),
		copyCall(`<tool_call>{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo", "hours_ahead": "two"}}</tool_call>`),
		user("Hi! How are you today?"),
	}
	type result struct {
		prompt string
		temp   float64
		code   int
		out    map[string]any
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var results []result
	for i, msgs := range conversations {
		for _, temp := range []float64{0, 0.8} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				code, out := post(t, base+"/v1/chat/completions", map[string]any{
					"messages": msgs, "tools": []any{weatherTool, timeTool}, "temperature": temp, "seed": i + 1, "max_tokens": 60,
				})
				mu.Lock()
				last, _ := msgs[len(msgs)-1].(map[string]any)["content"].(string)
				results = append(results, result{last, temp, code, out})
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	calls, texts := 0, 0
	for _, r := range results {
		if r.code != 200 {
			t.Fatalf("%q: %d %v", r.prompt, r.code, r.out)
		}
		ch := r.out["choices"].([]any)[0].(map[string]any)
		msg := ch["message"].(map[string]any)
		content, _ := msg["content"].(string)
		tc, _ := msg["tool_calls"].([]any)
		t.Logf("%q t=%v: finish %v, content %q, calls %v", r.prompt, r.temp, ch["finish_reason"], content, tc)
		// A call begins with its opening marker (the lazy grammar's trigger); a closing
		// marker alone is text the model sampled without ever starting a call (seen at
		// t=0.8 on llama.cpp b11434: "{#tool_call}\n<json_object>{...}</json_object}</tool_call>").
		if strings.Contains(content, "<tool_call>") {
			t.Errorf("%q (t=%v): a malformed call was left in content (finish %v): %q", r.prompt, r.temp, ch["finish_reason"], content)
			continue
		}
		if len(tc) == 0 {
			texts++
			continue
		}
		calls++
		if ch["finish_reason"] != "tool_calls" {
			t.Errorf("%q: calls with finish_reason %v", r.prompt, ch["finish_reason"])
		}
		for _, c := range tc {
			fn := c.(map[string]any)["function"].(map[string]any)
			validateArgs(t, fn["name"].(string), fn["arguments"].(string))
		}
	}
	t.Logf("%d replies with calls, %d plain text", calls, texts)
	if calls == 0 {
		t.Error("no reply called a tool: the grammar's call path went untested")
	}
}

// A lazy grammar that fails mid-reply (llama.cpp throws when the text that completes
// the trigger does not fit the grammar) must not take the server down: the task goes
// on unconstrained with the token the model drew, so its text is exactly the
// unconstrained greedy text; a task decoding in the same batch is unaffected; the next
// HTTP request works.
func TestGrammarFailureKeepsServing(t *testing.T) {
	var logs bytes.Buffer
	var mu sync.Mutex
	cfg := withDefaults(Config{NCtx: 2048, Parallel: 2})
	cfg.ModelPath = modelPath(t)
	a, err := Open(cfg, slog.New(slog.NewTextHandler(&lockedWriter{w: &logs, mu: &mu}, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ctx := context.Background()
	prompt, err := a.Model.Tokenize("<|im_start|>user\nDescribe Paris in two sentences.<|im_end|>\n<|im_start|>assistant\n", true, true)
	if err != nil {
		t.Fatal(err)
	}
	run := func(p engine.SamplingParams) (string, []engine.Token) {
		t.Helper()
		st, _, err := a.Engine.Submit(ctx, engine.Request{Prompt: prompt, Sampling: p, MaxTokens: 24})
		if err != nil {
			t.Fatal(err)
		}
		evs, err := st.Collect(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var text string
		var toks []engine.Token
		for _, ev := range evs {
			if ev.Err != nil {
				t.Fatalf("task failed: %v", ev.Err)
			}
			text += ev.Text
			for _, tl := range ev.Tokens {
				toks = append(toks, tl.Token)
			}
		}
		return text, toks
	}
	free, _ := run(engine.SamplingParams{})
	// The trigger: the first character of a multi-character word that does not occur
	// earlier in the reply. The grammar wants that character and then \x01, so the
	// token that completes the trigger carries text the grammar rejects.
	trig := ""
	for i, r := range free {
		if r >= 'a' && r <= 'z' && !strings.ContainsRune(free[:i], r) && i+1 < len(free) && free[i+1] >= 'a' && free[i+1] <= 'z' {
			trig = string(r)
			break
		}
	}
	if trig == "" {
		t.Fatalf("no trigger character in %q", free)
	}
	bad := engine.SamplingParams{Grammar: fmt.Sprintf("root ::= %q \"\\x01\"\n", trig), GrammarTriggers: []engine.GrammarTrigger{{Word: trig}}}
	var wg sync.WaitGroup
	var broken, other string
	wg.Add(2)
	go func() { defer wg.Done(); broken, _ = run(bad) }()
	go func() { defer wg.Done(); other, _ = run(engine.SamplingParams{}) }()
	wg.Wait()
	if broken != free {
		t.Errorf("after the grammar failed the text is %q, want the unconstrained %q", broken, free)
	}
	if other != free {
		t.Errorf("the task beside the failed one wrote %q, want %q", other, free)
	}
	mu.Lock()
	l := logs.String()
	mu.Unlock()
	if strings.Count(l, "grammar failed") != 1 {
		t.Errorf("want one grammar failure logged (trigger %q), got:\n%s", trig, l)
	}
	ts := startHandler(t, a)
	code, out := post(t, ts+"/v1/chat/completions", map[string]any{
		"messages": []any{map[string]any{"role": "user", "content": "Say hi."}}, "max_tokens": 8, "temperature": 0})
	if code != 200 {
		t.Fatalf("next request: %d %v", code, out)
	}
}

type lockedWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// startHandler serves a's API on a loopback port until the test ends.
func startHandler(t *testing.T, a *App) string {
	ts := httptest.NewServer(a.API.Handler())
	t.Cleanup(ts.Close)
	return ts.URL
}
