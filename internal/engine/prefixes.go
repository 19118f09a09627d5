package engine

import "github.com/polykv/polykv/internal/pool"

// PrefixObserver is told when a pool's prefix enters or leaves the KV cache, so that
// a router outside the process can learn which replica holds which prefix (KV events
// for llm-d's precise-prefix scorer). The scheduler records the changes as
// Observations (ObsPrefixStored, ObsPrefixRemoved); the engine hands them, after the
// step, to its Observer when that also implements PrefixObserver. It is called on the
// engine goroutine and must not block: an implementation queues the change and does
// its I/O elsewhere.
type PrefixObserver interface {
	PrefixStored(c PrefixChange)
	PrefixRemoved(c PrefixChange)
}

// PrefixChange is one pool's prefix becoming resident or being dropped. Tokens and Hash
// are the pool's own immutable slices (never written after the pool is created); the
// observer may keep them but must not modify them.
type PrefixChange struct {
	Pool int
	// D is the branch position: [0, D) lives in the parent's cells and was announced
	// when the parent became resident; the pool's own cells are [D, len(Tokens)).
	D      int
	Tokens []Token
	// Hash[i] fingerprints Tokens[0..i] (pool.RollingHash): a content address of every
	// prefix, the same on every replica for the same tokens.
	Hash []uint64
}

func prefixChange(p *pool.Pool) PrefixChange {
	return PrefixChange{Pool: p.ID, D: p.D, Tokens: p.Tokens, Hash: p.Hash}
}

// prefixStored records a pool that has just become resident.
func (s *Scheduler) prefixStored(p *pool.Pool) {
	s.obs = append(s.obs, Observation{Kind: ObsPrefixStored, Pool: p.ID, Prefix: prefixChange(p)})
	s.kv.cells.touch(p.Seq, 0) // with the prefix cache off, its cells become reportable
}

// prefixAnnounced reports a pool whose prefix was reported stored and not yet removed:
// fully materialized and not released (a half-built one that is abandoned never was).
func prefixAnnounced(p *pool.Pool) bool {
	return p.State == pool.Resident && p.L() > 0 && p.Filled() == p.L()
}

// prefixRemoved records a pool that no new request can reuse: released (its cells
// stay until the sessions on it end and the grace time passes, but nothing new may
// attach, so a router must stop sending its prefix here) or evicted. Callers check
// prefixAnnounced before the transition.
func (s *Scheduler) prefixRemoved(p *pool.Pool) {
	s.obs = append(s.obs, Observation{Kind: ObsPrefixRemoved, Pool: p.ID, Prefix: prefixChange(p)})
	s.kv.cells.touch(p.Seq, 0)
}

// PoolByKey finds a live pool (not released) by its content address: the rolling hash
// of its whole prefix, as reported in prefix_hash. A key is the same on every replica
// that holds the same prefix, unlike a pool id, which is local to one replica. When
// several pools hold the same prefix (created twice), a resident one is preferred, then
// one being built, then an evicted one (which would have to be restored).
func (s *Scheduler) PoolByKey(key uint64) (int, bool) {
	if s.poolsAllowed() != nil {
		return 0, false
	}
	var best *pool.Pool
	rank := map[pool.State]int{pool.Resident: 0, pool.Materializing: 1, pool.Evicted: 2}
	for _, p := range s.pools.All() {
		if p.State == pool.Released || p.Fingerprint() != key {
			continue
		}
		if best == nil || rank[p.State] < rank[best.State] {
			best = p
		}
	}
	if best == nil {
		return 0, false
	}
	return best.ID, true
}

// resolvePoolKey turns a request's pool key into a pool id when this replica holds the
// pool and the request shares at least Config.AttachMin tokens with it (issue 30:
// attaching makes the request a session of the pool, which pins the pool's cells as
// long as the session lives; a request that shares only a chat template's opening
// tokens is not worth that). Otherwise the request stays unpooled: with the prefix cache
// it still borrows whatever prefix is resident, the pool's cells included, by seq_cp,
// without joining the pool; without it, it prefills its whole prompt.
func (s *Scheduler) resolvePoolKey(req Request) Request {
	if req.HasPool || req.PoolKey == nil {
		return req
	}
	id, ok := s.PoolByKey(*req.PoolKey)
	if !ok {
		return req
	}
	if p, err := s.pools.Get(id); err != nil || attachLen(p, req) < max(1, s.cfg.AttachMin) {
		return req
	}
	req.HasPool, req.PoolID = true, id
	return req
}
