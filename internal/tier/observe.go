package tier

// Observer learns which entries this replica's own levels (RAM, --pool-dir) hold: the
// KV-event publisher announces them to the router with a tier medium (issue 44), so a
// replica holding a prefix in its tier scores for it, below one holding it in cells.
// An entry is reported stored once when it first lands in RAM or on disk (a move
// between the two is no change) and removed once when it has left both. The shared
// level is not reported: other replicas remove its files without telling, so what this
// replica would announce of it could be stale. Called with the store's lock held: it
// must not block or call the store.
type Observer interface {
	TierChanged(d int, tokens []int32, stored bool)
}

// SetObserver makes o learn of every entry stored or removed from now on (entries held
// already, found on disk at Open, are reported when they are next stored or removed).
func (s *Store) SetObserver(o Observer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.obs = o
	s.held = map[Key]Meta{}
}

// noteStored reports k's entry (m) held, unless it was already.
func (s *Store) noteStored(k Key, m Meta) {
	if s.obs == nil {
		return
	}
	if _, ok := s.held[k]; ok {
		return
	}
	s.held[k] = m
	s.obs.TierChanged(m.D, m.Tokens, true)
}

// noteGone reports k's entry removed when it has left every level of this replica.
func (s *Store) noteGone(k Key) {
	m, ok := s.held[k]
	if !ok || s.mem.Has(k) || s.pending[k] != nil || s.dsk.Has(k) {
		return
	}
	delete(s.held, k)
	s.obs.TierChanged(m.D, m.Tokens, false)
}
