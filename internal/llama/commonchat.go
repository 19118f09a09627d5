//go:build commonchat

package llama

// The measurement binding of llama.cpp's common/chat (docs/chat.md "The decision"):
// built only with -tags commonchat, by `make commonchat`, which adds common/'s headers
// and the tools tree's libllama-common to cgo's flags. It is not part of bin/polykv:
// the measurement kept PolyKV's own chat package (docs/chat.md has the numbers).

/*
#cgo CXXFLAGS: -std=c++17
#cgo LDFLAGS: -lllama-common -lllama-common-base -lcpp-httplib
#include <stdlib.h>
#include "commonchat.h"
*/
import "C"

import (
	"encoding/json"
	"errors"
	"runtime"
	"unsafe"
)

// CommonChat is a template parsed by llama.cpp's common/chat.
type CommonChat struct{ p *C.pk_cc }

// CommonChatParams is what common_chat_templates_apply returns that the measurement reads.
type CommonChatParams struct {
	Prompt           string   `json:"prompt"`
	Format           int      `json:"format"`
	FormatName       string   `json:"format_name"`
	Grammar          string   `json:"grammar"`
	Lazy             bool     `json:"lazy"`
	Triggers         []string `json:"triggers"`
	Parser           string   `json:"parser"`
	GenerationPrompt string   `json:"generation_prompt"`
}

func takeErr(e *C.char) error {
	if e == nil {
		return errors.New("common/chat: failed without a message")
	}
	defer C.free(unsafe.Pointer(e))
	return errors.New(C.GoString(e))
}

// NewCommonChat parses template with common_chat_templates_init (no model: the
// template, BOS and EOS are given). C++ exceptions come back as errors.
func NewCommonChat(template, bos, eos string) (*CommonChat, error) {
	ct, cb, ce := C.CString(template), C.CString(bos), C.CString(eos)
	defer C.free(unsafe.Pointer(ct))
	defer C.free(unsafe.Pointer(cb))
	defer C.free(unsafe.Pointer(ce))
	var e *C.char
	p := C.pk_cc_init(ct, cb, ce, &e)
	if p == nil {
		return nil, takeErr(e)
	}
	c := &CommonChat{p: p}
	runtime.SetFinalizer(c, func(c *CommonChat) { C.pk_cc_free(c.p) })
	return c, nil
}

// Apply renders OpenAI-form messages and tools (JSON; tools "" for none); thinking is
// enable_thinking (llama-server's default: true).
func (c *CommonChat) Apply(messages, tools string, addGen, parallel, thinking bool) (CommonChatParams, error) {
	cm, ctl := C.CString(messages), C.CString(tools)
	defer C.free(unsafe.Pointer(cm))
	defer C.free(unsafe.Pointer(ctl))
	var e *C.char
	out := C.pk_cc_apply(c.p, cm, ctl, cbool(addGen), cbool(parallel), cbool(thinking), &e)
	runtime.KeepAlive(c)
	var p CommonChatParams
	if out == nil {
		return p, takeErr(e)
	}
	defer C.free(unsafe.Pointer(out))
	err := json.Unmarshal([]byte(C.GoString(out)), &p)
	return p, err
}

// CommonChatParse parses generated text with Apply's result (common_chat_parse,
// reasoning as DeepSeek's reasoning_content) and returns the OpenAI-form message JSON.
func CommonChatParse(p CommonChatParams, text string, partial bool) (string, error) {
	cp, cg, ct := C.CString(p.Parser), C.CString(p.GenerationPrompt), C.CString(text)
	defer C.free(unsafe.Pointer(cp))
	defer C.free(unsafe.Pointer(cg))
	defer C.free(unsafe.Pointer(ct))
	var e *C.char
	out := C.pk_cc_parse(C.int(p.Format), cp, cg, ct, cbool(partial), &e)
	if out == nil {
		return "", takeErr(e)
	}
	defer C.free(unsafe.Pointer(out))
	return C.GoString(out), nil
}

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}
