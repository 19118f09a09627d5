package tier

import "time"

// Segments (issue 40): besides pools' own cells the store keeps segments of sessions'
// and cached sequences' cells, spilled when the cache needs their cells or their
// sequence ids. A segment is an ordinary entry (Meta{D: its first position, Tokens:
// the whole prefix up to its end}): named by content, so one stored by any sequence is
// found by any prompt that continues the same tokens, and checked like every entry.
// They live in the same RAM and disk budgets, least recently used first out, and a
// pinned pool's entry is kept there whatever the budget (a pin means never lost).

// Kinds of holder whose KV the store keeps (Stats.Kinds, metrics labels).
const (
	KindPool    = "pool"
	KindSession = "session"
	KindCached  = "cached"
)

// KindStats is the store's work for one kind of holder: entries put (Spills, or found
// there already) and their bytes, restores and the bytes and time they took, misses.
type KindStats struct {
	Spills, SpillBytes     int64
	Restores, RestoreBytes int64
	RestoreSeconds         float64
	Misses                 int64
}

func (s *Store) kind(k string) *KindStats {
	ks := s.kinds[k]
	if ks == nil {
		ks = &KindStats{}
		s.kinds[k] = ks
	}
	return ks
}

// PutSegment stores a segment of kind's cells (payload nil: it is stored already, only
// its use is noted) and returns where it went (None: dropped, nothing fits).
func (s *Store) PutSegment(kind string, m Meta, payload []byte) Location {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.putLocked(k, kind, m, payload)
}

// PutKept stores a user-pinned pool's KV paged out of the cache (issue 40): like Put, but
// the entry is never dropped by LRU, and without a disk tier to take it RAM keeps it
// beyond its budget.
func (s *Store) PutKept(pool int, m Meta, payload []byte) Location {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byPool[pool] = k
	s.kept[k] = true
	loc := s.putLocked(k, KindPool, m, payload)
	if loc == None && payload != nil {
		s.stats.Dropped-- // not dropped after all: kept in RAM over the budget
		_ = s.mem.Put(k, m, payload)
		s.noteStored(k, m)
		loc = RAM
	}
	return loc
}

// Drop removes an entry that is superseded (a longer segment holds its content), unless
// it is kept.
func (s *Store) Drop(m Meta) {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.kept[k] {
		return
	}
	s.mem.Delete(k)
	s.dropDisk(k)
}

// Promote reads an entry found only on disk into RAM when the RAM budget has room for
// it (a prefetch ahead of a load: the load then reads memory). It reports whether the
// entry is in memory now.
func (s *Store) Promote(m Meta) bool {
	if !s.OnDiskOnly(m) {
		return s.Has(m)
	}
	payload, _, err := s.Get(m)
	if err != nil {
		return false
	}
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	defer s.mu.Unlock()
	size := int64(len(payload))
	if s.mem.Has(k) || s.pending[k] != nil || size > s.cfg.RAMBytes {
		return s.mem.Has(k) || s.pending[k] != nil
	}
	for s.ramBytes()+size > s.cfg.RAMBytes && s.demoteLRU() {
	}
	if s.ramBytes()+size > s.cfg.RAMBytes {
		return false
	}
	_ = s.mem.Put(k, m, payload)
	s.noteStored(k, m)
	s.stats.Prefetches++
	return true
}

// MissKind counts a segment of kind's that could not be used (absent, corrupt,
// refused), logged once per reason.
func (s *Store) MissKind(kind string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := Reason(err)
	s.stats.Misses[r]++
	s.kind(kind).Misses++
	s.logOnce("KV segment not restored from the tier; prefilling it instead", "kind", kind, "reason", r, "err", err)
}

// GetTimed is Get with the time the read took.
func (s *Store) GetTimed(m Meta) ([]byte, Location, time.Duration, error) {
	t0 := time.Now()
	b, loc, err := s.Get(m)
	return b, loc, time.Since(t0), err
}
