package engine

import "testing"

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
		got, stopped := a.push([]byte(p))
		out += got
		if stopped {
			if out != "hello " || p != "OPx" {
				t.Fatalf("stopped at %q with %q", p, out)
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
	b := newTextAssembler(nil)
	b.push([]byte{0xe2, 0x82})
	if f := b.flush(); f != "\uFFFD" {
		t.Fatalf("flush of a truncated character: %q", f)
	}
}
