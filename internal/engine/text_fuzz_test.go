package engine

import (
	"bytes"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzTextAssembler splits a valid UTF-8 text into pieces at arbitrary byte positions
// (as tokens split characters) with up to two stop strings. What the assembler releases,
// joined, is all of the text when no stop occurs, else the text up to a stop with no stop
// inside it; every released chunk is valid UTF-8 (no U+FFFD ever needed).
func FuzzTextAssembler(f *testing.F) {
	f.Add("héllo wörld 🙂 done", "wör", "", []byte{1, 2, 3, 5, 8})
	f.Add("a🙂b🙂c", "🙂", "c", []byte{1, 1, 1, 1, 1, 1})
	f.Add("stop at END please", "END", "ND p", []byte{4, 4, 4})
	f.Add("日本語のテキスト", "", "", []byte{2, 2, 2, 2, 2})
	f.Fuzz(func(t *testing.T, text, stop1, stop2 string, cuts []byte) {
		text = strings.ToValidUTF8(text, "?")
		stop1, stop2 = strings.ToValidUTF8(stop1, "?"), strings.ToValidUTF8(stop2, "?")
		a := newTextAssembler([]string{stop1, stop2})
		want, wantStop := text, false
		for _, s := range []string{stop1, stop2} {
			if i := strings.Index(text, s); s != "" && i >= 0 && (!wantStop || i < len(want)) {
				want, wantStop = text[:i], true
			}
		}
		var got bytes.Buffer
		rest := []byte(text)
		stopped := false
		for i := 0; len(rest) > 0 && !stopped; i++ {
			n := 1
			if len(cuts) > 0 {
				n = 1 + int(cuts[i%len(cuts)])%7
			}
			n = min(n, len(rest))
			out, word := a.push(rest[:n])
			stopped = word != ""
			rest = rest[n:]
			if !utf8.ValidString(out) {
				t.Fatalf("released invalid UTF-8 %q", out)
			}
			got.WriteString(out)
		}
		if !stopped {
			got.WriteString(a.flush())
		}
		out := got.String()
		if stopped != wantStop {
			t.Fatalf("text %q stops %q %q: stopped %v, want %v", text, stop1, stop2, stopped, wantStop)
		}
		if !stopped && out != want {
			t.Fatalf("text %q without a stop: released %q", text, out)
		}
		if stopped {
			// Where it stops depends on how tokens split the text (a stop completed within
			// one piece wins over one that would have started earlier but ends later), so
			// check what must hold: a prefix of the text, no stop inside it, a stop right
			// after it, and nothing past the first place where a stop is complete.
			startsStop := false
			for _, s := range []string{stop1, stop2} {
				if s == "" {
					continue
				}
				startsStop = startsStop || strings.HasPrefix(text[len(out):], s)
				if strings.Contains(out, s) {
					t.Fatalf("text %q: released %q contains the stop %q", text, out, s)
				}
			}
			if !strings.HasPrefix(text, out) || !startsStop || len(out) > len(want)+len(stop1)+len(stop2) {
				t.Fatalf("text %q stops %q %q: released %q, not the text up to a stop", text, stop1, stop2, out)
			}
		}
		if a.text() != out {
			t.Fatalf("text() %q, released %q", a.text(), out)
		}
	})
}
