package chat

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// The schema compiler's contract, checked by fuzzing: for every schema it accepts,
// (1) its grammar is well-formed GBNF that llama.cpp's parser would take (every rule
// defined, only known escapes); (2) a document the schema validator accepts, written
// the way the grammar writes JSON (properties in schema order, required first), is
// accepted by the grammar: the model is never forced away from a valid answer; and
// (3) whatever the grammar derives is JSON the validator accepts: the model is never
// allowed an invalid one.

// FuzzSchemaToGBNF feeds arbitrary bytes as a schema: never a panic, and an accepted
// schema yields a grammar that parses.
func FuzzSchemaToGBNF(f *testing.F) {
	for _, s := range grammarSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, schema []byte) {
		g, err := SchemaToGBNF(schema)
		if err != nil {
			return
		}
		if _, err := parseGBNF(g); err != nil {
			t.Fatalf("schema %s compiled to a grammar llama.cpp would not parse: %v\n%s", schema, err, g)
		}
	})
}

var grammarSeeds = []string{
	`{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"},"unit":{"enum":["C","F"]}},"required":["city"]}`,
	`{"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":3}`,
	`{"$defs":{"node":{"type":"object","properties":{"kids":{"type":"array","items":{"$ref":"#/$defs/node"}}}}},"$ref":"#/$defs/node"}`,
	`{"anyOf":[{"type":"string","maxLength":3},{"type":"null"}]}`,
	`{"const":{"b":[1,2.5,"x\u00e9"],"a":null}}`,
	`{"type":["number","boolean"]}`,
	`{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},"c":{"type":"boolean"}}}`,
	`{"type":"object","additionalProperties":false}`,
	`true`,
}

// FuzzSchemaGrammarAgreement builds a schema from the fuzz bytes (within the supported
// subset, so most inputs test something), then checks properties (2) and (3).
func FuzzSchemaGrammarAgreement(f *testing.F) {
	f.Add([]byte{6, 3, 0, 1, 7, 9, 2}, []byte{1, 2, 3, 4, 5, 6, 7, 8}, []byte{9, 9, 9, 9, 1, 0, 3})
	f.Add([]byte{12, 1, 2, 3}, []byte{3, 3, 3, 3, 3, 3}, []byte{2, 2, 2, 2, 2, 2, 2, 2})
	f.Add([]byte{6, 2, 0, 0, 1, 0, 0}, []byte{0, 1, 0, 1}, []byte{1, 1, 1, 1, 1})
	f.Add([]byte{5, 1, 1, 2, 6, 1, 1, 3}, []byte{7, 7, 7}, []byte{200, 100, 50})
	f.Add([]byte{9, 0, 7, 2, 3, 1}, []byte{1, 0}, []byte{4, 4})
	f.Fuzz(func(t *testing.T, shape, doc, walk []byte) {
		schema := schemaFromBytes(&byteSource{b: shape})
		g, err := SchemaToGBNF([]byte(schema))
		if err != nil {
			t.Fatalf("supported-subset schema refused: %v\n%s", err, schema)
		}
		gr, err := parseGBNF(g)
		if err != nil {
			t.Fatalf("grammar does not parse: %v\n%s\n%s", err, schema, g)
		}
		v := compileTestSchema(t, schema)

		// (2) a valid document in the grammar's layout is accepted.
		node, _ := parseOrdered([]byte(schema))
		if d, ok := docFromSchema(node, node, &byteSource{b: doc}, 4); ok && validates(v, d) {
			if !gr.accepts(d) {
				t.Fatalf("grammar rejects a valid document\nschema: %s\ndoc:    %s\ngrammar:\n%s", schema, d, g)
			}
		}

		// (3) what the grammar derives validates.
		out := gr.generate(&byteSource{b: walk}, 6)
		if !json.Valid([]byte(out)) {
			t.Fatalf("grammar derived invalid JSON %q\nschema: %s\ngrammar:\n%s", out, schema, g)
		}
		if !validates(v, out) {
			t.Fatalf("grammar derived a document the schema rejects\nschema: %s\ndoc:    %s\ngrammar:\n%s", schema, out, g)
		}
	})
}

func compileTestSchema(t *testing.T, schema string) *jsonschema.Schema {
	t.Helper()
	doc, err := jsonschema.UnmarshalJSON(strings.NewReader(schema))
	if err != nil {
		t.Fatalf("generated schema is not JSON: %v\n%s", err, schema)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("schema.json", doc); err != nil {
		t.Fatal(err)
	}
	s, err := c.Compile("schema.json")
	if err != nil {
		t.Fatalf("generated schema does not compile: %v\n%s", err, schema)
	}
	return s
}

func validates(s *jsonschema.Schema, doc string) bool {
	v, err := jsonschema.UnmarshalJSON(strings.NewReader(doc))
	return err == nil && s.Validate(v) == nil
}

var propNames = []string{"city", "days", "unit", "q", "a b", "ünï", "x\"y", "id"}

var stringLits = []string{"C", "", "é中😀", "quote\"back\\slash", "tab\tnew\nline", "<tag>&amp;"}

// schemaFromBytes writes a schema of the supported subset (see SchemaToGBNF),
// shaped by the bytes. Numeric bounds are left out: they are accepted but not enforced
// by design, so property (3) does not hold for them.
func schemaFromBytes(src *byteSource) string {
	if src.intn(8) == 0 {
		// A recursive definition reached through $ref.
		return `{"$defs":{"node":{"type":"object","properties":{"v":` + subschema(src, 1) +
			`,"kids":{"type":"array","items":{"$ref":"#/$defs/node"},"maxItems":2}},"required":["v"]}},"$ref":"#/$defs/node"}`
	}
	return subschema(src, 3)
}

func subschema(src *byteSource, depth int) string {
	kinds := 13
	if depth <= 0 {
		kinds = 5 // scalars only
	}
	switch src.intn(kinds) {
	case 0:
		if src.intn(2) == 0 {
			return fmt.Sprintf(`{"type":"string","maxLength":%d}`, src.intn(6))
		}
		return `{"type":"string"}`
	case 1:
		return `{"type":"integer"}`
	case 2:
		return `{"type":"number"}`
	case 3:
		return `{"type":"boolean"}`
	case 4:
		return `{"type":"null"}`
	case 5:
		var b strings.Builder
		b.WriteString(`{"type":"array"`)
		if src.intn(3) > 0 {
			b.WriteString(`,"items":` + subschema(src, depth-1))
		}
		lo, hi := -1, -1
		if src.intn(2) == 0 {
			lo = src.intn(3)
			b.WriteString(fmt.Sprintf(`,"minItems":%d`, lo))
		}
		if src.intn(2) == 0 {
			hi = max(lo, 0) + src.intn(3)
			b.WriteString(fmt.Sprintf(`,"maxItems":%d`, hi))
		}
		return b.String() + "}"
	case 6:
		n := src.intn(4)
		var props, req []string
		used := map[string]bool{}
		for range n {
			k := propNames[src.intn(len(propNames))]
			if used[k] {
				continue
			}
			used[k] = true
			kq, _ := json.Marshal(k)
			props = append(props, string(kq)+":"+subschema(src, depth-1))
			if src.intn(2) == 0 {
				req = append(req, string(kq))
			}
		}
		if len(props) == 0 {
			if src.intn(2) == 0 {
				return `{"type":"object","additionalProperties":false}`
			}
			return `{"type":"object"}`
		}
		s := `{"type":"object","properties":{` + strings.Join(props, ",") + `}`
		if len(req) > 0 {
			s += `,"required":[` + strings.Join(req, ",") + `]`
		}
		return s + "}"
	case 7:
		var lits []string
		for range 1 + src.intn(3) {
			lits = append(lits, literalFromBytes(src))
		}
		return `{"enum":[` + strings.Join(lits, ",") + `]}`
	case 8:
		return `{"const":` + literalFromBytes(src) + `}`
	case 9:
		// anyOf, not oneOf: oneOf compiles to the same alternation, and a document
		// matching two branches would be derivable yet invalid (see SchemaToGBNF).
		return `{"anyOf":[` + subschema(src, depth-1) + `,` + subschema(src, depth-1) + `]}`
	case 10:
		types := []string{`"string"`, `"integer"`, `"number"`, `"boolean"`, `"null"`}
		a, b := types[src.intn(len(types))], types[src.intn(len(types))]
		if a == b {
			return `{"type":[` + a + `]}`
		}
		return `{"type":[` + a + `,` + b + `]}`
	case 11:
		return `{}`
	default:
		return `true`
	}
}

func literalFromBytes(src *byteSource) string {
	switch src.intn(6) {
	case 0:
		b, _ := json.Marshal(stringLits[src.intn(len(stringLits))])
		return string(b)
	case 1:
		return strconv.Itoa(src.intn(200) - 100)
	case 2:
		return []string{"2.5", "-0.125", "1e3", "1.0"}[src.intn(4)]
	case 3:
		return []string{"true", "false", "null"}[src.intn(3)]
	case 4:
		return `{"k":[1,"v"],"a":null}`
	default:
		return `["x",{"z":1,"y":2}]`
	}
}

// docFromSchema writes a document for node in the grammar's layout (compact, object
// properties required-first in schema order). ok is false where it gave up (depth);
// the validator, not this function, is the judge of validity.
func docFromSchema(root, node any, src *byteSource, depth int) (string, bool) {
	if depth < 0 {
		return "", false
	}
	switch n := node.(type) {
	case bool:
		return anyDoc(src, 2), n
	case *ordered:
		return docFromObject(root, n, src, depth)
	}
	return "", false
}

func docFromObject(root any, s *ordered, src *byteSource, depth int) (string, bool) {
	if ref, ok := s.vals["$ref"].(string); ok {
		node := root
		for _, part := range strings.Split(strings.TrimPrefix(ref, "#/"), "/") {
			o, ok := node.(*ordered)
			if !ok {
				return "", false
			}
			node = o.vals[part]
		}
		return docFromSchema(root, node, src, depth-1)
	}
	// const and enum values are written as the compiler writes their literals (one
	// encoding of the value; the validator judges that it is the same value).
	if v, ok := s.vals["const"]; ok {
		b, err := marshalNoEscape(plain(v))
		return string(b), err == nil
	}
	if v, ok := s.vals["enum"].([]any); ok && len(v) > 0 {
		b, err := marshalNoEscape(plain(v[src.intn(len(v))]))
		return string(b), err == nil
	}
	if v, ok := s.vals["anyOf"].([]any); ok && len(v) > 0 {
		return docFromSchema(root, v[src.intn(len(v))], src, depth-1)
	}
	var types []string
	switch t := s.vals["type"].(type) {
	case string:
		types = []string{t}
	case []any:
		for _, e := range t {
			types = append(types, e.(string))
		}
	}
	if len(types) == 0 {
		if _, ok := s.vals["properties"]; ok {
			types = []string{"object"}
		} else {
			return anyDoc(src, 2), true
		}
	}
	switch types[src.intn(len(types))] {
	case "string":
		limit := 12
		if ml, ok := s.vals["maxLength"].(json.Number); ok {
			n, _ := strconv.Atoi(ml.String())
			limit = n
		}
		return stringDoc(src, limit), true
	case "integer":
		return strconv.Itoa(int(src.next())*37 - 4000), true
	case "number":
		return []string{"0", "-3", "2.75", "1e-3", "-0.5E+2", "12345678.5"}[src.intn(6)], true
	case "boolean":
		return []string{"true", "false"}[src.intn(2)], true
	case "null":
		return "null", true
	case "array":
		lo, hi, err := itemBounds(s)
		if err != nil {
			return "", false
		}
		if hi < 0 {
			hi = lo + 3
		}
		n := lo + src.intn(hi-lo+1)
		items, hasItems := s.vals["items"]
		var parts []string
		for range n {
			if !hasItems {
				parts = append(parts, anyDoc(src, 1))
				continue
			}
			d, ok := docFromSchema(root, items, src, depth-1)
			if !ok {
				return "", false
			}
			parts = append(parts, d)
		}
		return "[" + strings.Join(parts, ",") + "]", true
	case "object":
		props, ok := s.vals["properties"].(*ordered)
		if !ok {
			if ap, ok := s.vals["additionalProperties"].(bool); ok && !ap {
				return "{}", true
			}
			return anyDoc(src, 1), true
		}
		required := map[string]bool{}
		if r, ok := s.vals["required"].([]any); ok {
			for _, e := range r {
				required[e.(string)] = true
			}
		}
		var parts []string
		for _, pass := range []bool{true, false} {
			for _, k := range props.keys {
				if required[k] != pass || !pass && src.intn(2) == 0 {
					continue
				}
				d, ok := docFromSchema(root, props.vals[k], src, depth-1)
				if !ok {
					return "", false
				}
				parts = append(parts, canonical(k)+":"+d)
			}
		}
		return "{" + strings.Join(parts, ",") + "}", true
	}
	return "", false
}

// anyDoc is an arbitrary JSON value, at most depth levels deep.
func anyDoc(src *byteSource, depth int) string {
	k := src.intn(6)
	if depth <= 0 {
		k %= 4
	}
	switch k {
	case 0:
		return stringDoc(src, 6)
	case 1:
		return strconv.Itoa(src.intn(1000) - 500)
	case 2:
		return []string{"true", "false", "null"}[src.intn(3)]
	case 3:
		return "0.5"
	case 4:
		return "[" + anyDoc(src, depth-1) + "," + anyDoc(src, depth-1) + "]"
	default:
		return `{"k":` + anyDoc(src, depth-1) + "}"
	}
}

var docRunes = []rune{'a', 'Z', ' ', '"', '\\', '/', 'é', '中', '😀', '\n', '\t', 0x7f, 0x01, 0x2028}

func stringDoc(src *byteSource, limit int) string {
	var rs []rune
	for range src.intn(limit + 1) {
		rs = append(rs, docRunes[src.intn(len(docRunes))])
	}
	return canonical(string(rs))
}

// canonical encodes v compactly the way the grammar's string rule allows: no raw
// control characters or DEL (escaped as \u00XX), no HTML escaping, map keys sorted (as
// the compiler's literals are).
func canonical(v any) string {
	switch x := v.(type) {
	case string:
		var b strings.Builder
		b.WriteByte('"')
		for _, r := range x {
			switch {
			case r == '"' || r == '\\':
				b.WriteByte('\\')
				b.WriteRune(r)
			case r < 0x20 || r == 0x7f:
				fmt.Fprintf(&b, `\u%04x`, r)
			default:
				b.WriteRune(r)
			}
		}
		b.WriteByte('"')
		return b.String()
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var parts []string
		for _, k := range keys {
			parts = append(parts, canonical(k)+":"+canonical(x[k]))
		}
		return "{" + strings.Join(parts, ",") + "}"
	case []any:
		var parts []string
		for _, e := range x {
			parts = append(parts, canonical(e))
		}
		return "[" + strings.Join(parts, ",") + "]"
	case json.Number:
		return x.String()
	case nil:
		return "null"
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
	return strings.TrimSpace(buf.String())
}

// TestSchemaGrammarSeeds runs the agreement checks on hand-picked schemas and
// documents, so a plain go test covers them without the fuzzer.
func TestSchemaGrammarSeeds(t *testing.T) {
	cases := []struct {
		schema string
		ok     []string
		bad    []string
	}{
		{`{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"}}}`,
			[]string{`{}`, `{"a":1}`, `{"b":"x"}`, `{"a":1,"b":"x"}`, `{ "a" : 1 , "b" : "x" }`},
			[]string{`{"b":"x","a":1}`, `{"c":1}`, `{"a":"1"}`}},
		{`{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},"c":{"type":"null"}},"required":["b"]}`,
			[]string{`{"b":""}`, `{"b":"","a":1}`, `{"b":"","c":null}`, `{"b":"","a":1,"c":null}`},
			[]string{`{}`, `{"a":1}`}},
		{`{"type":"string","maxLength":2}`, []string{`""`, `"ab"`, `"\u00e9\n"`}, []string{`"abc"`}},
		{`{"type":"array","items":{"type":"boolean"},"minItems":1,"maxItems":2}`, []string{`[true]`, `[true,false]`}, []string{`[]`, `[true,true,true]`}},
		{`{"type":"array","minItems":1,"maxItems":1}`, []string{`[{}]`, `["x"]`}, []string{`[]`, `[1,2]`}},
		{`{"const":{"b":1,"a":[null]}}`, []string{`{"a":[null],"b":1}`}, []string{`{"a":[null]}`}},
	}
	for _, c := range cases {
		g, err := SchemaToGBNF([]byte(c.schema))
		if err != nil {
			t.Fatalf("%s: %v", c.schema, err)
		}
		gr, err := parseGBNF(g)
		if err != nil {
			t.Fatalf("%s: %v\n%s", c.schema, err, g)
		}
		v := compileTestSchema(t, c.schema)
		for _, d := range c.ok {
			if !validates(v, d) || !gr.accepts(d) {
				t.Errorf("%s: %s: valid %v, grammar accepts %v; want both\n%s", c.schema, d, validates(v, d), gr.accepts(d), g)
			}
		}
		for _, d := range c.bad {
			if gr.accepts(d) {
				t.Errorf("%s: grammar accepts %s\n%s", c.schema, d, g)
			}
		}
	}
}

// TestSchemaGrammarAgreementIsExercised keeps the fuzz target honest: over a fixed
// set of random inputs, most generated documents must be valid (so property (2) is
// really checked, not skipped), and every check must hold.
func TestSchemaGrammarAgreementIsExercised(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	bytesOf := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		return b
	}
	checked := 0
	const runs = 400
	for range runs {
		schema := schemaFromBytes(&byteSource{b: bytesOf(24)})
		g, err := SchemaToGBNF([]byte(schema))
		if err != nil {
			t.Fatalf("%s: %v", schema, err)
		}
		gr, err := parseGBNF(g)
		if err != nil {
			t.Fatalf("%s: %v", schema, err)
		}
		v := compileTestSchema(t, schema)
		node, _ := parseOrdered([]byte(schema))
		if d, ok := docFromSchema(node, node, &byteSource{b: bytesOf(32)}, 4); ok && validates(v, d) {
			checked++
			if !gr.accepts(d) {
				t.Fatalf("grammar rejects valid %s for %s", d, schema)
			}
		}
		if out := gr.generate(&byteSource{b: bytesOf(64)}, 6); !validates(v, out) {
			t.Fatalf("grammar derived %s, invalid for %s", out, schema)
		}
	}
	if checked < runs*3/4 {
		t.Fatalf("only %d of %d generated documents were valid: the generator has drifted from the schemas", checked, runs)
	}
}

// A tool's schema relaxes what the grammar cannot express (ToolSchemaToGBNF): the
// grammar accepts every document the schema accepts (a superset), where SchemaToGBNF
// (response_format) refuses the schema. The schemas are the shapes of Claude Code's
// Workflow and Monitor tools that failed requests before (maxLength 10,000, pattern),
// and the other unsupported keywords.
func TestToolSchemaRelaxed(t *testing.T) {
	cases := []struct {
		schema string
		ok     []string
	}{
		{`{"type":"object","properties":{"script":{"type":"string","maxLength":10000},"name":{"type":"string","pattern":"^[a-z]+$"}},"required":["script"]}`,
			[]string{`{"script":"echo hi"}`, `{"script":"x","name":"abc"}`}},
		{`{"type":"object","properties":{"ids":{"type":"array","items":{"type":"integer"},"uniqueItems":true,"maxItems":5000}}}`,
			[]string{`{}`, `{"ids":[1,2,3]}`}},
		{`{"type":"object","properties":{"v":{"allOf":[{"type":"string"}],"minLength":3}}}`, []string{`{"v":"abcd"}`}},
		{`{"type":"object","properties":{"v":{"type":"uuid"}}}`, []string{`{"v":"x"}`, `{"v":1}`}},
	}
	for _, c := range cases {
		if _, err := SchemaToGBNF([]byte(c.schema)); err == nil {
			t.Errorf("%s: response_format's compiler accepted it (the relaxation is not exercised)", c.schema)
		}
		g, err := ToolSchemaToGBNF([]byte(c.schema))
		if err != nil {
			t.Fatalf("%s: %v", c.schema, err)
		}
		gr, err := parseGBNF(g)
		if err != nil {
			t.Fatalf("%s: %v\n%s", c.schema, err, g)
		}
		for _, d := range c.ok {
			if !gr.accepts(d) {
				t.Errorf("%s: the relaxed grammar refuses %s\n%s", c.schema, d, g)
			}
		}
	}
}
