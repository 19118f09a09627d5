package chat

import "strings"

// Alternate is msgs in the strictest shape chat templates ask for: at most one system
// message, first; then user and assistant turns that alternate. The agent CLIs send
// what the APIs allow and strict templates refuse (Gemma's raises "Conversation roles
// must alternate"): Claude Code a system message after the first user message, Codex
// two developer messages and then two user messages, and every tool loop tool-role
// results. The caller renders msgs as sent first and falls back to Alternate only when
// the template raises, so a template that takes the conversation sees it unchanged.
//
// The rules, in order:
//   - the leading system and developer messages become one system message (joined by a
//     blank line);
//   - a later system or developer message becomes user text, a tool result user text
//     inside <tool_response></tool_response>, and an assistant turn's tool calls
//     assistant text, each as <tool_call>{"name": ..., "arguments": ...}</tool_call>:
//     the Hermes form that the tools description (injectTools) asks the model to write;
//   - consecutive messages of one role are joined by a blank line (an assistant turn's
//     reasoning with them);
//   - a conversation that starts with an assistant turn gets an empty user turn before
//     it.
//
// The result is deterministic in msgs, so a conversation that grows by turns keeps its
// rendered prefix, and a prompt's KV is shared as before.
func Alternate(msgs []Message) []Message {
	var out []Message
	i := 0
	var sys []string
	for ; i < len(msgs) && (msgs[i].Role == "system" || msgs[i].Role == "developer"); i++ {
		sys = append(sys, msgs[i].Content)
	}
	if len(sys) > 0 {
		out = append(out, Message{Role: "system", Content: strings.Join(sys, "\n\n")})
	}
	for _, m := range msgs[i:] {
		role, text := m.Role, m.Content
		switch role {
		case "system", "developer":
			role = "user"
		case "tool":
			role, text = "user", "<tool_response>\n"+text+"\n</tool_response>"
		case "assistant":
			var b strings.Builder
			b.WriteString(text)
			for _, c := range m.ToolCalls {
				if b.Len() > 0 {
					b.WriteString("\n")
				}
				args := c.Function.Arguments
				if strings.TrimSpace(args) == "" {
					args = "{}"
				}
				b.WriteString(`<tool_call>{"name": "` + c.Function.Name + `", "arguments": ` + args + `}</tool_call>`)
			}
			text = b.String()
		}
		n := len(out)
		switch {
		case n > 0 && out[n-1].Role == role:
			out[n-1].Content = joinNonEmpty(out[n-1].Content, text)
			out[n-1].ReasoningContent += m.ReasoningContent
		case role == "assistant" && (n == 0 || out[n-1].Role == "system"):
			out = append(out, Message{Role: "user"}, Message{Role: role, Content: text, ReasoningContent: m.ReasoningContent})
		default:
			out = append(out, Message{Role: role, Content: text, ReasoningContent: m.ReasoningContent})
		}
	}
	return out
}

func joinNonEmpty(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "\n\n" + b
}
