package engine

import "slices"

// Residency reports (issue 27): what every sequence holds, as changes to a per-sequence
// token list, so that a router outside the process (KV events for llm-d's precise-prefix
// scorer) can learn every prefix a new request could reuse here. With the prefix cache on
// that is every resident cell: a request without a pool or a known session starts from
// the longest prefix any sequence holds (sessions, cached anonymous sequences, running
// tasks, pools). With it off only pools are reused by other requests (by pool_id or
// pool_key), so only announced pools (resident, fully built, not released) are reported.
//
// The cell tree tells the lowest position each sequence changed at since the last report
// (touch, its watcher); Observations turns the touched sequences into one ObsSeqChange each. A
// decoding sequence so reports one token per step, which the observer batches into
// blocks; nothing is reported for sequences nobody touched.

// ResidencyObserver is told how each sequence's content changes. Like PrefixObserver it
// is called on the engine goroutine and must not block.
type ResidencyObserver interface {
	SeqChanged(c SeqChange)
}

// SeqChange says that sequence Seq now holds the first Keep tokens it was last reported
// to hold, followed by Tokens (which the observer owns). Keep 0 with no Tokens: the
// sequence holds nothing (freed, evicted, or no longer reusable by other requests).
type SeqChange struct {
	Seq    int
	Keep   int
	Tokens []Token
}

// seqWatch is the reporting state; the cell tree calls its touch on every mutation
// (kvcache.Tree.Watch), so every change is seen.
type seqWatch struct {
	dirty    map[int]int // seq → lowest position changed since the last report
	reported map[int]int // seq → tokens last reported
}

// ReportResidency turns on ObsSeqChange observations (off by default: the bookkeeping
// is for a KV-event publisher). Call it before the first step.
func (s *Scheduler) ReportResidency() {
	s.watch = &seqWatch{dirty: map[int]int{}, reported: map[int]int{}}
	s.kv.Cells().Watch(s.watch.touch)
}

// touch notes that seq changed from position pos on: the cell tree's watcher
// (kvcache.Tree.Watch), called for every change of a sequence's cells.
func (w *seqWatch) touch(seq, pos int) {
	if d, ok := w.dirty[seq]; !ok || pos < d {
		w.dirty[seq] = pos
	}
}

// reportable says whether seq's cells are reused by other requests (see Residency).
func (s *Scheduler) reportable(seq int) bool {
	if s.cfg.PrefixCache {
		return true
	}
	// Evicted and released pools may keep a sequence id another pool now uses: the
	// sequence is reportable when any pool on it is announced.
	for _, p := range s.pools.All() {
		if p.Seq == seq && prefixAnnounced(p) {
			return true
		}
	}
	return false
}

// residencyObs appends one ObsSeqChange per sequence that changed since the last call,
// in sequence order (a replayed run reports the same).
func (s *Scheduler) residencyObs() {
	w := s.watch
	if w == nil || len(w.dirty) == 0 {
		return
	}
	seqs := make([]int, 0, len(w.dirty))
	for q := range w.dirty {
		seqs = append(seqs, q)
	}
	slices.Sort(seqs)
	for _, q := range seqs {
		n := 0
		if s.reportable(q) {
			n = s.kv.Cells().Len(q)
		}
		old := w.reported[q]
		keep := min(w.dirty[q], old, n)
		delete(w.dirty, q)
		if keep == old && n == old {
			continue
		}
		if n == 0 {
			delete(w.reported, q)
		} else {
			w.reported[q] = n
		}
		s.obs = append(s.obs, Observation{Kind: ObsSeqChange, Seq: SeqChange{Seq: q, Keep: keep, Tokens: s.kv.Cells().TokensIn(q, keep, n)}})
	}
}
