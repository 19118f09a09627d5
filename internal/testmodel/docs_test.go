package testmodel

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestDocsListTestModels checks the docs' lists of the test models against the one list,
// scripts/llama.sh's (testmodel-names, the models `make testmodels` writes): every list
// in README.md and docs/*.md marked <!-- testmodels --> … <!-- /testmodels --> names each
// of them (README.md and docs/llama-cpp.md must have one); every test model file or
// generator the docs name (NAME.gguf in the test models' directory, scripts/NAME-
// testmodel.cpp) is one of them; and every generator in scripts/ is in the list.
func TestDocsListTestModels(t *testing.T) {
	root := "../.."
	out, err := exec.Command(filepath.Join(root, "scripts/llama.sh"), "testmodel-names").Output()
	if err != nil {
		t.Fatalf("scripts/llama.sh testmodel-names: %v", err)
	}
	names := strings.Fields(string(out))
	if len(names) < 10 {
		t.Fatalf("scripts/llama.sh names %d test models (%v): want the whole list", len(names), names)
	}
	docs, _ := filepath.Glob(filepath.Join(root, "docs/*.md"))
	docs = append([]string{filepath.Join(root, "README.md")}, docs...)
	marked := regexp.MustCompile(`(?s)<!-- testmodels -->(.*?)<!-- /testmodels -->`)
	generator := regexp.MustCompile(`scripts/([a-z0-9]+)-testmodel\.cpp`)
	file := regexp.MustCompile("testmodels/([a-z0-9]+)\\.gguf|`([a-z0-9]+)\\.gguf`")
	lists := map[string]int{}
	for _, doc := range docs {
		data, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		text, base := string(data), filepath.Base(doc)
		for _, m := range marked.FindAllStringSubmatch(text, -1) {
			lists[base]++
			for _, n := range names {
				if !regexp.MustCompile("`" + n + "(\\.gguf)?`").MatchString(m[1]) {
					t.Errorf("%s: a list of the test models lacks `%s` (scripts/llama.sh testmodel-names)", base, n)
				}
			}
		}
		for _, m := range generator.FindAllStringSubmatch(text, -1) {
			if !slices.Contains(names, m[1]) {
				t.Errorf("%s names %s, which is not one of scripts/llama.sh's test models", base, m[0])
			}
		}
		for _, m := range file.FindAllStringSubmatch(text, -1) {
			if n := m[1] + m[2]; !slices.Contains(names, n) {
				t.Errorf("%s names %s, which is not one of scripts/llama.sh's test models", base, m[0])
			}
		}
	}
	for _, doc := range []string{"README.md", "llama-cpp.md"} {
		if lists[doc] == 0 {
			t.Errorf("%s has no marked list of the test models (<!-- testmodels --> … <!-- /testmodels -->)", doc)
		}
	}
	gens, _ := filepath.Glob(filepath.Join(root, "scripts/*-testmodel.cpp"))
	for _, g := range gens {
		if n := strings.TrimSuffix(filepath.Base(g), "-testmodel.cpp"); !slices.Contains(names, n) {
			t.Errorf("%s is not in scripts/llama.sh's list of test models (testmodel_generated)", g)
		}
	}
}
