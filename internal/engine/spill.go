package engine

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
)

// Sequences below the cache (issue 40). Pools always had a tier (tier.go); here every
// other holder of cells gets one too: an idle session or a finished anonymous sequence
// kept as prefix cache whose cells are taken (for cells or for its sequence id) spills
// them first, and a later request whose prompt continues them loads them back instead
// of prefilling. Nothing is keyed by who held the cells: what is stored is content,
// segments of a sequence's cells at chunk-aligned positions [k·C, min((k+1)·C, L)),
// each the KV of those positions computed after the whole prefix before them (the KV
// of a position depends on nothing else). So twelve agents that share a system prompt
// store its chunks once, and a request finds whatever a session, a cached request or
// an earlier turn of its own left, by its prompt alone.
//
// The scheduler only decides; the index of what the tier holds is the KV-cache manager's
// (kvcache.Below), kept by what the scheduler plans and what the tier reports (TierChanged).
// OpSave copies one segment out before the OpSeqRm that drops its cells; OpLoad asks the
// driver to load a run of segments into a sequence that holds the positions below the
// run's start, and the driver answers with Loaded (how far it got). The store's own
// checks (key over the model and every token of the prefix, checksum) make a wrong load
// impossible; a segment the store no longer has is a miss, forgotten here, and the
// rest of the prompt is prefilled. An entry of the fleet's level may outlive its file
// (other replicas report nothing): that costs one miss, never a wrong token.
//
// On a model with recurrent state a segment cannot start anywhere: the state is one
// value at a sequence's end. Such a sequence spills as one whole segment from the pool
// boundary it borrowed (0 without a pool) to its end, with its state, and loads back
// only whole, onto a sequence holding exactly that boundary (the Config.Recurrent rule
// for pools).

// DefaultTierChunk is the tokens per stored segment when Config.TierChunk is 0.
const DefaultTierChunk = 256

// SpillKind is what a spilled holder of cells was (metrics labels).
type SpillKind uint8

// Spill kinds.
const (
	SpillPool    SpillKind = iota // a pool's own cells (OpSpill)
	SpillSession                  // an idle session's sequence
	SpillCached                   // a finished anonymous sequence kept as prefix cache
)

func (k SpillKind) String() string {
	switch k {
	case SpillSession:
		return "session"
	case SpillCached:
		return "cached"
	}
	return "pool"
}

// Segment is one stored run of a sequence's cells (kvcache.Segment: the index of what
// lives below the cells is the KV-cache manager's).
type Segment = kvcache.Segment

// Loaded is the driver's answer to an OpLoad (message): sequence Seq of task Task now
// holds positions [0, N) (N == the op's P0 when nothing loaded). Missed is the index in
// the op's Segs of the segment the store could not give (absent, corrupt, refused):
// forgotten by the index; -1 when every segment it tried loaded or the load stopped
// for another reason (no room: nothing is wrong with the entries).
type Loaded struct {
	Task   TaskID
	Seq    int
	N      int
	Missed int
}

func (Loaded) isMsg() {}

// Found tells the scheduler of segments the tier holds that its index may not know
// (issue 44): entries another replica wrote to a shared level, or this one before a
// restart. The engine sends it before a request whose prompt they continue (Engine.
// SetTierLookup: the lookup runs on the submitting goroutine, never the engine's), so
// the ordinary OpLoad path restores them. Whole segments (recurrent state) are not
// looked up this way.
//
// It is also the driver's answer to an OpLookup (Task and Seq set): the task, seated
// and waiting for it (statusLookup), then plans its load from what the index holds.
type Found struct {
	Segs []Segment
	Task TaskID
	Seq  int
}

func (Found) isMsg() {}

// found adds segments the tier holds to the index, as if this scheduler had stored them
// (where: Fleet). A shorter entry of the index that one covers is forgotten by the
// index only: its store entry stays for the store's own LRU (it is valid, and may be
// another replica's to keep). An OpLookup's answer then lets its task go on: it plans
// its load from the index, now knowing what the lookup found.
func (s *Scheduler) found(m Found) {
	if below := s.kv.Below(); s.cfg.Tier && below != nil && !s.cfg.Recurrent {
		for _, g := range m.Segs {
			if g.Whole || g.Start < 0 || g.Start >= g.End() || g.Start%below.Chunk() != 0 {
				continue
			}
			key := kvcache.KeyOf(g)
			if own := g.Tokens[g.Start:]; below.Find(key, own, false) == nil {
				below.Add(key, slices.Clone(own), false, false, kvcache.Fleet)
				s.tierStats.Found++
			}
		}
	}
	if t := s.tasks[m.Task]; t != nil && t.status == statusLookup && t.slot.seq == m.Seq {
		s.setStatus(t, statusPrefilling)
		s.planLoad(t, t.slot)
	}
}

// lookUp plans, when t is seated on sl after a wait in the queue, asking the fleet's
// level again what it holds of t's prompt (OpLookup; Config.TierFleet): the Found
// answer plans t's load (found). Other replicas report nothing of what they write, and
// the lookup at submission was made before the wait: without this, the chunks another
// replica wrote through while t waited were prefilled (measured behind llm-d's router:
// teammates queued behind a cold burst prefilled a team prompt another replica had
// written tens of seconds earlier). One lookup per seat, off the engine goroutine: no
// request polls the tier while it waits. It reports whether the lookup was planned.
func (s *Scheduler) lookUp(t *task, sl *slot) bool {
	if !s.cfg.Tier || !s.cfg.TierFleet || s.kv.Below() == nil || s.cfg.Recurrent || !s.now.After(t.queued) {
		return false
	}
	s.setStatus(t, statusLookup)
	s.ops = append(s.ops, SeqOp{Kind: OpLookup, Seq: sl.seq, P0: len(sl.tokens), Tokens: t.req.Prompt, Task: t.id})
	return true
}

// TierChanged is the tier's report of entries that landed in this replica's tier (RAM
// or --pool-dir: Stored) or left it (its LRU dropped them, or they were superseded), in
// the order they happened (Engine.TierChanged collects them from the store). The index
// of what lives below the cells follows it (kvcache.Below): an entry the tier dropped is
// no longer offered to a load. Before it, the store dropped entries without telling
// and the index guessed, by a bound of its own, what to forget.
type TierChanged struct{ Changes []TierChange }

// TierChange is one entry stored or dropped.
type TierChange struct {
	Seg    Segment
	Stored bool
}

func (TierChanged) isMsg() {}

// tierChanged applies a TierChanged, in order.
func (s *Scheduler) tierChanged(m TierChanged) {
	below := s.kv.Below()
	if below == nil {
		return
	}
	for _, c := range m.Changes {
		if c.Stored {
			below.Stored(c.Seg)
			continue
		}
		below.Dropped(c.Seg)
		s.tierStats.Dropped++
	}
}

// writeThrough plans saving the chunks of t's prompt that its sequence holds and the
// index lacks, when t ends (Config.TierWriteThrough: a fleet's shared level gets every
// prefix a replica computed, not only what its cache evicts). Its cells stay where they
// are; the saves only copy them out, before any operation that drops them. The
// prompt's last chunk is saved as it ends (named by the prompt itself), so another
// replica serving the same prompt finds all of it by the prompt alone; a pool's
// prefix that the sequence shares is saved too (it is content like any other).
func (s *Scheduler) writeThrough(t *task, sl *slot) {
	if !s.cfg.Tier || !s.cfg.TierWriteThrough || s.kv.Below() == nil || s.cfg.Recurrent || t.kind != kindGenerate {
		return
	}
	n := pool.CommonPrefix(sl.tokens, t.req.Prompt)
	toks := slices.Clone(t.req.Prompt[:n])
	c := s.cfg.tierChunk()
	h := kvcache.HashSeed
	for k := 0; k < n; k += c {
		e := min(k+c, n)
		key := kvcache.BelowKey{Start: k, H: h}
		if s.kv.Below().Find(key, toks[k:e], false) == nil {
			for _, o := range s.kv.Below().Add(key, toks[k:e], false, false, kvcache.Planned) {
				s.ops = append(s.ops, SeqOp{Kind: OpDrop, Seq: sl.seq, P0: k, P1: k + len(o.Toks), Tokens: append(slices.Clone(toks[:k]), o.Toks...)})
			}
			s.ops = append(s.ops, SeqOp{Kind: OpSave, Seq: sl.seq, P0: k, P1: e, Tokens: toks[:e], Spill: spillKindOf(sl)})
			s.spillCount(spillKindOf(sl), e-k)
		}
		h = kvcache.HashTokens(h, toks[k:e])
	}
}

// tierChunk is the configured segment size.
func (c Config) tierChunk() int {
	if c.TierChunk > 0 {
		return c.TierChunk
	}
	return DefaultTierChunk
}

// spillKindOf is what sl is as a victim.
func spillKindOf(sl *slot) SpillKind {
	if sl.session != "" {
		return SpillSession
	}
	return SpillCached
}

// spillSeq plans saving what sl holds from position from on, before those cells are
// dropped (its tail under cell pressure, or all of it when its sequence id is taken).
// Segments the index already has are not saved again. A pool's prefix that sl borrows
// is the pool's own tier entry's, not sl's. On a recurrent model sl goes whole (it
// cannot be cut back) and is saved as one segment with its state.
func (s *Scheduler) spillSeq(sl *slot, from int, kind SpillKind) {
	if !s.cfg.Tier || s.kv.Below() == nil || len(sl.tokens) == 0 {
		return
	}
	toks := slices.Clone(sl.tokens) // ops keep prefixes of it; sl.tokens changes
	s.park(sl, toks)
	L := len(toks)
	base := max(from, sl.shared)
	if base >= L {
		return
	}
	if s.cfg.Recurrent {
		start := sl.shared // the pool boundary whose state the session extended, or 0
		k := kvcache.BelowKey{Start: start, H: kvcache.HashTokens(kvcache.HashSeed, toks[:start])}
		if s.kv.Below().Find(k, toks[start:], true) == nil {
			s.kv.Below().Add(k, toks[start:], true, true, kvcache.Planned)
			s.ops = append(s.ops, SeqOp{Kind: OpSave, Seq: sl.seq, P0: start, P1: L, Tokens: toks, Whole: true, Spill: kind})
			s.spillCount(kind, L-start)
		}
		return
	}
	c := s.cfg.tierChunk()
	k := base / c * c
	h := kvcache.HashTokens(kvcache.HashSeed, toks[:k])
	for k < L {
		e := min(k+c, L)
		key := kvcache.BelowKey{Start: k, H: h}
		if s.kv.Below().Find(key, toks[k:e], false) == nil {
			for _, o := range s.kv.Below().Add(key, toks[k:e], false, e == L, kvcache.Planned) {
				s.ops = append(s.ops, SeqOp{Kind: OpDrop, Seq: sl.seq, P0: k, P1: k + len(o.Toks), Tokens: append(slices.Clone(toks[:k]), o.Toks...)})
			}
			s.ops = append(s.ops, SeqOp{Kind: OpSave, Seq: sl.seq, P0: k, P1: e, Tokens: toks[:e], Spill: kind})
			s.spillCount(kind, e-k)
		} else if e == L {
			if en := s.kv.Below().Find(key, toks[k:e], false); en != nil && len(en.Toks) == e-k {
				en.Tail = true
			}
		}
		h = kvcache.HashTokens(h, toks[k:e])
		k = e
	}
}

// spillCount counts a planned segment save.
func (s *Scheduler) spillCount(kind SpillKind, n int) {
	s.tierStats.Saves[kind]++
	s.tierStats.SavedTokens[kind] += int64(n)
}

// planLoad, right after t was seated on sl, plans loading whatever the tier holds of
// t's prompt beyond what sl holds now, up to the last prompt token (decoded for its
// logits). t then waits (statusLoading) for the Loaded answer before any of its prompt is
// prefilled. Nothing is planned when the run is shorter than a worthwhile load.
//
// Room: the cells the load writes are t's own prompt's, which admission reserved
// (reservedPrefill) and Plan keeps from the batch (loadPending). Beyond them a load needs,
// only while it runs (before the batch), the cells of its first segment below what sl
// holds and of its last beyond what t uses: a segment goes whole into the scratch
// sequence and only what sl lacks is shared from there; the rest is free again when
// the load ends. The loads of a plan run in order, each after the cells of those before
// it are written.
func (s *Scheduler) planLoad(t *task, sl *slot) {
	if !s.cfg.Tier || s.kv.Below() == nil || t.kind != kindGenerate {
		return
	}
	h := len(sl.tokens)
	segs, to := s.kv.Below().Lookup(t.req.Prompt, h, len(t.req.Prompt)-1, s.cfg.Recurrent)
	if to-h < minLoad {
		return
	}
	s.setStatus(t, statusLoading)
	t.loadTo, t.loadSegs = to, segs // counted by loadPending from here
	want := s.loadPending() + s.tierPending() + h - segs[0].Start + segs[len(segs)-1].End() - to
	if s.kv.Room(0) < want && s.freeCells(want, nil, 0, kvcache.GraceHolds) < want {
		s.setStatus(t, statusPrefilling)
		t.loadTo, t.loadSegs = 0, nil
		return
	}
	s.ops = append(s.ops, SeqOp{Kind: OpLoad, Seq: sl.seq, P0: h, P1: to, Segs: segs, Task: t.id, Spill: spillKindOf(sl)})
}

// prefetch plans reading what t will load from disk into memory while t waits for a
// sequence (OpPrefetch: the driver reads off the engine goroutine; entries already in
// memory cost a lookup), so its load, once seated, reads memory.
func (s *Scheduler) prefetch(t *task) {
	if s.kv.Below() == nil || t.kind != kindGenerate {
		return
	}
	s.prefetchTokens(t.req.Prompt, len(t.req.Prompt)-1, t.id)
}

// prefetchTokens plans an OpPrefetch of the stored segments that continue what the
// cache holds of toks, up to limit, when they are worth a load.
func (s *Scheduler) prefetchTokens(toks []Token, limit int, task TaskID) {
	h, _ := s.kv.Longest(toks, limit)
	if segs, to := s.kv.Below().Lookup(toks, h, limit, s.cfg.Recurrent); to-h >= minLoad {
		s.ops = append(s.ops, SeqOp{Kind: OpPrefetch, Seq: -1, Segs: segs, Task: task})
	}
}

// prefetchLead is how long before a parked session's expected turn its segments are
// read up from disk: about what reading a long context's segments takes, so that the
// turn, when it comes, loads from memory; a turn that comes earlier prefetches anyway
// when it is queued.
const prefetchLead = 2 * time.Second

// park notes, when sl's cells go to the tier, what its session held and when its next
// turn is expected (from evidence about it alone, as nextUse: a hint, a tool call, its
// own gap), for prefetchExpected. Anonymous sequences have no next turn to expect.
func (s *Scheduler) park(sl *slot, toks []Token) {
	g := s.gaps.sessions[sl.session]
	if sl.session == "" || g == nil || sl.task != nil {
		return
	}
	exp := sl.expect
	if gap := s.turnGap(sl); exp.IsZero() && gap > 0 {
		exp = sl.lastUsed.Add(gap)
	}
	g.parked, g.expect, g.fetched = toks, exp, false
}

// prefetchExpected plans, once per parking, reading a parked session's segments from
// disk into memory when its expected turn is less than prefetchLead away (issue 40:
// prefetch when a session's turn is expected, not only once its request is queued).
// Sessions in id order: the plan must not depend on map order.
func (s *Scheduler) prefetchExpected() {
	if s.kv.Below() == nil {
		return
	}
	for _, id := range slices.Sorted(maps.Keys(s.gaps.sessions)) {
		g := s.gaps.sessions[id]
		if g.parked == nil || g.fetched || g.expect.IsZero() || g.expect.Sub(s.now) > prefetchLead {
			continue
		}
		g.fetched = true
		s.prefetchTokens(g.parked, len(g.parked), 0)
	}
}

// neverFits refuses, at once, a request that needs more new cells than the cache could
// give it even once every running request ended and everything evictable went: the
// cells of user-pinned pools (and of the ancestors their cells extend) stay, and
// without a tier nothing pages them out (issue 40: a request that can never fit fails
// at once, saying why, instead of waiting out the queue timeout). With a tier every
// pool pages, and a prompt shorter than the context always fits eventually.
func (s *Scheduler) neverFits(need int) error {
	if s.kv.PinPaging() {
		return nil
	}
	var others kvcache.SeqSet
	keep := map[int]bool{}
	for _, p := range s.pools.All() {
		if p.UserPinned && p.State == pool.Resident {
			for a := p; a != nil; a = a.Parent {
				keep[a.Seq] = true
			}
		}
	}
	if len(keep) == 0 {
		return nil
	}
	for q := range s.cfg.Parallel + s.cfg.MaxPools {
		if !keep[q] {
			others.Add(q)
		}
	}
	pinned := s.kv.Used() - s.kv.FreedBy(others, -1, 0)
	if need <= s.cfg.NCtx-pinned {
		return nil
	}
	return fmt.Errorf("%w: it needs %d new cells; pinned pools hold %d of the cache's %d (unpin one, or give the server a tier below the cache: --pool-ram-mb)", ErrNeverFits, need, pinned, s.cfg.NCtx)
}

// minLoad is the shortest run worth a load: below it the one step a load waits for its
// answer costs more than prefilling the tokens.
const minLoad = 16

// loadPending is the cells the loads planned and not yet answered will write.
func (s *Scheduler) loadPending() int {
	n := 0
	for _, t := range s.running {
		if t.loading(false) {
			n += t.loadTo - len(t.slot.tokens)
		}
	}
	return n
}

// loadWaiting reports whether task t still waits on seq for the answer to its OpLoad
// (a late asynchronous read for a task that ended must not load into a sequence that
// may now be someone else's).
func (s *Scheduler) loadWaiting(task TaskID, seq int) bool {
	t := s.tasks[task]
	return t != nil && t.loading(false) && t.slot.seq == seq
}

// loaded applies the driver's answer to an OpLoad (message Loaded): the positions it
// loaded join the sequence (as a prefill's would), a segment it could not load leaves
// the index, and the task's prompt is prefilled from where the load stopped.
func (s *Scheduler) loaded(m Loaded) {
	if !s.loadWaiting(m.Task, m.Seq) {
		return // cancelled before the answer came: nothing was loaded for it
	}
	t := s.tasks[m.Task]
	sl := t.slot
	s.setStatus(t, statusPrefilling)
	if m.N < len(sl.tokens) {
		// The load failed after it had to let go of what the sequence held (a recurrent
		// state cannot be cut back): the sequence holds [0, N) only.
		s.truncate(sl, m.N)
	}
	h := len(sl.tokens)
	n := min(max(m.N, h), t.loadTo)
	if n > h {
		s.kv.Allocate(sl.seq, t.req.Prompt[h:n])
		sl.tokens = append(sl.tokens, t.req.Prompt[h:n]...)
		t.restoredN += n - h
		s.tierStats.Loads[spillKindOf(sl)]++
		s.tierStats.LoadedTokens[spillKindOf(sl)] += int64(n - h)
	}
	if m.Missed >= 0 && m.Missed < len(t.loadSegs) {
		s.kv.Below().Forget(t.loadSegs[m.Missed])
		s.tierStats.Misses++
	}
	t.loadSegs = nil
}

// continuation classifies a new request at submission for the queue's order (issue 40,
// program-aware order): whether it continues a conversation the server has seen (a
// known session, or a prompt that extends what an idle sequence holds or a stored
// conversation ended with) and how much context that conversation has accumulated
// (its attained service: the tokens of the prompt already computed once).
func (s *Scheduler) continuation(t *task) (cont bool, attained, seq int) {
	prompt := t.req.Prompt
	seq = -1
	if id := t.req.SessionID; id != "" {
		_, bound := s.bySession[id]
		cont = bound || s.adm.Known(id)
		if g := s.gaps.sessions[id]; g != nil {
			attained = g.served
		}
	}
	for _, sl := range s.slots {
		own := sl.session != "" && sl.session == t.req.SessionID
		if len(sl.tokens) == 0 || (sl.task != nil && !own) {
			continue
		}
		m := pool.CommonPrefix(sl.tokens, prompt)
		covers := m >= 64 && m >= len(sl.tokens)-kvcache.ContinuationSlack(len(sl.tokens))
		cont = cont || covers
		if covers || own {
			attained = max(attained, m)
		}
		if covers && sl.session == "" && sl.task == nil && (seq < 0 || len(sl.tokens) > len(s.slots[seq].tokens)) {
			seq = sl.seq // the idle anonymous sequence it continues
		}
	}
	if s.cfg.Tier && s.kv.Below() != nil {
		if m := s.kv.Below().TailMatch(prompt); m >= 64 {
			cont = true
			attained = max(attained, m)
		}
	}
	return cont, attained, seq
}

// TierStats counts the sequence tier's work (issue 40), by SpillKind: segments planned
// to be saved and their tokens, loads answered and the tokens they brought back, and
// segments a load missed (forgotten by the index), segments found in the tier that
// another replica stored (Found). Index* is the index's size now.
type TierStats struct {
	Saves, SavedTokens  [3]int64
	Loads, LoadedTokens [3]int64
	Misses              int64
	// Found: segments the tier reported (Found) that the index did not know.
	Found int64
	// Dropped: entries the tier reported it dropped (TierChanged).
	Dropped       int64
	IndexSegments int
	IndexTokens   int
}

// TierStats copies the counters (tests, Usage).
func (s *Scheduler) TierStats() TierStats {
	st := s.tierStats
	st.IndexSegments, st.IndexTokens = s.kv.Below().Size()
	return st
}
