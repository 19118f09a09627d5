package chat

import (
	"strconv"
	"strings"
)

// pyCall is one call in Python syntax, its keyword arguments as a JSON object.
type pyCall struct{ name, args string }

// parsePythonCalls reads "[f(a=1, b='x'), g()]" (or one call without brackets), the
// call syntax LFM2 writes. Literals: strings, numbers, True/False/None, lists and
// dicts of them. Anything else (expressions, positional arguments) is not a call.
func parsePythonCalls(s string) ([]pyCall, bool) {
	p := &pyParser{s: s}
	p.ws()
	bracket := p.eat('[')
	var out []pyCall
	for {
		p.ws()
		if bracket && p.eat(']') {
			break
		}
		if !bracket && p.i == len(p.s) {
			break
		}
		name := p.ident()
		if name == "" {
			return nil, false
		}
		p.ws()
		if !p.eat('(') {
			return nil, false
		}
		args := newArgs(nil)
		for {
			p.ws()
			if p.eat(')') {
				break
			}
			k := p.ident()
			p.ws()
			if k == "" || !p.eat('=') {
				return nil, false
			}
			v, ok := p.literal()
			if !ok {
				return nil, false
			}
			args.addJSON(k, v)
			p.ws()
			if p.eat(',') {
				continue
			}
			if p.eat(')') {
				break
			}
			return nil, false
		}
		out = append(out, pyCall{name: name, args: args.String()})
		p.ws()
		if p.eat(',') {
			continue
		}
		if bracket {
			p.ws()
			if !p.eat(']') {
				return nil, false
			}
			break
		}
	}
	p.ws()
	return out, p.i == len(p.s)
}

type pyParser struct {
	s string
	i int
}

func (p *pyParser) ws() {
	for p.i < len(p.s) && strings.ContainsRune(" \t\r\n", rune(p.s[p.i])) {
		p.i++
	}
}

func (p *pyParser) eat(c byte) bool {
	if p.i < len(p.s) && p.s[p.i] == c {
		p.i++
		return true
	}
	return false
}

func (p *pyParser) ident() string {
	start := p.i
	for p.i < len(p.s) {
		c := p.s[p.i]
		if c == '_' || c == '.' || c == '-' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || p.i > start && c >= '0' && c <= '9' {
			p.i++
			continue
		}
		break
	}
	return p.s[start:p.i]
}

// literal returns the JSON text of a Python literal.
func (p *pyParser) literal() (string, bool) {
	p.ws()
	if p.i >= len(p.s) {
		return "", false
	}
	switch c := p.s[p.i]; {
	case c == '"' || c == '\'':
		return p.str()
	case c == '[':
		p.i++
		var items []string
		for {
			p.ws()
			if p.eat(']') {
				return "[" + strings.Join(items, ", ") + "]", true
			}
			v, ok := p.literal()
			if !ok {
				return "", false
			}
			items = append(items, v)
			p.ws()
			if !p.eat(',') {
				p.ws()
				if !p.eat(']') {
					return "", false
				}
				return "[" + strings.Join(items, ", ") + "]", true
			}
		}
	case c == '{':
		p.i++
		var items []string
		for {
			p.ws()
			if p.eat('}') {
				return "{" + strings.Join(items, ", ") + "}", true
			}
			k, ok := p.str()
			if !ok {
				return "", false
			}
			p.ws()
			if !p.eat(':') {
				return "", false
			}
			v, ok := p.literal()
			if !ok {
				return "", false
			}
			items = append(items, k+": "+v)
			p.ws()
			if !p.eat(',') {
				p.ws()
				if !p.eat('}') {
					return "", false
				}
				return "{" + strings.Join(items, ", ") + "}", true
			}
		}
	default:
		start := p.i
		for p.i < len(p.s) && strings.IndexByte(",)]} \t\n", p.s[p.i]) < 0 {
			p.i++
		}
		tok := p.s[start:p.i]
		switch tok {
		case "True":
			return "true", true
		case "False":
			return "false", true
		case "None":
			return "null", true
		}
		if _, err := strconv.ParseFloat(tok, 64); err == nil {
			return tok, true
		}
		return "", false
	}
}

// str reads a quoted Python string and returns it JSON-encoded.
func (p *pyParser) str() (string, bool) {
	if p.i >= len(p.s) {
		return "", false
	}
	q := p.s[p.i]
	if q != '"' && q != '\'' {
		return "", false
	}
	p.i++
	var b strings.Builder
	for p.i < len(p.s) {
		c := p.s[p.i]
		switch {
		case c == q:
			p.i++
			out, _ := marshalNoEscape(b.String())
			return string(out), true
		case c == '\\' && p.i+1 < len(p.s):
			p.i++
			switch e := p.s[p.i]; e {
			case 'n':
				b.WriteByte('\n')
			case 't':
				b.WriteByte('\t')
			case 'r':
				b.WriteByte('\r')
			default:
				b.WriteByte(e)
			}
			p.i++
		default:
			b.WriteByte(c)
			p.i++
		}
	}
	return "", false
}
