package chat

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
)

// Format is a model family's way of writing tool calls.
type Format string

// Tool-call formats, one per family the template reveals (DetectFormat).
const (
	// FormatHermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes 2
	// Pro/3, Qwen 2.5/3, Granite 4, and PolyKV's injected prompt for templates without
	// tool support).
	FormatHermes Format = "hermes"
	// FormatQwenXML: <tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>
	// (Qwen3-Coder, Qwen 3.5).
	FormatQwenXML Format = "qwen3_coder_xml"
	// FormatLlama3: a JSON object {"name": ..., "parameters": {...}}, optionally after
	// <|python_tag|>, possibly with text around it.
	FormatLlama3 Format = "llama3"
	// FormatMistral: [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...] (Mistral Nemo).
	FormatMistral Format = "mistral"
	// FormatMistralArgs: [TOOL_CALLS]NAME[ARGS]{...} per call, optionally with
	// [CALL_ID]ID before [ARGS] (Mistral Small 3.2, Devstral, Ministral 3, Magistral).
	FormatMistralArgs Format = "mistral_args"
	// FormatHarmony: GPT-OSS channels; a call is a commentary message to=functions.NAME.
	FormatHarmony Format = "gpt_oss_harmony"
	// FormatDeepSeek: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>... (R1: "function<｜tool▁sep｜>NAME\n```json\n{...}\n```";
	// V3.1: "NAME<｜tool▁sep｜>{...}").
	FormatDeepSeek Format = "deepseek"
	// FormatDeepSeekDSML: DeepSeek V3.2's <｜DSML｜function_calls> XML.
	FormatDeepSeekDSML Format = "deepseek_v3_2_dsml"
	// FormatKimiK2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>...
	FormatKimiK2 Format = "kimi_k2"
	// FormatGLM: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> (GLM 4.5+).
	FormatGLM Format = "glm_4_5"
	// FormatMiniMax: <minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke></minimax:tool_call>.
	FormatMiniMax Format = "minimax_m2"
	// FormatGranite: <|tool_call|>[{"name": ..., "arguments": {...}}] (Granite 3.x).
	FormatGranite Format = "granite"
	// FormatCommandR7B: <|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>.
	FormatCommandR7B Format = "command_r7b"
	// FormatFunctionaryV31: <function=NAME>{...}</function>, or <|python_tag|>code.
	FormatFunctionaryV31 Format = "functionary_v3_1"
	// FormatFunctionaryV32: the prompt ends in ">>>"; the reply is "all\ntext" or
	// "NAME\n{...}", several joined by ">>>".
	FormatFunctionaryV32 Format = "functionary_v3_2"
	// FormatLFM2: <|tool_call_start|>[name(k="v", n=1), ...]<|tool_call_end|> (Python call syntax).
	FormatLFM2 Format = "lfm2"
)

// Parsed is a reply split into what the client sees.
type Parsed struct {
	Content   string
	Reasoning string
	Calls     []ToolCall
	// Truncated: the calls were streamed in part and did not finish (their arguments
	// are what was sent, not necessarily complete JSON).
	Truncated bool
}

// Parse splits generated text into content and tool calls. Text that is not a
// well-formed call (malformed JSON, no name, an unterminated block that does not parse)
// stays content: a parser must never lose what the model said.
func Parse(f Format, text string) (string, []ToolCall) {
	p := ParseWith(f, text, nil)
	return p.Content, p.Calls
}

// ParseWith parses with the declared tools at hand: XML-style formats write argument
// values as bare text, and a parameter declared as a string stays a string even when
// it looks like a number.
func ParseWith(f Format, text string, tools []Tool) Parsed {
	ps := parser{format: f, tools: tools}
	fam := lookup(f)
	p := fam.parse(&ps, text)
	if _, isHermes := fam.(hermes); !isHermes && len(p.Calls) == 0 {
		// A grammar-forced call is written in Hermes tags when the format has no
		// grammar of its own (CallGrammar): accept it in every format.
		if h := ps.blocks(text, "<tool_call>", "</tool_call>", ps.hermes); len(h.Calls) > 0 {
			p = h
		}
	}
	return p
}

type parser struct {
	format Format
	tools  []Tool
	n      int // calls so far, for ids that number them
}

// blocks parses every open...close block with body; an unterminated last block is
// parsed too (generation may stop at the close tag, a stop string). A body that does
// not parse stays content.
func (ps *parser) blocks(text, open, close string, body func(string) (ToolCall, bool)) Parsed {
	var content strings.Builder
	var calls []ToolCall
	rest := text
	for {
		i := strings.Index(rest, open)
		if i < 0 {
			content.WriteString(rest)
			break
		}
		inner := rest[i+len(open):]
		j := strings.Index(inner, close)
		end := len(inner)
		if j >= 0 {
			end = j
		}
		call, ok := body(inner[:end])
		stop := i + len(open) + end
		if j >= 0 {
			stop += len(close)
		}
		if !ok {
			content.WriteString(rest[:stop])
			rest = rest[stop:]
			continue
		}
		content.WriteString(rest[:i])
		calls = append(calls, call)
		rest = rest[stop:]
	}
	return Parsed{Content: strings.TrimSpace(content.String()), Calls: calls}
}

// section parses a calls section (open ... close) holding call blocks; text outside
// the section is content.
func (ps *parser) section(text, open, close, callOpen, callClose string, body func(string) (ToolCall, bool)) Parsed {
	before, inner, after, ok := cutSection(text, open, close)
	if !ok {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	p := ps.blocks(inner, callOpen, callClose, body)
	if len(p.Calls) == 0 || strings.TrimSpace(p.Content) != "" {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	return Parsed{Content: strings.TrimSpace(before + after), Calls: p.Calls}
}

// cutSection splits text at its first open into what precedes it, what follows it up
// to close (to the end when close never comes: a reply cut short) and what follows
// close; ok is false when text has no open.
func cutSection(text, open, close string) (before, inner, after string, ok bool) {
	before, inner, ok = strings.Cut(text, open)
	if !ok {
		return text, "", "", false
	}
	if in, af, found := strings.Cut(inner, close); found {
		inner, after = in, af
	}
	return before, inner, after, true
}

func (ps *parser) id(fromModel string) string {
	ps.n++
	if fromModel != "" {
		return fromModel
	}
	return NewCallIDFor(ps.format)
}

func (ps *parser) call(name, args, id string) ToolCall {
	return ToolCall{ID: ps.id(id), Type: "function", Function: FunctionCall{Name: name, Arguments: args}}
}

// callFromJSON reads {"name": ..., <argsKey>: {...}|"..."} with nothing after it.
// The arguments are kept as the model wrote them (an object's JSON text), so what
// streamed is what the final message holds.
func (ps *parser) callFromJSON(s string, argsKeys ...string) (ToolCall, bool) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal([]byte(strings.TrimSpace(s)), &obj); err != nil {
		return ToolCall{}, false
	}
	return ps.callFromObject(obj, "name", argsKeys...)
}

func (ps *parser) callFromObject(obj map[string]json.RawMessage, nameKey string, argsKeys ...string) (ToolCall, bool) {
	var name string
	if err := json.Unmarshal(obj[nameKey], &name); err != nil || name == "" {
		return ToolCall{}, false
	}
	args := "{}"
	for _, k := range argsKeys {
		raw, ok := obj[k]
		if !ok {
			continue
		}
		a, ok := argsText(raw)
		if !ok {
			return ToolCall{}, false
		}
		args = a
		break
	}
	var id string
	if raw, ok := obj["id"]; ok {
		_ = json.Unmarshal(raw, &id)
	}
	return ps.call(name, args, id), true
}

// argsText is the arguments' JSON text: an object as written, or a JSON string that
// holds an object.
func argsText(raw json.RawMessage) (string, bool) {
	raw = bytes.TrimSpace(raw)
	var str string
	if json.Unmarshal(raw, &str) == nil {
		if json.Valid([]byte(str)) && strings.HasPrefix(strings.TrimSpace(str), "{") {
			return strings.TrimSpace(str), true
		}
		return "", false
	}
	if len(raw) == 0 || raw[0] != '{' || !json.Valid(raw) {
		return "", false
	}
	return string(raw), true
}

// known reports whether name is a declared tool (any name when none were given).
func (ps *parser) known(name string) bool {
	if len(ps.tools) == 0 {
		return true
	}
	for _, t := range ps.tools {
		if t.Function.Name == name {
			return true
		}
	}
	return false
}

// jsonList: MARKER[{...}, ...]END.
func (ps *parser) jsonList(text, marker, end string, argsKeys ...string) Parsed {
	i := strings.Index(text, marker)
	if i < 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	body := text[i+len(marker):]
	after := ""
	if end != "" {
		if j := strings.Index(body, end); j >= 0 {
			body, after = body[:j], body[j+len(end):]
		}
	}
	dec := json.NewDecoder(strings.NewReader(body))
	var arr []map[string]json.RawMessage
	if err := dec.Decode(&arr); err != nil || len(arr) == 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	after = body[dec.InputOffset():] + after
	var calls []ToolCall
	for _, obj := range arr {
		c, ok := ps.callFromObject(obj, "name", argsKeys...)
		if !ok {
			return Parsed{Content: strings.TrimSpace(text)}
		}
		calls = append(calls, c)
	}
	return Parsed{Content: strings.TrimSpace(text[:i] + after), Calls: calls}
}

// xmlInvoke parses name="NAME">(<{ns}parameter name="K" [string="true|false"]>V</{ns}parameter>)*
// (MiniMax M2 with ns "", DeepSeek V3.2 DSML with ns "｜DSML｜").
func (ps *parser) xmlInvoke(ns string) func(string) (ToolCall, bool) {
	popen, pclose := "<"+ns+"parameter ", "</"+ns+"parameter>"
	return func(body string) (ToolCall, bool) {
		name, ok := between(body, `name="`, `"`)
		if !ok || name == "" {
			return ToolCall{}, false
		}
		_, rest, ok := strings.Cut(body, ">")
		if !ok {
			return ToolCall{}, false
		}
		args := newArgs(ps.schemaFor(name))
		for {
			r := strings.TrimSpace(rest)
			if r == "" {
				break
			}
			r, ok = strings.CutPrefix(r, popen)
			if !ok {
				return ToolCall{}, false
			}
			attrs, r, ok := strings.Cut(r, ">")
			if !ok {
				return ToolCall{}, false
			}
			k, ok := between(attrs, `name="`, `"`)
			if !ok {
				return ToolCall{}, false
			}
			v, after, ok := strings.Cut(r, pclose)
			if !ok {
				return ToolCall{}, false
			}
			v = strings.TrimPrefix(strings.TrimSuffix(v, "\n"), "\n")
			switch {
			case strings.Contains(attrs, `string="true"`):
				args.addString(k, v)
			case strings.Contains(attrs, `string="false"`):
				if !json.Valid([]byte(strings.TrimSpace(v))) {
					return ToolCall{}, false
				}
				args.addJSON(k, strings.TrimSpace(v))
			default:
				args.add(k, v)
			}
			rest = after
		}
		return ps.call(name, args.String(), ""), true
	}
}

// between returns the text between the first open and the next close.
func between(s, open, close string) (string, bool) {
	i := strings.Index(s, open)
	if i < 0 {
		return "", false
	}
	rest := s[i+len(open):]
	j := strings.Index(rest, close)
	if j < 0 {
		return "", false
	}
	return rest[:j], true
}

// schemaFor returns how each parameter's text value is read (xmlParamType): "string"
// for strings (a string enum or const too), "nullable-string" for a string or null,
// else the declared type, "" when none.
func (ps *parser) schemaFor(name string) map[string]string {
	for _, t := range ps.tools {
		if t.Function.Name != name {
			continue
		}
		out := map[string]string{}
		node, err := parseOrdered(t.Function.Parameters)
		if err != nil {
			return out
		}
		o, ok := node.(*ordered)
		if !ok {
			return out
		}
		props, ok := o.vals["properties"].(*ordered)
		if !ok {
			return out
		}
		for _, k := range props.keys {
			if ty := xmlParamType(node, props.vals[k]); ty != "" {
				out[k] = ty
			}
		}
		return out
	}
	return nil
}

// argsBuilder writes a JSON arguments object from key/value text, in the model's order.
type argsBuilder struct {
	types map[string]string
	b     strings.Builder
	n     int
}

func newArgs(types map[string]string) *argsBuilder { return &argsBuilder{types: types} }

func (a *argsBuilder) key(k string) {
	if a.n == 0 {
		a.b.WriteByte('{')
	} else {
		a.b.WriteString(", ")
	}
	a.n++
	kb, _ := marshalNoEscape(k)
	a.b.Write(kb)
	a.b.WriteString(": ")
}

func (a *argsBuilder) addString(k, v string) {
	a.key(k)
	vb, _ := marshalNoEscape(v)
	a.b.Write(vb)
}

func (a *argsBuilder) addJSON(k, raw string) {
	a.key(k)
	var buf bytes.Buffer
	if json.Compact(&buf, []byte(raw)) == nil {
		a.b.Write(buf.Bytes())
	} else {
		a.b.WriteString(raw)
	}
}

// add writes v as a string when the schema says so (or v is not JSON), else as JSON.
func (a *argsBuilder) add(k, v string) {
	switch a.types[k] {
	case "string":
		a.addString(k, v)
		return
	case "nullable-string":
		if strings.TrimSpace(v) == "null" {
			a.addJSON(k, "null")
		} else {
			a.addString(k, v)
		}
		return
	}
	t := strings.TrimSpace(v)
	if t != "" && json.Valid([]byte(t)) && (a.types[k] != "" || !strings.HasPrefix(t, "\"")) {
		a.addJSON(k, t)
		return
	}
	a.addString(k, v)
}

func (a *argsBuilder) String() string {
	if a.n == 0 {
		return "{}"
	}
	return a.b.String() + "}"
}

// NewCallID returns an OpenAI-style tool call id.
func NewCallID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "call_" + hex.EncodeToString(b[:])
}

const alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

// NewCallIDFor returns a tool-call id in the form the family's template requires on
// the next turn: Mistral's templates raise unless an id is 9 letters and digits.
func NewCallIDFor(f Format) string {
	if lookup(f).markers().shortIDs {
		var b [9]byte
		_, _ = rand.Read(b[:])
		for i := range b {
			b[i] = alnum[int(b[i])%len(alnum)]
		}
		return string(b[:])
	}
	return NewCallID()
}

// CallSchema is the JSON schema of one call to any of tools (name + arguments), in
// the format's key names. It is written by hand so "name" comes before the arguments:
// the grammar keeps schema order, and a model should name the function first.
func CallSchema(f Format, tools []Tool) ([]byte, error) {
	argsKey := lookup(f).markers().argsKey
	if argsKey == "" {
		argsKey = "arguments"
	}
	var alts []string
	for _, t := range tools {
		name, _ := json.Marshal(t.Function.Name)
		params := []byte(`{"type": "object", "properties": {}}`)
		if p := bytes.TrimSpace(t.Function.Parameters); len(p) > 0 && string(p) != "null" {
			params = p
		}
		alts = append(alts, fmt.Sprintf(`{"type": "object", "properties": {"name": {"const": %s}, %q: %s}, "required": ["name", %q]}`, name, argsKey, params, argsKey))
	}
	switch len(alts) {
	case 0:
		return nil, fmt.Errorf("no tools to call")
	case 1:
		return []byte(alts[0]), nil
	}
	return []byte(`{"anyOf": [` + strings.Join(alts, ", ") + `]}`), nil
}

// CallGrammar wraps a GBNF grammar for one call (whose start rule is root) in the
// format's delimiters: the model can then only emit well-formed calls, then stop.
// Formats without a JSON-object call syntax of their own are forced into Hermes tags,
// which every format's parser accepts.
func CallGrammar(f Format, callGBNF string, parallel bool) string {
	g := renameRoot(callGBNF, "tool-call-json")
	if w, ok := lookup(f).(callWrapper); ok {
		return w.wrapCall("tool-call-json", parallel) + g
	}
	more := ""
	if parallel {
		more = ` ("\n" "<tool_call>" tool-call-json "</tool_call>")*`
	}
	return fmt.Sprintf("root ::= \"<tool_call>\" tool-call-json \"</tool_call>\"%s\n%s", more, g)
}

// renameRoot renames the grammar's root rule so it can be embedded.
func renameRoot(g, name string) string {
	lines := strings.Split(g, "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "root ::=") {
			lines[i] = name + " ::=" + strings.TrimPrefix(l, "root ::=")
		}
	}
	out := strings.Join(lines, "\n")
	if !strings.Contains(out, "space ::=") {
		out += "\nspace ::= | \" \" | \"\\n\" [ \\t]{0,20}\n"
	}
	return out
}
