// Package chat renders OpenAI-style conversations (with tools) into prompt text using
// the model's own Jinja chat template, and parses tool calls back out of generated
// text. It is pure Go: the caller supplies llama.cpp's built-in renderer as fallback.
package chat

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/nikolalohinski/gonja/v2"
	"github.com/nikolalohinski/gonja/v2/builtins"
	"github.com/nikolalohinski/gonja/v2/config"
	"github.com/nikolalohinski/gonja/v2/exec"
	"github.com/nikolalohinski/gonja/v2/loaders"
)

// ToolCall is an OpenAI tool call (function.arguments is a JSON string).
type ToolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function FunctionCall `json:"function"`
}

// FunctionCall names a function and its JSON-encoded arguments.
type FunctionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// Message is one turn of a conversation.
type Message struct {
	Role       string
	Content    string
	Name       string
	ToolCallID string
	ToolCalls  []ToolCall
}

// Tool is an OpenAI function tool.
type Tool struct {
	Type     string       `json:"type"`
	Function ToolFunction `json:"function"`
}

// ToolFunction describes a callable function; Parameters is a JSON schema.
type ToolFunction struct {
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
}

// Path names how prompts are rendered, for /props.
const (
	PathJinja    = "jinja"
	PathBuiltin  = "llama_chat_apply_template"
	PathFallback = "llama_chat_apply_template (the Jinja template did not compile)"
)

// Fallback renders plain role/content messages (llama_chat_apply_template).
type Fallback func(msgs []Message, addGenerationPrompt bool) (string, error)

// Renderer renders with the model's Jinja template, falling back to llama.cpp's
// built-in template detection when the Jinja template cannot be used.
type Renderer struct {
	source    string
	tmpl      *exec.Template
	compileMu sync.Mutex // gonja templates are not documented as safe for concurrent use
	bos, eos  string
	fallback  Fallback
	format    Format
	usesTools bool
	path      string
}

// NewRenderer compiles source (the GGUF tokenizer.chat_template). A template that
// does not compile leaves the fallback as the only path.
func NewRenderer(source, bos, eos string, fallback Fallback) *Renderer {
	r := &Renderer{source: source, bos: bos, eos: eos, fallback: fallback, format: DetectFormat(source),
		usesTools: strings.Contains(source, "tools"), path: PathBuiltin}
	if source == "" {
		return r
	}
	tmpl, err := compile(source)
	if err != nil {
		r.path = PathFallback
		return r
	}
	r.tmpl, r.path = tmpl, PathJinja
	return r
}

var silenceOnce sync.Once

func compile(source string) (*exec.Template, error) {
	silenceOnce.Do(func() { gonja.SetLoggerOutput(io.Discard) })
	cfg := config.New()
	// HF templates rely on trim_blocks/lstrip_blocks being off and undefined being
	// falsy (Jinja's default), so the default config is what they expect.
	loader, err := loaders.NewFileSystemLoader("")
	if err != nil {
		return nil, err
	}
	root := "chat-template"
	shifted, err := loaders.NewShiftedLoader(root, strings.NewReader(source), loader)
	if err != nil {
		return nil, err
	}
	env := &exec.Environment{
		Context:           exec.EmptyContext().Update(builtins.GlobalFunctions).Update(builtins.GlobalVariables).Update(helpers()),
		Filters:           builtins.Filters.Update(exec.NewFilterSet(map[string]exec.FilterFunction{"tojson": filterToJSON})),
		Tests:             builtins.Tests,
		ControlStructures: builtins.ControlStructures,
		Methods:           builtins.Methods,
	}
	return exec.NewTemplate(root, cfg, shifted, env)
}

// ErrTemplateRaised is a template's own raise_exception: the conversation broke a rule
// of the model's template (roles must alternate, say), so it is the caller's error.
var ErrTemplateRaised = errors.New("chat template raised an exception")

func helpers() *exec.Context {
	return exec.NewContext(map[string]any{
		"raise_exception": func(msg string) (string, error) {
			return "", fmt.Errorf("%w: %s", ErrTemplateRaised, msg)
		},
		"strftime_now": func(format string) string { return strftime(time.Now(), format) },
	})
}

// filterToJSON is HF's tojson: Python json.dumps separators (", " and ": "), no HTML
// escaping, non-ASCII kept.
func filterToJSON(_ *exec.Evaluator, in *exec.Value, params *exec.VarArgs) *exec.Value {
	if in.IsError() {
		return in
	}
	indent := 0
	if v, ok := params.KwArgs["indent"]; ok && v.IsInteger() {
		indent = v.Integer()
	}
	out, err := pyJSON(in.Interface(), indent)
	if err != nil {
		return exec.AsValue(exec.ErrInvalidCall(err))
	}
	return exec.AsSafeValue(out)
}

// Path says which renderer is in use.
func (r *Renderer) Path() string { return r.path }

// Format is the tool-call format the template implies.
func (r *Renderer) Format() Format { return r.format }

// Render renders msgs (and tools, if any) into prompt text.
func (r *Renderer) Render(msgs []Message, tools []Tool, addGenerationPrompt bool) (string, error) {
	if len(tools) > 0 && !r.usesTools {
		msgs = injectTools(msgs, tools)
		tools = nil
	}
	if r.tmpl == nil {
		if len(tools) > 0 || hasToolTurns(msgs) {
			return r.fallback(flattenToolTurns(msgs), addGenerationPrompt)
		}
		return r.fallback(msgs, addGenerationPrompt)
	}
	ctx := exec.NewContext(map[string]any{
		"messages":              templateMessages(msgs),
		"add_generation_prompt": addGenerationPrompt,
		"bos_token":             r.bos,
		"eos_token":             r.eos,
	})
	if len(tools) > 0 {
		ctx.Set("tools", templateTools(tools))
	}
	r.compileMu.Lock()
	defer r.compileMu.Unlock()
	var buf bytes.Buffer
	if err := r.tmpl.Execute(&buf, ctx); err != nil {
		if errors.Is(err, ErrTemplateRaised) {
			return "", err
		}
		if strings.Contains(err.Error(), ErrTemplateRaised.Error()) {
			// gonja reports the helper's error as text: keep the sentinel for callers.
			return "", fmt.Errorf("%w (%v)", ErrTemplateRaised, err)
		}
		return r.fallback(flattenToolTurns(msgs), addGenerationPrompt)
	}
	return buf.String(), nil
}

func hasToolTurns(msgs []Message) bool {
	for _, m := range msgs {
		if m.Role == "tool" || len(m.ToolCalls) > 0 {
			return true
		}
	}
	return false
}

// flattenToolTurns writes tool calls and results as text, for renderers that only know
// role/content turns.
func flattenToolTurns(msgs []Message) []Message {
	out := make([]Message, 0, len(msgs))
	for _, m := range msgs {
		switch {
		case len(m.ToolCalls) > 0:
			var b strings.Builder
			b.WriteString(m.Content)
			for _, c := range m.ToolCalls {
				fmt.Fprintf(&b, "<tool_call>{\"name\": %q, \"arguments\": %s}</tool_call>", c.Function.Name, argsOrEmpty(c.Function.Arguments))
			}
			out = append(out, Message{Role: "assistant", Content: b.String()})
		case m.Role == "tool":
			out = append(out, Message{Role: "user", Content: "<tool_response>\n" + m.Content + "\n</tool_response>"})
		default:
			out = append(out, m)
		}
	}
	return out
}

func argsOrEmpty(a string) string {
	if json.Valid([]byte(a)) {
		return a
	}
	return "{}"
}

// injectTools describes the tools in the system message for templates that cannot
// render tools themselves, asking for Hermes-style <tool_call> blocks.
func injectTools(msgs []Message, tools []Tool) []Message {
	var b strings.Builder
	b.WriteString("You can call functions to help with the user's request. The functions are described by JSON schemas:\n<tools>\n")
	for _, t := range tools {
		line, _ := pyJSON(map[string]any{"type": "function", "function": map[string]any{
			"name": t.Function.Name, "description": t.Function.Description, "parameters": rawOrEmpty(t.Function.Parameters)}}, 0)
		b.WriteString(line)
		b.WriteString("\n")
	}
	b.WriteString("</tools>\nTo call a function, answer with a JSON object inside tags: <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}</tool_call>")
	out := make([]Message, 0, len(msgs)+1)
	if len(msgs) > 0 && (msgs[0].Role == "system" || msgs[0].Role == "developer") {
		first := msgs[0]
		first.Role = "system"
		first.Content = strings.TrimRight(first.Content, "\n") + "\n\n" + b.String()
		out = append(out, first)
		msgs = msgs[1:]
	} else {
		out = append(out, Message{Role: "system", Content: b.String()})
	}
	return append(out, msgs...)
}

func rawOrEmpty(r json.RawMessage) any {
	var v any
	if len(r) == 0 || json.Unmarshal(r, &v) != nil {
		return map[string]any{"type": "object", "properties": map[string]any{}}
	}
	return v
}

func templateMessages(msgs []Message) []any {
	out := make([]any, len(msgs))
	for i, m := range msgs {
		role := m.Role
		if role == "developer" {
			role = "system"
		}
		mm := map[string]any{"role": role, "content": m.Content}
		if m.Name != "" {
			mm["name"] = m.Name
		}
		if m.ToolCallID != "" {
			mm["tool_call_id"] = m.ToolCallID
		}
		if len(m.ToolCalls) > 0 {
			calls := make([]any, len(m.ToolCalls))
			for j, c := range m.ToolCalls {
				var args any = c.Function.Arguments
				var parsed map[string]any
				if json.Unmarshal([]byte(c.Function.Arguments), &parsed) == nil {
					args = parsed // HF templates iterate or tojson the arguments object
				}
				calls[j] = map[string]any{"id": c.ID, "type": "function", "function": map[string]any{"name": c.Function.Name, "arguments": args}}
			}
			mm["tool_calls"] = calls
		}
		out[i] = mm
	}
	return out
}

func templateTools(tools []Tool) []any {
	out := make([]any, len(tools))
	for i, t := range tools {
		out[i] = map[string]any{"type": "function", "function": map[string]any{
			"name": t.Function.Name, "description": t.Function.Description, "parameters": rawOrEmpty(t.Function.Parameters)}}
	}
	return out
}

// strftime formats the subset of C strftime HF templates use (%Y %m %d %B %b %H %M %S %A %a %j %%).
func strftime(t time.Time, f string) string {
	var b strings.Builder
	for i := 0; i < len(f); i++ {
		if f[i] != '%' || i+1 == len(f) {
			b.WriteByte(f[i])
			continue
		}
		i++
		switch f[i] {
		case 'Y':
			fmt.Fprintf(&b, "%04d", t.Year())
		case 'm':
			fmt.Fprintf(&b, "%02d", int(t.Month()))
		case 'd':
			fmt.Fprintf(&b, "%02d", t.Day())
		case 'B':
			b.WriteString(t.Month().String())
		case 'b':
			b.WriteString(t.Month().String()[:3])
		case 'H':
			fmt.Fprintf(&b, "%02d", t.Hour())
		case 'M':
			fmt.Fprintf(&b, "%02d", t.Minute())
		case 'S':
			fmt.Fprintf(&b, "%02d", t.Second())
		case 'A':
			b.WriteString(t.Weekday().String())
		case 'a':
			b.WriteString(t.Weekday().String()[:3])
		case 'j':
			fmt.Fprintf(&b, "%03d", t.YearDay())
		case '%':
			b.WriteByte('%')
		default:
			b.WriteByte('%')
			b.WriteByte(f[i])
		}
	}
	return b.String()
}
