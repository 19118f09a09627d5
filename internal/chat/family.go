package chat

import (
	"fmt"
	"regexp"
	"strings"
)

// A toolFamily is everything PolyKV knows about one tool-call format, in one file
// (fam_<name>.go): how its template shows it, the markers its replies use, how a
// whole reply parses, and the grammar that constrains its calls. Detection, parsing,
// streaming and grammars are lookups in the registry below; adding a family is one new
// file and one line in families (docs/chat.md "Adding a family").
type toolFamily interface {
	// format is the family's name (the Format constant).
	format() Format
	// detect reports that a template writes past calls in this family's syntax; has
	// reports that the template contains every one of its arguments. Families are
	// asked in registry order; the first that says yes wins.
	detect(has func(s ...string) bool) bool
	// markers are the texts and shapes a streaming reply is watched for.
	markers() *markers
	// parse splits a whole reply into content and calls (ParseWith adds the
	// fallbacks every family shares).
	parse(ps *parser, text string) Parsed
	// grammar writes the family's call rules into r (rule "root" included) and
	// returns the lazy triggers; ok is false where the tools cannot be written in the
	// family's syntax so that its parser reads them back (the reply stays free).
	grammar(r *callRules) (triggers []Trigger, ok bool, err error)
}

// markers is what the streaming side (CallStream, ReplyStream) reads of a family.
type markers struct {
	// triggers open a call: from the first of them on, text is held for the parser.
	// "<tool_call>" is added to every family's (forced calls use Hermes tags where a
	// family has no grammar of its own: CallGrammar).
	triggers []string
	// head finds, in held text, where a call's name is complete and its JSON
	// arguments begin (group 1 the name, group 2 a model-given id when present), for
	// families whose arguments are JSON written as generated; nil: calls come whole.
	head *regexp.Regexp
	// moreHeads are tried after head and Hermes' (a bare JSON call in Hermes).
	moreHeads []*regexp.Regexp
	// headID reads the call id from head's match (Kimi K2 writes functions.NAME:IDX).
	headID func(match string) string
	// list: the calls are one JSON list; later calls start after the previous "},".
	list bool
	// opensWithJSON: a reply that opens with "{" is a call (bare JSON calls).
	opensWithJSON bool
	// textLead: the reply names its recipient first; one that opens with textLead is
	// text, anything else a call (Functionary v3.2's "all\n").
	textLead string
	// holdAll: replies are structured throughout (channels): held and parsed at the
	// end by a CallStream.
	holdAll bool
	// newStream: the family splits its replies itself as they stream (reasoning,
	// content and calls by channel): Harmony's harmonyStream.
	newStream func(tools []Tool) *harmonyStream
	// streamArgs streams a call's arguments where head cannot (values written as
	// text); it reports false to fall back to the head regexps.
	streamArgs func(c *CallStream, held string) bool
	// responseMarkers are removed from content (Command R7B's response block).
	responseMarkers []string
	// shortIDs: the family's templates require 9-letter-and-digit call ids (Mistral).
	shortIDs bool
	// argsKey is the arguments' key in CallSchema ("arguments" when empty).
	argsKey string
	// thinkTags are the reasoning blocks (open, close) the family's models write as
	// text. A reply is read for every family's tags whatever its format (thinkTags in
	// reasoning.go): the tool-call format a template was detected as does not say which
	// reasoning tags its model writes (Qwen3 thinks in <think> with Hermes calls).
	thinkTags [][2]string
}

// families is the registry, in detection order: a family whose markers contain
// another's comes first (Mistral's [ARGS] form before plain [TOOL_CALLS], Qwen's
// <function=...><parameter=...> before Functionary's <function=...>); Hermes, the
// default, is last and matches any template.
var families = []toolFamily{
	deepseekDSML{}, deepseek{}, kimiK2{}, glm{}, minimax{}, qwenXML{}, harmony{},
	mistralArgs{}, mistral{}, commandR7B{}, functionaryV32{}, functionaryV31{}, lfm2{},
	granite{}, llama3{}, hermes{},
}

var familyOf = func() map[Format]toolFamily {
	m := map[Format]toolFamily{}
	for _, f := range families {
		m[f.format()] = f
	}
	return m
}()

// lookup returns format f's family. A Format DetectFormat never returns gets
// unknownFamily: Hermes-tagged calls are read (as in every family), nothing else.
func lookup(f Format) toolFamily {
	if fam, ok := familyOf[f]; ok {
		return fam
	}
	return unknownFamily{}
}

// unknownFamily is not in the registry: it reads Hermes tags (the forced-call
// fallback every family reads), has no markers of its own and no grammar.
type unknownFamily struct{}

func (unknownFamily) format() Format                   { return "" }
func (unknownFamily) detect(func(...string) bool) bool { return false }
func (unknownFamily) markers() *markers                { return &markers{} }
func (unknownFamily) parse(ps *parser, text string) Parsed {
	return ps.blocks(text, "<tool_call>", "</tool_call>", ps.hermes)
}
func (unknownFamily) grammar(*callRules) ([]Trigger, bool, error) { return nil, false, nil }

// DetectFormat chooses the format from what the template shows: each family's
// template writes past calls the way the model writes new ones.
func DetectFormat(template string) Format {
	has := func(s ...string) bool {
		for _, x := range s {
			if !strings.Contains(template, x) {
				return false
			}
		}
		return true
	}
	for _, f := range families {
		if f.detect(has) {
			return f.format()
		}
	}
	return FormatHermes
}

// callRules is a grammar being built for one family's calls: the GBNF under
// construction, the tools, and the shapes JSON-call families share.
type callRules struct {
	*gbnf
	tools    []Tool
	parallel bool
	// forced: the grammar applies from the reply's first token (ForcedGrammar), so
	// variants only a lazy start needs are left out.
	forced bool
	// args are each tool's argument rule names (jsonArgs).
	args []string
}

// jsonArgs compiles each tool's parameters into rules (args) for families whose
// arguments are a JSON object.
func (r *callRules) jsonArgs() error {
	args, err := r.toolArgs(r.tools)
	if err != nil {
		return err
	}
	r.args = args
	r.prim("space")
	return nil
}

// safeNames: every tool name can be written as is (XML-like and Python-call syntaxes).
func (r *callRules) safeNames() bool {
	for _, t := range r.tools {
		if !safeName.MatchString(t.Function.Name) {
			return false
		}
	}
	return true
}

// alts joins one alternative per tool.
func (r *callRules) alts(each func(i int, name string) string) string {
	var out []string
	for i, t := range r.tools {
		out = append(out, each(i, t.Function.Name))
	}
	return strings.Join(out, " | ")
}

// jsonCall is {"<nameKey>": "NAME", "<argsKey>": ARGS} with the arguments' rule.
func (r *callRules) jsonCall(nameKey, argsKey string) string {
	return r.alts(func(i int, name string) string {
		return fmt.Sprintf(`"{" space %s space ":" space %s space "," space %s space ":" space %s "}" space`,
			q(`"`+nameKey+`"`), q(`"`+name+`"`), q(`"`+argsKey+`"`), r.args[i])
	})
}

// list is "[" item ("," item)* "]", the tail only with parallel.
func (r *callRules) list(item string) string {
	if r.parallel {
		return fmt.Sprintf(`"[" space %s ("," space %s)* "]" space`, item, item)
	}
	return fmt.Sprintf(`"[" space %s "]" space`, item)
}

// more repeats a call rule after the first one when parallel.
func (r *callRules) more(sep, call string) string {
	if r.parallel {
		return fmt.Sprintf(" (%s %s)*", sep, call)
	}
	return ""
}

// nameStart matches a JSON call object's start naming a declared tool (tool names are
// letters, digits, _ and -, none special in a regex).
func (r *callRules) nameStart() string {
	names := make([]string, len(r.tools))
	for i, t := range r.tools {
		names[i] = t.Function.Name
	}
	return `\{\s*"name"\s*:\s*"(?:` + strings.Join(names, "|") + `)"`
}

// callWrapper is implemented by families whose forced fallback call (CallGrammar: one
// JSON call object compiled from CallSchema) is written in their own syntax rather
// than in Hermes tags.
type callWrapper interface {
	wrapCall(callRule string, parallel bool) string
}

// setRoot makes root the grammar's start rule when the family could write the tools.
func (r *callRules) setRoot(root string, triggers []Trigger, ok bool, err error) ([]Trigger, bool, error) {
	if !ok || err != nil {
		return nil, false, err
	}
	r.rules["root"] = root
	return triggers, true, nil
}
