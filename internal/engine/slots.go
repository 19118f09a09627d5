package engine

import (
	"fmt"
	"slices"

	"github.com/polykv/polykv/internal/pool"
)

// llama-server's slot save/restore/erase (issue 25), on PolyKV's session sequences. The
// scheduler checks and does the bookkeeping; the engine loop copies the bytes with the
// backend (SlotBackend) right after the step, since only it touches the cache; the
// file is the API's business.

// SaveSlot asks for what session sequence Seq holds, to save it. Result: Tokens and
// Data (the sequence's KV, from SlotBackend.SaveSeq). A running sequence is refused.
type SaveSlot struct{ Seq int }

// LoadSlot puts saved KV back on an idle session sequence Seq: whatever it held is
// dropped and it then holds Tokens, as a finished anonymous sequence (with the prefix
// cache, a prefix any request can start from). Result: Err when it could not be loaded.
type LoadSlot struct {
	Seq    int
	Tokens []Token
	Data   []byte
}

// EraseSlot drops what an idle session sequence holds (and its session). Result:
// Erased, the tokens it held.
type EraseSlot struct{ Seq int }

// slotLoaded is the engine loop's answer to a LoadSlot.
type slotLoaded struct {
	seq    int
	tokens []Token
	err    error
}

func (SaveSlot) isMsg()   {}
func (LoadSlot) isMsg()   {}
func (EraseSlot) isMsg()  {}
func (slotLoaded) isMsg() {}

// SlotBackend is a backend's ability (Caps.Slots) to copy a sequence's KV out and back
// in.
type SlotBackend interface {
	SaveSeq(seq int) ([]byte, error)
	// LoadSeq loads data into seq (which it empties first) and checks that it then
	// holds exactly positions [0, n).
	LoadSeq(seq, n int, data []byte) error
}

// idleSlot returns session sequence seq when no task runs on it.
func (s *Scheduler) idleSlot(seq int) (*slot, error) {
	if seq < 0 || seq >= len(s.slots) {
		return nil, fmt.Errorf("%w: slot %d does not exist (0..%d)", pool.ErrBadRequest, seq, len(s.slots)-1)
	}
	sl := s.slots[seq]
	if sl.task != nil {
		return nil, fmt.Errorf("%w: slot %d is processing a request", ErrSessionBusy, seq)
	}
	return sl, nil
}

func (s *Scheduler) saveSlot(m SaveSlot) ([]Token, error) {
	sl, err := s.idleSlot(m.Seq)
	if err != nil {
		return nil, err
	}
	if len(sl.tokens) == 0 {
		return nil, fmt.Errorf("%w: slot %d holds nothing to save", pool.ErrBadRequest, m.Seq)
	}
	return slices.Clone(sl.tokens), nil
}

// loadSlot empties the slot and makes room for the tokens; the engine loop then loads
// the bytes and answers slotLoaded.
func (s *Scheduler) loadSlot(m LoadSlot) error {
	sl, err := s.idleSlot(m.Seq)
	if err != nil {
		return err
	}
	if len(m.Tokens) == 0 || len(m.Tokens) >= s.cfg.NCtx {
		return fmt.Errorf("%w: %d saved tokens, context size %d", ErrPromptTooLong, len(m.Tokens), s.cfg.NCtx)
	}
	s.evictSlot(sl)
	if free := s.freeCells(len(m.Tokens), sl, 0); free < len(m.Tokens) {
		return fmt.Errorf("%w: %d cells free, the slot needs %d", ErrQueueFull, free, len(m.Tokens))
	}
	return nil
}

func (s *Scheduler) slotLoaded(m slotLoaded) {
	if m.err != nil {
		return // the sequence holds nothing (SlotBackend.LoadSeq)
	}
	sl := s.slots[m.seq]
	s.kv.allocate(sl.seq, m.tokens)
	sl.tokens = slices.Clone(m.tokens)
	sl.lastUsed = s.now
}

func (s *Scheduler) eraseSlot(m EraseSlot) (int, error) {
	sl, err := s.idleSlot(m.Seq)
	if err != nil {
		return 0, err
	}
	n := len(sl.tokens)
	s.evictSlot(sl)
	return n, nil
}

// slotIO does the byte copies of the slot messages on the engine goroutine, right
// after the scheduler accepted them (res.Err nil).
func slotIO(sched *Scheduler, d driver, msg Msg, res *Result) {
	sb, ok := d.caps.Slots, d.caps.Slots != nil
	switch m := msg.(type) {
	case SaveSlot:
		if !ok {
			res.Err = errNoSlots
			return
		}
		// Operations planned since the last step go first: a task that just ended may
		// leave rejected draft cells that the next step would remove (speculative.go).
		ops := sched.ops
		sched.ops = nil
		for _, m := range d.apply(Plan{SeqOps: ops}) {
			sched.Step(sched.now, m) // a restore's answer
		}
		res.Data, res.Err = sb.SaveSeq(m.Seq)
	case LoadSlot:
		err := errNoSlots
		if ok {
			// The slot's old cells go first: LoadSeq writes into free cells.
			_ = d.apply(Plan{SeqOps: sched.ops})
			sched.ops = nil
			err = sb.LoadSeq(m.Seq, len(m.Tokens), m.Data)
		}
		sched.Step(sched.now, slotLoaded{seq: m.Seq, tokens: m.Tokens, err: err})
		res.Err = err
	}
}

var errNoSlots = fmt.Errorf("%w: this backend cannot save or load slots", pool.ErrBadRequest)
