package engine

import (
	"math/bits"
	"slices"
)

// cellTree is the scheduler's model of the unified KV cache (issue 12): a tree over
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
type cellTree struct {
	root  *cellNode // the empty run at position 0; never counted
	tip   map[int]*cellNode
	owned map[int]int
	total int
	// firstPool: sequence ids >= firstPool are pools' (preferred owners).
	firstPool int
	// watch, when set, notes each sequence's changes for residency reports.
	watch *seqWatch
}

type cellNode struct {
	parent   *cellNode
	children []*cellNode
	start    int
	toks     []Token
	holders  seqSet
	owner    int
}

func (n *cellNode) end() int { return n.start + len(n.toks) }

// seqSet is a set of sequence ids below MaxSeqs.
type seqSet [MaxSeqs / 64]uint64

func (s *seqSet) add(q int)     { s[q/64] |= 1 << (q % 64) }
func (s *seqSet) del(q int)     { s[q/64] &^= 1 << (q % 64) }
func (s seqSet) has(q int) bool { return s[q/64]&(1<<(q%64)) != 0 }
func (s seqSet) empty() bool    { return s == seqSet{} }
func (s seqSet) subsetOf(o seqSet) bool {
	for i := range s {
		if s[i]&^o[i] != 0 {
			return false
		}
	}
	return true
}

// only reports whether q is the set's single member.
func (s seqSet) only(q int) bool {
	var o seqSet
	o.add(q)
	return s == o
}

// each calls f for the members in ascending order until f returns false.
func (s seqSet) each(f func(q int) bool) {
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

func newCellTree(firstPool int) *cellTree {
	return &cellTree{root: &cellNode{owner: -1}, tip: map[int]*cellNode{}, owned: map[int]int{}, firstPool: firstPool}
}

// Len is how many cells seq holds (its positions are [0, Len)).
func (c *cellTree) Len(seq int) int {
	if n := c.tip[seq]; n != nil {
		return n.end()
	}
	return 0
}

// tokens lists what seq holds (tests).
func (c *cellTree) tokens(seq int) []Token {
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

// Append records that seq's next positions now hold toks (a committed batch).
func (c *cellTree) Append(seq int, toks []Token) {
	if len(toks) == 0 {
		return
	}
	c.touch(seq, c.Len(seq))
	t := c.tip[seq]
	if t == nil {
		t = c.root
	}
	if t != c.root && t.holders.only(seq) && len(t.children) == 0 {
		t.toks = append(t.toks, toks...)
	} else {
		n := &cellNode{parent: t, start: t.end(), toks: slices.Clone(toks), owner: seq}
		n.holders.add(seq)
		t.children = append(t.children, n)
		t = n
	}
	c.tip[seq] = t
	c.owned[t.owner] += len(toks)
	c.total += len(toks)
}

// split cuts n at position at (start < at < end): a new node takes [start, at) and
// becomes n's parent; n keeps [at, end), its children and every tip that points at it.
func (c *cellTree) split(n *cellNode, at int) *cellNode {
	k := at - n.start
	h := &cellNode{parent: n.parent, start: n.start, toks: slices.Clone(n.toks[:k]), holders: n.holders, owner: n.owner, children: []*cellNode{n}}
	p := n.parent
	p.children[slices.Index(p.children, n)] = h
	n.parent = h
	n.toks = slices.Clone(n.toks[k:])
	n.start = at
	return h
}

// cutAt finds the node on seq's path holding position pos-1 (the node that must end
// at pos), splitting it when pos falls inside. nil for pos 0.
func (c *cellTree) cutAt(seq, pos int) *cellNode {
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

// Rm takes seq out of its cells from position q on (seq_rm(seq, q, -1)).
func (c *cellTree) Rm(seq, q int) {
	t := c.tip[seq]
	if t == nil || q >= t.end() {
		return
	}
	c.touch(seq, max(q, 0))
	keep := c.cutAt(seq, max(q, 0))
	stop := keep
	if stop == nil {
		stop = c.root
	}
	for n := c.tip[seq]; n != stop; n = n.parent {
		n.holders.del(seq)
		if n.holders.empty() {
			c.owned[n.owner] -= len(n.toks)
			c.total -= len(n.toks)
			n.parent.children = slices.DeleteFunc(n.parent.children, func(x *cellNode) bool { return x == n })
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

func (c *cellTree) clean(seq int) {
	if c.owned[seq] == 0 {
		delete(c.owned, seq)
	}
}

// preferred is the owner a node falls to: the lowest pool sequence, else the lowest.
func (c *cellTree) preferred(h seqSet) int {
	first, pool := -1, -1
	h.each(func(q int) bool {
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

func (c *cellTree) reown(n *cellNode, to int) {
	if n.owner == to {
		return
	}
	c.owned[n.owner] -= len(n.toks)
	old := n.owner
	n.owner = to
	c.owned[to] += len(n.toks)
	c.clean(old)
}

// Cp makes the empty sequence dst a member of src's cells [0, p1) (seq_cp).
func (c *cellTree) Cp(src, dst, p1 int) {
	if c.tip[dst] != nil {
		c.Rm(dst, 0) // the scheduler always clears first; mirror llama.cpp's union anyway
	}
	p1 = min(p1, c.Len(src))
	t := c.cutAt(src, p1)
	if t == nil {
		return
	}
	c.touch(dst, 0)
	c.tip[dst] = t
	for n := t; n != c.root; n = n.parent {
		n.holders.add(dst)
		if dst >= c.firstPool && n.owner < c.firstPool {
			c.reown(n, dst)
		}
	}
}

// Owned is how many cells are attributed to seq.
func (c *cellTree) Owned(seq int) int { return c.owned[seq] }

// Exclusive counts the cells only seq holds at positions >= from: what seq_rm(seq,
// from, -1) would free. They are always a suffix of seq's path.
func (c *cellTree) Exclusive(seq, from int) int {
	n := 0
	for x := c.tip[seq]; x != nil && x != c.root && x.end() > from; x = x.parent {
		if !x.holders.only(seq) {
			break
		}
		n += x.end() - max(x.start, from)
	}
	return n
}

// holdersBelow is every sequence that holds some cell of seq's below position p1.
func (c *cellTree) holdersBelow(seq, p1 int) seqSet {
	var set seqSet
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
func (c *cellTree) Shares(a, b, pos int) bool {
	na, nb := c.nodeAt(a, pos), c.nodeAt(b, pos)
	return na != nil && na == nb
}

// nodeAt is the run on seq's path that holds position pos, or nil.
func (c *cellTree) nodeAt(seq, pos int) *cellNode {
	for n := c.tip[seq]; n != nil && n != c.root; n = n.parent {
		if n.start <= pos && pos < n.end() {
			return n
		}
	}
	return nil
}

// Joint counts the cells on seq's path that only members of set hold: what removing
// every member of set would free of seq's cells.
func (c *cellTree) Joint(seq int, set seqSet) int {
	n := 0
	for x := c.tip[seq]; x != nil && x != c.root; x = x.parent {
		if x.holders.subsetOf(set) {
			n += len(x.toks)
		}
	}
	return n
}

// Freed counts the cells that removing every sequence in set would free, except those
// keep holds below keepTo (cells a placement is about to copy from keep).
func (c *cellTree) Freed(set seqSet, keep, keepTo int) int {
	var protect *cellNode
	if keepTo > 0 {
		for n := c.tip[keep]; n != nil && n != c.root; n = n.parent {
			if n.start < keepTo {
				protect = n
				break
			}
		}
	}
	protected := map[*cellNode]bool{}
	for n := protect; n != nil && n != c.root; n = n.parent {
		protected[n] = true
	}
	total := 0
	var walk func(n *cellNode)
	walk = func(n *cellNode) {
		for _, ch := range n.children {
			if ch.holders.subsetOf(set) {
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
func (c *cellTree) Longest(prompt []Token, limit int) (int, *cellNode) {
	best, bestNode := 0, (*cellNode)(nil)
	c.below(c.root, prompt, limit, &best, &bestNode)
	return best, bestNode
}

// below extends a match that covers all of n into n's children (Longest's walk).
func (c *cellTree) below(n *cellNode, prompt []Token, limit int, best *int, bestNode **cellNode) {
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
func (c *cellTree) LongestFrom(seq, at int, prompt []Token, limit int) (int, *cellNode) {
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
