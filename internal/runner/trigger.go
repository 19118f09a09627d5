package runner

import (
	"regexp/syntax"
	"unicode/utf8"
)

// triggerMatcher decides, as the output grows piece by piece, whether the whole output
// so far matches a trigger pattern (std::regex_match's full match, as llama.cpp checks
// its lazy grammar triggers) and where its first non-empty capture group starts. It is
// a Pike VM over regexp/syntax's program, fed only the new text: a token costs time in
// proportion to its own length, where running Go's regexp over the whole output after
// every token is quadratic (13 to 17 s of CPU for one 40 KB reply, measured) and
// llama.cpp's std::regex recurses per character until the stack overflows. Threads
// follow the program's priority order, so the captures are regexp's leftmost-first
// ones.
type triggerMatcher struct {
	prog    *syntax.Prog
	ncap    int
	threads []thread // live threads at the end of the text, highest priority first
	pos     int      // bytes consumed
	partial []byte   // an incomplete UTF-8 sequence at the end of the text
}

type thread struct {
	pc  uint32
	cap []int
}

// newTriggerMatcher compiles pattern; ok is false when it does not compile or uses an
// empty-width assertion (^, $, \b: they need the character after a position, which a
// growing text does not have yet).
func newTriggerMatcher(pattern string) (*triggerMatcher, bool) {
	re, err := syntax.Parse(pattern, syntax.Perl)
	if err != nil {
		return nil, false
	}
	prog, err := syntax.Compile(re.Simplify())
	if err != nil {
		return nil, false
	}
	for _, inst := range prog.Inst {
		if inst.Op == syntax.InstEmptyWidth {
			return nil, false
		}
	}
	m := &triggerMatcher{prog: prog, ncap: 2 * (re.MaxCap() + 1)}
	caps := make([]int, m.ncap)
	for i := range caps {
		caps[i] = -1
	}
	caps[0] = 0
	seen := map[uint32]bool{}
	m.threads = m.closure(nil, uint32(prog.Start), 0, caps, seen)
	return m, true
}

// closure adds the threads reachable from pc without reading text, in priority order.
func (m *triggerMatcher) closure(list []thread, pc uint32, pos int, caps []int, seen map[uint32]bool) []thread {
	if seen[pc] {
		return list
	}
	seen[pc] = true
	inst := &m.prog.Inst[pc]
	switch inst.Op {
	case syntax.InstAlt, syntax.InstAltMatch:
		list = m.closure(list, inst.Out, pos, caps, seen)
		return m.closure(list, inst.Arg, pos, caps, seen)
	case syntax.InstCapture:
		if int(inst.Arg) < len(caps) {
			c := append([]int(nil), caps...)
			c[inst.Arg] = pos
			return m.closure(list, inst.Out, pos, c, seen)
		}
		return m.closure(list, inst.Out, pos, caps, seen)
	case syntax.InstNop:
		return m.closure(list, inst.Out, pos, caps, seen)
	case syntax.InstFail:
		return list
	}
	return append(list, thread{pc: pc, cap: caps}) // a rune instruction or Match
}

// push reads more of the text. It returns the start of the first non-empty capture
// group (or 0 when there is none) when the whole text read matches, else -1.
func (m *triggerMatcher) push(b []byte) int {
	buf := append(m.partial, b...)
	i := 0
	for i < len(buf) && len(m.threads) > 0 {
		if !utf8.FullRune(buf[i:]) {
			break
		}
		r, w := utf8.DecodeRune(buf[i:])
		next := m.threads[:0:0]
		seen := map[uint32]bool{}
		for _, t := range m.threads {
			inst := &m.prog.Inst[t.pc]
			var ok bool
			switch inst.Op {
			case syntax.InstRune:
				ok = inst.MatchRune(r)
			case syntax.InstRune1:
				ok = r == inst.Rune[0]
			case syntax.InstRuneAny:
				ok = true
			case syntax.InstRuneAnyNotNL:
				ok = r != '\n'
			}
			if ok {
				next = m.closure(next, inst.Out, m.pos+w, t.cap, seen)
			}
		}
		m.threads = next
		m.pos += w
		i += w
	}
	if len(m.threads) == 0 {
		m.partial = nil
		return -1 // no way to a match any more
	}
	m.partial = append(m.partial[:0:0], buf[i:]...)
	if len(m.partial) > 0 {
		return -1 // the text ends inside a character
	}
	for _, t := range m.threads {
		if m.prog.Inst[t.pc].Op != syntax.InstMatch {
			continue
		}
		for g := 2; g+1 < len(t.cap); g += 2 {
			if t.cap[g] >= 0 && t.cap[g+1] > t.cap[g] {
				return t.cap[g]
			}
		}
		return 0
	}
	return -1
}
