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
	m.Registry.MustRegister(m.ttft, m.itl, m.hits, m.queries, m)
	return m
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
	descRunning  = prometheus.NewDesc("polykv_requests_running", "Generation requests on a sequence.", nil, nil)
	descWaiting  = prometheus.NewDesc("polykv_requests_waiting", "Generation requests waiting for a sequence.", nil, nil)
	descKVRatio  = prometheus.NewDesc("polykv_kv_usage_ratio", "Fraction of the unified cache's cells in use.", nil, nil)
)

// Describe implements prometheus.Collector for the scrape-time gauges.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descGen, descKV, descSessions, descRunning, descWaiting, descKVRatio} {
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
	}
	ch <- prometheus.MustNewConstMetric(descRunning, prometheus.GaugeValue, float64(usage.Running))
	ch <- prometheus.MustNewConstMetric(descWaiting, prometheus.GaugeValue, float64(usage.Waiting))
	ch <- prometheus.MustNewConstMetric(descKVRatio, prometheus.GaugeValue, float64(usage.CellsUsed)/float64(max(1, usage.CellsMax)))
}
