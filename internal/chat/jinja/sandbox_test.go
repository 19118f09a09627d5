package jinja

import (
	"strings"
	"testing"
)

// TestSandbox: jinja2's sandbox rules (internal attributes, MAX_RANGE) hold here;
// list and dict mutation is allowed, as in jinja2's SandboxedEnvironment (see sandboxed).
func TestSandbox(t *testing.T) {
	for _, c := range []struct {
		src, want, err string
	}{
		{`{% set x = [] %}{{ x.append(1) }}{{ x|length }}`, "None1", ""},
		{`{{ "a".__class__ }}`, "", "__class__"},
		{`{{ m._private }}`, "", "_private"},
		{`{{ range(100001)|length }}`, "", "range too big"},
		{`{{ range(100000)|length }}`, "100000", ""},
		{`{% set ns = namespace(items=[]) %}{% set ns.items = ns.items + [1] %}{{ ns.items|length }}`, "1", ""},
	} {
		tpl, err := Compile(c.src)
		if err != nil {
			t.Fatalf("%s: %v", c.src, err)
		}
		got, err := tpl.Render(map[string]any{"m": map[string]any{"update": 1}})
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%s: got %q, %v; want an error naming %q", c.src, got, err, c.err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%s: got %q, %v; want %q", c.src, got, err, c.want)
		}
	}
}
