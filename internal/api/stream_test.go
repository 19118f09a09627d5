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
	gen := generation{k: k, id: "id-1", created: 42, plan: plan, shape: openaiShape{},
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

// pushPieces sends text pieces (byte tokens each) and joins the chunks' text and
// text offsets.
func pushPieces(t *testing.T, c *chunker, pieces ...string) (string, []int) {
	t.Helper()
	var text strings.Builder
	var offsets []int
	for _, piece := range pieces {
		out, end := c.event(engine.Event{Text: piece, Tokens: tokens(piece)})
		if end != streamOpen {
			t.Fatalf("piece %q ends the stream (%v)", piece, end)
		}
		if piece == "" && len(out) != 0 {
			t.Fatalf("an empty event gives chunks %v", out)
		}
		for _, v := range out {
			ch := v.(wire.TextChunk)
			if ch.ID != "id-1" || ch.Created != 42 || ch.Choices[0].FinishReason != nil {
				t.Fatalf("chunk %+v", ch)
			}
			text.WriteString(ch.Choices[0].Text)
			offsets = append(offsets, ch.Choices[0].Logprobs.TextOffset...)
		}
	}
	return text.String(), offsets
}

func jsonOf(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestChunkerTextStream(t *testing.T) {
	c := testChunker(kindText, true, true, nil)
	if got := c.start(); len(got) != 0 {
		t.Fatalf("a text stream starts with %v, want nothing", got)
	}
	// text_offset counts characters across chunks: é is two tokens at one offset.
	text, offsets := pushPieces(t, c, "ab", "", "é", "c")
	if want := []int{0, 1, 2, 2, 3}; text != "abéc" || !slices.Equal(offsets, want) {
		t.Fatalf("text %q offsets %v, want abéc %v", text, offsets, want)
	}
	done := engine.Event{Done: true, Finish: engine.FinishLength, Text: "!", Truncated: true,
		Stats: engine.Stats{PromptN: 3, PredictedN: 6, Pool: 4, Ctx: engine.SessionCtx{CtxUsed: 9}}}
	out, end := c.event(done)
	if end != streamDone || len(out) != 3 {
		t.Fatalf("done: %d chunks, end %v", len(out), end)
	}
	// The withheld text goes out first, without logprobs or stats; then the finish
	// with the stats; then the usage.
	for i, want := range []string{
		`{"choices":[{"finish_reason":null,"index":0,"logprobs":null,"text":"!"}],"created":42,"id":"id-1","model":"m","object":"text_completion"}`,
		`{"choices":[{"finish_reason":"length","index":0,"logprobs":null,"text":""}],"context":{"pool_id":null,"ctx_used":9,"ctx_headroom_tokens":0,"ctx_pressure":0},"created":42,"id":"id-1","model":"m","object":"text_completion","pool_id":4,"session_id":"s","timings":{"cache_n":0,"predicted_ms":0,"predicted_n":6,"predicted_per_second":0,"predicted_per_token_ms":0,"prompt_ms":0,"prompt_n":3,"prompt_per_second":0,"prompt_per_token_ms":0,"tps_ewma":0},"truncated":true}`,
		`{"choices":[],"created":42,"id":"id-1","model":"m","object":"text_completion","usage":{"completion_tokens":6,"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0},"total_tokens":9}}`,
	} {
		if got := jsonOf(out[i]); got != want {
			t.Errorf("chunk %d\n got %s\nwant %s", i, got, want)
		}
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
	var got chatStreamed
	reply := `<think>hm</think>ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>`
	for i := 0; i < len(reply); i += 5 {
		out, end := c.event(engine.Event{Text: reply[i:min(i+5, len(reply))]})
		if end != streamOpen {
			t.Fatal("the stream ended early")
		}
		got.add(t, out)
	}
	out, end := c.event(engine.Event{Done: true, Finish: engine.FinishStop})
	if end != streamDone {
		t.Fatalf("end %v", end)
	}
	got.add(t, out[:len(out)-1])
	last := out[len(out)-1].(wire.ChatChunk)
	if *last.Choices[0].FinishReason != "tool_calls" {
		t.Fatalf("finish_reason %q, want tool_calls", *last.Choices[0].FinishReason)
	}
	if got.reasoning.String() != "hm" || strings.TrimSpace(got.content.String()) != "ok" || !slices.Equal(got.names, []string{"f"}) ||
		!json.Valid([]byte(got.args.String())) {
		t.Fatalf("reasoning %q content %q calls %v args %q", got.reasoning.String(), got.content.String(), got.names, got.args.String())
	}
}

// chatStreamed joins a chat stream's deltas.
type chatStreamed struct {
	reasoning, content, args strings.Builder
	names                    []string
}

func (c *chatStreamed) add(t *testing.T, out []any) {
	t.Helper()
	for _, v := range out {
		d := v.(wire.ChatChunk).Choices[0].Delta
		c.reasoning.WriteString(d.ReasoningContent)
		if d.Content != nil {
			c.content.WriteString(*d.Content)
		}
		for _, tc := range d.ToolCalls {
			if tc.Function.Name != "" {
				c.names = append(c.names, tc.Function.Name)
				if tc.ID == "" || tc.Type != "function" {
					t.Fatalf("a call's first piece lacks id or type: %+v", tc)
				}
			}
			c.args.WriteString(tc.Function.Arguments)
		}
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
