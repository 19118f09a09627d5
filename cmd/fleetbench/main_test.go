package main

import (
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
