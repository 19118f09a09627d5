package runner

import (
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/polykv/polykv/internal/chat"
)

// triggerPatterns are the auto grammars' pattern triggers (and their after-thinking
// forms) for every family, plus a few shapes of their own.
func triggerPatterns(t *testing.T) []string {
	pats := []string{`a(b*?)c[\s\S]*`, `(x|xy)(y?)z`, `[\s\S]*?(é+)[\s\S]*`, `(?:[\s\S]*?>>>)?(f\n)\{[\s\S]*`}
	for _, f := range []chat.Format{chat.FormatHermes, chat.FormatLlama3, chat.FormatHarmony, chat.FormatFunctionaryV32, chat.FormatQwenXML} {
		_, trig, ok, err := chat.AutoGrammar(f, weather, false)
		if !ok || err != nil {
			t.Fatalf("%s: %v %v", f, ok, err)
		}
		for _, tr := range append(trig, chat.TriggersAfterThinking(trig)...) {
			if tr.Pattern != "" {
				pats = append(pats, tr.Pattern)
			}
		}
	}
	return pats
}

// The incremental matcher agrees with Go's regexp (a full match of the text so far,
// the first non-empty group's start) after every piece, on texts built from the
// pieces the triggers are made of, cut at random places (inside characters too).
func TestTriggerMatcherAgreesWithRegexp(t *testing.T) {
	words := []string{" ", "\n", "x", "y", "z", "a", "b", "c", "é", "f", "{", ">>>", "all", "</think>", "<tool_call>", `{"name": "get_weather"`, `{ "name":"get_time"`,
		"<|channel|>commentary", "<|channel|>analysis", " to", "=functions.", "<|start|>assistant", "get_weather\n", "<|python_tag|>", "\"", "text"}
	rng := rand.New(rand.NewPCG(1, 9))
	fired := 0
	for _, p := range triggerPatterns(t) {
		re := regexp.MustCompile(`^(?:` + p + `)$`)
		for range 300 {
			var text strings.Builder
			for range rng.IntN(12) {
				text.WriteString(words[rng.IntN(len(words))])
			}
			s := text.String()
			m, ok := newTriggerMatcher(p)
			if !ok {
				t.Fatalf("%s does not compile", p)
			}
			for i := 0; i < len(s); {
				n := min(len(s)-i, 1+rng.IntN(5))
				got := m.push([]byte(s[i : i+n]))
				i += n
				want := -1
				if loc := re.FindStringSubmatchIndex(s[:i]); loc != nil {
					want = 0
					for g := 2; g+1 < len(loc); g += 2 {
						if loc[g] >= 0 && loc[g+1] > loc[g] {
							want = loc[g]
							break
						}
					}
				}
				if !utf8.ValidString(s[:i]) {
					want = -1 // the matcher waits for the whole character
				}
				if got != want {
					t.Fatalf("%s on %q: %d, regexp %d", p, s[:i], got, want)
				}
				if got >= 0 {
					fired++
				}
			}
		}
	}
	if fired < 500 {
		t.Fatalf("only %d matches: the texts no longer exercise the triggers", fired)
	}
	if _, ok := newTriggerMatcher(`^a$`); ok {
		t.Error("an empty-width assertion was accepted")
	}
}

// BenchmarkTriggerWatch40KB: watching Llama 3.x's call pattern (it looks anywhere in
// the output) over 40 KB of free text, a token every 4 bytes; "matcher" feeds each
// token to a triggerMatcher, "regexp" reruns Go's regexp over the whole output after
// each token (quadratic). Compare the two ns/op.
func BenchmarkTriggerWatch40KB(b *testing.B) {
	_, trig, _, _ := chat.AutoGrammar(chat.FormatLlama3, weather, false)
	var pat string
	for _, tr := range trig {
		if tr.Pattern != "" {
			pat = tr.Pattern
		}
	}
	text := []byte(strings.Repeat("Some free text about the weather. ", 1200))
	b.Run("matcher", func(b *testing.B) {
		for range b.N {
			m, _ := newTriggerMatcher(pat)
			for i := 0; i < len(text); i += 4 {
				if m.push(text[i:min(i+4, len(text))]) >= 0 {
					b.Fatal("fired")
				}
			}
		}
	})
	b.Run("regexp", func(b *testing.B) {
		re := regexp.MustCompile(`^(?:` + pat + `)$`)
		for range b.N {
			for i := 4; i <= len(text); i += 4 {
				if re.Match(text[:i]) {
					b.Fatal("fired")
				}
			}
		}
	})
}

// FuzzTriggerMatcher: on any text cut into any pieces, the incremental matcher agrees
// with Go's regexp after every piece for every pattern the auto grammars use.
func FuzzTriggerMatcher(f *testing.F) {
	f.Add([]byte("all\nText.>>>get_weather\n{\"city\": 1}"), []byte{3, 1, 4})
	f.Add([]byte(`Use it: {"name": "get_time", "parameters": {}}`), []byte{0, 9})
	f.Add([]byte("<think>x</think><|channel|>commentary to=functions.get_weather"), []byte{2})
	f.Add([]byte(" to=functions.add<tool_call>é"), []byte{1, 1, 1})
	pats := triggerPatterns(&testing.T{})
	res := make([]*regexp.Regexp, len(pats))
	for i, p := range pats {
		res[i] = regexp.MustCompile(`^(?:` + p + `)$`)
	}
	f.Fuzz(func(t *testing.T, text, cuts []byte) {
		for pi, p := range pats {
			m, _ := newTriggerMatcher(p)
			for i, k := 0, 0; i < len(text); k++ {
				n := len(text) - i
				if k < len(cuts) {
					n = min(n, int(cuts[k])%9+1)
				}
				got := m.push(text[i : i+n])
				i += n
				want := -1
				if loc := res[pi].FindSubmatchIndex(text[:i]); loc != nil && !endsMidRune(text[:i]) {
					want = 0
					for g := 2; g+1 < len(loc); g += 2 {
						if loc[g] >= 0 && loc[g+1] > loc[g] {
							want = loc[g]
							break
						}
					}
				}
				if got != want {
					t.Fatalf("%s on %q: %d, regexp %d", p, text[:i], got, want)
				}
			}
		}
	})
}

// endsMidRune: b ends inside a UTF-8 sequence that more bytes could complete (the
// matcher waits for them; regexp reads the bytes as invalid).
func endsMidRune(b []byte) bool {
	j := len(b) - 1
	for j > 0 && j > len(b)-4 && !utf8.RuneStart(b[j]) {
		j--
	}
	return j >= 0 && !utf8.FullRune(b[j:])
}
