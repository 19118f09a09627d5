package api

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// The chunker is tested without HTTP: engine events in, typed chunks out.

func testChunker(k kind, logprobs, includeUsage bool, plan *toolPlan) *chunker {
	s := &Server{tok: enginetest.Vocab{}, info: Info{ModelID: "m"}}
	gen := generation{k: k, id: "id-1", created: 42, plan: plan,
		req: engine.Request{Prompt: []int32{1, 2, 3}, Logprobs: logprobs, SessionID: "s"}}
	return s.newChunker(gen, includeUsage)
}

func tokens(text string) []engine.TokenLogprob {
	var out []engine.TokenLogprob
	for _, t := range enginetest.Bytes(text) {
		out = append(out, engine.TokenLogprob{Token: t, Logprob: -0.5})
	}
	return out
}

func TestChunkerTextStream(t *testing.T) {
	c := testChunker(kindText, true, true, nil)
	if got := c.start(); len(got) != 0 {
		t.Fatalf("a text stream starts with %v, want nothing", got)
	}
	var text strings.Builder
	var offsets []int
	for _, piece := range []string{"ab", "", "é", "c"} {
		ev := engine.Event{Text: piece, Tokens: tokens(piece)}
		out, end := c.event(ev)
		if end != streamOpen {
			t.Fatalf("piece %q ends the stream (%v)", piece, end)
		}
		if piece == "" {
			if len(out) != 0 {
				t.Fatalf("an empty event gives chunks %v", out)
			}
			continue
		}
		ch := out[0].(wire.TextChunk)
		if ch.ID != "id-1" || ch.Created != 42 || ch.Object != "text_completion" || ch.Choices[0].FinishReason != nil {
			t.Fatalf("chunk %+v", ch)
		}
		text.WriteString(ch.Choices[0].Text)
		offsets = append(offsets, ch.Choices[0].Logprobs.TextOffset...)
	}
	// text_offset counts characters across chunks: é is two tokens at one offset.
	if want := []int{0, 1, 2, 2, 3}; text.String() != "abéc" || !slices.Equal(offsets, want) {
		t.Fatalf("text %q offsets %v, want abéc %v", text.String(), offsets, want)
	}
	done := engine.Event{Done: true, Finish: engine.FinishLength, Text: "!", Truncated: true,
		Stats: engine.Stats{PromptN: 3, PredictedN: 6, Pool: 4, Ctx: engine.SessionCtx{CtxUsed: 9}}}
	out, end := c.event(done)
	if end != streamDone || len(out) != 3 {
		t.Fatalf("done: %d chunks, end %v", len(out), end)
	}
	if tail := out[0].(wire.TextChunk); tail.Choices[0].Text != "!" || tail.Choices[0].Logprobs != nil || tail.Timings != nil {
		t.Fatalf("the withheld text goes out first, without logprobs or stats: %+v", tail)
	}
	last := out[1].(wire.TextChunk)
	if *last.Choices[0].FinishReason != "length" || last.PoolID != 4 || !last.Truncated || *last.SessionID != "s" ||
		last.Context.CtxUsed != 9 || last.Timings.PredictedN != 6 || last.Usage != nil {
		t.Fatalf("last chunk %+v", last)
	}
	usage := out[2].(wire.TextChunk)
	if len(usage.Choices) != 0 || usage.Usage == nil || usage.Usage.TotalTokens != 9 || usage.Timings != nil {
		t.Fatalf("usage chunk %+v", usage)
	}
	b, _ := json.Marshal(usage)
	if want := `{"choices":[],"created":42,"id":"id-1","model":"m","object":"text_completion","usage":{"completion_tokens":6,"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0},"total_tokens":9}}`; string(b) != want {
		t.Fatalf("usage chunk\n got %s\nwant %s", b, want)
	}
}

func TestChunkerChatToolCall(t *testing.T) {
	tools := []chat.Tool{{Type: "function", Function: chat.ToolFunction{Name: "f"}}}
	plan := &toolPlan{tools: tools, parse: true, reply: chat.ReplyOptions{Format: chat.FormatHermes, Tools: tools, Calls: true, Reasoning: true}}
	c := testChunker(kindChat, false, false, plan)
	start := c.start()
	if len(start) != 1 {
		t.Fatalf("start: %v", start)
	}
	if d := start[0].(wire.ChatChunk).Choices[0].Delta; d.Role != "assistant" || d.Content == nil || *d.Content != "" {
		t.Fatalf("role chunk delta %+v", d)
	}
	var reasoning, content, args strings.Builder
	var names []string
	collect := func(out []any) {
		for _, v := range out {
			d := v.(wire.ChatChunk).Choices[0].Delta
			reasoning.WriteString(d.ReasoningContent)
			if d.Content != nil {
				content.WriteString(*d.Content)
			}
			for _, tc := range d.ToolCalls {
				if tc.Function.Name != "" {
					names = append(names, tc.Function.Name)
					if tc.ID == "" || tc.Type != "function" {
						t.Fatalf("a call's first piece lacks id or type: %+v", tc)
					}
				}
				args.WriteString(tc.Function.Arguments)
			}
		}
	}
	reply := `<think>hm</think>ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>`
	for i := 0; i < len(reply); i += 5 {
		out, end := c.event(engine.Event{Text: reply[i:min(i+5, len(reply))]})
		if end != streamOpen {
			t.Fatal("the stream ended early")
		}
		collect(out)
	}
	out, end := c.event(engine.Event{Done: true, Finish: engine.FinishStop})
	if end != streamDone {
		t.Fatalf("end %v", end)
	}
	collect(out[:len(out)-1])
	last := out[len(out)-1].(wire.ChatChunk)
	if *last.Choices[0].FinishReason != "tool_calls" {
		t.Fatalf("finish_reason %q, want tool_calls", *last.Choices[0].FinishReason)
	}
	if reasoning.String() != "hm" || strings.TrimSpace(content.String()) != "ok" || len(names) != 1 || names[0] != "f" ||
		!json.Valid([]byte(args.String())) {
		t.Fatalf("reasoning %q content %q calls %v args %q", reasoning.String(), content.String(), names, args.String())
	}
}

func TestChunkerFailure(t *testing.T) {
	c := testChunker(kindChat, false, true, nil)
	out, end := c.event(engine.Event{Done: true, Err: engine.ErrQueueFull})
	if end != streamFailed || len(out) != 1 {
		t.Fatalf("a failed event: %v %v", out, end)
	}
	b, _ := json.Marshal(out[0])
	if want := `{"error":{"code":503,"message":"the request queue is full","type":"unavailable_error"}}`; string(b) != want {
		t.Fatalf("error event %s, want %s", b, want)
	}
}
