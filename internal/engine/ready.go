package engine

import "time"

// Ready is everything the scheduler has for its driver, handed over in one value as
// etcd raft's RawNode.Ready hands a node's entries, messages and state: the plan to
// run on the backend, the events for the tasks' streams, the measurements for the
// Observer, and a snapshot for readers when one is due (nil otherwise, as raft's
// SoftState is nil when unchanged). Each Ready drains what it holds: nothing is handed
// out twice, so the driver needs no Advance. The driver acts on it in this order: run
// the plan's samplers, drafts and sequence operations (answering each that has an
// answer through Step), publish the snapshot, deliver the events (a reader woken by an
// event already sees its effect), then decode the plan's batch and Commit. Nothing
// leaves the scheduler any other way: draft rounds, tier restores and loads, slot
// copies and probes are all operations of a Ready's plan.
type Ready struct {
	// Plan is the next step (Scheduler.Plan), or with Drafts the draft round before it;
	// empty unless the Ready was asked with plan set. Operations a message needs
	// before its reply (a slot's copy, a probe, a tier read that came in) come first,
	// in a Plan of their own with no batch, plan set or not.
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
// step (nextPlan). The driver asks without plan after each message it steps and after
// Commit, and with plan once its inbox is drained.
func (s *Scheduler) Ready(now time.Time, plan bool) Ready {
	var rd Ready
	due := s.snapDue
	switch {
	case len(s.urgent) > 0:
		rd.Plan = s.urgentPlan()
	case plan:
		rd.Plan = s.nextPlan(now)
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

// nextPlan is the next step's plan, or the draft round that must come before it (a
// plan holding only Drafts; the driver answers Drafted and asks again).
func (s *Scheduler) nextPlan(now time.Time) Plan {
	if w := s.draftRequest(); len(w) > 0 {
		return Plan{Drafts: w}
	}
	return s.Plan(now)
}

// urgentPlan hands out the operations messages need run before their replies (Ready
// hands them out first).
func (s *Scheduler) urgentPlan() Plan {
	p := Plan{SeqOps: s.urgent}
	s.urgent = nil
	return p
}
