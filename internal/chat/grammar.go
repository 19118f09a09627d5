package chat

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// SchemaToGBNF compiles a JSON schema into a llama.cpp GBNF grammar whose root rule
// matches exactly the JSON values the schema accepts (within the supported subset):
// type (string, integer, number, boolean, null, array, object, or a list of them),
// properties + required (properties kept in schema order, no extra keys),
// additionalProperties false, items with minItems/maxItems, enum, const, anyOf/oneOf,
// maxLength, local $ref (#/$defs/..., #/definitions/...; recursive schemas become
// recursive rules), and {} / true for any value. oneOf compiles as anyOf: a value
// matching two branches is not excluded (a grammar cannot say "exactly one" without
// expanding every overlap), so such schemas should use disjoint branches. Anything else
// that constrains values (allOf, not, pattern, ...; the unsupported list) is refused
// with the keyword named, since ignoring it would let the model produce JSON the schema
// rejects; numeric bounds are accepted and not enforced (see unsupported).
//
// (llama.cpp's own json-schema-to-grammar lives in its common library, which the server
// build leaves out (LLAMA_BUILD_COMMON=OFF, scripts/llama.sh): only the common/chat
// measurement links it, make commonchat.)
func SchemaToGBNF(schema []byte) (string, error) {
	return schemaToGBNF(schema, false)
}

// ToolSchemaToGBNF is SchemaToGBNF for a tool's parameters: what the grammar cannot
// express is relaxed rather than refused (the unsupported keywords, a maxLength over
// 4096, item bounds over 1000 and an unknown type each accept any value of that
// place), so the grammar accepts a superset of the schema and every call still parses
// as JSON. A tool is the client's own code, which validates its input anyway: refusing
// its schema would refuse the whole request (Claude Code's Workflow and Monitor tools
// carry pattern and maxLength 10,000, for example), while structured output
// (response_format, SchemaToGBNF) promises a reply the schema accepts and so refuses.
func ToolSchemaToGBNF(schema []byte) (string, error) {
	return schemaToGBNF(schema, true)
}

func schemaToGBNF(schema []byte, relax bool) (string, error) {
	node, err := parseOrdered(schema)
	if err != nil {
		return "", fmt.Errorf("schema is not valid JSON: %w", err)
	}
	c := &gbnf{rules: map[string]string{}, root: node, relax: relax}
	root, err := c.visit(node, "root")
	if err != nil {
		return "", err
	}
	if root != "root" {
		c.rules["root"] = root
	}
	return c.String(), nil
}

// ordered is a JSON object that remembers key order.
type ordered struct {
	keys []string
	vals map[string]any
}

func parseOrdered(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	v, err := readValue(dec)
	if err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, fmt.Errorf("trailing data")
	}
	return v, nil
}

func readValue(dec *json.Decoder) (any, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			o := &ordered{vals: map[string]any{}}
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				k := kt.(string)
				v, err := readValue(dec)
				if err != nil {
					return nil, err
				}
				if _, dup := o.vals[k]; !dup {
					o.keys = append(o.keys, k)
				}
				o.vals[k] = v
			}
			_, err := dec.Token()
			return o, err
		case '[':
			var arr []any
			for dec.More() {
				v, err := readValue(dec)
				if err != nil {
					return nil, err
				}
				arr = append(arr, v)
			}
			_, err := dec.Token()
			return arr, err
		}
	}
	return tok, nil
}

type gbnf struct {
	rules map[string]string
	n     int
	root  any    // for local $ref
	refNS string // prefix of $ref rule names, so several schemas share one grammar
	// py writes values as Python literals (LFM2's calls): True/False/None, strings in
	// double quotes with Python's escapes (pyPrimitives, pyLiteral).
	py bool
	// ban is text a JSON string may not hold raw (finishChars): the start of the tags
	// the family's parser cuts a call at.
	ban   string
	until map[string]string // textUntil's start rules by their tags
	// relax: what cannot be expressed accepts any value instead of failing
	// (ToolSchemaToGBNF).
	relax bool
}

func (c *gbnf) String() string {
	names := make([]string, 0, len(c.rules))
	for k := range c.rules {
		names = append(names, k)
	}
	sort.Slice(names, func(i, j int) bool {
		if names[i] == "root" || names[j] == "root" {
			return names[i] == "root"
		}
		return names[i] < names[j]
	})
	var b strings.Builder
	for _, n := range names {
		fmt.Fprintf(&b, "%s ::= %s\n", n, c.rules[n])
	}
	return b.String()
}

// primitives are shared rules, added on first use.
var primitives = map[string]string{
	"space":   `| " " | "\n" [ \t]{0,20}`,
	"char":    `[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})`,
	"string":  `"\"" char* "\"" space`,
	"integer": `("-"? ([0-9] | [1-9] [0-9]{0,15})) space`,
	"number":  `("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [0-9]{0,15})? space`,
	"boolean": `("true" | "false") space`,
	"null":    `"null" space`,
	"value":   `object | array | string | number | boolean | null`,
	"object":  `"{" space ( string ":" space value ("," space string ":" space value)* )? "}" space`,
	"array":   `"[" space ( value ("," space value)* )? "]" space`,
}

var primitiveDeps = map[string][]string{
	"string": {"char", "space"}, "integer": {"space"}, "number": {"space"}, "boolean": {"space"}, "null": {"space"},
	"value": {"object", "array", "string", "number", "boolean", "null"}, "object": {"space", "string", "value"}, "array": {"space", "value"},
}

// pyPrimitives replace primitives in py mode. Numbers keep JSON's syntax (a Python
// literal too) with at most two exponent digits, so that every one parses as a float.
var pyPrimitives = map[string]string{
	"char":    `[^"\\\x7F\x00-\x1F] | [\\] ["\\nrt]`,
	"number":  `("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [0-9]?)? space`,
	"boolean": `("True" | "False") space`,
	"null":    `"None" space`,
}

func (c *gbnf) prim(name string) string {
	if _, ok := c.rules[name]; !ok {
		c.rules[name] = primitives[name]
		if b, ok := pyPrimitives[name]; ok && c.py {
			c.rules[name] = b
		}
		for _, d := range primitiveDeps[name] {
			c.prim(d)
		}
	}
	return name
}

func (c *gbnf) fresh(hint string) string {
	c.n++
	return fmt.Sprintf("%s-%d", sanitize(hint), c.n)
}

func sanitize(s string) string {
	var b strings.Builder
	for _, r := range s {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' {
			b.WriteRune(r)
		} else {
			b.WriteByte('-')
		}
	}
	if b.Len() == 0 {
		return "r"
	}
	return b.String()
}

// literal is a GBNF string literal matching the JSON encoding of v, plus space.
func (c *gbnf) literal(v any) (string, error) {
	if c.py {
		lit, err := pyLiteral(v)
		if err != nil {
			return "", err
		}
		c.prim("space")
		return q(lit) + " space", nil
	}
	raw, err := marshalNoEscape(plain(v))
	if err != nil {
		return "", err
	}
	c.prim("space")
	return strconv.Quote(string(raw)) + " space", nil
}

// plain turns ordered objects back into maps for encoding.
func plain(v any) any {
	switch x := v.(type) {
	case *ordered:
		m := map[string]any{}
		for k, e := range x.vals {
			m[k] = plain(e)
		}
		return m
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = plain(e)
		}
		return out
	}
	return v
}

// unsupported are keywords whose constraint the grammar cannot express. Numeric bounds
// (minimum, maximum, exclusive*, multipleOf) are not among them: they are accepted and
// not enforced, since refusing every pydantic Field(gt=0) would make tools unusable.
var unsupported = []string{"allOf", "not", "if", "then", "else", "pattern", "patternProperties", "dependentSchemas", "dependentRequired", "prefixItems", "contains", "uniqueItems", "minProperties", "maxProperties", "minLength", "format"}

// visit returns a rule body (or name) for the schema node.
func (c *gbnf) visit(node any, name string) (string, error) {
	switch n := node.(type) {
	case bool:
		if n {
			return c.prim("value"), nil
		}
		return "", fmt.Errorf("schema false accepts nothing")
	case *ordered:
		return c.visitObject(n, name)
	}
	return "", fmt.Errorf("a schema must be an object or a boolean, got %T", node)
}

func (c *gbnf) define(name, body string) string {
	if name == "" {
		name = c.fresh("r")
	}
	c.rules[name] = body
	return name
}

func (c *gbnf) visitObject(s *ordered, name string) (string, error) {
	if ref, ok := s.vals["$ref"].(string); ok {
		return c.ref(ref)
	}
	for _, k := range unsupported {
		if _, ok := s.vals[k]; ok {
			if k == "format" {
				continue // an annotation by default in JSON Schema 2020-12
			}
			if k == "minLength" {
				if v, ok := s.vals[k].(json.Number); ok && v.String() == "0" {
					continue
				}
			}
			if c.relax {
				continue // the keyword's constraint is not enforced; the rest is
			}
			return "", fmt.Errorf("schema keyword %q is not supported by the grammar compiler", k)
		}
	}
	if v, ok := s.vals["const"]; ok {
		lit, err := c.literal(v)
		if err != nil {
			return "", err
		}
		return c.define(name, lit), nil
	}
	if v, ok := s.vals["enum"]; ok {
		arr, ok := v.([]any)
		if !ok || len(arr) == 0 {
			return "", fmt.Errorf("enum must be a non-empty array")
		}
		var alts []string
		for _, e := range arr {
			lit, err := c.literal(e)
			if err != nil {
				return "", err
			}
			alts = append(alts, lit)
		}
		return c.define(name, strings.Join(alts, " | ")), nil
	}
	for _, k := range []string{"anyOf", "oneOf"} {
		if v, ok := s.vals[k]; ok {
			arr, ok := v.([]any)
			if !ok || len(arr) == 0 {
				return "", fmt.Errorf("%s must be a non-empty array", k)
			}
			var alts []string
			for i, sub := range arr {
				r, err := c.visit(sub, c.fresh(fmt.Sprintf("%s-%s-%d", sanitize(name), strings.ToLower(k), i)))
				if err != nil {
					return "", err
				}
				alts = append(alts, r)
			}
			return c.define(name, strings.Join(alts, " | ")), nil
		}
	}
	var types []string
	switch t := s.vals["type"].(type) {
	case nil:
		if _, ok := s.vals["properties"]; ok {
			types = []string{"object"}
		}
	case string:
		types = []string{t}
	case []any:
		for _, e := range t {
			str, ok := e.(string)
			if !ok {
				return "", fmt.Errorf("type list entries must be strings")
			}
			types = append(types, str)
		}
	default:
		return "", fmt.Errorf("type must be a string or a list of strings")
	}
	if len(types) == 0 {
		return c.define(name, c.prim("value")), nil
	}
	var alts []string
	for _, t := range types {
		r, err := c.typed(s, t, name)
		if err != nil {
			return "", err
		}
		alts = append(alts, r)
	}
	return c.define(name, strings.Join(alts, " | ")), nil
}

func (c *gbnf) typed(s *ordered, t, name string) (string, error) {
	switch t {
	case "string":
		if ml, ok := s.vals["maxLength"].(json.Number); ok {
			n, err := strconv.Atoi(ml.String())
			if err != nil || n < 0 || n > 4096 {
				if c.relax {
					return c.prim("string"), nil
				}
				return "", fmt.Errorf("maxLength must be an integer in [0, 4096]")
			}
			c.prim("char")
			c.prim("space")
			return fmt.Sprintf(`"\"" char{0,%d} "\"" space`, n), nil
		}
		return c.prim("string"), nil
	case "integer", "number", "boolean", "null":
		return c.prim(t), nil
	case "array":
		lo, hi, err := itemBounds(s)
		if err != nil {
			if !c.relax {
				return "", err
			}
			lo, hi = 0, -1
		}
		items, ok := s.vals["items"]
		if !ok && lo == 0 && hi < 0 {
			return c.prim("array"), nil
		}
		// Without items any value may be an item, but minItems/maxItems still hold.
		item := c.prim("value")
		if ok {
			if item, err = c.visit(items, c.fresh(sanitize(name)+"-item")); err != nil {
				return "", err
			}
		}
		c.prim("space")
		rest := "*"
		switch {
		case hi == 0:
			return `"[" space "]" space`, nil
		case hi > 0:
			rest = fmt.Sprintf("{%d,%d}", max(lo-1, 0), hi-1)
		case lo > 1:
			rest = fmt.Sprintf("{%d,}", lo-1)
		}
		if lo == 0 {
			return fmt.Sprintf(`"[" space ( %s ("," space %s)%s )? "]" space`, item, item, rest), nil
		}
		return fmt.Sprintf(`"[" space %s ("," space %s)%s "]" space`, item, item, rest), nil
	case "object":
		return c.objectBody(s, name)
	}
	if c.relax {
		return c.prim("value"), nil
	}
	return "", fmt.Errorf("unknown type %q", t)
}

func (c *gbnf) objectBody(s *ordered, name string) (string, error) {
	propsNode, ok := s.vals["properties"]
	if !ok {
		if ap, ok := s.vals["additionalProperties"].(bool); ok && !ap {
			c.prim("space")
			return `"{" space "}" space`, nil
		}
		return c.prim("object"), nil
	}
	props, ok := propsNode.(*ordered)
	if !ok {
		return "", fmt.Errorf("properties must be an object")
	}
	required := map[string]bool{}
	if r, ok := s.vals["required"].([]any); ok {
		for _, e := range r {
			str, ok := e.(string)
			if !ok {
				return "", fmt.Errorf("required must list property names")
			}
			if _, known := props.vals[str]; !known {
				return "", fmt.Errorf("required property %q is not in properties", str)
			}
			required[str] = true
		}
	}
	c.prim("space")
	kv := func(k string) (string, error) {
		r, err := c.visit(props.vals[k], c.fresh(sanitize(name)+"-"+sanitize(k)))
		if err != nil {
			return "", err
		}
		key, err := c.literal(k)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf(`%s ":" space %s`, key, r), nil
	}
	var req, opt []string
	for _, k := range props.keys {
		part, err := kv(k)
		if err != nil {
			return "", err
		}
		if required[k] {
			req = append(req, part)
		} else {
			opt = append(opt, part)
		}
	}
	var body string
	switch {
	case len(req) > 0:
		body = strings.Join(req, ` "," space `)
		for _, o := range opt {
			body += ` ( "," space ` + o + ` )?`
		}
	case len(opt) > 0:
		// Any subset of the optional properties, in schema order. rest-i matches a
		// non-empty subset of opt[i:]: opt[i] then maybe more, or skip opt[i]. A named
		// rule per i keeps the grammar linear in the number of properties (inlining
		// would double it per property).
		next := c.define(c.fresh(sanitize(name)+"-rest"), opt[len(opt)-1])
		for i := len(opt) - 2; i >= 0; i-- {
			next = c.define(c.fresh(sanitize(name)+"-rest"), fmt.Sprintf(`%s ( "," space %s )? | %s`, opt[i], next, next))
		}
		body = "( " + next + " )?"
	}
	return fmt.Sprintf(`"{" space %s "}" space`, body), nil
}

// ref resolves a local reference (#/$defs/X, #/definitions/X) to a named rule, so
// recursive schemas become recursive rules.
func (c *gbnf) ref(ref string) (string, error) {
	path, ok := strings.CutPrefix(ref, "#/")
	if !ok {
		return "", fmt.Errorf("$ref %q: only local references (#/...) are supported", ref)
	}
	name := c.refNS + "ref-" + sanitize(path)
	if _, done := c.rules[name]; done {
		return name, nil
	}
	node := c.root
	for _, part := range strings.Split(path, "/") {
		o, ok := node.(*ordered)
		if !ok {
			return "", fmt.Errorf("$ref %q does not resolve", ref)
		}
		if node, ok = o.vals[part]; !ok {
			return "", fmt.Errorf("$ref %q does not resolve", ref)
		}
	}
	c.rules[name] = "" // placeholder: a recursive reference resolves to the name
	body, err := c.visit(node, name)
	if err != nil {
		return "", err
	}
	if body != name {
		c.rules[name] = body
	}
	return name, nil
}

// itemBounds reads minItems/maxItems (hi < 0: unbounded).
func itemBounds(s *ordered) (int, int, error) {
	lo, hi := 0, -1
	for k, dst := range map[string]*int{"minItems": &lo, "maxItems": &hi} {
		v, ok := s.vals[k].(json.Number)
		if !ok {
			continue
		}
		n, err := strconv.Atoi(v.String())
		if err != nil || n < 0 || n > 1000 {
			return 0, 0, fmt.Errorf("%s must be an integer in [0, 1000]", k)
		}
		*dst = n
	}
	if hi >= 0 && lo > hi {
		return 0, 0, fmt.Errorf("minItems %d exceeds maxItems %d", lo, hi)
	}
	return lo, hi, nil
}

// JSONObjectGBNF is response_format json_object: any JSON object, nested at most
// depth levels (deeper values are scalars) with at most width members or items per
// level. Unbounded nesting or repetition lets a small model loop until max_tokens and
// return JSON that never closes.
func JSONObjectGBNF(depth, width int) string {
	c := &gbnf{rules: map[string]string{}}
	c.prim("string")
	c.prim("number")
	c.prim("boolean")
	c.prim("null")
	scalar := "string | number | boolean | null"
	level := scalar
	for d := depth; d >= 1; d-- {
		obj := fmt.Sprintf("obj-%d", d)
		arr := fmt.Sprintf("arr-%d", d)
		val := fmt.Sprintf("val-%d", d)
		c.rules[val] = level
		c.rules[obj] = fmt.Sprintf(`"{" space ( string ":" space %s ("," space string ":" space %s){0,%d} )? "}" space`, val, val, width-1)
		c.rules[arr] = fmt.Sprintf(`"[" space ( %s ("," space %s){0,%d} )? "]" space`, val, val, width-1)
		level = fmt.Sprintf("%s | %s | %s", scalar, obj, arr)
	}
	c.rules["root"] = "obj-1"
	return c.String()
}

// pyLiteral writes v as the Python literal parsePythonCalls reads back as v.
func pyLiteral(v any) (string, error) {
	switch x := v.(type) {
	case string:
		return pyQuote(x), nil
	case json.Number:
		if _, err := strconv.ParseFloat(x.String(), 64); err != nil {
			return "", fmt.Errorf("number %s has no Python float", x)
		}
		return x.String(), nil
	case bool:
		if x {
			return "True", nil
		}
		return "False", nil
	case nil:
		return "None", nil
	case []any:
		parts := make([]string, len(x))
		for i, e := range x {
			p, err := pyLiteral(e)
			if err != nil {
				return "", err
			}
			parts[i] = p
		}
		return "[" + strings.Join(parts, ", ") + "]", nil
	case *ordered:
		parts := make([]string, len(x.keys))
		for i, k := range x.keys {
			p, err := pyLiteral(x.vals[k])
			if err != nil {
				return "", err
			}
			parts[i] = pyQuote(k) + ": " + p
		}
		return "{" + strings.Join(parts, ", ") + "}", nil
	}
	return "", fmt.Errorf("no Python literal for %T", v)
}

// pyQuote writes s as a double-quoted Python string with the escapes pyParser.str reads.
func pyQuote(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"', '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case '\n':
			b.WriteString(`\n`)
		case '\t':
			b.WriteString(`\t`)
		case '\r':
			b.WriteString(`\r`)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}
