package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/app"
)

// llamaBench passes prefill rows as -p N -n 0 and decode rows as -p 0 -n N -d depth,
// and takes llama-bench's tokens per second only from the row it asked for.
func TestLlamaBenchArgs(t *testing.T) {
	dir := t.TempDir()
	argsFile := filepath.Join(dir, "args")
	bin := filepath.Join(dir, "llama-bench")
	// The fake answers with the JSON in $ROW, whatever it was asked.
	script := "#!/bin/sh\necho \"$@\" > " + argsFile + "\necho \"$ROW\"\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := app.DefaultConfig()
	cfg.Threads, cfg.NBatch, cfg.NUBatch, cfg.FlashAttn = 2, 512, 256, "on"
	for _, tc := range []struct {
		prompt, gen, depth int
		row, args          string
		ok                 bool
	}{
		{128, 0, 0, `[{"n_prompt":128,"n_gen":0,"n_depth":0,"avg_ts":250.5}]`,
			"-m m.gguf -p 128 -n 0 -t 2 -b 512 -ub 256 -fa on -ctk q8_0 -ctv q8_0 -r 1 -o json", true},
		// A llama-bench older than -d has no n_depth in its JSON: fine for prefill rows.
		{128, 0, 0, `[{"n_prompt":128,"n_gen":0,"avg_ts":250.5}]`, "", true},
		{0, 32, 16, `[{"n_prompt":0,"n_gen":32,"n_depth":16,"avg_ts":250.5}]`,
			"-m m.gguf -p 0 -n 32 -t 2 -b 512 -ub 256 -fa on -ctk q8_0 -ctv q8_0 -r 1 -o json -d 16", true},
		// A row for other settings (here: -d ignored) is refused, not reported.
		{0, 32, 16, `[{"n_prompt":0,"n_gen":32,"n_depth":0,"avg_ts":250.5}]`, "", false},
		{0, 32, 16, `[{"n_prompt":0,"n_gen":32,"n_depth":16,"avg_ts":1},{"n_prompt":0,"n_gen":32,"n_depth":16,"avg_ts":2}]`, "", false},
	} {
		t.Setenv("ROW", tc.row)
		tps, err := llamaBench(bin, "m.gguf", cfg, "q8_0", tc.prompt, tc.gen, tc.depth)
		if !tc.ok {
			if err == nil {
				t.Fatalf("%s: got %.1f tok/s, want an error", tc.row, tps)
			}
			continue
		}
		if err != nil || tps != 250.5 {
			t.Fatalf("%s: %.1f tok/s, %v; want 250.5", tc.row, tps, err)
		}
		if tc.args != "" {
			got, err := os.ReadFile(argsFile)
			if err != nil {
				t.Fatal(err)
			}
			if s := strings.TrimSpace(string(got)); s != tc.args {
				t.Fatalf("args %q, want %q", s, tc.args)
			}
		}
	}
}
