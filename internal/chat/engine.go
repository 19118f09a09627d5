package chat

import (
	"time"

	"github.com/polykv/polykv/internal/chat/jinja"
)

// compile parses a chat template with internal/chat/jinja, a fork of
// github.com/ardanlabs/jinja v1.8.0. Why this engine: it is a maintained pure-Go Jinja
// written for GGUF chat templates (Ardan Labs' llama.cpp-family Go server uses it), with
// transformers' trim_blocks/lstrip_blocks on, insertion-ordered dicts, Python string
// methods and loop controls, tested byte for byte against jinja2. Why a fork: the gaps
// left for exactness with transformers (tojson arguments, None/float printing, Markup,
// dict() order) sit in unexported code without extension points, and its newer releases
// need a newer Go than ours; the changes are listed in jinja/FORK.md. gonja, which we
// used before, failed 23 of llama.cpp's 70 templates and walked Go maps in random order.
func compile(source string) (*jinja.Template, error) {
	return jinja.Compile(source)
}

// globals are the helpers transformers adds (raise_exception, strftime_now), given as
// template data so they shadow the engine's own: raise_exception must be told apart
// from an engine failure (a 400 for the client, not our 500).
func globals() map[string]jinja.Value {
	return map[string]jinja.Value{
		"raise_exception": jinja.NewCallable("raise_exception", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			msg := ""
			if len(args) > 0 {
				msg = printable(args[0])
			}
			return jinja.Undefined(), raisedError{msg: msg}
		}),
		"strftime_now": jinja.NewCallable("strftime_now", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			f := "%Y-%m-%d"
			if len(args) > 0 && args[0].IsString() {
				f = args[0].AsString()
			}
			return jinja.NewString(strftime(time.Now(), f)), nil
		}),
	}
}

func printable(v jinja.Value) string {
	if v.IsString() {
		return v.AsString()
	}
	return v.String()
}
