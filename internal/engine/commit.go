package engine

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/polykv/polykv/internal/pool"
)

// Commit applies the result of decoding the last planned batch.
func (s *Scheduler) Commit(sampled []Sampled, err error, now time.Time) {
	s.now = now
	in := s.inflight
	s.inflight = nil
	if len(in) > 0 {
		s.progressAt = now // the step computed something: the queue's deadlines restart
	}
	if err != nil {
		s.snapDue = true
		s.skipped = s.skipped[:0]
		for _, f := range in {
			if f.t.slot == nil {
				continue
			}
			// The cells this batch may have written are not trusted: drop them.
			s.kv.Free(f.t.slot.seq, len(f.t.slot.tokens))
			s.finish(f.t, FinishError, false, fmt.Errorf("%w: %v", ErrDecode, err))
		}
		return
	}
	si := 0
	for i, f := range in {
		if f.decode && len(f.drafts) > 0 && si < len(sampled) {
			in[i].accepted = specAccepted(f.drafts, sampled[si:min(si+1+len(f.drafts), len(sampled))])
		}
		if f.sample {
			si += 1 + len(f.drafts)
		}
	}
	s.measureStep(in, now)
	s.throttleCommit(in, now)
	si = 0
	for _, f := range in {
		t := f.t
		if f.decode {
			if si+f.n > len(sampled) {
				s.kv.Free(t.slot.seq, len(t.slot.tokens))
				s.finish(t, FinishError, false, fmt.Errorf("%w: backend returned %d samples for a batch that asked for more", ErrDecode, len(sampled)))
				continue
			}
			s.commitDecode(f, sampled[si:si+f.n], now)
			si += f.n
			continue
		} else {
			have := len(t.slot.tokens)
			s.kv.Allocate(t.slot.seq, t.req.Prompt[have:have+f.n])
			t.slot.tokens = append(t.slot.tokens, t.req.Prompt[have:have+f.n]...)
			if t.kind == kindMaterialize {
				if !t.prefilling() {
					s.poolMaterialized(t)
				}
				continue
			}
		}
		if f.sample {
			if si >= len(sampled) {
				s.finish(t, FinishError, false, fmt.Errorf("%w: backend returned %d samples for a batch that asked for more", ErrDecode, len(sampled)))
				continue
			}
			s.onToken(t, sampled[si])
			si++
		}
	}
}

// commitDecode applies one decode token and its drafts (speculative decoding): the
// decoded token joins the sequence, then each sample in turn is a generated token, and
// while the task goes on and the sample confirms the next draft, that draft (already
// in the cache) joins the sequence too. The cells of drafts past the first mismatch, or
// past where the task ended, are removed with the next step's operations; the cell tree
// never held them.
func (s *Scheduler) commitDecode(f inflight, smp []Sampled, now time.Time) {
	t, sl := f.t, f.t.slot
	seq, pos := sl.seq, len(sl.tokens)
	s.kv.Allocate(seq, []Token{t.next})
	sl.tokens = append(sl.tokens, t.next)
	k := len(f.drafts)
	a := specAccepted(f.drafts, smp)
	if k > 0 {
		t.spec.drafted += k
		t.spec.accepted += a
		s.specAdapt(t, k, a)
		s.obs = append(s.obs, Observation{Kind: ObsDraft, Pool: t.poolID(), Drafted: k, Accepted: a})
	}
	// The step made a+1 tokens (the EWMA takes them in one observation: it folds
	// observations at one instant), and they share its time for inter-token latency.
	t.ewma.Observe(a+1, now)
	t.shadow.Observe(a+1, now.Add(s.throttleLead[t.poolID()]))
	d := now.Sub(t.lastTok) / time.Duration(a+1)
	t.lastTok = now
	kept := pos + 1
	for i := 0; i <= a; i++ {
		s.obs = append(s.obs, Observation{Kind: ObsTokenLatency, D: d})
		s.onToken(t, smp[i])
		if t.status == statusDone || i == a {
			break // ended (its sequence may be gone), or the step's last token
		}
		// smp[i] == f.drafts[i]: that draft's cell at pos+1+i is now the sequence's.
		s.kv.Allocate(seq, f.drafts[i:i+1])
		sl.tokens = append(sl.tokens, f.drafts[i])
		kept++
	}
	if kept < pos+1+k && len(sl.tokens) == kept {
		// Not the cell tree's: only the backend's cache holds these.
		s.kv.Discard(seq, kept)
	}
}

func (s *Scheduler) onToken(t *task, smp Sampled) {
	if t.firstTok.IsZero() {
		t.firstTok, t.lastTok = s.now, s.now
		t.ewma.Start(s.now)
		t.shadow.Start(s.now.Add(s.throttleLead[t.poolID()]))
		s.obs = append(s.obs, Observation{Kind: ObsTTFT, Pool: t.poolID(), D: s.now.Sub(t.submitted)})
	}
	if s.vocab.IsEOG(smp.Token) && !t.req.IgnoreEOS {
		s.finish(t, FinishStop, false, nil)
		return
	}
	t.generated++
	text, stopWord := t.text.push(s.vocab.Piece(smp.Token))
	ev := Event{Task: t.id, Text: text, Pool: t.poolID()}
	if t.req.Logprobs {
		ev.Tokens = []TokenLogprob{{Token: smp.Token, Logprob: smp.Logprob, Top: smp.Top}}
	}
	if text != "" || ev.Tokens != nil {
		s.events = append(s.events, ev)
	}
	switch {
	case stopWord != "":
		t.stopWord = stopWord
		s.finish(t, FinishStop, false, nil)
	case t.req.MaxTokens > 0 && t.generated >= t.req.MaxTokens:
		s.finish(t, FinishLength, false, nil)
	case len(t.slot.tokens) >= s.cfg.NCtx:
		// The next token would sit at position n_ctx: stop, never shift the context.
		s.finish(t, FinishLength, true, nil)
	default:
		t.next = smp.Token
		s.setStatus(t, statusDecoding)
	}
}

// finish ends a running task and releases its sequence: a session keeps its KV for the
// next turn (unless its pool was released), an anonymous task's cells are freed at once.
func (s *Scheduler) finish(t *task, reason string, truncated bool, err error) {
	sl := t.slot
	if t.kind == kindMaterialize {
		s.removeRunning(t)
		s.events = append(s.events, Event{Task: t.id, Done: true, Finish: reason, Err: err, Pool: t.pool.ID})
		s.abandonPool(t.pool, t.restore, cmp.Or(err, ErrCancelled))
		return
	}
	stats := Stats{PromptN: len(t.req.Prompt) - t.cacheN - t.restoredN, CacheN: t.cacheN, RestoredN: t.restoredN, PredictedN: t.generated, Seq: sl.seq,
		DraftN: t.spec.drafted, DraftAccepted: t.spec.accepted, DraftFiltered: t.spec.filtered, ThrottledSteps: t.throttled}
	if sl.base != nil {
		stats.Pool = sl.base.ID
		stats.Shared = sl.shared
	}
	if !t.pacedAt.IsZero() {
		stats.Paced = t.admitted.Sub(t.pacedAt)
	}
	if !t.firstTok.IsZero() {
		stats.PromptTime = t.firstTok.Sub(t.admitted)
		stats.PredictTime = s.now.Sub(t.firstTok)
	} else {
		stats.PromptTime = s.now.Sub(t.admitted)
	}
	if t.status == statusLoading {
		// Its load is planned or being read: whatever it writes beyond what the cell
		// tree counts goes with the next step's operations (as a rejected draft's cells).
		t.loadSegs = nil
		s.kv.Discard(sl.seq, len(sl.tokens))
	}
	stats.TPS = t.ewma.Rate()
	stats.Ctx = s.sessionContext(sl)
	s.events = append(s.events, Event{Task: t.id, Text: t.text.flush(), Done: true, Finish: reason, StopWord: t.stopWord, Truncated: truncated, Err: err, Stats: stats, Pool: stats.Pool})
	s.samplers = append(s.samplers, SamplerOp{Task: t.id, Free: true})
	s.obs = append(s.obs, Observation{Kind: ObsQuery, Pool: stats.Pool, PromptTokens: len(t.req.Prompt), CachedTokens: t.cacheN})
	s.turnEnded(t, sl)
	s.writeThrough(t, sl)
	s.removeRunning(t)
	s.progressAt = s.now
	switch {
	case sl.base != nil && sl.base.State == pool.Released:
		s.evictSlot(sl)
	case sl.session == "" && s.cfg.PrefixCache:
		// Kept as cache: its cells stay until they or its sequence are needed. It no
		// longer counts as a session of its pool (the pool's cells it shares stay
		// shared by membership, whoever goes first).
		s.detach(sl)
	case sl.session == "":
		s.evictSlot(sl)
	}
}

func (s *Scheduler) removeRunning(t *task) {
	sl := t.slot
	sl.task = nil
	sl.lastUsed = s.now
	t.slot = nil
	s.running = slices.DeleteFunc(s.running, func(r *task) bool { return r == t })
	s.dropTask(t)
	// A task ended by Plan may still be listed for this step's batch: drop it.
	s.inflight = slices.DeleteFunc(s.inflight, func(f inflight) bool { return f.t == t })
}
