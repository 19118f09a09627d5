package engine

import (
	"errors"
	"slices"
)

// driver is the engine loop's hands: it performs what the scheduler planned on the
// backend, using only the abilities the backend declared (Caps), and returns the
// answers the scheduler needs. The test harness drives the scheduler with it too.
type driver struct {
	be   Backend
	caps Caps
}

// apply runs a plan's samplers and sequence operations on the backend and returns the
// answers the scheduler needs before the next batch: one Restored per pool with a
// restore planned (the last one: operations run in order, so it is what the pool's
// sequence holds now) and one Loaded per load.
func (d driver) apply(p Plan) []Msg {
	var answers []Msg
	for _, op := range p.Samplers {
		if op.Free {
			d.be.FreeSampler(op.Task)
		} else {
			d.be.NewSampler(op.Task, op.Params, op.Logprobs, op.History)
		}
	}
	for _, op := range p.SeqOps {
		switch op.Kind {
		case OpSeqRm:
			d.be.SeqRm(op.Seq, op.P0, op.P1)
			if d.caps.Draft != nil && op.P0 == 0 {
				d.caps.Draft.DraftSeqRm(op.Seq) // the sequence is emptied: free the drafter's cells for it
			}
		case OpSeqCp:
			d.be.SeqCp(op.Src, op.Seq, op.P0, op.P1)
		case OpSpill, OpRestore, OpRecord, OpForget, OpSave, OpDrop, OpPrefetch:
			var err error = errNoTier
			if d.caps.Tier != nil {
				err = d.caps.Tier.Tier(op)
			}
			if op.Kind == OpRestore {
				answers = slices.DeleteFunc(answers, func(m Msg) bool { r, ok := m.(Restored); return ok && r.Pool == op.Pool })
				if !errors.Is(err, ErrTierPending) {
					answers = append(answers, Restored{Pool: op.Pool, Err: err})
				}
			}
		case OpLoad:
			ans := Loaded{Task: op.Task, Seq: op.Seq, N: op.P0, Missed: -1}
			if d.caps.SeqTier != nil {
				ld, err := d.caps.SeqTier.Load(op)
				if errors.Is(err, ErrTierPending) {
					continue
				}
				ans = ld
			}
			answers = append(answers, ans)
		}
	}
	return answers
}

var errNoTier = errors.New("the backend has no tier")
