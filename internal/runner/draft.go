package runner

import (
	"log/slog"
	"slices"
	"sync/atomic"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
)

// Drafter drafts with a second model of the target's vocabulary in its own llama.cpp
// context (--model-draft, --spec-type draft-simple; issue 23): for every session the
// scheduler names (engine.DraftWant) it brings the session's draft sequence up to the
// session's context, then drafts greedily, one token per session per decode, batched
// over all drafting sessions.
//
// Draft sequences mirror the target's sequence ids (the draft context has as many) and
// are kept in sync by token prefix, not by replaying the target's operations: on each
// Draft the draft sequence keeps its longest common prefix with the session's tokens,
// its divergent tail (rejected drafts, a rewound session, a sequence reused by another
// task) is removed, and what is missing is decoded in chunks. A session that borrows a
// pool's prefix gets it by seq_cp from the pool's draft sequence, which is prefilled
// once for all its sessions. Cells held for a sequence the target empties are freed at
// once (DraftSeqRm); those of sequences not drafting now are evicted when the draft
// context runs out of room.
//
// Why not llama.cpp's common/speculative (draft-simple): its per-sequence state is fed
// by mirroring the target's llama_batch (common_speculative_process) and its prompt
// (begin); PolyKV's sessions get much of their context from a pool or the prefix cache
// by seq_cp, never in a batch, and the scheduler, not the drafter, decides how many
// tokens each session may draft (the cost-aware limit). Syncing by token prefix needs
// neither, and keeps common/ out of the server's link.
type Drafter struct {
	ctx  *llama.Context
	nVoc int     // tokens a draft may be (the smaller vocabulary)
	pMin float32 // stop a session's draft below this probability (--draft-p-min)
	nCtx int
	held map[int][]llama.Token // per target sequence: the tokens whose cells the draft context holds
	// copied: per sequence, the leading cells it shares with a pool's draft sequence
	// (seq_cp), so that cells are counted once while both hold them.
	copied map[int]copyOf
	log    *slog.Logger

	// heldCells, heldSeqs publish used() and len(held) to other goroutines (Held);
	// decoded counts the tokens the draft model decoded (tests).
	heldCells, heldSeqs, decoded atomic.Int64
}

// copyOf is a sequence's first n cells, shared with sequence from.
type copyOf struct{ from, n int }

// NewDrafter drafts for target with ctx, a context of draft (CheckDraftVocab passed),
// unified, with at least the target context's sequence ids.
func NewDrafter(target, draft *llama.Model, ctx *llama.Context, pMin float64, log *slog.Logger) *Drafter {
	if log == nil {
		log = slog.Default()
	}
	return &Drafter{ctx: ctx, nVoc: llama.VocabSize(target, draft), pMin: float32(pMin), nCtx: ctx.NCtx(),
		held: map[int][]llama.Token{}, copied: map[int]copyOf{}, log: log}
}

// Held is the number of draft-context cells held and the sequences holding them, as
// of the drafter's last call (safe from any goroutine: tests, diagnostics).
func (d *Drafter) Held() (cells, seqs int) {
	return int(d.heldCells.Load()), int(d.heldSeqs.Load())
}

// Decoded is the number of tokens the draft model has decoded (safe from any goroutine).
func (d *Drafter) Decoded() int64 { return d.decoded.Load() }

// publish makes what is held visible to Held.
func (d *Drafter) publish() {
	d.heldCells.Store(int64(d.used()))
	d.heldSeqs.Store(int64(len(d.held)))
}

// used is the cells held: every sequence's, less those it shares with a pool's draft
// sequence that still holds them.
func (d *Drafter) used() int {
	n := 0
	for seq, h := range d.held {
		n += len(h)
		if c, ok := d.copied[seq]; ok {
			n -= min(c.n, len(h), len(d.held[c.from]))
		}
	}
	return n
}

// drop frees everything held for seq; sequences that shared cells with it own them now.
func (d *Drafter) drop(seq int) {
	if _, ok := d.held[seq]; ok {
		d.ctx.SeqRm(seq, 0, -1)
		delete(d.held, seq)
	}
	delete(d.copied, seq)
	for s, c := range d.copied {
		if c.from == seq {
			delete(d.copied, s)
		}
	}
}

// cut keeps seq's first n held tokens.
func (d *Drafter) cut(seq, n int) {
	h := d.held[seq]
	if n >= len(h) {
		return
	}
	d.ctx.SeqRm(seq, n, -1)
	d.held[seq] = h[:n]
	if c, ok := d.copied[seq]; ok && c.n > n {
		d.copied[seq] = copyOf{c.from, n}
	}
	for s, c := range d.copied {
		if c.from == seq && c.n > n {
			d.copied[s] = copyOf{c.from, n} // past n the copies' cells are their own
		}
	}
}

// lcp is the length of the common prefix of a and b.
func lcp(a, b []llama.Token) int {
	p := 0
	for p < len(a) && p < len(b) && a[p] == b[p] {
		p++
	}
	return p
}

// draftJob is one want in flight.
type draftJob struct {
	w    engine.DraftWant
	out  []llama.Token
	idx  int  // batch index of the row to pick from after the current decode (-1: none)
	done bool // stopped drafting
	copy bool // takes its first w.Shared tokens from the pool's draft sequence
}

// Draft implements ModelDrafter. A decode failure drops the wanted
// sequences' draft state (the cache may hold part of a batch) and proposes nothing.
func (d *Drafter) Draft(wants []engine.DraftWant) []engine.DraftProposal {
	defer d.publish()
	wanted := map[int]bool{} // sessions drafting and the pools they copy from: not evicted
	pools := map[int][]llama.Token{}
	var jobs []*draftJob
	for _, w := range wants {
		n := len(w.Tokens)
		if n+w.K-1 > d.nCtx || wanted[w.Seq] || w.K < 1 {
			continue // longer than the draft context: no draft for it
		}
		wanted[w.Seq] = true
		j := &draftJob{w: w, idx: -1}
		// A session that lacks its pool's prefix copies it from the pool's draft
		// sequence (prefilled below if need be) rather than decoding it itself.
		if w.Shared > 0 && w.From != w.Seq && lcp(d.held[w.Seq], w.Tokens) < w.Shared {
			j.copy = true
			wanted[w.From] = true
			if len(w.Tokens[:w.Shared]) > len(pools[w.From]) {
				pools[w.From] = w.Tokens[:w.Shared]
			}
		}
		jobs = append(jobs, j)
	}
	if len(jobs) == 0 {
		return nil
	}
	// What each sequence keeps, and the cells the round needs beyond it.
	need := 0
	for from, toks := range pools {
		if p := lcp(d.held[from], toks); p < len(toks) {
			d.cut(from, p) // a pool's draft may hold more than these sessions borrow: kept
		}
		need += max(len(toks)-len(d.held[from]), 0)
	}
	for _, j := range jobs {
		n := len(j.w.Tokens)
		if j.copy {
			d.drop(j.w.Seq)
			need += n - j.w.Shared + j.w.K - 1
			continue
		}
		// The last token is decoded again when held: its row is the first pick.
		d.cut(j.w.Seq, min(lcp(d.held[j.w.Seq], j.w.Tokens), n-1))
		need += n - len(d.held[j.w.Seq]) + j.w.K - 1
	}
	if d.used()+need > d.nCtx {
		// Evict the sequences not used now, then drop wants until the rest fit.
		for seq := range d.held {
			if !wanted[seq] {
				d.drop(seq)
			}
		}
		for len(jobs) > 0 && d.used()+need > d.nCtx {
			j := jobs[len(jobs)-1]
			jobs = jobs[:len(jobs)-1]
			if j.copy {
				need -= len(j.w.Tokens) - j.w.Shared + j.w.K - 1
			} else {
				need -= len(j.w.Tokens) - len(d.held[j.w.Seq]) + j.w.K - 1
			}
			d.drop(j.w.Seq)
		}
	}
	fail := func(err error) []engine.DraftProposal {
		d.log.Warn("draft model decode failed: no drafts this step", "err", err)
		for _, j := range jobs {
			d.drop(j.w.Seq)
		}
		for from := range pools {
			d.drop(from)
		}
		return nil
	}
	// Prefill what each draft sequence misses, in batches of the context's size: the
	// pools' first, then the sessions' (after their copies of the pools' prefixes); the
	// row of a session's last token gives its first draft.
	nb := d.ctx.BatchCap()
	d.ctx.BatchClear()
	flush := func() error {
		if d.ctx.BatchLen() == 0 {
			return nil
		}
		d.decoded.Add(int64(d.ctx.BatchLen()))
		if err := d.ctx.Decode(); err != nil {
			return err
		}
		for _, j := range jobs {
			if j.idx >= 0 {
				d.pick(j)
			}
		}
		d.ctx.BatchClear()
		return nil
	}
	add := func(seq int, toks []llama.Token, j *draftJob) error {
		if len(d.held[seq]) >= len(toks) {
			return nil // a pool's draft holding these tokens already (sessions never do: cut to n-1)
		}
		for p := len(d.held[seq]); p < len(toks); p++ {
			if d.ctx.BatchLen() == nb {
				if err := flush(); err != nil {
					return err
				}
			}
			last := j != nil && p == len(toks)-1
			i, err := d.ctx.BatchAdd(toks[p], p, seq, last)
			if err != nil {
				return err
			}
			if last {
				j.idx = i
			}
		}
		d.held[seq] = append(d.held[seq], toks[len(d.held[seq]):]...)
		return nil
	}
	used := map[int]bool{}
	for _, j := range jobs {
		if from := j.w.From; j.copy && !used[from] {
			used[from] = true
			if err := add(from, pools[from], nil); err != nil {
				return fail(err)
			}
		}
	}
	if err := flush(); err != nil {
		return fail(err)
	}
	for _, j := range jobs {
		if j.copy {
			d.ctx.SeqCp(j.w.From, j.w.Seq, 0, j.w.Shared)
			d.held[j.w.Seq] = slices.Clone(j.w.Tokens[:j.w.Shared])
			d.copied[j.w.Seq] = copyOf{j.w.From, j.w.Shared}
		}
		if err := add(j.w.Seq, j.w.Tokens, j); err != nil {
			return fail(err)
		}
	}
	if err := flush(); err != nil {
		return fail(err)
	}
	// Draft: each step decodes every session's last draft token and picks the next.
	for {
		d.ctx.BatchClear()
		for _, j := range jobs {
			if j.done || len(j.out) == 0 || len(j.out) >= j.w.K {
				j.done = true
				continue
			}
			pos := len(j.w.Tokens) + len(j.out) - 1
			tok := j.out[len(j.out)-1]
			i, err := d.ctx.BatchAdd(tok, pos, j.w.Seq, true)
			if err != nil {
				return fail(err)
			}
			j.idx = i
			d.held[j.w.Seq] = append(d.held[j.w.Seq], tok)
		}
		if d.ctx.BatchLen() == 0 {
			break
		}
		if err := flush(); err != nil {
			return fail(err)
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

// pick takes j's greedy token from the row of the last decode, or stops j when the
// draft model is unsure (below --draft-p-min, as llama-server's draft-simple does).
func (d *Drafter) pick(j *draftJob) {
	tok, p, ok := d.ctx.Greedy(j.idx, d.nVoc)
	j.idx = -1
	if !ok || p < d.pMin {
		j.done = true
		return
	}
	j.out = append(j.out, tok)
	if len(j.out) >= j.w.K {
		j.done = true
	}
}

// DraftSeqRm implements ModelDrafter: the target emptied seq.
func (d *Drafter) DraftSeqRm(seq int) {
	d.drop(seq)
	d.publish()
}
