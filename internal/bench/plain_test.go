package bench

import (
	"testing"
	"time"

	"github.com/polykv/polykv/internal/app"
)

func TestPercentileNearestRank(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		out := make([]time.Duration, len(v))
		for i, x := range v {
			out[i] = time.Duration(x) * time.Millisecond
		}
		return out
	}
	for _, c := range []struct {
		in   []time.Duration
		q    float64
		want time.Duration
	}{
		{ms(7), 0.5, 7 * time.Millisecond},
		{ms(40, 10, 30, 20), 0.5, 20 * time.Millisecond}, // even count: the lower middle
		{ms(5, 1, 3), 0.5, 3 * time.Millisecond},
		{ms(5, 1, 3), 1, 5 * time.Millisecond},
		{ms(5, 1, 3), 0, 1 * time.Millisecond},
	} {
		in := append([]time.Duration(nil), c.in...)
		if got := percentile(c.in, c.q); got != c.want {
			t.Errorf("percentile(%v, %v) = %v, want %v", c.in, c.q, got, c.want)
		}
		for i := range in {
			if in[i] != c.in[i] {
				t.Fatalf("percentile reordered its input: %v, was %v", c.in, in)
			}
		}
	}
}

func TestParseModesAndCounts(t *testing.T) {
	m, err := parseModes("auto, pool,auto", modePool, modeAuto, modeOff)
	if err != nil || len(m) != 2 || m[0] != modeAuto || m[1] != modePool {
		t.Fatalf("parseModes: %v %v, want [auto pool]", m, err)
	}
	if _, err := parseModes("pool", modeAuto, modeOff); err == nil {
		t.Fatal("the agent loop has no pool config; want an error")
	}
	ns, err := parseCounts("1, 4,16", 64)
	if err != nil || len(ns) != 3 || ns[2] != 16 {
		t.Fatalf("parseCounts: %v %v", ns, err)
	}
	for _, bad := range []string{"0", "65", "x", "4,", "4x"} {
		if _, err := parseCounts(bad, 64); err == nil {
			t.Errorf("parseCounts(%q): want an error", bad)
		}
	}
}

func TestWithCacheReuse(t *testing.T) {
	// The flag's parsing is cmd/polykv's TestPrefixCacheFlag.
	cfg := app.DefaultConfig().Resolved()
	if cfg.PrefixCache != "on" || withCacheReuse(cfg, false).PrefixCache != "off" || withCacheReuse(cfg, true).PrefixCache != "on" {
		t.Fatalf("default %q; the off and on configs must spell --prefix-cache off and on", cfg.PrefixCache)
	}
}
