package kvcache

import (
	"slices"

	"github.com/polykv/polykv/internal/pool"
)

// Below is the index of the KV that lives below the cells (issue 55: one index for KV
// wherever it lives): the segments of sequences' cells the tier holds, by content, each
// with where it lives (Where). The Manager owns it beside the cell tree, so one owner
// answers, for a prompt, how much of it is in cells and how much below (Residency).
// The tier keeps the bytes (its levels, by key); this is the only index that finds them
// by a prompt. It learns what the tier holds from three sources, in the order they
// happen: the scheduler's plan (Planned: a save it asked for), the tier's own reports
// (Stored and Dropped: an entry landed in, or left, this replica's RAM and --pool-dir,
// including what the store's LRU drops, which it used to do without telling), and
// lookups of the tier by prompt (Fleet: what another replica, or this one before a
// restart, wrote). A load that misses forgets the entry (Forget): an entry may still
// be stale (the fleet's level is not reported), which costs one miss, never a wrong
// token (the store checks the key over every token of the prefix and a checksum).
//
// A segment covers a sequence's positions [k·C, min((k+1)·C, L)) (C the chunk), each
// the KV of those positions computed after the whole prefix before them, named by that
// prefix: so agents that share a system prompt store its chunks once, and a request
// finds whatever a session, a cached request or an earlier turn left, by its prompt
// alone. On a model with recurrent state a segment is Whole: one value of state at its
// end, stored and loaded only whole.
type Below struct {
	chunk    int
	limit    int
	entries  map[BelowKey][]*BelowEntry
	order    []belowRef // insertion order, for the limit (entries already gone are skipped)
	segments int
	tokens   int
}

// Segment is one stored run of a sequence's cells: positions [Start, len(Tokens))
// computed after Tokens[:Start]. Tokens is the whole prefix, which is what names the
// entry in the store. Whole: the entry also holds the recurrent state at its end and
// loads only whole.
type Segment struct {
	Start  int
	Tokens []Token
	Whole  bool
}

// End is one past the segment's last position.
func (g Segment) End() int { return len(g.Tokens) }

// Where is where an entry's KV lives, as far as the index knows (a set).
type Where uint8

// Where an entry lives.
const (
	// Planned: the scheduler planned its save; the tier has not reported it yet.
	Planned Where = 1 << iota
	// Local: this replica's tier (RAM or --pool-dir) reported it stored.
	Local
	// Fleet: a lookup found it on the fleet's shared level.
	Fleet
)

// BelowKey finds entries: the position a segment starts at and a hash of every token
// before it, so entries are found by content, whoever stored them.
type BelowKey struct {
	Start int
	H     uint64
}

// KeyOf is the key of a segment.
func KeyOf(g Segment) BelowKey { return BelowKey{g.Start, HashTokens(HashSeed, g.Tokens[:g.Start])} }

// BelowEntry is one entry: the tokens of a stored segment's own positions.
type BelowEntry struct {
	Toks  []Token
	Whole bool
	// Tail: the segment ended the sequence it was spilled from (the conversation's
	// end then), which is how a later prompt is recognised as its continuation.
	Tail  bool
	Where Where
}

// belowRef names one entry in insertion order.
type belowRef struct {
	k BelowKey
	e *BelowEntry
}

// DefaultBelowTokens bounds the index when its limit is 0.
const DefaultBelowTokens = 1 << 22

// NewBelow makes an empty index of chunk-token segments holding at most limit tokens
// (0: DefaultBelowTokens). The tier's reports keep it to what this replica's tier
// holds; the limit bounds what they cannot (entries found on the fleet's level, which
// other replicas drop without telling): past it the oldest entries are forgotten (a
// load not tried, never a wrong one).
func NewBelow(chunk, limit int) *Below {
	if limit <= 0 {
		limit = DefaultBelowTokens
	}
	return &Below{chunk: chunk, limit: limit, entries: map[BelowKey][]*BelowEntry{}}
}

// Chunk is the tokens per segment.
func (x *Below) Chunk() int { return x.chunk }

// Size is the entries and their tokens.
func (x *Below) Size() (segments, tokens int) {
	if x == nil {
		return 0, 0
	}
	return x.segments, x.tokens
}

// HashSeed is the hash of the empty prefix; HashTokens extends h over toks.
var HashSeed = pool.HashExtend(0, nil)

// HashTokens extends the prefix hash h over toks.
func HashTokens(h uint64, toks []Token) uint64 { return pool.HashExtend(h, toks) }

// Find is the entry at k whose tokens equal toks (whole) or begin with them (a longer
// entry covers a shorter one's content).
func (x *Below) Find(k BelowKey, toks []Token, whole bool) *BelowEntry {
	for _, e := range x.entries[k] {
		if e.Whole != whole {
			continue
		}
		if (whole && slices.Equal(e.Toks, toks)) || (!whole && len(e.Toks) >= len(toks) && slices.Equal(e.Toks[:len(toks)], toks)) {
			return e
		}
	}
	return nil
}

// Add records a segment the tier holds or will hold, where; entries it covers (shorter
// ones whose tokens begin its own) are dropped from the index and returned, so their
// store entries can be dropped too.
func (x *Below) Add(k BelowKey, toks []Token, whole, tail bool, where Where) (dropped []*BelowEntry) {
	e := &BelowEntry{Toks: toks, Whole: whole, Tail: tail, Where: where}
	list := x.entries[k]
	if !whole {
		list = slices.DeleteFunc(list, func(o *BelowEntry) bool {
			if !o.Whole && len(o.Toks) < len(toks) && slices.Equal(o.Toks, toks[:len(o.Toks)]) {
				dropped = append(dropped, o)
				return true
			}
			return false
		})
	}
	x.entries[k] = append(list, e)
	x.segments += 1 - len(dropped)
	x.tokens += len(toks)
	for _, o := range dropped {
		x.tokens -= len(o.Toks)
	}
	x.order = append(x.order, belowRef{k, e})
	for x.tokens > x.limit && len(x.order) > 0 {
		old := x.order[0]
		x.order = x.order[1:]
		x.unindex(old.k, func(o *BelowEntry) bool { return o == old.e })
	}
	if len(x.order) > 2*x.segments+64 {
		x.order = slices.DeleteFunc(x.order, func(r belowRef) bool { return !slices.Contains(x.entries[r.k], r.e) })
	}
	return dropped
}

// unindex drops the entries at k that match.
func (x *Below) unindex(k BelowKey, match func(*BelowEntry) bool) {
	list := x.entries[k]
	n := len(list)
	list = slices.DeleteFunc(list, func(e *BelowEntry) bool {
		if match(e) {
			x.tokens -= len(e.Toks)
			return true
		}
		return false
	})
	x.segments -= n - len(list)
	if len(list) == 0 {
		delete(x.entries, k)
	} else {
		x.entries[k] = list
	}
}

// Forget removes a segment the store could not give.
func (x *Below) Forget(g Segment) {
	own := g.Tokens[g.Start:]
	x.unindex(KeyOf(g), func(e *BelowEntry) bool { return e.Whole == g.Whole && slices.Equal(e.Toks, own) })
}

// Stored applies the tier's report that this replica's tier holds segment g now (it
// landed in RAM or on --pool-dir): the entry the scheduler planned is marked Local.
// A report of an entry the index lacks adds nothing: the store reports every entry it
// holds, pools' among them, whose payloads are not segments.
func (x *Below) Stored(g Segment) {
	if g.Whole || g.Start < 0 || g.Start >= g.End() {
		return
	}
	own := g.Tokens[g.Start:]
	for _, e := range x.entries[KeyOf(g)] {
		if !e.Whole && slices.Equal(e.Toks, own) {
			e.Where = e.Where&^Planned | Local
		}
	}
}

// Dropped applies the tier's report that segment g left this replica's tier (its LRU
// dropped it, or it was superseded): the entry is forgotten unless the fleet's level
// holds it too.
func (x *Below) Dropped(g Segment) {
	own := g.Tokens[g.Start:]
	x.unindex(KeyOf(g), func(e *BelowEntry) bool {
		if e.Whole || !slices.Equal(e.Toks, own) {
			return false
		}
		e.Where &^= Local | Planned
		return e.Where == 0
	})
}

// Lookup is the longest run of stored segments that continues prompt from position
// from (the sequence holds [0, from)) up to at most limit: the segments, in order, and
// the position the run reaches (from when nothing is stored). The first segment may
// start below from (chunks are aligned; the driver loads it whole into a scratch
// sequence and takes only what the sequence lacks) and the last may match the prompt
// only in part. recurrent: only a whole segment starting exactly at from, matching all
// of its tokens.
func (x *Below) Lookup(prompt []Token, from, limit int, recurrent bool) ([]Segment, int) {
	if x == nil || len(x.entries) == 0 || from >= limit {
		return nil, from
	}
	if recurrent {
		k := BelowKey{from, HashTokens(HashSeed, prompt[:from])}
		var best *BelowEntry
		for _, e := range x.entries[k] {
			if e.Whole && from+len(e.Toks) <= limit && slices.Equal(e.Toks, prompt[from:from+len(e.Toks)]) && (best == nil || len(e.Toks) > len(best.Toks)) {
				best = e
			}
		}
		if best == nil {
			return nil, from
		}
		return []Segment{{Start: from, Tokens: prompt[:from+len(best.Toks)], Whole: true}}, from + len(best.Toks)
	}
	c := x.chunk
	k := from / c * c
	h := HashTokens(HashSeed, prompt[:k])
	pos := from
	var segs []Segment
	for k < limit {
		var best *BelowEntry
		bestM := 0
		for _, e := range x.entries[BelowKey{k, h}] {
			if e.Whole {
				continue
			}
			if m := pool.CommonPrefix(e.Toks, prompt[k:limit]); m > bestM {
				best, bestM = e, m
			}
		}
		if best == nil || k+bestM <= pos {
			break
		}
		g := Segment{Start: k, Tokens: prompt[:k+bestM]}
		if bestM < len(best.Toks) {
			// Only a part matches: the entry's name is its own tokens, not the prompt's.
			g.Tokens = append(slices.Clone(prompt[:k]), best.Toks...)
		}
		segs = append(segs, g)
		pos = k + bestM
		if bestM < c {
			break
		}
		h = HashTokens(h, prompt[k:k+c])
		k += c
	}
	return segs, pos
}

// TailMatch reports how much of prompt a stored conversation's end covers: the longest
// run of stored segments from position 0 that passes through an entry that ended its
// sequence, up to that entry's end (0 when none): a prompt that continues it is that
// conversation's next turn.
func (x *Below) TailMatch(prompt []Token) int {
	if x == nil || len(x.entries) == 0 {
		return 0
	}
	c := x.chunk
	h := HashSeed
	best := 0
	for k := 0; k < len(prompt); k += c {
		var full *BelowEntry
		for _, e := range x.entries[BelowKey{k, h}] {
			if e.Whole {
				if e.Tail && k+len(e.Toks) <= len(prompt) && slices.Equal(e.Toks, prompt[k:k+len(e.Toks)]) {
					best = max(best, k+len(e.Toks))
				}
				continue
			}
			m := pool.CommonPrefix(e.Toks, prompt[k:])
			if e.Tail && m >= len(e.Toks)-ContinuationSlack(k+len(e.Toks)) {
				best = max(best, k+m)
			}
			if m == c {
				full = e
			}
		}
		if full == nil || k+c > len(prompt) {
			break
		}
		h = HashTokens(h, prompt[k:k+c])
	}
	return best
}

// ContinuationSlack is how many of a conversation's last tokens a next turn's prompt
// may differ in and still continue it: a chat template renders the previous reply
// again from its text, which need not tokenize as the model generated it.
func ContinuationSlack(n int) int { return max(64, n/8) }

// Residency is where a prompt's KV lives, from position 0 on: Cells, the longest
// prefix a sequence holds (Longest); then, continuing it, the tokens the index's
// segments cover in this replica's tier (Local, with what is planned) and on the
// fleet's level (Fleet, the rest of the run).
type Residency struct {
	Cells, Local, Fleet int
}

// Residency answers, for prompt up to limit, how much of it is in cells and how much
// below them, by where (one owner for the whole answer: issue 55).
func (kv *Manager) Residency(prompt []Token, limit int) Residency {
	h, _ := kv.Longest(prompt, limit)
	r := Residency{Cells: h}
	segs, to := kv.below.Lookup(prompt, h, limit, false)
	pos := h
	for i, g := range segs {
		end := g.End()
		if i == len(segs)-1 {
			end = to
		}
		n := max(0, end-max(pos, g.Start))
		if e := kv.below.Find(KeyOf(g), g.Tokens[g.Start:min(end, g.End())], false); e != nil && e.Where&(Local|Planned) != 0 {
			r.Local += n
		} else {
			r.Fleet += n
		}
		pos = max(pos, end)
	}
	return r
}

// Below is the index of what lives below the cells (nil: no tier).
func (kv *Manager) Below() *Below { return kv.below }
