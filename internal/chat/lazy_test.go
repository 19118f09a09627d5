package chat

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
)

var lazyTools = []Tool{
	{Type: "function", Function: ToolFunction{Name: "get_weather", Parameters: json.RawMessage(`{"type":"object","properties":{"city":{"type":"string"},"unit":{"enum":["C","F"]}},"required":["city"]}`)}},
	{Type: "function", Function: ToolFunction{Name: "get_time", Parameters: json.RawMessage(`{"type":"object","properties":{"zone":{"type":"string"}},"required":["zone"]}`)}},
}

// Each family's auto grammar starts on the family's own call opener, and only there
// (Harmony's and Functionary v3.2's patterns: TestAutoGrammarFamilyTriggers).
func TestAutoGrammarTriggersPerFamily(t *testing.T) {
	words := map[Format][]string{
		FormatHermes:         {"<tool_call>"},
		FormatLlama3:         {"<|python_tag|>"},
		FormatMistral:        {"[TOOL_CALLS]"},
		FormatMistralArgs:    {"[TOOL_CALLS]"},
		FormatGranite:        {"<|tool_call|>"},
		FormatCommandR7B:     {"<|START_ACTION|>"},
		FormatKimiK2:         {"<|tool_calls_section_begin|>"},
		FormatDeepSeek:       {"<｜tool▁calls▁begin｜>"},
		FormatFunctionaryV31: {"<function="},
		FormatQwenXML:        {"<tool_call>"},
		FormatGLM:            {"<tool_call>"},
		FormatMiniMax:        {"<minimax:tool_call>"},
		FormatDeepSeekDSML:   {"<｜DSML｜function_calls>"},
		FormatLFM2:           {"<|tool_call_start|>"},
	}
	for f, want := range words {
		g, trig, ok, err := AutoGrammar(f, lazyTools, false)
		if err != nil || !ok {
			t.Fatalf("%s: ok %v err %v", f, ok, err)
		}
		var got []string
		for _, tr := range trig {
			if tr.Word != "" {
				got = append(got, tr.Word)
			}
		}
		if strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("%s: trigger words %q, want %q", f, got, want)
		}
		// The grammar's start is the trigger word: llama.cpp feeds it from there.
		if !strings.Contains(g, "root ::= ") || !strings.Contains(g, strings.Trim(q(want[0]), `"`)) {
			t.Errorf("%s: grammar does not start with its trigger:\n%s", f, g)
		}
		for _, name := range []string{"get_weather", "get_time"} {
			if !strings.Contains(g, name) {
				t.Errorf("%s: grammar lacks tool %s", f, name)
			}
		}
	}
	if _, _, ok, _ := AutoGrammar(FormatHermes, nil, false); ok {
		t.Error("a grammar without tools")
	}
}

// The pattern triggers (bare JSON calls) fire on a call object that names a declared
// tool, and not on other JSON or prose. llama.cpp matches them against the whole output
// (std::regex_match); Go's regexp reads the same syntax, anchored here.
func TestAutoGrammarPatternTriggers(t *testing.T) {
	cases := []struct {
		f          Format
		fire, keep []string
	}{
		{FormatHermes,
			[]string{`{"name": "get_weather"`, ` {"name":"get_time", "arguments": {`},
			[]string{`{"name": "other"`, `Sure: {"name": "get_weather"`, `{"city": "Paris"}`, `{"name": "get_weathe`}},
		{FormatLlama3,
			[]string{`{"name": "get_weather"`, `Calling it: {"name": "get_time", "parameters": {}}`},
			[]string{`{"name": "other"`, `The JSON is {"a": 1}`}},
	}
	for _, c := range cases {
		_, trig, _, _ := AutoGrammar(c.f, lazyTools, false)
		var res []*regexp.Regexp
		for _, tr := range trig {
			if tr.Pattern != "" {
				res = append(res, regexp.MustCompile(`^(?:`+tr.Pattern+`)$`))
			}
		}
		if len(res) == 0 {
			t.Fatalf("%s: no pattern trigger", c.f)
		}
		fires := func(s string) bool {
			for _, re := range res {
				if re.MatchString(s) {
					return true
				}
			}
			return false
		}
		for _, s := range c.fire {
			if !fires(s) {
				t.Errorf("%s: %q does not trigger", c.f, s)
			}
		}
		for _, s := range c.keep {
			if fires(s) {
				t.Errorf("%s: %q triggers", c.f, s)
			}
		}
	}
}

// Tools whose schemas both use $defs with the same names get separate rules.
func TestAutoGrammarSeparatesToolRefs(t *testing.T) {
	tools := []Tool{
		{Function: ToolFunction{Name: "a", Parameters: json.RawMessage(`{"$defs":{"x":{"type":"string"}},"type":"object","properties":{"v":{"$ref":"#/$defs/x"}}}`)}},
		{Function: ToolFunction{Name: "b", Parameters: json.RawMessage(`{"$defs":{"x":{"type":"integer"}},"type":"object","properties":{"v":{"$ref":"#/$defs/x"}}}`)}},
	}
	g, _, _, err := AutoGrammar(FormatHermes, tools, false)
	if err != nil || !strings.Contains(g, "t0-ref--defs-x ::= string") || !strings.Contains(g, "t1-ref--defs-x ::= integer") {
		t.Fatalf("err %v\n%s", err, g)
	}
	// A tool schema's pattern is relaxed (any string), not refused.
	g, _, _, err = AutoGrammar(FormatHermes, []Tool{{Function: ToolFunction{Name: "p", Parameters: json.RawMessage(`{"type":"string","pattern":"^a"}`)}}}, false)
	if err != nil || !strings.Contains(g, "t0-args ::= string") && !strings.Contains(g, "::= string") {
		t.Fatalf("a pattern in a tool schema: err %v\n%s", err, g)
	}
}

// With a prompt that opens a think block, a call opener inside the reasoning does not
// trigger the grammar; the same opener after the block closes does.
func TestTriggersAfterThinking(t *testing.T) {
	_, trig, _, _ := AutoGrammar(FormatHermes, lazyTools, false)
	th := TriggersAfterThinking(trig)
	if len(th) != len(trig) {
		t.Fatalf("%d triggers, want %d", len(th), len(trig))
	}
	var res []*regexp.Regexp
	for _, tr := range th {
		if tr.Word != "" {
			t.Fatalf("a word trigger survives: %q (its token would fire inside reasoning)", tr.Word)
		}
		res = append(res, regexp.MustCompile(`^(?:`+tr.Pattern+`)$`))
	}
	fires := func(s string) string {
		for _, re := range res {
			if m := re.FindStringSubmatch(s); m != nil {
				return m[1]
			}
		}
		return ""
	}
	if got := fires("I could use <tool_call> here, or answer directly."); got != "" {
		t.Fatalf("fired inside reasoning: %q", got)
	}
	if got := fires("Use the tool.</think>\n\n<tool_call>\n{"); got != "<tool_call>" {
		t.Fatalf("after reasoning: %q, want the opener", got)
	}
	if got := fires("Done.</think>{\"name\": \"get_time\""); got != `{"name": "get_time"` {
		t.Fatalf("bare call after reasoning: %q", got)
	}
}

// Mistral Nemo and Granite lists and Qwen3-Coder XML calls stream while they are
// written: the header once the name is complete, arguments before the reply ends (XML:
// parameter by parameter), and the deltas rebuild exactly the calls Finish returns.
func TestListAndXMLCallsStream(t *testing.T) {
	cases := []struct {
		f     Format
		text  string
		early []string // argument pieces that must have gone out before the reply ended
	}{
		{FormatMistral, `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon", "list": [{"x": 1}, {"name": "add", "arguments": {}}]}, "id": "a1B2c3D4e"}, {"name": "add", "arguments": {"a": 1, "b": 2}, "id": "Zz9Yy8Xx7"}]`,
			[]string{`{"city": "Lyon"`, `{"a": 1`}},
		{FormatGranite, `<|tool_call|>[{"name": "add", "arguments": {"a": 7, "b": 8}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]`,
			[]string{`{"a": 7`, `{"city": "Oslo"`}},
		{FormatQwenXML, "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
			[]string{`{"city": "New York"`, `, "days": 3`, `{"a": 1}`}},
	}
	for _, c := range cases {
		s := NewCallStreamWith(c.f, familyTools).LiveCalls()
		var deltas []CallDelta
		var earlyArgs []string
		for i := 0; i < len(c.text); i += 3 {
			s.Push(c.text[i:min(i+3, len(c.text))])
			for _, d := range s.Deltas() {
				deltas = append(deltas, d)
				earlyArgs = append(earlyArgs, d.Args)
			}
		}
		fin := s.Finish()
		deltas = append(deltas, s.Deltas()...)
		joined := strings.Join(earlyArgs, "")
		for _, want := range c.early {
			if !strings.Contains(joined, want) {
				t.Errorf("%s: %q was not streamed before the end (streamed %q)", c.f, want, earlyArgs)
			}
		}
		var rebuilt []ToolCall
		for _, d := range deltas {
			if d.Index == len(rebuilt) {
				rebuilt = append(rebuilt, ToolCall{ID: d.ID, Type: "function", Function: FunctionCall{Name: d.Name}})
			}
			rebuilt[d.Index].Function.Arguments += d.Args
		}
		if len(rebuilt) != 2 || len(fin.Calls) != 2 {
			t.Fatalf("%s: rebuilt %+v, Finish %+v", c.f, rebuilt, fin)
		}
		for i := range rebuilt {
			if rebuilt[i] != fin.Calls[i] {
				t.Errorf("%s: call %d rebuilt %+v, Finish %+v", c.f, i, rebuilt[i], fin.Calls[i])
			}
		}
	}
}

// In the families whose parser cuts a call at its closing tag before reading the JSON,
// the grammar keeps that tag's start out of the JSON strings (a '<' alone is fine), so
// every call it allows parses.
func TestAutoGrammarStringsCannotCloseTheCall(t *testing.T) {
	cases := []struct {
		f         Format
		open, end string // around the arguments
		tag       string
	}{
		{FormatHermes, `<tool_call>{"name": "get_weather", "arguments": `, `}</tool_call>`, "</tool_call>"},
		{FormatFunctionaryV31, `<function=get_weather>`, `</function>`, "</function>"},
		{FormatKimiK2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>`, `<|tool_call_end|><|tool_calls_section_end|>`, "<|tool_call_end|>"},
		{FormatDeepSeek, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>`, `<｜tool▁call▁end｜><｜tool▁calls▁end｜>`, "<｜tool▁call▁end｜>"},
		{FormatCommandR7B, `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": `, `}]<|END_ACTION|>`, "<|END_ACTION|>"},
	}
	for _, c := range cases {
		g, _, _, err := AutoGrammar(c.f, lazyTools, false)
		if err != nil {
			t.Fatal(err)
		}
		gr, err := parseGBNF(g)
		if err != nil {
			t.Fatalf("%s: %v", c.f, err)
		}
		ok := c.open + `{"city": "a < b <"}` + c.end
		if !gr.accepts(ok) || len(ParseWith(c.f, ok, lazyTools).Calls) != 1 {
			t.Errorf("%s: %q: accepted %v, parsed %+v", c.f, ok, gr.accepts(ok), ParseWith(c.f, ok, lazyTools))
		}
		bad := c.open + `{"city": "a ` + c.tag + `"}` + c.end
		if gr.accepts(bad) {
			t.Errorf("%s: the grammar accepts %q (parsed: %+v)", c.f, bad, ParseWith(c.f, bad, lazyTools))
		}
	}
}
