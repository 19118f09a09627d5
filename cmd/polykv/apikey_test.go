package main

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/polykv/polykv/internal/app"
)

func parseKeys(t *testing.T, args ...string) ([]string, error) {
	t.Helper()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var cfg app.Config
	load := apiKeyFlags(fs, &cfg)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if err := load(); err != nil {
		return nil, err
	}
	return cfg.APIKeys, nil
}

func TestAPIKeyFlags(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "keys")
	if err := os.WriteFile(file, []byte("  k3 \n\nk4\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := parseKeys(t, "--api-key", "k1", "--api-key", "k2a,k2b", "--api-key-file", file)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"k1", "k2a", "k2b", "k3", "k4"}; !slices.Equal(got, want) {
		t.Fatalf("keys %q, want %q", got, want)
	}
	if got, err := parseKeys(t); err != nil || len(got) != 0 {
		t.Fatalf("no flags: %q %v", got, err)
	}
	empty := filepath.Join(dir, "empty")
	_ = os.WriteFile(empty, []byte("\n \n"), 0o600)
	for _, args := range [][]string{
		{"--api-key", ""}, {"--api-key", "a,,b"},
		{"--api-key-file", empty}, {"--api-key-file", filepath.Join(dir, "missing")},
	} {
		if _, err := parseKeys(t, args...); err == nil {
			t.Fatalf("%q: no error", args)
		}
	}
}
