package engine

import "fmt"

// ngram-simple (--spec-type ngram-simple): prompt lookup decoding. The end of the
// session's own context (its prompt, the tokens it borrows from its pool, what it
// generated) is looked up in that context, and what followed the longest, most recent
// match is proposed.

// SpecNgramSimple is ngram-simple's --spec-type, as llama-server names it.
const SpecNgramSimple = "ngram-simple"

// ngram-simple's defaults (Spec.NgramMin, Spec.NgramMax).
const (
	DefaultNgramMin = 3
	// DefaultNgramMax 64: a match is extended that far before the longest, most recent
	// one is taken. Text that repeats with a period (a model looping over a list of
	// JSON objects, a table, code with repeated blocks) holds the same 16-token run
	// several times per period with different continuations; a cap of 16 then takes
	// the most recent of them, often at the wrong phase, where a longer match finds the
	// previous period's same place. On the edit benchmark's reply (SmolLM2 loops with a
	// period of 82 tokens) replaying the scheduler's drafting over the recorded tokens
	// gave 74.9% of drafts accepted and 3.80 tokens per step at 16, 91.2% and 5.14 at
	// 32 or more; the other replies were unchanged (docs/speculative-log.md). The scan
	// stops at a match of this length, and costs the same where none is found.
	DefaultNgramMax = 64
)

// specProbeMatch is the shortest context match an ngram-simple probe drafts from
// (DraftSession.Propose's probe): on SmolLM2's chat at N = 8 probes from 3-token matches
// landed 19-60% of their drafts (docs/speculative-log.md), and a short match in prose (three
// tokens recurring) lands far less often than a long one in a quote.
const specProbeMatch = 8

// ngramSimple is the drafter: its options, and counters shared by its sessions.
type ngramSimple struct {
	minN, maxN int // Spec.NgramMin, Spec.NgramMax
	// lookups counts context scans (read by tests); noMemo (tests only) scans on every
	// ask, as before the memo, so a test can compare the plans.
	lookups int
	noMemo  bool
}

func newNgramSimple(sp Spec) Drafter { return &ngramSimple{minN: sp.NgramMin, maxN: sp.NgramMax} }

// ngramSimpleDefaults fills Spec.NgramMin and Spec.NgramMax.
func ngramSimpleDefaults(sp *Spec) {
	if sp.NgramMin == 0 {
		sp.NgramMin = DefaultNgramMin
	}
	if sp.NgramMax == 0 {
		sp.NgramMax = DefaultNgramMax
	}
}

// ngramSimpleCheck validates them.
func ngramSimpleCheck(sp Spec) error {
	if sp.NgramMin < 1 || sp.NgramMax < sp.NgramMin {
		return fmt.Errorf("n-gram lengths must satisfy 1 <= min <= max, got %d and %d", sp.NgramMin, sp.NgramMax)
	}
	return nil
}

// NewSession implements Drafter.
func (d *ngramSimple) NewSession() DraftSession { return &ngramSession{d: d} }

// ngramSession is a session's match in the current step, for the context it was found
// in (its length and next token): looked up once per step, though draftWants asks
// whether ngram-simple proposes before it asks a backend drafter and Plan asks again
// for the proposal to verify, with another minimum (a probe's) or k (the step's real
// room), which only ngramFrom uses. EndStep clears it.
type ngramSession struct {
	d         *ngramSimple
	ok        bool
	n         int
	next      Token
	best, end int
}

// Propose implements DraftSession: a match of at least NgramMin tokens (a probe's at
// least specProbeMatch), at most k tokens.
func (m *ngramSession) Propose(ctx []Token, next Token, k int, probe bool) []Token {
	minN := m.d.minN
	if probe {
		minN = min(max(minN, specProbeMatch), m.d.maxN)
	}
	if m.d.noMemo || !m.ok || m.n != len(ctx) || m.next != next {
		m.best, m.end = ngramMatch(ctx, next, m.d.maxN)
		m.ok, m.n, m.next = true, len(ctx), next
		m.d.lookups++
	}
	return ngramFrom(ctx, next, m.best, m.end, minN, k)
}

// Verified implements DraftSession (ngram-simple learns nothing from verifications).
func (m *ngramSession) Verified(int, int) {}

// EndStep implements DraftSession: the context moves on with the step.
func (m *ngramSession) EndStep() { m.ok = false }

// ngramMatch finds the longest suffix (up to maxN tokens) of ctx followed by last that
// occurs earlier in it, the most recent such occurrence: its length and where that
// occurrence ends. The scan over the context is ngram-simple's whole cost; neither
// minN nor k changes which match it finds (ngramFrom applies them), so one match
// serves every ask in a step (ngramSession).
func ngramMatch(ctx []Token, last Token, maxN int) (best, end int) {
	n := len(ctx) + 1
	at := func(i int) Token {
		if i == len(ctx) {
			return last
		}
		return ctx[i]
	}
	best, end = 0, -1
	// j is where an earlier occurrence of the suffix ends (it is followed by j+1).
	for j := n - 2; j >= 0 && best < maxN; j-- {
		if ctx[j] != last {
			continue
		}
		m := 1
		for m < maxN && j-m >= 0 && ctx[j-m] == at(n-1-m) {
			m++
		}
		if m > best {
			best, end = m, j
		}
	}
	return best, end
}

// ngramFrom is the proposal of a match found by ngramMatch: up to k tokens after the
// occurrence ending at end, or nil when the match is shorter than minN.
func ngramFrom(ctx []Token, last Token, best, end, minN, k int) []Token {
	if best < minN {
		return nil
	}
	out := make([]Token, 0, k)
	for i := end + 1; i < len(ctx)+1 && len(out) < k; i++ {
		if i == len(ctx) {
			out = append(out, last)
		} else {
			out = append(out, ctx[i])
		}
	}
	return out
}
