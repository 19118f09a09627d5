package jinja

// PolyKV fork: Python-exact json.dumps and repr, used by tojson, printing and the
// string filter, so rendered prompts are byte-identical to jinja2 under transformers.

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// JSONOptions are the json.dumps arguments a template passes to tojson.
type JSONOptions struct {
	Indent      int  // spaces per level when Pretty
	Pretty      bool // indent given: newlines and indentation, "," item separator by default
	ItemSep     string
	KeySep      string
	SortKeys    bool
	EnsureASCII bool
}

// DumpJSON encodes v as Python's json.dumps does with o: dict keys in insertion order
// (or sorted), Python's float repr, no HTML escaping.
func DumpJSON(v Value, o JSONOptions) (string, error) {
	var b strings.Builder
	if err := writeJSON(&b, v, o, 0); err != nil {
		return "", err
	}
	return b.String(), nil
}

func writeJSON(b *strings.Builder, v Value, o JSONOptions, depth int) error {
	nl := func(d int) {
		if o.Pretty {
			b.WriteByte('\n')
			b.WriteString(strings.Repeat(" ", o.Indent*d))
		}
	}
	switch v.kind {
	case KindNone, KindUndefined:
		b.WriteString("null")
	case KindBool:
		if v.AsBool() {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case KindInt:
		b.WriteString(strconv.FormatInt(v.AsInt(), 10))
	case KindFloat:
		b.WriteString(pyFloatRepr(v.AsFloat()))
	case KindString:
		writePyJSONString(b, v.AsString(), o.EnsureASCII)
	case KindList:
		items := v.AsList().Items
		if len(items) == 0 {
			b.WriteString("[]")
			return nil
		}
		b.WriteByte('[')
		for i, it := range items {
			if i > 0 {
				b.WriteString(o.ItemSep)
			}
			nl(depth + 1)
			if err := writeJSON(b, it, o, depth+1); err != nil {
				return err
			}
		}
		nl(depth)
		b.WriteByte(']')
	case KindDict:
		d := v.AsDict()
		keys := d.OrderedKeys()
		if o.SortKeys {
			sortStrings(keys)
		}
		if len(keys) == 0 {
			b.WriteString("{}")
			return nil
		}
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(o.ItemSep)
			}
			nl(depth + 1)
			writePyJSONString(b, k, o.EnsureASCII)
			b.WriteString(o.KeySep)
			if err := writeJSON(b, d.Data[k], o, depth+1); err != nil {
				return err
			}
		}
		nl(depth)
		b.WriteByte('}')
	default:
		//lint:ignore ST1005 Python's own TypeError text, as json.dumps raises it.
		return fmt.Errorf("Object of type %s is not JSON serializable", v.typeName())
	}
	return nil
}

func (v Value) typeName() string {
	if v.kind == KindCallable {
		return "function"
	}
	return "object"
}

func sortStrings(s []string) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// pyFloatRepr is Python's repr(float): shortest round-trip digits, ".0" on integral
// values, exponent form below 1e-4 and from 1e16 on, written e-05 / e+16.
func pyFloatRepr(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	}
	abs := math.Abs(f)
	if abs != 0 && (abs < 1e-4 || abs >= 1e16) {
		s := strconv.FormatFloat(f, 'e', -1, 64)
		mant, exp, _ := strings.Cut(s, "e")
		sign := exp[0]
		digits := strings.TrimLeft(exp[1:], "0")
		if len(digits) < 2 {
			digits = strings.Repeat("0", 2-len(digits)) + digits
		}
		return mant + "e" + string(sign) + digits
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.Contains(s, ".") {
		s += ".0"
	}
	return s
}

// writePyJSONString writes s as json.dumps does: \" \\ \n \r \t \b \f escaped, other
// control characters as \u00XX, the rest literal (ensure_ascii=False) or as \uXXXX
// with surrogate pairs (ensure_ascii=True).
func writePyJSONString(b *strings.Builder, s string, ascii bool) {
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			switch {
			case r < 0x20:
				fmt.Fprintf(b, `\u%04x`, r)
			case ascii && r > 0x7e:
				if r > 0xffff {
					r -= 0x10000
					fmt.Fprintf(b, `\u%04x\u%04x`, 0xd800+(r>>10), 0xdc00+(r&0x3ff))
				} else {
					fmt.Fprintf(b, `\u%04x`, r)
				}
			default:
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}

// pyRepr is Python's repr of a string: single quotes unless the text has a single
// quote and no double quote, backslash escapes for the quote, \\, \n, \r, \t and
// other control characters.
func pyRepr(s string) string {
	q := byte('\'')
	if strings.ContainsRune(s, '\'') && !strings.ContainsRune(s, '"') {
		q = '"'
	}
	var b strings.Builder
	b.WriteByte(q)
	for _, r := range s {
		switch {
		case r == rune(q) || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, `\x%02x`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte(q)
	return b.String()
}
