package api

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
)

// OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}),
// translated onto chat completions (translate.go). A response chain is a session: the
// first stored response of a chain names a session after itself, and every response
// continued by previous_response_id runs on its predecessor's session, so the engine
// reuses the cells that hold the conversation so far (usage.input_tokens_details.
// cached_tokens) instead of prefilling it again.

// responseTurn is what a response carries from its request to its end: the chain it
// continues and the conversation it stores.
type responseTurn struct {
	store   bool
	history []chatTurnMsg // the conversation before the reply (instructions left out)
	calls   map[string]string
	session string
	tools   responseToolSet
	// encrypted: the request's include asks for reasoning.encrypted_content.
	encrypted bool
}

func (s *Server) handleResponses(w http.ResponseWriter, r *http.Request) {
	req, ok := decodeGen[wire.ResponsesRequest](s, w, r, writeAPIError)
	if !ok {
		return
	}
	id := newID("resp_")
	creq, turn, e := s.responsesChat(id, req)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	ignoredToolsHeader(w, turn.tools.ignored)
	sh := &responsesShape{s: s, resp: responseSkeleton(s, id, req, creq), turn: turn}
	s.submitChat(w, r, creq, generation{k: kindChat, id: id, shape: sh})
}

// responsesChat translates a Responses request into a chat request: the chain it
// continues, its input items, instructions, tools, tool_choice, text.format,
// reasoning.effort and max_output_tokens. Errors are 400s naming the field.
func (s *Server) responsesChat(id string, req *wire.ResponsesRequest) (*wire.ChatRequest, *responseTurn, *apiError) {
	turn := &responseTurn{store: req.Store == nil || *req.Store, encrypted: contains(req.Include, "reasoning.encrypted_content")}
	var e *apiError
	if turn.tools, e = responseTools(req.Tools); e != nil {
		return nil, nil, e
	}
	c := newConvo(nil, nil)
	if p := req.PreviousResponseID; p != nil {
		prev := s.responses.get(*p)
		if prev == nil {
			return nil, nil, invalidParam("previous_response_id", "Invalid 'previous_response_id': previous response with id '%s' not found (unknown, deleted or expired).", *p)
		}
		c = newConvo(prev.history, prev.calls)
		turn.session = prev.session
	}
	if e := responseInput(c, req.Input, &turn.tools); e != nil {
		return nil, nil, e
	}
	turn.history, turn.calls = c.msgs, c.calls
	creq := &wire.ChatRequest{GenParams: req.GenParams, Messages: chatMessages(req.Instructions, c.msgs), ParallelToolCalls: req.ParallelToolCalls}
	g := &creq.GenParams
	switch {
	case g.SessionID != nil: // the client's own session wins
	case turn.session != "":
		g.SessionID = &turn.session
	case req.PromptCacheKey != nil && *req.PromptCacheKey != "":
		// Codex names its conversation here; a store: false client sends the whole
		// history each turn, and its session holds it in cells (one per thread).
		instr := ""
		if req.Instructions != nil {
			instr = *req.Instructions
		}
		turn.session = threadSession(*req.PromptCacheKey, instr, c.msgs)
		g.SessionID = &turn.session
	case turn.store:
		// A new chain: its session is named after its first response, so the next
		// turn finds its cells.
		turn.session = "resp-chain-" + id
		g.SessionID = &turn.session
	}
	if g.SessionID != nil {
		turn.session = *g.SessionID
	}
	if v := req.MaxOutputTokens; v != nil {
		if *v < 1 {
			return nil, nil, invalidParam("max_output_tokens", "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 1, but got %d instead.", *v)
		}
		g.MaxTokens, g.MaxCompletionTokens = v, nil // over the context: capped (maxTokens)
	}
	creq.Tools = chatTools(turn.tools.chat)
	if creq.ToolChoice, e = responseToolChoice(req.ToolChoice); e != nil {
		return nil, nil, e
	}
	if creq.ResponseFormat, e = responseFormat(req.Text); e != nil {
		return nil, nil, e
	}
	if req.Reasoning != nil {
		creq.ReasoningEffort = req.Reasoning.Effort
	}
	return creq, turn, nil
}

// responseInput adds input (a string, or an array of items) to the conversation.
func responseInput(c *convo, raw json.RawMessage, tools *responseToolSet) *apiError {
	if isNull(raw) {
		return invalidParam("input", "Missing required parameter: 'input'.")
	}
	var text string
	if json.Unmarshal(raw, &text) == nil {
		c.say("user", text)
		return nil
	}
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) != nil {
		return invalidParam("input", "Invalid 'input': expected a string or an array of input items.")
	}
	for i, rawItem := range items {
		var it wire.ResponseInputItem
		if err := json.Unmarshal(rawItem, &it); err != nil {
			return invalidParam(fmt.Sprintf("input[%d]", i), "Invalid 'input[%d]': expected an input item object.", i)
		}
		if e := responseItem(c, i, &it, tools); e != nil {
			return e
		}
	}
	return nil
}

// responseItem adds one input item (or, for a stored reply, one output item).
func responseItem(c *convo, i int, it *wire.ResponseInputItem, tools *responseToolSet) *apiError {
	field := func(name string) string { return fmt.Sprintf("input[%d].%s", i, name) }
	typ := it.Type
	if typ == "" && it.Role != "" {
		typ = "message"
	}
	switch typ {
	case "message":
		switch it.Role {
		case "user", "system", "developer", "assistant":
		default:
			return invalidParam(field("role"), "Invalid '%s': %q is not one of user, system, developer, assistant.", field("role"), it.Role)
		}
		text, bad, ok := textParts(it.Content, "input_text", "output_text", "text", "refusal")
		if !ok {
			return invalidParam(field("content"), "Invalid '%s': content must be a string or text parts (input_text, output_text); %q is not supported.", field("content"), bad)
		}
		c.say(it.Role, text)
	case "function_call":
		if it.CallID == "" || it.Name == "" {
			return invalidParam(field("call_id"), "Invalid '%s': a function_call needs call_id and name.", field("call_id"))
		}
		c.call(it.CallID, tools.modelName(it.Namespace, it.Name), it.Arguments)
	case "function_call_output":
		out, bad, ok := textParts(it.Output, "input_text", "output_text", "text")
		if !ok {
			return invalidParam(field("output"), "Invalid '%s': output must be a string or text parts; %q is not supported.", field("output"), bad)
		}
		if !c.result(it.CallID, out) {
			return invalidParam(field("call_id"), "No tool call found for function call output with call_id '%s'.", it.CallID)
		}
	case "reasoning":
		text, _, _ := textParts(it.Content, "reasoning_text")
		if text == "" && it.EncryptedContent != "" {
			var ok bool
			if text, ok = openReasoning(it.EncryptedContent); !ok {
				return invalidParam(field("encrypted_content"), "Invalid '%s': not reasoning this server returned (it reads only its own encrypted_content).", field("encrypted_content"))
			}
		}
		if text == "" {
			for _, p := range it.Summary {
				if p.Text != nil {
					text += *p.Text
				}
			}
		}
		c.think(text)
	default:
		return invalidParam(field("type"), "Invalid '%s': input item type %q is not supported (message, function_call, function_call_output, reasoning).", field("type"), typ)
	}
	return nil
}

// responseToolSet is a Responses request's tools as the model sees them: function
// tools as they are, the functions of namespace tools (Codex's multi_agent_v1 holds its
// sub-agent functions) flattened beside them, and built-in tools the server cannot run
// (web_search, file_search, ...) left out and named in ignored.
type responseToolSet struct {
	chat    []chatToolFunc
	ns      map[string]nsFunc // a flattened function's model name -> its namespace and name
	byNS    map[nsFunc]string // the reverse
	ignored []string
}

// nsFunc is a function of a namespace tool.
type nsFunc struct{ namespace, name string }

// responseTools reads tools. A namespace function keeps its own name for the model
// unless another tool has that name; then it is namespace__name. Either way a call of it
// is returned with its namespace and own name, as the client declared it.
func responseTools(tools []wire.ResponseTool) (responseToolSet, *apiError) {
	set := responseToolSet{ns: map[string]nsFunc{}, byNS: map[nsFunc]string{}}
	taken := map[string]int{}
	for _, t := range tools {
		taken[t.Name]++
		for _, f := range t.Tools {
			taken[f.Name]++
		}
	}
	for i, t := range tools {
		switch t.Type {
		case "function":
			if !toolNameRE.MatchString(t.Name) {
				return set, invalidParam(fmt.Sprintf("tools[%d].name", i), "Invalid 'tools[%d].name': %q must be 1-64 letters, digits, _ or -.", i, t.Name)
			}
			set.chat = append(set.chat, chatToolFunc{Name: t.Name, Description: t.Description, Parameters: t.Parameters})
		case "namespace":
			for j, f := range t.Tools {
				if f.Type != "function" || !toolNameRE.MatchString(f.Name) || !toolNameRE.MatchString(t.Name) {
					return set, invalidParam(fmt.Sprintf("tools[%d].tools[%d]", i, j), "Invalid 'tools[%d].tools[%d]': a namespace holds function tools named with 1-64 letters, digits, _ or -.", i, j)
				}
				name := f.Name
				if taken[name] > 1 {
					name = t.Name + "__" + f.Name
				}
				set.ns[name], set.byNS[nsFunc{t.Name, f.Name}] = nsFunc{t.Name, f.Name}, name
				desc := f.Description
				if t.Description != "" {
					desc = t.Description + " " + desc
				}
				set.chat = append(set.chat, chatToolFunc{Name: name, Description: desc, Parameters: f.Parameters})
			}
		default:
			set.ignored = append(set.ignored, t.Type)
		}
	}
	return set, nil
}

// modelName is the name the model knows a declared function by (a call item's namespace
// and name, as the client sends it back).
func (set *responseToolSet) modelName(namespace, name string) string {
	if n, ok := set.byNS[nsFunc{namespace, name}]; ok {
		return n
	}
	return name
}

// clientName is a call's function as the client declared it: its namespace ("" for a
// plain function) and name.
func (set *responseToolSet) clientName(model string) (namespace, name string) {
	if f, ok := set.ns[model]; ok {
		return f.namespace, f.name
	}
	return "", model
}

// reasoningSeal prefixes the reasoning PolyKV returns as encrypted_content. It is the
// reasoning text in base64, not encrypted: the field exists so that a client that stores
// nothing on the server (store: false) can hand the reasoning back, and a local server
// has no secret to keep from the client that generated it.
const reasoningSeal = "polykv-reasoning-v1:"

// sealReasoning is text as encrypted_content.
func sealReasoning(text string) string {
	return reasoningSeal + base64.StdEncoding.EncodeToString([]byte(text))
}

// openReasoning reads encrypted_content that sealReasoning wrote.
func openReasoning(sealed string) (string, bool) {
	rest, ok := strings.CutPrefix(sealed, reasoningSeal)
	if !ok {
		return "", false
	}
	b, err := base64.StdEncoding.DecodeString(rest)
	if err != nil {
		return "", false
	}
	return string(b), true
}

// responseToolChoice converts tool_choice ({type: "function", name} names one).
func responseToolChoice(raw json.RawMessage) (json.RawMessage, *apiError) {
	if isNull(raw) {
		return nil, nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return raw, nil // auto | none | required, checked by planTools
	}
	var obj struct {
		Type string `json:"type"`
		Name string `json:"name"`
	}
	if json.Unmarshal(raw, &obj) != nil || obj.Type != "function" || obj.Name == "" {
		return nil, invalidParam("tool_choice", "Invalid 'tool_choice': expected \"auto\", \"none\", \"required\" or {type: \"function\", name}.")
	}
	return namedChoice(obj.Name), nil
}

// responseFormat converts text.format to chat's response_format.
func responseFormat(t *wire.ResponseText) (json.RawMessage, *apiError) {
	if t == nil || t.Format == nil {
		return nil, nil
	}
	f := t.Format
	var rf wire.ResponseFormat
	rf.Type = f.Type
	switch f.Type {
	case "text", "json_object":
	case "json_schema":
		if isNull(f.Schema) {
			return nil, invalidParam("text.format.schema", "Missing required parameter: 'text.format.schema'.")
		}
		rf.JSONSchema = &struct {
			Name   string          `json:"name"`
			Schema json.RawMessage `json:"schema"`
		}{f.Name, f.Schema}
	default:
		return nil, invalidParam("text.format.type", "Invalid 'text.format.type': %q is not one of text, json_object, json_schema.", f.Type)
	}
	b, _ := json.Marshal(rf)
	return b, nil
}

// responseSkeleton is the response object before anything is generated: the request's
// settings echoed back, status in_progress.
func responseSkeleton(s *Server, id string, req *wire.ResponsesRequest, creq *wire.ChatRequest) wire.Response {
	resp := wire.Response{ID: id, Object: "response", CreatedAt: time.Now().Unix(), Status: "in_progress",
		Instructions: req.Instructions, MaxOutputTokens: req.MaxOutputTokens, Metadata: req.Metadata, Model: s.info.ModelID,
		Output: []wire.ResponseOutputItem{}, ParallelToolCalls: req.ParallelToolCalls == nil || *req.ParallelToolCalls,
		PreviousResponseID: req.PreviousResponseID, Store: req.Store == nil || *req.Store, Temperature: req.Temperature,
		ToolChoice: req.ToolChoice, Tools: nonNil(req.Tools), TopP: req.TopP, Truncation: "disabled"}
	if resp.Metadata == nil {
		resp.Metadata = map[string]string{}
	}
	if req.Reasoning != nil {
		resp.Reasoning = *req.Reasoning
	}
	resp.Text.Format = &wire.ResponseTextFormat{Type: "text"}
	if req.Text != nil && req.Text.Format != nil {
		resp.Text = *req.Text
	}
	if isNull(resp.ToolChoice) {
		resp.ToolChoice = json.RawMessage(`"auto"`)
	}
	if creq.GenParams.SessionID != nil {
		resp.SessionID = *creq.GenParams.SessionID
	}
	return resp
}

func (s *Server) handleGetResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	st := s.responses.get(id)
	if st == nil {
		writeAPIError(w, responseNotFound(id))
		return
	}
	writeJSON(w, http.StatusOK, st.resp)
}

func (s *Server) handleDeleteResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !s.responses.remove(id) {
		writeAPIError(w, responseNotFound(id))
		return
	}
	writeJSON(w, http.StatusOK, wire.ResponseDeleted{ID: id, Object: "response.deleted", Deleted: true})
}

func responseNotFound(id string) *apiError {
	return &apiError{status: http.StatusNotFound, typ: "not_found_error",
		msg: fmt.Sprintf("Response with id '%s' not found (unknown, deleted or expired).", id)}
}
