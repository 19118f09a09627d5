package bench

import (
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The times under the floor come from the readings: each one stands for the interval
// since the one before; readings with no warm decoding session count for nothing.
func TestEpisodeSummarize(t *testing.T) {
	at := func(ms int) time.Duration { return time.Duration(ms) * time.Millisecond }
	r := episodeResult{samples: []episodeSample{
		{t: at(250), serverN: 2, serverMean: 50, serverLow: 0, clientN: 2, clientMean: 45, workers: 2},
		{t: at(500), serverN: 3, serverMean: 30, serverLow: 2, clientN: 3, clientMean: 35, clientLow: 1, workers: 3},
		{t: at(750), serverN: 3, serverMean: 15, serverLow: 3, clientN: 3, clientMean: 25, clientLow: 3, workers: 3},
		{t: at(1000), serverN: 0, clientN: 0, workers: 3}, // everyone in a tool call
		{t: at(1500), serverN: 1, serverMean: 60, clientN: 1, clientMean: 55, workers: 1},
	}}
	r.summarize(40)
	if r.under != at(500) || r.deep != at(250) {
		t.Fatalf("under %s deep %s, want 500ms and 250ms", r.under, r.deep)
	}
	if r.sessUnder != 5*at(250) {
		t.Fatalf("session time under %s, want 1.25s", r.sessUnder)
	}
	if r.clientUnder != at(500) || r.clientDeep != 0 || r.clientSessUnder != 4*at(250) {
		t.Fatalf("client: under %s deep %s sessions %s", r.clientUnder, r.clientDeep, r.clientSessUnder)
	}
	if want := (2*0.25 + 3*0.25 + 3*0.25 + 3*0.25 + 1*0.5); math.Abs(r.workerSeconds-want) > 1e-9 {
		t.Fatalf("worker-seconds %f, want %f", r.workerSeconds, want)
	}
	// Time-weighted mean over the readings with sessions decoding: (50+30+15)·0.25 + 60·0.5.
	if want := (95*0.25 + 60*0.5) / 1.25; math.Abs(r.meanTPS-want) > 1e-9 {
		t.Fatalf("mean tps %f, want %f", r.meanTPS, want)
	}
}

// A random tool latency is the same for a package and step in every configuration,
// and stays in [0, 2·latency).
func TestEpisodeLatencySeeded(t *testing.T) {
	e := episode{toolLatency: time.Second, toolRandom: true}
	seen := map[time.Duration]bool{}
	for p := range 4 {
		for s := range 4 {
			d := e.latency(p, s)
			if d != e.latency(p, s) || d < 0 || d >= 2*time.Second {
				t.Fatalf("latency(%d, %d) = %s (again %s)", p, s, d, e.latency(p, s))
			}
			seen[d] = true
		}
	}
	if len(seen) < 12 {
		t.Fatalf("only %d distinct latencies of 16", len(seen))
	}
	if d := (episode{toolLatency: time.Second}).latency(3, 2); d != time.Second {
		t.Fatalf("fixed latency %s", d)
	}
}

func TestEpisodeConfigs(t *testing.T) {
	e := episode{configs: "baseline,gated,throttle", gateKind: "reserve"}
	if got, err := e.parseConfigs(); err != nil || strings.Join(got, ",") != "baseline,gated,throttle" {
		t.Fatalf("%v %v", got, err)
	}
	e.llamaServer = "/bin/llama-server"
	if got, _ := e.parseConfigs(); strings.Join(got, ",") != "baseline,gated,throttle,llama" {
		t.Fatalf("with a llama-server binary: %v", got)
	}
	for _, bad := range []episode{
		{configs: "baseline,fast", gateKind: "reserve"},
		{configs: "llama", gateKind: "reserve"},
		{configs: "url", gateKind: "reserve"},
		{configs: "gated", gateKind: "ask"},
	} {
		if _, err := bad.parseConfigs(); err == nil {
			t.Fatalf("accepted %+v", bad)
		}
	}
}

// The timeline files: a CSV per second, one of every reading's sessions, and a PNG.
func TestEpisodeWrite(t *testing.T) {
	dir := t.TempDir()
	e := episode{out: dir, maxWorkers: 4}
	r := episodeResult{config: epGated, rep: 0, wall: 3 * time.Second, samples: []episodeSample{
		{t: 250 * time.Millisecond, serverN: 1, serverMean: 50, serverAll: 52, clientN: 1, clientMean: 48, workers: 1,
			serverRates: map[string]float64{"worker-0": 50}, clientRates: map[string]float64{"worker-0": 48}},
		{t: 2250 * time.Millisecond, serverN: 2, serverMean: 30, serverAll: 31, clientN: 2, clientMean: 29, workers: 2,
			serverRates: map[string]float64{"worker-0": 31, "worker-1": 29}, clientRates: map[string]float64{"worker-0": 30, "worker-1": 28}},
	}}
	r.summarize(40)
	if err := e.write(r, 40); err != nil {
		t.Fatal(err)
	}
	csv, err := os.ReadFile(filepath.Join(dir, "episode-gated-1.csv"))
	if err != nil {
		t.Fatal(err)
	}
	want := "second,mean_active_tps,client_mean_tps,workers,decoding,throttled_steps_running,mean_active_tps_all,background_tps\n" +
		"0,50.00,48.00,1,1,0,52.00,\n1,,,0,0,0,,\n2,30.00,29.00,2,2,0,31.00,\n3,,,0,0,0,,\n"
	if string(csv) != want {
		t.Fatalf("per-second CSV:\n%s\nwant:\n%s", csv, want)
	}
	sess, err := os.ReadFile(filepath.Join(dir, "episode-gated-1-sessions.csv"))
	if err != nil || strings.Count(string(sess), "\n") != 7 || !strings.Contains(string(sess), "2.25,worker-1,client,28.00") {
		t.Fatalf("sessions CSV (%v):\n%s", err, sess)
	}
	f, err := os.Open(filepath.Join(dir, "episode-gated-1.png"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil || img.Bounds().Dx() != plotW || img.Bounds().Dy() != plotH {
		t.Fatalf("PNG: %v %v", err, img)
	}
}

// The machine's busy time counts this process's own: burning CPU here moves both, and
// what other processes used stays what the machine did beyond it.
func TestForeignCPU(t *testing.T) {
	start := readCPU()
	if start.machine <= 0 { // own may still be 0 ticks this early
		t.Skipf("no /proc CPU times here: %+v", start)
	}
	// Burn 0.15 s of this process's own CPU, however busy the machine is (a wall-clock
	// budget would measure the neighbours, not the accounting).
	deadline := time.Now().Add(30 * time.Second)
	x := 0
	for readCPU().own-start.own < 0.15 && time.Now().Before(deadline) {
		for range 1_000_000 {
			x++
		}
	}
	now := readCPU()
	if now.own-start.own < 0.1 || now.machine-start.machine < now.own-start.own-0.05 {
		t.Fatalf("busy loop (%d): own %.2f s, machine %.2f s", x, now.own-start.own, now.machine-start.machine)
	}
	if f := foreignSince(start); f < 0 {
		t.Fatalf("foreign %.2f", f)
	}
}
