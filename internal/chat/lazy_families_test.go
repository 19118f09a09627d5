package chat

import (
	"encoding/json"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// The families whose auto grammar is built by xmlFamily, harmonyFamily, functionary32Family and lfm2Family.
var grammarFamilies = []Format{FormatQwenXML, FormatGLM, FormatMiniMax, FormatDeepSeekDSML, FormatHarmony, FormatLFM2, FormatFunctionaryV32}

// grammarTools declare a parameter of every kind the text forms tell apart: plain,
// bounded and enumerated strings, Optional[str], integers, numbers, booleans in a
// nested object, arrays, and a tool without parameters.
var grammarTools = []Tool{
	{Type: "function", Function: ToolFunction{Name: "get_weather", Parameters: json.RawMessage(`{"type": "object", "properties": {
		"city": {"type": "string", "description": "where"},
		"days": {"type": "integer"},
		"unit": {"enum": ["C", "F", "1"]},
		"note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
		"code": {"type": "string", "maxLength": 3},
		"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
		"opts": {"type": "object", "properties": {"deep": {"type": "boolean"}, "n": {"type": ["number", "null"]}}},
		"any": {}
	}, "required": ["city"]}`)}},
	{Type: "function", Function: ToolFunction{Name: "add", Parameters: json.RawMessage(`{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}`)}},
	{Type: "function", Function: ToolFunction{Name: "ping"}},
	{Type: "function", Function: ToolFunction{Name: "any_args", Parameters: json.RawMessage(`{}`)}},
}

// freeText is text a model may write before its call in each family (none of it
// starts the grammar). Harmony's depend on how the call's header starts.
func freeText(f Format, call string) []string {
	switch f {
	case FormatHarmony:
		analysis := "<|channel|>analysis<|message|>Need the tool: to=functions is next.<|end|>"
		switch {
		case strings.HasPrefix(call, " to="):
			return []string{"", analysis + "<|start|>assistant"}
		case strings.HasPrefix(call, "<|start|>"):
			return []string{"", analysis}
		}
		return []string{"", analysis + "<|start|>assistant"}
	case FormatFunctionaryV32:
		return []string{"", "all\nLet me check get_weather first.>>>"}
	case FormatGLM, FormatQwenXML:
		return []string{"", "Let me check.\n", "I could use <function=add> or </tool_call> text.\n"}
	}
	return []string{"", "Let me check.\n\n", "I'll call it: "}
}

// triggerStart is where llama.cpp's lazy sampler starts the grammar in text, as the
// text grows token by token (here: rune by rune): the first trigger that fires, at
// the start of its word or first capture group; -1 when none fires.
func triggerStart(trig []Trigger, text string) int {
	res := make([]*regexp.Regexp, len(trig))
	for i, tr := range trig {
		if tr.Pattern != "" {
			res[i] = regexp.MustCompile(`^(?:` + tr.Pattern + `)$`)
		}
	}
	for n := 1; n <= len(text); n++ {
		if !utf8.RuneStart(text[n-1]) && n < len(text) || n < len(text) && !utf8.RuneStart(text[n]) {
			continue
		}
		prefix := text[:n]
		for i, tr := range trig {
			if tr.Word != "" {
				if j := strings.Index(prefix, tr.Word); j >= 0 {
					return j
				}
				continue
			}
			if m := res[i].FindStringSubmatchIndex(prefix); m != nil {
				for g := 2; g < len(m); g += 2 {
					if m[g] >= 0 && m[g+1] > m[g] {
						return m[g]
					}
				}
				return m[0]
			}
		}
	}
	return -1
}

func toolSchemas(t *testing.T, tools []Tool) map[string]*jsonschema.Schema {
	t.Helper()
	out := map[string]*jsonschema.Schema{}
	for _, tool := range tools {
		p := strings.TrimSpace(string(tool.Function.Parameters))
		if p == "" || p == "null" {
			p = `{"type": "object", "properties": {}}`
		}
		out[tool.Function.Name] = compileTestSchema(t, p)
	}
	return out
}

// checkGrammarReply: a reply of free text and then a string the auto grammar derives
// triggers the grammar where that string starts (or where the grammar accepts the rest
// from), and both ParseWith and the streamed ReplyStream read from it the calls, each
// of a declared tool with arguments its schema accepts. It returns the calls.
func checkGrammarReply(t *testing.T, f Format, tools []Tool, schemas map[string]*jsonschema.Schema, gr *grammar, trig []Trigger, free, call string, parallel bool, cuts []byte) []ToolCall {
	t.Helper()
	text := free + call
	start := triggerStart(trig, text)
	if start < 0 || start > len(free) || !gr.accepts(text[start:]) {
		t.Fatalf("%s: the grammar does not start where the call does (trigger at %d, call at %d)\ntext: %q", f, start, len(free), text)
	}
	p := ParseWith(f, text, tools)
	if len(p.Calls) == 0 || !parallel && len(p.Calls) != 1 {
		t.Fatalf("%s: %d calls parsed from %q (content %q)", f, len(p.Calls), text, p.Content)
	}
	for _, c := range p.Calls {
		s, ok := schemas[c.Function.Name]
		if !ok {
			t.Fatalf("%s: call of undeclared %q from %q", f, c.Function.Name, text)
		}
		if !validates(s, c.Function.Arguments) {
			t.Fatalf("%s: arguments %s of %s break its schema\ntext: %q", f, c.Function.Arguments, c.Function.Name, text)
		}
	}
	// The API's path, in pieces: the same calls.
	for _, live := range []bool{false, true} {
		rs := NewReplyStream(ReplyOptions{Format: f, Tools: tools, Calls: true, Reasoning: true, Stream: live})
		rest := text
		for i := 0; rest != ""; i++ {
			n := len(rest)
			if i < len(cuts) {
				n = 0
				for k := 0; k < int(cuts[i])%7+1 && n < len(rest); k++ {
					_, size := utf8.DecodeRuneInString(rest[n:])
					n += size
				}
			}
			rs.Push(rest[:n])
			rs.Deltas()
			rest = rest[n:]
		}
		fin := rs.Finish()
		if len(fin.Calls) != len(p.Calls) {
			t.Fatalf("%s (stream, live %v): calls %+v, ParseWith %+v\ntext: %q", f, live, fin.Calls, p.Calls, text)
		}
		for i := range fin.Calls {
			if fin.Calls[i].Function != p.Calls[i].Function {
				t.Fatalf("%s (stream, live %v): call %d %+v, ParseWith %+v\ntext: %q", f, live, i, fin.Calls[i].Function, p.Calls[i].Function, text)
			}
		}
	}
	return p.Calls
}

// Every family's auto grammar, sampled: each derived call, after any free text the
// family allows, starts the grammar and is read back as declared tools called with
// schema-valid arguments, whole and streamed; and the samples reach every parameter.
func TestAutoGrammarFamiliesRoundTrip(t *testing.T) {
	schemas := toolSchemas(t, grammarTools)
	rng := rand.New(rand.NewPCG(7, 11))
	bytesOf := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		return b
	}
	for _, f := range grammarFamilies {
		for _, parallel := range []bool{false, true} {
			g, trig, ok, err := AutoGrammar(f, grammarTools, parallel)
			if err != nil || !ok {
				t.Fatalf("%s: ok %v err %v", f, ok, err)
			}
			gr, err := parseGBNF(g)
			if err != nil {
				t.Fatalf("%s: %v\n%s", f, err, g)
			}
			keys := map[string]bool{}
			names := map[string]bool{}
			several := false
			for i := 0; i < 150; i++ {
				call := gr.generate(&byteSource{b: bytesOf(200)}, 12)
				frees := freeText(f, call)
				calls := checkGrammarReply(t, f, grammarTools, schemas, gr, trig, frees[i%len(frees)], call, parallel, bytesOf(40))
				several = several || len(calls) > 1
				for _, c := range calls {
					names[c.Function.Name] = true
					var args map[string]any
					_ = json.Unmarshal([]byte(c.Function.Arguments), &args)
					for k := range args {
						keys[c.Function.Name+"."+k] = true
					}
				}
			}
			for _, k := range []string{"get_weather.city", "get_weather.days", "get_weather.unit", "get_weather.note", "get_weather.code", "get_weather.tags", "get_weather.opts", "get_weather.any", "add.a", "add.b"} {
				if !keys[k] {
					t.Errorf("%s: no sample set %s (seen %v)", f, k, keys)
				}
			}
			// Harmony ends the turn with each call (<|call|>): one per reply.
			if len(names) != len(grammarTools) || several != (parallel && f != FormatHarmony) {
				t.Errorf("%s parallel %v: tools called %v, several calls in a reply %v", f, parallel, names, several)
			}
		}
	}
}

// Hand-written calls in each family's own layout (as its template writes them) fit its
// grammar, and calls the schema forbids do not.
func TestAutoGrammarFamiliesFitRealCalls(t *testing.T) {
	cases := []struct {
		f        Format
		fit, bad []string
	}{
		{FormatQwenXML,
			[]string{"<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York <b>x</b> & </div>\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>",
				"<tool_call>\n<function=ping>\n</function>\n</tool_call>",
				"<tool_call><function=get_weather><parameter=city>Oslo</parameter><parameter=note>null</parameter></function></tool_call>",
				"<tool_call><function=get_weather><parameter=city>Oslo</parameter><parameter=tags>[\"<b>\", \"a <\\/b> <<\"]</parameter></function></tool_call>"},
			[]string{"<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", // city is required
				"<tool_call>\n<function=get_weather>\n<parameter=city>\na</function>\n</parameter>\n</function>\n</tool_call>",
				"<tool_call>\n<function=add>\n<parameter=a>\nx\n</parameter>\n<parameter=b>\n1\n</parameter>\n</function>\n</tool_call>",
				"<tool_call>\n<function=rm>\n</function>\n</tool_call>",
				"<tool_call><function=get_weather><parameter=city>Oslo</parameter><parameter=tags>[\"</b>\"]</parameter></function></tool_call>"}},
		{FormatGLM,
			[]string{"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
				"<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>2.5</arg_value></tool_call>"},
			[]string{"<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
				"<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</tool_call></arg_value></tool_call>"}},
		{FormatMiniMax,
			[]string{"<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Cairo</parameter>\n<parameter name=\"tags\">[\"a\", \"b\"]</parameter>\n</invoke>\n</minimax:tool_call>"},
			[]string{"<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Cairo</parameter>\n<parameter name=\"tags\">[\"a\", \"b\", \"c\"]</parameter>\n</invoke>\n</minimax:tool_call>"}},
		{FormatDeepSeekDSML,
			[]string{"<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Lima</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"},
			[]string{"<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Lima</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"true\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"}},
		{FormatHarmony,
			[]string{`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}`,
				`<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 2}`,
				` to=functions.ping<|channel|>commentary<|message|>{}`,
				`<|channel|>commentary to=functions.get_weather<|message|>{"city": "a < b <<", "tags": ["<", "<\u007c"]}`},
			[]string{`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town": "Tokyo"}`,
				`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "<|call|>"}`}},
		{FormatLFM2,
			[]string{`<|tool_call_start|>[get_weather(city="Accra", days=2, opts={"deep": True, "n": None})]<|tool_call_end|>`,
				`<|tool_call_start|>[add(a=1, b=-2.5e3)]<|tool_call_end|>`},
			[]string{`<|tool_call_start|>[get_weather(city=Accra)]<|tool_call_end|>`,
				`<|tool_call_start|>[add(a=1, b=1e999)]<|tool_call_end|>`}},
		{FormatFunctionaryV32,
			[]string{"get_weather\n{\"city\": \"Quito\"}", "add\n{\"a\": 1, \"b\": 2}", "get_weather\n{\"city\": \"a >> b >\", \"tags\": [\">>\"]}"},
			[]string{"get_weather\n{\"city\": \"a>>>b\"}", "add\n{\"a\": 1}"}},
	}
	schemas := toolSchemas(t, grammarTools)
	for _, c := range cases {
		g, trig, ok, err := AutoGrammar(c.f, grammarTools, false)
		if err != nil || !ok {
			t.Fatalf("%s: ok %v err %v", c.f, ok, err)
		}
		gr, err := parseGBNF(g)
		if err != nil {
			t.Fatalf("%s: %v", c.f, err)
		}
		for _, s := range c.fit {
			if !gr.accepts(s) {
				t.Errorf("%s: the grammar rejects %q\n%s", c.f, s, g)
				continue
			}
			checkGrammarReply(t, c.f, grammarTools, schemas, gr, trig, "", s, false, nil)
		}
		for _, s := range c.bad {
			if gr.accepts(s) {
				t.Errorf("%s: the grammar accepts %q", c.f, s)
			}
		}
	}
}

// The triggers: each family's grammar starts at its call opener (llama.cpp's
// triggers), and not on text that only looks like one.
func TestAutoGrammarFamilyTriggers(t *testing.T) {
	cases := []struct {
		f     Format
		fire  map[string]int // text -> where the grammar starts
		quiet []string
	}{
		{FormatQwenXML, map[string]int{"Sure.\n<tool_call>\n<function=add>": 6}, []string{"<function=add>", "tool_call"}},
		{FormatGLM, map[string]int{"<tool_call>add": 0, "x\n<tool_call>": 2}, []string{"<arg_key>a</arg_key>"}},
		{FormatMiniMax, map[string]int{"ok <minimax:tool_call>": 3}, []string{"<invoke name=\"add\">"}},
		{FormatDeepSeekDSML, map[string]int{"\n\n<｜DSML｜function_calls>": 2}, []string{"<｜DSML｜invoke name=\"add\">"}},
		{FormatLFM2, map[string]int{"x<|tool_call_start|>[": 1}, []string{"[add(a=1)]"}},
		{FormatHarmony, map[string]int{
			"<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=functions.add": 56,
			"<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.add":                      38,
			" to=functions.add": 0,
		}, []string{"<|channel|>final<|message|>I will go to=functions later", "<|channel|>commentary<|message|>hi", "x to=functions.add"}},
		{FormatFunctionaryV32, map[string]int{"add\n{": 0, "all\nChecking.>>>get_weather\n{": 16}, []string{"all\nadd\n{", "add\n[", "all\nChecking.>>>all\n", ">>>other\n{"}},
	}
	for _, c := range cases {
		_, trig, ok, err := AutoGrammar(c.f, grammarTools, false)
		if err != nil || !ok {
			t.Fatalf("%s: ok %v err %v", c.f, ok, err)
		}
		for text, want := range c.fire {
			if got := triggerStart(trig, text); got != want {
				t.Errorf("%s: %q starts the grammar at %d, want %d", c.f, text, got, want)
			}
		}
		for _, text := range c.quiet {
			if got := triggerStart(trig, text); got >= 0 {
				t.Errorf("%s: %q starts the grammar (at %d)", c.f, text, got)
			}
		}
	}
}

// Tools the family's syntax cannot carry leave auto unconstrained (no grammar), and a
// schema keyword the compiler cannot express is relaxed as for the JSON families.
func TestAutoGrammarFamiliesRefuse(t *testing.T) {
	odd := []Tool{{Function: ToolFunction{Name: "f", Parameters: json.RawMessage(`{"type": "object", "properties": {"a b": {"type": "string"}}}`)}}}
	mixed := []Tool{{Function: ToolFunction{Name: "f", Parameters: json.RawMessage(`{"type": "object", "properties": {"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}`)}}}
	for _, f := range []Format{FormatQwenXML, FormatGLM, FormatMiniMax, FormatLFM2} {
		if _, _, ok, err := AutoGrammar(f, odd, false); ok || err != nil {
			t.Errorf("%s: a parameter name the syntax cannot carry: ok %v err %v", f, ok, err)
		}
	}
	// A string-or-integer text value: "12" would read back as a number either way it
	// was meant, so only DSML (which says string="false") constrains it.
	for _, f := range []Format{FormatQwenXML, FormatGLM, FormatMiniMax} {
		if _, _, ok, err := AutoGrammar(f, mixed, false); ok || err != nil {
			t.Errorf("%s: an ambiguous text value: ok %v err %v", f, ok, err)
		}
	}
	if _, _, ok, err := AutoGrammar(FormatDeepSeekDSML, mixed, false); !ok || err != nil {
		t.Errorf("dsml: ok %v err %v", ok, err)
	}
	// A keyword the grammar cannot express is relaxed in a tool's schema, never the
	// request refused (ToolSchemaToGBNF): every family compiles it.
	relaxed := []Tool{{Function: ToolFunction{Name: "f", Parameters: json.RawMessage(`{"type": "object", "properties": {"v": {"type": "string", "pattern": "^a", "maxLength": 10000}}}`)}}}
	for _, f := range grammarFamilies {
		if _, _, _, err := AutoGrammar(f, relaxed, false); err != nil {
			t.Errorf("%s: a relaxed keyword failed the grammar: %v", f, err)
		}
	}
}

// The XML parsers read a string enum's or Optional[str]'s text as the grammar writes
// it: "1" stays the string "1", "null" is null.
func TestXMLParamTypes(t *testing.T) {
	p := ParseWith(FormatQwenXML, "<tool_call>\n<function=get_weather>\n<parameter=city>\n7\n</parameter>\n<parameter=unit>\n1\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>", grammarTools)
	if len(p.Calls) != 1 || p.Calls[0].Function.Arguments != `{"city": "7", "unit": "1", "note": null}` {
		t.Fatalf("%+v", p)
	}
	p = ParseWith(FormatGLM, "<tool_call>get_weather<arg_key>note</arg_key><arg_value>no</arg_value></tool_call>", grammarTools)
	if len(p.Calls) != 1 || p.Calls[0].Function.Arguments != `{"note": "no"}` {
		t.Fatalf("%+v", p)
	}
}

// objectSchemaFromBytes is a tool's parameters: an object with one to four properties
// of the supported subset (schemaFromBytes' shapes), some required.
func objectSchemaFromBytes(src *byteSource) string {
	names := append([]string{"city", "days", "q", "note"}, propNames...)
	var props, req []string
	used := map[string]bool{}
	for range 1 + src.intn(4) {
		k := names[src.intn(len(names))]
		if used[k] {
			continue
		}
		used[k] = true
		kq, _ := json.Marshal(k)
		props = append(props, string(kq)+":"+subschema(src, 2))
		if src.intn(2) == 0 {
			req = append(req, string(kq))
		}
	}
	s := `{"type":"object","properties":{` + strings.Join(props, ",") + `}`
	if len(req) > 0 {
		s += `,"required":[` + strings.Join(req, ",") + `]`
	}
	return s + "}"
}

// familyFuzzCase: in the family fam picks, a tool shaped by shape next to a fixed one;
// when the family can express it, a call its grammar derives (walk) is read back as a
// valid call, whole and streamed in the pieces cuts gives. It reports whether the
// family could express the tool.
func familyFuzzCase(t *testing.T, fam byte, shape, walk, cuts []byte) bool {
	f := grammarFamilies[int(fam)%len(grammarFamilies)]
	parallel := fam&0x80 != 0
	params := objectSchemaFromBytes(&byteSource{b: shape})
	tools := []Tool{{Type: "function", Function: ToolFunction{Name: "get_weather", Parameters: json.RawMessage(params)}}, grammarTools[1]}
	g, trig, ok, err := AutoGrammar(f, tools, parallel)
	if err != nil {
		t.Fatalf("%s: supported-subset schema refused: %v\n%s", f, err, params)
	}
	if !ok {
		return false
	}
	gr, err := parseGBNF(g)
	if err != nil {
		t.Fatalf("%s: grammar does not parse: %v\n%s\n%s", f, err, params, g)
	}
	call := gr.generate(&byteSource{b: walk}, 10)
	frees := freeText(f, call)
	checkGrammarReply(t, f, tools, toolSchemas(t, tools), gr, trig, frees[len(walk)%len(frees)], call, parallel, cuts)
	return true
}

// FuzzAutoGrammarFamilies: the round trip of TestAutoGrammarFamiliesRoundTrip with
// parameter schemas the fuzzer shapes.
func FuzzAutoGrammarFamilies(f *testing.F) {
	for fam := range len(grammarFamilies) {
		f.Add(byte(fam), []byte{6, 3, 0, 1, 7, 9, 2, byte(fam)}, []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, []byte{2, 5})
		f.Add(byte(fam)|0x80, []byte{3, 0, 1, 5, 2, 9, 0, 3, 1, 8}, []byte{9, 9, 9, 1, 0, 3, 200, 100}, []byte{0})
	}
	f.Fuzz(func(t *testing.T, fam byte, shape, walk, cuts []byte) {
		familyFuzzCase(t, fam, shape, walk, cuts)
	})
}

// TestAutoGrammarFamiliesFuzzIsExercised keeps the fuzz target honest: over fixed random
// inputs most shaped tools get a grammar (so the round trip really runs), and every
// check holds.
func TestAutoGrammarFamiliesFuzzIsExercised(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	bytesOf := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		return b
	}
	const runs = 700
	checked := 0
	for i := range runs {
		if familyFuzzCase(t, byte(i), bytesOf(24), bytesOf(120), bytesOf(30)) {
			checked++
		}
	}
	if checked < runs/2 {
		t.Fatalf("only %d of %d shaped tools got a grammar", checked, runs)
	}
	t.Logf("%d of %d shaped tools got a grammar", checked, runs)
}
