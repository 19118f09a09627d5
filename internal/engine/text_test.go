package engine

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestTextAssemblerUTF8AcrossPieces(t *testing.T) {
	a := newTextAssembler(nil)
	euro := []byte("€") // 3 bytes
	if got, _ := a.push(euro[:1]); got != "" {
		t.Fatalf("released a partial character: %q", got)
	}
	if got, _ := a.push(euro[1:2]); got != "" {
		t.Fatalf("released a partial character: %q", got)
	}
	if got, _ := a.push(append(euro[2:], 'x')); got != "€x" {
		t.Fatalf("got %q, want €x", got)
	}
}

func TestTextAssemblerStopAcrossPieces(t *testing.T) {
	a := newTextAssembler([]string{"END", "STOP"})
	var out string
	for _, p := range []string{"hello ", "S", "T", "OPx"} {
		got, word := a.push([]byte(p))
		out += got
		if word != "" {
			if out != "hello " || p != "OPx" || word != "STOP" {
				t.Fatalf("stopped by %q at %q with %q", word, p, out)
			}
			if a.text() != "hello " {
				t.Fatalf("full text %q", a.text())
			}
			return
		}
		if len(out) > len("hello ") {
			t.Fatalf("released part of a stop string: %q", out)
		}
	}
	t.Fatal("stop string not found")
}

func TestTextAssemblerHeldPrefixReleasedWhenNotStop(t *testing.T) {
	a := newTextAssembler([]string{"STOP"})
	got1, _ := a.push([]byte("ab ST"))
	got2, _ := a.push([]byte("ART"))
	if got1 != "ab " || got2 != "START" {
		t.Fatalf("got %q then %q", got1, got2)
	}
	if a.flush() != "" {
		t.Fatal("nothing should remain")
	}
	b := newTextAssembler([]string{"STOP"})
	b.push([]byte("x ST"))
	if f := b.flush(); f != "ST" {
		t.Fatalf("flush %q, want the held prefix", f)
	}
}

func TestTextAssemblerInvalidBytesDoNotBlock(t *testing.T) {
	a := newTextAssembler(nil)
	if got, _ := a.push([]byte{0xff, 'a'}); got != "\xffa" {
		t.Fatalf("invalid byte blocked output: %q", got)
	}
}

// A reply that ends inside a character (max_tokens cut it, or the context ran out)
// drops the dangling bytes: no U+FFFD, and nothing that is not valid UTF-8.
func TestTextAssemblerFlushDropsDanglingPartialCharacter(t *testing.T) {
	for _, tc := range []struct {
		name   string
		pieces [][]byte
		want   string
	}{
		{"first byte of 3", [][]byte{[]byte("ab"), {0xe2}}, "ab"},
		{"two bytes of 3", [][]byte{[]byte("ab"), {0xe2}, {0x82}}, "ab"},
		{"three bytes of 4", [][]byte{[]byte("x"), {0xf0, 0x9f, 0xa6}}, "x"},
		{"complete then partial", [][]byte{[]byte("€"), {0xe2, 0x82}}, "€"},
		{"nothing dangling", [][]byte{[]byte("a€")}, "a€"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newTextAssembler([]string{"STOP"})
			var out string
			for _, p := range tc.pieces {
				got, _ := a.push(p)
				out += got
			}
			out += a.flush()
			if strings.ContainsRune(out, utf8.RuneError) || !utf8.ValidString(out) {
				t.Fatalf("text %q carries a replacement character or invalid UTF-8", out)
			}
			if out != tc.want || a.text() != tc.want {
				t.Fatalf("text %q (full %q), want %q", out, a.text(), tc.want)
			}
		})
	}
}
