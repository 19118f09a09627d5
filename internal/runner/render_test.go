package runner

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/llama"
)

func TestTemplateRenderingMatchesLlamaCpp(t *testing.T) {
	m := testModel(t)
	r := NewChatRenderer(m, m.ChatTemplate())
	if r.Path() != chat.PathJinja {
		t.Fatalf("SmolLM2's template is not rendered by Jinja: %s", r.Path())
	}
	msgs := []chat.Message{{Role: "system", Content: "You are terse."}, {Role: "user", Content: "Hi!"}, {Role: "assistant", Content: "Hello."}, {Role: "user", Content: "Name a prime."}}
	lm := make([]llama.ChatMessage, len(msgs))
	for i, msg := range msgs {
		lm[i] = llama.ChatMessage{Role: msg.Role, Content: msg.Content}
	}
	for _, addGen := range []bool{true, false} {
		jinja, err := r.Render(msgs, nil, addGen)
		if err != nil {
			t.Fatal(err)
		}
		builtin, err := m.ApplyChatTemplate("", lm, addGen)
		if err != nil {
			t.Fatal(err)
		}
		jt, _ := m.Tokenize(jinja, true, true)
		bt, _ := m.Tokenize(builtin, true, true)
		if !slices.Equal(jt, bt) {
			t.Fatalf("add_generation_prompt=%v: Jinja and llama.cpp differ:\n%q\n%q", addGen, jinja, builtin)
		}
	}
	// Without a system message SmolLM2's own template adds its default one (llama.cpp's
	// built-in chatml does not): only the Jinja path is faithful to the model there.
	j, _ := r.Render([]chat.Message{{Role: "user", Content: "x"}}, nil, true)
	if !strings.Contains(j, "named SmolLM") {
		t.Fatalf("default system prompt missing: %q", j)
	}
	tools := []chat.Tool{{Type: "function", Function: chat.ToolFunction{Name: "get_weather", Parameters: json.RawMessage(`{"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}`)}}}
	withTools, err := r.Render(msgs, tools, true)
	if err != nil || !strings.Contains(withTools, `"name": "get_weather"`) || !strings.Contains(withTools, `"required": ["city", "unit"]`) {
		t.Fatalf("rendering with tools lacks the schema: %v\n%s", err, withTools)
	}
}
