package engine

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/polykv/polykv/internal/engine/kvcache"
)

// TestCellTreeMirrorsCache drives the KV-cache manager (package kvcache) and the fake
// cache with the same random appends, copies and removals: the tree's cells in use, each sequence's tokens and the
// cells removing a set would free must equal the fake cache's, and ownership must sum
// to the cells in use.
func TestCellTreeMirrorsCache(t *testing.T) {
	const nSeq, firstPool = 8, 6
	for round := range 200 {
		r := rand.New(rand.NewPCG(uint64(round), 7))
		be := newFakeBackend(t, 1<<20)
		kv := kvcache.New(kvcache.Config{NCtx: 1 << 20, FirstPool: firstPool, Plan: noPlan{}})
		c := kv.Cells()
		for range 60 {
			seq := r.IntN(nSeq)
			switch r.IntN(4) {
			case 0, 1:
				toks := make([]Token, 1+r.IntN(5))
				for i := range toks {
					toks[i] = Token(r.IntN(3))
				}
				for _, tk := range toks {
					be.nextCell++
					be.kv[seq] = append(be.kv[seq], fakeCell{id: be.nextCell, tok: tk})
				}
				kv.Allocate(seq, toks)
			case 2:
				src := r.IntN(nSeq)
				if src == seq || len(be.kv[src]) == 0 {
					continue
				}
				p1 := 1 + r.IntN(len(be.kv[src]))
				be.SeqRm(seq, 0, -1)
				kv.Free(seq, 0)
				be.SeqCp(src, seq, 0, p1)
				kv.Share(src, seq, p1)
			case 3:
				q := r.IntN(len(be.kv[seq]) + 1)
				want := 0
				for _, cell := range be.kv[seq][q:] {
					if cellHolders(be, cell.id) == 1 {
						want++
					}
				}
				if got := c.Exclusive(seq, q); got != want {
					t.Fatalf("round %d: exclusive(%d, %d) = %d, want %d", round, seq, q, got, want)
				}
				be.SeqRm(seq, q, -1)
				kv.Free(seq, q)
			}
			if kv.Used() != be.cells() {
				t.Fatalf("round %d: tree %d cells, cache %d", round, kv.Used(), be.cells())
			}
			sum := 0
			for q := range nSeq {
				sum += c.Owned(q)
				if !slices.Equal(c.Tokens(q), be.tokens(q)) {
					t.Fatalf("round %d: seq %d tree %v cache %v", round, q, c.Tokens(q), be.tokens(q))
				}
			}
			if sum != kv.Used() {
				t.Fatalf("round %d: Σ owned %d != %d cells", round, sum, kv.Used())
			}
			var set kvcache.SeqSet
			in := map[int]bool{}
			for q := range nSeq {
				if r.IntN(2) == 0 {
					set.Add(q)
					in[q] = true
				}
			}
			want := 0
			seen := map[int]bool{}
			for q, cells := range be.kv {
				for _, cell := range cells {
					if seen[cell.id] {
						continue
					}
					seen[cell.id] = true
					all := true
					for q2, cells2 := range be.kv {
						if slices.ContainsFunc(cells2, func(x fakeCell) bool { return x.id == cell.id }) && !in[q2] {
							all = false
						}
					}
					_ = q
					if all {
						want++
					}
				}
			}
			if got := c.Freed(set, -1, 0); got != want {
				t.Fatalf("round %d: freed %d, want %d", round, got, want)
			}
		}
	}
}

func cellHolders(be *fakeBackend, id int) int {
	n := 0
	for _, cells := range be.kv {
		if slices.ContainsFunc(cells, func(x fakeCell) bool { return x.id == id }) {
			n++
		}
	}
	return n
}

// noPlan drops the manager's planned operations (a test that applies them itself).
type noPlan struct{}

func (noPlan) SeqRm(int, int)      {}
func (noPlan) SeqCp(int, int, int) {}
