package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A stream as `go test -json` writes it: one package with a pass, a skip with a reason, a
// subtest skip, a failure and a package without tests.
const stream = `{"Action":"start","Package":"github.com/polykv/polykv/internal/a"}
{"Action":"run","Package":"github.com/polykv/polykv/internal/a","Test":"TestOK"}
{"Action":"output","Package":"github.com/polykv/polykv/internal/a","Test":"TestOK","Output":"=== RUN   TestOK\n"}
{"Action":"pass","Package":"github.com/polykv/polykv/internal/a","Test":"TestOK"}
{"Action":"output","Package":"github.com/polykv/polykv/internal/a","Test":"TestGPU","Output":"=== RUN   TestGPU\n"}
{"Action":"output","Package":"github.com/polykv/polykv/internal/a","Test":"TestGPU","Output":"    gpu_test.go:9: no GPU here\n"}
{"Action":"output","Package":"github.com/polykv/polykv/internal/a","Test":"TestGPU","Output":"--- SKIP: TestGPU (0.00s)\n"}
{"Action":"skip","Package":"github.com/polykv/polykv/internal/a","Test":"TestGPU"}
{"Action":"output","Package":"github.com/polykv/polykv/internal/a","Test":"TestX/sub","Output":"    x_test.go:3: model missing\n"}
{"Action":"skip","Package":"github.com/polykv/polykv/internal/a","Test":"TestX/sub"}
{"Action":"output","Package":"github.com/polykv/polykv/internal/a","Test":"TestBad","Output":"    bad_test.go:5: wrong answer\n"}
{"Action":"fail","Package":"github.com/polykv/polykv/internal/a","Test":"TestBad"}
{"Action":"output","Package":"github.com/polykv/polykv/internal/a","Output":"FAIL\tgithub.com/polykv/polykv/internal/a\t0.1s\n"}
{"Action":"fail","Package":"github.com/polykv/polykv/internal/a"}
{"Action":"skip","Package":"github.com/polykv/polykv/internal/b"}
`

func run(t *testing.T, in, allow string) (string, bool) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "allow")
	if err := os.WriteFile(path, []byte(allow), 0o644); err != nil {
		t.Fatal(err)
	}
	rules, err := readRules(path)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	r := report{out: &out, module: "github.com/polykv/polykv/", buf: map[string][]string{}}
	if err := r.read(strings.NewReader(in)); err != nil {
		t.Fatal(err)
	}
	ok := r.summary(&out, rules)
	return out.String(), ok
}

func TestSkipsListedAndChecked(t *testing.T) {
	out, ok := run(t, stream, "# GPU tests on a CPU machine\ninternal/a/TestGPU no GPU here\n")
	for _, want := range []string{
		"--- skipped Go tests (2)\n",
		"  internal/a/TestGPU: gpu_test.go:9: no GPU here\n",
		"! internal/a/TestX/sub: x_test.go:3: model missing\n",
		"FAIL: 1 skip(s) marked ! are not on the allow-list",
		"bad_test.go:5: wrong answer",                    // a failed test's output is shown
		"FAIL: 2 failed: internal/a/TestBad, internal/a", // and counted
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	if ok || strings.Contains(out, "internal/b") || strings.Contains(out, "=== RUN") {
		t.Errorf("ok %v, report:\n%s", ok, out)
	}
}

func TestAllowedSkipsPass(t *testing.T) {
	passing := strings.Join(strings.Split(stream, "\n")[:10], "\n") + "\n"
	// A rule matches the test and the reason both: the right test with another reason
	// is still unexpected.
	if out, ok := run(t, passing, "internal/a/TestGPU no GPU\ninternal/a/TestX/.* missing\n"); !ok {
		t.Errorf("all skips allowed, report fails:\n%s", out)
	}
	if out, ok := run(t, passing, "internal/a/TestGPU no GPU\ninternal/a/TestX/.* a GPU\n"); ok {
		t.Errorf("a skip whose reason no rule allows passed:\n%s", out)
	}
	if out, ok := run(t, "", ""); ok {
		t.Errorf("no events at all passed:\n%s", out)
	}
}
