package runner

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/pool"
	"github.com/polykv/polykv/internal/tier"
)

var _ engine.TierBackend = (*Backend)(nil)

// EnableTier makes the backend perform the engine's tier operations (issue 25) with
// store. A restore from disk reads the file on another goroutine (see restore). A sliding-window model needs its SWA anchors and a model with recurrent state
// its scratch sequence (Policy.Enable): the first is saved and loaded a window at a
// time (see swaChunks), the second through the scratch sequence (see saveRecurrent).
func (b *Backend) EnableTier(store *tier.Store) {
	b.store = store
	// One pending read per waiting pool and one per seated task at most, each fewer than
	// MaxSeqs: a reader never blocks on the send.
	b.ready = make(chan engine.SeqOp, 2*engine.MaxSeqs)
	b.prefetched = map[int]prefetch{}
	b.loadsRead = map[engine.TaskID][]prefetch{}
}

var _ engine.AsyncTierBackend = (*Backend)(nil)

// prefetch is a restore's entry read off the engine goroutine, and how long the read
// took.
type prefetch struct {
	data []byte
	loc  tier.Location
	err  error
	read time.Duration
}

// TierReady implements engine.AsyncTierBackend.
func (b *Backend) TierReady() <-chan engine.SeqOp { return b.ready }

// TierDiscard implements engine.AsyncTierBackend.
func (b *Backend) TierDiscard(op engine.SeqOp) {
	b.mu.Lock()
	if op.Kind == engine.OpLoad {
		delete(b.loadsRead, op.Task)
	} else {
		delete(b.prefetched, op.Pool)
	}
	b.mu.Unlock()
}

// Tier implements engine.TierBackend. A pool's own cells [D, L) are what is stored: a
// child's [0, D) are its parent's cells, resident whenever the child is, so they are
// taken out of the child's sequence (membership only: the parent keeps them) before
// the copy, and shared back by the engine's seq_cp after a restore.
func (b *Backend) Tier(op engine.SeqOp) error {
	if b.store == nil {
		return errors.New("no tier")
	}
	m := tier.Meta{D: op.D, Tokens: op.Tokens}
	put := b.store.Put
	if op.Pinned {
		put = b.store.PutKept // paged out while pinned (issue 40): never dropped
	}
	switch op.Kind {
	case engine.OpSave, engine.OpDrop, engine.OpPrefetch:
		return b.segmentOp(op)
	case engine.OpSpill:
		if b.store.Has(m) {
			put(op.Pool, m, nil) // restored and evicted again: the entry is unchanged
			return nil
		}
		data, err := b.ownState(op, false)
		if err != nil {
			b.store.Miss(op.Pool, fmt.Errorf("spill: %w", err))
			return err
		}
		put(op.Pool, m, b.withMTP(op, data))
	case engine.OpRestore:
		return b.restore(op, m)
	case engine.OpRecord:
		// The record (tokens, pin, prefix_hash, policy) is written whenever it changed;
		// the cells are copied out only when the tier lacks them (a pool recovered
		// without its KV and prefilled since has them written again).
		rec := tier.Record{ID: op.Pool, Parent: op.Parent, D: op.D, Tokens: op.Tokens, Pin: true, PrefixHash: pool.PrefixHash(op.Tokens)}
		if op.Admission != nil {
			rec.Admission, _ = json.Marshal(op.Admission)
		}
		if b.store.Has(m) {
			b.store.Record(rec, nil)
			return nil
		}
		data, err := b.ownState(op, true)
		if err != nil {
			b.store.Miss(op.Pool, fmt.Errorf("record: %w", err))
			b.store.Record(rec, nil) // the record alone: a restart prefills the pool
			return err
		}
		b.store.Record(rec, b.withMTP(op, data))
	case engine.OpForget:
		b.store.Forget(op.Pool)
	}
	return nil
}

// ownState copies out the cells [D, L) of the pool on op.Seq. keep: the pool stays
// resident, so its membership of the parent's [0, D) is put back afterwards (an
// evicted pool's sequence is cleared by the engine's next operation anyway).
func (b *Backend) ownState(op engine.SeqOp, keep bool) ([]byte, error) {
	if b.recurrent() {
		return b.saveRecurrent(op.Seq, op.D, len(op.Tokens))
	}
	if lo, hi := b.ctx.SeqPosMin(op.Seq), b.ctx.SeqPosMax(op.Seq); lo != 0 || hi != len(op.Tokens)-1 {
		return nil, fmt.Errorf("pool %d's sequence holds positions [%d, %d], want [0, %d)", op.Pool, lo, hi, len(op.Tokens))
	}
	if b.anchor > 0 {
		// Nothing is taken out of the pool's sequence: the chunks are copied from it.
		return b.saveChunks(op.Seq, op.D, len(op.Tokens))
	}
	if op.D > 0 {
		b.ctx.SeqRm(op.Seq, 0, op.D)
		if keep {
			defer b.ctx.SeqCp(op.Src, op.Seq, 0, op.D)
		}
	}
	return b.ctx.SeqStateGet(op.Seq)
}

// restore loads a pool's own cells from the tier into its empty sequence (load), or
// counts why not.
//
// An entry only on disk is read on another goroutine: the engine goroutine, which every
// session's step runs on, is answered engine.ErrTierPending at once, and the op is sent
// back on TierReady when the bytes are in memory; applied again, it finds them here and
// loads them (the load into llama.cpp must run on the engine goroutine). The restore
// time counted is the read's plus the load's, not the wait in between.
func (b *Backend) restore(op engine.SeqOp, m tier.Meta) error {
	start := time.Now()
	b.mu.Lock()
	pf, ok := b.prefetched[op.Pool]
	delete(b.prefetched, op.Pool)
	b.mu.Unlock()
	var data []byte
	var loc tier.Location
	var err error
	switch {
	case ok:
		data, loc, err = pf.data, pf.loc, pf.err
		start = start.Add(-pf.read)
	case b.store.OnDiskOnly(m):
		go func() {
			t0 := time.Now()
			data, loc, err := b.store.Get(m)
			b.mu.Lock()
			b.prefetched[op.Pool] = prefetch{data: data, loc: loc, err: err, read: time.Since(t0)}
			b.mu.Unlock()
			b.ready <- op
		}()
		return engine.ErrTierPending
	default:
		data, loc, err = b.store.Get(m)
	}
	var part []byte
	if err == nil {
		data, part, err = splitPart(data)
	}
	// A hybrid target's load shares cells into the sequence (mirrored) before the
	// follower's part is loaded: the mirror's check waits for the whole restore.
	b.follower.restoring(true)
	defer b.follower.restoring(false)
	if err == nil {
		if b.recurrent() {
			err = b.loadRecurrent(op.Seq, op.Src, op.D, len(op.Tokens), data)
		} else {
			err = b.load(op.Seq, op.D, len(op.Tokens), data)
		}
		if err != nil {
			err = &tier.MissError{Reason: tier.MissRejected, Err: err}
		}
	}
	if err == nil && b.follower.hasPart() {
		// The target's cells are back whatever happens here: without the MTP part (an
		// entry written without MTP, or one the MTP context refuses) the pool's sessions
		// are only not drafted for.
		if part == nil {
			b.log.Info("pool restored from the tier without MTP cells: its sessions are not MTP-drafted for", "pool", op.Pool)
		} else if e := b.follower.loadPart(op.Seq, op.Src, op.D, len(op.Tokens), part); e != nil {
			b.log.Warn("pool's MTP cells not restored: its sessions are not MTP-drafted for", "pool", op.Pool, "err", e)
		}
	}
	if err != nil {
		b.store.Miss(op.Pool, err)
		return err
	}
	b.store.Restored(loc, time.Since(start))
	return nil
}

// A pool's tier entry on a server whose drafter follows the target (a Follower: the
// model's MTP head, draft-mtp) holds the follower's part too (MTP.savePart), behind the
// target's (the magic names MTP, the only follower, and stays so that entries and slot
// files written before keep loading):
//
//	"PKVMTP1\x00" | u64 target part length | target part | MTP part
//
// An entry without the prefix is the target's part alone (written without MTP, or by a
// version before this format): it restores as before, only without MTP drafts for the
// pool's sessions, and a server without MTP restores an entry with it by dropping the
// MTP part. The prefix cannot open a target part: llama.cpp's sequence state and the
// chunked state (saveChunks) open with a count, "PKVM" read as one is over a billion.
// The entry's own header (tier.Meta, the model key) is unchanged, so both kinds live
// under the same key.
const mtpMagic = "PKVMTP1\x00"

// withMTP adds the follower's part of op's pool to the target's part data (as is
// without a follower, or when the follower does not hold the pool: its sessions were not
// drafted for either).
func (b *Backend) withMTP(op engine.SeqOp, data []byte) []byte {
	out, err := b.envelope(op.Seq, op.Src, op.D, len(op.Tokens), data)
	if err != nil {
		b.log.Warn("pool's MTP cells not saved with it: after a restore its sessions are not MTP-drafted for", "pool", op.Pool, "err", err)
	}
	return out
}

// envelope is data (the target's part of seq's cells [lo, hi)) with the follower's
// part of the same cells behind it (Follower.savePart), in the format above: data as is
// without a follower that keeps cells, and with the error when it cannot give its part.
func (b *Backend) envelope(seq, src, lo, hi int, data []byte) ([]byte, error) {
	if !b.follower.hasPart() { // none, or an MTP assistant's: its cells are the target's
		return data, nil
	}
	part, err := b.follower.savePart(seq, src, lo, hi)
	if err != nil {
		return data, err
	}
	out := make([]byte, 0, len(mtpMagic)+8+len(data)+len(part))
	out = append(out, mtpMagic...)
	out = binary.LittleEndian.AppendUint64(out, uint64(len(data)))
	out = append(out, data...)
	return append(out, part...), nil
}

// splitPart is envelope's inverse: the target's part and the follower's (nil: none).
func splitPart(data []byte) (target, part []byte, err error) {
	if !bytes.HasPrefix(data, []byte(mtpMagic)) {
		return data, nil, nil
	}
	data = data[len(mtpMagic):]
	if len(data) < 8 || binary.LittleEndian.Uint64(data) > uint64(len(data)-8) {
		return nil, nil, &tier.MissError{Reason: tier.MissCorrupt, Err: errors.New("MTP entry: target part longer than the entry")}
	}
	n := binary.LittleEndian.Uint64(data)
	return data[8 : 8+n], data[8+n:], nil
}

// load writes data (from SeqStateGet) into seq and checks that seq then holds exactly
// positions [lo, hi). Where attention is not ordered by position the cache is compacted
// first when cells were removed since the last batch (settle), so the loaded cells land
// above every resident one, in position order
// (the order a prefill would leave them in: see Decode). On failure seq holds nothing.
func (b *Backend) load(seq, lo, hi int, data []byte) error {
	if err := b.settle(); err != nil {
		return err
	}
	if b.anchor > 0 {
		return b.loadChunks(seq, lo, hi, data)
	}
	if err := b.ctx.SeqStateSet(seq, data); err != nil {
		return err
	}
	if p0, p1 := b.ctx.SeqPosMin(seq), b.ctx.SeqPosMax(seq); p0 != lo || p1 != hi-1 {
		b.ctx.SeqRm(seq, -1, -1)
		b.holes = true
		return fmt.Errorf("loaded positions [%d, %d], want [%d, %d)", p0, p1, lo, hi)
	}
	return nil
}

var _ engine.SlotBackend = (*Backend)(nil)

// SaveSeq implements engine.SlotBackend (llama-server's slot save). On a draft-mtp
// server the file holds the MTP context's cells and rows of the slot too (the tier
// entries' envelope), so a restored slot is drafted for as before.
func (b *Backend) SaveSeq(seq int) ([]byte, error) {
	var data []byte
	var err error
	if b.anchor > 0 && !b.recurrent() {
		if lo := b.ctx.SeqPosMin(seq); lo != 0 {
			return nil, fmt.Errorf("sequence %d starts at position %d, not 0", seq, lo)
		}
		data, err = b.saveChunks(seq, 0, b.ctx.SeqPosMax(seq)+1)
	} else {
		data, err = b.ctx.SeqStateGet(seq)
	}
	if err != nil {
		return nil, err
	}
	out, err := b.envelope(seq, -1, 0, b.ctx.SeqPosMax(seq)+1, data)
	if err != nil {
		b.log.Warn("slot's MTP cells not saved with it: after a restore it is not MTP-drafted for", "seq", seq, "err", err)
	}
	return out, nil
}

// LoadSeq implements engine.SlotBackend (llama-server's slot restore). A file with the
// MTP part restores the MTP context's cells and rows of the slot too; one without it
// (saved by a server not drafting with MTP) restores the target's alone, and the slot
// is then not MTP-drafted for; a server without MTP drops the part.
func (b *Backend) LoadSeq(seq, n int, data []byte) error {
	data, part, err := splitPart(data)
	if err != nil {
		return err
	}
	// The target's cells come back before the follower's: the mirror's check waits for
	// the whole restore (as for the tier's).
	b.follower.restoring(true)
	defer b.follower.restoring(false)
	if b.recurrent() {
		err = b.loadRecurrent(seq, -1, 0, n, data)
	} else {
		err = b.load(seq, 0, n, data)
	}
	if err != nil || !b.follower.hasPart() {
		return err
	}
	if part == nil {
		b.log.Info("slot restored without MTP cells: it is not MTP-drafted for", "seq", seq)
	} else if e := b.follower.loadPart(seq, -1, 0, n, part); e != nil {
		b.log.Warn("slot's MTP cells not restored: it is not MTP-drafted for", "seq", seq, "err", e)
	}
	return nil
}

// recurrent: the model keeps recurrent state (recurrent or hybrid layers).
func (b *Backend) recurrent() bool { return b.model.IsRecurrent() || b.model.IsHybrid() }

// A model with recurrent state keeps one state per sequence, valid at its last position,
// beside (in a hybrid) attention cells per position. A pool's entry holds its own
// attention cells [D, L) and its recurrent state at L. It cannot be taken from the
// pool's sequence by removing the parent's [0, D) first, as for attention alone: putting
// them back (seq_cp) would also replace the pool's recurrent state by its parent's
// (llama.cpp's recurrent seq_cp copies a sequence's state whatever the range). So the
// cells [D, L) and the state are shared onto the scratch sequence, saved from there,
// and the pool's sequence is never touched. A load goes the other way: the entry into
// the scratch sequence, then the parent's [0, D) shared onto the pool's sequence and
// the scratch's [D, L) and state after them, so that the state the pool ends with is
// its own. The engine leaves that share to the backend (Config.Recurrent in
// Scheduler.restored).
//
// With sliding-window layers too (Qwen3.5), one state is enough, unlike saveChunks: its
// SWA part leaves out the cells masked for the pool's last position, but such a model
// is only ever continued from a pool boundary (Config.Recurrent), and what follows a
// boundary never attends to a cell the window masks there.

// saveRecurrent copies out seq's cells [lo, hi) and its recurrent state (at hi-1).
func (b *Backend) saveRecurrent(seq, lo, hi int) ([]byte, error) {
	if b.scratch < 0 {
		return nil, errors.New("no scratch sequence for a recurrent model's state")
	}
	if p := b.ctx.SeqPosMax(seq); p != hi-1 {
		return nil, fmt.Errorf("sequence %d ends at position %d, want %d", seq, p, hi-1)
	}
	x := b.scratch
	b.ctx.SeqRm(x, -1, -1)
	defer b.ctx.SeqRm(x, -1, -1)
	b.ctx.SeqCp(seq, x, lo, hi)
	return b.ctx.SeqStateGet(x)
}

// loadRecurrent loads what saveRecurrent wrote into seq, which must be empty, with
// src's [0, lo) shared before it, or (src < 0) already hold exactly [0, lo). On failure
// seq holds nothing.
func (b *Backend) loadRecurrent(seq, src, lo, hi int, data []byte) (err error) {
	if b.scratch < 0 {
		return errors.New("no scratch sequence for a recurrent model's state")
	}
	if lo > 0 && src < 0 && b.ctx.SeqPosMax(seq) != lo-1 {
		return fmt.Errorf("load from position %d without a sequence holding the positions below", lo)
	}
	if err := b.settle(); err != nil {
		return err
	}
	x := b.scratch
	defer func() {
		b.ctx.SeqRm(x, -1, -1)
		if err != nil {
			b.SeqRm(seq, -1, -1)
			b.holes = true
		}
	}()
	if err := b.ctx.SeqStateSet(x, data); err != nil {
		return err
	}
	// A hybrid's lowest position is its recurrent state's (the larger of the two
	// memories' minimums): the attention cells cannot be checked apart from it.
	if p0, p1 := b.ctx.SeqPosMin(x), b.ctx.SeqPosMax(x); p0 != hi-1 || p1 != hi-1 {
		return fmt.Errorf("loaded positions [%d, %d], want a state at %d", p0, p1, hi-1)
	}
	// Through b.SeqCp: with SWA anchors seq's shadow gets them too.
	if lo > 0 && src >= 0 {
		b.SeqCp(src, seq, 0, lo)
	}
	b.SeqCp(x, seq, lo, hi) // last: seq's recurrent state becomes x's
	if p := b.ctx.SeqPosMax(seq); p != hi-1 {
		return fmt.Errorf("sequence ends at position %d after the load, want %d", p, hi-1)
	}
	return nil
}

// A sliding-window model's saved state, in chunks. llama.cpp's sequence state leaves
// out every cell the window masks for the sequence's last position
// (llama_kv_cache::state_write), so one state of a pool holds only its last window in
// the SWA layers, and the pool could not serve an attach or fork below it. Its state is
// therefore saved a window-aligned chunk of positions at a time, each copied into the
// scratch sequence alone, where no cell of the chunk is masked for the chunk's own last
// position (a standard or chunked window; anything else fails the position check on
// load and counts as a miss). On load, each chunk goes into the scratch sequence (a
// sequence's load first drops what it held), then is shared with the pool's sequence
// and its shadow, so every loaded cell keeps two members and is never handed out again
// while the next chunks load (see EnableSWAAnchors). Hand-written: llama.cpp has no
// flag that writes a sequence's masked cells (LLAMA_STATE_SEQ_FLAGS_* select parts of
// the memory, not the window).
//
// Format: per chunk, its first position, one past its last, and its state's length
// (each a little-endian uint64), then the state.

// swaChunks is the window-aligned chunks of positions [lo, hi).
func (b *Backend) swaChunks(lo, hi int) [][2]int {
	w := b.model.NSWA()
	var out [][2]int
	for a := lo; a < hi; {
		e := min(hi, (a/w+1)*w)
		out = append(out, [2]int{a, e})
		a = e
	}
	return out
}

// saveChunks copies out the cells [lo, hi) of seq, chunk by chunk (see above).
func (b *Backend) saveChunks(seq, lo, hi int) ([]byte, error) {
	return saveChunks(b.ctx, b.scratch, seq, b.swaChunks(lo, hi))
}

// loadChunks loads what saveChunks wrote into seq (and its shadow), which must be
// empty, and checks that each chunk and the whole hold exactly their positions. On
// failure seq holds nothing.
func (b *Backend) loadChunks(seq, lo, hi int, data []byte) (err error) {
	defer func() {
		if err != nil {
			b.SeqRm(seq, -1, -1)
			b.holes = true
		}
	}()
	x := b.scratch
	if err := loadChunks(b.ctx, x, lo, hi, data, func(c0, c1 int) {
		b.SeqCp(x, seq, c0, c1) // mirrored on seq's shadow
	}); err != nil {
		return err
	}
	if p0, p1 := b.ctx.SeqPosMin(seq), b.ctx.SeqPosMax(seq); p0 != lo || p1 != hi-1 {
		return fmt.Errorf("loaded positions [%d, %d], want [%d, %d)", p0, p1, lo, hi)
	}
	return nil
}

// saveChunks copies out seq's cells of each chunk of ctx through the empty scratch
// sequence x, in the format above. The target's part and the MTP context's
// (MTP.saveChunks) are saved alike.
func saveChunks(ctx *llama.Context, x, seq int, chunks [][2]int) ([]byte, error) {
	defer ctx.SeqRm(x, -1, -1)
	var out []byte
	for _, c := range chunks {
		ctx.SeqRm(x, -1, -1)
		ctx.SeqCp(seq, x, c[0], c[1])
		data, err := ctx.SeqStateGet(x)
		if err != nil {
			return nil, err
		}
		out = binary.LittleEndian.AppendUint64(out, uint64(c[0]))
		out = binary.LittleEndian.AppendUint64(out, uint64(c[1]))
		out = binary.LittleEndian.AppendUint64(out, uint64(len(data)))
		out = append(out, data...)
	}
	return out, nil
}

// loadChunks loads the chunks saveChunks wrote for positions [lo, hi) into ctx, one at
// a time into the scratch sequence x (a sequence's load first drops what it held),
// checks that each holds exactly its positions and that they cover [lo, hi), and hands
// each to share, which gives its cells to their sequence (and its shadow) before the
// next load drops them from x.
func loadChunks(ctx *llama.Context, x, lo, hi int, data []byte, share func(c0, c1 int)) error {
	defer ctx.SeqRm(x, -1, -1)
	next := lo
	for len(data) > 0 {
		if len(data) < 24 {
			return fmt.Errorf("chunked state: %d bytes left, want a 24-byte chunk header", len(data))
		}
		c0, c1, n := binary.LittleEndian.Uint64(data), binary.LittleEndian.Uint64(data[8:]), binary.LittleEndian.Uint64(data[16:])
		data = data[24:]
		if c0 != uint64(next) || c1 <= c0 || c1 > uint64(hi) || n > uint64(len(data)) {
			return fmt.Errorf("chunked state: chunk [%d, %d) of %d bytes, want one from %d up to %d within %d bytes", c0, c1, n, next, hi, len(data))
		}
		if err := ctx.SeqStateSet(x, data[:n]); err != nil {
			return err
		}
		data = data[n:]
		if p0, p1 := ctx.SeqPosMin(x), ctx.SeqPosMax(x); p0 != int(c0) || p1 != int(c1)-1 {
			return fmt.Errorf("chunk loaded positions [%d, %d], want [%d, %d)", p0, p1, c0, c1)
		}
		share(int(c0), int(c1))
		next = int(c1)
	}
	if next != hi {
		return fmt.Errorf("chunked state ends at position %d, want %d", next, hi)
	}
	return nil
}
