package chat

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
)

// The corpus test renders llama.cpp's real chat templates (models/templates/*.jinja,
// fetched by scripts/fetch-templates.sh from a pinned llama-cpp-python sdist into the
// cache) in the conversations issue 11 lists, and compares every prompt byte for byte
// with jinja2 configured as transformers' apply_chat_template (scripts/render_reference.py).

const corpusVersion = "llama-cpp-python-0.3.36"

// corpusTool is declared with keys in OpenAI's order (not sorted) and a non-ASCII
// description, so key order and ensure_ascii=False are both checked.
const corpusTools = `[{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city (température en °C)", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}, {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]`

// corpusConversations are in the form transformers receives (tool-call arguments as
// objects, content null where an OpenAI client sends null). The tool-call id is 9
// alphanumerics, the strictest form a template asks for (Mistral's).
var corpusConversations = []struct {
	name, messages string
	tools          bool
}{
	{"system_user", `[{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a prime number."}]`, false},
	{"user_only", `[{"role": "user", "content": "Hello there! Ça va?"}]`, false},
	{"multi_turn", `[{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another one?"}]`, false},
	{"tools_first_turn", `[{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "What is the weather in Paris?"}]`, true},
	{"tool_loop", `[{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "What is the weather in Paris?"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "a1B2c3D4e", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}, {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "{\"temperature\": 18, \"sky\": \"clear\"}"}, {"role": "assistant", "content": "18 °C and clear."}, {"role": "user", "content": "And in Rome?"}]`, true},
}

type corpusCase struct {
	Name     string          `json:"name"`
	Messages json.RawMessage `json:"messages"`
	Tools    json.RawMessage `json:"tools"`
	AddGen   bool            `json:"add_generation_prompt"`
}

func corpusCases() []corpusCase {
	var out []corpusCase
	for _, c := range corpusConversations {
		for _, gen := range []bool{true, false} {
			cc := corpusCase{Name: c.name, Messages: json.RawMessage(c.messages), Tools: json.RawMessage("null"), AddGen: gen}
			if gen {
				cc.Name += "+gen"
			}
			if c.tools {
				cc.Tools = json.RawMessage(corpusTools)
			}
			out = append(out, cc)
		}
	}
	return out
}

// messagesFromHF reads the transformers-form conversation the way the server reads an
// OpenAI one: arguments objects become the JSON string a client would send.
func messagesFromHF(t *testing.T, raw json.RawMessage) []Message {
	var in []struct {
		Role       string  `json:"role"`
		Content    *string `json:"content"`
		ToolCallID string  `json:"tool_call_id"`
		ToolCalls  []struct {
			ID       string `json:"id"`
			Function struct {
				Name      string          `json:"name"`
				Arguments json.RawMessage `json:"arguments"`
			} `json:"function"`
		} `json:"tool_calls"`
	}
	var raws []json.RawMessage
	if err := json.Unmarshal(raw, &in); err != nil || json.Unmarshal(raw, &raws) != nil {
		t.Fatal(err)
	}
	out := make([]Message, len(in))
	for i, m := range in {
		out[i] = Message{Role: m.Role, ToolCallID: m.ToolCallID, NullContent: m.Content == nil, Raw: raws[i]}
		if m.Content != nil {
			out[i].Content = *m.Content
		}
		for _, c := range m.ToolCalls {
			out[i].ToolCalls = append(out[i].ToolCalls, ToolCall{ID: c.ID, Type: "function", Function: FunctionCall{Name: c.Function.Name, Arguments: string(c.Function.Arguments)}})
		}
	}
	return out
}

func toolsFrom(t *testing.T, raw json.RawMessage) []Tool {
	if string(raw) == "null" {
		return nil
	}
	var tools []Tool
	if err := json.Unmarshal(raw, &tools); err != nil {
		t.Fatal(err)
	}
	return tools
}

func corpusDir(t *testing.T) string {
	cache := os.Getenv("POLYKV_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "polykv")
	}
	dir := filepath.Join(cache, "templates", corpusVersion)
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err != nil {
		skipOrFail(t, "template corpus not fetched (run scripts/fetch-templates.sh): "+dir)
	}
	return dir
}

func skipOrFail(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("POLYKV_REQUIRE_MODEL") == "1" {
		t.Fatal(why)
	}
	t.Skip(why)
}

func referencePython(t *testing.T) string {
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
		skipOrFail(t, fmt.Sprintf("no python with jinja2 at %s (make venv, or set POLYKV_PYTHON): %v", py, err))
	}
	return py
}

// family groups corpus templates for the README table.
func family(name string) string {
	n := strings.ToLower(name)
	for _, f := range []struct{ key, fam string }{
		{"deepseek-r1", "DeepSeek R1"}, {"deepseek", "DeepSeek V3/V4"},
		{"gpt-oss", "GPT-OSS"}, {"qwen3-coder", "Qwen3-Coder"}, {"qwen3.5", "Qwen 3.5"}, {"qwq", "Qwen"}, {"qwen", "Qwen"},
		{"hermes", "Hermes"}, {"llama-3", "Llama 3.x"}, {"firefunction", "Llama 3.x"},
		{"devstral", "Mistral"}, {"mistral", "Mistral"}, {"ministral", "Mistral"}, {"gemma", "Gemma"}, {"granite", "Granite"},
		{"glm", "GLM"}, {"kimi", "Kimi"}, {"command-r", "Command R"}, {"cohere", "Command R"}, {"functionary", "Functionary"},
		{"lfm", "LFM2"}, {"minimax", "MiniMax"}, {"nemotron", "Nemotron"}, {"smollm", "SmolLM"}, {"phi", "Phi"}, {"apriel", "Apriel"},
		{"laguna", "Laguna"}, {"gigachat", "GigaChat"},
	} {
		if strings.Contains(n, f.key) {
			return f.fam
		}
	}
	return "other"
}

type corpusResult struct {
	template, cas  string
	refErr, ourErr string
	same           bool
	injected       bool // tools given to a template that cannot show them: PolyKV describes them itself
	diffAt         int
	ref, ours      string
}

func TestTemplateCorpus(t *testing.T) {
	dir := corpusDir(t)
	py := referencePython(t)
	files, _ := filepath.Glob(filepath.Join(dir, "*.jinja"))
	if len(files) < 60 {
		t.Fatalf("only %d templates in %s", len(files), dir)
	}
	templates := map[string]string{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		templates[strings.TrimSuffix(filepath.Base(f), ".jinja")] = string(b)
	}
	cases := corpusCases()
	special := map[string]string{"bos_token": "<s>", "eos_token": "</s>"}
	job, _ := json.Marshal(map[string]any{"templates": templates, "cases": cases, "special": special})
	cmd := exec.Command(py, filepath.Join("..", "..", "scripts", "render_reference.py"))
	cmd.Stdin = bytes.NewReader(job)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("reference renderer: %v\n%s", err, stderr.String())
	}
	var ref map[string]struct {
		Text  *string `json:"text"`
		Error string  `json:"error"`
	}
	if err := json.Unmarshal(out, &ref); err != nil {
		t.Fatal(err)
	}

	names := make([]string, 0, len(templates))
	for n := range templates {
		names = append(names, n)
	}
	sort.Strings(names)
	var results []corpusResult
	nondeterministic := 0
	for _, name := range names {
		r := NewRenderer(templates[name], special["bos_token"], special["eos_token"])
		for _, c := range cases {
			res := corpusResult{template: name, cas: c.Name}
			rf := ref[name+"/"+c.Name]
			if rf.Text == nil {
				res.refErr = rf.Error
				if res.refErr == "" {
					res.refErr = "missing"
				}
			} else {
				res.ref = *rf.Text
			}
			msgs, tools := messagesFromHF(t, c.Messages), toolsFrom(t, c.Tools)
			got, err := r.Render(msgs, tools, c.AddGen)
			if err != nil {
				res.ourErr = err.Error()
			} else {
				res.ours = got
				// Determinism: the same request renders the same prompt every time.
				for range 3 {
					again, err := r.Render(messagesFromHF(t, c.Messages), toolsFrom(t, c.Tools), c.AddGen)
					if err != nil || again != got {
						nondeterministic++
						break
					}
				}
			}
			res.same = res.refErr == "" && res.ourErr == "" && res.ours == res.ref
			if strings.Contains(templates[name], "[AVAILABLE_TOOLS]") && strings.HasPrefix(c.Name, "tools_first_turn") && !strings.Contains(res.ours, "[AVAILABLE_TOOLS]") {
				t.Errorf("%s/%s: Mistral tools block missing", name, c.Name)
			}
			res.injected = len(tools) > 0 && !strings.Contains(templates[name], "tools")
			if !res.same && res.refErr == "" && res.ourErr == "" {
				res.diffAt = firstDiff(res.ref, res.ours)
			}
			results = append(results, res)
		}
	}

	// Per-family table (and per-template detail with -v).
	type agg struct{ refOK, same, ourErr, injected, templates int }
	fams := map[string]*agg{}
	perTemplate := map[string]*agg{}
	total, totalSame, totalInjected := 0, 0, 0
	for _, r := range results {
		f := family(r.template)
		if fams[f] == nil {
			fams[f] = &agg{}
		}
		if perTemplate[r.template] == nil {
			perTemplate[r.template] = &agg{}
			fams[f].templates++
		}
		if r.refErr != "" {
			continue
		}
		total++
		fams[f].refOK++
		perTemplate[r.template].refOK++
		if r.same {
			totalSame++
			fams[f].same++
			perTemplate[r.template].same++
		} else if r.ourErr != "" {
			fams[f].ourErr++
			perTemplate[r.template].ourErr++
		} else if r.injected {
			fams[f].injected++
			totalInjected++
		}
	}
	var table strings.Builder
	table.WriteString("| family | templates | pairs transformers renders | identical | PolyKV error | differ: tools described by PolyKV |\n|---|---|---|---|---|---|\n")
	famNames := make([]string, 0, len(fams))
	for f := range fams {
		famNames = append(famNames, f)
	}
	sort.Strings(famNames)
	for _, f := range famNames {
		a := fams[f]
		fmt.Fprintf(&table, "| %s | %d | %d | %d | %d | %d |\n", f, a.templates, a.refOK, a.same, a.ourErr, a.injected)
	}
	fmt.Fprintf(&table, "| **all** | %d | %d | %d (%.1f%%) | | %d |\n", len(templates), total, totalSame, 100*float64(totalSame)/float64(max(total, 1)), totalInjected)
	t.Logf("template corpus (%s), %d conversations:\n%s", corpusVersion, len(cases), table.String())
	if p := os.Getenv("POLYKV_CORPUS_REPORT"); p != "" {
		var detail strings.Builder
		detail.WriteString(table.String())
		detail.WriteString("\n")
		for _, r := range results {
			switch {
			case r.refErr != "":
				fmt.Fprintf(&detail, "REFERR %s/%s: %s\n", r.template, r.cas, firstLine(r.refErr))
			case r.ourErr != "":
				fmt.Fprintf(&detail, "OURERR %s/%s: %s\n", r.template, r.cas, firstLine(r.ourErr))
			case !r.same:
				fmt.Fprintf(&detail, "DIFF   %s/%s at %d: ref %q ours %q\n", r.template, r.cas, r.diffAt, around(r.ref, r.diffAt), around(r.ours, r.diffAt))
			}
		}
		_ = os.WriteFile(p, []byte(detail.String()), 0o644)
	}
	if nondeterministic > 0 {
		t.Errorf("%d (template, conversation) pairs rendered differently from run to run", nondeterministic)
	}
	if float64(totalSame) < 0.95*float64(total) {
		t.Errorf("identical for %d of %d pairs (%.1f%%), want >= 95%%", totalSame, total, 100*float64(totalSame)/float64(total))
	}
}

func firstDiff(a, b string) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

func around(s string, i int) string {
	lo, hi := max(0, i-30), min(len(s), i+50)
	return s[lo:hi]
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	if len(s) > 200 {
		return s[:200]
	}
	return s
}
