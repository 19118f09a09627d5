package runner

import (
	"errors"
	"testing"

	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
)

// Every family's forced call grammar (tool_choice required or named), run by
// llama.cpp's own grammar engine as a plain (not lazy) sampler: llama.cpp takes it, the
// family's call fits from the reply's first token, text before the call does not, a
// grammar naming another function refuses the call, and after a think block the
// prompt opened (chat.ForcedAfterThinking) the call fits once the block is closed.
func TestForcedGrammarsFitFamilyCalls(t *testing.T) {
	m := testModel(t)
	const a = `{"city": "Paris", "unit": "C"}`
	cases := []struct {
		f    chat.Format
		call string
	}{
		{chat.FormatHermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + a + "}\n</tool_call>"},
		{chat.FormatLlama3, `<|python_tag|>{"name": "get_weather", "parameters": ` + a + `}`},
		{chat.FormatLlama3, `{"name": "get_weather", "parameters": ` + a + `}`},
		{chat.FormatMistral, `[TOOL_CALLS][{"name": "get_weather", "arguments": ` + a + `}]`},
		{chat.FormatMistralArgs, `[TOOL_CALLS]get_weather[ARGS]` + a},
		{chat.FormatGranite, `<|tool_call|>[{"name": "get_weather", "arguments": ` + a + `}]`},
		{chat.FormatCommandR7B, "<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", \"parameters\": " + a + "}\n]<|END_ACTION|>"},
		{chat.FormatKimiK2, `<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>` + a + `<|tool_call_end|><|tool_calls_section_end|>`},
		{chat.FormatDeepSeek, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>` + a + `<｜tool▁call▁end｜><｜tool▁calls▁end｜>`},
		{chat.FormatFunctionaryV31, `<function=get_weather>` + a + `</function>`},
		{chat.FormatQwenXML, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>"},
		{chat.FormatGLM, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"},
		{chat.FormatMiniMax, "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n</invoke>\n</minimax:tool_call>"},
		{chat.FormatDeepSeekDSML, "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"},
		{chat.FormatHarmony, `<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>` + a},
		{chat.FormatLFM2, `<|tool_call_start|>[get_weather(city="Paris", unit="C")]<|tool_call_end|>`},
		{chat.FormatFunctionaryV32, "get_weather\n" + a},
	}
	run := func(f chat.Format, g, text string) error {
		t.Helper()
		if err := m.CheckGrammar(g); err != nil {
			t.Fatalf("%s: llama.cpp refuses the grammar: %v\n%s", f, err, g)
		}
		s, err := llama.NewSampler(m, samplerParams(engine.SamplingParams{Grammar: g}))
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		defer s.Free()
		toks, err := m.Tokenize(text, false, false)
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
	for _, c := range cases {
		for _, named := range []string{"", "get_weather"} {
			g, ok, err := chat.ForcedGrammar(c.f, weather, named, false)
			if err != nil || !ok {
				t.Fatalf("%s: ok %v err %v", c.f, ok, err)
			}
			if err := run(c.f, g, c.call); err != nil {
				t.Errorf("%s named %q: the call does not fit from the first token: %v\n%s", c.f, named, err, c.call)
			}
			if err := run(c.f, g, "Let me check that. "+c.call); !errors.Is(err, llama.ErrGrammar) {
				t.Errorf("%s named %q: free text before a forced call fits (err %v)", c.f, named, err)
			}
		}
		other, _, _ := chat.ForcedGrammar(c.f, weather, "get_time", false)
		if err := run(c.f, other, c.call); !errors.Is(err, llama.ErrGrammar) {
			t.Errorf("%s: the grammar of named get_time takes a get_weather call (err %v)", c.f, err)
		}
		if c.f == chat.FormatHarmony {
			continue // reasons in its analysis channel, not in think tags
		}
		g, _, _ := chat.ForcedGrammar(c.f, weather, "", false)
		tg := chat.ForcedAfterThinking(g, "<|im_start|>assistant\n<think>\n")
		if err := run(c.f, tg, "The user wants Paris.</think>\n\n"+c.call); err != nil {
			t.Errorf("%s: a call after the think block does not fit: %v", c.f, err)
		}
	}
}
