package engine

import "time"

// Ready is everything the scheduler has for its driver, handed over in one value as
// etcd raft's RawNode.Ready hands a node's entries, messages and state: the plan to
// run on the backend, the events for the tasks' streams, the measurements for the
// Observer, and a snapshot for readers when one is due (nil otherwise, as raft's
// SoftState is nil when unchanged). Each Ready drains what it holds: nothing is handed
// out twice, so the driver needs no Advance. The driver acts on it in this order: run
// the plan's samplers and sequence operations (answering planned restores through
// Step), publish the snapshot, deliver the events (a reader woken by an event already
// sees its effect), then decode the plan's batch and Commit.
type Ready struct {
	// Plan is the next step (Scheduler.Plan); empty unless the Ready was asked with
	// plan set.
	Plan         Plan
	Events       []Event
	Observations []Observation
	// Snapshot is set when one is due: after every message (Step), when a task ended,
	// when a decode failed, when a plan changed sequences without a batch to follow,
	// and otherwise at most every snapshotEvery.
	Snapshot *Snapshot
}

// snapshotEvery bounds how often a decoding engine republishes its snapshot: building
// one walks every slot and pool, which does not belong on each decode step. Messages
// and finished tasks always republish, so a reader sees its own command's effect.
const snapshotEvery = 50 * time.Millisecond

// Ready returns the scheduler's outputs at now; with plan, it first builds the next
// step (Plan). The driver asks without plan after each message it steps and after
// Commit, and with plan once its inbox is drained.
func (s *Scheduler) Ready(now time.Time, plan bool) Ready {
	var rd Ready
	due := s.snapDue
	if plan {
		rd.Plan = s.Plan(now)
		p := rd.Plan
		due = due || len(p.Batch) == 0 && (len(p.SeqOps) > 0 || len(p.Samplers) > 0)
	}
	rd.Observations = s.Observations()
	rd.Events = s.Events()
	for _, ev := range rd.Events {
		due = due || ev.Done
	}
	if due || now.Sub(s.snapAt) >= snapshotEvery {
		rd.Snapshot = s.Snapshot(now)
		s.snapAt, s.snapDue = now, false
	}
	return rd
}
