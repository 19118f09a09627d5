package kvcache

import (
	"slices"
	"testing"
)

// seqTokens is n consecutive token ids from from.
func seqTokens(from, n int) []Token {
	out := make([]Token, n)
	for i := range out {
		out[i] = Token(from + i)
	}
	return out
}

// TestCellTreeLongest: the longest held prefix wins, limited to the prompt's limit.
func TestCellTreeLongest(t *testing.T) {
	c := NewTree(10)
	c.write(0, seqTokens(1, 10))
	c.share(0, 1, 6)
	c.write(1, []Token{50, 51})
	c.write(2, seqTokens(1, 3)) // the same tokens in other cells
	for _, tc := range []struct {
		prompt     []Token
		limit, P   int
		holderSeqs []int
	}{
		{seqTokens(1, 10), 9, 9, []int{0}},
		{append(seqTokens(1, 6), 50, 51, 52), 8, 8, []int{1}},
		{append(seqTokens(1, 6), 77), 6, 6, []int{0, 1}},
		{append(seqTokens(1, 2), 9), 3, 2, []int{0, 1}},
		{[]Token{99}, 1, 0, nil},
	} {
		P, n := c.Longest(tc.prompt, tc.limit)
		var holders []int
		if n != nil {
			n.Holders().Each(func(q int) bool { holders = append(holders, q); return true })
		}
		if P != tc.P || !slices.Equal(holders, tc.holderSeqs) {
			t.Errorf("Longest(%v, %d) = %d held by %v, want %d by %v", tc.prompt, tc.limit, P, holders, tc.P, tc.holderSeqs)
		}
	}
}

// TestCellTreeFreedKeeps: cells a placement is about to copy from keep are not counted
// as freed by evicting keep, partially covered runs included.
func TestCellTreeFreedKeeps(t *testing.T) {
	c := NewTree(10)
	c.write(0, seqTokens(1, 10))
	c.write(0, seqTokens(50, 5)) // still one run: seq 0 holds it alone
	c.share(0, 1, 4)             // splits at 4: [0,4) shared, [4,15) seq 0's
	var set SeqSet
	set.Add(0)
	for _, tc := range []struct{ keepTo, want int }{{0, 11}, {4, 11}, {6, 9}, {15, 0}} {
		if got := c.Freed(set, 0, tc.keepTo); got != tc.want {
			t.Errorf("evicting seq 0 keeping [0, %d): %d freed, want %d", tc.keepTo, got, tc.want)
		}
	}
	set.Add(1)
	if got := c.Freed(set, -1, 0); got != 15 {
		t.Errorf("evicting both: %d, want 15", got)
	}
	if got := c.Exclusive(0, 0); got != 11 {
		t.Errorf("exclusive(0) = %d, want 11", got)
	}
	if c.Owned(0) != 15 || c.Owned(1) != 0 {
		t.Errorf("owned: seq 0 %d, seq 1 %d; the writer keeps ownership", c.Owned(0), c.Owned(1))
	}
	c.remove(0, 0)
	if c.total != 4 || c.Owned(1) != 4 {
		t.Errorf("after seq 0 lets go: %d cells, seq 1 owns %d; want 4 and 4", c.total, c.Owned(1))
	}
}

// TestCellTreeLongestFrom: a fork's lookup stays below its parent's node at D: it
// follows the parent's own cells when they go on matching (at D inside a run too), it
// finds other sequences below that node, and never same-token cells elsewhere.
func TestCellTreeLongestFrom(t *testing.T) {
	c := NewTree(10)
	c.write(10, seqTokens(1, 20))            // the parent pool: one run [0, 20)
	c.share(10, 0, 20)                       // a request borrowed it
	c.write(0, seqTokens(30, 6))             // and prefilled 30..35 below it
	c.write(1, append(seqTokens(1, 20), 30)) // the same tokens in cells of its own
	c.write(1, seqTokens(31, 9))
	for _, tc := range []struct {
		at         int
		prompt     []Token
		P          int
		holderSeqs []int
	}{
		// D inside the parent's run, the child's tokens go on as the parent's.
		{10, seqTokens(1, 15), 15, []int{0, 10}},
		// D inside the run, then a token of its own.
		{10, append(seqTokens(1, 10), 99), 10, []int{0, 10}},
		// D at the run's end: seq 0's cells below it; seq 1's longer match is elsewhere.
		{20, append(seqTokens(1, 20), seqTokens(30, 9)...), 26, []int{0}},
		// at 0: the whole tree (seq 1 holds the longest).
		{0, append(seqTokens(1, 20), seqTokens(30, 9)...), 29, []int{1}},
	} {
		P, n := c.LongestFrom(10, tc.at, tc.prompt, len(tc.prompt))
		var holders []int
		if n != nil {
			n.Holders().Each(func(q int) bool { holders = append(holders, q); return true })
		}
		if P != tc.P || !slices.Equal(holders, tc.holderSeqs) {
			t.Errorf("LongestFrom(at %d, %v) = %d held by %v, want %d by %v", tc.at, tc.prompt, P, holders, tc.P, tc.holderSeqs)
		}
	}
}
