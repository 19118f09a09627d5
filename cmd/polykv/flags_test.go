package main

import (
	"flag"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/app"
)

func parseCore(t *testing.T, args ...string) app.Config {
	t.Helper()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg := app.DefaultConfig()
	coreFlags(fs, &cfg)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return cfg.Resolved()
}

// A flag that is not given keeps its default; an explicit 0 is 0 (no sentinel values).
func TestFlagsDistinguishNotGivenFromZero(t *testing.T) {
	def := parseCore(t)
	want := app.DefaultConfig().Resolved()
	if !reflect.DeepEqual(def, want) {
		t.Fatalf("no flags: %+v, want the defaults %+v", def, want)
	}
	if def.SessionTTL != 30*time.Minute || def.MaxPools != 16 || def.PoolGrace != 30*time.Second || def.MaxQueue != 64 || def.QueueTimeout != 30*time.Second || def.AttachMin != 64 {
		t.Fatalf("defaults changed unnoticed: %+v", def)
	}
	zero := parseCore(t, "--session-ttl", "0", "--max-pools", "0", "--pool-grace-ms", "0", "--queue", "0", "--queue-timeout", "0")
	if zero.SessionTTL != 0 || zero.MaxPools != 0 || zero.PoolGrace != 0 || zero.MaxQueue != 0 || zero.QueueTimeout != 0 {
		t.Fatalf("explicit zeros: ttl %s, max-pools %d, grace %s, queue %d, queue timeout %s; want all 0", zero.SessionTTL, zero.MaxPools, zero.PoolGrace, zero.MaxQueue, zero.QueueTimeout)
	}
	zero.ModelPath = "m.gguf"
	if err := zero.Validate(); err != nil {
		t.Fatalf("zeros are valid settings: %v", err)
	}
	set := parseCore(t, "-c", "2048", "--session-ttl", "5m", "--pool-grace-ms", "1500", "--queue-timeout", "90s")
	if set.NCtx != 2048 || set.SessionTTL != 5*time.Minute || set.PoolGrace != 1500*time.Millisecond || set.QueueTimeout != 90*time.Second {
		t.Fatalf("given values: %+v", set)
	}
	if set := parseCore(t, "--attach-min-tokens", "0"); set.AttachMin != 0 {
		t.Fatalf("--attach-min-tokens 0: %d", set.AttachMin)
	}
	for _, bad := range [][]string{{"--queue-timeout", "-1s"}, {"--attach-min-tokens", "-1"}} {
		neg := parseCore(t, bad...)
		neg.ModelPath = "m.gguf"
		if err := neg.Validate(); err == nil || !strings.Contains(err.Error(), bad[0]) {
			t.Fatalf("%s %s: %v, want an error naming the flag", bad[0], bad[1], err)
		}
	}
}

// --prefix-cache: on by default, off for comparison, anything else refused.
func TestPrefixCacheFlag(t *testing.T) {
	if def := parseCore(t); def.PrefixCache != "on" {
		t.Fatalf("default --prefix-cache %q, want on", def.PrefixCache)
	}
	off := parseCore(t, "--prefix-cache", "off")
	off.ModelPath = "m.gguf"
	if off.PrefixCache != "off" || off.Validate() != nil {
		t.Fatalf("--prefix-cache off: %q, %v", off.PrefixCache, off.Validate())
	}
	bad := parseCore(t, "--prefix-cache", "2")
	bad.ModelPath = "m.gguf"
	if bad.Validate() == nil {
		t.Fatal("--prefix-cache 2 accepted")
	}
}

// --fa-kernel and --mm-kernel default to PolyKV's kernels, accept ggml and refuse
// anything else with an error naming the flag.
func TestKernelFlags(t *testing.T) {
	def := parseCore(t)
	if def.FAKernel != "polykv" || def.MMKernel != "polykv" {
		t.Fatalf("defaults: --fa-kernel %q, --mm-kernel %q, want polykv", def.FAKernel, def.MMKernel)
	}
	for _, flag := range []string{"--fa-kernel", "--mm-kernel"} {
		ok := parseCore(t, flag, "ggml")
		ok.ModelPath = "m.gguf"
		if err := ok.Validate(); err != nil {
			t.Fatalf("%s ggml: %v", flag, err)
		}
		bad := parseCore(t, flag, "fast")
		bad.ModelPath = "m.gguf"
		if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), flag) {
			t.Fatalf("%s fast: %v, want an error naming the flag", flag, err)
		}
	}
}
