package runner

import (
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/kvcache"
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
// The draft context's cells are owned by a kvcache.Manager of their own, as the
// target's are by the engine's: its cell tree mirrors which draft sequence holds which
// cells (a pool's prefix shared by seq_cp counted once), its Recorder executes each
// seq_rm and seq_cp it plans on the draft context at once (the runner is the I/O side),
// and its Victims are the draft sequences not drafting now.
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
	// kv owns the draft context's cells: per target sequence the tokens its draft
	// sequence holds, and the cells it shares with a pool's draft sequence (seq_cp).
	kv *kvcache.Manager
	// busy, during a Draft: the sequences drafting and the pools they copy from, which
	// eviction does not take.
	busy kvcache.SeqSet
	log  *slog.Logger

	// heldCells, heldSeqs publish the cells and sequences held to other goroutines
	// (Held); decoded counts the tokens the draft model decoded (tests).
	heldCells, heldSeqs, decoded atomic.Int64
}

// NewDrafter drafts for target with ctx, a context of draft (CheckDraftVocab passed),
// unified, with at least the target context's sequence ids.
func NewDrafter(target, draft *llama.Model, ctx *llama.Context, pMin float64, log *slog.Logger) *Drafter {
	if log == nil {
		log = slog.Default()
	}
	d := &Drafter{ctx: ctx, nVoc: llama.VocabSize(target, draft), pMin: float32(pMin), nCtx: ctx.NCtx(), log: log}
	d.kv = d.newKV(draftOps{ctx})
	return d
}

// newKV is a Manager of the draft context's cells that plans into plan.
func (d *Drafter) newKV(plan kvcache.Recorder) *kvcache.Manager {
	// No draft sequence is a pool to the Manager (FirstPool past every id): pools'
	// draft sequences are ordinary sequences here, which eviction takes whole.
	return kvcache.New(kvcache.Config{NCtx: d.nCtx, FirstPool: kvcache.MaxSeqs, Plan: plan, Holders: d.holders})
}

// draftOps is the draft Manager's Recorder: it executes each operation on the draft
// context as it is planned.
type draftOps struct{ ctx *llama.Context }

func (o draftOps) SeqRm(seq, p0 int)      { o.ctx.SeqRm(seq, p0, -1) }
func (o draftOps) SeqCp(src, dst, p1 int) { o.ctx.SeqCp(src, dst, 0, p1) }

// draftSeq is a draft sequence holding cells, as the Manager's eviction sees it: busy
// while it drafts (or is a pool that a drafting session copies from); evicted whole.
type draftSeq struct {
	seq  int
	busy bool
}

func (s draftSeq) Seq() int          { return s.seq }
func (draftSeq) LastUsed() time.Time { return time.Time{} }
func (draftSeq) Kind() kvcache.Kind  { return kvcache.Session }
func (s draftSeq) Busy() bool        { return s.busy }
func (draftSeq) Pinned() bool        { return false }
func (draftSeq) Pageable() bool      { return false }
func (draftSeq) UserPinned() bool    { return false }
func (draftSeq) AwaitsUse() bool     { return false }
func (draftSeq) UseQueued() bool     { return false }

var _ kvcache.Holder = draftSeq{}

// holders lists the draft sequences holding cells (Config.Holders), by id.
func (d *Drafter) holders() []kvcache.Holder {
	var out []kvcache.Holder
	for seq := range kvcache.MaxSeqs {
		if d.held(seq) > 0 {
			out = append(out, draftSeq{seq, d.busy.Has(seq)})
		}
	}
	return out
}

// held is how many cells seq holds (its positions [0, held)).
func (d *Drafter) held(seq int) int { return d.kv.Cells().Len(seq) }

// lcp is the length of the common prefix of what seq holds and toks.
func (d *Drafter) lcp(seq int, toks []llama.Token) int {
	return lcp(d.kv.Cells().Tokens(seq), toks)
}

// Held is the number of draft-context cells held and the sequences holding them, as
// of the drafter's last call (safe from any goroutine: tests, diagnostics).
func (d *Drafter) Held() (cells, seqs int) {
	return int(d.heldCells.Load()), int(d.heldSeqs.Load())
}

// Decoded is the number of tokens the draft model has decoded (safe from any goroutine).
func (d *Drafter) Decoded() int64 { return d.decoded.Load() }

// publish makes what is held visible to Held: the cells in use (shared ones once).
func (d *Drafter) publish() {
	d.heldCells.Store(int64(d.kv.Used()))
	d.heldSeqs.Store(int64(len(d.holders())))
}

// drop frees everything held for seq; sequences that shared cells with it keep them.
func (d *Drafter) drop(seq int) {
	if d.held(seq) > 0 {
		d.kv.Free(seq, 0)
	}
}

// discard drops seq after a failed decode, whose batch the cache may hold part of,
// the cell tree none: seq_rm(seq, 0, -1) even when it holds nothing.
func (d *Drafter) discard(seq int) {
	if d.held(seq) > 0 {
		d.kv.Free(seq, 0)
	} else {
		d.kv.Discard(seq, 0)
	}
}

// cut keeps seq's first n held tokens.
func (d *Drafter) cut(seq, n int) {
	if n < d.held(seq) {
		d.kv.Free(seq, n)
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
	d.busy = kvcache.SeqSet{} // sessions drafting and the pools they copy from: not evicted
	pools := map[int][]llama.Token{}
	var jobs []*draftJob
	for _, w := range wants {
		n := len(w.Tokens)
		if n+w.K-1 > d.nCtx || d.busy.Has(w.Seq) || w.K < 1 {
			continue // longer than the draft context: no draft for it
		}
		d.busy.Add(w.Seq)
		j := &draftJob{w: w, idx: -1}
		// A session that lacks its pool's prefix copies it from the pool's draft
		// sequence (prefilled below if need be) rather than decoding it itself.
		if w.Shared > 0 && w.From != w.Seq && d.lcp(w.Seq, w.Tokens) < w.Shared {
			j.copy = true
			d.busy.Add(w.From)
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
		if p := d.lcp(from, toks); p < len(toks) {
			d.cut(from, p) // a pool's draft may hold more than these sessions borrow: kept
		}
		need += max(len(toks)-d.held(from), 0)
	}
	for _, j := range jobs {
		n := len(j.w.Tokens)
		if j.copy {
			d.drop(j.w.Seq)
			need += n - j.w.Shared + j.w.K - 1
			continue
		}
		// The last token is decoded again when held: its row is the first pick.
		d.cut(j.w.Seq, min(d.lcp(j.w.Seq, j.w.Tokens), n-1))
		need += n - d.held(j.w.Seq) + j.w.K - 1
	}
	if d.kv.Room(need) < 0 {
		// Evict the sequences not used now (the Manager's victims), then drop wants
		// until the rest fit.
		for _, h := range d.kv.Victims(time.Time{}, -1) {
			d.drop(h.Seq())
		}
		for len(jobs) > 0 && d.kv.Room(need) < 0 {
			j := jobs[len(jobs)-1]
			jobs = jobs[:len(jobs)-1]
			if j.copy {
				need -= len(j.w.Tokens) - j.w.Shared + j.w.K - 1
			} else {
				need -= len(j.w.Tokens) - d.held(j.w.Seq) + j.w.K - 1
			}
			d.drop(j.w.Seq)
		}
	}
	fail := func(err error) []engine.DraftProposal {
		d.log.Warn("draft model decode failed: no drafts this step", "err", err)
		for _, j := range jobs {
			d.discard(j.w.Seq)
		}
		for from := range pools {
			d.discard(from)
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
		have := d.held(seq)
		if have >= len(toks) {
			return nil // a pool's draft holding these tokens already (sessions never do: cut to n-1)
		}
		for p := have; p < len(toks); p++ {
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
		d.kv.Allocate(seq, toks[have:])
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
			d.kv.Share(j.w.From, j.w.Seq, j.w.Shared)
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
			d.kv.Allocate(j.w.Seq, []llama.Token{tok})
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
