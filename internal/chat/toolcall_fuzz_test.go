package chat

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

// allFormats is every tool-call format, for the fuzz target to pick from.
var allFormats = []Format{FormatHermes, FormatQwenXML, FormatLlama3, FormatMistral, FormatMistralArgs,
	FormatHarmony, FormatDeepSeek, FormatDeepSeekDSML, FormatKimiK2, FormatGLM, FormatMiniMax,
	FormatGranite, FormatCommandR7B, FormatFunctionaryV31, FormatFunctionaryV32, FormatLFM2}

// streamOutcome is what a client ends up with after a streamed reply.
type streamOutcome struct {
	Content, Reasoning string
	Calls              []string // name + " " + arguments
	Truncated          bool
}

// streamReply feeds text to a ReplyStream in the pieces cuts describes (each byte a
// piece length in runes, as the text assembler only ever releases whole characters)
// and collects what a client would see. Live: calls as assembled from the deltas.
func streamReply(f Format, text string, cuts []byte, live bool) streamOutcome {
	// The API's path: a ReplyStream (reasoning split, then the CallStream).
	cs := NewReplyStream(ReplyOptions{Format: f, Tools: familyTools, Calls: true, Reasoning: true, Stream: live})
	var out streamOutcome
	var content, reasoning strings.Builder
	type assembled struct{ name, args string }
	var calls []assembled
	collect := func() {
		for _, d := range cs.Deltas() {
			for len(calls) <= d.Index {
				calls = append(calls, assembled{})
			}
			if d.Name != "" {
				calls[d.Index].name = d.Name
			}
			calls[d.Index].args += d.Args
		}
	}
	rest := text
	for i := 0; rest != ""; i++ {
		n := len(rest)
		if i < len(cuts) {
			n = 0
			for k := 0; k < int(cuts[i])%8+1 && n < len(rest); k++ {
				_, size := utf8.DecodeRuneInString(rest[n:])
				n += size
			}
		}
		r, c := cs.Push(rest[:n])
		content.WriteString(c)
		reasoning.WriteString(r)
		collect()
		rest = rest[n:]
	}
	p := cs.Finish()
	collect()
	content.WriteString(p.Content)
	out.Content, out.Reasoning, out.Truncated = content.String(), reasoning.String()+p.Reasoning, p.Truncated
	if live {
		for _, c := range calls {
			out.Calls = append(out.Calls, c.name+" "+c.args)
		}
	} else {
		for _, c := range p.Calls {
			out.Calls = append(out.Calls, c.Function.Name+" "+c.Function.Arguments)
		}
	}
	return out
}

// FuzzToolCallParsing checks the tool-call parsers and the streaming splitter on any
// text in any format: no panic; every parsed call has a name and JSON-object
// arguments; what a streaming client receives does not depend on how the reply was
// split into tokens; and streamed calls are the calls the whole reply parses to
// (ParseReply: the reasoning split first, as the API does).
func FuzzToolCallParsing(f *testing.F) {
	for i, c := range familyCases {
		fi := 0
		for j, x := range allFormats {
			if x == c.format {
				fi = j
			}
		}
		f.Add(uint8(fi), c.text, []byte{byte(i), 3, 1, 7, 2, 5})
	}
	f.Fuzz(func(t *testing.T, fi uint8, text string, cuts []byte) {
		if !utf8.ValidString(text) {
			return // generated text reaches the parsers only as whole characters
		}
		format := allFormats[int(fi)%len(allFormats)]
		whole := ParseWith(format, text, familyTools)
		for _, c := range whole.Calls {
			if c.Function.Name == "" {
				t.Fatalf("%s: a call without a name from %q", format, text)
			}
			var obj map[string]any
			if err := json.Unmarshal([]byte(c.Function.Arguments), &obj); err != nil {
				t.Fatalf("%s: call %s has arguments %q that are not a JSON object (%v), from %q", format, c.Function.Name, c.Function.Arguments, err, text)
			}
		}
		var wholeCalls []string
		reply := ParseReply(ReplyOptions{Format: format, Tools: familyTools, Calls: true, Reasoning: true}, text)
		for _, c := range reply.Calls {
			wholeCalls = append(wholeCalls, c.Function.Name+" "+c.Function.Arguments)
		}
		for _, live := range []bool{false, true} {
			one := streamReply(format, text, nil, live)
			split := streamReply(format, text, cuts, live)
			if !reflect.DeepEqual(one, split) {
				t.Fatalf("%s live=%v: the outcome depends on the token split of %q\nwhole:  %s\nsplit:  %s", format, live, text, show(one), show(split))
			}
			if !one.Truncated && !reflect.DeepEqual(one.Calls, wholeCalls) {
				t.Fatalf("%s live=%v: streamed calls differ from the parsed reply %q\nstream: %q\nparse:  %q", format, live, text, one.Calls, wholeCalls)
			}
		}
	})
}

func show(o streamOutcome) string { return fmt.Sprintf("%+v", o) }
