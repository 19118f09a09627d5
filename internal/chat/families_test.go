package chat

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var familyTools = func() []Tool {
	var tools []Tool
	_ = json.Unmarshal([]byte(`[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}},
		{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]`), &tools)
	return tools
}()

type familyCase struct {
	name    string
	format  Format
	text    string
	content string
	reason  string
	calls   []string // name + " " + arguments
}

// Output samples in each family's own syntax, as the models write them (shapes from
// the families' chat templates and model cards), including partial and malformed ones.
var familyCases = []familyCase{
	{"hermes/qwen2.5", FormatHermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", "", "", []string{`get_weather {"city": "Paris"}`}},
	{"hermes/two calls and text", FormatHermes, "Checking both.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>", "Checking both.", "", []string{`add {"a": 1, "b": 2}`, `get_weather {"city": "Rome"}`}},
	{"hermes/bare json reply", FormatHermes, `{"name": "add", "arguments": {"a": 2, "b": 3}}`, "", "", []string{`add {"a": 2, "b": 3}`}},
	{"hermes/unknown bare json stays", FormatHermes, `{"name": "rm_rf", "arguments": {}}`, `{"name": "rm_rf", "arguments": {}}`, "", nil},
	{"hermes/truncated", FormatHermes, "<tool_call>\n{\"name\": \"get_weather\", \"argum", "<tool_call>\n{\"name\": \"get_weather\", \"argum", "", nil},

	{"qwen3-coder xml", FormatQwenXML, "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n</tool_call>", "", "", []string{`get_weather {"city": "New York", "days": 3, "zip": "10001"}`}},
	{"qwen3.5 xml with text", FormatQwenXML, "Let me look.\n\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>", "Let me look.", "", []string{`add {"a": 1, "b": 2}`}},
	{"qwen xml malformed", FormatQwenXML, "<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>", "", nil},

	{"llama3.1 python_tag", FormatLlama3, `<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}`, "", "", []string{`get_weather {"city": "Oslo"}`}},
	{"llama3.2 bare json", FormatLlama3, `{"type": "function", "name": "add", "parameters": {"a": 4, "b": 5}}`, "", "", []string{`add {"a": 4, "b": 5}`}},
	{"llama3 text around json", FormatLlama3, `Sure, I will call it: {"name": "add", "parameters": {"a": 1, "b": 1}} and tell you.`, "Sure, I will call it:  and tell you.", "", []string{`add {"a": 1, "b": 1}`}},
	{"llama3 prose", FormatLlama3, "The answer is {probably} 4.", "The answer is {probably} 4.", "", nil},

	{"mistral nemo", FormatMistral, `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}, "id": "a1B2c3D4e"}]`, "", "", []string{`get_weather {"city": "Lyon"}`}},
	{"mistral small 3.2", FormatMistralArgs, `[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}`, "", "", []string{`get_weather {"city": "Nice"}`}},
	{"devstral two calls", FormatMistralArgs, `I'll do both.[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}`, "I'll do both.", "", []string{`add {"a": 1, "b": 2}`, `get_weather {"city": "Bern"}`}},
	{"magistral call id", FormatMistralArgs, `[TOOL_CALLS]add[CALL_ID]x9Y8z7W6v[ARGS]{"a": 0, "b": 0}`, "", "", []string{`add {"a": 0, "b": 0}`}},
	{"mistral args malformed", FormatMistralArgs, `[TOOL_CALLS]add[ARGS]{"a": 1,`, `[TOOL_CALLS]add[ARGS]{"a": 1,`, "", nil},

	{"gpt-oss call", FormatHarmony, `<|channel|>analysis<|message|>Need weather; call tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}<|call|>`, "", "Need weather; call tool.", []string{`get_weather {"city": "Tokyo"}`}},
	{"gpt-oss recipient in header", FormatHarmony, `<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 2}<|call|>`, "", "Add them.", []string{`add {"a": 2, "b": 2}`}},
	{"gpt-oss final", FormatHarmony, `<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>`, "It is 4.", "Simple.", nil},

	{"deepseek r1", FormatDeepSeek, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", "", []string{`get_weather {"city": "Paris"}`}},
	{"deepseek v3.1", FormatDeepSeek, "Calling.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 3, \"b\": 4}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Kyiv\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Calling.", "", []string{`add {"a": 3, "b": 4}`, `get_weather {"city": "Kyiv"}`}},
	{"deepseek malformed", FormatDeepSeek, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": <｜tool▁call▁end｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": <｜tool▁call▁end｜>", "", nil},
	{"deepseek v3.2 dsml", FormatDeepSeekDSML, "\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Lima</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", "", "", []string{`get_weather {"city": "Lima", "days": 2}`}},

	{"kimi k2", FormatKimiK2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Seoul"}<|tool_call_end|><|tool_calls_section_end|>`, "", "", []string{`get_weather {"city": "Seoul"}`}},

	{"glm 4.6", FormatGLM, "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n</tool_call>", "", "", []string{`get_weather {"city": "Beijing", "days": 5}`}},
	{"glm 4.7 compact", FormatGLM, "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>2</arg_value></tool_call>", "", "", []string{`add {"a": 1, "b": 2}`}},
	{"glm malformed", FormatGLM, "<tool_call>add<arg_key>a</arg_key></tool_call>", "<tool_call>add<arg_key>a</arg_key></tool_call>", "", nil},

	{"minimax m2", FormatMiniMax, "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Cairo</parameter>\n</invoke>\n</minimax:tool_call>", "", "", []string{`get_weather {"city": "Cairo"}`}},

	{"granite 3.3", FormatGranite, `<|tool_call|>[{"name": "add", "arguments": {"a": 7, "b": 8}}]`, "", "", []string{`add {"a": 7, "b": 8}`}},

	{"command r7b", FormatCommandR7B, `<|START_THINKING|>I should add.<|END_THINKING|><|START_ACTION|>[
    {"tool_call_id": "0", "tool_name": "add", "parameters": {"a": 1, "b": 9}}
]<|END_ACTION|>`, "", "I should add.", []string{`add {"a": 1, "b": 9}`}},
	{"command r7b response", FormatCommandR7B, `<|START_RESPONSE|>Ten.<|END_RESPONSE|>`, "Ten.", "", nil},

	{"functionary 3.1", FormatFunctionaryV31, `<function=get_weather>{"city": "Rio"}</function>`, "", "", []string{`get_weather {"city": "Rio"}`}},
	{"functionary 3.1 python", FormatFunctionaryV31, "<|python_tag|>print(2+2)", "", "", []string{`python {"code":"print(2+2)"}`}},
	{"functionary 3.2 call", FormatFunctionaryV32, "get_weather\n{\"city\": \"Quito\"}", "", "", []string{`get_weather {"city": "Quito"}`}},
	{"functionary 3.2 text then call", FormatFunctionaryV32, "all\nLet me check.>>>add\n{\"a\": 1, \"b\": 2}", "Let me check.", "", []string{`add {"a": 1, "b": 2}`}},
	{"functionary 3.2 text", FormatFunctionaryV32, "all\nHello there.", "Hello there.", "", nil},

	{"lfm2 pythonic", FormatLFM2, `<|tool_call_start|>[get_weather(city="Accra", days=2), add(a=1, b=-2)]<|tool_call_end|>Done.`, "Done.", "", []string{`get_weather {"city":"Accra", "days": 2}`, `add {"a": 1, "b": -2}`}},
	{"lfm2 malformed", FormatLFM2, `<|tool_call_start|>[get_weather(city=Accra)]<|tool_call_end|>`, `<|tool_call_start|>[get_weather(city=Accra)]<|tool_call_end|>`, "", nil},

	{"forced hermes in another format", FormatKimiK2, `<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>`, "", "", []string{`add {"a": 1, "b": 1}`}},
}

func normArgs(t *testing.T, s string) string {
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("arguments %q are not JSON: %v", s, err)
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func checkParsed(t *testing.T, c familyCase, p Parsed, how string) {
	t.Helper()
	if p.Content != c.content || p.Reasoning != c.reason || len(p.Calls) != len(c.calls) {
		t.Fatalf("%s (%s): content %q reasoning %q calls %+v", c.name, how, p.Content, p.Reasoning, p.Calls)
	}
	for i, want := range c.calls {
		name, args, _ := strings.Cut(want, " ")
		got := p.Calls[i]
		if got.Function.Name != name || normArgs(t, got.Function.Arguments) != normArgs(t, args) || got.Type != "function" || got.ID == "" {
			t.Fatalf("%s (%s): call %d = %+v, want %s %s", c.name, how, i, got, name, args)
		}
	}
}

func TestParseEveryFamily(t *testing.T) {
	for _, c := range familyCases {
		checkParsed(t, c, ParseWith(c.format, c.text, familyTools), "whole")
	}
}

// Streaming gives the client the same content and calls as the whole reply, whatever
// the chunking (every 1..7 bytes, cut mid-marker and mid-rune alike).
func TestCallStreamEveryFamily(t *testing.T) {
	for _, c := range familyCases {
		for step := 1; step <= 7; step++ {
			// The API's path: a ReplyStream (reasoning split, then the CallStream).
			s := NewReplyStream(ReplyOptions{Format: c.format, Tools: familyTools, Calls: true, Reasoning: true})
			var live, reasoning strings.Builder
			for i := 0; i < len(c.text); i += step {
				r, t := s.Push(c.text[i:min(i+step, len(c.text))])
				live.WriteString(t)
				reasoning.WriteString(r)
			}
			fin := s.Finish()
			got := Parsed{Content: strings.TrimSpace(live.String() + fin.Content), Reasoning: strings.TrimSpace(reasoning.String() + fin.Reasoning), Calls: fin.Calls}
			want := c
			if len(c.calls) == 0 && c.reason == "" {
				want.content = strings.TrimSpace(contentWhenNoCall(c))
			}
			// Whitespace where the call was cut out may differ; the words may not.
			want.content = strings.Join(strings.Fields(want.content), " ")
			got.Content = strings.Join(strings.Fields(got.Content), " ")
			checkParsed(t, want, got, "stream")
		}
	}
}

// contentWhenNoCall: a reply without calls reaches a streaming client as written
// (prefix markers such as functionary's "all\n" removed).
func contentWhenNoCall(c familyCase) string {
	if c.format == FormatFunctionaryV32 || c.format == FormatCommandR7B {
		return c.content
	}
	return c.text
}

var mistralID = regexp.MustCompile(`^[a-zA-Z0-9]{9}$`)

func TestToolCallIDsInTheTemplatesForm(t *testing.T) {
	for _, f := range []Format{FormatMistral, FormatMistralArgs} {
		p := ParseWith(f, `[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}`, nil)
		if f == FormatMistral {
			p = ParseWith(f, `[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]`, nil)
		}
		if len(p.Calls) != 1 || !mistralID.MatchString(p.Calls[0].ID) {
			t.Fatalf("%s id %+v", f, p.Calls)
		}
	}
	// Kimi's ids are the model's own functions.NAME:IDX, which its template numbers.
	p := ParseWith(FormatKimiK2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.add:3<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>`, nil)
	if len(p.Calls) != 1 || p.Calls[0].ID != "functions.add:3" {
		t.Fatalf("kimi id %+v", p.Calls)
	}
	// And the next turn renders through a Mistral template that checks the form.
	src := `{%- for m in messages %}{%- for c in m.tool_calls or [] %}{%- if c.id is not string or c.id|length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}{%- endfor %}{%- endfor %}`
	c := ParseWith(FormatMistralArgs, `[TOOL_CALLS]add[ARGS]{"a": 1}`, nil).Calls[0]
	if _, err := NewRenderer(src, "", "").Render([]Message{{Role: "assistant", NullContent: true, ToolCalls: []ToolCall{c}}}, nil, false); err != nil {
		t.Fatalf("mistral template refused our id %q: %v", c.ID, err)
	}
}

// The corpus templates of each family are detected as that family's format.
func TestDetectFormatOnCorpus(t *testing.T) {
	dir := corpusDir(t)
	want := map[string]Format{
		"NousResearch-Hermes-3-Llama-3.1-8B-tool_use": FormatHermes, "Qwen-Qwen2.5-7B-Instruct": FormatHermes, "Qwen-Qwen3-0.6B": FormatHermes,
		"Qwen3-Coder": FormatQwenXML, "Qwen3.5-4B": FormatQwenXML, "meta-llama-Llama-3.1-8B-Instruct": FormatLlama3, "meta-llama-Llama-3.3-70B-Instruct": FormatLlama3,
		"mistralai-Mistral-Nemo-Instruct-2407": FormatMistral, "Mistral-Small-3.2-24B-Instruct-2506": FormatMistralArgs, "unsloth-mistral-Devstral-Small-2507": FormatMistralArgs,
		"openai-gpt-oss-120b": FormatHarmony, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": FormatDeepSeek, "llama-cpp-deepseek-r1": FormatDeepSeek, "deepseek-ai-DeepSeek-V3.1": FormatDeepSeek,
		"deepseek-ai-DeepSeek-V3.2": FormatDeepSeekDSML, "Kimi-K2-Instruct": FormatKimiK2, "GLM-4.6": FormatGLM, "GLM-4.7-Flash": FormatGLM, "MiniMax-M2": FormatMiniMax,
		"ibm-granite-granite-3.3-2B-Instruct": FormatGranite, "ibm-granite-granite-4.0": FormatHermes, "CohereForAI-c4ai-command-r7b-12-2024-tool_use": FormatCommandR7B,
		"meetkai-functionary-medium-v3.1": FormatFunctionaryV31, "meetkai-functionary-medium-v3.2": FormatFunctionaryV32, "LFM2-8B-A1B": FormatLFM2, "LFM2.5-8B-A1B": FormatLFM2,
	}
	for name, f := range want {
		b, err := os.ReadFile(filepath.Join(dir, name+".jinja"))
		if err != nil {
			t.Fatal(err)
		}
		if got := DetectFormat(string(b)); got != f {
			t.Errorf("%s: detected %s, want %s", name, got, f)
		}
	}
}

// With live calls, the deltas sent during and after the reply rebuild exactly the calls
// Finish returns; for formats with JSON arguments they arrive while the call is written.
func TestLiveCallDeltasEveryFamily(t *testing.T) {
	for _, c := range familyCases {
		if len(c.calls) == 0 {
			continue
		}
		for step := 1; step <= 5; step += 2 {
			s := NewCallStreamWith(c.format, familyTools).LiveCalls()
			var deltas []CallDelta
			early := 0
			for i := 0; i < len(c.text); i += step {
				s.Push(c.text[i:min(i+step, len(c.text))])
				d := s.Deltas()
				for _, x := range d {
					if x.Args != "" {
						early++
					}
				}
				deltas = append(deltas, d...)
			}
			fin := s.Finish()
			deltas = append(deltas, s.Deltas()...)
			var rebuilt []ToolCall
			for _, d := range deltas {
				if d.Index == len(rebuilt) {
					if d.ID == "" || d.Name == "" {
						t.Fatalf("%s: first delta of call %d lacks id or name: %+v", c.name, d.Index, d)
					}
					rebuilt = append(rebuilt, ToolCall{ID: d.ID, Type: "function", Function: FunctionCall{Name: d.Name}})
				}
				rebuilt[d.Index].Function.Arguments += d.Args
			}
			if len(rebuilt) != len(fin.Calls) {
				t.Fatalf("%s step %d: deltas rebuild %+v, Finish %+v", c.name, step, rebuilt, fin.Calls)
			}
			for i := range rebuilt {
				if rebuilt[i] != fin.Calls[i] {
					t.Fatalf("%s step %d: call %d rebuilt %+v, Finish %+v", c.name, step, i, rebuilt[i], fin.Calls[i])
				}
			}
			re := lookup(c.format).markers().head
			if jsonArgs := re != nil && re.MatchString(c.text) && !strings.Contains(c.text, "```"); jsonArgs && early == 0 {
				t.Fatalf("%s: no arguments streamed before the reply ended", c.name)
			}
		}
	}
	// A call cut short after its start streamed: no calls, no content repeating it.
	s := NewCallStreamWith(FormatHermes, familyTools).LiveCalls()
	s.Push(`<tool_call>{"name": "add", "arguments": {"a": 1, "b"`)
	if d := s.Deltas(); len(d) != 2 || d[0].Name != "add" || d[1].Args != `{"a": 1, "b"` {
		t.Fatalf("partial deltas %+v", d)
	}
	if fin := s.Finish(); !fin.Truncated || fin.Content != "" || len(fin.Calls) != 0 {
		t.Fatalf("cut short: %+v", fin)
	}
}

func TestJSONValuePrefix(t *testing.T) {
	for in, want := range map[string]int{`{"a": 1}, "x"`: 8, `{"a": "b\`: 8, `{"\`: 2, `{"a": [1, `: 9, `{"a"  `: 4, `nope`: 0, `{}`: 2} {
		if n, _ := jsonValuePrefix(in); n != want {
			t.Errorf("%q: %d, want %d", in, n, want)
		}
	}
}
