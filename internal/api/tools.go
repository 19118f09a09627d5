package api

import (
	"bytes"
	"encoding/json"
	"maps"
	"regexp"
	"strings"

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
func (s *Server) planTools(req *chatRequest) (toolPlan, *apiError) {
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
		callable := plan.tools
		if choice == "named" {
			callable = nil
			for _, t := range plan.tools {
				if t.Function.Name == named {
					callable = []chat.Tool{t}
				}
			}
			if callable == nil {
				return plan, badRequest("tool_choice names function %q, which is not in tools", named)
			}
		}
		schema, err := chat.CallSchema(format, callable)
		if err != nil {
			return plan, badRequest("tools: %v", err)
		}
		g, err := chat.SchemaToGBNF(schema)
		if err != nil {
			return plan, badRequest("tools: a parameters schema cannot be compiled to a grammar: %v", err)
		}
		plan.grammar = chat.CallGrammar(format, g, plan.parallel && choice == "required")
	}
	reasoning, e := req.templateOptions.reasoning()
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
	var obj struct {
		Type     string `json:"type"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil || obj.Type != "function" || obj.Function.Name == "" {
		return "", "", badRequest("tool_choice must be \"auto\", \"none\", \"required\" or {type: \"function\", function: {name}}")
	}
	return "named", obj.Function.Name, nil
}

func (s *Server) responseFormatGrammar(raw json.RawMessage) (string, *apiError) {
	if isNull(raw) {
		return "", nil
	}
	var rf struct {
		Type       string `json:"type"`
		JSONSchema *struct {
			Name   string          `json:"name"`
			Schema json.RawMessage `json:"schema"`
		} `json:"json_schema"`
	}
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

// toolCallsJSON is the OpenAI message.tool_calls array.
func toolCallsJSON(calls []chat.ToolCall) []map[string]any {
	out := make([]map[string]any, len(calls))
	for i, c := range calls {
		out[i] = map[string]any{"id": c.ID, "type": "function", "function": map[string]any{"name": c.Function.Name, "arguments": c.Function.Arguments}}
	}
	return out
}

// sendCallDeltas sends tool-call pieces as OpenAI streams them, one chunk each: the
// first piece of a call with its index, id, type and name, then its arguments as they
// were generated. base is an empty chunk to fill; false means the client is gone.
func sendCallDeltas(send func(any) bool, base map[string]any, deltas []chat.CallDelta) bool {
	for _, d := range deltas {
		var tc map[string]any
		if d.Name != "" {
			tc = map[string]any{"index": d.Index, "id": d.ID, "type": "function", "function": map[string]any{"name": d.Name, "arguments": d.Args}}
		} else {
			tc = map[string]any{"index": d.Index, "function": map[string]any{"arguments": d.Args}}
		}
		c := maps.Clone(base)
		choice := maps.Clone(base["choices"].([]any)[0].(map[string]any))
		choice["delta"] = map[string]any{"tool_calls": []map[string]any{tc}}
		c["choices"] = []any{choice}
		if !send(c) {
			return false
		}
	}
	return true
}

// replyMessage builds the chat message from the generated text: reasoning_content,
// content and tool_calls as the plan says (finish_reason "tool_calls" when calls came).
func replyMessage(plan *toolPlan, text string, choice map[string]any) map[string]any {
	msg := map[string]any{"role": "assistant", "content": text}
	p := chat.ParseReply(plan.reply, text)
	if p.Reasoning == "" && len(p.Calls) == 0 && !plan.reply.Forced && p.Content == strings.TrimSpace(text) {
		return msg // nothing to split out: the text as generated
	}
	msg["content"] = p.Content
	if p.Reasoning != "" {
		msg["reasoning_content"] = p.Reasoning
	}
	if len(p.Calls) > 0 {
		msg["tool_calls"] = toolCallsJSON(p.Calls)
		msg["content"] = nilIfEmpty(p.Content)
		choice["finish_reason"] = "tool_calls"
	} else if plan.reply.Forced {
		msg["content"] = nilIfEmpty(p.Content) // a forced call cut short: no half call
	}
	return msg
}

// reasoningChunk turns a stream chunk into a delta.reasoning_content one.
func reasoningChunk(c map[string]any, text string) map[string]any {
	c["choices"].([]any)[0].(map[string]any)["delta"] = map[string]any{"reasoning_content": text}
	return c
}
