package engine

import (
	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
)

// pickSlot chooses the sequence for t without side effects: its session's own; for an
// implicit request (prefixCached), an idle cached anonymous sequence holding the
// longest prefix of its prompt (taken over); else an empty one, else the least
// recently used idle one (evictsBefore).
func (s *Scheduler) pickSlot(t *task) *slot {
	if t.kind == kindMaterialize {
		return s.poolSeqs[t.pool.ID]
	}
	if t.req.SessionID != "" {
		if sl, ok := s.bySession[t.req.SessionID]; ok {
			if sl.task != nil {
				return nil
			}
			return sl
		}
	}
	t.donorP, t.donorSeq = 0, -1
	if s.prefixCached(t) {
		t.donorP, t.donorSeq = s.donor(t.req.Prompt)
		if d := s.cachedSlot(t.donorSeq); d != nil {
			return d
		}
	}
	var lru *slot
	for _, sl := range s.slots {
		if sl.task != nil {
			continue
		}
		if sl.session == "" && len(sl.tokens) == 0 {
			return sl
		}
		if lru == nil || s.evictsBefore(sl, lru) {
			lru = sl
		}
	}
	return lru
}

// evictsBefore orders idle sequences for reuse under sequence-id pressure: those
// holding nothing (a session whose KV was flushed) first, then the order eviction under
// cell pressure follows (victims: the one expected to be needed last first, cached
// anonymous sequences and idle sessions alike; then the least recently used, the
// anonymous one first only when both were last used at the same instant).
func (s *Scheduler) evictsBefore(a, b *slot) bool {
	if ea, eb := len(a.tokens) == 0, len(b.tokens) == 0; ea != eb {
		return ea
	}
	if c := s.nextUse(victim{sl: b}).Compare(s.nextUse(victim{sl: a})); c != 0 {
		return c < 0
	}
	if c := a.lastUsed.Compare(b.lastUsed); c != 0 {
		return c < 0
	}
	return a.session == "" && b.session != ""
}

// cachedSlot returns seq's slot when it is a finished anonymous sequence kept as cache.
func (s *Scheduler) cachedSlot(seq int) *slot {
	if seq < 0 || seq >= len(s.slots) {
		return nil
	}
	if sl := s.slots[seq]; sl.task == nil && sl.session == "" && len(sl.tokens) > 0 {
		return sl
	}
	return nil
}

// prefixCached reports whether t starts from whatever resident sequence holds the
// longest prefix of its prompt (issue 12): a request without a pool whose session, if
// it names one, holds no sequence (a known session continues on its own).
func (s *Scheduler) prefixCached(t *task) bool {
	if !s.cfg.PrefixCache || t.kind != kindGenerate || t.pool != nil || t.req.NoPrefixCache {
		return false
	}
	if t.req.SessionID != "" {
		if _, ok := s.bySession[t.req.SessionID]; ok {
			return false
		}
	}
	return true
}

// donor finds the longest prefix of prompt that some sequence holds (sessions, cached
// anonymous sequences, running tasks' committed cells, pools), leaving the last prompt
// token to prefill so there are logits to sample from: its length and a sequence to
// copy it from, an idle cached one when there is one (it can be taken over), else the
// lowest id. (0, -1) when nothing matches.
func (s *Scheduler) donor(prompt []Token) (int, int) {
	P, n := s.kv.Longest(prompt, len(prompt)-1)
	if P == 0 {
		return 0, -1
	}
	best := -1
	n.Holders().Each(func(q int) bool {
		if s.cachedSlot(q) != nil {
			best = q
			return false
		}
		if best < 0 {
			best = q
		}
		return true
	})
	return P, best
}

// poolDonor is where a pool's materialization starts: the same lookup an anonymous
// request makes (issue 12: one mechanism), the longest prefix of the pool's tokens that
// some resident sequence holds, and a holder to seq_cp it from. A root searches the
// whole tree; a child searches below its parent's node at D (the sequences that share
// the parent's cells [0, D): the parent itself, its other children, sessions and cached
// sequences that borrowed from it), so it always shares at least the parent's [0, D),
// as its branch contract says, and copies whatever of its own part is already cached.
// The whole prefix may match (no logits are needed): the pool is then resident without
// a prefill. With the prefix cache off a root starts empty and a child from its
// parent's [0, D) only. The parent must be resident. (0, -1) when nothing matches.
func (s *Scheduler) poolDonor(p *pool.Pool) (int, int) {
	par := p.Parent
	if par != nil && p.D == 0 {
		par = nil // it inherits nothing: a root in all but name
	}
	if !s.cfg.PrefixCache {
		if par != nil && s.cfg.Recurrent {
			// The boundary ancestor's sequence holds the state at D (createPool checked
			// that one ends exactly there); without it, prefill from the start.
			if b := boundary(par, p.D); b != nil && b.L() == p.D && b.State == pool.Resident {
				return p.D, b.Seq
			}
			return 0, -1
		}
		if par != nil {
			return p.D, par.Seq
		}
		return 0, -1
	}
	var P int
	var n *kvcache.Node
	if par != nil {
		P, n = s.kv.LongestFrom(par.Seq, p.D, p.Tokens, p.L())
	} else {
		P, n = s.kv.Longest(p.Tokens, p.L())
	}
	if P == 0 {
		return 0, -1
	}
	donor := -1
	n.Holders().Each(func(q int) bool {
		donor = q
		return false
	})
	if par != nil && n.Holders().Has(par.Seq) {
		donor = par.Seq // the parent when it holds all of it: the plainest seq_cp
	}
	return P, donor
}

// awaitsDonor reports whether t should stay queued because a task still prefilling
// will soon hold a longer prefix of t's prompt than anything resident now (fan-out:
// many requests with one long system prompt arrive together). Only committed cells can
// be copied, so t waits until that task's prefill covers the common part.
func (s *Scheduler) awaitsDonor(t *task) bool {
	limit := len(t.req.Prompt) - 1
	have, _ := s.kv.Longest(t.req.Prompt, limit)
	for _, r := range s.running {
		if r.prefilling() && min(commonPrefix(r.req.Prompt, t.req.Prompt), limit) > have {
			return true
		}
	}
	return false
}

// placement is how a task will sit on its sequence: keep [0, keep) of what the
// sequence holds, or reset it and borrow [0, attachP) from a pool, or reset it and
// share [0, cpP) of sequence cpFrom's cells (implicit prefix sharing).
type placement struct {
	keep    int
	attachP int // > 0: reset the sequence and seq_cp [0, attachP) from the pool
	// attachTo is the pool the sequence joins: the request's, or on a recurrent model the
	// one its session borrowed from before; attachFrom the pool whose sequence the attach
	// copies: attachTo, or on a recurrent model the ancestor whose boundary is attachP.
	attachTo, attachFrom *pool.Pool
	cpFrom               int
	cpP                  int  // > 0: reset the sequence and seq_cp [0, cpP) from cpFrom
	reused               bool // keep or cpP came from the prefix cache (counted as hits)
}

func (s *Scheduler) place(t *task, sl *slot) placement {
	if t.kind == kindMaterialize {
		return placement{}
	}
	prompt := t.req.Prompt
	if s.prefixCached(t) && t.donorSeq >= 0 {
		if sl.seq == t.donorSeq {
			return placement{keep: t.donorP, reused: true}
		}
		return placement{cpFrom: t.donorSeq, cpP: t.donorP, reused: true}
	}
	own := sl.session != "" && sl.session == t.req.SessionID
	k := 0
	if own {
		k = min(commonPrefix(sl.tokens, prompt), len(prompt)-1) // the last prompt token must be decoded for logits
	}
	p := t.pool
	if own && s.cfg.Recurrent && k < len(sl.tokens) {
		k = 0 // its recurrent state is past k: it cannot be cut back (Config.Recurrent)
		if p == nil && sl.base != nil && sl.base.State == pool.Resident {
			p = sl.base // but the pool it borrowed from still holds a state to start over from
		}
	}
	if p != nil {
		P := attachLen(p, t.req)
		src := p
		if s.cfg.Recurrent {
			// Only a pool's own sequence holds recurrent state, at its full length.
			if src = boundary(p, P); src != nil && src.State == pool.Resident {
				P = src.L()
			} else {
				P = 0
			}
		}
		// Continuation on the same pool reuses the session's own cells first.
		if !(own && sl.base == p && k >= P) && P > 0 {
			return placement{attachP: P, attachTo: p, attachFrom: src}
		}
	}
	if !own {
		return placement{}
	}
	return placement{keep: k}
}

func commonPrefix(a, b []Token) int { return pool.CommonPrefix(a, b) }

// attachLen is how much of pool p a request can borrow: the prefix its prompt shares
// with p (capped by shared_prefix_n_tokens), less the last prompt token, which must be
// decoded for its logits.
func attachLen(p *pool.Pool, req Request) int {
	P := min(commonPrefix(p.Tokens, req.Prompt), len(req.Prompt)-1)
	if req.SharedPrefixN != nil {
		P = min(P, *req.SharedPrefixN)
	}
	return P
}
