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

// Tool-call formats.
const (
	// FormatHermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen,
	// and PolyKV's injected prompt for templates without tool support).
	FormatHermes Format = "hermes"
	// FormatLlama3: a bare JSON object {"name": ..., "parameters": {...}}, optionally
	// after <|python_tag|>.
	FormatLlama3 Format = "llama3"
	// FormatMistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...].
	FormatMistral Format = "mistral"
)

// DetectFormat chooses the format from what the template shows.
func DetectFormat(template string) Format {
	switch {
	case strings.Contains(template, "[TOOL_CALLS]"):
		return FormatMistral
	case strings.Contains(template, "<|python_tag|>") || strings.Contains(template, "ipython"):
		return FormatLlama3
	}
	return FormatHermes
}

// Parse splits generated text into content and tool calls. Text that is not a
// well-formed call (malformed JSON, no name, an unterminated block that does not parse)
// stays content: a parser must never lose what the model said.
func Parse(f Format, text string) (string, []ToolCall) {
	switch f {
	case FormatMistral:
		return parseMistral(text)
	case FormatLlama3:
		return parseLlama3(text)
	}
	return parseHermes(text)
}

const (
	hermesOpen  = "<tool_call>"
	hermesClose = "</tool_call>"
)

func parseHermes(text string) (string, []ToolCall) {
	var content strings.Builder
	var calls []ToolCall
	rest := text
	for {
		i := strings.Index(rest, hermesOpen)
		if i < 0 {
			content.WriteString(rest)
			break
		}
		body := rest[i+len(hermesOpen):]
		j := strings.Index(body, hermesClose)
		end := len(body)
		if j >= 0 {
			end = j
		}
		call, ok := callFromJSON(body[:end], "arguments")
		if !ok {
			// Not a call: keep the text as it was and look for the next block.
			stop := i + len(hermesOpen) + end
			if j >= 0 {
				stop += len(hermesClose)
			}
			content.WriteString(rest[:stop])
			rest = rest[stop:]
			continue
		}
		content.WriteString(rest[:i])
		calls = append(calls, call)
		if j < 0 {
			break
		}
		rest = body[j+len(hermesClose):]
	}
	return strings.TrimSpace(content.String()), calls
}

func parseLlama3(text string) (string, []ToolCall) {
	t := strings.TrimSpace(text)
	t = strings.TrimSpace(strings.TrimPrefix(t, "<|python_tag|>"))
	if !strings.HasPrefix(t, "{") {
		return strings.TrimSpace(text), nil
	}
	var calls []ToolCall
	for _, part := range splitJSONObjects(t) {
		c, ok := callFromJSON(part, "parameters", "arguments")
		if !ok {
			return strings.TrimSpace(text), nil
		}
		calls = append(calls, c)
	}
	return "", calls
}

func parseMistral(text string) (string, []ToolCall) {
	const marker = "[TOOL_CALLS]"
	i := strings.Index(text, marker)
	if i < 0 {
		return strings.TrimSpace(text), nil
	}
	var arr []json.RawMessage
	if err := json.Unmarshal([]byte(strings.TrimSpace(text[i+len(marker):])), &arr); err != nil {
		return strings.TrimSpace(text), nil
	}
	var calls []ToolCall
	for _, raw := range arr {
		c, ok := callFromJSON(string(raw), "arguments", "parameters")
		if !ok {
			return strings.TrimSpace(text), nil
		}
		calls = append(calls, c)
	}
	return strings.TrimSpace(text[:i]), calls
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

// callFromJSON reads {"name": ..., <argsKey>: {...}|"..."}.
func callFromJSON(s string, argsKeys ...string) (ToolCall, bool) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal([]byte(strings.TrimSpace(s)), &obj); err != nil {
		return ToolCall{}, false
	}
	var name string
	if err := json.Unmarshal(obj["name"], &name); err != nil || name == "" {
		return ToolCall{}, false
	}
	args := "{}"
	for _, k := range argsKeys {
		raw, ok := obj[k]
		if !ok {
			continue
		}
		var str string
		if json.Unmarshal(raw, &str) == nil && json.Valid([]byte(str)) {
			args = str // arguments given as a JSON string
		} else {
			var buf bytes.Buffer
			if err := json.Compact(&buf, raw); err != nil {
				return ToolCall{}, false
			}
			args = buf.String()
		}
		break
	}
	return ToolCall{ID: NewCallID(), Type: "function", Function: FunctionCall{Name: name, Arguments: args}}, true
}

// NewCallID returns an OpenAI-style tool call id.
func NewCallID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "call_" + hex.EncodeToString(b[:])
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
