package engine

import (
	"fmt"
	"slices"

	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
)

// llama-server's slot save/restore/erase (issue 25), on PolyKV's session sequences. The
// scheduler checks and does the bookkeeping and plans the copy (OpSlotSave,
// OpSlotLoad) to run before the message's reply: the engine loop finds it in the Ready
// that follows the step, copies the bytes with the backend (Caps.Slots), since only it
// touches the cache, and answers SlotDone, which is the reply's data. The file is the
// API's business.

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

// SlotDone is the driver's answer to an OpSlotSave (Data: the sequence's KV) or an
// OpSlotLoad (Load; the sequence then holds Tokens): Err says why it failed (a failed
// load leaves the sequence holding nothing). Result: Data and Err, the reply to the
// SaveSlot or LoadSlot.
type SlotDone struct {
	Seq    int
	Load   bool
	Tokens []Token
	Data   []byte
	Err    error
}

func (SaveSlot) isMsg()  {}
func (LoadSlot) isMsg()  {}
func (EraseSlot) isMsg() {}
func (SlotDone) isMsg()  {}

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
	if !s.slotIO {
		return nil, errNoSlots
	}
	// Operations planned since the last step go first: a task that just ended may
	// leave rejected draft cells that the next step would remove (speculative.go).
	s.urgent = append(append(s.urgent, s.ops...), SeqOp{Kind: OpSlotSave, Seq: m.Seq})
	s.ops = nil
	return slices.Clone(sl.tokens), nil
}

// loadSlot empties the slot and makes room for the tokens, then plans the load (the
// driver answers SlotDone).
func (s *Scheduler) loadSlot(m LoadSlot) error {
	sl, err := s.idleSlot(m.Seq)
	if err != nil {
		return err
	}
	if len(m.Tokens) == 0 || len(m.Tokens) >= s.cfg.NCtx {
		return fmt.Errorf("%w: %d saved tokens, context size %d", ErrPromptTooLong, len(m.Tokens), s.cfg.NCtx)
	}
	s.evictSlot(sl)
	if free := s.freeCells(len(m.Tokens), sl, 0, kvcache.GraceHolds); free < len(m.Tokens) {
		return fmt.Errorf("%w: %d cells free, the slot needs %d", ErrQueueFull, free, len(m.Tokens))
	}
	if !s.slotIO {
		return errNoSlots
	}
	// The slot's old cells go first: LoadSeq writes into free cells.
	s.urgent = append(append(s.urgent, s.ops...), SeqOp{Kind: OpSlotLoad, Seq: m.Seq, Tokens: m.Tokens, Data: m.Data})
	s.ops = nil
	return nil
}

// slotDone applies the driver's answer to a slot's copy; its data and error are the
// reply.
func (s *Scheduler) slotDone(m SlotDone) Result {
	if m.Load && m.Err == nil && m.Seq >= 0 && m.Seq < len(s.slots) {
		sl := s.slots[m.Seq]
		s.kv.Allocate(sl.seq, m.Tokens)
		sl.tokens = slices.Clone(m.Tokens)
		sl.lastUsed = s.now
	}
	return Result{Data: m.Data, Err: m.Err}
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

var errNoSlots = fmt.Errorf("%w: this backend cannot save or load slots", pool.ErrBadRequest)
