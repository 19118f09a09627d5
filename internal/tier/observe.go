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

// SetObserver makes o learn of every entry stored or removed from now on, and of the
// entries found on disk at Open: a goroutine of its own reads each found file's head
// (header and tokens, not its KV) and reports the entry, so that a restarted replica's
// routers learn what its --pool-dir holds at startup rather than when each entry is
// next stored. A file whose head does not check (another model, torn, not named by its
// own key) is not reported; a load would find it a miss anyway.
func (s *Store) SetObserver(o Observer) { s.setObserver(o, true) }

// SetChangeObserver makes o learn of every entry stored or removed from now on, but not
// of the entries found on disk at Open (no file's head is read for it): for an observer
// that only follows what changes (the scheduler's index of what lives below the cells,
// which knows nothing the store holds from before).
func (s *Store) SetChangeObserver(o Observer) { s.setObserver(o, false) }

func (s *Store) setObserver(o Observer, announce bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.obs = o
	s.held = map[Key]Meta{}
	if !announce {
		return
	}
	c := s.dsk.Caps()
	if c.List == nil || c.Head == nil {
		return // a disk level that cannot list or read heads: entries are reported as stored
	}
	if found := c.List.Keys(); len(found) > 0 && s.jobs != nil {
		s.bg.Add(1)
		go s.announceFound(c.Head, found)
	}
}

// announceFound reports the entries found on disk at Open that are still there, until
// the store closes.
func (s *Store) announceFound(head HeadReader, found []Key) {
	defer s.bg.Done()
	for _, k := range found {
		m, err := head.Head(k)
		s.mu.Lock()
		if s.jobs == nil { // closed
			s.mu.Unlock()
			return
		}
		if err == nil && s.dsk.Has(k) {
			s.noteStored(k, m)
		}
		s.mu.Unlock()
	}
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
