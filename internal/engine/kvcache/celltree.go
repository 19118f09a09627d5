package kvcache

import (
	"math/bits"
	"slices"
)

// Tree is the scheduler's model of the unified KV cache (issue 12): a tree over
// token ids whose nodes are runs of physical cells at positions [start, end), each
// shared by every sequence whose path goes through the node. It mirrors llama.cpp
// exactly: seq_cp(src, dst, 0, P) makes dst a member of src's first P cells (the nodes
// on src's path up to P), seq_rm(seq, q, -1) only takes seq out of its cells from q on,
// and a cell is free once no sequence holds it. So the cells in use are Σ node span,
// a borrower's cells are never freed by what a donor does, and "which resident sequence
// holds the longest prefix of this prompt" is a walk from the root.
//
// Two children may start with the same token: they are different cells that happen to
// hold the same tokens (two sequences prefilled them independently). The lookup
// explores every matching child.
//
// Every node's cells are attributed to exactly one of its holders (owner), so KV bytes
// are still reported by ownership and Σ owned == cells in use: pools first (a pool seq
// that is handed cells by seq_cp takes them over from a session, as a zero-copy
// snapshot does), otherwise the sequence that wrote them, and when the owner lets go,
// the lowest pool seq, else the lowest sequence still holding them.
//
// Only the Manager changes a Tree (write, remove, share are unexported, so the
// compiler keeps every other package to reading it); everyone may read it.
type Tree struct {
	root  *Node // the empty run at position 0; never counted
	tip   map[int]*Node
	owned map[int]int
	total int
	// firstPool: sequence ids >= firstPool are pools' (preferred owners).
	firstPool int
	// watch, when set, is told each sequence's changes (Watch).
	watch func(seq, pos int)
}

// Node is one run of cells of a Tree: what Longest returns, so that the caller can
// pick one of its holders to seq_cp the run from.
type Node struct {
	parent   *Node
	children []*Node
	start    int
	toks     []Token
	holders  SeqSet
	owner    int
}

func (n *Node) end() int { return n.start + len(n.toks) }

// Holders is the set of sequences that hold the node's cells (each holds [0, end)).
func (n *Node) Holders() SeqSet { return n.holders }

// SeqSet is a set of sequence ids below MaxSeqs.
type SeqSet [MaxSeqs / 64]uint64

// Add puts q in the set.
func (s *SeqSet) Add(q int) { s[q/64] |= 1 << (q % 64) }

// Del takes q out of the set.
func (s *SeqSet) Del(q int) { s[q/64] &^= 1 << (q % 64) }

// Has reports whether q is in the set.
func (s SeqSet) Has(q int) bool { return s[q/64]&(1<<(q%64)) != 0 }

// Empty reports whether the set has no member.
func (s SeqSet) Empty() bool { return s == SeqSet{} }

// SubsetOf reports whether every member of s is in o.
func (s SeqSet) SubsetOf(o SeqSet) bool {
	for i := range s {
		if s[i]&^o[i] != 0 {
			return false
		}
	}
	return true
}

// Only reports whether q is the set's single member.
func (s SeqSet) Only(q int) bool {
	var o SeqSet
	o.Add(q)
	return s == o
}

// Each calls f for the members in ascending order until f returns false.
func (s SeqSet) Each(f func(q int) bool) {
	for i, w := range s {
		for w != 0 {
			b := bits.TrailingZeros64(w)
			if !f(i*64 + b) {
				return
			}
			w &^= 1 << b
		}
	}
}

// NewTree returns an empty tree; sequence ids >= firstPool are pools' (the preferred
// owners of shared cells).
func NewTree(firstPool int) *Tree {
	return &Tree{root: &Node{owner: -1}, tip: map[int]*Node{}, owned: map[int]int{}, firstPool: firstPool}
}

// Len is how many cells seq holds (its positions are [0, Len)).
func (c *Tree) Len(seq int) int {
	if n := c.tip[seq]; n != nil {
		return n.end()
	}
	return 0
}

// Tokens lists what seq holds (the liveness checks of tests compare it with what the
// scheduler thinks its sequences hold).
func (c *Tree) Tokens(seq int) []Token {
	var runs [][]Token
	for n := c.tip[seq]; n != nil && n != c.root; n = n.parent {
		runs = append(runs, n.toks)
	}
	var out []Token
	for i := len(runs) - 1; i >= 0; i-- {
		out = append(out, runs[i]...)
	}
	return out
}

// write records that seq's next positions now hold toks (a committed batch).
func (c *Tree) write(seq int, toks []Token) {
	if len(toks) == 0 {
		return
	}
	c.Touch(seq, c.Len(seq))
	t := c.tip[seq]
	if t == nil {
		t = c.root
	}
	if t != c.root && t.holders.Only(seq) && len(t.children) == 0 {
		t.toks = append(t.toks, toks...)
	} else {
		n := &Node{parent: t, start: t.end(), toks: slices.Clone(toks), owner: seq}
		n.holders.Add(seq)
		t.children = append(t.children, n)
		t = n
	}
	c.tip[seq] = t
	c.owned[t.owner] += len(toks)
	c.total += len(toks)
}

// split cuts n at position at (start < at < end): a new node takes [start, at) and
// becomes n's parent; n keeps [at, end), its children and every tip that points at it.
func (c *Tree) split(n *Node, at int) *Node {
	k := at - n.start
	h := &Node{parent: n.parent, start: n.start, toks: slices.Clone(n.toks[:k]), holders: n.holders, owner: n.owner, children: []*Node{n}}
	p := n.parent
	p.children[slices.Index(p.children, n)] = h
	n.parent = h
	n.toks = slices.Clone(n.toks[k:])
	n.start = at
	return h
}

// cutAt finds the node on seq's path holding position pos-1 (the node that must end
// at pos), splitting it when pos falls inside. nil for pos 0.
func (c *Tree) cutAt(seq, pos int) *Node {
	if pos <= 0 {
		return nil
	}
	n := c.tip[seq]
	for n != nil && n != c.root && n.start >= pos {
		n = n.parent
	}
	if n == nil || n == c.root {
		return nil
	}
	if pos < n.end() {
		return c.split(n, pos)
	}
	return n
}

// remove takes seq out of its cells from position q on (seq_rm(seq, q, -1)).
func (c *Tree) remove(seq, q int) {
	t := c.tip[seq]
	if t == nil || q >= t.end() {
		return
	}
	c.Touch(seq, max(q, 0))
	keep := c.cutAt(seq, max(q, 0))
	stop := keep
	if stop == nil {
		stop = c.root
	}
	for n := c.tip[seq]; n != stop; n = n.parent {
		n.holders.Del(seq)
		if n.holders.Empty() {
			c.owned[n.owner] -= len(n.toks)
			c.total -= len(n.toks)
			n.parent.children = slices.DeleteFunc(n.parent.children, func(x *Node) bool { return x == n })
		} else if n.owner == seq {
			c.reown(n, c.preferred(n.holders))
		}
	}
	if keep == nil {
		delete(c.tip, seq)
	} else {
		c.tip[seq] = keep
	}
	c.clean(seq)
}

func (c *Tree) clean(seq int) {
	if c.owned[seq] == 0 {
		delete(c.owned, seq)
	}
}

// preferred is the owner a node falls to: the lowest pool sequence, else the lowest.
func (c *Tree) preferred(h SeqSet) int {
	first, pool := -1, -1
	h.Each(func(q int) bool {
		if first < 0 {
			first = q
		}
		if q >= c.firstPool {
			pool = q
			return false
		}
		return true
	})
	if pool >= 0 {
		return pool
	}
	return first
}

func (c *Tree) reown(n *Node, to int) {
	if n.owner == to {
		return
	}
	c.owned[n.owner] -= len(n.toks)
	old := n.owner
	n.owner = to
	c.owned[to] += len(n.toks)
	c.clean(old)
}

// share makes the empty sequence dst a member of src's cells [0, p1) (seq_cp).
func (c *Tree) share(src, dst, p1 int) {
	if c.tip[dst] != nil {
		c.remove(dst, 0) // the scheduler always clears first; mirror llama.cpp's union anyway
	}
	p1 = min(p1, c.Len(src))
	t := c.cutAt(src, p1)
	if t == nil {
		return
	}
	c.Touch(dst, 0)
	c.tip[dst] = t
	for n := t; n != c.root; n = n.parent {
		n.holders.Add(dst)
		if dst >= c.firstPool && n.owner < c.firstPool {
			c.reown(n, dst)
		}
	}
}

// Owned is how many cells are attributed to seq.
func (c *Tree) Owned(seq int) int { return c.owned[seq] }

// Exclusive counts the cells only seq holds at positions >= from: what seq_rm(seq,
// from, -1) would free. They are always a suffix of seq's path.
func (c *Tree) Exclusive(seq, from int) int {
	n := 0
	for x := c.tip[seq]; x != nil && x != c.root && x.end() > from; x = x.parent {
		if !x.holders.Only(seq) {
			break
		}
		n += x.end() - max(x.start, from)
	}
	return n
}

// HoldersBelow is every sequence that holds some cell of seq's below position p1.
func (c *Tree) HoldersBelow(seq, p1 int) SeqSet {
	var set SeqSet
	for x := c.tip[seq]; x != nil && x != c.root; x = x.parent {
		if x.start < p1 {
			for i := range set {
				set[i] |= x.holders[i]
			}
		}
	}
	return set
}

// Shares reports whether sequences a and b hold the same cells at position pos (the
// same run of the tree, not merely the same token): then they share all of [0, pos].
func (c *Tree) Shares(a, b, pos int) bool {
	na, nb := c.nodeAt(a, pos), c.nodeAt(b, pos)
	return na != nil && na == nb
}

// nodeAt is the run on seq's path that holds position pos, or nil.
func (c *Tree) nodeAt(seq, pos int) *Node {
	for n := c.tip[seq]; n != nil && n != c.root; n = n.parent {
		if n.start <= pos && pos < n.end() {
			return n
		}
	}
	return nil
}

// Joint counts the cells on seq's path that only members of set hold: what removing
// every member of set would free of seq's cells.
func (c *Tree) Joint(seq int, set SeqSet) int {
	n := 0
	for x := c.tip[seq]; x != nil && x != c.root; x = x.parent {
		if x.holders.SubsetOf(set) {
			n += len(x.toks)
		}
	}
	return n
}

// Freed counts the cells that removing every sequence in set would free, except those
// keep holds below keepTo (cells a placement is about to copy from keep).
func (c *Tree) Freed(set SeqSet, keep, keepTo int) int {
	var protect *Node
	if keepTo > 0 {
		for n := c.tip[keep]; n != nil && n != c.root; n = n.parent {
			if n.start < keepTo {
				protect = n
				break
			}
		}
	}
	protected := map[*Node]bool{}
	for n := protect; n != nil && n != c.root; n = n.parent {
		protected[n] = true
	}
	total := 0
	var walk func(n *Node)
	walk = func(n *Node) {
		for _, ch := range n.children {
			if ch.holders.SubsetOf(set) {
				span := len(ch.toks)
				if protected[ch] {
					span = max(0, ch.end()-max(ch.start, keepTo))
				}
				total += span
			}
			walk(ch)
		}
	}
	walk(c.root)
	return total
}

// Longest finds the longest prefix of prompt[:limit] that some sequence holds: the
// length and the node it ends in (every holder of the node holds [0, length)). Among
// equal lengths the first found wins (children in creation order).
func (c *Tree) Longest(prompt []Token, limit int) (int, *Node) {
	best, bestNode := 0, (*Node)(nil)
	c.below(c.root, prompt, limit, &best, &bestNode)
	return best, bestNode
}

// below extends a match that covers all of n into n's children (Longest's walk).
func (c *Tree) below(n *Node, prompt []Token, limit int, best *int, bestNode **Node) {
	for _, ch := range n.children {
		if ch.start >= limit || prompt[ch.start] != ch.toks[0] {
			continue
		}
		m := commonPrefix(ch.toks, prompt[ch.start:limit])
		if ch.start+m > *best {
			*best, *bestNode = ch.start+m, ch
		}
		if m == len(ch.toks) {
			c.below(ch, prompt, limit, best, bestNode)
		}
	}
}

// LongestFrom is Longest among the sequences that share seq's cells [0, at): the walk
// starts on seq's path at position at, so every holder of the node found holds seq's
// own cells [0, at) (a fork builds on its parent's node). prompt[:at] must be what seq
// holds there; at must not pass seq's length or limit. (0, nil) when seq holds nothing.
func (c *Tree) LongestFrom(seq, at int, prompt []Token, limit int) (int, *Node) {
	if at <= 0 {
		return c.Longest(prompt, limit)
	}
	n := c.tip[seq]
	for n != nil && n != c.root && n.start >= at {
		n = n.parent
	}
	if n == nil || n == c.root {
		return 0, nil
	}
	best, bestNode := at, n
	if at < n.end() {
		// at falls inside n: the match goes on along n's own cells first.
		m := commonPrefix(n.toks[at-n.start:], prompt[at:limit])
		if best += m; best < n.end() {
			return best, n
		}
	}
	c.below(n, prompt, limit, &best, &bestNode)
	return best, bestNode
}

// Watch sets the function told, on the engine goroutine, that a sequence changed from
// a position on: every write, removal and copy calls it (with the lowest position it
// changes), and so do callers of Touch. Residency reports (the engine's residency.go)
// are built from it. nil stops it.
func (c *Tree) Watch(f func(seq, pos int)) { c.watch = f }

// Touch tells the watcher, if any, that seq changed from position pos on, though no
// cell did (a pool became reportable or stopped being so).
func (c *Tree) Touch(seq, pos int) {
	if c.watch != nil {
		c.watch(seq, pos)
	}
}

// TokensIn lists what seq holds at [from, to) by walking up from its tip, so a step
// that appends one token reads one node, not the whole path.
func (c *Tree) TokensIn(seq, from, to int) []Token {
	if from >= to {
		return nil
	}
	out := make([]Token, to-from)
	for n := c.tip[seq]; n != nil && n != c.root && n.end() > from; n = n.parent {
		lo, hi := max(n.start, from), min(n.end(), to)
		if lo < hi {
			copy(out[lo-from:], n.toks[lo-n.start:hi-n.start])
		}
	}
	return out
}

// commonPrefix is how many leading tokens a and b share.
func commonPrefix(a, b []Token) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}
