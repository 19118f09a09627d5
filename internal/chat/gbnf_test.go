package chat

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// A GBNF reader, recognizer and generator for tests: the fuzz targets check the
// schema compiler's grammars without a model, so they need to run a grammar in Go.
// llama.cpp's grammar engine needs a loaded vocabulary, and no maintained Go module
// parses GBNF; this one covers the syntax llama.cpp documents (grammars/README.md):
// rules on one line each, literals, character classes, groups, alternation and the
// repetition operators *, +, ?, {m}, {m,}, {m,n}. Escapes are the ones llama.cpp's
// parser knows, so a grammar using any other (\a, \b, \f, \v) is an error here too.

type gAlt []gSeq

type gSeq []gItem

type gItem struct {
	atom     gAtom
	min, max int // max < 0: unbounded
}

type gAtomKind int

const (
	gLit gAtomKind = iota
	gClass
	gRef
	gGroup
)

type gAtom struct {
	kind   gAtomKind
	lit    []rune
	ranges [][2]rune
	neg    bool
	rule   string
	group  gAlt
}

type grammar struct {
	rules map[string]gAlt
}

// parseGBNF reads a grammar and checks that every referenced rule is defined and a
// root exists.
func parseGBNF(src string) (*grammar, error) {
	g := &grammar{rules: map[string]gAlt{}}
	var refs []string
	for n, line := range strings.Split(src, "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		name, body, ok := strings.Cut(line, " ::= ")
		if !ok {
			return nil, fmt.Errorf("line %d: no ::= in %q", n+1, line)
		}
		if name == "" || strings.Trim(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-") != "" {
			return nil, fmt.Errorf("line %d: bad rule name %q", n+1, name)
		}
		if _, dup := g.rules[name]; dup {
			return nil, fmt.Errorf("rule %q defined twice", name)
		}
		p := &gbnfParser{s: []rune(body)}
		alt, err := p.alt()
		if err != nil {
			return nil, fmt.Errorf("rule %s: %w", name, err)
		}
		if p.i < len(p.s) {
			return nil, fmt.Errorf("rule %s: unexpected %q at %d", name, string(p.s[p.i:]), p.i)
		}
		g.rules[name] = alt
		refs = append(refs, p.refs...)
	}
	if _, ok := g.rules["root"]; !ok {
		return nil, fmt.Errorf("no root rule")
	}
	for _, r := range refs {
		if _, ok := g.rules[r]; !ok {
			return nil, fmt.Errorf("rule %q is used but not defined", r)
		}
	}
	return g, nil
}

type gbnfParser struct {
	s    []rune
	i    int
	refs []string
}

func (p *gbnfParser) ws() {
	for p.i < len(p.s) && (p.s[p.i] == ' ' || p.s[p.i] == '\t') {
		p.i++
	}
}

func (p *gbnfParser) alt() (gAlt, error) {
	var a gAlt
	for {
		s, err := p.seq()
		if err != nil {
			return nil, err
		}
		a = append(a, s)
		p.ws()
		if p.i < len(p.s) && p.s[p.i] == '|' {
			p.i++
			continue
		}
		return a, nil
	}
}

func (p *gbnfParser) seq() (gSeq, error) {
	var s gSeq
	for {
		p.ws()
		if p.i >= len(p.s) || p.s[p.i] == '|' || p.s[p.i] == ')' {
			return s, nil
		}
		at, err := p.atom()
		if err != nil {
			return nil, err
		}
		it := gItem{atom: at, min: 1, max: 1}
		if p.i < len(p.s) {
			switch p.s[p.i] {
			case '*':
				it.min, it.max = 0, -1
				p.i++
			case '+':
				it.min, it.max = 1, -1
				p.i++
			case '?':
				it.min, it.max = 0, 1
				p.i++
			case '{':
				end := slices.Index(p.s[p.i:], '}')
				if end < 0 {
					return nil, fmt.Errorf("unclosed {")
				}
				spec := string(p.s[p.i+1 : p.i+end])
				p.i += end + 1
				lo, hi, comma := strings.Cut(spec, ",")
				var err error
				if it.min, err = strconv.Atoi(strings.TrimSpace(lo)); err != nil {
					return nil, fmt.Errorf("bad repetition {%s}", spec)
				}
				switch {
				case !comma:
					it.max = it.min
				case strings.TrimSpace(hi) == "":
					it.max = -1
				default:
					if it.max, err = strconv.Atoi(strings.TrimSpace(hi)); err != nil || it.max < it.min {
						return nil, fmt.Errorf("bad repetition {%s}", spec)
					}
				}
			}
		}
		s = append(s, it)
	}
}

func (p *gbnfParser) atom() (gAtom, error) {
	c := p.s[p.i]
	switch {
	case c == '"':
		p.i++
		var lit []rune
		for {
			if p.i >= len(p.s) {
				return gAtom{}, fmt.Errorf("unterminated literal")
			}
			if p.s[p.i] == '"' {
				p.i++
				return gAtom{kind: gLit, lit: lit}, nil
			}
			r, err := p.char()
			if err != nil {
				return gAtom{}, err
			}
			lit = append(lit, r)
		}
	case c == '[':
		p.i++
		a := gAtom{kind: gClass}
		if p.i < len(p.s) && p.s[p.i] == '^' {
			a.neg = true
			p.i++
		}
		for {
			if p.i >= len(p.s) {
				return gAtom{}, fmt.Errorf("unterminated class")
			}
			if p.s[p.i] == ']' {
				p.i++
				return a, nil
			}
			lo, err := p.char()
			if err != nil {
				return gAtom{}, err
			}
			hi := lo
			if p.i+1 < len(p.s) && p.s[p.i] == '-' && p.s[p.i+1] != ']' {
				p.i++
				if hi, err = p.char(); err != nil {
					return gAtom{}, err
				}
			}
			a.ranges = append(a.ranges, [2]rune{lo, hi})
		}
	case c == '(':
		p.i++
		alt, err := p.alt()
		if err != nil {
			return gAtom{}, err
		}
		if p.i >= len(p.s) || p.s[p.i] != ')' {
			return gAtom{}, fmt.Errorf("unclosed (")
		}
		p.i++
		return gAtom{kind: gGroup, group: alt}, nil
	case c == '-' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9':
		start := p.i
		for p.i < len(p.s) && (p.s[p.i] == '-' || p.s[p.i] >= 'a' && p.s[p.i] <= 'z' || p.s[p.i] >= 'A' && p.s[p.i] <= 'Z' || p.s[p.i] >= '0' && p.s[p.i] <= '9') {
			p.i++
		}
		name := string(p.s[start:p.i])
		p.refs = append(p.refs, name)
		return gAtom{kind: gRef, rule: name}, nil
	}
	return gAtom{}, fmt.Errorf("unexpected %q at %d", c, p.i)
}

// char reads one (possibly escaped) character of a literal or class.
func (p *gbnfParser) char() (rune, error) {
	c := p.s[p.i]
	p.i++
	if c != '\\' {
		return c, nil
	}
	if p.i >= len(p.s) {
		return 0, fmt.Errorf("dangling backslash")
	}
	e := p.s[p.i]
	p.i++
	hex := func(n int) (rune, error) {
		if p.i+n > len(p.s) {
			return 0, fmt.Errorf("short \\%c escape", e)
		}
		v, err := strconv.ParseUint(string(p.s[p.i:p.i+n]), 16, 32)
		if err != nil {
			return 0, fmt.Errorf("bad \\%c escape", e)
		}
		p.i += n
		return rune(v), nil
	}
	switch e {
	case 'x':
		return hex(2)
	case 'u':
		return hex(4)
	case 'U':
		return hex(8)
	case 't':
		return '\t', nil
	case 'r':
		return '\r', nil
	case 'n':
		return '\n', nil
	case '\\', '"', '[', ']':
		return e, nil
	}
	return 0, fmt.Errorf("escape \\%c is not one llama.cpp's GBNF parser knows", e)
}

// accepts reports whether the root rule matches the whole of s.
func (g *grammar) accepts(s string) bool {
	r := &recognizer{g: g, in: []rune(s), memo: map[recKey][]int{}, busy: map[recKey]bool{}}
	return slices.Contains(r.rule("root", 0), len(r.in))
}

type recKey struct {
	rule string
	pos  int
}

// recognizer computes, for an expression and a start position, every position where a
// match can end (memoized per rule and position), so ambiguity costs no backtracking.
type recognizer struct {
	g    *grammar
	in   []rune
	memo map[recKey][]int
	busy map[recKey]bool
}

func (r *recognizer) rule(name string, pos int) []int {
	k := recKey{name, pos}
	if v, ok := r.memo[k]; ok {
		return v
	}
	if r.busy[k] {
		return nil // left recursion: the compiler never emits it
	}
	r.busy[k] = true
	v := r.alt(r.g.rules[name], pos)
	delete(r.busy, k)
	r.memo[k] = v
	return v
}

func (r *recognizer) alt(a gAlt, pos int) []int {
	var out []int
	for _, s := range a {
		out = union(out, r.seq(s, pos))
	}
	return out
}

func (r *recognizer) seq(s gSeq, pos int) []int {
	cur := []int{pos}
	for _, it := range s {
		var next []int
		for _, p := range cur {
			next = union(next, r.item(it, p))
		}
		if cur = next; len(cur) == 0 {
			return nil
		}
	}
	return cur
}

func (r *recognizer) item(it gItem, pos int) []int {
	var out []int
	cur := []int{pos}
	if it.min == 0 {
		out = []int{pos}
	}
	seen := map[int]bool{pos: true}
	for k := 1; it.max < 0 || k <= it.max; k++ {
		var next []int
		for _, p := range cur {
			next = union(next, r.atom(it.atom, p))
		}
		if it.max < 0 && k >= it.min {
			// Unbounded: only positions not reached before can lead anywhere new.
			next = slices.DeleteFunc(next, func(p int) bool { return seen[p] })
			for _, p := range next {
				seen[p] = true
			}
		}
		if len(next) == 0 {
			break
		}
		if k >= it.min {
			out = union(out, next)
		}
		cur = next
	}
	return out
}

func (r *recognizer) atom(a gAtom, pos int) []int {
	switch a.kind {
	case gLit:
		if pos+len(a.lit) <= len(r.in) && slices.Equal(r.in[pos:pos+len(a.lit)], a.lit) {
			return []int{pos + len(a.lit)}
		}
	case gClass:
		if pos < len(r.in) && a.matches(r.in[pos]) {
			return []int{pos + 1}
		}
	case gRef:
		return r.rule(a.rule, pos)
	case gGroup:
		return r.alt(a.group, pos)
	}
	return nil
}

func (a gAtom) matches(c rune) bool {
	in := false
	for _, rg := range a.ranges {
		if c >= rg[0] && c <= rg[1] {
			in = true
			break
		}
	}
	return in != a.neg
}

func union(a, b []int) []int {
	for _, x := range b {
		if !slices.Contains(a, x) {
			a = append(a, x)
		}
	}
	return a
}

// byteSource hands out choices from fuzz input; when it runs dry every choice is 0,
// which the generators treat as "the shortest way out".
type byteSource struct {
	b []byte
}

func (s *byteSource) next() byte {
	if len(s.b) == 0 {
		return 0
	}
	c := s.b[0]
	s.b = s.b[1:]
	return c
}

func (s *byteSource) intn(n int) int {
	if n <= 1 {
		return 0
	}
	return int(s.next()) % n
}

// generate writes a random string the grammar derives, choices taken from src.
// Past a depth budget it takes each rule's cheapest alternative, so it terminates.
func (g *grammar) generate(src *byteSource, budget int) string {
	cost := g.costs()
	gen := &generator{g: g, src: src, cost: cost}
	var b strings.Builder
	gen.alt(&b, g.rules["root"], budget)
	return b.String()
}

type generator struct {
	g    *grammar
	src  *byteSource
	cost map[string]int
}

const costInf = 1 << 30

// costs: for each rule, the least depth of rule expansions needed to derive a string.
func (g *grammar) costs() map[string]int {
	c := map[string]int{}
	for n := range g.rules {
		c[n] = costInf
	}
	for changed := true; changed; {
		changed = false
		for n, a := range g.rules {
			if v := altCost(a, c) + 1; v < c[n] {
				c[n] = v
				changed = true
			}
		}
	}
	return c
}

func altCost(a gAlt, c map[string]int) int {
	best := costInf
	for _, s := range a {
		best = min(best, seqCost(s, c))
	}
	return best
}

func seqCost(s gSeq, c map[string]int) int {
	worst := 0
	for _, it := range s {
		if it.min == 0 {
			continue
		}
		worst = max(worst, atomCost(it.atom, c))
	}
	return worst
}

func atomCost(a gAtom, c map[string]int) int {
	switch a.kind {
	case gRef:
		return c[a.rule]
	case gGroup:
		return altCost(a.group, c)
	}
	return 0
}

func (gen *generator) alt(b *strings.Builder, a gAlt, budget int) {
	var pick gSeq
	if budget <= 0 {
		best := costInf
		for _, s := range a {
			if v := seqCost(s, gen.cost); v < best {
				best, pick = v, s
			}
		}
	} else {
		pick = a[gen.src.intn(len(a))]
		if seqCost(pick, gen.cost) >= costInf {
			pick = a[0]
		}
	}
	for _, it := range pick {
		n := it.min
		if budget > 0 {
			span := 3
			if it.max >= 0 {
				span = it.max - it.min
			}
			n += gen.src.intn(min(span, 3) + 1)
		}
		for range n {
			gen.atom(b, it.atom, budget)
		}
	}
}

// palette: characters tried, in turn, for a negated class.
var palette = []rune{'a', 'Z', '7', ' ', 'é', '中', '😀', '{', '-', '.', '"', '\\', '\n', 0x7f, 0x01}

func (gen *generator) atom(b *strings.Builder, a gAtom, budget int) {
	switch a.kind {
	case gLit:
		b.WriteString(string(a.lit))
	case gClass:
		if a.neg {
			start := gen.src.intn(len(palette))
			for i := range palette {
				if c := palette[(start+i)%len(palette)]; a.matches(c) {
					b.WriteRune(c)
					return
				}
			}
			panic("no palette character fits " + fmt.Sprint(a.ranges))
		}
		rg := a.ranges[gen.src.intn(len(a.ranges))]
		c := rg[0] + rune(gen.src.intn(int(rg[1]-rg[0])+1))
		if !utf8.ValidRune(c) {
			c = rg[0]
		}
		b.WriteRune(c)
	case gRef:
		gen.alt(b, gen.g.rules[a.rule], budget-1)
	case gGroup:
		gen.alt(b, a.group, budget)
	}
}
