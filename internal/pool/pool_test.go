package pool

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

// fakeCells stands in for the engine's cell tree: how many positions each sequence
// holds and how many cells it owns.
type fakeCells struct{ held, owned map[int]int }

func newFakeCells() *fakeCells { return &fakeCells{held: map[int]int{}, owned: map[int]int{}} }

func (c *fakeCells) Len(seq int) int   { return c.held[seq] }
func (c *fakeCells) Owned(seq int) int { return c.owned[seq] }
func (c *fakeCells) set(seq, held, owned int) {
	c.held[seq], c.owned[seq] = held, owned
}

func toks(from, n int) []Token {
	out := make([]Token, n)
	for i := range out {
		out[i] = Token(from + i)
	}
	return out
}

func TestRollingHashIdentifiesPrefixes(t *testing.T) {
	a := RollingHash(toks(1, 50))
	b := RollingHash(append(toks(1, 30), 999))
	for i := 0; i < 30; i++ {
		if a[i] != b[i] {
			t.Fatalf("equal prefixes hash differently at %d", i)
		}
	}
	if a[30] == b[30] {
		t.Fatal("diverging prefixes hash the same")
	}
	seen := map[uint64]bool{}
	for _, h := range a {
		if seen[h] {
			t.Fatal("collision within one prefix")
		}
		seen[h] = true
	}
}

func TestTreeForkContractAndIDs(t *testing.T) {
	now := time.Unix(0, 0)
	cells := newFakeCells()
	tr := NewTree(8, 2, cells)
	root, err := tr.NewRoot(toks(1, 20), now)
	if err != nil || root.ID != 1 || root.Seq != 8 || root.State != Materializing {
		t.Fatalf("root %+v %v", root, err)
	}
	cells.set(root.Seq, 20, 20)
	if err := root.Materialized(now); err != nil {
		t.Fatal(err)
	}
	bad := toks(1, 25)
	bad[7] = 0
	if _, err := tr.Fork(root, 10, bad, now); !errors.Is(err, ErrPrefixMismatch) {
		t.Fatalf("mismatch: %v", err)
	}
	for _, d := range []int{-1, 21} {
		if _, err := tr.Fork(root, d, toks(1, 25), now); !errors.Is(err, ErrBadRequest) {
			t.Fatalf("D=%d: %v", d, err)
		}
	}
	child, err := tr.Fork(root, 12, append(toks(1, 12), 77, 78), now)
	if err != nil || child.ID != 2 || child.Seq != 9 || child.Parent != root || child.D != 12 || child.Depth() != 2 {
		t.Fatalf("child %+v %v", child, err)
	}
	if !root.AutoPinned() || root.UserPinned {
		t.Fatal("a parent with a child is pinned automatically")
	}
	if _, err := tr.NewRoot(toks(1, 3), now); !errors.Is(err, ErrNoSeqIDs) {
		t.Fatalf("third pool with 2 ids: %v", err)
	}
	if err := tr.Remove(root); !errors.Is(err, ErrHasChildren) {
		t.Fatalf("remove a parent: %v", err)
	}
	// Residency and ownership are read from the cell tree, not kept by the pool.
	cells.set(child.Seq, 14, 2)
	if root.OwnCells()+child.OwnCells() != 20+2 || tr.OwnCells() != 22 || child.Filled() != 14 {
		t.Fatalf("ownership: root %d child %d, child filled %d", root.OwnCells(), child.OwnCells(), child.Filled())
	}
	if err := tr.Remove(child); !errors.Is(err, ErrConflict) {
		t.Fatalf("remove a pool whose sequence still holds cells: %v", err)
	}
	cells.set(child.Seq, 0, 0)
	if err := tr.Remove(child); err != nil || len(root.Children) != 0 || tr.FreeIDs() != 1 {
		t.Fatalf("remove child: %v", err)
	}
	again, _ := tr.NewRoot(toks(5, 3), now)
	if again.ID != 3 || again.Seq != 9 {
		t.Fatalf("after removing pool 2 (sequence 9): new pool id %d on sequence %d, want a fresh id 3 on the freed sequence 9", again.ID, again.Seq)
	}
	if _, err := tr.Get(2); !errors.Is(err, ErrNotFound) {
		t.Fatalf("removed id 2 still resolves: %v", err)
	}
	if _, err := tr.Get(42); !errors.Is(err, ErrNotFound) {
		t.Fatalf("get unknown: %v", err)
	}
}

// A fork of a pool that is still materializing is accepted (its own materialization
// waits for the parent, issue 25); a released parent is refused.
func TestForkOfMaterializingParent(t *testing.T) {
	now := time.Unix(0, 0)
	tr := NewTree(8, 3, newFakeCells())
	root, _ := tr.NewRoot(toks(1, 20), now)
	child, err := tr.Fork(root, 20, append(toks(1, 20), 5), now)
	if err != nil || child.Parent != root || child.State != Materializing {
		t.Fatalf("fork of a materializing pool: %+v %v", child, err)
	}
	other, _ := tr.NewRoot(toks(100, 5), now)
	other.State = Released
	if _, err := tr.Fork(other, 2, toks(100, 4), now); !errors.Is(err, ErrNotFound) {
		t.Fatalf("fork of a released pool: %v", err)
	}
}

func TestRecoverKeepsIDs(t *testing.T) {
	now := time.Unix(0, 0)
	tr := NewTree(8, 3, newFakeCells())
	tr.SkipIDs(1000)
	root, err := tr.Recover(7, nil, 0, toks(1, 10), now)
	if err != nil || root.ID != 7 || root.State != Evicted {
		t.Fatalf("recover root: %+v %v", root, err)
	}
	if _, err := tr.Recover(8, root, 4, toks(50, 10), now); !errors.Is(err, ErrPrefixMismatch) {
		t.Fatalf("child that does not extend its parent: %v", err)
	}
	if _, err := tr.Recover(7, nil, 0, toks(1, 3), now); !errors.Is(err, ErrConflict) {
		t.Fatalf("taken id: %v", err)
	}
	// A record's prefix_hash, from the tokens alone, is the one the pool shows.
	if got, want := PrefixHash(root.Tokens), strconv.FormatUint(root.Fingerprint(), 16); got != want {
		t.Fatalf("PrefixHash %s, the pool's fingerprint %s", got, want)
	}
	p, _ := tr.NewRoot(toks(3, 3), now)
	if p.ID != 1001 {
		t.Fatalf("new id %d after floor 1000", p.ID)
	}
}
