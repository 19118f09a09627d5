package pool

import (
	"fmt"
	"time"
)

// Lifecycle verbs. The engine's scheduler decides when a pool's sequence is copied,
// prefilled or removed in the cache; these verbs move the pool's state and refuse
// transitions that would break the tree's invariants, checked against the cell tree
// (Cells), which alone knows what the pool's sequence holds:
//
//	Materializing --(cells copied / prefilled)--> Materialized --> Resident --Evict--> Evicted
//	      ^                                                                       |
//	      +------------------------------ Materialize (restore) <-----------------+
//	Resident / Evicted --Release--> Released --(Tree.Reclaim)--> gone
//
// A pool starts materializing holding nothing; Resident means its sequence holds all
// of [0, L); Sessions never goes negative; a released pool takes no new pin, attach or
// child; a pool is reclaimed only once its sequence holds nothing.

// Materialize starts (or restarts, for an evicted pool) building [0, L) on the pool's
// sequence, which holds nothing yet: the scheduler copies the longest resident prefix
// (seq_cp, as for any request) and prefills the rest.
func (p *Pool) Materialize() error {
	switch {
	case p.State != Materializing && p.State != Evicted:
		return fmt.Errorf("%w: pool %d is %s; only a new or evicted pool is materialized", ErrConflict, p.ID, p.State)
	case p.Filled() != 0:
		return fmt.Errorf("%w: pool %d's sequence still holds %d cells; an evicted pool's cells are removed first", ErrConflict, p.ID, p.Filled())
	}
	p.State = Materializing
	return nil
}

// Materialized makes a pool resident (attachable) once its sequence holds all of
// [0, L) in the cell tree; it then awaits its first use (AwaitsUse).
func (p *Pool) Materialized(now time.Time) error {
	switch {
	case p.State != Materializing:
		return fmt.Errorf("%w: pool %d is %s, not materializing", ErrConflict, p.ID, p.State)
	case p.Filled() != p.L():
		return fmt.Errorf("%w: pool %d's sequence holds %d of its %d positions", ErrConflict, p.ID, p.Filled(), p.L())
	}
	p.State, p.LastAccess, p.AwaitsUse = Resident, now, true
	return nil
}

// Abandon undoes an unfinished materialization whose cells the caller removed: it stays
// as an evicted object (the caller removes a new pool from the tree).
func (p *Pool) Abandon() {
	p.State = Evicted
}

// Evict drops the pool's own cells, keeping its tokens so it can be restored. Nothing
// may depend on them: not a user pin, a child (whose [0, D) lives in these cells) nor an
// attached sequence.
func (p *Pool) Evict() error {
	switch {
	case p.State != Resident:
		return fmt.Errorf("%w: pool %d is %s", ErrConflict, p.ID, p.State)
	case p.UserPinned:
		return fmt.Errorf("%w: pool %d is pinned; unpin it first", ErrConflict, p.ID)
	case len(p.Children) > 0:
		return fmt.Errorf("%w: pool %d has children %v that share its cells", ErrConflict, p.ID, ChildIDs(p))
	case p.Sessions > 0:
		return fmt.Errorf("%w: %d sequences are attached to pool %d; flush them first", ErrConflict, p.Sessions, p.ID)
	}
	p.State = Evicted // the caller removes its sequence's cells
	return nil
}

// Page drops the pool's own cells under memory pressure when a tier below the cache
// keeps its KV (issue 40): unlike Evict it is allowed on a user-pinned pool, since a pin
// means "never lost", not "never moved" (the pool keeps its tokens and is restored on
// its next attach), and on a pool whose children hold no cells and are not being built
// (evicted themselves: a child's restore restores its parent first). Nothing attached
// may depend on the cells.
func (p *Pool) Page() error {
	switch {
	case p.State != Resident:
		return fmt.Errorf("%w: pool %d is %s", ErrConflict, p.ID, p.State)
	case p.Sessions > 0:
		return fmt.Errorf("%w: %d sequences are attached to pool %d", ErrConflict, p.Sessions, p.ID)
	}
	for _, c := range p.Children {
		if c.Filled() > 0 || c.State == Materializing {
			return fmt.Errorf("%w: pool %d's child %d holds or is building cells on its own", ErrConflict, p.ID, c.ID)
		}
	}
	p.State = Evicted // the caller spills and removes its sequence's cells
	return nil
}

// Pageable reports whether Page would succeed: resident, nothing attached, and no child
// holding cells.
func (p *Pool) Pageable() bool {
	if p.State != Resident || p.Sessions > 0 {
		return false
	}
	for _, c := range p.Children {
		if c.Filled() > 0 || c.State == Materializing {
			return false
		}
	}
	return true
}

// Release ends the pool for clients: no new attach, pin or child. Children that are
// released themselves do not block it (they only wait to be reclaimed, before their
// parent); live ones do.
func (p *Pool) Release(now time.Time) error {
	switch p.State {
	case Released:
		return fmt.Errorf("%w: pool %d was released", ErrNotFound, p.ID)
	case Materializing:
		return fmt.Errorf("%w: pool %d is still materializing", ErrConflict, p.ID)
	}
	if live := LiveChildren(p); len(live) > 0 {
		return fmt.Errorf("%w: pool %d has children %v; release them first", ErrHasChildren, p.ID, live)
	}
	p.State, p.UserPinned, p.ReleasedAt, p.LastAccess = Released, false, now, now
	return nil
}

// SetPin sets or clears the user pin.
func (p *Pool) SetPin(pin bool, now time.Time) error {
	if p.State == Released {
		return fmt.Errorf("%w: pool %d was released", ErrNotFound, p.ID)
	}
	p.UserPinned, p.LastAccess = pin, now
	return nil
}

// Attach counts one more sequence borrowing the pool's prefix.
func (p *Pool) Attach(now time.Time) {
	p.Sessions++
	p.LastAccess = now
	p.AwaitsUse = false
}

// Used records that a request without pool_id borrowed all of the pool's cells (the
// prefix cache found them): they are as recently used as an attach makes them, for
// eviction's order, and that was the pool's first use if it awaited one (AwaitsUse).
// A borrow of only part of the prefix is not a use of the pool (the engine does not
// call Used for it): the borrower holds the cells it shares whatever becomes of the
// pool, and the pool's other cells were not used.
func (p *Pool) Used(now time.Time) {
	if p.State != Released {
		p.LastAccess = now
		p.AwaitsUse = false
	}
}

// Detach counts one sequence fewer borrowing the pool's prefix.
func (p *Pool) Detach(now time.Time) error {
	if p.Sessions == 0 {
		return fmt.Errorf("%w: pool %d has no attached sequence to detach", ErrConflict, p.ID)
	}
	p.Sessions--
	p.LastAccess = now
	return nil
}

// Reclaimable reports a released pool that nothing uses any more and whose grace time
// has passed.
func (p *Pool) Reclaimable(now time.Time, grace time.Duration) bool {
	return p.State == Released && p.Sessions == 0 && len(p.Children) == 0 && now.Sub(p.LastAccess) >= grace
}

// LiveChildren lists the ids of p's children that are not released.
func LiveChildren(p *Pool) []int {
	var ids []int
	for _, c := range p.Children {
		if c.State != Released {
			ids = append(ids, c.ID)
		}
	}
	return ids
}

// Reclaim removes a reclaimable pool (its sequence already cleared by the caller) and
// returns its sequence id to the reserve.
func (t *Tree) Reclaim(p *Pool) error {
	switch {
	case p.State != Released || p.Sessions != 0:
		return fmt.Errorf("%w: pool %d is %s with %d sessions; only an unused released pool is reclaimed", ErrConflict, p.ID, p.State, p.Sessions)
	case p.Filled() != 0:
		return fmt.Errorf("%w: pool %d's sequence still holds %d cells", ErrConflict, p.ID, p.Filled())
	}
	return t.Remove(p)
}
