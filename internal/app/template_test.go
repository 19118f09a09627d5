package app

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Issue 11's template routes and flags against the real model.

func TestApplyTemplatePropsAndPoolTools(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 2048, Parallel: 2, MaxPools: 2})
	sys := map[string]any{"role": "system", "content": "You are a weather bot. Answer in one line."}
	user := map[string]any{"role": "user", "content": "Weather in Paris?"}
	tools := []any{weatherTool, timeTool}

	// /apply-template: the prompt a chat request would generate from, nothing generated.
	code, out := post(t, base+"/apply-template", map[string]any{"messages": []any{sys, user}, "tools": tools})
	if code != 200 {
		t.Fatalf("apply-template: %d %v", code, out)
	}
	prompt := out["prompt"].(string)
	if !strings.Contains(prompt, `"name": "get_weather"`) || !strings.HasSuffix(prompt, "<|im_start|>assistant\n") {
		t.Fatalf("apply-template prompt lacks the tools or the generation prompt:\n%s", prompt)
	}
	toks, err := a.Model.Tokenize(prompt, true, true)
	if err != nil {
		t.Fatal(err)
	}
	code, chatOut := post(t, base+"/v1/chat/completions", map[string]any{"messages": []any{sys, user}, "tools": tools, "max_tokens": 1, "temperature": 0})
	if code != 200 || num(chatOut["usage"].(map[string]any)["prompt_tokens"]) != len(toks) {
		t.Fatalf("chat prompt_tokens %v, apply-template prompt has %d tokens", chatOut["usage"], len(toks))
	}
	code, out = post(t, base+"/apply-template", map[string]any{"messages": []any{sys, user}, "add_generation_prompt": false})
	if code != 200 || strings.HasSuffix(out["prompt"].(string), "<|im_start|>assistant\n") {
		t.Fatalf("add_generation_prompt false: %d %v", code, out)
	}
	for _, bad := range []map[string]any{{"messages": []any{}}, {"messages": []any{user}, "tools": "x"}, {"messages": []any{user}, "chat_template_kwargs": []any{1}}} {
		if code, out := post(t, base+"/apply-template", bad); code != 400 || out["error"] == nil {
			t.Fatalf("bad apply-template %v: %d %v", bad, code, out)
		}
	}

	// /props reports bos_token and eos_token as llama-server does.
	var props map[string]any
	get(t, base+"/props", &props)
	if props["bos_token"] != "<|im_start|>" || props["eos_token"] != "<|im_end|>" {
		t.Fatalf("props bos %q eos %q", props["bos_token"], props["eos_token"])
	}

	// A pool created from the system message and the tools shares the whole system +
	// tools prefix with a chat that has the same tools.
	root := createPool(t, base, map[string]any{"messages": []any{sys}, "tools": tools})
	id, L := num(root["pool_id"]), num(root["prefix_len"])
	plain := createPool(t, base, map[string]any{"messages": []any{sys}})
	if num(plain["prefix_len"]) >= L {
		t.Fatalf("pool with tools (%d tokens) is not longer than without (%d)", L, num(plain["prefix_len"]))
	}
	code, out = post(t, base+"/v1/chat/completions", map[string]any{"pool_id": id, "messages": []any{sys, user}, "tools": tools, "max_tokens": 2, "temperature": 0})
	if code != 200 || num(out["timings"].(map[string]any)["cache_n"]) != L {
		t.Fatalf("chat with tools attached at cache_n %v, want the whole pool prefix %d (%d %v)", out["timings"], L, code, out["error"])
	}
	if code, out := post(t, base+"/polykv/pools", map[string]any{"prompt": "x", "tools": tools}); code != 400 {
		t.Fatalf("tools without messages: %d %v", code, out)
	}
}

func TestChatTemplateOverrideAndMissingTemplate(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.jinja")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// An empty template file stands for a GGUF without tokenizer.chat_template: the
	// server starts, and chat answers a 400 naming --chat-template, never a 500.
	_, base := startServer(t, Config{NCtx: 512, Parallel: 1, ChatTemplateFile: empty})
	msgs := []any{map[string]any{"role": "user", "content": "hi"}}
	for _, route := range []string{"/v1/chat/completions", "/apply-template"} {
		code, out := post(t, base+route, map[string]any{"messages": msgs, "tools": []any{weatherTool}, "max_tokens": 2})
		msg, _ := out["error"].(map[string]any)["message"].(string)
		if code != 400 || !strings.Contains(msg, "--chat-template") {
			t.Fatalf("%s without a template: %d %v", route, code, out)
		}
	}
	// Completions still work.
	if code, out := post(t, base+"/v1/completions", map[string]any{"prompt": "Hello", "max_tokens": 2}); code != 200 {
		t.Fatalf("completion without a template: %d %v", code, out)
	}
	var props map[string]any
	get(t, base+"/props", &props)
	if props["chat_template_path"] != "none" || props["chat_template_error"] == nil {
		t.Fatalf("props: path %v error %v", props["chat_template_path"], props["chat_template_error"])
	}

	// --chat-template NAME replaces the GGUF's template.
	_, base = startServer(t, Config{NCtx: 512, Parallel: 1, ChatTemplate: "llama3"})
	code, out := post(t, base+"/apply-template", map[string]any{"messages": msgs})
	if code != 200 || out["prompt"] != "<|im_start|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n" {
		t.Fatalf("--chat-template llama3: %d %q", code, out["prompt"])
	}
	if _, err := Open(withDefaults(Config{ModelPath: modelPath(t), ChatTemplate: "no-such-template"}), nil); err == nil || !strings.Contains(err.Error(), "chatml") {
		t.Fatalf("unknown --chat-template name: %v", err)
	}
}

func TestForcedCallOutOfTokensIsLengthWithoutHalfCall(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 1024, Parallel: 1})
	body := map[string]any{
		"messages":    []any{map[string]any{"role": "user", "content": "Weather in Paris?"}},
		"tools":       []any{weatherTool},
		"tool_choice": "required", "temperature": 0, "max_tokens": 6,
	}
	code, out := post(t, base+"/v1/chat/completions", body)
	if code != 200 {
		t.Fatalf("%d %v", code, out)
	}
	ch := out["choices"].([]any)[0].(map[string]any)
	msg := ch["message"].(map[string]any)
	if ch["finish_reason"] != "length" || msg["tool_calls"] != nil || (msg["content"] != nil && msg["content"] != "") {
		t.Fatalf("forced call cut short: finish %v message %v", ch["finish_reason"], msg)
	}
	// Streamed: no content delta carries the half call either.
	body["stream"] = true
	events := streamEvents(t, base, body)
	var finish any
	for _, ev := range events {
		for _, c := range ev["choices"].([]any) {
			c := c.(map[string]any)
			if d, _ := c["delta"].(map[string]any); d != nil {
				if s, _ := d["content"].(string); s != "" || d["tool_calls"] != nil {
					t.Fatalf("streamed a half call: %v", d)
				}
			}
			if c["finish_reason"] != nil {
				finish = c["finish_reason"]
			}
		}
	}
	if finish != "length" {
		t.Fatalf("streamed finish_reason %v", finish)
	}
}

// streamEvents posts a streaming request and returns its JSON chunks.
func streamEvents(t testing.TB, base string, body map[string]any) []map[string]any {
	t.Helper()
	buf, _ := json.Marshal(body)
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(buf))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out []map[string]any
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev map[string]any
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		if ev["choices"] == nil {
			t.Fatalf("chunk without choices: %v", ev)
		}
		out = append(out, ev)
	}
	return out
}

func TestGemmaWithoutTemplateThenBuiltin(t *testing.T) {
	path := gemmaPath(t)
	open := func(cfg Config) string {
		cfg.ModelPath, cfg.NCtx, cfg.Parallel = path, 1024, 1
		a, err := Open(withDefaults(cfg), nil)
		if err != nil {
			t.Fatal(err)
		}
		if a.Model.ChatTemplate() != "" {
			t.Fatalf("this Gemma GGUF was expected to ship no chat template")
		}
		ts := httptest.NewServer(a.API.Handler())
		t.Cleanup(func() { ts.Close(); a.Close() })
		return ts.URL
	}
	msgs := []any{map[string]any{"role": "user", "content": "What is the weather in Paris?"}}
	base := open(Config{})
	code, out := post(t, base+"/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 4})
	msg, _ := out["error"].(map[string]any)["message"].(string)
	if code != 400 || !strings.Contains(msg, "--chat-template") {
		t.Fatalf("Gemma without a template: %d %v", code, out)
	}
	// --chat-template gemma: Gemma's own turn format, and tools through it.
	base = open(Config{ChatTemplate: "gemma"})
	code, out = post(t, base+"/apply-template", map[string]any{"messages": msgs})
	if code != 200 || out["prompt"] != "<bos><start_of_turn>user\nWhat is the weather in Paris?<end_of_turn>\n<start_of_turn>model\n" {
		t.Fatalf("gemma template: %d %q", code, out["prompt"])
	}
	code, out = post(t, base+"/v1/chat/completions", map[string]any{"messages": msgs, "tools": []any{weatherTool},
		"tool_choice": "required", "temperature": 0, "max_tokens": 80})
	if code != 200 {
		t.Fatalf("gemma tool call: %d %v", code, out)
	}
	calls, _ := out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["tool_calls"].([]any)
	if len(calls) != 1 {
		t.Fatalf("gemma forced call: %v", out["choices"])
	}
	fn := calls[0].(map[string]any)["function"].(map[string]any)
	if fn["name"] != "get_weather" {
		t.Fatalf("gemma called %v", fn)
	}
	validateArgs(t, "get_weather", fn["arguments"].(string))
}
