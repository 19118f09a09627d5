package chat

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/polykv/polykv/internal/chat/jinja"
)

// orderedJSON decodes JSON into template values keeping object keys in document order
// (Go maps would lose it; transformers keeps the client's order, and prompts must not
// change from run to run). Integers stay integers, as in Python's json.
func orderedJSON(b []byte) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	v, err := decodeValue(dec)
	if err != nil {
		return jinja.Undefined(), err
	}
	if _, err := dec.Token(); err == nil {
		return jinja.Undefined(), errors.New("trailing data after JSON value")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder) (jinja.Value, error) {
	tok, err := dec.Token()
	if err != nil {
		return jinja.Undefined(), err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			v := jinja.NewDict()
			d := v.AsDict()
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return jinja.Undefined(), err
				}
				k, _ := kt.(string)
				val, err := decodeValue(dec)
				if err != nil {
					return jinja.Undefined(), err
				}
				d.Set(k, val)
			}
			_, err := dec.Token() // '}'
			return v, err
		case '[':
			var items []jinja.Value
			for dec.More() {
				val, err := decodeValue(dec)
				if err != nil {
					return jinja.Undefined(), err
				}
				items = append(items, val)
			}
			_, err := dec.Token() // ']'
			if items == nil {
				items = []jinja.Value{}
			}
			return jinja.NewList(items), err
		}
	case string:
		return jinja.NewString(t), nil
	case json.Number:
		return jinja.FromGoValue(t), nil
	case bool:
		return jinja.NewBool(t), nil
	case nil:
		return jinja.None(), nil
	}
	return jinja.Undefined(), fmt.Errorf("unexpected JSON token %v", tok)
}

// raisedError carries a template's raise_exception message.
type raisedError struct{ msg string }

func (e raisedError) Error() string { return "raise_exception: " + e.msg }

func isRaised(err error) bool {
	var r raisedError
	return errors.As(err, &r) || strings.Contains(err.Error(), "raise_exception: ")
}

func raisedMessage(err error) string {
	var r raisedError
	if errors.As(err, &r) {
		return r.msg
	}
	s := err.Error()
	if i := strings.Index(s, "raise_exception: "); i >= 0 {
		return s[i+len("raise_exception: "):]
	}
	return s
}

// strftime formats the subset of C strftime HF templates use (%Y %m %d %e %B %b %H %M %S %A %a %j %y %p %I %%).
func strftime(t time.Time, f string) string {
	var b strings.Builder
	for i := 0; i < len(f); i++ {
		if f[i] != '%' || i+1 == len(f) {
			b.WriteByte(f[i])
			continue
		}
		i++
		switch f[i] {
		case 'Y':
			fmt.Fprintf(&b, "%04d", t.Year())
		case 'y':
			fmt.Fprintf(&b, "%02d", t.Year()%100)
		case 'm':
			fmt.Fprintf(&b, "%02d", int(t.Month()))
		case 'd':
			fmt.Fprintf(&b, "%02d", t.Day())
		case 'e':
			fmt.Fprintf(&b, "%2d", t.Day())
		case 'B':
			b.WriteString(t.Month().String())
		case 'b':
			b.WriteString(t.Month().String()[:3])
		case 'H':
			fmt.Fprintf(&b, "%02d", t.Hour())
		case 'I':
			h := t.Hour() % 12
			if h == 0 {
				h = 12
			}
			fmt.Fprintf(&b, "%02d", h)
		case 'p':
			if t.Hour() < 12 {
				b.WriteString("AM")
			} else {
				b.WriteString("PM")
			}
		case 'M':
			fmt.Fprintf(&b, "%02d", t.Minute())
		case 'S':
			fmt.Fprintf(&b, "%02d", t.Second())
		case 'A':
			b.WriteString(t.Weekday().String())
		case 'a':
			b.WriteString(t.Weekday().String()[:3])
		case 'j':
			fmt.Fprintf(&b, "%03d", t.YearDay())
		case '%':
			b.WriteByte('%')
		default:
			b.WriteByte('%')
			b.WriteByte(f[i])
		}
	}
	return b.String()
}

// marshalNoEscape is json.Marshal without HTML escaping (GBNF literals must keep <>&).
func marshalNoEscape(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimRight(buf.Bytes(), "\n"), nil
}
