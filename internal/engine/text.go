package engine

import (
	"bytes"
	"strings"
	"unicode/utf8"
)

// textAssembler turns token pieces into text that is safe to send: complete UTF-8
// characters only, and nothing that could still turn out to be the start of a stop
// string. A matched stop string is cut off and never sent.
type textAssembler struct {
	stops   [][]byte
	pending []byte // received but not yet released
	full    strings.Builder
}

func newTextAssembler(stops []string) *textAssembler {
	a := &textAssembler{}
	for _, s := range stops {
		if s != "" {
			a.stops = append(a.stops, []byte(s))
		}
	}
	return a
}

// push adds a piece and returns the text now safe to release and the stop string that
// matched, if one did ("" otherwise; then the text before it is released and nothing
// after). Of stop strings matching at once the one starting first wins.
func (a *textAssembler) push(piece []byte) (string, string) {
	a.pending = append(a.pending, piece...)
	cut, word := -1, ""
	for _, s := range a.stops {
		if i := bytes.Index(a.pending, s); i >= 0 && (cut < 0 || i < cut) {
			cut, word = i, string(s)
		}
	}
	if cut >= 0 {
		out := a.release(cut)
		a.pending = a.pending[:0]
		return out, word
	}
	hold := 0
	for _, s := range a.stops {
		hold = max(hold, partialSuffix(a.pending, s))
	}
	n := len(a.pending) - hold
	n = completeUTF8(a.pending[:n])
	return a.release(n), ""
}

// flush releases everything still held (at the end of generation). A character whose
// last bytes never came (the reply stopped inside it, at max_tokens or the context's
// end) is dropped rather than sent as U+FFFD: the bytes so far are not text, and a
// client joining the stream must get the same text as the non-streamed reply.
func (a *textAssembler) flush() string {
	n := completeUTF8(a.pending)
	out := string(a.pending[:n])
	a.full.WriteString(out)
	a.pending = a.pending[:0]
	return out
}

// text is everything released so far.
func (a *textAssembler) text() string { return a.full.String() }

func (a *textAssembler) release(n int) string {
	if n <= 0 {
		return ""
	}
	out := string(a.pending[:n])
	a.pending = append(a.pending[:0], a.pending[n:]...)
	a.full.WriteString(out)
	return out
}

// partialSuffix is the length of the longest suffix of b that is a proper prefix of s.
func partialSuffix(b, s []byte) int {
	for k := min(len(b), len(s)-1); k > 0; k-- {
		if bytes.Equal(b[len(b)-k:], s[:k]) {
			return k
		}
	}
	return 0
}

// completeUTF8 is the length of the longest prefix of b that does not end inside a
// multi-byte character. Invalid bytes count as complete so they never block output.
func completeUTF8(b []byte) int {
	for back := 1; back <= utf8.UTFMax && back <= len(b); back++ {
		c := b[len(b)-back]
		if c < 0x80 {
			return len(b) // ASCII: complete
		}
		if utf8.RuneStart(c) {
			need := 0
			switch {
			case c>>5 == 0x6:
				need = 2
			case c>>4 == 0xE:
				need = 3
			case c>>3 == 0x1E:
				need = 4
			default:
				return len(b) // invalid lead byte: let it through
			}
			if back < need {
				return len(b) - back
			}
			return len(b)
		}
	}
	return len(b)
}
