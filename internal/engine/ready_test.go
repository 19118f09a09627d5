package engine

import (
	"testing"
	"time"
)

// TestReadyBundlesOutputs drives a request through Ready alone, as the engine loop does,
// and checks what each Ready holds: the plan only when asked, every event once, and a
// snapshot exactly when one is due (a message, a task's end, snapshotEvery elapsed).
func TestReadyBundlesOutputs(t *testing.T) {
	h := newHarness(t, Config{NCtx: 512, Parallel: 2, NBatch: 8, MaxQueue: 2})
	now := h.now
	if rd := h.s.Ready(now, false); rd.Snapshot == nil {
		t.Fatal("the first Ready has no snapshot")
	}
	if rd := h.s.Ready(now, false); rd.Snapshot != nil || len(rd.Events) != 0 || len(rd.Plan.Batch) != 0 {
		t.Fatalf("an idle Ready right after another holds %+v", rd)
	}
	res := h.s.Step(now, Submit{Req: Request{Prompt: seqTokens(1, 5), MaxTokens: 3, IgnoreEOS: true}})
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if rd := h.s.Ready(now, false); rd.Snapshot == nil || len(rd.Plan.Batch) != 0 {
		t.Fatalf("after a message: snapshot %v, batch %d (want a snapshot and no plan)", rd.Snapshot != nil, len(rd.Plan.Batch))
	}
	var events []Event
	var doneSnap *Snapshot
	for i := 0; i < 20 && doneSnap == nil; i++ {
		now = now.Add(time.Millisecond) // well within snapshotEvery
		rd := h.s.Ready(now, true)
		if i == 0 && (len(rd.Plan.Batch) != 5 || len(rd.Plan.Samplers) != 1) {
			t.Fatalf("first plan: %d batch entries, %d sampler ops; want the 5-token prompt and its sampler", len(rd.Plan.Batch), len(rd.Plan.Samplers))
		}
		if rd.Snapshot != nil {
			t.Fatalf("step %d: a snapshot without a message, an end or snapshotEvery", i)
		}
		apply(h.be, rd.Plan)
		if len(rd.Plan.Batch) == 0 {
			continue
		}
		sampled, err := h.be.Decode(rd.Plan.Batch)
		h.s.Commit(sampled, err, now)
		rd = h.s.Ready(now, false)
		events = append(events, rd.Events...)
		done := false
		for _, ev := range rd.Events {
			done = done || ev.Done
		}
		switch {
		case done && rd.Snapshot == nil:
			t.Fatal("the Ready holding a task's end has no snapshot")
		case done:
			doneSnap = rd.Snapshot
		case rd.Snapshot != nil:
			t.Fatal("a snapshot with tokens only")
		}
	}
	if doneSnap == nil {
		t.Fatalf("no Done event in %d events", len(events))
	}
	if n := len(events); n != 4 { // three tokens and the end
		t.Fatalf("%d events, want 3 tokens and the end: %+v", n, events)
	}
	if rd := h.s.Ready(now, false); len(rd.Events) != 0 || rd.Snapshot != nil {
		t.Fatal("a Ready handed out something twice")
	}
	if rd := h.s.Ready(now.Add(snapshotEvery), false); rd.Snapshot == nil {
		t.Fatal("no snapshot after snapshotEvery")
	}
}
