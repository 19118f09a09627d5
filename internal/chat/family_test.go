package chat

import (
	"strings"
	"testing"
)

// The registry holds each format once, under its own name, and every Format the
// fuzz target and the family tests use is registered.
func TestRegistryCoversEveryFormat(t *testing.T) {
	seen := map[Format]bool{}
	for _, f := range families {
		if seen[f.format()] {
			t.Errorf("%s registered twice", f.format())
		}
		seen[f.format()] = true
		if f.markers() == nil {
			t.Errorf("%s has no markers", f.format())
		}
	}
	for _, f := range allFormats {
		if !seen[f] || lookup(f).format() != f {
			t.Errorf("%s is not in the registry", f)
		}
	}
	if len(families) != len(allFormats) {
		t.Errorf("%d families registered, %d formats known", len(families), len(allFormats))
	}
	if _, ok := lookup("no_such_family").(unknownFamily); !ok {
		t.Error("an unknown format is not unknownFamily")
	}
	if families[len(families)-1].format() != FormatHermes || !families[len(families)-1].detect(func(...string) bool { return false }) {
		t.Error("Hermes, the default, must be last and match any template")
	}
}

// A Hermes-tagged call (the forced fallback) streamed in Kimi K2 gets an id of its own:
// only Kimi's own call head carries an id (functions.NAME:IDX). Before the registry
// the Kimi id was cut out of whichever head matched, the Hermes tag included.
func TestKimiHermesFallbackStreamsWithCallID(t *testing.T) {
	s := NewCallStreamWith(FormatKimiK2, familyTools).LiveCalls()
	s.Push(`<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>`)
	d := s.Deltas()
	if len(d) == 0 || d[0].Name != "add" || !strings.HasPrefix(d[0].ID, "call_") {
		t.Fatalf("deltas %+v", d)
	}
	s = NewCallStreamWith(FormatKimiK2, familyTools).LiveCalls()
	s.Push(`<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{"a": 1}`)
	if d := s.Deltas(); len(d) == 0 || d[0].ID != "functions.add:0" {
		t.Fatalf("Kimi's own id: deltas %+v", d)
	}
}
