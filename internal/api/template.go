package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/chat"
)

// reasoning reports whether reasoning goes to reasoning_content.
func reasoning(o wire.TemplateOptions) (bool, *apiError) {
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
func kwargs(o wire.TemplateOptions) (json.RawMessage, *apiError) {
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
func (s *Server) renderChat(msgs []chat.Message, tools []chat.Tool, addGen bool, o wire.TemplateOptions) (string, *apiError) {
	kw, e := kwargs(o)
	if e != nil {
		return "", e
	}
	render := func(msgs []chat.Message) (string, error) {
		if r, ok := s.chat.(optsRenderer); ok {
			return r.RenderOpts(msgs, tools, chat.Options{AddGenerationPrompt: addGen, Kwargs: kw})
		}
		return s.chat.Render(msgs, tools, addGen)
	}
	text, err := render(msgs)
	if errors.Is(err, chat.ErrTemplateRaised) {
		// A strict template (Gemma's: roles must alternate) refused a conversation the
		// APIs allow: render it in the shape such templates take (chat.Alternate). A
		// conversation the alternate shape cannot save keeps the first error.
		if alt, altErr := render(chat.Alternate(msgs)); altErr == nil {
			text, err = alt, nil
		}
	}
	if err != nil {
		return "", renderError(err)
	}
	return text, nil
}

// handleApplyTemplate is llama-server's /apply-template: a chat body in, the prompt the
// server would generate from out ({prompt}), nothing generated.
func (s *Server) handleApplyTemplate(w http.ResponseWriter, r *http.Request) {
	var req wire.ApplyTemplateRequest
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
	prompt, e := s.renderChat(msgs, tools, addGen, req.TemplateOptions)
	if e != nil {
		writeAPIError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, wire.AppliedTemplate{Prompt: prompt})
}

// templateProps sets /props' template fields as llama-server reports them.
func (s *Server) templateProps(p *wire.Props) {
	if t, ok := s.chat.(interface {
		BOS() string
		EOS() string
	}); ok {
		p.BOSToken, p.EOSToken = t.BOS(), t.EOS()
	}
	if t, ok := s.chat.(interface{ Err() error }); ok && t.Err() != nil {
		p.ChatTemplateError = t.Err().Error()
	}
}
