package runner

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync/atomic"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
)

// MTP drafts with the served model's own MTP (NextN) head (--spec-type draft-mtp;
// issue 23). The head is one more decoder block that reads a token's embedding beside
// the target's hidden state h of the position before it and predicts the token after;
// it keeps a KV cache of its own in a second llama.cpp context on the same model
// (llama.ContextParams.MTPTarget).
//
// The MTP context mirrors the target's cells: after every target decode it decodes the
// same entries (token, position, sequence), each with the target's h of the position
// before it in the same sequence; every SeqRm and SeqCp the backend applies to the
// target is applied to it too, so a session attached to a pool (a seq_cp) finds the
// pool's MTP cells in its own sequence, exactly as in the target. This is llama.cpp's
// own draft-mtp driver (common_speculative_impl_draft_mtp fed by every batch the
// server decodes) carried over to PolyKV's operations; unlike the draft model
// (Drafter), it cannot resync by token prefix later, because h exists only while the
// target decodes that position.
//
// h of a position is read from the target's decode that wrote it (unmasked NextN rows:
// one per batch entry). The h needed across decodes (the first entry of a sequence in
// a batch needs the row of its last position before) comes from the rows kept per
// sequence, one per position it holds, shared (by reference) between sequences as the
// cells are: a sequence's last decode cut back by a rejected draft still has the row of
// its last accepted position, and a prefix copied from the middle of another sequence
// (the prefix cache) has the row at its cut. That costs n_embd floats per cell in RAM
// beside the target's KV (1 KiB on the test models; 16 KiB on GLM-4.5-Air, under a tenth
// of its 46 layers' KV per cell), bounded by the cells in use. A pool's rows go to the
// pool tier with its MTP cells (saveSeq, loadSeq). Where no row is known (an entry the
// tier restored without MTP cells, a failed MTP decode) the entry is decoded with h = 0
// and counted as a gap: the MTP cache is then slightly wrong at that position, which
// costs acceptance, never correctness (the target verifies every draft). A sequence
// whose MTP cells do not start at 0 or end one before the session's next token (a pool
// restored from a tier entry without MTP cells) is not drafted for.
//
// Draft runs the head autoregressively (a model with several MTP blocks chains them
// instead, one draft per block: ChainHeads), batched over all drafting sessions: the first
// entry is the session's next token with the target's h of the position before it,
// each later one the last drafted token with the head's own row; a session stops at
// the wanted length or at a token the head gives less than --draft-p-min. The draft
// positions are removed again afterwards: when the target verifies them, the mirror
// decodes them with the target's rows.
//
// An MTP assistant (Gemma 4's: a model file of its own, llama.Model.IsAssistant) keeps
// no cache: its context's layers attend over the target's cells, shared by llama.cpp
// (llama.Context.SharesTargetKV), so there is nothing to mirror and every cell operation
// on it is a no-op. MTP then only keeps, per sequence, the target's rows of the entries
// its last decode sampled and of its last entry (one of them is the row of the position
// before the session's next token, whichever of its drafts were accepted), drafts at the
// next token's position (the assistant writes no cells, so each draft token is read at
// that same position, as llama.cpp's driver does), and has no part in tier entries or slot
// files. A sequence whose row of its last position is not kept (its last decode ended
// elsewhere) is not drafted for.
type MTP struct {
	tgt, ctx *llama.Context
	// heads are the MTP contexts, one per NextN block a model with several chains its
	// drafts through (ChainHeads); heads[0] is ctx. Each mirrors the target.
	heads []*llama.Context
	nVoc  int
	pMin  float32
	zero  []float32
	// rows: per target sequence, the rows of the positions it holds, ascending. Each
	// sequence's slice has a backing array of its own (rows are shared, slices never),
	// so it is truncated and appended to in place.
	rows map[int][]posRow
	log  *slog.Logger
	// shared: ctx is an MTP assistant's over the target's cells (see MTP).
	shared bool

	// gaps counts entries decoded with h = 0 because the row was not known;
	// decoded counts the mirror's entries; drafted the head's draft tokens (tests,
	// diagnostics: safe from any goroutine).
	gaps, decoded, drafted atomic.Int64
	// noRoom counts an assistant's draft decodes that found no free cell in the target's
	// cache (NoRoom).
	noRoom atomic.Int64
	// checkSeqs > 0: after every mirrored operation, sequences below it are compared
	// with the target's and a difference counted in mismatches, the first kept in
	// mismatch (CheckMirror; tests). paused: a tier restore is under way, whose
	// target-side operations leave the two apart until it ends (engine goroutine only).
	checkSeqs  atomic.Int32
	paused     bool
	mismatches atomic.Int64
	mismatch   atomic.Value // string
	// backend is the target's backend (Backend.EnableMTP; nil in tests of the MTP alone),
	// whose SWA shadows (anchor), window chunks and scratch sequence the MTP context uses
	// too: on a model with sliding-window layers its SWA cache hands a cell held by one
	// sequence to another once it falls out of that sequence's window, as the target's
	// does, so each sequence's cells get the same shadow here (mirror, seqRm, seqCp,
	// loadSeq), and a pool's MTP part is saved and loaded chunk by chunk, as the
	// target's part is (saveChunks), because an SWA cache's state holds only the window.
	backend *Backend
}

// anchor is the target's SWA shadow offset (0: none).
func (m *MTP) anchor() int {
	if m.backend == nil {
		return 0
	}
	return m.backend.anchor
}

// posRow is the target's NextN row h of one position.
type posRow struct {
	pos int
	h   []float32
}

// NewMTP drafts for the target context tgt of model (loaded with its MTP layers; tgt's
// NextN rows turned on, unmasked) with ctx, an MTP context over it with as many
// sequence ids and at least its batch size.
func NewMTP(model *llama.Model, tgt, ctx *llama.Context, pMin float64, log *slog.Logger) (*MTP, error) {
	if !ctx.IsMTP() {
		return nil, fmt.Errorf("mtp: not an MTP context")
	}
	if ctx.NSeqMax() < tgt.NSeqMax() || ctx.BatchCap() < tgt.BatchCap() {
		return nil, fmt.Errorf("mtp: the MTP context has %d sequences and batches of %d, the target %d and %d",
			ctx.NSeqMax(), ctx.BatchCap(), tgt.NSeqMax(), tgt.BatchCap())
	}
	if log == nil {
		log = slog.Default()
	}
	return &MTP{tgt: tgt, ctx: ctx, heads: []*llama.Context{ctx}, nVoc: model.NVocab(), pMin: float32(pMin), shared: ctx.SharesTargetKV(),
		zero: make([]float32, model.NEmbdOut()), rows: map[int][]posRow{}, log: log}, nil
}

// ChainHeads adds MTP contexts for a model with several NextN blocks, each set to run
// block 1, 2, … in turn (llama.Context.SetNextNLayer), shaped as the first. Its drafts
// are then chained as llama.cpp's driver chains them: draft i comes from block i, at
// most one draft per block. llama.cpp keeps the blocks in one context and, for every
// batch, removes the positions the previous block wrote and decodes them again under the
// next, which leaves each block's KV where the cache happens to place the same cells
// again; PolyKV's cache, with holes left by other sequences, does not place them so, so
// each block has a context of its own here, mirrored like the first (memory: each
// context allocates every block's KV, of which it fills one).
func (m *MTP) ChainHeads(ctxs ...*llama.Context) error {
	for _, c := range ctxs {
		if !c.IsMTP() || c.SharesTargetKV() || c.NSeqMax() < m.ctx.NSeqMax() || c.BatchCap() < m.ctx.BatchCap() {
			return fmt.Errorf("mtp: a chained head needs an MTP context of its own shaped as the first")
		}
	}
	m.heads = append(m.heads, ctxs...)
	return nil
}

// Gaps is the number of mirrored entries decoded without their h (see MTP); Decoded the
// entries the mirror decoded; Drafted the tokens the head drafted. Safe from any goroutine.
func (m *MTP) Gaps() int64    { return m.gaps.Load() }
func (m *MTP) Decoded() int64 { return m.decoded.Load() }
func (m *MTP) Drafted() int64 { return m.drafted.Load() }

// NoRoom is the number of an MTP assistant's draft decodes refused for want of a free
// cell in the target's cache (no drafts that step). Safe from any goroutine.
func (m *MTP) NoRoom() int64 { return m.noRoom.Load() }

// CheckMirror makes the mirror compare, after every decode, SeqRm and SeqCp it mirrors,
// the positions each sequence below n holds in the MTP context with the target's
// (tests: Mismatches reports what it found). Safe from any goroutine.
func (m *MTP) CheckMirror(n int) { m.checkSeqs.Store(int32(n)) }

// Mirrors reports whether the MTP context keeps cells of its own beside every target
// cell (an MTP head; false for an assistant, which reads the target's): sequences'
// cells then cannot be loaded back from the tier without its part (issue 40: the engine
// spills no session or cached sequence, engine.Config.NoSequenceSpill).
func (m *MTP) Mirrors() bool { return !m.shared }

// Mismatches is the number of checks (CheckMirror) that found the MTP context's cells
// differing from the target's, and the first difference. Safe from any goroutine.
func (m *MTP) Mismatches() (int64, string) {
	s, _ := m.mismatch.Load().(string)
	return m.mismatches.Load(), s
}

// check compares the sequences' positions with the target's (see CheckMirror).
func (m *MTP) check(op string) {
	if m.paused || m.shared {
		return
	}
	for seq := range int(m.checkSeqs.Load()) {
		// llama.cpp reports a rolled-back sequence's old last position until its next
		// decode consumes the rollback: skipped.
		if m.backend != nil && m.backend.rolled[seq] {
			continue
		}
		tlo, thi := m.tgt.SeqPosMin(seq), m.tgt.SeqPosMax(seq)
		for h, c := range m.heads {
			mlo, mhi := c.SeqPosMin(seq), c.SeqPosMax(seq)
			// (A hybrid target's lowest position is its recurrent state's, its last: only
			// the highest compares; the MTP context's own cache starts at 0.)
			if thi != mhi || (mhi >= 0 && mlo != 0) {
				if m.mismatches.Add(1) == 1 {
					m.mismatch.Store(fmt.Sprintf("after %s: sequence %d: target holds %d..%d, the MTP context (head %d) %d..%d", op, seq, tlo, thi, h, mlo, mhi))
				}
				return
			}
		}
	}
}

// row is h of seq's position pos from the rows kept (nil: not kept).
func (m *MTP) row(seq, pos int) []float32 {
	rs := m.rows[seq]
	if i, ok := slices.BinarySearchFunc(rs, pos, cmpPos); ok {
		return rs[i].h
	}
	return nil
}

func cmpPos(r posRow, pos int) int { return r.pos - pos }

// mirror mirrors a target decode of batch (its NextN rows still readable). A failure
// drops the batch's sequences from the MTP context, whose cache may hold part of it;
// they are then not drafted for (their positions no longer start at 0).
func (m *MTP) mirror(batch []engine.BatchEntry) {
	if m.shared {
		m.keepLast(batch)
		return
	}
	fresh := map[int][]posRow{} // this batch's rows, per sequence
	hs := make([][]float32, len(batch))
	for i, e := range batch {
		var h []float32
		if f := fresh[e.Seq]; len(f) > 0 && f[len(f)-1].pos == e.Pos-1 {
			h = f[len(f)-1].h
		} else if e.Pos > 0 {
			h = m.row(e.Seq, e.Pos-1)
		}
		if h == nil {
			if e.Pos > 0 {
				m.gaps.Add(1)
			}
			h = m.zero
		}
		hs[i] = h
		// A view of the target's buffer (BatchAddEmbd copies h into the MTP batch); the
		// rows are copied once, below.
		fresh[e.Seq] = append(fresh[e.Seq], posRow{e.Pos, m.tgt.EmbeddingsNextNView(i)})
	}
	m.decoded.Add(int64(len(batch)))
	for _, c := range m.heads {
		c.BatchClear()
		for i, e := range batch {
			if _, err := c.BatchAddEmbd(e.Token, e.Pos, e.Seq, false, hs[i]); err != nil {
				m.fail(batch, err)
				return
			}
		}
		if err := c.Decode(); err != nil {
			m.fail(batch, err)
			return
		}
	}
	for seq, f := range fresh {
		if a := m.anchor(); a > 0 {
			for _, c := range m.heads {
				c.SeqCp(seq, seq+a, f[0].pos, f[len(f)-1].pos+1)
			}
		}
		// A decode writes a sequence's positions from f[0].pos up (llama.cpp replaces
		// any it held there). f's rows are views of the target's output buffer: copied.
		rs := m.rows[seq]
		i, _ := slices.BinarySearchFunc(rs, f[0].pos, cmpPos)
		rs = rs[:i]
		for _, r := range f {
			rs = append(rs, posRow{r.pos, slices.Clone(r.h)})
		}
		m.rows[seq] = rs
	}
	m.check("decode")
}

// keepLast keeps, for each sequence of batch, the target's rows of its sampled entries
// and of its last one, in place of what it kept before: an assistant's draft starts from
// the row of the sequence's last position, which is its last entry or, after a rollback,
// one of its verified drafts (see MTP). The rest of a prefill chunk's rows are not kept:
// they would cost n_embd floats per prompt token and are never read.
func (m *MTP) keepLast(batch []engine.BatchEntry) {
	last := map[int]int{}
	for i, e := range batch {
		last[e.Seq] = i
	}
	for seq := range last {
		m.rows[seq] = m.rows[seq][:0]
	}
	for i, e := range batch {
		if e.Sample || last[e.Seq] == i {
			m.rows[e.Seq] = append(m.rows[e.Seq], posRow{e.Pos, m.tgt.EmbeddingsNextN(i)})
		}
	}
}

func (m *MTP) fail(batch []engine.BatchEntry, err error) {
	m.log.Warn("MTP context decode failed: its sequences are not drafted for until emptied", "err", err)
	for _, e := range batch {
		for _, c := range m.heads {
			c.SeqRm(e.Seq, 0, -1)
			if a := m.anchor(); a > 0 {
				c.SeqRm(e.Seq+a, 0, -1)
			}
		}
		delete(m.rows, e.Seq)
	}
}

// seqRm mirrors a SeqRm on the target.
func (m *MTP) seqRm(seq, p0, p1 int) {
	for _, c := range m.heads {
		c.SeqRm(seq, p0, p1)
		if a := m.anchor(); a > 0 {
			c.SeqRm(seq+a, p0, p1)
		}
	}
	switch rs := m.rows[seq]; {
	case p0 <= 0 && p1 < 0:
		delete(m.rows, seq)
	case p1 < 0:
		// A trailing cut (rejected drafts, every step): no scan of the held rows.
		i, _ := slices.BinarySearchFunc(rs, p0, cmpPos)
		clear(rs[i:]) // (the cut rows' h are garbage now)
		m.rows[seq] = rs[:i]
	default:
		m.rows[seq] = slices.DeleteFunc(rs, func(r posRow) bool { return r.pos >= p0 && r.pos < p1 })
	}
	m.check("seq_rm")
}

// seqCp mirrors a SeqCp on the target: dst gets src's cells and rows in [p0, p1).
func (m *MTP) seqCp(src, dst, p0, p1 int) {
	for _, c := range m.heads {
		c.SeqCp(src, dst, p0, p1)
		if a := m.anchor(); a > 0 {
			c.SeqCp(src, dst+a, p0, p1)
		}
	}
	in := func(r posRow) bool { return r.pos >= p0 && (p1 < 0 || r.pos < p1) }
	rs := slices.DeleteFunc(slices.Clone(m.rows[dst]), in)
	for _, r := range m.rows[src] {
		if in(r) {
			rs = append(rs, r) // rows are never written in place: sharing is safe
		}
	}
	slices.SortFunc(rs, func(a, b posRow) int { return a.pos - b.pos })
	m.rows[dst] = rs
	m.check("seq_cp")
}

// mtpJob is one want in flight.
type mtpJob struct {
	w    engine.DraftWant
	out  []llama.Token
	idx  int // batch index of the entry whose row gives the next token
	done bool
}

// Draft implements engine.DraftBackend's drafting (see MTP).
func (m *MTP) Draft(wants []engine.DraftWant) []engine.DraftProposal {
	if len(m.heads) > 1 {
		return m.draftChained(wants)
	}
	var jobs []*mtpJob
	m.ctx.BatchClear()
	ws, hs := m.startable(wants)
	for k, w := range ws {
		n := len(w.Tokens)
		i, err := m.ctx.BatchAddEmbd(w.Tokens[n-1], n-1, w.Seq, true, hs[k])
		if err != nil {
			break
		}
		jobs = append(jobs, &mtpJob{w: w, idx: i})
	}
	if len(jobs) == 0 {
		return nil
	}
	// Whatever happens, the draft positions go: the mirror writes them again, with the
	// target's rows, when the target decodes them.
	defer func() {
		for _, j := range jobs {
			m.ctx.SeqRm(j.w.Seq, len(j.w.Tokens)-1, -1)
		}
	}()
	for m.ctx.BatchLen() > 0 {
		if err := m.ctx.Decode(); err != nil {
			if m.shared && errors.Is(err, llama.ErrNoKVSlot) {
				// llama.cpp places an assistant's entries in the target's cache, though it
				// writes nothing there: with that cache full there are no drafts until
				// cells are freed. The server's target context has a cell per session
				// beyond the scheduler's for them (app.Open), so this is not expected;
				// said once, not every step, should it happen.
				if m.noRoom.Add(1) == 1 {
					m.log.Info("MTP assistant: no drafts while the target's KV cache has no free cell (llama.cpp places its entries there); said once")
				}
				return nil
			}
			m.log.Warn("MTP draft decode failed: no drafts this step", "err", err)
			return nil
		}
		// Read every pick before the batch is rebuilt: the rows live in the context's
		// output buffer until the next decode.
		type next struct {
			j   *mtpJob
			tok llama.Token
			h   []float32
		}
		var nexts []next
		for _, j := range jobs {
			if j.done {
				continue
			}
			tok, p, ok := m.ctx.Greedy(j.idx, m.nVoc)
			if !ok || p < m.pMin {
				j.done = true
				continue
			}
			j.out = append(j.out, tok)
			m.drafted.Add(1)
			if len(j.out) >= j.w.K {
				j.done = true
				continue
			}
			nexts = append(nexts, next{j, tok, m.ctx.EmbeddingsNextN(j.idx)})
		}
		m.ctx.BatchClear()
		for _, x := range nexts {
			if x.h == nil { // (the head gives a row for every entry with logits)
				x.j.done = true
				continue
			}
			pos := len(x.j.w.Tokens) - 1 // an assistant reads every draft token there (see MTP)
			if !m.shared {
				pos += len(x.j.out)
			}
			i, err := m.ctx.BatchAddEmbd(x.tok, pos, x.j.w.Seq, true, x.h)
			if err != nil {
				x.j.done = true
				continue
			}
			x.j.idx = i
		}
	}
	out := make([]engine.DraftProposal, 0, len(jobs))
	for _, j := range jobs {
		if len(j.out) > 0 {
			out = append(out, engine.DraftProposal{Task: j.w.Task, At: len(j.w.Tokens), Tokens: j.out})
		}
	}
	return out
}

// startable is the wants the MTP contexts can draft for (one per sequence), each with the
// target's row of the position before its next token: the MTP cells must be the target's,
// positions 0..n-2 (the next token, at n-1, is not decoded yet; an assistant's cells are
// the target's own), and that row known.
func (m *MTP) startable(wants []engine.DraftWant) ([]engine.DraftWant, [][]float32) {
	var ws []engine.DraftWant
	var hs [][]float32
	seen := map[int]bool{}
	for _, w := range wants {
		n := len(w.Tokens)
		if w.K < 1 || n < 2 || seen[w.Seq] {
			continue
		}
		h := m.row(w.Seq, n-2)
		if h == nil || m.ctx.SeqPosMax(w.Seq) != n-2 || (!m.shared && m.ctx.SeqPosMin(w.Seq) != 0) {
			continue
		}
		seen[w.Seq] = true
		ws, hs = append(ws, w), append(hs, h)
	}
	return ws, hs
}

// chainJob is one want in flight through chained heads: the tokens drafted so far and the
// rows they were read with (rows[0] the target's of the position before the next token,
// rows[t] the row head t-1 gave with draft t).
type chainJob struct {
	w    engine.DraftWant
	out  []llama.Token
	rows [][]float32
	idx  int
	done bool
}

// draftChained drafts through the heads in turn (ChainHeads), as llama.cpp's driver
// chains them: draft i is head i's pick after it reads the next token and drafts 1..i,
// each at its position with its row, in the head's own context, whose cells hold the
// target's up to the position before the next token (mirrored); at most one draft per
// head. Every entry asks for logits: with b11434's masked NextN rows only that keeps an
// entry's row at its batch index (see llama.Context.EmbeddingsNextN).
func (m *MTP) draftChained(wants []engine.DraftWant) []engine.DraftProposal {
	var jobs []*chainJob
	ws, hs := m.startable(wants)
	for k, w := range ws {
		jobs = append(jobs, &chainJob{w: w, rows: [][]float32{hs[k]}})
	}
	if len(jobs) == 0 {
		return nil
	}
	defer func() {
		for _, j := range jobs {
			for _, c := range m.heads {
				c.SeqRm(j.w.Seq, len(j.w.Tokens)-1, -1)
			}
		}
	}()
	for _, c := range m.heads {
		c.BatchClear()
		live := false
		for _, j := range jobs {
			if j.done {
				continue
			}
			n := len(j.w.Tokens)
			for t := 0; t <= len(j.out); t++ {
				tok := j.w.Tokens[n-1]
				if t > 0 {
					tok = j.out[t-1]
				}
				i, err := c.BatchAddEmbd(tok, n-1+t, j.w.Seq, true, j.rows[t])
				if err != nil {
					j.done = true
					break
				}
				j.idx = i
			}
			live = live || !j.done
		}
		if !live {
			break
		}
		if err := c.Decode(); err != nil {
			m.log.Warn("MTP draft decode failed: no more drafts this step", "err", err)
			break
		}
		for _, j := range jobs {
			if j.done {
				continue
			}
			tok, p, ok := c.Greedy(j.idx, m.nVoc)
			row := c.EmbeddingsNextN(j.idx)
			if !ok || p < m.pMin || row == nil {
				j.done = true
				continue
			}
			j.out = append(j.out, tok)
			j.rows = append(j.rows, row)
			m.drafted.Add(1)
			j.done = len(j.out) >= j.w.K
		}
	}
	out := make([]engine.DraftProposal, 0, len(jobs))
	for _, j := range jobs {
		if len(j.out) > 0 {
			out = append(out, engine.DraftProposal{Task: j.w.Task, At: len(j.w.Tokens), Tokens: j.out})
		}
	}
	return out
}

// DraftSeqRm implements engine.DraftBackend: nothing to do, the target's SeqRm of the
// sequence was mirrored already.
func (m *MTP) DraftSeqRm(int) {}

// A pool's MTP part in its tier entry (saveSeq, loadSeq): the MTP context's sequence
// state of the pool's own cells [D, L) and the target's rows of those positions, so a
// restored pool's sessions draft as before its eviction, with no gap. Little-endian:
//
//	u64 state length | state | u64 row count | u64 row width | per row: u64 position, width × f32
//	| per further head (ChainHeads): u64 state length | state
//
// Hand-written beside llama.cpp's state format: the rows are PolyKV's (the target's
// NextN outputs), which no llama.cpp state holds.

// saveSeq copies out seq's MTP cells [lo, hi) and their rows. As for the target
// (Backend.ownState), the cells below lo are the parent's (src's): they are taken out of
// seq for the copy and shared back from src after it.
func (m *MTP) saveSeq(seq, src, lo, hi int) ([]byte, error) {
	states := make([][]byte, len(m.heads))
	for h, c := range m.heads {
		if p0, p1 := c.SeqPosMin(seq), c.SeqPosMax(seq); p0 != 0 || p1 != hi-1 {
			return nil, fmt.Errorf("the MTP context (head %d) holds positions [%d, %d] of sequence %d, want [0, %d)", h, p0, p1, seq, hi)
		}
		st, err := m.headState(c, seq, src, lo, hi)
		if err != nil {
			return nil, err
		}
		states[h] = st
	}
	var rs []posRow
	for _, r := range m.rows[seq] {
		if r.pos >= lo && r.pos < hi {
			rs = append(rs, r)
		}
	}
	w := len(m.zero)
	out := make([]byte, 0, 8+len(states[0])+16+len(rs)*(8+4*w))
	out = binary.LittleEndian.AppendUint64(out, uint64(len(states[0])))
	out = append(out, states[0]...)
	out = binary.LittleEndian.AppendUint64(out, uint64(len(rs)))
	out = binary.LittleEndian.AppendUint64(out, uint64(w))
	for _, r := range rs {
		out = binary.LittleEndian.AppendUint64(out, uint64(r.pos))
		for _, x := range r.h {
			out = binary.LittleEndian.AppendUint32(out, math.Float32bits(x))
		}
	}
	for _, st := range states[1:] {
		out = binary.LittleEndian.AppendUint64(out, uint64(len(st)))
		out = append(out, st...)
	}
	return out, nil
}

// headState is head context c's state of seq's cells [lo, hi) (see saveSeq): chunk by
// chunk through the backend's scratch sequence where the target keeps SWA shadows, in the
// target's chunked format (Backend.saveChunks).
func (m *MTP) headState(c *llama.Context, seq, src, lo, hi int) ([]byte, error) {
	if m.anchor() > 0 {
		return saveChunks(c, m.backend.scratch, seq, m.backend.swaChunks(lo, hi))
	}
	if lo > 0 {
		c.SeqRm(seq, 0, lo)
		defer c.SeqCp(src, seq, 0, lo)
	}
	return c.SeqStateGet(seq)
}

// loadSeq loads what saveSeq wrote into seq and checks that seq then holds exactly
// [lo, hi), or [0, hi) where it held src's [0, lo) already. An attention-only target's
// pool sequence is empty here (the engine shares the parent's [0, lo) after the
// restore, mirrored like any SeqCp); a hybrid target's restore (Backend.loadRecurrent)
// shared them before, and llama.cpp's state load empties the sequence first, so they
// are shared again from src after it. On failure seq holds nothing in the MTP contexts
// (its sessions are then not drafted for).
func (m *MTP) loadSeq(seq, src, lo, hi int, data []byte) (err error) {
	defer func() {
		for _, c := range m.heads {
			if err != nil {
				c.SeqRm(seq, -1, -1)
			}
			if a := m.anchor(); a > 0 {
				// The shadow holds exactly seq's cells again (none on failure).
				c.SeqRm(seq+a, -1, -1)
				c.SeqCp(seq, seq+a, -1, -1)
			}
		}
		if err != nil {
			delete(m.rows, seq)
		}
	}()
	prefix := m.ctx.SeqPosMax(seq) >= 0
	for h, c := range m.heads {
		if p0, p1 := c.SeqPosMin(seq), c.SeqPosMax(seq); (p1 >= 0) != prefix || (prefix && (p0 != 0 || p1 != lo-1 || src < 0)) {
			return fmt.Errorf("sequence %d holds MTP cells [%d, %d] (head %d) before the load, want none or [0, %d) of sequence %d", seq, p0, p1, h, lo, src)
		}
	}
	below := slices.Clone(m.rows[seq])
	u64 := func() (uint64, bool) {
		if len(data) < 8 {
			return 0, false
		}
		v := binary.LittleEndian.Uint64(data)
		data = data[8:]
		return v, true
	}
	state := func() ([]byte, error) {
		n, ok := u64()
		if !ok || n > uint64(len(data)) {
			return nil, fmt.Errorf("MTP part: a state of %d bytes in %d", n, len(data))
		}
		st := data[:n]
		data = data[n:]
		return st, nil
	}
	states := make([][]byte, len(m.heads))
	if states[0], err = state(); err != nil {
		return err
	}
	nr, ok1 := u64()
	w, ok2 := u64()
	if !ok1 || !ok2 || w != uint64(len(m.zero)) || nr > uint64(hi-lo) || uint64(len(data)) < nr*(8+4*w) {
		return fmt.Errorf("MTP part: %d rows of width %d in %d bytes, want rows of width %d within [%d, %d)", nr, w, len(data), len(m.zero), lo, hi)
	}
	rs := make([]posRow, nr)
	for i := range rs {
		p, _ := u64()
		if int(p) < lo || int(p) >= hi || (i > 0 && int(p) <= rs[i-1].pos) {
			return fmt.Errorf("MTP part: row position %d out of order or outside [%d, %d)", p, lo, hi)
		}
		h := make([]float32, w)
		for j := range h {
			h[j] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*j:]))
		}
		data = data[4*w:]
		rs[i] = posRow{int(p), h}
	}
	for h := 1; h < len(m.heads); h++ {
		if states[h], err = state(); err != nil {
			return fmt.Errorf("%w (head %d of %d)", err, h, len(m.heads))
		}
	}
	if len(data) > 0 {
		return fmt.Errorf("MTP part: %d bytes past the states of %d heads", len(data), len(m.heads))
	}
	for h, c := range m.heads {
		if err := m.loadHead(c, seq, src, lo, hi, states[h], prefix); err != nil {
			return fmt.Errorf("head %d: %w", h, err)
		}
	}
	m.rows[seq] = append(below, rs...)
	return nil
}

// loadHead loads head context c's state st (headState) into seq's [lo, hi), whose [0, lo)
// it holds already if prefix (shared from src).
func (m *MTP) loadHead(c *llama.Context, seq, src, lo, hi int, st []byte, prefix bool) error {
	if a := m.anchor(); a > 0 {
		// Chunk by chunk through the scratch sequence, which leaves seq's [0, lo) as it
		// is; each chunk is shared with seq and its shadow (so a loaded cell always has
		// two members, as the target's).
		x := m.backend.scratch
		if err := loadChunks(c, x, lo, hi, st, func(c0, c1 int) {
			c.SeqCp(x, seq, c0, c1)
			c.SeqCp(x, seq+a, c0, c1)
		}); err != nil {
			return err
		}
		if p0, p1 := c.SeqPosMin(seq), c.SeqPosMax(seq); (p0 != lo && !(prefix && p0 == 0)) || p1 != hi-1 {
			return fmt.Errorf("the MTP context loaded positions [%d, %d], want [%d, %d)", p0, p1, lo, hi)
		}
		return nil
	}
	if err := c.SeqStateSet(seq, st); err != nil {
		return err
	}
	if p0, p1 := c.SeqPosMin(seq), c.SeqPosMax(seq); p0 != lo || p1 != hi-1 {
		return fmt.Errorf("the MTP context loaded positions [%d, %d], want [%d, %d)", p0, p1, lo, hi)
	}
	if prefix {
		c.SeqCp(src, seq, 0, lo)
		if p0 := c.SeqPosMin(seq); p0 != 0 {
			return fmt.Errorf("sequence %d starts at %d after sharing [0, %d) back", seq, p0, lo)
		}
	}
	return nil
}
