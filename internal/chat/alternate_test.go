package chat

import (
	"errors"
	"reflect"
	"testing"
)

// The agent CLIs' conversation shapes, as Alternate rewrites them for a template that
// insists on alternation.
func TestAlternate(t *testing.T) {
	call := []ToolCall{{ID: "c1", Type: "function", Function: FunctionCall{Name: "Bash", Arguments: `{"command": "ls"}`}}}
	for _, tc := range []struct {
		name string
		in   []Message
		want []Message
	}{
		{"claude code: a system message after the first user message",
			[]Message{{Role: "system", Content: "S"}, {Role: "user", Content: "reminder"}, {Role: "system", Content: "env"}, {Role: "user", Content: "task"}},
			[]Message{{Role: "system", Content: "S"}, {Role: "user", Content: "reminder\n\nenv\n\ntask"}}},
		{"codex: two developer messages, two user messages",
			[]Message{{Role: "developer", Content: "D1"}, {Role: "developer", Content: "D2"}, {Role: "user", Content: "ctx"}, {Role: "user", Content: "task"}},
			[]Message{{Role: "system", Content: "D1\n\nD2"}, {Role: "user", Content: "ctx\n\ntask"}}},
		{"a tool loop becomes Hermes text",
			[]Message{{Role: "user", Content: "list"}, {Role: "assistant", NullContent: true, ToolCalls: call}, {Role: "tool", ToolCallID: "c1", Content: "a.txt"}, {Role: "assistant", Content: "a.txt is here"}},
			[]Message{{Role: "user", Content: "list"}, {Role: "assistant", Content: `<tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call>`},
				{Role: "user", Content: "<tool_response>\na.txt\n</tool_response>"}, {Role: "assistant", Content: "a.txt is here"}}},
		{"an assistant turn first gets a user turn before it",
			[]Message{{Role: "system", Content: "S"}, {Role: "assistant", Content: "hi", ReasoningContent: "r"}},
			[]Message{{Role: "system", Content: "S"}, {Role: "user"}, {Role: "assistant", Content: "hi", ReasoningContent: "r"}}},
	} {
		if got := Alternate(tc.in); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.name, got, tc.want)
		}
	}
}

// Gemma's template raises on the shapes above; Alternate's output renders, and a
// conversation one turn longer renders to a prompt that extends the shorter one's
// (without the generation prompt), so its KV prefix is shared.
func TestAlternateRendersUnderGemma(t *testing.T) {
	r := NewRenderer(builtinTemplates["gemma"], "<bos>", "<eos>")
	call := []ToolCall{{ID: "c1", Type: "function", Function: FunctionCall{Name: "Bash", Arguments: `{"command": "ls"}`}}}
	convo := []Message{{Role: "developer", Content: "D1"}, {Role: "developer", Content: "D2"}, {Role: "user", Content: "ctx"}, {Role: "user", Content: "task"},
		{Role: "assistant", NullContent: true, ToolCalls: call}, {Role: "tool", ToolCallID: "c1", Content: "a.txt"}}
	if _, err := r.Render(convo, nil, true); !errors.Is(err, ErrTemplateRaised) {
		t.Fatalf("gemma took the raw conversation (err %v): the fallback is not exercised", err)
	}
	short, err := r.Render(Alternate(convo[:4]), nil, false)
	if err != nil {
		t.Fatal(err)
	}
	long, err := r.Render(Alternate(convo), nil, true)
	if err != nil {
		t.Fatal(err)
	}
	if len(long) <= len(short) || long[:len(short)] != short {
		t.Fatalf("the longer conversation does not extend the shorter one's prompt:\n%q\n%q", short, long)
	}
}
