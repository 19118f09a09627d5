package engine

import "github.com/polykv/polykv/internal/pool"

// A pool's prefix enters or leaves what other requests may reuse when the pool becomes
// resident, is released or is evicted: the residency reports (residency.go) then
// announce or withdraw its sequence, which the KV events (package kvevents) publish.

// prefixStored marks a pool that has just become resident: with the prefix cache off,
// its cells become reportable.
func (s *Scheduler) prefixStored(p *pool.Pool) {
	s.kv.Cells().Touch(p.Seq, 0)
}

// prefixAnnounced reports a pool whose prefix was reported stored and not yet removed:
// fully materialized and not released (a half-built one that is abandoned never was).
func prefixAnnounced(p *pool.Pool) bool {
	return p.State == pool.Resident && p.L() > 0 && p.Filled() == p.L()
}

// prefixRemoved marks a pool that no new request can reuse: released (its cells stay
// until the sessions on it end and the grace time passes, but nothing new may attach,
// so a router must stop sending its prefix here) or evicted. Callers check
// prefixAnnounced before the transition.
func (s *Scheduler) prefixRemoved(p *pool.Pool) {
	s.kv.Cells().Touch(p.Seq, 0)
}

// PoolByKey finds a live pool (not released) by its content address: the rolling hash
// of its whole prefix, as reported in prefix_hash. A key is the same on every replica
// that holds the same prefix, unlike a pool id, which is local to one replica. When
// several pools hold the same prefix (created twice), a resident one is preferred, then
// one being built, then an evicted one (which would have to be restored).
func (s *Scheduler) PoolByKey(key uint64) (int, bool) {
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
