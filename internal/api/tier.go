package api

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/tier"
)

// wirePool is a pool's entry with what the tier knows: an evicted pool whose KV the
// tier holds is resident in "ram" or on "disk", and every evicted pool says what
// attaching to it will cost (restore_cost).
func (s *Server) wirePool(p engine.PoolInfo) wire.PoolInfo {
	w := wirePool(p)
	if s.tier == nil || w.Residency != "evicted" {
		return w
	}
	loc, n := s.tier.Where(p.PoolID)
	if loc == tier.None {
		w.RestoreCost = &wire.RestoreCost{From: "prefill", PrefillTokens: p.OwnLen}
		return w
	}
	w.Residency = string(loc)
	w.RestoreCost = &wire.RestoreCost{From: string(loc), Bytes: n}
	st := s.tier.Stats()
	if k, secs := st.Restores[loc], st.RestoreSeconds[loc]; k > 0 && st.SpillBytes > 0 && st.Spills > 0 {
		// The measured mean restore time scaled by this entry's size against the mean
		// entry: a rough estimate, stated as one.
		mean := float64(st.SpillBytes) / float64(st.Spills)
		ms := secs / float64(k) * 1000 * float64(n) / mean
		w.RestoreCost.EstMs = &ms
	}
	return w
}

func (s *Server) wirePools(st engine.PoolsStatus) wire.PoolsStatus {
	out := wirePools(st)
	for i, p := range st.Pools {
		out.Pools[i] = s.wirePool(p)
	}
	if s.tier != nil {
		for _, l := range s.tier.Lost() {
			out.LostPools = append(out.LostPools, wire.LostPool{PoolID: l.ID, Reason: l.Reason, Error: l.Err})
		}
	}
	return out
}

// tierProps is the tier's part of /props (nil when no tier was asked for).
func (s *Server) tierProps() *wire.PoolTierProps {
	switch {
	case s.tier == nil && s.info.PoolTier == "":
		return nil
	case s.tier == nil:
		return &wire.PoolTierProps{Off: s.info.PoolTier, Restores: map[string]int64{}, Misses: map[string]int64{}}
	}
	st := s.tier.Stats()
	restores := map[string]int64{}
	for loc, n := range st.Restores {
		restores[string(loc)] = n
	}
	kinds := map[string]wire.TierKind{}
	for k, v := range st.Kinds {
		kinds[k] = wire.TierKind{Spills: v.Spills, SpillBytes: v.SpillBytes, Restores: v.Restores, RestoreBytes: v.RestoreBytes,
			RestoreSeconds: v.RestoreSeconds, Misses: v.Misses}
	}
	ram, disk := st.Level(tier.RAM), st.Level(tier.Disk)
	return &wire.PoolTierProps{Enabled: true, RAMBytes: ram.Bytes, RAMEntries: ram.Entries, DiskBytes: disk.Bytes,
		DiskEntries: disk.Entries, Spills: st.Spills, Restores: restores, Misses: st.Misses, DiskErrors: st.DiskErrors, Kinds: kinds}
}

var (
	descTierBytes    = prometheus.NewDesc("polykv_pool_tier_bytes", "Bytes of evicted pools' KV held by the pool tier, by tier (ram, disk).", []string{"tier"}, nil)
	descTierEntries  = prometheus.NewDesc("polykv_pool_tier_entries", "Entries (pools' KV) held by the pool tier, by tier.", []string{"tier"}, nil)
	descTierSpills   = prometheus.NewDesc("polykv_pool_tier_spills_total", "Pool evictions that put (or found) the pool's KV in the tier.", nil, nil)
	descTierRestores = prometheus.NewDesc("polykv_pool_tier_restores_total", "Pools restored from the tier instead of prefilled, by tier.", []string{"tier"}, nil)
	descTierSeconds  = prometheus.NewDesc("polykv_pool_tier_restore_seconds_total", "Time spent restoring pools from the tier (read, verify, load), by tier.", []string{"tier"}, nil)
	descTierMisses   = prometheus.NewDesc("polykv_pool_tier_misses_total", "Restores that found no usable entry and prefilled instead, by reason (absent, truncated, corrupt, foreign, io, rejected).", []string{"reason"}, nil)
	descTierErrors   = prometheus.NewDesc("polykv_pool_tier_disk_errors_total", "Pool tier disk writes that failed (disk full, read-only, ...); the server kept serving.", nil, nil)
	descTierLost     = prometheus.NewDesc("polykv_pool_tier_lost_pools", "Recorded pools not back after this start (1 each), by pool id and reason (absent, truncated, corrupt, foreign, io: their record; refused: the server's).", []string{"pool", "reason"}, nil)
	// By kind of holder (issue 40): pool, session, cached.
	descKindSpills     = prometheus.NewDesc("polykv_tier_spills_total", "Entries put in the tier (or found there already), by kind of holder: pool, session (an idle session's segments), cached (a cached request's segments).", []string{"kind"}, nil)
	descKindSpillBytes = prometheus.NewDesc("polykv_tier_spill_bytes_total", "Bytes put in the tier, by kind of holder.", []string{"kind"}, nil)
	descKindRestores   = prometheus.NewDesc("polykv_tier_restores_total", "Entries restored from the tier into the cache instead of prefilled, by kind of holder.", []string{"kind"}, nil)
	descKindRestBytes  = prometheus.NewDesc("polykv_tier_restore_bytes_total", "Bytes restored from the tier, by kind of holder.", []string{"kind"}, nil)
	descKindRestSecs   = prometheus.NewDesc("polykv_tier_restore_seconds_total", "Time spent restoring from the tier (read, verify, load), by kind of holder.", []string{"kind"}, nil)
	descKindMisses     = prometheus.NewDesc("polykv_tier_misses_total", "Restores or loads that found no usable entry (the rest was prefilled), by kind of holder.", []string{"kind"}, nil)
)

// tierCollector exports a tier store's counters at scrape time.
type tierCollector struct{ t *tier.Store }

func (c tierCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descTierBytes, descTierEntries, descTierSpills, descTierRestores, descTierSeconds, descTierMisses, descTierErrors, descTierLost,
		descKindSpills, descKindSpillBytes, descKindRestores, descKindRestBytes, descKindRestSecs, descKindMisses} {
		ch <- d
	}
}

func (c tierCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.t.Stats()
	// One series per level the store has (ram and disk always, the fleet's level when
	// there is one), labelled with its location.
	for _, l := range st.Levels {
		loc := string(l.Location)
		ch <- prometheus.MustNewConstMetric(descTierBytes, prometheus.GaugeValue, float64(l.Bytes), loc)
		ch <- prometheus.MustNewConstMetric(descTierEntries, prometheus.GaugeValue, float64(l.Entries), loc)
		ch <- prometheus.MustNewConstMetric(descTierRestores, prometheus.CounterValue, float64(st.Restores[l.Location]), loc)
		ch <- prometheus.MustNewConstMetric(descTierSeconds, prometheus.CounterValue, st.RestoreSeconds[l.Location], loc)
	}
	ch <- prometheus.MustNewConstMetric(descTierSpills, prometheus.CounterValue, float64(st.Spills))
	for _, r := range []string{tier.MissAbsent, tier.MissTruncated, tier.MissCorrupt, tier.MissForeign, tier.MissIO, tier.MissRejected} {
		ch <- prometheus.MustNewConstMetric(descTierMisses, prometheus.CounterValue, float64(st.Misses[r]), r)
	}
	ch <- prometheus.MustNewConstMetric(descTierErrors, prometheus.CounterValue, float64(st.DiskErrors))
	seen := map[tier.Lost]bool{} // one series per label set: a repeat would fail the scrape
	for _, l := range c.t.Lost() {
		if l.Err = ""; !seen[l] {
			seen[l] = true
			ch <- prometheus.MustNewConstMetric(descTierLost, prometheus.GaugeValue, 1, strconv.Itoa(l.ID), l.Reason)
		}
	}
	for _, k := range []string{tier.KindPool, tier.KindSession, tier.KindCached} {
		ks := st.Kinds[k]
		ch <- prometheus.MustNewConstMetric(descKindSpills, prometheus.CounterValue, float64(ks.Spills), k)
		ch <- prometheus.MustNewConstMetric(descKindSpillBytes, prometheus.CounterValue, float64(ks.SpillBytes), k)
		ch <- prometheus.MustNewConstMetric(descKindRestores, prometheus.CounterValue, float64(ks.Restores), k)
		ch <- prometheus.MustNewConstMetric(descKindRestBytes, prometheus.CounterValue, float64(ks.RestoreBytes), k)
		ch <- prometheus.MustNewConstMetric(descKindRestSecs, prometheus.CounterValue, ks.RestoreSeconds, k)
		ch <- prometheus.MustNewConstMetric(descKindMisses, prometheus.CounterValue, float64(ks.Misses), k)
	}
}

// SetTier exports the pool tier's sizes and counters (polykv_pool_tier_*).
func (m *Metrics) SetTier(t *tier.Store) { m.Registry.MustRegister(tierCollector{t}) }
