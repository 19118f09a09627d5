package chat

import (
	"bytes"
	"encoding/json"
	"slices"
	"strconv"
	"strings"
)

// pyJSON encodes v the way Python's json.dumps(v, ensure_ascii=False) does, which is
// what HF chat templates' tojson produces: ", " and ": " separators (or newlines and
// indent), no HTML escaping. Object keys are sorted (Go maps keep no order).
func pyJSON(v any, indent int) (string, error) {
	// Normalise through encoding/json so any Go value becomes maps, slices and scalars.
	raw, err := marshalNoEscape(v)
	if err != nil {
		return "", err
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var norm any
	if err := dec.Decode(&norm); err != nil {
		return "", err
	}
	var b strings.Builder
	writePy(&b, norm, indent, 0)
	return b.String(), nil
}

func marshalNoEscape(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimRight(buf.Bytes(), "\n"), nil
}

func writePy(b *strings.Builder, v any, indent, depth int) {
	nl := func(d int) {
		if indent > 0 {
			b.WriteByte('\n')
			b.WriteString(strings.Repeat(" ", indent*d))
		}
	}
	item := ", "
	if indent > 0 {
		item = ","
	}
	switch x := v.(type) {
	case map[string]any:
		if len(x) == 0 {
			b.WriteString("{}")
			return
		}
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(item)
			}
			nl(depth + 1)
			writeString(b, k)
			b.WriteString(": ")
			writePy(b, x[k], indent, depth+1)
		}
		nl(depth)
		b.WriteByte('}')
	case []any:
		if len(x) == 0 {
			b.WriteString("[]")
			return
		}
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(item)
			}
			nl(depth + 1)
			writePy(b, e, indent, depth+1)
		}
		nl(depth)
		b.WriteByte(']')
	case string:
		writeString(b, x)
	case json.Number:
		b.WriteString(x.String())
	case bool:
		b.WriteString(strconv.FormatBool(x))
	case nil:
		b.WriteString("null")
	default:
		raw, _ := marshalNoEscape(x)
		b.Write(raw)
	}
}

func writeString(b *strings.Builder, s string) {
	raw, _ := marshalNoEscape(s)
	b.Write(raw)
}
