package engine

import "fmt"

// ngram-mod (--spec-type ngram-mod): llama.cpp's common_ngram_mod. One hashed table of
// n-gram → next token, shared by every session (what one agent wrote drafts for
// another), fed with each session's context.

// SpecNgramMod is ngram-mod's --spec-type, as llama-server names it.
const SpecNgramMod = "ngram-mod"

// DefaultModN is Spec.ModN's default (llama.cpp's n_match).
const DefaultModN = 24

// modSize is the table (entries of 4 bytes): llama.cpp uses 4M entries; one million
// suffice for the 25% occupancy at which the table is reset.
const modSize = 1 << 20

// ngramModDrafter is the drafter: the table all its sessions share.
type ngramModDrafter struct{ mod *ngramMod }

func newNgramModDrafter(sp Spec) Drafter { return &ngramModDrafter{mod: newNgramMod(sp.ModN)} }

// ngramModDefaults fills Spec.ModN.
func ngramModDefaults(sp *Spec) {
	if sp.ModN == 0 {
		sp.ModN = DefaultModN
	}
}

// ngramModCheck validates it.
func ngramModCheck(sp Spec) error {
	if sp.ModN < 1 {
		return fmt.Errorf("ngram-mod length must be positive, got %d", sp.ModN)
	}
	return nil
}

// NewSession implements Drafter.
func (d *ngramModDrafter) NewSession() DraftSession { return &modSession{m: d.mod, gen: d.mod.gen} }

// modSession is a session's progress feeding its context to the table and its streak of
// poor proposals.
type modSession struct {
	m *ngramMod
	// fed: the context's n-grams added so far, while the table's generation is gen (a
	// reset empties the table for every session: each feeds its whole context again).
	fed, gen int
	low      int
}

// Propose implements DraftSession: the n-grams of ctx not added yet are added, then the
// table's chain of lookups from ctx's end followed by next.
func (s *modSession) Propose(ctx []Token, next Token, k int, _ bool) []Token {
	s.feed(ctx)
	return s.m.draft(ctx, next, k)
}

// Verified implements DraftSession. As llama.cpp's ngram-mod: a session whose proposals
// keep failing (under a quarter accepted, five times running) resets the shared table,
// which has filled with n-grams that no longer predict anything.
func (s *modSession) Verified(k, a int) {
	if 4*a >= k {
		s.low = 0
		return
	}
	if s.low++; s.low >= 5 {
		s.m.reset()
		s.low = 0
	}
}

// EndStep implements DraftSession.
func (s *modSession) EndStep() {}

// feed adds the n-grams of ctx it has not added yet (the whole prompt on the first call:
// its pool's tokens too), and resets the table past a quarter full as llama.cpp does
// (collisions would make most proposals wrong).
func (s *modSession) feed(ctx []Token) {
	m := s.m
	if s.gen != m.gen {
		s.fed, s.gen = 0, m.gen
	}
	for ; s.fed+m.n < len(ctx); s.fed++ {
		m.add(ctx[s.fed : s.fed+m.n+1])
	}
	if 4*m.used > len(m.entries) {
		m.reset()
		s.fed, s.gen = 0, m.gen
	}
}

// ngramMod is llama.cpp's common_ngram_mod: a fixed table indexed by a hash of n
// tokens, holding the token that last followed them (collisions overwrite).
type ngramMod struct {
	n       int
	entries []Token
	used    int
	gen     int // resets so far (modSession.fed counts within one)
}

func newNgramMod(n int) *ngramMod {
	m := &ngramMod{n: n, entries: make([]Token, modSize)}
	m.reset()
	m.gen = 0
	return m
}

func (m *ngramMod) reset() {
	for i := range m.entries {
		m.entries[i] = NotDrawn
	}
	m.used = 0
	m.gen++
}

// idx hashes n tokens as llama.cpp does.
func (m *ngramMod) idx(toks []Token) int {
	var h uint64
	for _, t := range toks[:m.n] {
		h = h*6364136223846793005 + uint64(int64(t))
	}
	return int(h % uint64(len(m.entries)))
}

// add records that toks[n] followed toks[:n].
func (m *ngramMod) add(toks []Token) {
	i := m.idx(toks)
	if m.entries[i] == NotDrawn {
		m.used++
	}
	m.entries[i] = toks[m.n]
}

// draft chains lookups from the last n tokens of ctx+last, up to k tokens.
func (m *ngramMod) draft(ctx []Token, last Token, k int) []Token {
	if len(ctx)+1 < m.n {
		return nil
	}
	win := make([]Token, 0, m.n+k)
	win = append(win, ctx[len(ctx)-(m.n-1):]...)
	win = append(win, last)
	for range k {
		tok := m.entries[m.idx(win[len(win)-m.n:])]
		if tok == NotDrawn {
			break
		}
		win = append(win, tok)
	}
	return win[m.n:]
}
