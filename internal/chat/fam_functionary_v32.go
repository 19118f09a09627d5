package chat

import (
	"encoding/json"
	"fmt"
	"strings"
)

// functionaryV32: the prompt ends in ">>>"; the reply is "all\ntext" or "NAME\n{...}",
// several joined by ">>>".
type functionaryV32 struct{}

func (functionaryV32) format() Format { return FormatFunctionaryV32 }
func (functionaryV32) detect(has func(...string) bool) bool {
	return has(">>>", "recipient")
}
func (functionaryV32) markers() *markers { return functionaryV32Markers }

var functionaryV32Markers = &markers{triggers: []string{">>>"}, textLead: "all\n"}

func (functionaryV32) parse(ps *parser, text string) Parsed { return ps.functionary32(text) }

func (functionaryV32) grammar(r *callRules) ([]Trigger, bool, error) {
	if !r.safeNames() {
		return nil, false, nil
	}
	return r.setRoot(r.functionary32Family(r.tools, r.parallel))
}

// functionary32: "all\ntext" or "NAME\n{...}" segments joined by ">>>".
func (ps *parser) functionary32(text string) Parsed {
	var p Parsed
	var content []string
	for _, seg := range strings.Split(text, ">>>") {
		if strings.TrimSpace(seg) == "" {
			continue
		}
		name, body, ok := strings.Cut(seg, "\n")
		name = strings.TrimSpace(name)
		switch {
		case !ok || name == "all" || strings.ContainsAny(name, " {}\"") || name == "":
			if name == "all" {
				content = append(content, body)
			} else {
				content = append(content, seg)
			}
		default:
			args := strings.TrimSpace(body)
			if name == "python" && !strings.HasPrefix(args, "{") {
				a, _ := marshalNoEscape(map[string]string{"code": args})
				args = string(a)
			}
			if !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
				return Parsed{Content: strings.TrimSpace(text)}
			}
			p.Calls = append(p.Calls, ps.call(name, args, ""))
		}
	}
	p.Content = strings.TrimSpace(strings.Join(content, "\n"))
	return p
}

// functionary32Family: after the prompt's ">>>" the reply names its recipient on the
// first line, "all" for text; a call is "NAME\n{...}", later ones after ">>>". As in
// llama.cpp, a pattern per tool fires once "NAME\n{" starts the reply or follows ">>>",
// and the grammar starts at the name.
func (c *gbnf) functionary32Family(tools []Tool, parallel bool) (string, []Trigger, bool, error) {
	c.ban = ">>>" // the parser splits the reply there
	args, err := c.toolArgs(tools)
	if err != nil {
		return "", nil, false, err
	}
	if !objectArgs(tools) {
		return "", nil, false, nil
	}
	c.prim("space")
	var alts []string
	var triggers []Trigger
	for i, t := range tools {
		alts = append(alts, fmt.Sprintf(`%s %s`, q(t.Function.Name+"\n"), args[i]))
		triggers = append(triggers, Trigger{Pattern: `(?:[\s\S]*?>>>)?(` + regexQuote(t.Function.Name) + `\n)\{[\s\S]*`})
	}
	call := c.define("call", strings.Join(alts, " | "))
	root := call
	if parallel {
		root += ` ( ">>>" call )*`
	}
	return root, triggers, true, nil
}
