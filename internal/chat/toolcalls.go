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
	switch {
	case has("DSML"):
		return FormatDeepSeekDSML
	case has("tool▁calls▁begin"), has("tool▁call▁begin"):
		return FormatDeepSeek
	case has("<|tool_calls_section_begin|>"):
		return FormatKimiK2
	case has("<arg_key>"):
		return FormatGLM
	case has("<minimax:tool_call>"):
		return FormatMiniMax
	case has("<function=", "<parameter="):
		return FormatQwenXML
	case has("<|channel|>", "<|call|>"):
		return FormatHarmony
	case has("[TOOL_CALLS]", "[ARGS]"):
		return FormatMistralArgs
	case has("[TOOL_CALLS]"):
		return FormatMistral
	case has("<|START_ACTION|>"):
		return FormatCommandR7B
	case has(">>>", "recipient"):
		return FormatFunctionaryV32
	case has("<function="):
		return FormatFunctionaryV31
	case has("<|tool_call_start|>"), has("<|tool_list_start|>"):
		return FormatLFM2
	case has("<|tool_call|>"):
		return FormatGranite
	case has("<|python_tag|>"), has("ipython"):
		return FormatLlama3
	}
	return FormatHermes
}

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
	var p Parsed
	switch f {
	case FormatQwenXML:
		p = ps.blocks(text, "<tool_call>", "</tool_call>", ps.qwenXML)
	case FormatLlama3:
		p = ps.llama3(text)
	case FormatMistral:
		p = ps.mistral(text)
	case FormatMistralArgs:
		p = ps.mistralArgs(text)
	case FormatHarmony:
		p = ps.harmony(text)
	case FormatDeepSeek:
		p = ps.section(text, "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", ps.deepseek)
	case FormatDeepSeekDSML:
		p = ps.section(text, "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", "<｜DSML｜invoke ", "</｜DSML｜invoke>", ps.xmlInvoke("｜DSML｜"))
	case FormatKimiK2:
		p = ps.section(text, "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>", ps.kimi)
	case FormatGLM:
		p = ps.blocks(text, "<tool_call>", "</tool_call>", ps.glm)
	case FormatMiniMax:
		p = ps.section(text, "<minimax:tool_call>", "</minimax:tool_call>", "<invoke ", "</invoke>", ps.xmlInvoke(""))
	case FormatGranite:
		p = ps.jsonList(text, "<|tool_call|>", "", "arguments")
	case FormatCommandR7B:
		p = ps.commandR(text)
	case FormatFunctionaryV31:
		p = ps.blocks(text, "<function=", "</function>", ps.functionary31)
		if len(p.Calls) == 0 {
			p = ps.pythonTag(text)
		}
	case FormatFunctionaryV32:
		p = ps.functionary32(text)
	case FormatLFM2:
		p = ps.lfm2(text)
	default:
		p = ps.blocks(text, "<tool_call>", "</tool_call>", ps.hermes)
	}
	if f != FormatHermes && len(p.Calls) == 0 {
		// A grammar-forced call is written in Hermes tags when the format has no
		// grammar of its own (CallGrammar): accept it in every format.
		if h := ps.blocks(text, "<tool_call>", "</tool_call>", ps.hermes); len(h.Calls) > 0 {
			p = h
		}
	}
	if f == FormatHermes && len(p.Calls) == 0 {
		// Models trained on other formats but served with a Hermes prompt sometimes
		// answer with a bare JSON call: accept exactly that and nothing looser.
		if q := ps.bareJSON(text); len(q.Calls) > 0 {
			p = q
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
	i := strings.Index(text, open)
	if i < 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	inner := text[i+len(open):]
	after := ""
	if j := strings.Index(inner, close); j >= 0 {
		inner, after = inner[:j], inner[j+len(close):]
	}
	p := ps.blocks(inner, callOpen, callClose, body)
	if len(p.Calls) == 0 || strings.TrimSpace(p.Content) != "" {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	return Parsed{Content: strings.TrimSpace(text[:i] + after), Calls: p.Calls}
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

// hermes: {"name": ..., "arguments": {...}}.
func (ps *parser) hermes(body string) (ToolCall, bool) {
	return ps.callFromJSON(body, "arguments", "parameters")
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

// bareJSON accepts a reply that is exactly one {"name", "arguments"} object.
func (ps *parser) bareJSON(text string) Parsed {
	t := strings.TrimSpace(text)
	if !strings.HasPrefix(t, "{") {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	if c, ok := ps.callFromJSON(t, "arguments", "parameters"); ok && ps.known(c.Function.Name) {
		return Parsed{Calls: []ToolCall{c}}
	}
	return Parsed{Content: strings.TrimSpace(text)}
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

// llama3: optional <|python_tag|>, then JSON call objects separated by ";" or
// newlines; or one call object inside text.
func (ps *parser) llama3(text string) Parsed {
	t := strings.TrimSpace(text)
	if rest, ok := strings.CutPrefix(t, "<|python_tag|>"); ok {
		t = strings.TrimSpace(rest)
	}
	if strings.HasPrefix(t, "{") {
		var calls []ToolCall
		all := true
		for _, part := range splitJSONObjects(t) {
			c, ok := ps.callFromJSON(part, "parameters", "arguments")
			if !ok {
				all = false
				break
			}
			calls = append(calls, c)
		}
		if all && len(calls) > 0 {
			return Parsed{Calls: calls}
		}
		ps.n = 0
	}
	// Text around one call: the first '{' that starts a call object naming a
	// declared tool.
	for i := strings.IndexByte(text, '{'); i >= 0; {
		dec := json.NewDecoder(strings.NewReader(text[i:]))
		var raw json.RawMessage
		if dec.Decode(&raw) == nil {
			if c, ok := ps.callFromJSON(string(raw), "parameters", "arguments"); ok && ps.known(c.Function.Name) && len(ps.tools) > 0 {
				end := i + int(dec.InputOffset())
				return Parsed{Content: strings.TrimSpace(text[:i] + text[end:]), Calls: []ToolCall{c}}
			}
		}
		k := strings.IndexByte(text[i+1:], '{')
		if k < 0 {
			break
		}
		i += 1 + k
	}
	return Parsed{Content: strings.TrimSpace(text)}
}

// splitJSONObjects splits "{...}; {...}" or "{...}\n{...}" into objects.
func splitJSONObjects(s string) []string {
	dec := json.NewDecoder(strings.NewReader(s))
	var out []string
	for {
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			rest := strings.TrimSpace(s[dec.InputOffset():])
			if rest != "" {
				// A trailing separator like ";" is fine, anything else is not a call list.
				if strings.HasPrefix(rest, ";") {
					return append(out, splitJSONObjects(strings.TrimPrefix(rest, ";"))...)
				}
				return []string{s + "\x00"} // forces a parse failure upstream
			}
			return out
		}
		out = append(out, string(raw))
	}
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

func (ps *parser) mistral(text string) Parsed {
	return ps.jsonList(text, "[TOOL_CALLS]", "", "arguments", "parameters")
}

// mistralArgs: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}, repeated.
func (ps *parser) mistralArgs(text string) Parsed {
	const marker = "[TOOL_CALLS]"
	i := strings.Index(text, marker)
	if i < 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	if strings.HasPrefix(strings.TrimSpace(text[i+len(marker):]), "[") {
		return ps.mistral(text) // older list form
	}
	var calls []ToolCall
	rest := text[i:]
	for strings.HasPrefix(rest, marker) {
		rest = rest[len(marker):]
		j := strings.Index(rest, "[ARGS]")
		if j < 0 {
			return Parsed{Content: strings.TrimSpace(text)}
		}
		name, id := rest[:j], ""
		if k := strings.Index(name, "[CALL_ID]"); k >= 0 {
			name, id = name[:k], name[k+len("[CALL_ID]"):]
		}
		name = strings.TrimSpace(name)
		rest = rest[j+len("[ARGS]"):]
		dec := json.NewDecoder(strings.NewReader(rest))
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil || name == "" {
			return Parsed{Content: strings.TrimSpace(text)}
		}
		args, ok := argsText(raw)
		if !ok {
			return Parsed{Content: strings.TrimSpace(text)}
		}
		calls = append(calls, ps.call(name, args, strings.TrimSpace(id)))
		rest = strings.TrimLeft(rest[dec.InputOffset():], " \n")
	}
	return Parsed{Content: strings.TrimSpace(text[:i] + rest), Calls: calls}
}

// harmony parses GPT-OSS messages: analysis is reasoning, final is content, a
// commentary message to=functions.NAME is a call (its body the arguments).
func (ps *parser) harmony(text string) Parsed {
	if !strings.Contains(text, "<|channel|>") && !strings.Contains(text, "<|message|>") {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	var p Parsed
	var content, reasoning []string
	for _, seg := range strings.Split(text, "<|start|>") {
		h, body, ok := strings.Cut(seg, "<|message|>")
		if !ok {
			if s := strings.TrimSpace(seg); s != "" && s != "assistant" {
				content = append(content, s)
			}
			continue
		}
		for _, end := range []string{"<|end|>", "<|call|>", "<|return|>"} {
			if j := strings.Index(body, end); j >= 0 {
				body = body[:j]
			}
		}
		channel, recipient := "", ""
		for _, f := range strings.Fields(strings.NewReplacer("<|channel|>", " <|channel|>", "<|constrain|>", " <|constrain|>").Replace(h)) {
			switch {
			case strings.HasPrefix(f, "<|channel|>"):
				channel = strings.TrimPrefix(f, "<|channel|>")
			case strings.HasPrefix(f, "to="):
				recipient = strings.TrimPrefix(f, "to=")
			}
		}
		switch {
		case harmonyCallName(recipient) != "":
			args := strings.TrimSpace(body)
			if !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
				return Parsed{Content: strings.TrimSpace(text)}
			}
			p.Calls = append(p.Calls, ps.call(harmonyCallName(recipient), args, ""))
		case channel == "analysis":
			reasoning = append(reasoning, body)
		default:
			content = append(content, body)
		}
	}
	p.Content = strings.TrimSpace(strings.Join(content, "\n"))
	p.Reasoning = strings.TrimSpace(strings.Join(reasoning, "\n"))
	return p
}

// deepseek: "function<｜tool▁sep｜>NAME\n```json\n{...}\n```" (R1) or "NAME<｜tool▁sep｜>{...}" (V3.1).
func (ps *parser) deepseek(body string) (ToolCall, bool) {
	head, args, ok := strings.Cut(body, "<｜tool▁sep｜>")
	if !ok {
		return ToolCall{}, false
	}
	name := strings.TrimSpace(head)
	if name == "function" || name == "" {
		n, rest, ok := strings.Cut(args, "\n")
		if !ok {
			return ToolCall{}, false
		}
		name, args = strings.TrimSpace(n), rest
	}
	args = strings.TrimSpace(args)
	if a, ok := strings.CutPrefix(args, "```json"); ok {
		args = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(a), "```"))
	}
	if name == "" || !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
		return ToolCall{}, false
	}
	return ps.call(name, args, ""), true
}

// kimi: functions.NAME:IDX<|tool_call_argument_begin|>{...}; the id is the model's.
func (ps *parser) kimi(body string) (ToolCall, bool) {
	id, args, ok := strings.Cut(body, "<|tool_call_argument_begin|>")
	if !ok {
		return ToolCall{}, false
	}
	id = strings.TrimSpace(id)
	name := strings.TrimPrefix(id, "functions.")
	if k := strings.LastIndexByte(name, ':'); k >= 0 {
		name = name[:k]
	}
	args = strings.TrimSpace(args)
	if name == "" || !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
		return ToolCall{}, false
	}
	return ps.call(name, args, id), true
}

// glm: NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
func (ps *parser) glm(body string) (ToolCall, bool) {
	name, rest, _ := strings.Cut(body, "<arg_key>")
	name = strings.TrimSpace(name)
	if name == "" || strings.ContainsAny(name, "<>{} \n") {
		return ToolCall{}, false
	}
	args := newArgs(ps.schemaFor(name))
	if rest != "" {
		rest = "<arg_key>" + rest
	}
	for strings.TrimSpace(rest) != "" {
		r := strings.TrimSpace(rest)
		k, ok := between(r, "<arg_key>", "</arg_key>")
		if !ok {
			return ToolCall{}, false
		}
		r = strings.TrimSpace(r[strings.Index(r, "</arg_key>")+len("</arg_key>"):])
		v, ok := between(r, "<arg_value>", "</arg_value>")
		if !ok {
			return ToolCall{}, false
		}
		args.add(k, v)
		rest = r[strings.Index(r, "</arg_value>")+len("</arg_value>"):]
	}
	return ps.call(name, args.String(), ""), true
}

// qwenXML: <function=NAME><parameter=K>\nV\n</parameter>...</function>.
func (ps *parser) qwenXML(body string) (ToolCall, bool) {
	b := strings.TrimSpace(body)
	rest, ok := strings.CutPrefix(b, "<function=")
	if !ok {
		return ToolCall{}, false
	}
	name, rest, ok := strings.Cut(rest, ">")
	if !ok || name == "" {
		return ToolCall{}, false
	}
	rest, _, _ = strings.Cut(rest, "</function>")
	args := newArgs(ps.schemaFor(name))
	for {
		r := strings.TrimSpace(rest)
		if r == "" {
			break
		}
		r, ok = strings.CutPrefix(r, "<parameter=")
		if !ok {
			return ToolCall{}, false
		}
		k, r, ok := strings.Cut(r, ">")
		if !ok {
			return ToolCall{}, false
		}
		v, after, ok := strings.Cut(r, "</parameter>")
		if !ok {
			return ToolCall{}, false
		}
		v = strings.TrimPrefix(v, "\n")
		v = strings.TrimSuffix(v, "\n")
		args.add(k, v)
		rest = after
	}
	return ps.call(name, args.String(), ""), true
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

// commandR: optional <|START_THINKING|>...<|END_THINKING|>, then
// <|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|> or
// <|START_RESPONSE|>text<|END_RESPONSE|>.
func (ps *parser) commandR(text string) Parsed {
	var p Parsed
	if th, ok := between(text, "<|START_THINKING|>", "<|END_THINKING|>"); ok {
		p.Reasoning = strings.TrimSpace(th)
		text = text[strings.Index(text, "<|END_THINKING|>")+len("<|END_THINKING|>"):]
	}
	if r, ok := strings.CutPrefix(strings.TrimSpace(text), "<|START_RESPONSE|>"); ok {
		r, _, _ = strings.Cut(r, "<|END_RESPONSE|>")
		p.Content = strings.TrimSpace(r)
		return p
	}
	i := strings.Index(text, "<|START_ACTION|>")
	if i < 0 {
		p.Content = strings.TrimSpace(text)
		return p
	}
	body := text[i+len("<|START_ACTION|>"):]
	body, after, _ := strings.Cut(body, "<|END_ACTION|>")
	var arr []map[string]json.RawMessage
	if err := json.Unmarshal([]byte(strings.TrimSpace(body)), &arr); err != nil || len(arr) == 0 {
		p.Content = strings.TrimSpace(text)
		return p
	}
	for _, obj := range arr {
		c, ok := ps.callFromObject(obj, "tool_name", "parameters")
		if !ok {
			p.Content = strings.TrimSpace(text)
			p.Calls = nil
			return p
		}
		var id string
		if json.Unmarshal(obj["tool_call_id"], &id) == nil && id != "" {
			c.ID = id
		}
		p.Calls = append(p.Calls, c)
	}
	p.Content = strings.TrimSpace(text[:i] + after)
	return p
}

// functionary31: NAME>{...} (the inside of <function=NAME>{...}</function>).
func (ps *parser) functionary31(body string) (ToolCall, bool) {
	name, args, ok := strings.Cut(body, ">")
	args = strings.TrimSpace(args)
	if !ok || name == "" || !json.Valid([]byte(args)) || !strings.HasPrefix(args, "{") {
		return ToolCall{}, false
	}
	return ps.call(name, args, ""), true
}

// pythonTag: <|python_tag|>code is a call of the "python" tool with {"code": ...}.
func (ps *parser) pythonTag(text string) Parsed {
	i := strings.Index(text, "<|python_tag|>")
	if i < 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	code := strings.TrimSpace(text[i+len("<|python_tag|>"):])
	args, _ := marshalNoEscape(map[string]string{"code": code})
	return Parsed{Content: strings.TrimSpace(text[:i]), Calls: []ToolCall{ps.call("python", string(args), "")}}
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

// lfm2: <|tool_call_start|>[name(k="v", n=1), other()]<|tool_call_end|>.
func (ps *parser) lfm2(text string) Parsed {
	const open, close = "<|tool_call_start|>", "<|tool_call_end|>"
	i := strings.Index(text, open)
	if i < 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	body := text[i+len(open):]
	after := ""
	if j := strings.Index(body, close); j >= 0 {
		body, after = body[:j], body[j+len(close):]
	}
	calls, ok := parsePythonCalls(strings.TrimSpace(body))
	if !ok || len(calls) == 0 {
		return Parsed{Content: strings.TrimSpace(text)}
	}
	p := Parsed{Content: strings.TrimSpace(text[:i] + after)}
	for _, c := range calls {
		p.Calls = append(p.Calls, ps.call(c.name, c.args, ""))
	}
	return p
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
	if f == FormatMistral || f == FormatMistralArgs {
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
	argsKey := "arguments"
	if f == FormatLlama3 {
		argsKey = "parameters"
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
	switch f {
	case FormatMistral:
		more := ""
		if parallel {
			more = ` ("," space tool-call-json)*`
		}
		return fmt.Sprintf("root ::= \"[TOOL_CALLS]\" \"[\" tool-call-json%s \"]\"\n%s", more, g)
	case FormatLlama3:
		return "root ::= tool-call-json\n" + g
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
