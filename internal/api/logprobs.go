package api

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
)

// maxTopLogprobs is OpenAI's bound on top_logprobs (the legacy completions API stops at
// 5; PolyKV allows 20 on both routes, as llama-server does not bound n_probs at 5).
const maxTopLogprobs = 20

// invalidParam is a 400 naming the offending field in OpenAI's "param".
func invalidParam(param, format string, args ...any) *apiError {
	e := badRequest(format, args...)
	e.extra = wire.Error{Param: param}
	return e
}

// parseLogprobs reads logprobs (chat: a boolean; legacy completions: the number of
// alternatives, 0..20) and top_logprobs (0..20, needs logprobs). It returns whether to
// report logprobs and how many alternatives per token.
func parseLogprobs(raw json.RawMessage, top *int) (bool, int, *apiError) {
	on, n := false, 0
	if !isNull(raw) {
		var b bool
		if json.Unmarshal(raw, &b) == nil {
			on = b
		} else {
			var v int
			if err := json.Unmarshal(raw, &v); err != nil {
				return false, 0, invalidParam("logprobs", "logprobs must be a boolean or an integer in [0, %d]", maxTopLogprobs)
			}
			if v < 0 || v > maxTopLogprobs {
				return false, 0, boundsError("logprobs", v)
			}
			on, n = true, v
		}
	}
	if top != nil {
		if *top < 0 || *top > maxTopLogprobs {
			return false, 0, boundsError("top_logprobs", *top)
		}
		if *top > 0 && !on {
			return false, 0, invalidParam("top_logprobs", "Invalid value for 'top_logprobs': 'logprobs' must be set to true if 'top_logprobs' is used.")
		}
		n = *top
	}
	return on, n, nil
}

func boundsError(param string, v int) *apiError {
	if v < 0 {
		return invalidParam(param, "Invalid '%s': integer below minimum value. Expected a value >= 0, but got %d instead.", param, v)
	}
	return invalidParam(param, "Invalid '%s': integer above maximum value. Expected a value <= %d, but got %d instead.", param, maxTopLogprobs, v)
}

// chatLogprobs are tokens with their logprobs in OpenAI's chat shape:
// {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}], id}]}.
func (s *Server) chatLogprobs(lps []engine.TokenLogprob) *wire.ChatLogprobs {
	entry := func(tok engine.Token) (string, []int) {
		piece := s.tok.TokenPiece(tok, false)
		bs := make([]int, len(piece))
		for j, c := range piece {
			bs[j] = int(c)
		}
		return string(piece), bs
	}
	content := make([]wire.TokenLogprob, len(lps))
	for i, lp := range lps {
		e := wire.TokenLogprob{ID: lp.Token, Logprob: lp.Logprob, TopLogprobs: make([]wire.TopLogprob, len(lp.Top))}
		e.Token, e.Bytes = entry(lp.Token)
		for j, alt := range lp.Top {
			t := &e.TopLogprobs[j]
			t.Token, t.Bytes = entry(alt.Token)
			t.Logprob = alt.Logprob
		}
		content[i] = e
	}
	return &wire.ChatLogprobs{Content: content}
}

// textLogprobs are tokens with their logprobs in the legacy completions shape:
// {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset, token_ids};
// offs carries text_offset across a stream's chunks.
func (s *Server) textLogprobs(lps []engine.TokenLogprob, offs *textOffsets) *wire.TextLogprobs {
	out := &wire.TextLogprobs{Tokens: make([]string, len(lps)), TokenLogprobs: make([]float32, len(lps)),
		TopLogprobs: make([]map[string]float32, len(lps)), TextOffset: make([]int, len(lps)), TokenIDs: make([]int32, len(lps))}
	for i, lp := range lps {
		piece := s.tok.TokenPiece(lp.Token, false)
		out.Tokens[i] = legacyToken(piece)
		out.TokenLogprobs[i] = lp.Logprob
		out.TokenIDs[i] = lp.Token
		out.TextOffset[i] = offs.next(piece)
		top := make(map[string]float32, len(lp.Top))
		for _, alt := range lp.Top {
			key := legacyToken(s.tok.TokenPiece(alt.Token, false))
			if _, dup := top[key]; !dup { // most likely first: keep the first
				top[key] = alt.Logprob
			}
		}
		out.TopLogprobs[i] = top
	}
	return out
}

// legacyToken is a token's text in the legacy shape: the piece itself when it is valid
// UTF-8, else OpenAI's "bytes:\xNN..." spelling, so a fragment of a character neither
// turns into U+FFFD nor collides with another fragment as a top_logprobs key.
func legacyToken(piece []byte) string {
	if utf8.Valid(piece) {
		return string(piece)
	}
	var b strings.Builder
	b.WriteString("bytes:")
	for _, c := range piece {
		fmt.Fprintf(&b, "\\x%02x", c)
	}
	return b.String()
}

// textOffsets numbers a reply's characters as its tokens arrive, for the legacy
// text_offset: a token's offset is the number of characters (Unicode code points, as
// a Python client indexes the text) generated before it; a token that starts inside a
// character split across tokens gets that character's offset.
type textOffsets struct {
	runes int    // complete characters so far
	tail  []byte // the bytes of a character still incomplete
}

func (o *textOffsets) next(piece []byte) int {
	off := o.runes
	o.tail = append(o.tail, piece...)
	n := len(o.tail)
	for back := 1; back < utf8.UTFMax && back <= len(o.tail); back++ {
		if i := len(o.tail) - back; utf8.RuneStart(o.tail[i]) {
			if !utf8.FullRune(o.tail[i:]) {
				n = i
			}
			break
		}
	}
	o.runes += utf8.RuneCount(o.tail[:n])
	o.tail = append(o.tail[:0], o.tail[n:]...)
	return off
}
