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

// Arch is the path of the tiny random-weight model of a llama.cpp architecture (qwen35,
// lfm2, granitehybrid, ...) that `make testmodels` writes to ~/.cache/polykv/testmodels
// (POLYKV_TESTMODELS overrides the directory). These stand in for architectures with no
// small real model here: their output is noise, but it is the noise the architecture's
// real graph computes, so sharing, batching and determinism can be checked on it.
func Arch(t testing.TB, arch string) string {
	t.Helper()
	dir := os.Getenv("POLYKV_TESTMODELS")
	if dir == "" {
		home, _ := os.UserHomeDir()
		dir = filepath.Join(home, ".cache", "polykv", "testmodels")
	}
	p := filepath.Join(dir, arch+".gguf")
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("POLYKV_REQUIRE_MODEL") != "" {
			t.Fatalf("test model missing (%v): run `make testmodels` first", err)
		}
		t.Skipf("random-weight %s test skipped: %s is missing; run `make testmodels` (or `make test`, which writes it)", arch, p)
	}
	return p
}
