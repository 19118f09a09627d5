package engine

import (
	"encoding/json"
	"fmt"
	"hash"
	"hash/fnv"
	"os"
	"testing"
)

// The harness's trace hash (issue 55): with POLYKV_HARNESS_HASH naming a file, every
// harness hashes what its scheduler decides (each plan: samplers, drafts, sequence
// operations, batch; each message's result; each event) and, when its test ends,
// appends a line "test hash decisions" to that file. scripts/harness-hash.sh runs the
// package's tests so and sorts the lines: two runs on two versions of the engine give
// the same file exactly when every harness saw the same decisions, which is how a
// refactor of the scheduler proves it changed no behaviour (the batches and events,
// not only the assertions the tests make of them).
//
// JSON is the encoding because it follows pointers (SeqOp.Admission) where fmt would
// print addresses; errors are hashed by their text, which JSON drops.

// harnessHashEnv names the file the hashes are appended to.
const harnessHashEnv = "POLYKV_HARNESS_HASH"

// harnessTrace hashes one harness's decisions (nil: tracing off).
type harnessTrace struct {
	h hash.Hash64
	n int
}

// newHarnessTrace starts a trace for t when tracing is on, and appends its line when
// t ends.
func newHarnessTrace(t *testing.T) *harnessTrace {
	path := os.Getenv(harnessHashEnv)
	if path == "" {
		return nil
	}
	tr := &harnessTrace{h: fnv.New64a()}
	t.Cleanup(func() {
		f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			t.Errorf("harness hash: %v", err)
			return
		}
		defer f.Close()
		// One write per line: tests of other packages never share the file, and
		// O_APPEND keeps a line whole.
		if _, err := fmt.Fprintf(f, "%s %016x %d\n", t.Name(), tr.h.Sum64(), tr.n); err != nil {
			t.Errorf("harness hash: %v", err)
		}
	})
	return tr
}

// add hashes one decision: what kind it is, then v as JSON and err's text.
func (tr *harnessTrace) add(kind string, v any, err error) {
	if tr == nil {
		return
	}
	b, jerr := json.Marshal(v)
	if jerr != nil {
		b = []byte(jerr.Error())
	}
	fmt.Fprintf(tr.h, "%s\x00%s\x00", kind, b)
	if err != nil {
		fmt.Fprintf(tr.h, "%s", err.Error())
	}
	tr.h.Write([]byte{0})
	tr.n++
}

// TestHarnessTraceSeesDecisions checks the trace is a function of the decisions: the
// same run hashes the same, and one other token in a batch changes the hash.
func TestHarnessTraceSeesDecisions(t *testing.T) {
	run := func(tok Token) uint64 {
		tr := &harnessTrace{h: fnv.New64a()}
		tr.add("plan", Plan{Batch: []BatchEntry{{Token: tok, Pos: 0, Seq: 1, Sample: true}}}, nil)
		tr.add("event", Event{Task: 1, Done: true, Finish: "stop"}, ErrCancelled)
		return tr.h.Sum64()
	}
	first, again := run(5), run(5)
	if first != again {
		t.Fatal("the same decisions hashed differently")
	}
	if first == run(6) {
		t.Fatal("another token in a batch did not change the hash")
	}
}
