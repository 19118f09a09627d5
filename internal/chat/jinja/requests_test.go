package jinja_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/chat/jinja"
)

// TestRequestsAgainstTemplates renders every chat template under
// testdata/templates against every captured request body under
// testdata/requests and compares this engine's output to the canonical
// HuggingFace Jinja2 implementation byte-for-byte.
//
// The reference output comes from scripts/render_reference.py (the renderer
// internal/chat's corpus test uses: jinja2's ImmutableSandboxedEnvironment set up
// as transformers' apply_chat_template sets it), run by the Python of the test
// venv (make venv; POLYKV_PYTHON overrides it), which has jinja2. There are no
// checked-in golden files: adding a template (drop it in testdata/templates/) or
// a captured request (drop it in testdata/requests/) just makes the next `go test`
// run pick it up automatically. (Upstream ran its own scripts/render_python.py
// through `uv` and skipped without it; PolyKV's fork runs it in make test, where
// a missing Python or jinja2 fails.)
func TestRequestsAgainstTemplates(t *testing.T) {
	requests := loadRequests(t)
	reqNames := sortedKeys(requests)
	reference := pythonReference(t, requests, reqNames)
	refused := 0 // pairs both engines refuse to render
	defer func() { t.Logf("%d template × request pairs, %d refused by both engines", len(reference), refused) }()

	for _, templateName := range sortedTemplateNames() {
		content := chatTemplates[templateName]
		t.Run(templateName, func(t *testing.T) {
			tmpl, err := jinja.Compile(content)
			if err != nil {
				t.Fatalf("compile: %v", err)
			}

			for _, reqName := range reqNames {
				req := requests[reqName]
				t.Run(reqName, func(t *testing.T) {
					data := buildRenderData(req)

					var got string
					result, err := tmpl.Render(data)
					if err != nil {
						got = "RENDER ERROR: " + err.Error() + "\n"
					} else {
						got = result
					}

					if templateName == "DeepSeek-V4-Flash" && reqName == "kronk-req-deepseek" {
						for _, fragment := range []string{
							`<｜DSML｜invoke name="get_weather">`,
							`<｜DSML｜parameter name="location" string="true">New York City, NY</｜DSML｜parameter>`,
							`<tool_result>{"temperature":"72°F","condition":"sunny"}</tool_result>`,
						} {
							if !strings.Contains(got, fragment) {
								t.Errorf("rendered DeepSeek output missing %q", fragment)
							}
						}
					}

					key := templateName + "/" + reqName
					ref, ok := reference[key]
					if !ok {
						t.Fatalf("scripts/render_reference.py did not produce output for key %q (template/request mismatch)", key)
					}
					if ref.Text == nil {
						if err == nil {
							t.Errorf("jinja2 refuses to render (%s); this engine rendered %d bytes", ref.Error, len(got))
						}
						refused++
						return
					}
					want := *ref.Text

					if got != want {
						t.Errorf("rendered output diverges from canonical Python jinja2\n%s", diffSummary(got, want))
					}
				})
			}
		})
	}
}

// buildRenderData turns a captured request body into the variable map the chat
// template expects. The known chat templates in this repo reference messages,
// tools, and a handful of well-known control variables (bos_token,
// add_generation_prompt, enable_thinking, ...). We provide neutral defaults
// for those so every template can render without panicking on a missing name.
// pythonReference hands the reference renderer the same map.
func buildRenderData(req map[string]any) map[string]any {
	return map[string]any{
		"messages":              req["messages"],
		"tools":                 req["tools"],
		"add_generation_prompt": true,
		"bos_token":             "<s>",
		"eos_token":             "</s>",
		"enable_thinking":       false,
		"thinking":              false,
		"reasoning_effort":      "medium",
		"model_identity":        "You are a helpful assistant.",
		"builtin_tools":         []any{},
		"date":                  "2024-01-01",
		"date_string":           "2024-01-01",
		"tools_in_user_message": false,
	}
}

// referenceRender is one rendering by jinja2: its text, or why it refused.
type referenceRender struct {
	Text  *string `json:"text"`
	Error string  `json:"error"`
}

// pythonReference renders every template against every request with jinja2
// (scripts/render_reference.py, one process for all pairs) and returns the
// renderings by "<template>/<request>". Without a Python that has jinja2 the
// test skips, or fails under make test (POLYKV_REQUIRE_MODEL).
func pythonReference(t *testing.T, requests map[string]map[string]any, reqNames []string) map[string]referenceRender {
	t.Helper()
	py := os.Getenv("POLYKV_PYTHON")
	if py == "" {
		cache := os.Getenv("POLYKV_CACHE")
		if cache == "" {
			home, _ := os.UserHomeDir()
			cache = filepath.Join(home, ".cache", "polykv")
		}
		py = filepath.Join(cache, "venv", "bin", "python")
	}
	if err := exec.Command(py, "-c", "import jinja2").Run(); err != nil {
		why := fmt.Sprintf("no Python with jinja2 at %s (make venv, or set POLYKV_PYTHON): %v", py, err)
		if os.Getenv("POLYKV_REQUIRE_MODEL") != "" {
			t.Fatal(why)
		}
		t.Skip(why)
	}
	type refCase struct {
		Name                string         `json:"name"`
		Messages            any            `json:"messages"`
		Tools               any            `json:"tools"`
		AddGenerationPrompt bool           `json:"add_generation_prompt"`
		Kwargs              map[string]any `json:"kwargs"`
	}
	var cases []refCase
	var special map[string]any
	for _, name := range reqNames {
		data := buildRenderData(requests[name])
		c := refCase{Name: name, Messages: data["messages"], Tools: data["tools"], AddGenerationPrompt: true, Kwargs: map[string]any{}}
		special = map[string]any{"bos_token": data["bos_token"], "eos_token": data["eos_token"]}
		for k, v := range data {
			switch k {
			case "messages", "tools", "add_generation_prompt", "bos_token", "eos_token":
			default:
				c.Kwargs[k] = v
			}
		}
		cases = append(cases, c)
	}
	job, err := json.Marshal(map[string]any{"templates": chatTemplates, "cases": cases, "special": special})
	if err != nil {
		t.Fatal(err)
	}
	script := filepath.Join("..", "..", "..", "scripts", "render_reference.py")
	cmd := exec.Command(py, script)
	cmd.Stdin = bytes.NewReader(job)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("running %s failed: %v\nstderr:\n%s", script, err, stderr.String())
	}
	var ref map[string]referenceRender
	if err := json.Unmarshal(stdout.Bytes(), &ref); err != nil {
		t.Fatalf("decoding %s output: %v\nfirst bytes: %q", script, err, head(stdout.Bytes(), 200))
	}
	if len(ref) != len(chatTemplates)*len(cases) {
		t.Fatalf("%s rendered %d pairs, want %d templates × %d requests", script, len(ref), len(chatTemplates), len(cases))
	}
	return ref
}

func head(b []byte, n int) []byte {
	if len(b) <= n {
		return b
	}
	return b[:n]
}

var requestFiles map[string]map[string]any

func loadRequests(t testing.TB) map[string]map[string]any {
	if requestFiles != nil {
		return requestFiles
	}

	files, err := filepath.Glob("testdata/requests/*.json")
	if err != nil {
		t.Fatalf("glob requests: %v", err)
	}
	if len(files) == 0 {
		t.Fatalf("no request files found in testdata/requests")
	}

	requestFiles = make(map[string]map[string]any, len(files))
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatalf("read %q: %v", f, err)
		}

		// Use json.Decoder with UseNumber so that JSON integers stay
		// distinguishable from floats — Python's json module preserves
		// that distinction and we need it to render large integers
		// (e.g. 9007199254740991) the same way the canonical engine does.
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.UseNumber()

		var req map[string]any
		if err := dec.Decode(&req); err != nil {
			t.Fatalf("unmarshal %q: %v", f, err)
		}
		normalizeToolCallArguments(req)
		name := strings.TrimSuffix(filepath.Base(f), ".json")
		requestFiles[name] = req
	}
	return requestFiles
}

// normalizeToolCallArguments mirrors Kronk's pre-render normalization of
// OpenAI assistant tool calls. OpenAI request bodies encode function arguments
// as JSON strings, while model templates such as GLM-5.2 iterate them as maps.
func normalizeToolCallArguments(req map[string]any) {
	messages, _ := req["messages"].([]any)
	for _, value := range messages {
		message, _ := value.(map[string]any)
		if message["role"] != "assistant" {
			continue
		}
		toolCalls, _ := message["tool_calls"].([]any)
		for _, value := range toolCalls {
			toolCall, _ := value.(map[string]any)
			function, _ := toolCall["function"].(map[string]any)
			arguments, ok := function["arguments"].(string)
			if !ok {
				continue
			}

			dec := json.NewDecoder(strings.NewReader(arguments))
			dec.UseNumber()
			var normalized any
			if err := dec.Decode(&normalized); err != nil {
				continue
			}
			if encoded, ok := normalized.(string); ok {
				dec := json.NewDecoder(strings.NewReader(encoded))
				dec.UseNumber()
				if err := dec.Decode(&normalized); err != nil {
					continue
				}
			}
			argumentsMap, ok := normalized.(map[string]any)
			if !ok && normalized != nil {
				continue
			}
			function["arguments"] = argumentsMap
		}
	}
}

func sortedKeys(m map[string]map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func sortedTemplateNames() []string {
	keys := make([]string, 0, len(chatTemplates))
	for k := range chatTemplates {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// diffSummary returns a compact, human-readable description of where two
// strings first differ. Rendered chat templates can be many KB long with
// extremely long single lines (e.g. tool-definition JSON), so dumping the full
// strings is unhelpful. Instead, we report sizes, the line/column of the first
// divergence, and a small character window around it.
func diffSummary(got, want string) string {
	if got == want {
		return "(no diff)"
	}

	n := min(len(want), len(got))
	i := 0
	for i < n && got[i] == want[i] {
		i++
	}

	line, col := lineCol(got, i)

	const window = 60
	gotCtx := contextAround(got, i, window)
	wantCtx := contextAround(want, i, window)

	return fmt.Sprintf(
		"first difference at byte %d (line %d, col %d); got=%dB want=%dB\n  got:  %q\n  want: %q",
		i, line, col, len(got), len(want), gotCtx, wantCtx,
	)
}

func contextAround(s string, i, window int) string {
	start := max(i-window, 0)
	end := min(i+window, len(s))
	prefix := ""
	if start > 0 {
		prefix = "…"
	}
	suffix := ""
	if end < len(s) {
		suffix = "…"
	}
	return prefix + s[start:end] + suffix
}

func lineCol(s string, i int) (int, int) {
	line, col := 1, 1
	for j := 0; j < i && j < len(s); j++ {
		if s[j] == '\n' {
			line++
			col = 1
		} else {
			col++
		}
	}
	return line, col
}
