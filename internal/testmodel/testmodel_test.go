package testmodel

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestManifestMatchesGenerators: every test-model generator (llama.cpp's test-llama-archs
// for the architectures scripts/llama.sh lists, and each scripts/*-testmodel.cpp) has a
// manifest entry whose key is the key of today's sources (scripts/llama.sh testmodel-key:
// the generator's source, the shared headers, the llama.cpp pin). A generator changed
// without its models being regenerated and the manifest rewritten fails here.
func TestManifestMatchesGenerators(t *testing.T) {
	entries, err := Manifest()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, strings.TrimSuffix(e.File, ".gguf"))
	}
	gens, _ := filepath.Glob("../../scripts/*-testmodel.cpp")
	if len(gens) == 0 {
		t.Fatal("no scripts/*-testmodel.cpp found")
	}
	for _, g := range gens {
		name := strings.TrimSuffix(filepath.Base(g), "-testmodel.cpp")
		if !slices.Contains(names, name) {
			t.Errorf("scripts/%s has no entry %s.gguf in testmodels.sum", filepath.Base(g), name)
		}
	}
	for _, e := range entries {
		name := strings.TrimSuffix(e.File, ".gguf")
		out, err := exec.Command("../../scripts/llama.sh", "testmodel-key", name).Output()
		if err != nil {
			t.Fatalf("scripts/llama.sh testmodel-key %s: %v", name, err)
		}
		if key := strings.TrimSpace(string(out)); key != e.Key {
			t.Errorf("%s: its generator's key is %s, the manifest's %s: a generator (or the llama.cpp pin) changed; "+
				"run `make testmodels`, then scripts/llama.sh testmodels-manifest >internal/testmodel/testmodels.sum", e.File, key, e.Key)
		}
	}
}

// TestCachedModelsMatchManifest: each model in the cache is the manifest's, byte for byte,
// and stamped with its generator's key (scripts/llama.sh rewrites a model whose stamp is
// not the current key). A missing model skips, or fails under make test.
func TestCachedModelsMatchManifest(t *testing.T) {
	entries, err := Manifest()
	if err != nil {
		t.Fatal(err)
	}
	dir := ArchDir()
	for _, e := range entries {
		t.Run(strings.TrimSuffix(e.File, ".gguf"), func(t *testing.T) {
			p := filepath.Join(dir, e.File)
			if _, err := os.Stat(p); err != nil {
				SkipOrFail(t, "test model missing ("+err.Error()+"): run `make testmodels`")
			}
			sum, err := FileSHA256(p)
			if err != nil {
				t.Fatal(err)
			}
			if sum != e.SHA256 {
				t.Errorf("%s: sha256 %s, the manifest lists %s", p, sum, e.SHA256)
			}
			if os.Getenv("POLYKV_TESTMODELS") != "" {
				return // a directory of copies (scripts/gpu-check.sh): no stamps there
			}
			stamp, err := os.ReadFile(strings.TrimSuffix(p, ".gguf") + ".key")
			if err != nil || strings.TrimSpace(string(stamp)) != e.Key {
				t.Errorf("%s: generated under key %q (%v), the manifest's is %s: run `make testmodels`", p, strings.TrimSpace(string(stamp)), err, e.Key)
			}
		})
	}
}
