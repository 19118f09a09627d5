package api

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/polykv/polykv/internal/engine"
)

// Metrics is PolyKV's Prometheus surface. Labels are pools only, never sessions: the
// number of sessions is unbounded, the number of pools is not (--max-pools).
type Metrics struct {
	Registry *prometheus.Registry
	ttft     prometheus.Histogram
	itl      prometheus.Histogram
	hits     *prometheus.CounterVec
	queries  *prometheus.CounterVec
	eng      *engine.Engine
	cacheCfg *prometheus.GaugeVec
	// Speculative decoding, per pool: proposals verified, their draft tokens, and the
	// draft tokens accepted.
	specProposals, specDrafted, specAccepted *prometheus.CounterVec
}

// NewMetrics registers the collectors. Attach the engine with SetEngine before serving.
func NewMetrics() *Metrics {
	m := &Metrics{Registry: prometheus.NewRegistry()}
	m.ttft = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "polykv_time_to_first_token_seconds",
		Help: "Time from request arrival to its first generated token.", Buckets: prometheus.ExponentialBuckets(0.005, 2, 14)})
	m.itl = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "polykv_inter_token_latency_seconds",
		Help: "Time between consecutive generated tokens of a request.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 14)})
	m.hits = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "polykv_prefix_cache_hits_total",
		Help: "Prompt tokens served from the KV cache (pool prefix or the session's own cells) instead of prefilled."}, []string{"pool"})
	m.queries = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "polykv_queries_total",
		Help: "Generation requests completed."}, []string{"pool"})
	m.cacheCfg = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "polykv_cache_config_info",
		Help: "KV cache configuration as labels (value 1), in the shape of vllm:cache_config_info: block_size is the KV-event block size in tokens, num_gpu_blocks the cache's cells divided by it."},
		[]string{"block_size", "num_gpu_blocks"})
	m.specProposals = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "polykv_spec_proposals_total",
		Help: "Speculative decoding: draft proposals verified (one per session per step that drafted)."}, []string{"pool"})
	m.specDrafted = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "polykv_spec_draft_tokens_total",
		Help: "Speculative decoding: draft tokens verified (llama-server's draft_n)."}, []string{"pool"})
	m.specAccepted = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "polykv_spec_draft_tokens_accepted_total",
		Help: "Speculative decoding: draft tokens the model accepted (llama-server's draft_n_accepted); accepted / drafted is the acceptance rate."}, []string{"pool"})
	m.Registry.MustRegister(m.ttft, m.itl, m.hits, m.queries, m.cacheCfg, m.specProposals, m.specDrafted, m.specAccepted, m)
	return m
}

// SetCacheConfig publishes the cache-config info gauge that llm-d's metrics extractor
// reads (cacheInfoSpec): the block size used for KV events and the whole cache in
// blocks of that size.
func (m *Metrics) SetCacheConfig(blockSize, nCtx int) {
	if blockSize < 1 {
		return
	}
	m.cacheCfg.Reset()
	m.cacheCfg.WithLabelValues(strconv.Itoa(blockSize), strconv.Itoa(nCtx/blockSize)).Set(1)
}

// SetEngine gives the scrape-time collector its snapshot source.
func (m *Metrics) SetEngine(e *engine.Engine) { m.eng = e }

func poolLabel(pool int) string {
	if pool == 0 {
		return "none"
	}
	return strconv.Itoa(pool)
}

// TTFT implements engine.Observer.
func (m *Metrics) TTFT(_ int, d time.Duration) { m.ttft.Observe(d.Seconds()) }

// TokenLatency implements engine.Observer.
func (m *Metrics) TokenLatency(d time.Duration) { m.itl.Observe(d.Seconds()) }

// Draft implements engine.DraftObserver.
func (m *Metrics) Draft(pool, drafted, accepted int) {
	l := poolLabel(pool)
	m.specProposals.WithLabelValues(l).Inc()
	m.specDrafted.WithLabelValues(l).Add(float64(drafted))
	m.specAccepted.WithLabelValues(l).Add(float64(accepted))
}

// Query implements engine.Observer.
func (m *Metrics) Query(pool, _ int, cached int) {
	l := poolLabel(pool)
	m.queries.WithLabelValues(l).Inc()
	m.hits.WithLabelValues(l).Add(float64(cached))
}

var (
	descGen      = prometheus.NewDesc("polykv_gen_throughput_tps", "Sum of experienced decode tokens/s of the pool's generating sessions.", []string{"pool"}, nil)
	descKV       = prometheus.NewDesc("polykv_pool_kv_bytes", "KV bytes owned by the pool and its attached sessions' suffixes.", []string{"pool"}, nil)
	descSessions = prometheus.NewDesc("polykv_pool_sessions", "Sessions holding cells on the pool.", []string{"pool"}, nil)
	// Throttle toward the floor (issue 41).
	descPaced     = prometheus.NewDesc("polykv_paced_turns_total", "Turns the pool's throttle (throttle: toward_floor) held in the queue because one more session would have slowed its running sessions under the floor.", []string{"pool"}, nil)
	descThrottled = prometheus.NewDesc("polykv_throttled_steps_total", "Decode steps the pool's sessions skipped because its policy throttles sessions decoding well above the floor (throttle: toward_floor).", []string{"pool"}, nil)
	descRunning   = prometheus.NewDesc("polykv_requests_running", "Generation requests on a sequence.", nil, nil)
	descWaiting   = prometheus.NewDesc("polykv_requests_waiting", "Generation requests waiting for a sequence.", nil, nil)
	// Every wait is visible and bounded (issue 30, --queue-timeout).
	descWaitReason   = prometheus.NewDesc("polykv_requests_waiting_reason", "Generation requests without a sequence yet, by why they wait: pool (being built or restored), prefix (a running request will hold a longer prefix), session (its previous turn runs), sequence (all are running), cells (held by running requests or pinned pools), queue (behind a request waiting for cells), admission (held by an enforced pool's gate).", []string{"reason"}, nil)
	descWaitOldest   = prometheus.NewDesc("polykv_queue_oldest_wait_seconds", "How long the longest-waiting request without a sequence has waited (0: none waits).", nil, nil)
	descWaitTimeouts = prometheus.NewDesc("polykv_queue_timeouts_total", "Waits that ran past --queue-timeout: requests refused with 503, pool creations and restores abandoned.", nil, nil)
	// KV usage as a router reads it (vLLM's kv_cache_usage_perc: blocks no new request
	// can get): idle sessions', cached sequences' and evictable pools' cells are free
	// for the asking, so counting them steered new work away from the replica holding
	// the useful prefix (issue 30). The cells themselves are reported beside it.
	descKVRatio          = prometheus.NewDesc("polykv_kv_usage_ratio", "Fraction of the unified cache's cells that no new request can get: in use by running requests, pinned or recently used pools and prompts being prefilled; idle sessions', cached sequences' and evictable pools' cells count as free (polykv_kv_cells_evictable).", nil, nil)
	descKVCellsUsed      = prometheus.NewDesc("polykv_kv_cells_used", "KV cells in use (every sequence's, idle and cached ones included).", nil, nil)
	descKVCellsEvictable = prometheus.NewDesc("polykv_kv_cells_evictable", "KV cells in use that eviction would free for a new request: held only by idle sessions, cached anonymous sequences and evictable pools (unpinned, or pinned with a pool tier), not counting a pool just made that awaits its first use within --pool-grace-ms.", nil, nil)
	// The prefix cache (issue 12, --prefix-cache).
	descCacheImplicit  = prometheus.NewDesc("polykv_prefix_cache_implicit_hit_tokens_total", "Prompt tokens that requests without pool_id (or a known session) took from a resident sequence's prefix by seq_cp instead of prefilling.", nil, nil)
	descCacheResident  = prometheus.NewDesc("polykv_prefix_cache_resident_tokens", "Cells held only by finished anonymous sequences kept as cache (what dropping the cache would free).", nil, nil)
	descCacheSeqs      = prometheus.NewDesc("polykv_prefix_cache_sequences", "Finished anonymous sequences kept as cache.", nil, nil)
	descCacheEvictions = prometheus.NewDesc("polykv_prefix_cache_evictions_total", "Times a cached anonymous sequence lost cells (least recently used tail first) or its sequence id under pressure or expiry.", nil, nil)
	descEvictions      = prometheus.NewDesc("polykv_evictions_total", "Times eviction under cell or sequence-id pressure (in order of expected next use) took cells from a victim, by its kind: cached (an anonymous sequence kept as cache; also its sequence id or expiry), session (an idle session's tail, or the whole session) or pool (a pool's own cells; with a tier also a pinned pool's, paged out).", []string{"kind"}, nil)
	descSeqSaves       = prometheus.NewDesc("polykv_tier_segments_saved_total", "Segments of evicted sessions' and cached sequences' KV the scheduler asked the tier to store (shared content is asked once), by kind (session, cached).", []string{"kind"}, nil)
	descSeqLoaded      = prometheus.NewDesc("polykv_tier_loaded_tokens_total", "Prompt tokens loaded from the tier into a sequence instead of prefilled, by what stored them last (session, cached).", []string{"kind"}, nil)
	descSeqLoads       = prometheus.NewDesc("polykv_tier_loads_total", "Loads from the tier into a request's sequence that brought tokens back, by kind (session, cached).", []string{"kind"}, nil)
	descSeqMisses      = prometheus.NewDesc("polykv_tier_segment_misses_total", "Segments a load expected but the tier no longer had or could not load (the rest of the prompt was prefilled).", nil, nil)
)

var waitReasons = []string{engine.WaitPool, engine.WaitPrefix, engine.WaitSession, engine.WaitSequence,
	engine.WaitCells, engine.WaitQueue, engine.WaitAdmission, engine.WaitFloor}

// Describe implements prometheus.Collector for the scrape-time gauges.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descGen, descKV, descSessions, descThrottled, descPaced, descRunning, descWaiting, descKVRatio,
		descWaitReason, descWaitOldest, descWaitTimeouts, descKVCellsUsed, descKVCellsEvictable,
		descCacheImplicit, descCacheResident, descCacheSeqs, descCacheEvictions, descEvictions,
		descSeqSaves, descSeqLoaded, descSeqLoads, descSeqMisses} {
		ch <- d
	}
}

// Collect reads the engine's published snapshot (never its live state).
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	if m.eng == nil {
		return
	}
	snap := m.eng.Snapshot()
	rows, usage := snap.Metrics, snap.Usage
	for _, r := range rows {
		l := poolLabel(r.PoolID)
		ch <- prometheus.MustNewConstMetric(descGen, prometheus.GaugeValue, r.GenTPS, l)
		ch <- prometheus.MustNewConstMetric(descKV, prometheus.GaugeValue, float64(r.KVBytes), l)
		ch <- prometheus.MustNewConstMetric(descSessions, prometheus.GaugeValue, float64(r.Sessions), l)
		if !r.Unattached {
			ch <- prometheus.MustNewConstMetric(descThrottled, prometheus.CounterValue, float64(r.ThrottledSteps), l)
			ch <- prometheus.MustNewConstMetric(descPaced, prometheus.CounterValue, float64(r.PacedTurns), l)
		}
	}
	ch <- prometheus.MustNewConstMetric(descRunning, prometheus.GaugeValue, float64(usage.Running))
	ch <- prometheus.MustNewConstMetric(descWaiting, prometheus.GaugeValue, float64(usage.Waiting))
	byReason := map[string]int{}
	for _, r := range waitReasons {
		byReason[r] = 0 // every reason is exported, 0 included, so a dashboard's series never vanish
	}
	var oldest time.Duration
	for _, w := range snap.Waiting {
		byReason[w.Reason]++
		oldest = max(oldest, w.Waited)
	}
	for r, n := range byReason {
		ch <- prometheus.MustNewConstMetric(descWaitReason, prometheus.GaugeValue, float64(n), r)
	}
	ch <- prometheus.MustNewConstMetric(descWaitOldest, prometheus.GaugeValue, oldest.Seconds())
	ch <- prometheus.MustNewConstMetric(descWaitTimeouts, prometheus.CounterValue, float64(usage.QueueTimeouts))
	ch <- prometheus.MustNewConstMetric(descKVRatio, prometheus.GaugeValue, float64(usage.CellsUsed-usage.CellsEvictable)/float64(max(1, usage.CellsMax)))
	ch <- prometheus.MustNewConstMetric(descKVCellsUsed, prometheus.GaugeValue, float64(usage.CellsUsed))
	ch <- prometheus.MustNewConstMetric(descKVCellsEvictable, prometheus.GaugeValue, float64(usage.CellsEvictable))
	ch <- prometheus.MustNewConstMetric(descCacheImplicit, prometheus.CounterValue, float64(usage.CacheHitTokens))
	ch <- prometheus.MustNewConstMetric(descCacheResident, prometheus.GaugeValue, float64(usage.CacheCells))
	ch <- prometheus.MustNewConstMetric(descCacheSeqs, prometheus.GaugeValue, float64(usage.CacheSeqs))
	ch <- prometheus.MustNewConstMetric(descCacheEvictions, prometheus.CounterValue, float64(usage.CacheEvictions))
	for _, k := range []engine.SpillKind{engine.SpillSession, engine.SpillCached} {
		ts := usage.Tier
		ch <- prometheus.MustNewConstMetric(descSeqSaves, prometheus.CounterValue, float64(ts.Saves[k]), k.String())
		ch <- prometheus.MustNewConstMetric(descSeqLoaded, prometheus.CounterValue, float64(ts.LoadedTokens[k]), k.String())
		ch <- prometheus.MustNewConstMetric(descSeqLoads, prometheus.CounterValue, float64(ts.Loads[k]), k.String())
	}
	ch <- prometheus.MustNewConstMetric(descSeqMisses, prometheus.CounterValue, float64(usage.Tier.Misses))
	for kind, n := range map[string]int64{"cached": usage.CacheEvictions, "session": usage.SessionEvictions, "pool": usage.PoolEvictions} {
		ch <- prometheus.MustNewConstMetric(descEvictions, prometheus.CounterValue, float64(n), kind)
	}
}

// AddCompactions exports the whole-cache compactions the backend ran and the seconds they
// took. With PolyKV's attention kernel over an f16/f32 cache both stay 0 (cells are summed
// in position order wherever they sit); quantized caches and llama.cpp's kernel still
// compact after frees, at a cost that grows with every tenant's cells.
func (m *Metrics) AddCompactions(stats func() (int64, time.Duration)) {
	m.Registry.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "polykv_kv_compactions_total", Help: "Whole-KV-cache compactions (each copies every used cell out and back in)."},
			func() float64 { n, _ := stats(); return float64(n) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "polykv_kv_compaction_seconds_total", Help: "Time spent compacting the KV cache."},
			func() float64 { _, d := stats(); return d.Seconds() }),
	)
}

// AddKVEvents exports the KV-event publisher's counters: messages sent, snapshots
// sent to newly joined subscribers, and changes dropped because its queue was full
// (non-zero means a router's view of this replica is stale).
func (m *Metrics) AddKVEvents(sent, snapshots, dropped func() float64) {
	m.Registry.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "polykv_kv_events_messages_total", Help: "KV-event messages sent over ZMQ."}, sent),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "polykv_kv_events_snapshots_total", Help: "KV-event snapshots (AllBlocksCleared + resident pools) sent when a subscriber joined."}, snapshots),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "polykv_kv_events_dropped_total", Help: "Pool changes dropped because the KV-event queue was full."}, dropped),
	)
}
