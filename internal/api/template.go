package api

import (
	"bytes"
	"encoding/json"
	"net/http"

	"github.com/polykv/polykv/internal/chat"
)

// templateOptions are the chat-request fields that reach the template itself.
type templateOptions struct {
	// ChatTemplateKwargs are extra template variables (llama-server's
	// chat_template_kwargs, e.g. {"enable_thinking": false} for Qwen3).
	ChatTemplateKwargs json.RawMessage `json:"chat_template_kwargs"`
	// ReasoningEffort is given to templates as reasoning_effort (GPT-OSS reads it),
	// unless chat_template_kwargs sets it already.
	ReasoningEffort *string `json:"reasoning_effort"`
	// ReasoningFormat is llama-server's reasoning_format: "none" leaves a thinking
	// model's reasoning in content; "deepseek" and "auto" (default) return it as
	// reasoning_content.
	ReasoningFormat *string `json:"reasoning_format"`
}

// reasoning reports whether reasoning goes to reasoning_content.
func (o templateOptions) reasoning() (bool, *apiError) {
	if o.ReasoningFormat == nil {
		return true, nil
	}
	switch chat.ReasoningFormat(*o.ReasoningFormat) {
	case chat.ReasoningNone:
		return false, nil
	case chat.ReasoningDeepSeek, chat.ReasoningAuto, "deepseek-legacy":
		return true, nil
	}
	return false, badRequest("reasoning_format must be none, deepseek or auto, got %q", *o.ReasoningFormat)
}

// kwargs merges reasoning_effort into chat_template_kwargs, keeping the client's order.
func (o templateOptions) kwargs() (json.RawMessage, *apiError) {
	kw := bytes.TrimSpace(o.ChatTemplateKwargs)
	if isNull(kw) {
		kw = nil
	}
	if kw != nil {
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(kw, &obj); err != nil {
			return nil, badRequest("chat_template_kwargs must be a JSON object")
		}
		if _, set := obj["reasoning_effort"]; set || o.ReasoningEffort == nil {
			return kw, nil
		}
	}
	if o.ReasoningEffort == nil {
		return nil, nil
	}
	switch *o.ReasoningEffort {
	case "low", "medium", "high", "minimal", "none":
	default:
		return nil, badRequest("reasoning_effort must be one of none, minimal, low, medium, high, got %q", *o.ReasoningEffort)
	}
	eff, _ := json.Marshal(*o.ReasoningEffort)
	if kw == nil || bytes.Equal(kw, []byte("{}")) {
		return json.RawMessage(`{"reasoning_effort": ` + string(eff) + `}`), nil
	}
	// Append to the object: drop its closing brace, add the member.
	return json.RawMessage(string(kw[:len(kw)-1]) + `, "reasoning_effort": ` + string(eff) + `}`), nil
}

// optsRenderer is the renderer's full interface (chat.Renderer); fakes may implement
// only ChatRenderer.
type optsRenderer interface {
	RenderOpts(msgs []chat.Message, tools []chat.Tool, o chat.Options) (string, error)
}

// renderChat renders a chat request's prompt with its template options.
func (s *Server) renderChat(msgs []chat.Message, tools []chat.Tool, addGen bool, o templateOptions) (string, *apiError) {
	kw, e := o.kwargs()
	if e != nil {
		return "", e
	}
	var text string
	var err error
	if r, ok := s.chat.(optsRenderer); ok {
		text, err = r.RenderOpts(msgs, tools, chat.Options{AddGenerationPrompt: addGen, Kwargs: kw})
	} else {
		text, err = s.chat.Render(msgs, tools, addGen)
	}
	if err != nil {
		return "", renderError(err)
	}
	return text, nil
}

func (s *Server) routeTemplate(mux *http.ServeMux) {
	mux.HandleFunc("POST /apply-template", s.handleApplyTemplate)
}

// handleApplyTemplate is llama-server's /apply-template: a chat body in, the prompt the
// server would generate from out ({prompt}), nothing generated.
func (s *Server) handleApplyTemplate(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Messages            json.RawMessage `json:"messages"`
		Tools               json.RawMessage `json:"tools"`
		ToolChoice          json.RawMessage `json:"tool_choice"`
		AddGenerationPrompt *bool           `json:"add_generation_prompt"`
		templateOptions
	}
	if e := s.decodeBody(w, r, &req); e != nil {
		writeAPIError(w, e)
		return
	}
	msgs, e := parseMessages(req.Messages)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	tools, e := parseTools(req.Tools)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	if choice, _, e := parseToolChoice(req.ToolChoice); e != nil {
		writeAPIError(w, e)
		return
	} else if choice == "none" {
		tools = nil // as a chat request with tool_choice "none" renders
	}
	addGen := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt
	prompt, e := s.renderChat(msgs, tools, addGen, req.templateOptions)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"prompt": prompt})
}

// templateProps are /props' template fields as llama-server reports them.
func (s *Server) templateProps() map[string]any {
	out := map[string]any{"bos_token": "", "eos_token": ""}
	if t, ok := s.chat.(interface {
		BOS() string
		EOS() string
	}); ok {
		out["bos_token"], out["eos_token"] = t.BOS(), t.EOS()
	}
	if t, ok := s.chat.(interface{ Err() error }); ok && t.Err() != nil {
		out["chat_template_error"] = t.Err().Error()
	}
	return out
}
