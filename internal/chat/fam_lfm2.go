package chat

import (
	"fmt"
	"strings"
)

// lfm2: <|tool_call_start|>[name(k="v", n=1), ...]<|tool_call_end|> (Python call syntax,
// pythonic.go).
type lfm2 struct{}

func (lfm2) format() Format { return FormatLFM2 }
func (lfm2) detect(has func(...string) bool) bool {
	return has("<|tool_call_start|>") || has("<|tool_list_start|>")
}
func (lfm2) markers() *markers { return lfm2Markers }

var lfm2Markers = &markers{triggers: []string{"<|tool_call_start|>"}}

func (lfm2) parse(ps *parser, text string) Parsed { return ps.lfm2(text) }

func (lfm2) grammar(r *callRules) ([]Trigger, bool, error) {
	if !r.safeNames() {
		return nil, false, nil
	}
	return r.setRoot(r.lfm2Family(r.tools, r.parallel))
}

// lfm2: <|tool_call_start|>[name(k="v", n=1), other()]<|tool_call_end|>.
func (ps *parser) lfm2(text string) Parsed {
	const open, close = "<|tool_call_start|>", "<|tool_call_end|>"
	before, body, after, ok := cutSection(text, open, close)
	if !ok {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	calls, ok := parsePythonCalls(strings.TrimSpace(body))
	if !ok || len(calls) == 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	p := Parsed{Content: strings.TrimSpace(before + after)}
	for _, c := range calls {
		p.Calls = append(p.Calls, ps.call(c.name, c.args, ""))
	}
	return p
}

// lfm2Family: <|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|> with
// Python literals (parsePythonCalls).
func (c *gbnf) lfm2Family(tools []Tool, parallel bool) (string, []Trigger, bool, error) {
	c.py = true
	var calls []string
	for i, t := range tools {
		props, required, ok := topProperties(t)
		if !ok {
			return "", nil, false, nil
		}
		c.root, c.refNS = props.root, fmt.Sprintf("t%d-", i)
		var req, opt []string
		for _, k := range props.keys {
			if !safeName.MatchString(k) {
				return "", nil, false, nil
			}
			v, err := c.visit(props.vals[k], c.fresh(fmt.Sprintf("t%d-p-%s", i, sanitize(k))))
			if err != nil {
				return "", nil, false, fmt.Errorf("tool %q: %w", t.Function.Name, err)
			}
			kv := fmt.Sprintf(`%s space %s`, q(k+"="), v)
			if required[k] {
				req = append(req, kv)
			} else {
				opt = append(opt, kv)
			}
		}
		c.prim("space")
		calls = append(calls, c.define(fmt.Sprintf("call-%d", i), fmt.Sprintf(`%s space %s ")"`, q(t.Function.Name+"("), c.members(req, opt, fmt.Sprintf("t%d-rest", i)))))
	}
	call := c.define("call", strings.Join(calls, " | "))
	list := call
	if parallel {
		list += ` ( "," space call )*`
	}
	return fmt.Sprintf(`"<|tool_call_start|>" "[" %s "]" "<|tool_call_end|>"`, list), []Trigger{{Word: "<|tool_call_start|>"}}, true, nil
}
