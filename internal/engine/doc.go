// Package engine is PolyKV's continuous-batching core.
//
// The Scheduler is a deterministic state machine in the spirit of etcd's raft: it does
// no I/O and reads no clock. Everything from outside enters as a typed message (Submit,
// Cancel, CreatePool, ReleasePool, PinPool, EvictPool, FlushPool, SetAdmission,
// QueryCapacity, Reserve, ReleaseReservation, RecoverPool, SaveSlot, LoadSlot,
// EraseSlot, ProbeFits, ExpectTurn, Tick: messages.go, slots.go, order.go; and the
// driver's answers to planned operations: Drafted, Restored, Loaded, SlotDone, Probed,
// and TierRead when a tier read finishes off the engine goroutine: draft.go, tier.go,
// spill.go) through one entry, Step(now, msg), which answers with a Result. Each step
// of the model is a Plan: sampler and sequence operations to perform, and one batch
// holding a decode token for every generating task (followed by its speculative draft
// tokens when speculation is on: speculative.go) plus prompt chunks (chunked prefill)
// within the batch budget. The backend's sampled tokens go back through Commit.
// Everything the scheduler has for its driver comes out in one Ready (ready.go, as
// etcd raft's RawNode.Ready): the plan, the events (text and completions to deliver),
// the observations and, when due, a snapshot. That is the only door: a draft model's
// round before a step (Plan.Drafts), tier restores and loads, slot copies and cell
// probes are operations of a Ready's plan whose answers come back as messages, and
// nothing outside the scheduler's methods touches its state. A log of (time, message)
// pairs and backend results replays a run exactly.
//
// The Engine drives a Scheduler on one goroutine, the only one that touches the
// Backend (and so the llama.cpp context) and the only reader of the clock. What the
// backend can do beyond Backend it declares once (Caps, read at New). The loop is, in
// full (deliver: observe, publish the snapshot if any, then push the events; settle:
// run a plan's operations on the backend and Step each answer back, driver.go):
//
//	for {
//		for each waiting message m (or a Tick when idle for 200 ms, or a TierRead):
//			res := sched.Step(time.Now(), m)
//			rd := sched.Ready(now, false) // with the operations m needs before its reply
//			if settle(rd.Plan) answered { deliver(rd); rd = sched.Ready(now, false) }
//			deliver(rd); reply(res, with the answers' data)
//		rd := sched.Ready(time.Now(), true)
//		if len(rd.Plan.Drafts) > 0 { // the draft round (draft.go)
//			settle(rd.Plan) // the drafter's proposals: Step(Drafted{...})
//			deliver(rd); rd = sched.Ready(time.Now(), true)
//		}
//		settle(rd.Plan) // samplers and sequence ops; Restored, Loaded back
//		deliver(rd), then deliver(sched.Ready(now, false)) if answers were stepped
//		if len(rd.Plan.Batch) == 0 { wait for a message; continue }
//		sampled, err := backend.Decode(rd.Plan.Batch)
//		sched.Commit(sampled, err, time.Now())
//		deliver(sched.Ready(now, false))
//	}
//
// Other goroutines (the HTTP handlers) only send messages (Engine.Submit, CreatePool,
// Send) and read the immutable Snapshot the loop publishes through an atomic pointer:
// after every message, whenever a task ends, and otherwise at most every 50 ms while
// decoding. The snapshot is published before events are delivered, so a reader woken
// by its own request's end, or by a command's reply, already sees the effect. A
// request's events arrive on its Stream.
//
// Sequence and cell rules: each session sequence holds exactly the tokens listed in its
// slot at positions 0..n-1. A known session reuses the longest common prefix of its
// tokens and the new prompt and removes the rest; anonymous tasks free their cells when
// they end, unless the prefix cache is on (Config.PrefixCache, issue 12): then a task
// without a pool or a known session starts from the longest prefix any sequence holds
// (seq_cp, or taking over a cached sequence), waits while a prefilling task will soon
// hold a longer one, and its sequence stays as cache when it ends. The cell tree
// (kvcache/celltree.go) mirrors which sequences share which cells, exactly as llama.cpp does:
// it is the cell accounting (used cells, ownership, what an eviction frees) and the
// longest-prefix index. The KV-cache manager (package kvcache, its own package) owns it
// behind a small API (Allocate, Free, Share, Longest, Victims, MakeRoom, DraftRoom): the
// scheduler plans and asks, and only the manager changes cells and evicts (the room a
// step's speculative drafts take from idle tails included). It sees the scheduler's
// sequences and pools as kvcache.Holders and hands each victim it picks back to be
// taken (holders.go); the cell tree tells residency reports every change through its
// watcher (residency.go). Pools are named nodes of
// the same tree (their residency and own cells are read from it), built by the same
// longest-prefix seq_cp, a fork from its
// parent's node. Admission reserves the cells a prompt needs, evicting in one order
// (expected next use) over the tree's leaves (cached sequences' and idle sessions'
// tails, unpinned idle pools: kvcache/kvcache.go; what a taken victim loses: cells.go), so two half-prefilled prompts can never
// deadlock the cache. When no cell is left a generating task stops with finish
// "length" and Truncated set; the context is never shifted. Pools (package pool) change state only through their
// lifecycle verbs; a verb the scheduler's request breaks is counted (Violations).
//
// Below the cache (issues 25, 40; tier.go, spill.go): with Config.Tier whatever eviction
// takes is spilled first, an evicted pool's own cells whole (a user-pinned pool is paged
// too, never lost), an idle session's or cached sequence's cells as content-addressed
// segments of Config.TierChunk tokens (a shared prefix is stored once), and a later
// request loads what its prompt continues instead of prefilling it: the plan's OpSave /
// OpLoad and the driver's Loaded answer, as OpSpill / OpRestore and Restored for pools.
// Eviction and sequence reuse go in order of expected next use, not recency alone, and
// the queue in program-aware order: continuations before first turns, least attained
// service first, aging against starvation (order.go).
//
// Liveness (issue 30): a waiting request with admissible capacity is scheduled or
// refused within one step. A request waits only for something that makes progress on
// its own (its pool or its parent pool being built, a running request that will hold a
// longer prefix of its prompt, its own session's running turn, a sequence id or cells
// that running requests hold, its throttled pool's running sessions when it is paced,
// for at most paceMaxHold), or behind the first such request in queue order (the
// head waits for cells rather than be overtaken, so a long prompt is never starved; only
// the first use of a pool in its grace goes ahead of it). A pool just made or restored
// is kept for its first use (its grace, --pool-grace-ms) only while running work will
// make room for the request that needs its cells: a request nothing running will ever
// make room for takes it, after every other victim (issue 54: on an idle server the
// grace held such a request 30-60 s). Admission counts exactly what eviction can free for it
// (fit): the cells free now, less those promised to seated prompts, plus every cell
// that only idle sequences, evictable pools and the sequence it takes hold, except
// what its placement keeps or borrows. The test harness checks this at the end of
// every admission pass of every test, story and fuzz input, against its own count
// (checkLiveness). And no wait is without a deadline: a task still queued
// Config.QueueTimeout after it entered the queue is refused (ErrQueueTimeout; a pool's
// creation is abandoned), which also ends the waits that only a client could end
// (cells pinned by pools, a pool queued behind the creation that waits for its
// sibling's pinned cells). The deadline runs only while the server makes no progress
// (issue 40: a request behind work that progresses keeps its place), and a request
// that can never fit beside pools pinned without a tier to page them is refused at once
// (ErrNeverFits). Why each request waits (Wait*) and for how long is in Waiting and the
// snapshot.
//
// Admission state (policies, settle windows, the measured-drop forecast, requests held
// by an enforced gate, reservations, the sessions seen before) lives in an
// admission.Controller, pure like the scheduler: the scheduler hands it facts about a
// pool (poolFacts), reports what happened (a new session seated, a settle window's
// progress, a request naming a reservation) and acts on its decisions (admit, warn,
// hold, refuse with a SaturatedError). Held requests count against the queue bound.
//
// Throttle toward the floor (issue 41, throttle.go): a pool's policy may let its
// sessions that decode well above its floor skip steps of Plan's decode loop while a
// session near or under its own floor, or a prompt the step's budget cuts, gains from
// it; skips are bounded per session, and admission reads the rates sessions would have
// unthrottled, so the gate does not refuse the room the throttle makes. The same policy
// paces turns: a waiting turn of the pool stays in the queue while one more session
// would slow the step's sessions under the floor (paced), at most paceMaxHold, never
// when none of its pool's sessions runs; among such turns the conversation furthest
// along goes first (pacedPeers).
//
// Tests: most scheduling rules are tested against a fake backend (fake_test.go) in
// milliseconds, as data-driven stories (testdata/stories) and by fuzzing random
// message sequences (FuzzSchedulerInvariants).
package engine
