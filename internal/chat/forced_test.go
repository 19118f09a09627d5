package chat

import (
	"encoding/json"
	"math/rand/v2"
	"testing"
	"unicode/utf8"
)

// callFamilies are the formats with a call grammar of their own: forced calls are
// written in their syntax, not in Hermes tags.
var callFamilies = append([]Format{FormatHermes, FormatLlama3, FormatMistral, FormatMistralArgs, FormatGranite,
	FormatCommandR7B, FormatKimiK2, FormatDeepSeek, FormatFunctionaryV31}, grammarFamilies...)

// readForced reads text as the API does for a forced call, whole and streamed in
// pieces cut by cuts (both ways the same), and returns the calls and all content.
func readForced(t *testing.T, f Format, tools []Tool, text string, cuts []byte) ([]ToolCall, string) {
	t.Helper()
	o := ReplyOptions{Format: f, Tools: tools, Calls: true, Reasoning: true, Forced: true}
	p := ParseReply(o, text)
	for _, live := range []bool{false, true} {
		o.Stream = live
		rs := NewReplyStream(o)
		var content string
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
			_, c := rs.Push(rest[:n])
			content += c
			rs.Deltas()
			rest = rest[n:]
		}
		fin := rs.Finish()
		content += fin.Content
		if content != "" {
			t.Fatalf("%s (stream, live %v): a forced reply streamed content %q\ntext: %q", f, live, content, text)
		}
		if live && fin.Truncated {
			continue // cut short after calls were streamed: the client holds those pieces
		}
		if len(fin.Calls) != len(p.Calls) {
			t.Fatalf("%s (stream, live %v): calls %+v, whole %+v\ntext: %q", f, live, fin.Calls, p.Calls, text)
		}
		for i := range fin.Calls {
			if fin.Calls[i].Function != p.Calls[i].Function {
				t.Fatalf("%s (stream, live %v): call %d %+v, whole %+v\ntext: %q", f, live, i, fin.Calls[i].Function, p.Calls[i].Function, text)
			}
		}
	}
	return p.Calls, p.Content
}

// A forced call's grammar in every family with a call grammar, sampled from its first
// token (no trigger): each string is read back by the family's parser, whole and
// streamed, as calls of the callable tools (exactly the named one for a named choice;
// one call unless parallel) with schema-valid arguments, and no content; cut short
// anywhere (max_tokens), it leaves no half call in content, streamed or not. A named
// grammar refuses every call of another tool that the required grammar writes.
func TestForcedGrammarFamiliesRoundTrip(t *testing.T) {
	schemas := toolSchemas(t, grammarTools)
	rng := rand.New(rand.NewPCG(3, 5))
	bytesOf := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		return b
	}
	for _, f := range callFamilies {
		grammars := map[string]*grammar{}
		for _, named := range []string{"", "get_weather", "add", "ping", "any_args"} {
			for _, parallel := range []bool{false, true} {
				if named != "" && parallel {
					continue // the API forces one call of a named function
				}
				g, ok, err := ForcedGrammar(f, grammarTools, named, parallel)
				if err != nil || !ok {
					t.Fatalf("%s named %q: ok %v err %v", f, named, ok, err)
				}
				gr, err := parseGBNF(g)
				if err != nil {
					t.Fatalf("%s: %v\n%s", f, err, g)
				}
				if !parallel {
					grammars[named] = gr
				}
				names, keys, several := map[string]bool{}, map[string]bool{}, false
				for i := 0; i < 60; i++ {
					call := gr.generate(&byteSource{b: bytesOf(200)}, 12)
					calls, content := readForced(t, f, grammarTools, call, bytesOf(40))
					if len(calls) == 0 || !parallel && len(calls) != 1 || content != "" {
						t.Fatalf("%s named %q parallel %v: calls %+v content %q from %q", f, named, parallel, calls, content, call)
					}
					several = several || len(calls) > 1
					for _, c := range calls {
						s, ok := schemas[c.Function.Name]
						if !ok || named != "" && c.Function.Name != named {
							t.Fatalf("%s named %q: call of %q from %q", f, named, c.Function.Name, call)
						}
						if !validates(s, c.Function.Arguments) {
							t.Fatalf("%s: arguments %s of %s break its schema\ntext: %q", f, c.Function.Arguments, c.Function.Name, call)
						}
						names[c.Function.Name] = true
						var args map[string]any
						_ = json.Unmarshal([]byte(c.Function.Arguments), &args)
						for k := range args {
							keys[c.Function.Name+"."+k] = true
						}
					}
					// Cut short anywhere: a call or nothing, never half a call as content.
					rs := []rune(call)
					cut := string(rs[:rng.IntN(len(rs))])
					if _, content := readForced(t, f, grammarTools, cut, bytesOf(40)); content != "" {
						t.Fatalf("%s: cut short, content %q from %q", f, content, cut)
					}
				}
				want := len(grammarTools)
				if named != "" {
					want = 1
				}
				if len(names) != want || several != (parallel && f != FormatHarmony) {
					t.Errorf("%s named %q parallel %v: tools called %v, several calls %v", f, named, parallel, names, several)
				}
				if named == "get_weather" {
					for _, k := range []string{"city", "days", "unit", "note", "code", "tags", "opts", "any"} {
						if !keys["get_weather."+k] {
							t.Errorf("%s: no sample set get_weather.%s (seen %v)", f, k, keys)
						}
					}
				}
			}
		}
		// Calls of other tools, as the required grammar writes them, are outside each
		// named grammar.
		refused := 0
		for i := 0; i < 60; i++ {
			call := grammars[""].generate(&byteSource{b: bytesOf(200)}, 12)
			p := ParseWith(f, call, grammarTools)
			if len(p.Calls) != 1 {
				t.Fatalf("%s: %d calls from required %q", f, len(p.Calls), call)
			}
			for named, gr := range grammars {
				if named != "" && named != p.Calls[0].Function.Name {
					if gr.accepts(call) {
						t.Fatalf("%s: the grammar of named %q accepts a call of %q: %q", f, named, p.Calls[0].Function.Name, call)
					}
					refused++
				}
			}
		}
		if refused == 0 {
			t.Errorf("%s: no call of another tool was tried on a named grammar", f)
		}
	}
}

// Without a call grammar of its own (or tools it cannot write), ForcedGrammar says so
// and the API falls back to Hermes tags.
func TestForcedGrammarFallsBack(t *testing.T) {
	if _, ok, err := ForcedGrammar(Format("no_such_family"), grammarTools, "", false); ok || err != nil {
		t.Fatalf("unknown family: ok %v err %v", ok, err)
	}
	odd := []Tool{{Type: "function", Function: ToolFunction{Name: "has space", Parameters: json.RawMessage(`{"type": "object"}`)}}}
	if _, ok, err := ForcedGrammar(FormatQwenXML, odd, "", false); ok || err != nil {
		t.Fatalf("a name the XML syntax cannot carry: ok %v err %v", ok, err)
	}
	if _, ok, _ := ForcedGrammar(FormatMistral, grammarTools, "no_such_tool", false); ok {
		t.Fatal("a named tool that is not declared")
	}
}

// A prompt that opens a think block: the forced grammar lets the reasoning run to the
// closing tag and then forces the family's call, which the parser reads as a call (not
// as reasoning); a call written inside the block does not end the grammar, and a reply
// without the closing tag is incomplete. Prompts that open no block keep the grammar.
func TestForcedAfterThinking(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 1))
	src := func() *byteSource {
		b := make([]byte, 200)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		return &byteSource{b: b}
	}
	for _, f := range callFamilies {
		if f == FormatHarmony {
			continue // reasons in its analysis channel, never in think tags
		}
		g, ok, err := ForcedGrammar(f, grammarTools, "", false)
		if !ok || err != nil {
			t.Fatalf("%s: %v %v", f, ok, err)
		}
		if ForcedAfterThinking(g, "<|im_start|>assistant\n") != g {
			t.Fatalf("%s: a prompt without a think block changed the grammar", f)
		}
		tg := ForcedAfterThinking(g, "<|im_start|>assistant\n<think>\n")
		gr, err := parseGBNF(tg)
		if err != nil {
			t.Fatalf("%s: %v\n%s", f, err, tg)
		}
		call := parseGBNFMust(t, g).generate(src(), 12)
		reasoning := "The user wants the weather; <tool_call> and </thinking> are words here."
		reply := reasoning + "</think>\n\n" + call
		if !gr.accepts(reply) || gr.accepts(call) || gr.accepts(reasoning+call) {
			t.Fatalf("%s: after thinking %v, call alone %v, call inside the block %v\n%s", f, gr.accepts(reply), gr.accepts(call), gr.accepts(reasoning+call), tg)
		}
		p := ParseReply(ReplyOptions{Format: f, Tools: grammarTools, Calls: true, Reasoning: true, Forced: true, ThinkingOpen: true}, reply)
		if len(p.Calls) != 1 || p.Reasoning != reasoning || p.Content != "" {
			t.Fatalf("%s: %+v from %q", f, p, reply)
		}
		for i := 0; i < 20; i++ {
			s := gr.generate(src(), 12)
			p := ParseReply(ReplyOptions{Format: f, Tools: grammarTools, Calls: true, Reasoning: true, Forced: true, ThinkingOpen: true}, s)
			if len(p.Calls) != 1 || p.Content != "" {
				t.Fatalf("%s: %+v from sampled %q", f, p, s)
			}
		}
	}
}

func parseGBNFMust(t *testing.T, g string) *grammar {
	t.Helper()
	gr, err := parseGBNF(g)
	if err != nil {
		t.Fatalf("%v\n%s", err, g)
	}
	return gr
}

// forcedFuzzCase: in the family fam picks (all with a call grammar), a tool shaped by
// shape next to a fixed one, forced (required, or named get_weather); when the family
// can write the tool, a call its grammar derives (walk) is read back as calls of the
// callable tools with schema-valid arguments and no content, whole and streamed in the
// pieces cuts gives, and cut short it leaves no content. It reports whether the family
// could write the tool.
func forcedFuzzCase(t *testing.T, fam byte, shape, walk, cuts []byte) bool {
	f := callFamilies[int(fam&0x3f)%len(callFamilies)]
	parallel := fam&0x80 != 0
	named := ""
	if fam&0x40 != 0 {
		named, parallel = "get_weather", false
	}
	params := objectSchemaFromBytes(&byteSource{b: shape})
	tools := []Tool{{Type: "function", Function: ToolFunction{Name: "get_weather", Parameters: json.RawMessage(params)}}, grammarTools[1]}
	g, ok, err := ForcedGrammar(f, tools, named, parallel)
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
	schemas := toolSchemas(t, tools)
	call := gr.generate(&byteSource{b: walk}, 10)
	calls, content := readForced(t, f, tools, call, cuts)
	if len(calls) == 0 || !parallel && len(calls) != 1 || content != "" {
		t.Fatalf("%s named %q parallel %v: calls %+v content %q from %q", f, named, parallel, calls, content, call)
	}
	for _, c := range calls {
		s, ok := schemas[c.Function.Name]
		if !ok || named != "" && c.Function.Name != named {
			t.Fatalf("%s named %q: call of %q from %q", f, named, c.Function.Name, call)
		}
		if !validates(s, c.Function.Arguments) {
			t.Fatalf("%s: arguments %s of %s break its schema\n%s\ntext: %q", f, c.Function.Arguments, c.Function.Name, params, call)
		}
	}
	if rs := []rune(call); len(rs) > 1 {
		cut := string(rs[:len(walk)%len(rs)])
		if _, content := readForced(t, f, tools, cut, cuts); content != "" {
			t.Fatalf("%s: cut short, content %q from %q", f, content, cut)
		}
	}
	return true
}

// FuzzForcedGrammarFamilies: the forced round trip of TestForcedGrammarFamiliesRoundTrip
// with parameter schemas the fuzzer shapes, in every family with a call grammar.
func FuzzForcedGrammarFamilies(f *testing.F) {
	for fam := range len(callFamilies) {
		f.Add(byte(fam), []byte{6, 3, 0, 1, 7, 9, 2, byte(fam)}, []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, []byte{2, 5})
		f.Add(byte(fam)|0x80, []byte{3, 0, 1, 5, 2, 9, 0, 3, 1, 8}, []byte{9, 9, 9, 1, 0, 3, 200, 100}, []byte{0})
		f.Add(byte(fam)|0x40, []byte{1, 4, 4, 2, 0, 7}, []byte{5, 0, 250, 17, 3}, []byte{6, 1})
	}
	f.Fuzz(func(t *testing.T, fam byte, shape, walk, cuts []byte) {
		forcedFuzzCase(t, fam, shape, walk, cuts)
	})
}

// TestForcedGrammarFuzzIsExercised keeps the fuzz target honest: over fixed random
// inputs most shaped tools get a forced grammar, and every check holds.
func TestForcedGrammarFuzzIsExercised(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 2))
	bytesOf := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		return b
	}
	const runs = 500
	checked := 0
	for range runs {
		if forcedFuzzCase(t, byte(rng.IntN(256)), bytesOf(24), bytesOf(120), bytesOf(30)) {
			checked++
		}
	}
	if checked < runs/2 {
		t.Fatalf("only %d of %d shaped tools got a forced grammar", checked, runs)
	}
	t.Logf("%d of %d shaped tools got a forced grammar", checked, runs)
}
