// Command testreport reads `go test -json` on stdin and prints what plain `go test` would
// (one line per package; the whole output of a failed test), then every skipped test with
// the reason it gave. It exits 1 when a test or package failed or when a skip is not on
// the allow-list: make test's log ends with the skip list, and a test that starts
// skipping where it should run fails the run instead of passing unseen.
//
//	go test -json ./... | go run ./cmd/testreport -allow scripts/skips.allow [-o skips.txt]
//
// -o writes the skip list to a file too (make test prints it again at its very end).
//
// The allow-list has one rule per line, `TEST REASON`: TEST a regular expression on
// "package/TestName" (the package path relative to the module, subtests with their
// slashes), REASON one on the skip's message; both must match. `#` starts a comment line.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strings"
)

// event is one line of `go test -json` (cmd/test2json).
type event struct {
	Action     string
	Package    string
	ImportPath string // build-output, build-fail
	Test       string
	Output     string
	Elapsed    float64
}

// skip is one skipped test and its message.
type skip struct {
	test, reason string
}

// rule is one allow-list line.
type rule struct {
	test, reason *regexp.Regexp
	line         int
}

func main() {
	allowFile := flag.String("allow", "", "allow-list of skips (see the package doc)")
	module := flag.String("module", "github.com/polykv/polykv/", "import path prefix dropped from package names")
	outFile := flag.String("o", "", "also write the skip list to this file")
	flag.Parse()
	rules, err := readRules(*allowFile)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testreport:", err)
		os.Exit(2)
	}
	r := report{out: os.Stdout, module: *module, buf: map[string][]string{}}
	if err := r.read(os.Stdin); err != nil {
		fmt.Fprintln(os.Stderr, "testreport:", err)
		os.Exit(2)
	}
	var list strings.Builder
	ok := r.summary(io.MultiWriter(os.Stdout, &list), rules)
	if *outFile != "" {
		if err := os.WriteFile(*outFile, []byte(list.String()), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "testreport:", err)
			os.Exit(2)
		}
	}
	if !ok {
		os.Exit(1)
	}
}

func readRules(path string) ([]rule, error) {
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var rules []rule
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		test, reason, _ := strings.Cut(line, " ")
		rt, err := regexp.Compile("^(?:" + test + ")$")
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %v", path, i+1, err)
		}
		rr, err := regexp.Compile(strings.TrimSpace(reason))
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %v", path, i+1, err)
		}
		rules = append(rules, rule{test: rt, reason: rr, line: i + 1})
	}
	return rules, nil
}

// report follows the event stream.
type report struct {
	out       io.Writer
	module    string
	buf       map[string][]string // output so far of each running test, by package + "." + test
	skips     []skip
	failed    []string // failed tests and packages
	sawEvents bool
}

func (r *report) pkg(p string) string { return strings.TrimPrefix(p, r.module) }

func (r *report) read(in io.Reader) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if err := json.Unmarshal(line, &e); err != nil || e.Action == "" {
			fmt.Fprintln(r.out, string(line)) // not an event (a go command message): pass it on
			continue
		}
		r.sawEvents = true
		r.event(e)
	}
	return sc.Err()
}

func (r *report) event(e event) {
	key := e.Package + "." + e.Test
	switch e.Action {
	case "build-output":
		fmt.Fprint(r.out, e.Output)
	case "build-fail":
		r.failed = append(r.failed, r.pkg(e.ImportPath)+" (build)")
	case "output":
		if e.Test != "" {
			r.buf[key] = append(r.buf[key], e.Output)
			return
		}
		// Package-level lines: "ok  pkg 1.2s", "FAIL pkg", panics outside tests, the
		// "PASS"/"FAIL" line before them is left out as plain go test does without -v.
		if o := strings.TrimSpace(e.Output); o != "PASS" && o != "FAIL" && !strings.HasPrefix(o, "=== ") {
			fmt.Fprint(r.out, e.Output)
		}
	case "fail":
		if e.Test == "" {
			r.failed = append(r.failed, r.pkg(e.Package))
			return
		}
		r.failed = append(r.failed, r.pkg(e.Package)+"/"+e.Test)
		for _, o := range r.buf[key] {
			fmt.Fprint(r.out, o)
		}
		delete(r.buf, key)
	case "skip":
		if e.Test != "" { // (a package without tests is "skip" too: not a test)
			r.skips = append(r.skips, skip{test: r.pkg(e.Package) + "/" + e.Test, reason: reason(r.buf[key])})
		}
		delete(r.buf, key)
	case "pass":
		delete(r.buf, key)
	}
}

// reason is a skipped test's message: its output without the runner's own lines, the
// "file.go:12: " prefix kept (it says where the skip is).
func reason(out []string) string {
	var lines []string
	for _, o := range out {
		for _, l := range strings.Split(o, "\n") {
			t := strings.TrimSpace(l)
			if t == "" || strings.HasPrefix(t, "=== ") || strings.HasPrefix(t, "--- SKIP") {
				continue
			}
			lines = append(lines, t)
		}
	}
	if len(lines) == 0 {
		return "(no message)"
	}
	return strings.Join(lines, " | ")
}

// summary prints the skip list and the failures to w; false when the run must fail.
func (r *report) summary(w io.Writer, rules []rule) bool {
	ok := r.sawEvents
	if !ok {
		fmt.Fprintln(w, "testreport: no test events read (did go test -json run?)")
	}
	sort.Slice(r.skips, func(i, j int) bool { return r.skips[i].test < r.skips[j].test })
	fmt.Fprintf(w, "\n--- skipped Go tests (%d)\n", len(r.skips))
	var unexpected []skip
	for _, s := range r.skips {
		allowed := false
		for _, ru := range rules {
			if ru.test.MatchString(s.test) && ru.reason.MatchString(s.reason) {
				allowed = true
				break
			}
		}
		mark := "  "
		if !allowed {
			mark = "! "
			unexpected = append(unexpected, s)
		}
		fmt.Fprintf(w, "%s%s: %s\n", mark, s.test, s.reason)
	}
	if len(unexpected) > 0 {
		ok = false
		fmt.Fprintf(w, "FAIL: %d skip(s) marked ! are not on the allow-list (scripts/skips.allow): make the test run here, or allow it there with the reason\n", len(unexpected))
	}
	if len(r.failed) > 0 {
		ok = false
		fmt.Fprintf(w, "FAIL: %d failed: %s\n", len(r.failed), strings.Join(r.failed, ", "))
	}
	return ok
}
