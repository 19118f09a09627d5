package runner

import (
	"log/slog"
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
// task) is removed, and what is missing is decoded in chunks. Cells held for a
// sequence the target empties are freed at once (DraftSeqRm); those of sessions not
// drafting now are evicted when the draft context runs out of room.
//
// Why not llama.cpp's common/speculative (draft-simple): its per-sequence state is fed
// by mirroring the target's llama_batch (common_speculative_process) and its prompt
// (begin); PolyKV's sessions get much of their context from a pool or the prefix cache
// by seq_cp, never in a batch, and the scheduler, not the drafter, decides how many
// tokens each session may draft (the cost-aware limit). Syncing by token prefix needs
// neither, and keeps common/ out of the server's link.
//
// The draft pool's prefix is not shared between sessions in the draft context (no
// seq_cp): each session's draft sequence prefills its whole context once.
type Drafter struct {
	ctx   *llama.Context
	nVoc  int     // tokens a draft may be (the smaller vocabulary)
	pMin  float32 // stop a session's draft below this probability (--draft-p-min)
	nCtx  int
	held  map[int][]llama.Token // per target sequence: the tokens whose cells the draft context holds
	cells int                   // cells held in all
	log   *slog.Logger

	// heldCells, heldSeqs publish cells and len(held) to other goroutines (Held).
	heldCells, heldSeqs atomic.Int64
}

// NewDrafter drafts for target with ctx, a context of draft (CheckDraftVocab passed),
// unified, with at least the target context's sequence ids.
func NewDrafter(target, draft *llama.Model, ctx *llama.Context, pMin float64, log *slog.Logger) *Drafter {
	if log == nil {
		log = slog.Default()
	}
	return &Drafter{ctx: ctx, nVoc: llama.VocabSize(target, draft), pMin: float32(pMin), nCtx: ctx.NCtx(),
		held: map[int][]llama.Token{}, log: log}
}

// Held is the number of draft-context cells held and the sequences holding them, as
// of the drafter's last call (safe from any goroutine: tests, diagnostics).
func (d *Drafter) Held() (cells, seqs int) {
	return int(d.heldCells.Load()), int(d.heldSeqs.Load())
}

// publish makes what is held visible to Held.
func (d *Drafter) publish() {
	d.heldCells.Store(int64(d.cells))
	d.heldSeqs.Store(int64(len(d.held)))
}

// drop frees everything held for seq.
func (d *Drafter) drop(seq int) {
	if h, ok := d.held[seq]; ok {
		d.ctx.SeqRm(seq, 0, -1)
		d.cells -= len(h)
		delete(d.held, seq)
	}
}

// cut keeps seq's first n held tokens.
func (d *Drafter) cut(seq, n int) {
	h := d.held[seq]
	if n >= len(h) {
		return
	}
	d.ctx.SeqRm(seq, n, -1)
	d.cells -= len(h) - n
	d.held[seq] = h[:n]
}

// draftJob is one want in flight.
type draftJob struct {
	w    engine.DraftWant
	out  []llama.Token
	idx  int  // batch index of the row to pick from after the current decode (-1: none)
	done bool // stopped drafting
}

// Draft implements engine.DraftBackend's drafting. A decode failure drops the wanted
// sequences' draft state (the cache may hold part of a batch) and proposes nothing.
func (d *Drafter) Draft(wants []engine.DraftWant) []engine.DraftProposal {
	defer d.publish()
	wanted := map[int]bool{}
	var jobs []*draftJob
	need := 0
	for _, w := range wants {
		n := len(w.Tokens)
		if n+w.K-1 > d.nCtx || wanted[w.Seq] || w.K < 1 {
			continue // longer than the draft context: no draft for it
		}
		wanted[w.Seq] = true
		h := d.held[w.Seq]
		p := 0
		for p < len(h) && p < n && h[p] == w.Tokens[p] {
			p++
		}
		// The last token is decoded again when held: its row is the first pick.
		d.cut(w.Seq, min(p, n-1))
		need += n - len(d.held[w.Seq]) + w.K - 1
		jobs = append(jobs, &draftJob{w: w, idx: -1})
	}
	if len(jobs) == 0 {
		return nil
	}
	if d.cells+need > d.nCtx {
		// Evict the sessions not drafting now, then drop wants until the rest fit.
		for seq := range d.held {
			if !wanted[seq] {
				d.drop(seq)
			}
		}
		for len(jobs) > 0 && d.cells+need > d.nCtx {
			j := jobs[len(jobs)-1]
			jobs = jobs[:len(jobs)-1]
			need -= len(j.w.Tokens) - len(d.held[j.w.Seq]) + j.w.K - 1
			d.drop(j.w.Seq)
		}
	}
	fail := func(err error) []engine.DraftProposal {
		d.log.Warn("draft model decode failed: no drafts this step", "err", err)
		for _, j := range jobs {
			d.drop(j.w.Seq)
		}
		return nil
	}
	// Prefill what each draft sequence misses, in batches of the context's size; the
	// row of a session's last token gives its first draft.
	nb := d.ctx.BatchCap()
	d.ctx.BatchClear()
	flush := func() error {
		if d.ctx.BatchLen() == 0 {
			return nil
		}
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
	for _, j := range jobs {
		seq, toks := j.w.Seq, j.w.Tokens
		for p := len(d.held[seq]); p < len(toks); p++ {
			if d.ctx.BatchLen() == nb {
				if err := flush(); err != nil {
					return fail(err)
				}
			}
			last := p == len(toks)-1
			i, err := d.ctx.BatchAdd(toks[p], p, seq, last)
			if err != nil {
				return fail(err)
			}
			if last {
				j.idx = i
			}
		}
		d.held[seq] = append(d.held[seq], toks[len(d.held[seq]):]...)
	}
	d.recount()
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
			d.cells++
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

// recount sets cells from what is held (after a round of appends).
func (d *Drafter) recount() {
	d.cells = 0
	for _, h := range d.held {
		d.cells += len(h)
	}
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

// DraftSeqRm implements engine.DraftBackend: the target emptied seq.
func (d *Drafter) DraftSeqRm(seq int) {
	d.drop(seq)
	d.publish()
}
