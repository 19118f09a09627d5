package pool

import (
	"errors"
	"testing"
	"time"
)

func TestMaterializeChecksTheCellTree(t *testing.T) {
	now := time.Unix(100, 0)
	cells := newFakeCells()
	tr := NewTree(4, 2, cells)
	root, _ := tr.NewRoot(toks(1, 10), now)
	if root.Attachable() {
		t.Fatal("a materializing pool is attachable")
	}
	cells.set(root.Seq, 4, 4)
	if root.Filled() != 4 || root.OwnCells() != 4 {
		t.Fatalf("half built: filled %d, own %d, want both read from the cells (4)", root.Filled(), root.OwnCells())
	}
	if err := root.Materialized(now); !errors.Is(err, ErrConflict) || root.State != Materializing {
		t.Fatalf("materialized holding 4 of 10 positions: %v, want a conflict", err)
	}
	cells.set(root.Seq, 10, 7) // 3 of its cells were already owned by another pool
	if err := root.Materialized(now.Add(time.Second)); err != nil || root.State != Resident || root.Filled() != 10 || root.OwnCells() != 7 || !root.LastAccess.Equal(now.Add(time.Second)) {
		t.Fatalf("materialized: %v %+v", err, root)
	}
	if err := root.Materialize(); !errors.Is(err, ErrConflict) {
		t.Fatalf("re-materialize a resident pool: %v", err)
	}
	if err := root.Materialized(now); !errors.Is(err, ErrConflict) {
		t.Fatalf("materialized twice: %v", err)
	}
}

func TestEvictRestoreAndWhatBlocksEviction(t *testing.T) {
	now := time.Unix(100, 0)
	cells := newFakeCells()
	tr := NewTree(4, 3, cells)
	root, _ := tr.NewRoot(toks(1, 10), now)
	cells.set(root.Seq, 10, 10)
	if err := root.Materialized(now); err != nil {
		t.Fatal(err)
	}
	_ = root.SetPin(true, now)
	if err := root.Evict(); !errors.Is(err, ErrConflict) {
		t.Fatalf("evict pinned: %v", err)
	}
	_ = root.SetPin(false, now)
	root.Attach(now)
	if err := root.Evict(); !errors.Is(err, ErrConflict) || !root.AutoPinned() {
		t.Fatalf("evict with an attached sequence: %v", err)
	}
	if err := root.Detach(now); err != nil {
		t.Fatal(err)
	}
	if err := root.Detach(now); !errors.Is(err, ErrConflict) || root.Sessions != 0 {
		t.Fatalf("detach below zero: %v, sessions %d", err, root.Sessions)
	}
	child, _ := tr.Fork(root, 10, toks(1, 12), now)
	if err := root.Evict(); !errors.Is(err, ErrConflict) {
		t.Fatalf("evict with a child: %v", err)
	}
	child.Abandon()
	if err := tr.Remove(child); err != nil {
		t.Fatal(err)
	}
	if err := root.Evict(); err != nil || root.State != Evicted {
		t.Fatalf("evict: %v %+v", err, root)
	}
	if err := root.Materialize(); !errors.Is(err, ErrConflict) {
		t.Fatalf("restore before the evicted cells were removed: %v, want a conflict", err)
	}
	cells.set(root.Seq, 0, 0) // the scheduler's seq_rm
	if err := root.Evict(); !errors.Is(err, ErrConflict) {
		t.Fatalf("evict twice: %v", err)
	}
	// An evicted pool can be forked (its child waits for the restore) and restored.
	if _, err := tr.Fork(root, 5, toks(1, 7), now); err != nil {
		t.Fatalf("fork of an evicted pool: %v", err)
	}
	if err := root.Materialize(); err != nil || root.State != Materializing || root.Filled() != 0 {
		t.Fatalf("restore: %v %+v", err, root)
	}
}

func TestReleasePinAndReclaim(t *testing.T) {
	now := time.Unix(100, 0)
	grace := 5 * time.Second
	cells := newFakeCells()
	tr := NewTree(4, 3, cells)
	root, _ := tr.NewRoot(toks(1, 10), now)
	if err := root.Release(now); !errors.Is(err, ErrConflict) {
		t.Fatalf("release while materializing: %v", err)
	}
	cells.set(root.Seq, 10, 10)
	_ = root.Materialized(now)
	a, _ := tr.Fork(root, 10, toks(1, 12), now)
	b, _ := tr.Fork(root, 4, append(toks(1, 4), 50), now)
	cells.set(a.Seq, 12, 2)
	cells.set(b.Seq, 5, 1)
	if err := errors.Join(a.Materialized(now), b.Materialized(now)); err != nil {
		t.Fatal(err)
	}
	if err := root.Release(now); !errors.Is(err, ErrHasChildren) {
		t.Fatalf("release with live children: %v", err)
	}
	if err := a.Release(now); err != nil {
		t.Fatal(err)
	}
	if live := LiveChildren(root); len(live) != 1 || live[0] != b.ID {
		t.Fatalf("live children %v, want [%d]", live, b.ID)
	}
	b.Attach(now)
	if err := b.Release(now); err != nil {
		t.Fatal(err)
	}
	_ = root.SetPin(true, now)
	if err := root.Release(now); err != nil || root.UserPinned || root.State != Released {
		t.Fatalf("release with only released children: %v %+v", err, root)
	}
	for _, err := range []error{root.Release(now), root.SetPin(true, now)} {
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("verb on a released pool: %v, want not found", err)
		}
	}
	if _, err := tr.Fork(root, 10, toks(1, 11), now); !errors.Is(err, ErrNotFound) {
		t.Fatalf("fork of a released pool: %v", err)
	}
	later := now.Add(grace)
	if root.Reclaimable(later, grace) || b.Reclaimable(later, grace) || !a.Reclaimable(later, grace) || a.Reclaimable(now, grace) {
		t.Fatal("reclaimable: only a (released, unused, no children, past grace)")
	}
	if err := tr.Reclaim(b); !errors.Is(err, ErrConflict) {
		t.Fatalf("reclaim with an attached session: %v", err)
	}
	_ = b.Detach(later)
	if err := tr.Reclaim(a); !errors.Is(err, ErrConflict) {
		t.Fatalf("reclaim while its sequence holds cells: %v", err)
	}
	for _, p := range []*Pool{a, b} {
		cells.set(p.Seq, 0, 0)
		if err := tr.Reclaim(p); err != nil {
			t.Fatal(err)
		}
	}
	if !root.Reclaimable(later.Add(grace), grace) {
		t.Fatal("the root is reclaimable once its children are gone")
	}
	cells.set(root.Seq, 0, 0)
	if err := tr.Reclaim(root); err != nil || tr.Len() != 0 || tr.FreeIDs() != 3 {
		t.Fatalf("reclaim root: %v, %d pools, %d free sequences", err, tr.Len(), tr.FreeIDs())
	}
}

// Used (an implicit borrow by a request without pool_id) refreshes a live pool's last
// access, as an attach does, and leaves a released pool's grace clock alone.
func TestUsedRefreshesLastAccess(t *testing.T) {
	now := time.Unix(100, 0)
	cells := newFakeCells()
	tr := NewTree(4, 2, cells)
	p, _ := tr.NewRoot(toks(1, 10), now)
	cells.set(p.Seq, 10, 10)
	_ = p.Materialized(now)
	later := now.Add(time.Minute)
	if p.Used(later); !p.LastAccess.Equal(later) {
		t.Fatalf("last access %v after a use at %v", p.LastAccess, later)
	}
	_ = p.Release(later)
	if p.Used(later.Add(time.Minute)); !p.LastAccess.Equal(later) {
		t.Fatalf("a released pool's last access moved to %v", p.LastAccess)
	}
}

// A pool awaits its first use from when it becomes resident (built or restored) until an
// attach, a fork from it or a whole borrow (Used): what the engine's grace protects.
func TestAwaitsUseUntilFirstUse(t *testing.T) {
	now := time.Unix(100, 0)
	cells := newFakeCells()
	tr := NewTree(4, 3, cells)
	uses := map[string]func(p *Pool){
		"attach": func(p *Pool) { p.Attach(now) },
		"used":   func(p *Pool) { p.Used(now) },
		"fork":   func(p *Pool) { _, _ = tr.Fork(p, 10, toks(1, 12), now) },
	}
	for name, use := range uses {
		p, _ := tr.NewRoot(toks(1, 10), now)
		if p.AwaitsUse {
			t.Fatalf("%s: a pool still materializing awaits use", name)
		}
		cells.set(p.Seq, 10, 10)
		if _ = p.Materialized(now); !p.AwaitsUse {
			t.Fatalf("%s: a pool just built does not await its first use", name)
		}
		if _ = p.SetPin(true, now); !p.AwaitsUse {
			t.Fatalf("%s: a pin counted as a use", name)
		}
		if use(p); p.AwaitsUse {
			t.Fatalf("%s: still awaits use after its first", name)
		}
		for _, c := range p.Children {
			_ = tr.Remove(c)
		}
		p.Children, p.Sessions = nil, 0
		_ = p.Release(now)
		cells.set(p.Seq, 0, 0)
		if err := tr.Reclaim(p); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
}
