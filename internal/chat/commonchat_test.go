//go:build commonchat

package chat

// The measurement behind docs/chat.md "The decision": llama.cpp's common/chat (b11434,
// through the test-only binding internal/llama/commonchat.go) against this package, on
// the same tests. Run it with `make commonchat` (it needs the tools tree's
// libllama-common, the template corpus and the reference Python); it is not part of
// make test. Each test logs its table; docs/chat.md carries the numbers.

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
	"time"
	"unicode/utf8"

	"github.com/polykv/polykv/internal/llama"
)

// openAIMessages turns the corpus's transformers-form conversation into the OpenAI form
// llama-server receives (arguments as a JSON string), which is what common/chat reads.
func openAIMessages(t testing.TB, raw json.RawMessage) string {
	var msgs []map[string]any
	if err := json.Unmarshal(raw, &msgs); err != nil {
		t.Fatal(err)
	}
	for _, m := range msgs {
		calls, _ := m["tool_calls"].([]any)
		for _, c := range calls {
			fn := c.(map[string]any)["function"].(map[string]any)
			if _, ok := fn["arguments"].(string); !ok {
				b, _ := json.Marshal(fn["arguments"])
				fn["arguments"] = string(b)
			}
		}
	}
	b, _ := json.Marshal(msgs)
	return string(b)
}

func corpusTemplates(t *testing.T) map[string]string {
	return readTemplates(t, corpusDir(t))
}

func readTemplates(t testing.TB, dir string) map[string]string {
	files, _ := filepath.Glob(filepath.Join(dir, "*.jinja"))
	templates := map[string]string{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		templates[strings.TrimSuffix(filepath.Base(f), ".jinja")] = string(b)
	}
	return templates
}

// TestCommonChatCorpus: identity with transformers' rendering, both engines, same pairs.
func TestCommonChatCorpus(t *testing.T) {
	templates := corpusTemplates(t)
	py := referencePython(t)
	cases := corpusCases()
	job, _ := json.Marshal(map[string]any{"templates": templates, "cases": cases, "special": map[string]string{"bos_token": "<s>", "eos_token": "</s>"}})
	cmd := exec.Command(py, filepath.Join("..", "..", "scripts", "render_reference.py"))
	cmd.Stdin = bytes.NewReader(job)
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	var ref map[string]struct {
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(out, &ref); err != nil {
		t.Fatal(err)
	}
	type agg struct{ pairs, ours, theirs, theirsNoThink, theirErr, ourErr int }
	fams := map[string]*agg{}
	var detail strings.Builder
	names := make([]string, 0, len(templates))
	for n := range templates {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		r := NewRenderer(templates[name], "<s>", "</s>")
		cc, initErr := llama.NewCommonChat(templates[name], "<s>", "</s>")
		f := family(name)
		if fams[f] == nil {
			fams[f] = &agg{}
		}
		for _, c := range cases {
			rf := ref[name+"/"+c.Name]
			if rf.Text == nil {
				continue
			}
			a := fams[f]
			a.pairs++
			if got, err := r.Render(messagesFromHF(t, c.Messages), toolsFrom(t, c.Tools), c.AddGen); err != nil {
				a.ourErr++
			} else if got == *rf.Text {
				a.ours++
			}
			tools := ""
			if string(c.Tools) != "null" {
				tools = string(c.Tools)
			}
			var p llama.CommonChatParams
			err := initErr
			if err == nil {
				p, err = cc.Apply(openAIMessages(t, c.Messages), tools, c.AddGen, false, true)
			}
			if initErr == nil {
				if q, err := cc.Apply(openAIMessages(t, c.Messages), tools, c.AddGen, false, false); err == nil && q.Prompt == *rf.Text {
					a.theirsNoThink++
				}
			}
			switch {
			case err != nil:
				a.theirErr++
				fmt.Fprintf(&detail, "ERR  %s/%s: %s\n", name, c.Name, firstLine(err.Error()))
			case p.Prompt == *rf.Text:
				a.theirs++
			default:
				i := firstDiff(*rf.Text, p.Prompt)
				fmt.Fprintf(&detail, "DIFF %s/%s at %d: ref %q common %q\n", name, c.Name, i, around(*rf.Text, i), around(p.Prompt, i))
			}
		}
	}
	var table strings.Builder
	table.WriteString("| family | pairs transformers renders | identical: PolyKV | identical: common/chat | same, enable_thinking false | common/chat error |\n|---|---|---|---|---|---|\n")
	fnames := make([]string, 0, len(fams))
	for f := range fams {
		fnames = append(fnames, f)
	}
	sort.Strings(fnames)
	var tot agg
	for _, f := range fnames {
		a := fams[f]
		fmt.Fprintf(&table, "| %s | %d | %d | %d | %d | %d |\n", f, a.pairs, a.ours, a.theirs, a.theirsNoThink, a.theirErr)
		tot.theirsNoThink += a.theirsNoThink
		tot.pairs += a.pairs
		tot.ours += a.ours
		tot.theirs += a.theirs
		tot.theirErr += a.theirErr
	}
	fmt.Fprintf(&table, "| **all** | %d | %d (%.1f%%) | %d (%.1f%%) | %d (%.1f%%) | %d |\n", tot.pairs, tot.ours, 100*float64(tot.ours)/float64(tot.pairs),
		tot.theirs, 100*float64(tot.theirs)/float64(tot.pairs), tot.theirsNoThink, 100*float64(tot.theirsNoThink)/float64(tot.pairs), tot.theirErr)
	t.Logf("template corpus, PolyKV vs common/chat:\n%s", table.String())
	if p := os.Getenv("POLYKV_COMMONCHAT_REPORT"); p != "" {
		_ = os.WriteFile(p, []byte(table.String()+"\n"+detail.String()), 0o644)
	}
}

// familyTemplatesOf picks each family's template (familyTemplateNames).
func familyTemplatesOf(templates map[string]string) map[Format]string {
	out := map[Format]string{}
	for f, name := range familyTemplateNames {
		out[f] = templates[name]
	}
	return out
}

// familyTemplateNames: the corpus template each family's cases are parsed with.
var familyTemplateNames = map[Format]string{
	FormatHermes: "Qwen-Qwen2.5-7B-Instruct", FormatQwenXML: "Qwen3-Coder", FormatLlama3: "meta-llama-Llama-3.1-8B-Instruct",
	FormatMistral: "mistralai-Mistral-Nemo-Instruct-2407", FormatMistralArgs: "Mistral-Small-3.2-24B-Instruct-2506",
	FormatHarmony: "openai-gpt-oss-120b", FormatDeepSeek: "deepseek-ai-DeepSeek-V3.1", FormatDeepSeekDSML: "deepseek-ai-DeepSeek-V3.2",
	FormatKimiK2: "moonshotai-Kimi-K2", FormatGLM: "GLM-4.6", FormatMiniMax: "MiniMax-M2", FormatGranite: "ibm-granite-granite-3.3-2B-Instruct",
	FormatCommandR7B: "CohereForAI-c4ai-command-r7b-12-2024-tool_use", FormatFunctionaryV31: "meetkai-functionary-medium-v3.1",
	FormatFunctionaryV32: "meetkai-functionary-medium-v3.2", FormatLFM2: "LFM2-8B-A1B",
}

// caseTemplateNames: cases written for another member of their family.
var caseTemplateNames = map[string]string{"deepseek r1": "llama-cpp-deepseek-r1", "glm 4.7 compact": "GLM-4.7-Flash"}

func familyToolsJSON() string {
	b, _ := json.Marshal(familyTools)
	return string(b)
}

const familyPrompt = `[{"role": "user", "content": "What is the weather in Paris?"}]`

// commonParseWith parses text with what common_chat_templates_apply returned, as
// llama-server does, and reads the OpenAI-form message back.
func commonParseWith(p llama.CommonChatParams, text string, partial bool) (Parsed, error) {
	out, err := llama.CommonChatParse(p, text, partial)
	if err != nil {
		return Parsed{}, err
	}
	var m struct {
		Content   *string `json:"content"`
		Reasoning string  `json:"reasoning_content"`
		Calls     []struct {
			ID       string `json:"id"`
			Function struct {
				Name, Arguments string
			} `json:"function"`
		} `json:"tool_calls"`
	}
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		return Parsed{}, err
	}
	var r Parsed
	if m.Content != nil {
		r.Content = *m.Content
	}
	r.Reasoning = m.Reasoning
	for _, c := range m.Calls {
		r.Calls = append(r.Calls, ToolCall{ID: c.ID, Type: "function", Function: FunctionCall{Name: c.Function.Name, Arguments: c.Function.Arguments}})
	}
	return r, nil
}

func sameParsed(c familyCase, p Parsed) bool {
	if strings.TrimSpace(p.Content) != strings.TrimSpace(c.content) || strings.TrimSpace(p.Reasoning) != c.reason || len(p.Calls) != len(c.calls) {
		return false
	}
	for i, want := range c.calls {
		name, args, _ := strings.Cut(want, " ")
		var a, b any
		if json.Unmarshal([]byte(p.Calls[i].Function.Arguments), &a) != nil || json.Unmarshal([]byte(args), &b) != nil {
			return false
		}
		ja, _ := json.Marshal(a)
		jb, _ := json.Marshal(b)
		if p.Calls[i].Function.Name != name || string(ja) != string(jb) {
			return false
		}
	}
	return true
}

// TestCommonChatFamilies: every family case of families_test.go, parsed whole by both
// (common/chat with a corpus template of that family, tools declared), and streamed:
// every byte prefix parsed as partial, as llama-server does per token, checking that
// content never retracts and that the last partial parse agrees with the whole.
func TestCommonChatFamilies(t *testing.T) {
	templates := corpusTemplates(t)
	tmpls := familyTemplatesOf(templates)
	var table strings.Builder
	table.WriteString("| case | family | PolyKV whole | common/chat format | common/chat whole | common/chat streamed |\n|---|---|---|---|---|---|\n")
	oursOK, theirsOK, streamOK, n := 0, 0, 0, 0
	var detail strings.Builder
	for _, c := range familyCases {
		n++
		ours := sameParsed(c, ParseWith(c.format, c.text, familyTools))
		if ours {
			oursOK++
		}
		src, ok := tmpls[c.format]
		if n, o := caseTemplateNames[c.name]; o {
			src = templates[n]
		}
		theirs, streamed, fmtName := "no template", "-", "-"
		if ok {
			cc, err := llama.NewCommonChat(src, "<s>", "</s>")
			if err == nil {
				var p llama.CommonChatParams
				p, err = cc.Apply(familyPrompt, familyToolsJSON(), true, true, false)
				fmtName = p.FormatName
				var whole Parsed
				if err == nil {
					whole, err = commonParseWith(p, c.text, false)
				}
				switch {
				case err != nil:
					theirs = "error"
					fmt.Fprintf(&detail, "%s: %s\n", c.name, firstLine(err.Error()))
				case sameParsed(c, whole):
					theirs = "same"
					theirsOK++
				default:
					theirs = "differs"
					fmt.Fprintf(&detail, "%s: content %q reasoning %q calls %+v\n", c.name, whole.Content, whole.Reasoning, whole.Calls)
				}
				if err == nil {
					streamed = "ok"
					prev := ""
					for i := 1; i <= len(c.text); i++ {
						if !utf8.ValidString(c.text[:i]) {
							continue
						}
						q, err := commonParseWith(p, c.text[:i], true)
						if err != nil {
							streamed = "error"
							fmt.Fprintf(&detail, "%s: partial at %d: %s\n", c.name, i, firstLine(err.Error()))
							break
						}
						if !strings.HasPrefix(q.Content, prev) {
							streamed = "retracts"
							fmt.Fprintf(&detail, "%s: partial at %d: content %q after %q\n", c.name, i, q.Content, prev)
							break
						}
						prev = q.Content
					}
					if streamed == "ok" {
						streamOK++
					}
				}
			} else {
				theirs = "init error"
			}
		}
		fmt.Fprintf(&table, "| %s | %s | %v | %s | %s | %s |\n", c.name, c.format, ours, fmtName, theirs, streamed)
	}
	fmt.Fprintf(&table, "| **all %d** | | %d | | %d | %d |\n", n, oursOK, theirsOK, streamOK)
	t.Logf("family parse cases, PolyKV vs common/chat:\n%s\n%s", table.String(), detail.String())
}

// TestCommonChatRaises: a template that raises, a template that does not parse and
// malformed messages must come back as errors, not abort the process (C++ exceptions
// are caught in commonchat.cpp).
func TestCommonChatRaises(t *testing.T) {
	if _, err := llama.NewCommonChat("{% if %}", "", ""); err == nil {
		t.Error("a template that does not parse was accepted")
	} else {
		t.Logf("bad template: %v", err)
	}
	cc, err := llama.NewCommonChat(`{{ raise_exception("no system role") }}`, "", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cc.Apply(familyPrompt, "", true, false, true); err == nil {
		t.Error("raise_exception rendered")
	} else {
		t.Logf("raise_exception: %v", err)
	}
	if _, err := cc.Apply(`[{"role": 5}]`, "", true, false, true); err == nil {
		t.Error("malformed messages accepted")
	} else {
		t.Logf("malformed messages: %v", err)
	}
}

// longConversation is n user/assistant turns with tool calls every fifth turn.
func longConversation(n int) string {
	var msgs []map[string]any
	msgs = append(msgs, map[string]any{"role": "system", "content": "You are a terse assistant."})
	for i := range n {
		msgs = append(msgs, map[string]any{"role": "user", "content": fmt.Sprintf("Question %d: what is the weather in city number %d, and why?", i, i)})
		if i%5 == 4 {
			msgs = append(msgs, map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": fmt.Sprintf("call%05d", i), "type": "function",
				"function": map[string]any{"name": "get_weather", "arguments": fmt.Sprintf(`{"city": "City %d"}`, i)}}}})
			msgs = append(msgs, map[string]any{"role": "tool", "tool_call_id": fmt.Sprintf("call%05d", i), "content": `{"temperature": 18}`})
		}
		msgs = append(msgs, map[string]any{"role": "assistant", "content": fmt.Sprintf("Answer %d: it is mild, about 18 degrees, because of the season.", i)})
	}
	b, _ := json.Marshal(msgs)
	return string(b)
}

// TestCommonChatRenderSpeed: rendering a 200-turn conversation with tools (the whole
// prompt, as every request with a long history does), per template, both engines.
func TestCommonChatRenderSpeed(t *testing.T) {
	templates := corpusTemplates(t)
	conv := longConversation(200)
	var raw []json.RawMessage
	_ = json.Unmarshal([]byte(conv), &raw)
	var msgs []Message
	for _, m := range raw {
		var x Message
		if err := json.Unmarshal(m, &x); err != nil {
			t.Fatal(err)
		}
		x.Raw = m
		msgs = append(msgs, x)
	}
	var table strings.Builder
	table.WriteString("| template | prompt bytes | PolyKV ms | common/chat ms |\n|---|---|---|---|\n")
	for _, name := range []string{"Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct", "openai-gpt-oss-120b", "mistralai-Mistral-Nemo-Instruct-2407", "deepseek-ai-DeepSeek-V3.1", "moonshotai-Kimi-K2"} {
		src, ok := templates[name]
		if !ok {
			continue
		}
		r := NewRenderer(src, "<s>", "</s>")
		cc, err := llama.NewCommonChat(src, "<s>", "</s>")
		if err != nil {
			t.Fatal(err)
		}
		best := func(f func() (int, error)) (time.Duration, int, error) {
			b, size := time.Duration(1<<62), 0
			for range 5 {
				t0 := time.Now()
				n, err := f()
				if err != nil {
					return 0, 0, err
				}
				b, size = min(b, time.Since(t0)), n
			}
			return b, size, nil
		}
		ours, size, err := best(func() (int, error) { s, err := r.Render(msgs, familyTools, true); return len(s), err })
		if err != nil {
			t.Logf("%s: PolyKV: %v", name, err)
			continue
		}
		theirs, _, err := best(func() (int, error) {
			p, err := cc.Apply(conv, familyToolsJSON(), true, false, true)
			return len(p.Prompt), err
		})
		if err != nil {
			t.Logf("%s: common/chat: %v", name, err)
			continue
		}
		fmt.Fprintf(&table, "| %s | %d | %.2f | %.2f |\n", name, size, ours.Seconds()*1e3, theirs.Seconds()*1e3)
	}
	t.Logf("render a 200-turn conversation (best of 5):\n%s", table.String())
}

// FuzzCommonChatParse: common/chat's parser on arbitrary text in every family's
// format (whole and as partial), as toolcall_fuzz_test.go fuzzes ours: a whole parse
// must not return a call without a name or with arguments that are not a JSON object.
// A C++ abort kills the run: the crash-safety finding it also looks for.
func FuzzCommonChatParse(f *testing.F) {
	for i, c := range familyCases {
		fi := 0
		for j, x := range allFormats {
			if x == c.format {
				fi = j
			}
		}
		f.Add(uint8(fi), c.text, uint8(i))
	}
	home, _ := os.UserHomeDir()
	srcs := familyTemplatesOf(readTemplates(f, filepath.Join(home, ".cache", "polykv", "templates", corpusVersion)))
	tmpls := map[Format]llama.CommonChatParams{}
	// POLYKV_COMMONCHAT_CRASH_ONLY=1 looks for aborts only: the call check fails on the
	// seed corpus already (docs/chat.md), which would stop the fuzzer there.
	crashOnly := os.Getenv("POLYKV_COMMONCHAT_CRASH_ONLY") == "1"
	f.Fuzz(func(t *testing.T, fi uint8, text string, cut uint8) {
		if !utf8.ValidString(text) {
			return
		}
		format := allFormats[int(fi)%len(allFormats)]
		p, ok := tmpls[format]
		if !ok {
			cc, err := llama.NewCommonChat(srcs[format], "<s>", "</s>")
			if err != nil {
				return
			}
			if p, err = cc.Apply(familyPrompt, familyToolsJSON(), true, true, false); err != nil {
				return
			}
			tmpls[format] = p
		}
		for _, partial := range []bool{false, true} {
			got, err := commonParseWith(p, text, partial)
			if err != nil {
				continue // an error is a clean answer; only a crash or a bad call fails
			}
			if crashOnly {
				continue
			}
			for _, c := range got.Calls {
				var obj map[string]any
				if c.Function.Name == "" || (json.Unmarshal([]byte(c.Function.Arguments), &obj) != nil && !partial) {
					t.Fatalf("%s: bad call %+v from %q", format, c, text)
				}
			}
		}
	})
}
