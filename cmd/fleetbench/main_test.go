package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestRunReadsUsageAndRetries: against a fake server that streams like PolyKV and
// fails every third request of each agent once, each turn's history grows with the
// replies, the hit ratio is the usage's cached / prompt tokens, and failed attempts are
// retried and counted apart from lost turns. (Every third request of all agents together,
// as before, could fail one agent's retries back to back when the others' requests fell
// in between, and lose its turn: seen once under load.)
func TestRunReadsUsageAndRetries(t *testing.T) {
	var n atomic.Int64
	var mu sync.Mutex
	sessions, most := map[string]int{}, 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		mu.Lock()
		sessions[r.Header.Get("x-session-id")]++
		fail := sessions[r.Header.Get("x-session-id")]%3 == 0
		mu.Unlock()
		if fail {
			http.Error(w, "replica gone", http.StatusServiceUnavailable)
			return
		}
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		most = max(most, strings.Count(string(body), `"role"`))
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"prompt_tokens_details\":{\"cached_tokens\":75}}}\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()
	c := config{url: srv.URL, model: "m", label: "t", teams: 2, agents: 2, turns: 3, systemWords: 20, maxTokens: 1,
		timeout: 5 * time.Second, retries: 3, retryWait: time.Millisecond}
	res := collect(c)
	if len(res) != 12 {
		t.Fatalf("%d turns, want 2 teams x 2 agents x 3 turns", len(res))
	}
	failed, lost := 0, 0
	for _, r := range res {
		failed += r.failed
		if r.err != nil {
			lost++
			continue
		}
		if r.prompt != 100 || r.cached != 75 || r.ttft <= 0 {
			t.Fatalf("turn read as %+v, want usage 100/75 and a TTFT", r)
		}
	}
	if lost != 0 || failed == 0 || int64(len(res)+failed) != n.Load() {
		t.Fatalf("%d failed attempts, %d lost turns, %d requests in all", failed, lost, n.Load())
	}
	if len(sessions) != 4 {
		t.Fatalf("%d sessions, want one per agent", len(sessions))
	}
	// A last turn carries the system prompt and 3 user and 2 assistant messages.
	if most != 6 {
		t.Fatalf("the longest request had %d messages, want 6", most)
	}
}

// TestReplicaTokensAndRestart: against a fake fleet whose replies name their replica
// (the gateway's x-polykv-replica header) and carry PolyKV's timings, each turn's
// prefilled and restored tokens are summed per replica in -replicas order, the turns
// that started after the fault command began are told apart from the others, the
// after-fault line describes the restarted replica's first turns, and -records writes
// every turn once, in order of start.
func TestReplicaTokensAndRestart(t *testing.T) {
	var faulted atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		replica := "r1"
		if !strings.HasSuffix(r.Header.Get("x-session-id"), "agent0") {
			replica = "r2"
		}
		// Before the fault every prompt is prefilled; after it, loaded from the tier
		// but for its last 10 tokens.
		prefilled, restored := 100, 0
		time.Sleep(5 * time.Millisecond) // agents stay mid-run when the fault comes
		if faulted.Load() {
			prefilled, restored = 10, 90
		}
		w.Header().Set(replicaHeader, replica)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n")
		fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}],\"timings\":{\"cache_n\":0,\"prompt_n\":%d,\"restored_n\":%d}}\n\n", prefilled, restored)
		fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"prompt_tokens_details\":{\"cached_tokens\":%d}}}\n\n", restored)
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()
	c := config{url: srv.URL, model: "m", label: "t", replicas: []string{"r1", "r2"}, teams: 2, agents: 3, turns: 4,
		systemWords: 20, maxTokens: 1, timeout: 5 * time.Second, retries: 0, faultReplica: "r2",
		// The command takes longer than the rest of the run (as a restart's health wait
		// can): turns that start while it runs count as after the fault.
		during: func() { faulted.Store(true); time.Sleep(200 * time.Millisecond) }}
	res := collect(c)
	if len(res) != 24 {
		t.Fatalf("%d turns, want 2 teams x 3 agents x 4 turns", len(res))
	}
	pre, rest := map[string]int{}, map[string]int{}
	after := 0
	for _, r := range res {
		if r.err != nil {
			t.Fatalf("turn failed: %v", r.err)
		}
		pre[r.replica] += r.prefilled
		rest[r.replica] += r.restored
		if r.afterFault {
			// Its attempt started after the fault command began, which faults the server
			// first thing; the server reads its state 5 ms after the request arrives.
			if r.restored != 90 || r.prefilled != 10 || r.cached != 90 {
				t.Fatalf("turn after the fault read as %+v, want 90 restored and 10 prefilled", r)
			}
			if r.replica == "r2" {
				after++
			}
		}
	}
	if after == 0 || rest["r2"] == 0 || pre["r1"] == 0 {
		t.Fatalf("no turn on r2 after the fault (%d), or no tokens read: prefilled %v restored %v", after, pre, rest)
	}
	got := row(c, res, []string{"x", "y"})
	want := fmt.Sprintf("| x / y | %d / %d | %d / %d |", pre["r1"], pre["r2"], rest["r1"], rest["r2"])
	if !strings.HasSuffix(got, want) {
		t.Fatalf("row %q, want it to end with %q", got, want)
	}
	line := afterFault(c, res, 2)
	if !strings.HasPrefix(line, fmt.Sprintf("after the fault, r2 served %d turns; first: [", after)) ||
		!strings.HasSuffix(line, fmt.Sprintf("all: prompt %d = cells 0 + restored %d + prefilled %d", 100*after, 90*after, 10*after)) ||
		strings.Count(line, "= cells 0 + restored 90 + prefilled 10, TTFT") != min(2, after) {
		t.Fatalf("after-fault line %q (%d turns on r2 after the fault)", line, after)
	}
	// Without the header, a replica alone is the one that served; several are "other".
	alone := config{replicas: []string{"solo"}}
	if p, r := perReplica(alone, []result{{prefilled: 7, restored: 3}}); p != "7" || r != "3" {
		t.Fatalf("one replica without the header: %q %q", p, r)
	}
	if p, _ := perReplica(c, []result{{prefilled: 7}}); p != "0 / 0 / other 7" {
		t.Fatalf("turns of no listed replica: %q", p)
	}

	var buf bytes.Buffer
	if err := writeRecords(&buf, c, res); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != len(res) {
		t.Fatalf("%d records, want %d", len(lines), len(res))
	}
	last, seen := -1.0, map[string]bool{}
	for _, l := range lines {
		var rec record
		if err := json.Unmarshal([]byte(l), &rec); err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprintf("%s/%d", rec.Session, rec.Turn)
		if seen[key] || rec.StartS < last || rec.Replica == "" || rec.Prompt != 100 || rec.Restored+rec.Prefilled != 100 {
			t.Fatalf("record %s out of order, repeated or incomplete", l)
		}
		seen[key], last = true, rec.StartS
	}
}
