package kvcache

import (
	"slices"
	"testing"
)

// chunks indexes toks as chunk-token segments from 0, the last one a tail.
func chunks(x *Below, toks []Token, chunk int, where Where) {
	h := HashSeed
	for k := 0; k < len(toks); k += chunk {
		e := min(k+chunk, len(toks))
		x.Add(BelowKey{k, h}, toks[k:e], false, e == len(toks), where)
		h = HashTokens(h, toks[k:e])
	}
}

// The index finds stored content by prompt alone: full chunks in a row, a last one
// that matches only in part, and nothing past a gap.
func TestBelowLookup(t *testing.T) {
	x := NewBelow(4, 0)
	toks := seqTokens(10, 14)
	chunks(x, toks, 4, Planned)
	segs, to := x.Lookup(toks, 0, 13, false)
	if to != 13 || len(segs) != 4 || segs[3].End() != 14 {
		t.Fatalf("lookup: to %d, %d segments (last ends %d)", to, len(segs), segs[len(segs)-1].End())
	}
	p := append(slices.Clone(toks[:10]), 99, 98, 97)
	segs, to = x.Lookup(p, 5, len(p)-1, false)
	if to != 10 || len(segs) != 2 || segs[0].Start != 4 || !slices.Equal(segs[1].Tokens, toks[:12]) {
		t.Fatalf("partial: to %d, segments %+v", to, segs)
	}
	if x.TailMatch(append(slices.Clone(toks), 1, 2)) != 14 || x.TailMatch(p) != 0 {
		t.Fatalf("TailMatch: %d, %d", x.TailMatch(append(slices.Clone(toks), 1, 2)), x.TailMatch(p))
	}
	x.Forget(segs[1])
	if _, to = x.Lookup(toks, 0, 13, false); to != 8 {
		t.Fatalf("after forgetting the third chunk: to %d, want 8", to)
	}
	// Bounded: past its limit the oldest entries go.
	y := NewBelow(4, 8)
	chunks(y, toks[:12], 4, Planned)
	if n, tok := y.Size(); tok != 8 || n != 2 {
		t.Fatalf("bounded index holds %d tokens in %d segments, want 8 in 2", tok, n)
	}
	if _, to := y.Lookup(toks, 0, 13, false); to != 0 {
		t.Fatalf("the oldest (first) chunk was forgotten, yet a lookup from 0 reached %d", to)
	}
}

// The tier's reports keep the index to what it holds: a stored report marks the
// planned entry local, a drop report forgets it (the store's LRU no longer drops
// without telling), and an entry the fleet's level holds too outlives the local drop.
// A report of an entry the index never planned (a pool's) adds nothing.
func TestBelowFollowsTierReports(t *testing.T) {
	x := NewBelow(4, 0)
	toks := seqTokens(10, 12)
	chunks(x, toks, 4, Planned)
	second := Segment{Start: 4, Tokens: toks[:8]}
	x.Stored(second)
	if e := x.Find(KeyOf(second), toks[4:8], false); e == nil || e.Where != Local {
		t.Fatalf("after the stored report: %+v, want the entry local", e)
	}
	x.Dropped(second)
	if _, to := x.Lookup(toks, 0, 12, false); to != 4 {
		t.Fatalf("after the tier dropped the second chunk a lookup reached %d, want 4", to)
	}
	if n, tok := x.Size(); n != 2 || tok != 8 {
		t.Fatalf("index %d segments, %d tokens; want 2, 8", n, tok)
	}
	third := Segment{Start: 8, Tokens: toks[:12]}
	x.Find(KeyOf(third), toks[8:12], false).Where |= Fleet
	x.Dropped(third)
	if e := x.Find(KeyOf(third), toks[8:12], false); e == nil || e.Where != Fleet {
		t.Fatalf("an entry the fleet holds too: %+v after the local drop, want it kept (fleet)", e)
	}
	x.Stored(Segment{Start: 0, Tokens: seqTokens(500, 4)})
	if n, _ := x.Size(); n != 2 {
		t.Fatalf("a report of an entry never planned changed the index: %d segments", n)
	}
}

// Residency answers for a prompt how much is in cells, and, continuing that, how much
// lives in this replica's tier and on the fleet's level.
func TestResidency(t *testing.T) {
	kv := New(Config{NCtx: 64, FirstPool: 4, BelowChunk: 4})
	toks := seqTokens(10, 16)
	kv.Allocate(0, toks[:6])
	chunks(kv.Below(), toks[:12], 4, Local)
	kv.Below().Add(BelowKey{12, HashTokens(HashSeed, toks[:12])}, toks[12:16], false, true, Fleet)
	r := kv.Residency(toks, 15)
	if r.Cells != 6 || r.Local != 6 || r.Fleet != 3 {
		t.Fatalf("residency %+v, want 6 in cells, 6 local (to 12), 3 on the fleet (to the limit 15)", r)
	}
}
