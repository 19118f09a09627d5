package engine

import "testing"

// A move the table lacks is refused and counted as a lifecycle violation; the moves it
// lists are made.
func TestStatusMoves(t *testing.T) {
	h := newHarness(t, Config{NCtx: 64, Parallel: 1, NBatch: 8, MaxQueue: 4})
	tk := &task{id: 99}
	h.s.setStatus(tk, statusDecoding) // waiting cannot decode before it is seated
	if n, _ := h.s.Violations(); n != 1 || tk.status != statusWaiting {
		t.Fatalf("waiting -> decoding: %d violations, status %s; want 1 and waiting", n, tk.status)
	}
	for _, st := range []status{statusPrefilling, statusLookup, statusPrefilling, statusLoading, statusPrefilling, statusDecoding, statusDone} {
		h.s.setStatus(tk, st)
		if tk.status != st {
			t.Fatalf("refused the move to %s", st)
		}
	}
	if n, _ := h.s.Violations(); n != 1 {
		t.Fatalf("%d violations after legal moves, want the first one only", n)
	}
	h.s.violations = 0 // the harness asserts none at its end
}
