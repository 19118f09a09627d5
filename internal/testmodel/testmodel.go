// Package testmodel finds the real models the tests run on (make model puts them in
// $POLYKV_CACHE/models, ~/.cache/polykv by default). Without a model a test skips with a
// message naming `make model`, so plain `go test ./...` passes on a machine that never
// fetched one; `make test` sets POLYKV_REQUIRE_MODEL=1, where a missing model is a
// failure, never a silent skip. Only tests import it.
package testmodel

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	_ "embed" // the manifest of the random-weight test models
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
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

// Cache is the directory the Makefile and scripts/*.sh keep models, llama.cpp and the
// venv in: $POLYKV_CACHE, or ~/.cache/polykv.
func Cache() string {
	if c := os.Getenv("POLYKV_CACHE"); c != "" {
		return c
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".cache", "polykv")
}

// SkipOrFail skips the test for why, or fails it under make test (POLYKV_REQUIRE_MODEL
// set), where something the suite needs being absent must not pass as a skip.
func SkipOrFail(t testing.TB, why string) {
	t.Helper()
	if os.Getenv("POLYKV_REQUIRE_MODEL") != "" {
		t.Fatal(why)
	}
	t.Skip(why)
}

func find(t testing.TB, env, file string) string {
	t.Helper()
	p := os.Getenv(env)
	if p == "" {
		p = filepath.Join(Cache(), "models", file)
	}
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("POLYKV_REQUIRE_MODEL") != "" {
			t.Fatalf("test model missing (%v): run `make model` first", err)
		}
		t.Skipf("real-model test skipped: %s is missing; run `make model` (or `make test`, which fetches it)", p)
	}
	return p
}

// ArchDir is the directory of the random-weight test models: $POLYKV_TESTMODELS, or
// testmodels/ in Cache() (where scripts/llama.sh testmodels writes them).
func ArchDir() string {
	if d := os.Getenv("POLYKV_TESTMODELS"); d != "" {
		return d
	}
	return filepath.Join(Cache(), "testmodels")
}

// Arch is the path of the tiny random-weight model of a llama.cpp architecture (qwen35,
// lfm2, granitehybrid, ...) that `make testmodels` writes to ArchDir(). These stand in
// for architectures with no small real model here: their output is noise, but it is the
// noise the architecture's real graph computes, so sharing, batching and determinism can
// be checked on it. The file must be byte for byte the one testmodels.sum lists: a model
// left in the cache by an older generator fails the test that uses it (`make testmodels`
// writes it again), so no suite passes on a stale model.
func Arch(t testing.TB, arch string) string {
	t.Helper()
	p := filepath.Join(ArchDir(), arch+".gguf")
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("POLYKV_REQUIRE_MODEL") != "" {
			t.Fatalf("test model missing (%v): run `make testmodels` first", err)
		}
		t.Skipf("random-weight %s test skipped: %s is missing; run `make testmodels` (or `make test`, which writes it)", arch, p)
	}
	if err := checkArch(arch, p); err != nil {
		t.Fatal(err)
	}
	return p
}

// ManifestEntry is one line of testmodels.sum: a test model's file, its sha256 and the
// key of what generated it (scripts/llama.sh testmodel-key).
type ManifestEntry struct {
	File, SHA256, Key string
}

//go:embed testmodels.sum
var manifestText []byte

// Manifest is the committed list of test models (testmodels.sum), in file order.
func Manifest() ([]ManifestEntry, error) {
	var out []ManifestEntry
	sc := bufio.NewScanner(bytes.NewReader(manifestText))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 3 || len(f[0]) != 64 || len(f[2]) != 64 {
			return nil, fmt.Errorf("testmodels.sum: malformed line %q", line)
		}
		out = append(out, ManifestEntry{SHA256: f[0], File: f[1], Key: f[2]})
	}
	return out, sc.Err()
}

// FileSHA256 is the hex sha256 of the file at path.
func FileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

var checked sync.Map // path -> error (nil: matches the manifest), hashed once per process

// checkArch compares the model at path with its manifest entry.
func checkArch(arch, path string) error {
	if v, ok := checked.Load(path); ok {
		err, _ := v.(error)
		return err
	}
	err := func() error {
		entries, err := Manifest()
		if err != nil {
			return err
		}
		for _, e := range entries {
			if e.File != arch+".gguf" {
				continue
			}
			sum, err := FileSHA256(path)
			if err != nil {
				return err
			}
			if sum != e.SHA256 {
				return fmt.Errorf("%s has sha256 %s, internal/testmodel/testmodels.sum lists %s: a stale model from another "+
					"generator (run `make testmodels`), or a changed generator whose manifest was not updated "+
					"(scripts/llama.sh testmodels-manifest)", path, sum, e.SHA256)
			}
			return nil
		}
		return fmt.Errorf("%s.gguf is not in internal/testmodel/testmodels.sum (scripts/llama.sh testmodels-manifest)", arch)
	}()
	checked.Store(path, err)
	return err
}
