package engine

import (
	"errors"
	"slices"
	"time"
)

// driver is the engine loop's hands: it performs what the scheduler planned on the
// backend, using only the abilities the backend declared (Caps), and returns the
// answers the scheduler needs. It is the only caller of the backend besides Decode,
// and the test harness drives the scheduler with it too.
type driver struct {
	be   Backend
	caps Caps
	// lookup answers an OpLookup: later, the answer comes as a message once the lookup
	// (I/O, off the engine goroutine) is done; otherwise ans is the answer now. nil:
	// the tier cannot be looked up, the answer is that nothing was found.
	lookup func(op SeqOp) (ans Found, later bool)
}

// settle runs p (apply) and hands each answer to the scheduler at now; an answer that
// is the reply to the message just stepped (a slot's bytes, a probe's verdict) fills
// res when it is not nil. It reports whether there were answers.
func (d driver) settle(s *Scheduler, now time.Time, p Plan, res *Result) bool {
	answers := d.apply(p)
	for _, m := range answers {
		r := s.Step(now, m)
		switch m.(type) {
		case SlotDone, Probed:
			if res != nil {
				res.Data, res.Fits, res.Err = r.Data, r.Fits, r.Err
			}
		}
	}
	return len(answers) > 0
}

// apply runs a plan's samplers, drafts and sequence operations on the backend and
// returns the answers the scheduler needs before the next batch: Drafted for the
// drafts, one Restored per pool with a restore planned (the last one: operations run
// in order, so it is what the pool's sequence holds now), one Loaded per load, one
// SlotDone per slot save or load and one Probed per probe.
func (d driver) apply(p Plan) []Msg {
	var answers []Msg
	for _, op := range p.Samplers {
		if op.Free {
			d.be.FreeSampler(op.Task)
		} else {
			d.be.NewSampler(op.Task, op.Params, op.Logprobs, op.History)
		}
	}
	if len(p.Drafts) > 0 {
		var ans Drafted
		if d.caps.Draft != nil {
			ans.Props = d.caps.Draft.Draft(p.Drafts)
		}
		answers = append(answers, ans)
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
			answers = d.tierOp(op, answers)
		case OpLoad:
			if ans, ok := d.load(op); ok {
				answers = append(answers, ans)
			}
		case OpSlotSave:
			ans := SlotDone{Seq: op.Seq, Err: errNoSlots}
			if d.caps.Slots != nil {
				ans.Data, ans.Err = d.caps.Slots.SaveSeq(op.Seq)
			}
			answers = append(answers, ans)
		case OpSlotLoad:
			ans := SlotDone{Seq: op.Seq, Load: true, Tokens: op.Tokens, Err: errNoSlots}
			if d.caps.Slots != nil {
				ans.Err = d.caps.Slots.LoadSeq(op.Seq, len(op.Tokens), op.Data)
			}
			answers = append(answers, ans)
		case OpProbe:
			ans := Probed{Err: errNoProbe}
			if d.caps.Probe != nil {
				ans.Fits, ans.Err = d.caps.Probe.ProbeFits(op.Seq, op.P1, op.Tok)
			}
			answers = append(answers, ans)
		case OpLookup:
			ans := Found{Task: op.Task, Seq: op.Seq}
			if d.lookup != nil {
				var later bool
				if ans, later = d.lookup(op); later {
					continue
				}
			}
			answers = append(answers, ans)
		case OpDiscard:
			if d.caps.AsyncTier != nil {
				read := op
				read.Kind = op.Of
				d.caps.AsyncTier.TierDiscard(read)
			}
		}
	}
	return answers
}

// tierOp runs a pool or segment tier operation. An OpRestore's answer replaces any
// earlier one for the same pool (operations run in order: the last is what the pool's
// sequence holds now); an answer still pending (ErrTierPending) comes later, through
// TierRead.
func (d driver) tierOp(op SeqOp, answers []Msg) []Msg {
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
	return answers
}

// load runs an OpLoad and returns its answer, unless it is pending (ok false: it
// comes later, through TierRead). Without a sequence tier nothing loads.
func (d driver) load(op SeqOp) (Loaded, bool) {
	ans := Loaded{Task: op.Task, Seq: op.Seq, N: op.P0, Missed: -1}
	if d.caps.SeqTier != nil {
		ld, err := d.caps.SeqTier.Load(op)
		if errors.Is(err, ErrTierPending) {
			return Loaded{}, false
		}
		ans = ld
	}
	return ans, true
}

var (
	errNoTier  = errors.New("the backend has no tier")
	errNoProbe = errors.New("engine: the backend cannot probe cells")
)
