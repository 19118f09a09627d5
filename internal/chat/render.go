// Package chat renders OpenAI-style conversations (with tools) into prompt text using
// the model's own Jinja chat template, and parses tool calls back out of generated
// text. It is pure Go.
package chat

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/polykv/polykv/internal/chat/jinja"
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
	Role string
	// Content is the text; NullContent says the client sent null or nothing (an
	// assistant turn that only calls tools), which templates see as none, not "".
	Content     string
	NullContent bool
	Name        string
	ToolCallID  string
	ToolCalls   []ToolCall
	// ReasoningContent is an assistant turn's reasoning, given back by the client;
	// thinking templates (Qwen3, GLM, …) read message.reasoning_content.
	ReasoningContent string
	// Raw is the client's message object: its other keys (GPT-OSS's "thinking", …)
	// reach the template too, in the client's order, as transformers passes them.
	Raw json.RawMessage
}

// Tool is an OpenAI function tool. Raw keeps the client's JSON so the template sees
// its keys in the order the client wrote them (transformers passes the dicts through).
type Tool struct {
	Type     string          `json:"type"`
	Function ToolFunction    `json:"function"`
	Raw      json.RawMessage `json:"-"`
}

// UnmarshalJSON decodes a tool and keeps its raw bytes for order-preserving rendering.
func (t *Tool) UnmarshalJSON(b []byte) error {
	type plain Tool
	var p plain
	if err := json.Unmarshal(b, &p); err != nil {
		return err
	}
	*t = Tool(p)
	t.Raw = append(json.RawMessage(nil), b...)
	return nil
}

// ToolFunction describes a callable function; Parameters is a JSON schema.
type ToolFunction struct {
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
}

// Path names how prompts are rendered, for /props.
const (
	PathJinja = "jinja"
	// PathNone: no usable template; chat requests answer 400 naming --chat-template.
	PathNone = "none"
)

// ErrTemplateRaised is a template's own raise_exception: the conversation broke a rule
// of the model's template (roles must alternate, say), so it is the caller's error.
var ErrTemplateRaised = errors.New("chat template raised an exception")

// ErrNoTemplate means the model has no chat template (or one that does not compile)
// and none was given on the command line: the client's 400, naming the flag that fixes it.
var ErrNoTemplate = errors.New("the model has no usable chat template; start the server with --chat-template NAME or --chat-template-file PATH")

// ErrTemplateFailed is a template that compiled but could not render this
// conversation for a reason other than its own raise_exception.
var ErrTemplateFailed = errors.New("chat template failed to render")

// Renderer renders with a Jinja template the way transformers' apply_chat_template
// does. A template that cannot be used makes every Render fail with ErrNoTemplate:
// there is no silent fallback that would drop tools or tool turns.
type Renderer struct {
	source     string
	tmpl       *jinja.Template
	compileErr error
	bos, eos   string
	format     Format
	usesTools  bool
}

// NewRenderer compiles source (the GGUF tokenizer.chat_template or an override). Err
// reports why it cannot be used, for a startup warning.
func NewRenderer(source, bos, eos string) *Renderer {
	r := &Renderer{source: source, bos: bos, eos: eos, format: DetectFormat(source),
		usesTools: strings.Contains(source, "tools")}
	if strings.TrimSpace(source) == "" {
		r.compileErr = errors.New("no chat template")
		return r
	}
	tmpl, err := compile(source)
	if err != nil {
		r.compileErr = err
		return r
	}
	r.tmpl = tmpl
	return r
}

// Err is nil when the template compiled, else why chat requests will be refused.
func (r *Renderer) Err() error { return r.compileErr }

// BOS and EOS are the token texts the template sees as bos_token and eos_token.
func (r *Renderer) BOS() string { return r.bos }

// EOS is the end-of-sequence token text given to the template.
func (r *Renderer) EOS() string { return r.eos }

// Path says which renderer is in use.
func (r *Renderer) Path() string {
	if r.tmpl == nil {
		return PathNone
	}
	return PathJinja
}

// Format is the tool-call format the template implies.
func (r *Renderer) Format() Format { return r.format }

// Options are the render inputs beyond messages and tools.
type Options struct {
	AddGenerationPrompt bool
	// Kwargs are extra template variables (chat_template_kwargs), in the client's order.
	Kwargs json.RawMessage
}

// Render renders msgs (and tools, if any) into prompt text.
func (r *Renderer) Render(msgs []Message, tools []Tool, addGenerationPrompt bool) (string, error) {
	return r.RenderOpts(msgs, tools, Options{AddGenerationPrompt: addGenerationPrompt})
}

// RenderOpts renders with explicit options.
func (r *Renderer) RenderOpts(msgs []Message, tools []Tool, o Options) (string, error) {
	if r.tmpl == nil {
		return "", fmt.Errorf("%w (%v)", ErrNoTemplate, r.compileErr)
	}
	if len(tools) > 0 && !r.usesTools {
		// The template cannot show tools: describe them in the system message instead,
		// so a small model without tool training can still call them (documented).
		msgs = injectTools(msgs, tools)
		tools = nil
	}
	data := globals()
	for k, v := range map[string]jinja.Value{
		"messages":              templateMessages(msgs),
		"add_generation_prompt": jinja.NewBool(o.AddGenerationPrompt),
		"bos_token":             jinja.NewString(r.bos),
		"eos_token":             jinja.NewString(r.eos),
		// transformers passes tools=None and documents=None when there are none: a
		// template's "tools is defined" is then true and "tools is not none" false.
		"tools":     jinja.None(),
		"documents": jinja.None(),
	} {
		data[k] = v
	}
	if len(tools) > 0 {
		data["tools"] = templateTools(tools)
	}
	if len(o.Kwargs) > 0 && string(o.Kwargs) != "null" {
		kw, err := orderedJSON(o.Kwargs)
		if err != nil || !kw.IsDict() {
			return "", fmt.Errorf("%w: chat_template_kwargs must be a JSON object", ErrTemplateFailed)
		}
		d := kw.AsDict()
		for _, k := range d.Keys {
			switch k {
			case "messages", "tools", "documents", "add_generation_prompt":
				// transformers refuses these too (render() gets them twice).
				return "", fmt.Errorf("%w: chat_template_kwargs must not set %q", ErrTemplateFailed, k)
			}
			data[k] = d.Data[k]
		}
	}
	out, err := r.tmpl.RenderValues(data)
	if err != nil {
		if isRaised(err) {
			return "", fmt.Errorf("%w: %s", ErrTemplateRaised, raisedMessage(err))
		}
		return "", fmt.Errorf("%w: %v", ErrTemplateFailed, err)
	}
	return out, nil
}

// injectTools describes the tools in the system message for templates that cannot
// render tools themselves, asking for Hermes-style <tool_call> blocks.
func injectTools(msgs []Message, tools []Tool) []Message {
	var b strings.Builder
	b.WriteString("You can call functions to help with the user's request. The functions are described by JSON schemas:\n<tools>\n")
	for _, t := range tools {
		line, _ := jinja.DumpJSON(toolValue(t), jinja.JSONOptions{ItemSep: ", ", KeySep: ": "})
		b.WriteString(line)
		b.WriteString("\n")
	}
	b.WriteString("</tools>\nTo call a function, answer with a JSON object inside tags: <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}</tool_call>")
	out := make([]Message, 0, len(msgs)+1)
	if len(msgs) > 0 && (msgs[0].Role == "system" || msgs[0].Role == "developer") {
		first := msgs[0]
		first.Role = "system"
		first.Content = strings.TrimRight(first.Content, "\n") + "\n\n" + b.String()
		first.NullContent = false
		out = append(out, first)
		msgs = msgs[1:]
	} else {
		out = append(out, Message{Role: "system", Content: b.String()})
	}
	return append(out, msgs...)
}

// templateMessages builds the messages as transformers hands them to the template:
// role and content first, content none when the client sent null, arguments as an
// object (in the client's key order) when they are JSON, as llama.cpp and HF templates
// expect.
func templateMessages(msgs []Message) jinja.Value {
	items := make([]jinja.Value, len(msgs))
	for i, m := range msgs {
		v := jinja.NewDict()
		if len(m.Raw) > 0 {
			if raw, err := orderedJSON(m.Raw); err == nil && raw.IsDict() {
				v = raw // the fields below replace theirs in place, keeping the order
			}
		}
		d := v.AsDict()
		role := m.Role
		if role == "developer" {
			role = "system"
		}
		d.Set("role", jinja.NewString(role))
		if m.NullContent {
			d.Set("content", jinja.None())
		} else {
			d.Set("content", jinja.NewString(m.Content))
		}
		if m.Name != "" {
			d.Set("name", jinja.NewString(m.Name))
		}
		if m.ReasoningContent != "" {
			d.Set("reasoning_content", jinja.NewString(m.ReasoningContent))
		}
		if m.ToolCallID != "" {
			d.Set("tool_call_id", jinja.NewString(m.ToolCallID))
		}
		if len(m.ToolCalls) > 0 {
			calls := make([]jinja.Value, len(m.ToolCalls))
			for j, c := range m.ToolCalls {
				cv := jinja.NewDict()
				cd := cv.AsDict()
				cd.Set("id", jinja.NewString(c.ID))
				cd.Set("type", jinja.NewString("function"))
				fv := jinja.NewDict()
				fd := fv.AsDict()
				fd.Set("name", jinja.NewString(c.Function.Name))
				args := jinja.NewString(c.Function.Arguments)
				if a, err := orderedJSON([]byte(c.Function.Arguments)); err == nil && a.IsDict() {
					args = a
				}
				fd.Set("arguments", args)
				cd.Set("function", fv)
				calls[j] = cv
			}
			d.Set("tool_calls", jinja.NewList(calls))
		}
		items[i] = v
	}
	return jinja.NewList(items)
}

func templateTools(tools []Tool) jinja.Value {
	items := make([]jinja.Value, len(tools))
	for i, t := range tools {
		items[i] = toolValue(t)
	}
	return jinja.NewList(items)
}

// toolValue is the client's tool object in its own key order; a tool built in Go
// (no raw JSON) gets OpenAI's order: type, function{name, description, parameters}.
func toolValue(t Tool) jinja.Value {
	if len(t.Raw) > 0 {
		if v, err := orderedJSON(t.Raw); err == nil {
			return v
		}
	}
	fv := jinja.NewDict()
	fd := fv.AsDict()
	fd.Set("name", jinja.NewString(t.Function.Name))
	if t.Function.Description != "" {
		fd.Set("description", jinja.NewString(t.Function.Description))
	}
	if len(t.Function.Parameters) > 0 {
		if p, err := orderedJSON(t.Function.Parameters); err == nil {
			fd.Set("parameters", p)
		}
	}
	v := jinja.NewDict()
	v.AsDict().Set("type", jinja.NewString("function"))
	v.AsDict().Set("function", fv)
	return v
}
