package api

import (
	"bytes"
	"encoding/json"
	"regexp"
	"strings"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/chat"
)

// toolPlan is what a chat request asks of tools and output structure.
type toolPlan struct {
	tools   []chat.Tool // rendered into the prompt ("none" renders none)
	parse   bool        // parse tool calls out of the reply
	grammar string      // constrained decoding ("" = free)
	// triggers make grammar lazy (tool_choice auto): free text until one appears.
	triggers []chat.Trigger
	parallel bool
	// reply says how the generated text splits into reasoning, content and calls
	// (ThinkingOpen is set once the prompt is rendered).
	reply chat.ReplyOptions
}

var toolNameRE = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,64}$`)

// planTools validates tools, tool_choice, parallel_tool_calls and response_format and
// compiles the grammar they call for. Errors are 400s naming the field.
func (s *Server) planTools(req *wire.ChatRequest) (toolPlan, *apiError) {
	var plan toolPlan
	tools, e := parseTools(req.Tools)
	if e != nil {
		return plan, e
	}
	plan.tools = tools
	// Grammar-forced calls allow several only when asked for explicitly: left open, a
	// small model repeats the call until max_tokens.
	plan.parallel = req.ParallelToolCalls != nil && *req.ParallelToolCalls
	choice, named, e := parseToolChoice(req.ToolChoice)
	if e != nil {
		return plan, e
	}
	if choice != "auto" && len(plan.tools) == 0 {
		if choice == "none" {
			choice = "auto"
		} else {
			return plan, badRequest("tool_choice %q needs tools", choice)
		}
	}
	format := s.format()
	switch choice {
	case "none":
		plan.tools = nil
	case "auto":
		plan.parse = len(plan.tools) > 0
		// Free text until the family's call syntax starts, then a well-formed call
		// of a declared tool (families without a call grammar stay free).
		g, trig, ok, err := chat.AutoGrammar(format, plan.tools, plan.parallel)
		if err != nil {
			return plan, badRequest("tools: a parameters schema cannot be compiled to a grammar: %v", err)
		}
		if ok {
			plan.grammar, plan.triggers = g, trig
		}
	case "required", "named":
		plan.parse = true
		if plan.grammar, e = forcedCallGrammar(format, plan.tools, named, plan.parallel && choice == "required"); e != nil {
			return plan, e
		}
	}
	reasoning, e := reasoning(req.TemplateOptions)
	if e != nil {
		return plan, e
	}
	plan.reply = chat.ReplyOptions{Format: format, Tools: plan.tools, Calls: plan.parse, Reasoning: reasoning,
		Forced: choice == "required" || choice == "named"}
	rf, e := s.responseFormatGrammar(req.ResponseFormat)
	if e != nil {
		return plan, e
	}
	if rf != "" {
		if plan.triggers != nil {
			// The whole reply must fit response_format: no call can start in it.
			plan.grammar, plan.triggers = "", nil
		}
		if plan.grammar != "" {
			return plan, badRequest("response_format cannot be combined with tool_choice %q: the reply is a tool call", choice)
		}
		plan.grammar = rf
	}
	if plan.grammar != "" {
		if err := s.tok.CheckGrammar(plan.grammar); err != nil {
			return plan, badRequest("the grammar compiled from the schema was refused: %v", err)
		}
	}
	return plan, nil
}

// forcedCallGrammar is the grammar of tool_choice "required" (named "") or a named
// function: the reply is a call of one of the callable tools, from its first token, in
// the family's own call syntax (chat.ForcedGrammar); Hermes tags only where the family
// has no call grammar or cannot write these tools (its parser reads those too).
func forcedCallGrammar(format chat.Format, tools []chat.Tool, named string, parallel bool) (string, *apiError) {
	callable := tools
	if named != "" {
		callable = nil
		for _, t := range tools {
			if t.Function.Name == named {
				callable = []chat.Tool{t}
			}
		}
		if callable == nil {
			return "", badRequest("tool_choice names function %q, which is not in tools", named)
		}
	}
	g, ok, err := chat.ForcedGrammar(format, callable, "", parallel)
	if err != nil {
		return "", badRequest("tools: a parameters schema cannot be compiled to a grammar: %v", err)
	}
	if ok {
		return g, nil
	}
	schema, err := chat.CallSchema(format, callable)
	if err != nil {
		return "", badRequest("tools: %v", err)
	}
	g, err = chat.ToolSchemaToGBNF(schema)
	if err != nil {
		return "", badRequest("tools: a parameters schema cannot be compiled to a grammar: %v", err)
	}
	return chat.CallGrammar(format, g, parallel), nil
}

// parseTools validates an OpenAI tools array (chat requests and pools share it, so a
// pool built with tools renders exactly the start of a chat with the same tools).
func parseTools(raw json.RawMessage) ([]chat.Tool, *apiError) {
	if isNull(raw) {
		return nil, nil
	}
	var tools []chat.Tool
	if err := json.Unmarshal(raw, &tools); err != nil {
		return nil, badRequest("tools must be an array of {type: \"function\", function: {name, description, parameters}}")
	}
	seen := map[string]bool{}
	for i, t := range tools {
		if t.Type != "function" {
			return nil, badRequest("tools[%d].type must be \"function\", got %q", i, t.Type)
		}
		if !toolNameRE.MatchString(t.Function.Name) {
			return nil, badRequest("tools[%d].function.name %q must be 1-64 letters, digits, _ or -", i, t.Function.Name)
		}
		if seen[t.Function.Name] {
			return nil, badRequest("tools[%d]: duplicate function name %q", i, t.Function.Name)
		}
		seen[t.Function.Name] = true
		if p := bytes.TrimSpace(t.Function.Parameters); len(p) > 0 && !isNull(p) {
			var obj map[string]any
			if err := json.Unmarshal(p, &obj); err != nil {
				return nil, badRequest("tools[%d].function.parameters must be a JSON schema object", i)
			}
		}
	}
	return tools, nil
}

func parseToolChoice(raw json.RawMessage) (string, string, *apiError) {
	if isNull(raw) {
		return "auto", "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		switch s {
		case "auto", "none", "required":
			return s, "", nil
		}
		return "", "", badRequest("tool_choice must be \"auto\", \"none\", \"required\" or {type: \"function\", function: {name}}, got %q", s)
	}
	var obj wire.ToolChoiceFunction
	if err := json.Unmarshal(raw, &obj); err != nil || obj.Type != "function" || obj.Function.Name == "" {
		return "", "", badRequest("tool_choice must be \"auto\", \"none\", \"required\" or {type: \"function\", function: {name}}")
	}
	return "named", obj.Function.Name, nil
}

func (s *Server) responseFormatGrammar(raw json.RawMessage) (string, *apiError) {
	if isNull(raw) {
		return "", nil
	}
	var rf wire.ResponseFormat
	if err := json.Unmarshal(raw, &rf); err != nil {
		return "", badRequest("response_format must be an object with a type")
	}
	var schema []byte
	switch rf.Type {
	case "text":
		return "", nil
	case "json_object":
		return chat.JSONObjectGBNF(2, 8), nil
	case "json_schema":
		if rf.JSONSchema == nil || isNull(rf.JSONSchema.Schema) {
			return "", badRequest("response_format json_schema needs json_schema.schema")
		}
		schema = rf.JSONSchema.Schema
	default:
		return "", badRequest("response_format.type must be text, json_object or json_schema, got %q", rf.Type)
	}
	g, err := chat.SchemaToGBNF(schema)
	if err != nil {
		return "", badRequest("response_format: %v", err)
	}
	return g, nil
}

func (s *Server) format() chat.Format {
	if f, ok := s.chat.(interface{ Format() chat.Format }); ok {
		return f.Format()
	}
	return chat.FormatHermes
}

// wireToolCalls is the OpenAI message.tool_calls array.
func wireToolCalls(calls []chat.ToolCall) []wire.ToolCall {
	out := make([]wire.ToolCall, len(calls))
	for i, c := range calls {
		out[i] = wire.ToolCall{ID: c.ID, Type: "function", Function: wire.ToolCallFunction{Name: c.Function.Name, Arguments: c.Function.Arguments}}
	}
	return out
}

// replyMessage builds the chat message from the generated text: reasoning_content,
// content and tool_calls as the plan says; calls reports whether tool calls came
// (finish_reason "tool_calls").
func replyMessage(plan *toolPlan, text string) (msg wire.Message, calls bool) {
	msg = wire.Message{Role: "assistant", Content: &text}
	p := chat.ParseReply(plan.reply, text)
	if p.Reasoning == "" && len(p.Calls) == 0 && !plan.reply.Forced && p.Content == strings.TrimSpace(text) {
		return msg, false // nothing to split out: the text as generated
	}
	msg.Content = &p.Content
	msg.ReasoningContent = p.Reasoning
	if len(p.Calls) > 0 {
		msg.ToolCalls = wireToolCalls(p.Calls)
		msg.Content = nilIfEmpty(p.Content)
		return msg, true
	}
	if plan.reply.Forced {
		msg.Content = nilIfEmpty(p.Content) // a forced call cut short: no half call
	}
	return msg, false
}

// nilIfEmpty is content that is null when empty.
func nilIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}
