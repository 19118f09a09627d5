package api

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/polykv/polykv/internal/engine"
)

// maxTopLogprobs is OpenAI's bound on top_logprobs (the legacy completions API stops at
// 5; PolyKV allows 20 on both routes, as llama-server does not bound n_probs at 5).
const maxTopLogprobs = 20

// invalidParam is a 400 naming the offending field in OpenAI's "param".
func invalidParam(param, format string, args ...any) *apiError {
	e := badRequest(format, args...)
	e.extra = map[string]any{"param": param}
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

// logprobsJSON renders tokens with their logprobs in the route's shape. Chat:
// {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}], id}]}.
// Legacy completions: {tokens, token_logprobs, top_logprobs: [{token: logprob}],
// text_offset, token_ids}; offs carries text_offset across a stream's chunks.
func (s *Server) logprobsJSON(k kind, lps []engine.TokenLogprob, offs *textOffsets) any {
	if k == kindChat {
		entry := func(lp engine.TokenLogprob) map[string]any {
			piece := s.tok.TokenPiece(lp.Token, false)
			bs := make([]int, len(piece))
			for j, c := range piece {
				bs[j] = int(c)
			}
			return map[string]any{"token": string(piece), "logprob": lp.Logprob, "bytes": bs}
		}
		content := make([]map[string]any, len(lps))
		for i, lp := range lps {
			e := entry(lp)
			top := make([]map[string]any, len(lp.Top))
			for j, alt := range lp.Top {
				top[j] = entry(alt)
			}
			e["top_logprobs"] = top
			e["id"] = lp.Token
			content[i] = e
		}
		return map[string]any{"content": content}
	}
	toks := make([]string, len(lps))
	vals := make([]float32, len(lps))
	tops := make([]map[string]float32, len(lps))
	textOffset := make([]int, len(lps))
	ids := make([]int32, len(lps))
	for i, lp := range lps {
		piece := s.tok.TokenPiece(lp.Token, false)
		toks[i] = legacyToken(piece)
		vals[i] = lp.Logprob
		ids[i] = lp.Token
		textOffset[i] = offs.next(piece)
		tops[i] = make(map[string]float32, len(lp.Top))
		for _, alt := range lp.Top {
			key := legacyToken(s.tok.TokenPiece(alt.Token, false))
			if _, dup := tops[i][key]; !dup { // most likely first: keep the first
				tops[i][key] = alt.Logprob
			}
		}
	}
	return map[string]any{"tokens": toks, "token_logprobs": vals, "top_logprobs": tops, "text_offset": textOffset, "token_ids": ids}
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
