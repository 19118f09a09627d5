// Package engine is PolyKV's continuous-batching core.
//
// The Scheduler is a deterministic state machine in the spirit of etcd's raft: it does
// no I/O and reads no clock. Requests and cancellations enter through Submit and Cancel,
// time enters as an argument, and each step it answers with a Plan: sampler and
// sequence operations to perform, and one batch holding a decode token for every
// generating task plus prompt chunks (chunked prefill) within the batch budget. The
// backend's sampled tokens go back through Commit, and Events drains the text and
// completions to deliver.
//
// The driving loop (Engine.run) is, in full:
//
//	for {
//		handle waiting messages (Submit, Cancel, Inspect)
//		plan := sched.Plan(now)
//		run plan.Samplers and plan.SeqOps on the backend
//		deliver(sched.Events())
//		if len(plan.Batch) == 0 { wait for a message; continue }
//		sampled, err := backend.Decode(plan.Batch)
//		sched.Commit(sampled, err, now)
//		deliver(sched.Events())
//	}
//
// Only that loop's goroutine touches the Backend (and so the llama.cpp context).
// Handlers hold a Stream and read events from it; snapshots (Slots, Usage) are copied
// out through Inspect.
//
// Sequence and cell rules: each session sequence holds exactly the tokens listed in its
// slot at positions 0..n-1. A known session reuses the longest common prefix of its
// tokens and the new prompt and removes the rest; anonymous tasks free their cells when
// they end. Admission reserves the cells a prompt needs, evicting idle sessions least
// recently used first, so two half-prefilled prompts can never deadlock the cache. When
// no cell is left a generating task stops with finish "length" and Truncated set; the
// context is never shifted.
package engine
