package chat

import (
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Grammar helpers for the families whose calls are not one JSON object in a wrapper:
// argument values as bare text (Qwen3-Coder / Qwen 3.5 XML, GLM 4.5+, MiniMax-M2,
// DeepSeek V3.2 DSML: xmlFamily with the form in each family's file), Harmony's
// recipient headers, LFM2's Python calls and Functionary v3.2's recipient lines (in
// their family files). Each grammar writes exactly what the family's
// parser (ParseWith, the ReplyStream) reads back as a call of a declared tool with
// arguments its schema accepts: a text value runs to its closing tag and contains none
// of the tags the parser cuts at, JSON strings inside these calls cannot hold the
// character that starts those tags, and a value whose text the parser could turn into
// something the schema rejects is not offered (xmlKindOf).

// safeName: tool and parameter names every one of these syntaxes can carry as written
// (OpenAI's own rule for function names, dots allowed).
var safeName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_.-]*$`)

// finishChars keeps c.ban out of the raw text of JSON strings: a string holding the
// start of a tag the family's parser cuts at would end the call there. ban is two
// different characters (a '<' then what follows it in every such tag) or one character
// repeated (">>>"). An escape (\u003c) still writes the text. Strings with maxLength
// count characters one by one, so there the ban's first character is not raw at all.
func (c *gbnf) finishChars() {
	if c.ban == "" {
		return
	}
	rs := []rune(c.ban)
	a := rs[0]
	ctl := `"\\\x7F\x00-\x1F`
	esc := `[\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})`
	plain := "[^" + ctl + classChar(a) + "]"
	if _, ok := c.rules["char"]; ok {
		c.rules["char"] = plain + " | " + esc
	}
	if _, ok := c.rules["string"]; !ok {
		return
	}
	A := q(string(a))
	var tail string
	if len(rs) == 2 && rs[1] != a {
		c.rules["schar"] = fmt.Sprintf(`%s | %s | %s+ ( [^%s%s%s] | %s )`, plain, esc, A, ctl, classChar(a), classChar(rs[1]), esc)
		tail = A + "*"
	} else {
		c.rules["schar"] = fmt.Sprintf(`%s | %s | %s{1,%d} ( %s | %s )`, plain, esc, A, len(rs)-1, plain, esc)
		tail = fmt.Sprintf("%s{0,%d}", A, len(rs)-1)
	}
	c.prim("space")
	c.rules["string"] = fmt.Sprintf(`"\"" schar* %s "\"" space`, tail)
}

// xmlForm is how one of the families that write argument values as tagged text
// writes a call (each family's file holds its form).
type xmlForm struct {
	word       string                // trigger, and the start of the grammar
	open       string                // rule body before the calls
	close      string                // rule body after them
	call       func(n string) string // a call's opening
	afterName  string                // between the opening and the first parameter
	callClose  string
	param      func(k string, str bool) string
	valueOpen  string // rule body between a parameter's key and its value
	valueEnd   string
	stops      []string // tags a text value must not contain: the parser cuts there
	strip      bool     // the parser strips one "\n" at each end of a value
	perCall    bool     // open ... close wraps each call, not the whole list
	attributes bool     // DSML: string="true|false" says how a value is read
}

// xmlFamily builds the grammar of a family whose values are tagged text (Qwen3-Coder
// XML, GLM, MiniMax, DeepSeek V3.2 DSML) from its form.
func (r *callRules) xmlFamily(fm xmlForm) ([]Trigger, bool, error) {
	if !r.safeNames() {
		return nil, false, nil
	}
	return r.setRoot(r.xmlRules(fm, r.tools, r.parallel))
}

// xmlRules: the call rules of an xmlForm family; it returns the root rule's body.
func (c *gbnf) xmlRules(fm xmlForm, tools []Tool, parallel bool) (string, []Trigger, bool, error) {
	c.ban = "</" // every tag these parsers cut at starts with "</"
	var calls []string
	for i, t := range tools {
		props, required, ok := topProperties(t)
		if !ok {
			return "", nil, false, nil
		}
		c.root, c.refNS = props.root, fmt.Sprintf("t%d-", i)
		var parts []string
		for _, k := range props.keys {
			if !safeName.MatchString(k) {
				return "", nil, false, nil
			}
			node := props.vals[k]
			name := fmt.Sprintf("t%d-p-%s", i, sanitize(k))
			// Compile the JSON form first: an unsupported keyword is the same error as
			// for every other family.
			js, err := c.visit(node, c.fresh(name+"-json"))
			if err != nil {
				return "", nil, false, fmt.Errorf("tool %q: %w", t.Function.Name, err)
			}
			kind := xmlKindOf(props.root, node)
			var value string
			str := true
			switch {
			case fm.attributes && (kind.kind == xmlNullable || kind.kind == xmlJSON || kind.kind == xmlNone):
				// DSML says in the tag that the value is JSON: any schema fits.
				value, str = fmt.Sprintf(`"\n"? %s %s`, js, q(fm.valueEnd)), false
			case kind.kind == xmlText || kind.kind == xmlNullable:
				value = c.textUntil(fm.valueEnd, fm.stops)
			case kind.kind == xmlEnum:
				var alts []string
				for _, lit := range kind.lits {
					if containsAny(lit, append([]string{fm.valueEnd}, fm.stops...)) {
						return "", nil, false, nil
					}
					if fm.strip && (strings.HasPrefix(lit, "\n") || strings.HasSuffix(lit, "\n")) {
						alts = append(alts, fmt.Sprintf(`"\n" %s "\n"`, q(lit)))
					} else if fm.strip {
						alts = append(alts, fmt.Sprintf(`"\n"? %s "\n"?`, q(lit)))
					} else {
						alts = append(alts, q(lit))
					}
				}
				value = "( " + strings.Join(alts, " | ") + " ) " + q(fm.valueEnd)
			case kind.kind == xmlBounded:
				// No '<': every tag the parser cuts at starts with it.
				value = fmt.Sprintf(`[^<]{0,%d} %s`, kind.max, q(fm.valueEnd))
			case kind.kind == xmlJSON:
				value = fmt.Sprintf(`%s%s %s`, map[bool]string{true: `"\n"? `, false: ""}[fm.strip], js, q(fm.valueEnd))
			default:
				return "", nil, false, nil // a text value the parser could misread
			}
			p := c.define(c.fresh(name), fmt.Sprintf(`%s %s %s "\n"?`, q(fm.param(k, str)), fm.valueOpen, value))
			if required[k] {
				parts = append(parts, p)
			} else {
				parts = append(parts, p+"?")
			}
		}
		body := fmt.Sprintf("%s %s", q(fm.call(t.Function.Name)), fm.afterName)
		if len(parts) > 0 {
			body += " " + strings.Join(parts, " ")
		}
		if fm.callClose != "" {
			body += " " + q(fm.callClose)
		}
		calls = append(calls, c.define(fmt.Sprintf("call-%d", i), body))
	}
	call := c.define("call", strings.Join(calls, " | "))
	var root string
	if fm.perCall {
		block := c.define("block", fmt.Sprintf(`%s %s %s`, fm.open, call, fm.close))
		root = block
		if parallel {
			root += ` ( "\n"? block )*`
		}
	} else {
		list := call
		if parallel {
			list += ` ( "\n"? call )*`
		}
		root = fmt.Sprintf(`%s %s %s`, fm.open, list, fm.close)
	}
	return root, []Trigger{{Word: fm.word}}, true, nil
}

// members is a comma-separated list of the required parts in order, then any subset
// of the optional ones in order (as objectBody does for JSON objects).
func (c *gbnf) members(req, opt []string, hint string) string {
	switch {
	case len(req) > 0:
		body := strings.Join(req, ` "," space `)
		for _, o := range opt {
			body += ` ( "," space ` + o + ` )?`
		}
		return body
	case len(opt) > 0:
		next := c.define(c.fresh(hint), opt[len(opt)-1])
		for i := len(opt) - 2; i >= 0; i-- {
			next = c.define(c.fresh(hint), fmt.Sprintf(`%s ( "," space %s )? | %s`, opt[i], next, next))
		}
		return "( " + next + " )?"
	}
	return ""
}

// objectArgs reports whether every tool's parameters are an object schema (the
// Harmony and Functionary parsers take only an object as arguments).
func objectArgs(tools []Tool) bool {
	for _, t := range tools {
		if _, _, ok := topProperties(t); !ok {
			return false
		}
	}
	return true
}

// toolProps is a tool's parameters: the top-level properties in schema order.
type toolProps struct {
	root any
	keys []string
	vals map[string]any
}

// topProperties reads a tool's parameters as an object with (possibly no) properties;
// ok is false for any other top-level shape.
func topProperties(t Tool) (toolProps, map[string]bool, bool) {
	raw := strings.TrimSpace(string(t.Function.Parameters))
	if raw == "" || raw == "null" {
		raw = `{"type": "object", "properties": {}}`
	}
	node, err := parseOrdered([]byte(raw))
	if err != nil {
		return toolProps{}, nil, false
	}
	o, ok := node.(*ordered)
	if !ok {
		return toolProps{}, nil, false
	}
	if ty, has := o.vals["type"]; has && ty != "object" {
		return toolProps{}, nil, false
	}
	for _, k := range []string{"$ref", "anyOf", "oneOf", "enum", "const"} {
		if _, has := o.vals[k]; has {
			return toolProps{}, nil, false
		}
	}
	tp := toolProps{root: node, vals: map[string]any{}}
	if p, has := o.vals["properties"]; has {
		props, ok := p.(*ordered)
		if !ok {
			return toolProps{}, nil, false
		}
		tp.keys, tp.vals = props.keys, props.vals
	} else if _, has := o.vals["type"]; !has && constrains(o) {
		return toolProps{}, nil, false
	}
	required := map[string]bool{}
	if r, has := o.vals["required"].([]any); has {
		for _, e := range r {
			s, ok := e.(string)
			if _, known := tp.vals[s]; !ok || !known {
				return toolProps{}, nil, false
			}
			required[s] = true
		}
	}
	return tp, required, true
}

// How a text-valued parameter is written, so that the parser's reading (argsBuilder.add
// with the type xmlParamType gives) is a value the schema accepts.
const (
	xmlNone     = iota // no text form is read back as a valid value
	xmlText            // any text: a string, or any value at all
	xmlNullable        // a string or null: any text ("null" reads as null)
	xmlEnum            // one of these strings, written as they are
	xmlBounded         // a string of at most max characters
	xmlJSON            // never a string: JSON, which the parser reads as JSON
)

type xmlKind struct {
	kind int
	lits []string
	max  int
}

// valueKeys are the keywords that constrain a value (anything else is annotation).
var valueKeys = []string{"type", "enum", "const", "anyOf", "oneOf", "$ref", "properties", "items", "maxLength", "minLength",
	"minItems", "maxItems", "additionalProperties", "required", "allOf", "not", "pattern", "format",
	"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}

func constrains(o *ordered, allowed ...string) bool {
	for _, k := range valueKeys {
		if _, has := o.vals[k]; has && !contains(allowed, k) {
			return true
		}
	}
	return false
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// plainString: {"type": "string"} with nothing else that constrains its value.
func plainString(node any) bool {
	o, ok := node.(*ordered)
	return ok && o.vals["type"] == "string" && !constrains(o, "type", "format") && minLengthZero(o)
}

func minLengthZero(o *ordered) bool {
	v, has := o.vals["minLength"]
	if !has {
		return true
	}
	n, ok := v.(json.Number)
	return ok && n.String() == "0"
}

// xmlKindOf classifies a parameter's schema (see the constants).
func xmlKindOf(root, node any) xmlKind {
	if b, ok := node.(bool); ok {
		if b {
			return xmlKind{kind: xmlText}
		}
		return xmlKind{}
	}
	o, ok := node.(*ordered)
	if !ok {
		return xmlKind{}
	}
	if _, has := o.vals["$ref"]; !has {
		if !constrains(o) {
			return xmlKind{kind: xmlText} // any value
		}
		if plainString(o) {
			return xmlKind{kind: xmlText}
		}
		if lits, ok := stringEnum(o); ok {
			return xmlKind{kind: xmlEnum, lits: lits}
		}
		if o.vals["type"] == "string" && !constrains(o, "type", "format", "maxLength", "minLength") && minLengthZero(o) {
			if n, ok := o.vals["maxLength"].(json.Number); ok {
				if m, err := strconv.Atoi(n.String()); err == nil && m >= 0 && m <= 4096 {
					return xmlKind{kind: xmlBounded, max: m}
				}
			}
		}
		if nullableString(o) {
			return xmlKind{kind: xmlNullable}
		}
	}
	if !mayBeString(root, node, 0) {
		return xmlKind{kind: xmlJSON}
	}
	return xmlKind{}
}

// stringEnum: an enum or const whose values are all strings (type absent or string).
func stringEnum(o *ordered) ([]string, bool) {
	if t, has := o.vals["type"]; has && t != "string" {
		return nil, false
	}
	if constrains(o, "type", "enum", "const", "format") {
		return nil, false
	}
	var vals []any
	if v, has := o.vals["const"]; has {
		vals = []any{v}
	} else if e, has := o.vals["enum"].([]any); has && len(e) > 0 {
		vals = e
	} else {
		return nil, false
	}
	var out []string
	for _, v := range vals {
		s, ok := v.(string)
		if !ok {
			return nil, false
		}
		out = append(out, s)
	}
	return out, true
}

// nullableString: a plain string or null (type ["string", "null"], or anyOf/oneOf of
// the two), Optional[str] as pydantic writes it.
func nullableString(o *ordered) bool {
	if ts, ok := o.vals["type"].([]any); ok && len(ts) == 2 && !constrains(o, "type", "format") {
		a, _ := ts[0].(string)
		b, _ := ts[1].(string)
		return a == "string" && b == "null" || a == "null" && b == "string"
	}
	for _, k := range []string{"anyOf", "oneOf"} {
		alts, ok := o.vals[k].([]any)
		if !ok || len(alts) != 2 || constrains(o, k) {
			continue
		}
		isNull := func(n any) bool {
			x, ok := n.(*ordered)
			return ok && x.vals["type"] == "null" && !constrains(x, "type")
		}
		return plainString(alts[0]) && isNull(alts[1]) || isNull(alts[0]) && plainString(alts[1])
	}
	return false
}

// mayBeString reports whether the schema accepts some JSON string (conservatively:
// true when unsure).
func mayBeString(root, node any, depth int) bool {
	if depth > 32 {
		return true
	}
	if b, ok := node.(bool); ok {
		return b
	}
	o, ok := node.(*ordered)
	if !ok {
		return true
	}
	if ref, ok := o.vals["$ref"].(string); ok {
		path, ok := strings.CutPrefix(ref, "#/")
		if !ok {
			return true
		}
		n := root
		for _, part := range strings.Split(path, "/") {
			x, ok := n.(*ordered)
			if !ok {
				return true
			}
			if n, ok = x.vals[part]; !ok {
				return true
			}
		}
		return mayBeString(root, n, depth+1)
	}
	if v, has := o.vals["const"]; has {
		_, s := v.(string)
		return s
	}
	if e, has := o.vals["enum"].([]any); has {
		for _, v := range e {
			if _, s := v.(string); s {
				return true
			}
		}
		return false
	}
	for _, k := range []string{"anyOf", "oneOf"} {
		if alts, has := o.vals[k].([]any); has {
			for _, a := range alts {
				if mayBeString(root, a, depth+1) {
					return true
				}
			}
			return false
		}
	}
	switch t := o.vals["type"].(type) {
	case string:
		return t == "string"
	case []any:
		for _, e := range t {
			if e == "string" {
				return true
			}
		}
		return false
	case nil:
		_, obj := o.vals["properties"]
		return !obj
	}
	return true
}

// xmlParamType is the type argsBuilder reads a text value of this parameter as.
func xmlParamType(root, node any) string {
	switch k := xmlKindOf(root, node); k.kind {
	case xmlEnum, xmlBounded:
		return "string"
	case xmlNullable:
		return "nullable-string"
	case xmlText:
		if plainString(node) {
			return "string"
		}
		return ""
	}
	if o, ok := node.(*ordered); ok {
		if t, ok := o.vals["type"].(string); ok {
			return t
		}
	}
	return ""
}

// textUntil defines the rules for any text that contains none of stops, followed by
// end (the parsers cut a value at the first of these tags): the states of the
// Aho-Corasick automaton of {end} ∪ stops, each the longest suffix of the text read
// that begins one of the tags. Returns the start rule.
func (c *gbnf) textUntil(end string, stops []string) string {
	key := end + "\x00" + strings.Join(stops, "\x00")
	if name, ok := c.until[key]; ok {
		return name
	}
	if c.until == nil {
		c.until = map[string]string{}
	}
	base := fmt.Sprintf("text-%d", len(c.until))
	c.until[key] = base + "-0"
	pats := append([]string{end}, stops...)
	prefixes := map[string]bool{"": true}
	alphabet := map[rune]bool{}
	for _, p := range pats {
		rs := []rune(p)
		for i := range rs {
			prefixes[string(rs[:i])] = true
			alphabet[rs[i]] = true
		}
	}
	states := make([]string, 0, len(prefixes))
	for p := range prefixes {
		states = append(states, p)
	}
	sort.Slice(states, func(i, j int) bool {
		if len(states[i]) != len(states[j]) {
			return len(states[i]) < len(states[j])
		}
		return states[i] < states[j]
	})
	id := map[string]int{}
	for i, s := range states {
		id[s] = i
	}
	runes := make([]rune, 0, len(alphabet))
	for r := range alphabet {
		runes = append(runes, r)
	}
	sort.Slice(runes, func(i, j int) bool { return runes[i] < runes[j] })
	// hit is the tag the text read now ends with, if any.
	hit := func(s string) string {
		for _, p := range pats {
			if strings.HasSuffix(s, p) {
				return p
			}
		}
		return ""
	}
	// step is the state after reading r in state s: the tag the text now ends with, or
	// the longest suffix that begins one.
	step := func(s string, r rune) string {
		t := s + string(r)
		if h := hit(t); h != "" {
			return h
		}
		for i := 0; i <= len(t); i++ {
			if prefixes[t[i:]] {
				return t[i:]
			}
		}
		return ""
	}
	for _, s := range states {
		// Characters that lead anywhere but back to the start are spelled out; the
		// class takes the rest.
		var cls strings.Builder
		var alts []string
		for _, r := range runes {
			t := step(s, r)
			if t == "" {
				continue
			}
			cls.WriteString(classChar(r))
			switch h := hit(t); {
			case h == end:
				alts = append(alts, q(string(r)))
			case h != "":
				// a stop tag: no way on
			default:
				alts = append(alts, fmt.Sprintf("%s %s-%d", q(string(r)), base, id[t]))
			}
		}
		alts = append([]string{fmt.Sprintf("[^%s] %s-0", cls.String(), base)}, alts...)
		c.rules[fmt.Sprintf("%s-%d", base, id[s])] = strings.Join(alts, " | ")
	}
	return base + "-0"
}

// classChar writes r for a GBNF character class.
func classChar(r rune) string {
	switch {
	case r == '\\' || r == ']' || r == '[' || r == '^' || r == '-' || r == '"':
		return fmt.Sprintf(`\x%02X`, r)
	case r < 0x20 || r == 0x7f:
		return fmt.Sprintf(`\x%02X`, r)
	}
	return string(r)
}

// q is a GBNF string literal for s, with only the escapes llama.cpp's GBNF parser
// knows (strconv.Quote would also write \a, \b, \f and \v, which it refuses).
func q(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, `\x%02X`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

func containsAny(s string, subs []string) bool {
	for _, x := range subs {
		if strings.Contains(s, x) {
			return true
		}
	}
	return false
}
