package jinja

import "testing"

// Number literals lex as jinja2 reads them (values and str() as Python prints them).
func TestNumberLiterals(t *testing.T) {
	for src, want := range map[string]string{
		`{{ 1e3 }}`:                  "1000.0",
		`{{ 2.5E-4 }}`:               "0.00025",
		`{{ 1E+2 }}`:                 "100.0",
		`{{ 3.0e1 }}`:                "30.0",
		`{{ 1e3 is float }}`:         "True",
		`{{ 1_000 + 1 }}`:            "1001",
		`{{ 1_0.5_0 }}`:              "10.5",
		`{{ 0x1F }}`:                 "31",
		`{{ 0o17 }}`:                 "15",
		`{{ 0b101 }}`:                "5",
		`{{ 12 }}`:                   "12",
		`{{ 2.5 }}`:                  "2.5",
		`{{ [[1, [7, 8]]].0.1.0 }}`:  "7",
		`{{ x.e1 if false else 4 }}`: "4",
		`{{ 1e }}`:                   "",
	} {
		tpl, err := Compile(src)
		if want == "" {
			if err == nil {
				if _, err = tpl.Render(nil); err == nil {
					t.Errorf("%s: no error", src)
				}
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", src, err)
		}
		got, err := tpl.Render(nil)
		if err != nil || got != want {
			t.Errorf("%s: got %q, %v; want %q", src, got, err, want)
		}
	}
}
