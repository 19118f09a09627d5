// Package pool holds PolyKV's shared-prefix pools: an immutable token prefix per pool,
// arranged in a tree, each owning one sequence id of the unified KV cache.
//
// A pool is a name on a path of the engine's cell tree (issue 12: one mechanism): the
// cells themselves, how many positions the pool's sequence holds and which of them it
// owns are read from that tree through the Cells view, never kept here a second time.
// What the package keeps is what the cell tree does not know: the public id, the
// immutable token prefix, the branch contract with the parent (a child shares at least
// [0, D) of its parent's cells, by sequence membership: nothing is copied, and owns the
// rest; D == parent.L extends, D < parent.L branches), the pins, the attached sessions
// and the lifecycle state machine (lifecycle.go). KV cells are attributed by ownership,
// never by membership, so summing own cells over every pool and sequence counts every
// physical cell once.
//
// The package is pure bookkeeping: the engine's scheduler decides when sequences are
// copied, prefilled and removed, and calls the lifecycle verbs, which check their
// invariants against the cell tree.
package pool

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"
)

// Token is a model token id.
type Token = int32

// State is where a pool is in its life.
type State int

// Pool states.
const (
	Materializing State = iota // its [D, L) is being prefilled
	Resident                   // all of [0, L) is in the cache
	Evicted                    // its own cells were dropped; the object (tokens) remains
	Released                   // released by the client; reclaimed once nothing uses it
)

func (s State) String() string {
	switch s {
	case Materializing:
		return "materializing"
	case Resident:
		return "resident"
	case Evicted:
		return "evicted"
	case Released:
		return "released"
	}
	return "unknown"
}

// Sentinel errors the API maps to statuses.
var (
	ErrNotFound       = errors.New("pool not found")
	ErrNoSeqIDs       = errors.New("no pool sequence ids left")
	ErrPrefixMismatch = errors.New("prefix contract violated")
	ErrHasChildren    = errors.New("pool has children")
	ErrBadRequest     = errors.New("invalid pool request")
	ErrConflict       = errors.New("pool state conflict")
)

// Cells is the view of the KV cache a Tree reads residency and ownership from: the
// engine's cell tree, the single source of which cells a sequence holds and owns.
type Cells interface {
	// Len is how many positions seq holds ([0, Len)).
	Len(seq int) int
	// Owned is how many cells are attributed to seq by ownership.
	Owned(seq int) int
}

// Pool is one node of the tree, used only on the engine goroutine. Its state changes
// only through the lifecycle verbs (lifecycle.go), which check the invariants.
type Pool struct {
	// ID is the public id. It is never reused in a server's lifetime, so an id kept in
	// a client's checkpoint can only ever name this pool (a reclaimed one answers 404).
	ID         int
	Seq        int // its sequence id in the KV cache, returned to the reserve on Remove
	Parent     *Pool
	D          int     // branch position: [0, D) is shared with Parent's cells (at least)
	Tokens     []Token // the full prefix [0, L)
	Hash       []uint64
	Children   []*Pool
	UserPinned bool
	State      State
	Created    time.Time
	LastAccess time.Time
	ReleasedAt time.Time
	Sessions   int // sequences currently borrowing this pool's prefix (kept by the engine)
	// AwaitsUse: the pool became resident (created, forked or restored) and nothing has
	// used it since: no attach, no fork from it, no request that borrowed all of it.
	// That first use is what the engine's grace time (--pool-grace-ms) protects: a pool
	// is made for the attach that follows, and must not be evicted in between.
	AwaitsUse bool
	tree      *Tree
}

// L is the prefix length.
func (p *Pool) L() int { return len(p.Tokens) }

// Filled is how many positions [0, Filled) the pool's sequence holds in the cache (L
// once resident, 0 when evicted), read from the cell tree.
func (p *Pool) Filled() int { return p.tree.cells.Len(p.Seq) }

// OwnCells is the number of cells attributed to this pool by ownership in the cell
// tree: its [D, L) once resident, less what another pool already owned when it was
// built, plus what it took over from sequences that are not pools (a pool is the
// preferred owner of the cells it holds).
func (p *Pool) OwnCells() int { return p.tree.cells.Owned(p.Seq) }

// Fingerprint is the cumulative hash of the whole prefix.
func (p *Pool) Fingerprint() uint64 {
	if len(p.Hash) == 0 {
		return 0
	}
	return p.Hash[len(p.Hash)-1]
}

// AutoPinned reports whether the pool must stay resident because something depends on
// it: a child (resident or not: its [0, D) lives in our cells) or an attached sequence.
func (p *Pool) AutoPinned() bool { return len(p.Children) > 0 || p.Sessions > 0 }

// Pinned reports a user or automatic pin.
func (p *Pool) Pinned() bool { return p.UserPinned || p.AutoPinned() }

// Attachable reports whether new sessions may attach.
func (p *Pool) Attachable() bool { return p.State == Resident }

// Depth is 1 for a root.
func (p *Pool) Depth() int {
	d := 1
	for q := p.Parent; q != nil; q = q.Parent {
		d++
	}
	return d
}

// Tree owns every pool, the reserve of pool sequence ids and the public id counter.
type Tree struct {
	cells    Cells
	pools    map[int]*Pool // by public id
	freeSeqs []int         // ascending; lowest first keeps sequence use predictable
	lastID   int           // public ids count up from 1 and are never reused
}

// NewTree reserves sequence ids [first, first+n) for pools, whose cells cells tells.
func NewTree(first, n int, cells Cells) *Tree {
	t := &Tree{cells: cells, pools: map[int]*Pool{}}
	for i := range n {
		t.freeSeqs = append(t.freeSeqs, first+i)
	}
	return t
}

// Get returns a pool by id.
func (t *Tree) Get(id int) (*Pool, error) {
	p, ok := t.pools[id]
	if !ok {
		return nil, fmt.Errorf("%w: pool %d does not exist (never created, or released and reclaimed)", ErrNotFound, id)
	}
	return p, nil
}

// All returns the pools ordered by id.
func (t *Tree) All() []*Pool {
	out := make([]*Pool, 0, len(t.pools))
	for _, p := range t.pools {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b *Pool) int { return a.ID - b.ID })
	return out
}

// Len is the number of pools (every state).
func (t *Tree) Len() int { return len(t.pools) }

// FreeIDs is the number of pool sequence ids left.
func (t *Tree) FreeIDs() int { return len(t.freeSeqs) }

// NewRoot creates a root pool over tokens in state Materializing, Filled 0.
func (t *Tree) NewRoot(tokens []Token, now time.Time) (*Pool, error) {
	if len(tokens) == 0 {
		return nil, fmt.Errorf("%w: the prefix is empty", ErrBadRequest)
	}
	return t.add(nil, 0, tokens, now)
}

// Fork creates a child of parent inheriting [0, d) and owning [d, len(tokens)).
// tokens is the child's full prefix and must equal parent's tokens on [0, d). The parent
// must be resident or evicted (then the caller restores it before the child is built).
func (t *Tree) Fork(parent *Pool, d int, tokens []Token, now time.Time) (*Pool, error) {
	if parent.State == Released {
		return nil, fmt.Errorf("%w: pool %d was released; fork from a live pool", ErrNotFound, parent.ID)
	}
	// A parent still materializing (or being restored) or evicted is fine: the child's
	// materialization waits until the parent is resident, as an attach does (the
	// scheduler restores an evicted parent first). Refusing would hand a client that
	// forks right after another client's fork a 409 it cannot act on (issue 25).
	if d < 0 || d > parent.L() {
		return nil, fmt.Errorf("%w: branch_pos %d is outside [0, %d] (the parent's prefix length)", ErrBadRequest, d, parent.L())
	}
	if len(tokens) <= d {
		return nil, fmt.Errorf("%w: the child's prefix (%d tokens) must extend past branch_pos %d", ErrBadRequest, len(tokens), d)
	}
	if i := FirstMismatch(parent.Tokens[:d], tokens[:d]); i >= 0 {
		return nil, fmt.Errorf("%w: the child's token %d (%d) differs from the parent's (%d); [0, branch_pos) must equal the parent's prefix",
			ErrPrefixMismatch, i, tokens[i], parent.Tokens[i])
	}
	return t.add(parent, d, tokens, now)
}

func (t *Tree) add(parent *Pool, d int, tokens []Token, now time.Time) (*Pool, error) {
	if len(t.freeSeqs) == 0 {
		return nil, fmt.Errorf("%w: all %d are in use; release a pool first", ErrNoSeqIDs, len(t.pools))
	}
	seq := t.freeSeqs[0]
	t.freeSeqs = t.freeSeqs[1:]
	t.lastID++
	p := &Pool{ID: t.lastID, Seq: seq, Parent: parent, D: d, Tokens: slices.Clone(tokens), Hash: RollingHash(tokens), State: Materializing, Created: now, LastAccess: now, tree: t}
	if parent != nil {
		parent.Children = append(parent.Children, p)
		parent.LastAccess = now
		parent.AwaitsUse = false // a fork is a use of its parent
	}
	t.pools[p.ID] = p
	return p, nil
}

// Recover puts back a pool recorded by an earlier run (package tier) under its old id,
// evicted: its tokens are known and its KV is in the tier, not in the cache. The
// parent (nil for a root) was recovered before it. Ids of this run count up from the
// highest one seen, so none is ever reused.
func (t *Tree) Recover(id int, parent *Pool, d int, tokens []Token, now time.Time) (*Pool, error) {
	if _, taken := t.pools[id]; taken || id <= 0 {
		return nil, fmt.Errorf("%w: pool id %d is taken or invalid", ErrConflict, id)
	}
	if parent != nil {
		if d < 0 || d > parent.L() || len(tokens) <= d || FirstMismatch(parent.Tokens[:d], tokens[:d]) >= 0 {
			return nil, fmt.Errorf("%w: recovered pool %d does not extend its parent %d at %d", ErrPrefixMismatch, id, parent.ID, d)
		}
	} else if len(tokens) == 0 || d != 0 {
		return nil, fmt.Errorf("%w: recovered root %d has %d tokens, branch position %d", ErrBadRequest, id, len(tokens), d)
	}
	last := t.lastID
	t.lastID = id - 1
	p, err := t.add(parent, d, tokens, now)
	t.lastID = max(last, id)
	if err != nil {
		return nil, err
	}
	p.State = Evicted
	return p, nil
}

// SkipIDs makes the next pool id start above floor (ids an earlier run may have used).
func (t *Tree) SkipIDs(floor int) { t.lastID = max(t.lastID, floor) }

// Remove deletes a pool without children and returns its id to the reserve. The
// caller has already removed its sequence from the cache.
func (t *Tree) Remove(p *Pool) error {
	if len(p.Children) > 0 {
		return fmt.Errorf("%w: pool %d has children %v; release them first", ErrHasChildren, p.ID, ChildIDs(p))
	}
	if n := p.Filled(); n != 0 {
		return fmt.Errorf("%w: pool %d's sequence still holds %d cells; remove them first", ErrConflict, p.ID, n)
	}
	if p.Parent != nil {
		p.Parent.Children = slices.DeleteFunc(p.Parent.Children, func(c *Pool) bool { return c == p })
	}
	delete(t.pools, p.ID)
	i, _ := slices.BinarySearch(t.freeSeqs, p.Seq)
	t.freeSeqs = slices.Insert(t.freeSeqs, i, p.Seq)
	return nil
}

// ChildIDs lists a pool's children.
func ChildIDs(p *Pool) []int {
	ids := make([]int, len(p.Children))
	for i, c := range p.Children {
		ids[i] = c.ID
	}
	return ids
}

// MaxDepth is the depth of the deepest pool (0 without pools).
func (t *Tree) MaxDepth() int {
	d := 0
	for _, p := range t.pools {
		d = max(d, p.Depth())
	}
	return d
}

// OwnCells sums the pools' own cells.
func (t *Tree) OwnCells() int {
	n := 0
	for _, p := range t.pools {
		n += p.OwnCells()
	}
	return n
}

// FirstMismatch is the first index where a and b differ, or -1 when equal (same length).
func FirstMismatch(a, b []Token) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// CommonPrefix is the length of the longest common prefix of a and b.
func CommonPrefix(a, b []Token) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// xxhash64's primes; the rolling hash mixes one token per position, so h[i] names the
// whole prefix [0, i] and any branch point can be checked in O(1).
const (
	prime1 uint64 = 11400714785074694791
	prime2 uint64 = 14029467366897019727
	prime3 uint64 = 1609587929392839161
	prime5 uint64 = 2870177450012600261
)

// PrefixHash is the prefix_hash the API shows for a pool holding tokens: its
// Fingerprint in hex, from the tokens alone (a restart's record carries it).
func PrefixHash(tokens []Token) string {
	h := prime5
	for _, t := range tokens {
		h = mix(h, uint64(uint32(t)))
	}
	if len(tokens) == 0 {
		h = 0
	}
	return strconv.FormatUint(h, 16)
}

// RollingHash returns h where h[i] fingerprints tokens[0..i].
func RollingHash(tokens []Token) []uint64 {
	out := make([]uint64, len(tokens))
	h := prime5
	for i, t := range tokens {
		h = mix(h, uint64(uint32(t)))
		out[i] = h
	}
	return out
}

// HashExtend continues a rolling hash over toks: HashExtend(HashExtend(0, nil), t)
// ends where RollingHash(t)'s last value does. HashExtend(0, nil) is the hash of the
// empty prefix.
func HashExtend(h uint64, toks []Token) uint64 {
	if h == 0 {
		h = prime5
	}
	for _, t := range toks {
		h = mix(h, uint64(uint32(t)))
	}
	return h
}

func mix(h, v uint64) uint64 {
	k := v * prime2
	k = (k << 31) | (k >> 33)
	k *= prime1
	h ^= k
	h = ((h<<27)|(h>>37))*prime1 + prime3
	// avalanche so neighbouring prefixes differ in every bit
	x := h
	x ^= x >> 33
	x *= prime2
	x ^= x >> 29
	x *= prime3
	x ^= x >> 32
	return x ^ h
}
