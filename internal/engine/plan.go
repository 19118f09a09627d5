package engine

import (
	"slices"
	"time"

	"github.com/polykv/polykv/internal/tps"
)

// Plan builds the next step, budget by budget: one decode token for every decoding
// task and the drafts speculation adds to it (planDecodes), then prompt chunks in
// admission order with what is left of the batch (planPrefills: chunked prefill), then,
// when nothing else runs, the sessions the throttle skipped (planSkipped). Restores and
// loads are planned where tasks are seated (admission); they count here as cells the
// step must not give away (stepBudget.pending).
func (s *Scheduler) Plan(now time.Time) Plan {
	s.draftsIn = false // the next plan has a draft round of its own
	s.now = now
	s.planAt = now
	s.advance()
	s.inflight = s.inflight[:0]
	// A restore or load planned in this step writes its cells before the batch runs,
	// though the cell tree counts them only once its answer comes: they count as
	// planned, here and in every freeCells below (else a decode token beside a restore
	// that filled the cache found "room" the restore had taken, and the batch failed).
	pending := s.tierPending() + s.loadPending()
	b := &stepBudget{budget: s.cfg.NBatch, pending: pending, free: s.kv.Room(pending)}
	// Sessions throttled toward their pool's floor skip this step (throttle.go).
	s.throttleSkips()
	s.planDecodes(b)
	s.planPrefills(b)
	for _, t := range s.running {
		t.spec.endStep() // the context moves on with this step
		t.skipNow = false
	}
	if len(b.batch) == 0 && len(s.skipped) > 0 {
		s.planSkipped(b)
	}
	p := Plan{Samplers: s.samplers, SeqOps: s.ops, Batch: b.batch}
	s.samplers, s.ops = nil, nil
	return p
}

// stepBudget is what the step being planned has used and has left.
type stepBudget struct {
	batch []BatchEntry
	// budget is the batch positions left (Config.NBatch in all).
	budget int
	// pending is the cells restores and loads planned and not yet answered will write;
	// free is the cells free beyond them and beyond what this step planned (planned).
	pending, free, planned int
	// decoders is the decoding tasks still to plan: each needs one position of the
	// budget and one cell, which drafts never take from them. spare is what drafts may
	// use: cells free beyond those promised to prompts being prefilled, so a draft
	// never makes a prefill chunk evict anything.
	decoders, spare int
	// specGain and specRows are the step's expected tokens and rows so far, for the
	// cost-aware draft limit: every decoder's token, and the drafts planned and
	// expected to land.
	specGain, specRows float64
}

// cells finds n free cells for t's prompt chunk, evicting (under t's grace rule) when
// the cells free now are fewer, and reports how many are free.
func (s *Scheduler) cells(b *stepBudget, n int, t *task) int {
	if b.free < n {
		b.free = s.freeCells(n, nil, b.pending+b.planned, t.grace)
	}
	return b.free
}

// noCell reports whether t's decode token finds no cell, evicting (under t's grace
// rule) when none is free.
func (s *Scheduler) noCell(b *stepBudget, t *task) bool {
	if b.free == 0 {
		b.free = s.freeCells(1, nil, b.pending+b.planned, t.grace)
	}
	return b.free == 0
}

// planDecodes plans one decode token for every decoding task not skipped this step,
// with its drafts (planDraft). A task that finds no cell at all stops cleanly
// (FinishLength) rather than shift the context.
func (s *Scheduler) planDecodes(b *stepBudget) {
	for _, t := range s.running {
		if t.status == statusDecoding && !t.skipNow {
			b.decoders++
		}
	}
	if s.cfg.Spec.On() {
		b.spare = b.free - s.reservedPrefill()
	}
	b.specGain, b.specRows = float64(b.decoders), float64(b.decoders)
	for _, t := range slices.Clone(s.running) {
		if t.status != statusDecoding || t.skipNow {
			continue
		}
		b.decoders--
		if s.noCell(b, t) {
			// Every cell is held by a running task or a pool: stop cleanly rather than shift.
			s.finish(t, FinishLength, true, nil)
			continue
		}
		pos := len(t.slot.tokens)
		b.batch = append(b.batch, BatchEntry{Token: t.next, Pos: pos, Seq: t.slot.seq, Sample: true, Task: t.id})
		f := inflight{t: t, n: 1, decode: true, sample: true}
		b.free--
		b.spare--
		b.planned++
		b.budget--
		if s.specOn(t) && t.spec.wait > 0 {
			t.spec.wait--
		} else if s.specOn(t) {
			s.planDraft(b, t, &f)
		}
		s.inflight = append(s.inflight, f)
	}
}

// planDraft plans t's drafts after its decode token (speculative decoding): they use
// what the other decoders leave of the budget and spare cells, which idle sequences'
// tails give up when there are too few (draftRoom).
func (s *Scheduler) planDraft(b *stepBudget, t *task, f *inflight) {
	k := min(s.specBudget(t), b.budget-b.decoders)
	probe := false
	if c := s.specCostCap(t, k, b.specGain, b.specRows); c > 0 {
		k = c
	} else if t.spec.idle >= specProbeEvery {
		k, probe = min(k, specProbeLen), true // a probe: does t copy again?
	} else {
		k = 0
	}
	t.spec.idle++
	d := s.specDraft(t, k, probe)
	if room := b.spare - b.decoders; len(d) > room {
		got := s.draftRoom(len(d) - room)
		b.free += got
		b.spare += got
		if n := b.spare - b.decoders; n < len(d) {
			d = d[:max(n, 0)]
			if len(d) < s.draftMin(t) {
				d = nil
			}
		}
	}
	if len(d) == 0 {
		return
	}
	t.spec.idle = 0
	b.specGain += t.spec.expected(len(d))
	b.specRows += float64(len(d))
	pos := len(t.slot.tokens)
	for i, tok := range d {
		b.batch = append(b.batch, BatchEntry{Token: tok, Pos: pos + 1 + i, Seq: t.slot.seq, Sample: true, Task: t.id, Draft: true})
	}
	f.drafts, f.n = d, 1+len(d)
	b.free -= len(d)
	b.spare -= len(d)
	b.planned += len(d)
	b.budget -= len(d)
}

// planPrefills plans prompt chunks of the prefilling tasks in admission order with
// what is left of the batch; the chunk that ends a request's prompt samples its first
// token.
func (s *Scheduler) planPrefills(b *stepBudget) {
	for _, t := range s.running {
		if b.budget == 0 {
			break
		}
		if t.status != statusPrefilling || !t.prefilling() {
			continue
		}
		have := len(t.slot.tokens)
		k := min(len(t.req.Prompt)-have, b.budget)
		k = min(k, s.cells(b, k, t))
		if k == 0 {
			break
		}
		last := have+k == len(t.req.Prompt)
		sample := last && t.kind == kindGenerate
		for j := range k {
			p := have + j
			b.batch = append(b.batch, BatchEntry{Token: t.req.Prompt[p], Pos: p, Seq: t.slot.seq, Sample: sample && j == k-1, Task: t.id})
		}
		s.inflight = append(s.inflight, inflight{t: t, n: k, sample: sample})
		b.budget -= k
		b.free -= k
		b.planned += k
	}
}

// planSkipped plans the tokens of the sessions the throttle skipped, when nothing else
// runs this step: the skips would gain nobody (and an empty batch would idle the loop).
func (s *Scheduler) planSkipped(b *stepBudget) {
	skipped := slices.Clone(s.skipped)
	s.unskip()
	for _, t := range skipped {
		if s.noCell(b, t) {
			s.finish(t, FinishLength, true, nil)
			continue
		}
		b.batch = append(b.batch, BatchEntry{Token: t.next, Pos: len(t.slot.tokens), Seq: t.slot.seq, Sample: true, Task: t.id})
		s.inflight = append(s.inflight, inflight{t: t, n: 1, decode: true, sample: true})
		b.free--
		b.planned++
	}
}

// measureStep feeds the aggregate decode and prompt rates with one step's tokens.
// After an idle gap the averages restart, so idle time is not read as slowness.
func (s *Scheduler) measureStep(in []inflight, now time.Time) {
	gen, prompt := 0, 0
	for _, f := range in {
		switch {
		case f.decode:
			gen += 1 + f.accepted // accepted drafts are tokens generated in this step
		case f.t.kind == kindGenerate && f.sample:
			gen++ // the first token, sampled from the prompt's last position
			prompt += f.n
		default:
			prompt += f.n
		}
	}
	for _, e := range []struct {
		ewma *tps.EWMA
		n    int
	}{{&s.agg, gen}, {&s.aggPrompt, prompt}} {
		if e.n == 0 {
			continue
		}
		if now.Sub(e.ewma.Last()) > s.cfg.TPSTau {
			*e.ewma = tps.NewEWMA(s.cfg.TPSTau)
			e.ewma.Start(s.planAt)
		}
		e.ewma.Observe(e.n, now)
	}
}
