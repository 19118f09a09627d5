// Package testmodel finds the real models the tests run on (make model puts them in
// ~/.cache/polykv/models). Without a model a test skips with a message naming
// `make model`, so plain `go test ./...` passes on a machine that never fetched one;
// `make test` sets POLYKV_REQUIRE_MODEL=1, where a missing model is a failure, never a
// silent skip. Only tests import it.
package testmodel

import (
	"os"
	"path/filepath"
	"testing"
)

// SmolLM2 is the path of SmolLM2-135M-Instruct (POLYKV_MODEL overrides it).
func SmolLM2(t testing.TB) string {
	t.Helper()
	return find(t, "POLYKV_MODEL", "SmolLM2-135M-Instruct.Q4_1.gguf")
}

// Gemma is the path of Gemma 3 270M (POLYKV_MODEL_GEMMA overrides it).
func Gemma(t testing.TB) string {
	t.Helper()
	return find(t, "POLYKV_MODEL_GEMMA", "gemma-3-270m-q4_k_m.gguf")
}

func find(t testing.TB, env, file string) string {
	t.Helper()
	p := os.Getenv(env)
	if p == "" {
		home, _ := os.UserHomeDir()
		p = filepath.Join(home, ".cache", "polykv", "models", file)
	}
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("POLYKV_REQUIRE_MODEL") != "" {
			t.Fatalf("test model missing (%v): run `make model` first", err)
		}
		t.Skipf("real-model test skipped: %s is missing; run `make model` (or `make test`, which fetches it)", p)
	}
	return p
}
