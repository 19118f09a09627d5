package chat

import (
	"strings"
	"testing"
)

func TestReasoningSplit(t *testing.T) {
	cases := []struct {
		name             string
		o                ReplyOptions
		text             string
		reasoning, reply string
		calls            int
	}{
		{"qwen3 think tags", ReplyOptions{Reasoning: true}, "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.", "It is 4.", 0},
		{"r1 prompt opened think", ReplyOptions{Reasoning: true, ThinkingOpen: true}, "Add them.\n</think>\n\n4", "Add them.", "4", 0},
		{"unclosed think is all reasoning", ReplyOptions{Reasoning: true, ThinkingOpen: true}, "Still thinking about", "Still thinking about", "", 0},
		{"reasoning_format none keeps tags", ReplyOptions{Reasoning: false}, "<think>x</think>y", "", "<think>x</think>y", 0},
		{"no think block", ReplyOptions{Reasoning: true}, "Just an answer.", "", "Just an answer.", 0},
		{"think then hermes call", ReplyOptions{Reasoning: true, Calls: true, Format: FormatHermes}, "<think>Need a tool.</think>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>", "Need a tool.", "", 1},
		{"seed think", ReplyOptions{Reasoning: true}, "<seed:think>hmm</seed:think>ok", "hmm", "ok", 0},
		{"harmony without tools", ReplyOptions{Reasoning: true, Format: FormatHarmony}, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>", "Easy.", "4", 0},
		{"command r7b thinking", ReplyOptions{Reasoning: true, Format: FormatCommandR7B}, "<|START_THINKING|>Plan.<|END_THINKING|><|START_RESPONSE|>Done.<|END_RESPONSE|>", "Plan.", "Done.", 0},
	}
	for _, c := range cases {
		p := ParseReply(c.o, c.text)
		if p.Reasoning != c.reasoning || p.Content != c.reply || len(p.Calls) != c.calls {
			t.Fatalf("%s: reasoning %q content %q calls %+v", c.name, p.Reasoning, p.Content, p.Calls)
		}
		// Streamed byte by byte, the deltas add up to the same split.
		s := NewReplyStream(c.o)
		var r, co strings.Builder
		for i := 0; i < len(c.text); i++ {
			a, b := s.Push(c.text[i : i+1])
			r.WriteString(a)
			co.WriteString(b)
		}
		fin := s.Finish()
		if got := strings.TrimSpace(r.String() + fin.Reasoning); got != c.reasoning {
			t.Fatalf("%s streamed reasoning %q", c.name, got)
		}
		if got := strings.TrimSpace(co.String() + fin.Content); got != c.reply || len(fin.Calls) != c.calls {
			t.Fatalf("%s streamed content %q calls %+v", c.name, got, fin.Calls)
		}
		if c.name == "qwen3 think tags" && !strings.Contains(r.String(), "The user") {
			t.Fatalf("reasoning was not streamed before the reply ended: %q", r.String())
		}
	}
	if !PromptOpensThinking("<|im_start|>assistant\n<think>\n") || PromptOpensThinking("<|im_start|>assistant\n") {
		t.Fatal("PromptOpensThinking")
	}
}

func TestForcedCallCutShortLeavesNoHalfCall(t *testing.T) {
	o := ReplyOptions{Format: FormatHermes, Calls: true, Forced: true, Reasoning: true}
	half := "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1"
	if p := ParseReply(o, half); p.Content != "" || len(p.Calls) != 0 {
		t.Fatalf("forced, cut short: %+v", p)
	}
	s := NewReplyStream(o)
	_, c := s.Push(half)
	if fin := s.Finish(); c+fin.Content != "" || fin.Calls != nil {
		t.Fatalf("forced, cut short, streamed: %q %+v", c, fin)
	}
	// Not forced (auto), a broken call stays content: nothing the model said is lost.
	o.Forced = false
	if p := ParseReply(o, half); p.Content != half {
		t.Fatalf("auto, cut short: %+v", p)
	}
}

func TestReasoningContentReachesTheTemplate(t *testing.T) {
	out := renderOne(t, `{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{% endfor %}`,
		[]Message{{Role: "user", Content: "q"}, {Role: "assistant", Content: "a", ReasoningContent: "because"}}, nil)
	if out != "q<think>because</think>a" {
		t.Fatalf("%q", out)
	}
}

func TestHarmonyStreamsReasoningAndArguments(t *testing.T) {
	text := `<|channel|>analysis<|message|>Need weather; call tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}<|call|>`
	s := NewReplyStream(ReplyOptions{Format: FormatHarmony, Tools: familyTools, Calls: true, Reasoning: true, Stream: true})
	var reasoning strings.Builder
	var deltas []CallDelta
	argsEarly := false
	for i := 0; i < len(text); i += 3 {
		r, c := s.Push(text[i:min(i+3, len(text))])
		if c != "" {
			t.Fatalf("content %q from a call reply", c)
		}
		reasoning.WriteString(r)
		d := s.Deltas()
		for _, x := range d {
			argsEarly = argsEarly || (x.Args != "" && i+3 < len(text))
		}
		deltas = append(deltas, d...)
	}
	fin := s.Finish()
	deltas = append(deltas, s.Deltas()...)
	if strings.TrimSpace(reasoning.String()) != "Need weather; call tool." || !argsEarly {
		t.Fatalf("reasoning %q, args streamed early %v", reasoning.String(), argsEarly)
	}
	args := ""
	for _, d := range deltas[1:] {
		args += d.Args
	}
	if len(fin.Calls) != 1 || deltas[0].Name != "get_weather" || deltas[0].ID != fin.Calls[0].ID || args != fin.Calls[0].Function.Arguments || args != `{"city": "Tokyo"}` {
		t.Fatalf("deltas %+v, calls %+v", deltas, fin.Calls)
	}
	// Plain text (no Harmony markers) comes back as written.
	if p := ParseReply(ReplyOptions{Format: FormatHarmony, Reasoning: true}, "just text"); p.Content != "just text" {
		t.Fatalf("plain: %+v", p)
	}
}

// TestCommandR7BStreams: Command R7B's thinking streams as reasoning, its response as
// content without the markers, and its action list as call deltas while written, not
// all at the end of the reply.
func TestCommandR7BStreams(t *testing.T) {
	s := NewReplyStream(ReplyOptions{Format: FormatCommandR7B, Tools: familyTools, Calls: true, Reasoning: true, Stream: true})
	r, c := s.Push("<|START_THINKING|>I should add")
	if r != "I should add" || c != "" {
		t.Fatalf("thinking: reasoning %q content %q", r, c)
	}
	s.Push(".<|END_THINKING|><|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"add\", \"parameters\": {\"a\": 1")
	d := s.Deltas()
	if len(d) != 2 || d[0].Name != "add" || d[1].Args != `{"a": 1` {
		t.Fatalf("call deltas before the action ends: %+v", d)
	}
	s.Push(", \"b\": 9}}\n]<|END_ACTION|>")
	fin := s.Finish()
	if len(fin.Calls) != 1 || fin.Calls[0].Function.Arguments != `{"a": 1, "b": 9}` {
		t.Fatalf("final %+v", fin)
	}
	resp := NewReplyStream(ReplyOptions{Format: FormatCommandR7B, Calls: true, Reasoning: true, Stream: true})
	var content string
	for _, piece := range []string{"<|START_RES", "PONSE|>Ten", " apples.<|END_", "RESPONSE|>"} {
		_, c := resp.Push(piece)
		content += c
	}
	if content += resp.Finish().Content; content != "Ten apples." {
		t.Fatalf("response content %q", content)
	}
}

// TestThinkTagsFromFamilies: the reasoning tags a reply is read for are the families'
// own (markers().thinkTags), each once, with <think> first: a prompt that opens a think
// block is closed by thinkTags[0] (NewReplyStream).
func TestThinkTagsFromFamilies(t *testing.T) {
	if len(thinkTags) == 0 || thinkTags[0] != [2]string{"<think>", "</think>"} {
		t.Fatalf("thinkTags %q: want <think> first", thinkTags)
	}
	seen := map[[2]string]int{}
	for _, tag := range thinkTags {
		seen[tag]++
	}
	for _, f := range families {
		for _, tag := range f.markers().thinkTags {
			if seen[tag] != 1 {
				t.Errorf("%s's %q is in thinkTags %d times, want once", f.format(), tag, seen[tag])
			}
			// Read in any format: a reply in this family's own opens with it.
			p := ParseReply(ReplyOptions{Format: f.format(), Reasoning: true}, tag[0]+"why"+tag[1]+"ok")
			if p.Reasoning != "why" {
				t.Errorf("%s: %q block read as reasoning %q, content %q", f.format(), tag[0], p.Reasoning, p.Content)
			}
		}
	}
	if len(seen) != len(thinkTags) {
		t.Errorf("thinkTags %q has duplicates", thinkTags)
	}
}
