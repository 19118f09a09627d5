package runner

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"

	"github.com/polykv/polykv/internal/testmodel"
)

func testModel(t *testing.T) *llama.Model {
	t.Helper()
	p := testmodel.SmolLM2(t)
	llama.Init()
	m, err := llama.LoadModel(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Free)
	return m
}

var weather = []chat.Tool{
	{Type: "function", Function: chat.ToolFunction{Name: "get_weather", Parameters: json.RawMessage(`{"type":"object","properties":{"city":{"type":"string"},"unit":{"enum":["C","F"]}},"required":["city"]}`)}},
	{Type: "function", Function: chat.ToolFunction{Name: "get_time", Parameters: json.RawMessage(`{"type":"object","properties":{"zone":{"type":"string"}},"required":["zone"]}`)}},
}

// Every family's auto grammar, run by llama.cpp's own grammar engine as a lazy sampler:
// a real call of the family after free text fits (and the family's parser reads it
// back as that call), and the same call with an argument the schema does not declare
// fails with ErrGrammar at the bad token (never an abort).
func TestAutoGrammarsFitFamilyCalls(t *testing.T) {
	m := testModel(t)
	cases := []struct {
		f    chat.Format
		call string // @A stands for the arguments object
	}{
		{chat.FormatHermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": @A}\n</tool_call>"},
		{chat.FormatHermes, `{"name": "get_weather", "arguments": @A}`},
		{chat.FormatLlama3, `<|python_tag|>{"name": "get_weather", "parameters": @A}`},
		{chat.FormatLlama3, `{"name": "get_weather", "parameters": @A}`},
		{chat.FormatMistral, `[TOOL_CALLS][{"name": "get_weather", "arguments": @A}]`},
		{chat.FormatMistralArgs, `[TOOL_CALLS]get_weather[ARGS]@A`},
		{chat.FormatGranite, `<|tool_call|>[{"name": "get_weather", "arguments": @A}]`},
		{chat.FormatCommandR7B, "<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", \"parameters\": @A}\n]<|END_ACTION|>"},
		{chat.FormatKimiK2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>@A<|tool_call_end|><|tool_calls_section_end|>`},
		{chat.FormatDeepSeek, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>@A<｜tool▁call▁end｜><｜tool▁calls▁end｜>`},
		{chat.FormatDeepSeek, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n@A\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"},
		{chat.FormatFunctionaryV31, `<function=get_weather>@A</function>`},
	}
	const good, bad = `{"city": "Paris", "unit": "C"}`, `{"town": "Paris"}`
	for _, c := range cases {
		g, trig, ok, err := chat.AutoGrammar(c.f, weather, false)
		if err != nil || !ok {
			t.Fatalf("%s: ok %v err %v", c.f, ok, err)
		}
		if err := m.CheckGrammar(g); err != nil {
			t.Fatalf("%s: llama.cpp refuses the grammar: %v\n%s", c.f, err, g)
		}
		prefix := "Let me check that. " // free text before the trigger
		if c.f == chat.FormatHermes && strings.HasPrefix(c.call, "{") {
			prefix = "" // a bare Hermes call object is a call only as the whole reply
		}
		run := func(args string) error {
			p := engine.SamplingParams{Grammar: g}
			for _, tr := range trig {
				p.GrammarTriggers = append(p.GrammarTriggers, engine.GrammarTrigger{Word: tr.Word, Pattern: tr.Pattern})
			}
			s, err := llama.NewSampler(m, samplerParams(p))
			if err != nil {
				t.Fatalf("%s: %v", c.f, err)
			}
			defer s.Free()
			toks, err := m.Tokenize(prefix+strings.ReplaceAll(c.call, "@A", args), false, false)
			if err != nil {
				t.Fatal(err)
			}
			for _, tok := range toks {
				if err := s.Accept(tok); err != nil {
					return err
				}
			}
			return nil
		}
		if err := run(good); err != nil {
			t.Errorf("%s: a well-formed call does not fit: %v\n%s", c.f, err, c.call)
		}
		if err := run(bad); !errors.Is(err, llama.ErrGrammar) {
			t.Errorf("%s: an undeclared argument fits (err %v)\n%s", c.f, err, c.call)
		}
		p := chat.ParseWith(c.f, prefix+strings.ReplaceAll(c.call, "@A", good), weather)
		if len(p.Calls) != 1 || p.Calls[0].Function.Name != "get_weather" || !strings.Contains(p.Calls[0].Function.Arguments, "Paris") {
			t.Errorf("%s: the parser does not read the call back: %+v", c.f, p)
		}
	}
}

// The auto grammars of the families whose calls are not a JSON object in a wrapper
// (text values, Harmony headers, Python calls, recipient lines), run by llama.cpp's
// grammar engine as lazy samplers: llama.cpp takes each grammar, a call in the family's
// own layout after free text fits and is read back by the parser, and a call with an
// undeclared parameter fails at the bad token.
func TestAutoGrammarsFitTextFamilyCalls(t *testing.T) {
	m := testModel(t)
	const prefix = "Let me check that. "
	cases := []struct {
		f                 chat.Format
		prefix, good, bad string
	}{
		{chat.FormatQwenXML, prefix,
			"<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <b>\n</parameter>\n<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>",
			"<tool_call>\n<function=get_weather>\n<parameter=town>\nParis\n</parameter>\n</function>\n</tool_call>"},
		{chat.FormatGLM, prefix,
			"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>C</arg_value>\n</tool_call>",
			"<tool_call>get_weather\n<arg_key>town</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"},
		{chat.FormatMiniMax, prefix,
			"<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"unit\">C</parameter>\n</invoke>\n</minimax:tool_call>",
			"<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"town\">Paris</parameter>\n</invoke>\n</minimax:tool_call>"},
		{chat.FormatDeepSeekDSML, prefix,
			"<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
			"<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"town\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"},
		{chat.FormatHarmony, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant",
			`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "C"}`,
			`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town": "Paris"}`},
		{chat.FormatLFM2, prefix,
			`<|tool_call_start|>[get_weather(city="Paris", unit="C")]<|tool_call_end|>`,
			`<|tool_call_start|>[get_weather(town="Paris")]<|tool_call_end|>`},
		{chat.FormatFunctionaryV32, "all\nLet me check that.>>>",
			"get_weather\n{\"city\": \"Paris\", \"unit\": \"C\"}",
			"get_weather\n{\"town\": \"Paris\"}"},
	}
	for _, c := range cases {
		g, trig, ok, err := chat.AutoGrammar(c.f, weather, false)
		if err != nil || !ok {
			t.Fatalf("%s: ok %v err %v", c.f, ok, err)
		}
		if err := m.CheckGrammar(g); err != nil {
			t.Fatalf("%s: llama.cpp refuses the grammar: %v\n%s", c.f, err, g)
		}
		run := func(call string) error {
			p := engine.SamplingParams{Grammar: g}
			for _, tr := range trig {
				p.GrammarTriggers = append(p.GrammarTriggers, engine.GrammarTrigger{Word: tr.Word, Pattern: tr.Pattern})
			}
			s, err := llama.NewSampler(m, samplerParams(p))
			if err != nil {
				t.Fatalf("%s: %v", c.f, err)
			}
			defer s.Free()
			toks, err := m.Tokenize(c.prefix+call, false, false)
			if err != nil {
				t.Fatal(err)
			}
			for _, tok := range toks {
				if err := s.Accept(tok); err != nil {
					return err
				}
			}
			return nil
		}
		if err := run(c.good); err != nil {
			t.Errorf("%s: a well-formed call does not fit: %v\n%s", c.f, err, c.good)
		}
		if err := run(c.bad); !errors.Is(err, llama.ErrGrammar) {
			t.Errorf("%s: an undeclared parameter fits (err %v)\n%s", c.f, err, c.bad)
		}
		p := chat.ParseWith(c.f, c.prefix+c.good, weather)
		if len(p.Calls) != 1 || p.Calls[0].Function.Name != "get_weather" || !strings.Contains(p.Calls[0].Function.Arguments, "Paris") {
			t.Errorf("%s: the parser does not read the call back: %+v", c.f, p)
		}
	}
}

// A lazy grammar's triggers are matched here, not by llama.cpp (whose std::regex
// matcher overflows the stack on long output): after 40 KB of free text a trigger
// (a word, or a pattern looking anywhere) still starts the grammar, which then
// constrains the call (a declared argument fits, an undeclared one fails), also when
// the trigger begins inside a token; without a trigger the reply stays free.
func TestLazyGrammarAfterLongFreeText(t *testing.T) {
	m := testModel(t)
	b := NewBackend(m, nil, nil)
	params := func(f chat.Format) engine.SamplingParams {
		g, trig, _, _ := chat.AutoGrammar(f, weather, false)
		p := engine.SamplingParams{Grammar: g}
		for _, tr := range trig {
			p.GrammarTriggers = append(p.GrammarTriggers, engine.GrammarTrigger{Word: tr.Word, Pattern: tr.Pattern})
		}
		return p
	}
	hermes, llama3 := params(chat.FormatHermes), params(chat.FormatLlama3)
	long := strings.Repeat("Some free text about the weather. ", 1200) // 40 KB
	const good = `{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`
	const bad = `{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>`
	midToken := false
	for _, c := range []struct {
		p          engine.SamplingParams
		free, call string
		fits       bool // false: no trigger, or the call breaks the grammar
		trigger    bool
	}{
		{hermes, long, "", false, false},
		{hermes, long + "Let me check.", "<tool_call>\n" + good, true, true},
		{hermes, long + "Let me check.", "<tool_call>\n" + bad, false, true},
		{hermes, "", `{"name": "get_weather", "arguments": {"city": "Oslo"}}`, true, true}, // the bare-call pattern
		// Llama 3.x: a pattern that looks for the call anywhere in the output.
		{llama3, long + "Calling it: ", `{"name": "get_weather", "parameters": {"city": "Paris"}}`, true, true},
		{llama3, long + "Calling it: ", `{"name": "get_weather", "parameters": {"town": "Paris"}}`, false, true},
	} {
		b.NewSampler(1, c.p, false, nil)
		smp := b.samplers[1]
		if smp.s.HasGrammar() || smp.lazy == nil {
			t.Fatal("a lazy grammar constrains from the start")
		}
		toks, _ := m.Tokenize(c.free+c.call, false, false)
		n, failed := 0, error(nil)
		for _, tok := range toks {
			piece := m.TokenPiece(tok, true)
			if smp.lazy == nil && !smp.s.HasGrammar() {
				t.Fatalf("%.30q: the grammar was dropped", c.call)
			}
			if smp.s.HasGrammar() && n < len(c.free) {
				t.Fatalf("%.30q: the grammar started in the free text (byte %d of %d)", c.call, n, len(c.free))
			}
			if err := smp.s.Accept(tok); err != nil {
				failed = err
				break
			}
			if n < len(c.free) && n+len(piece) > len(c.free) {
				midToken = true // the call starts inside this token
			}
			n += len(piece)
			if smp.lazy != nil {
				b.watchFreeText(1, smp, tok)
			}
		}
		if c.trigger != smp.s.HasGrammar() && failed == nil || (failed == nil) != c.fits && c.trigger {
			t.Errorf("%.40q: grammar %v, err %v; want trigger %v, fits %v", c.call, smp.s.HasGrammar(), failed, c.trigger, c.fits)
		}
		if failed != nil && !errors.Is(failed, llama.ErrGrammar) {
			t.Errorf("%.40q: %v", c.call, failed)
		}
		b.FreeSampler(1)
	}
	if !midToken {
		t.Error("no trigger began inside a token: the test text no longer covers that case")
	}
	if len(b.samplers) != 0 {
		t.Fatal("sampler leaked")
	}
}
