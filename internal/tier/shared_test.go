package tier

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
)

// sharedStores opens n stores (replicas) over one shared directory, each without RAM
// or a directory of its own, so every entry they hold is the shared level's.
func sharedStores(t *testing.T, n int, budget int64) ([]*Store, string) {
	t.Helper()
	dir := t.TempDir()
	var out []*Store
	for range n {
		out = append(out, open(t, Config{SharedDir: dir, SharedBytes: budget}))
	}
	return out, dir
}

func kvFiles(t *testing.T, dir string) []string {
	t.Helper()
	f, err := filepath.Glob(filepath.Join(dir, "*.kv"))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// TestSharedOtherReplica: an entry one store (replica A) puts is found and read by
// another over the same directory (replica B, which never stored it): by Has, by Run
// (the chunk run of a prompt) and by Get, from the shared level.
func TestSharedOtherReplica(t *testing.T) {
	st, dir := sharedStores(t, 2, 1<<20)
	a, b := st[0], st[1]
	prompt := meta(0, 40, 7).Tokens
	// A's chunks of 16: [0,16) [16,32) and the partial [32,40) ending the prompt.
	for k := 0; k < 40; k += 16 {
		m := Meta{D: k, Tokens: prompt[:min(k+16, 40)]}
		if loc := a.PutSegment(KindCached, m, payload(100, byte(k))); loc != Shared {
			t.Fatalf("chunk %d went to %q, want shared (no RAM, no --pool-dir)", k, loc)
		}
	}
	a.Flush()
	if n := len(kvFiles(t, dir)); n != 3 {
		t.Fatalf("%d files in the shared directory, want 3", n)
	}
	run := b.Run(prompt, 16)
	if len(run) != 3 || run[2].D != 32 || len(run[2].Tokens) != 40 {
		t.Fatalf("B's run of the prompt: %+v, want the 3 chunks A stored", run)
	}
	// A longer prompt that continues it (the conversation's next turn): the two whole
	// chunks and the partial one, found although named by a 40-token prefix that is
	// not this prompt; a prompt that parts from it inside the chunk finds the two.
	next := append(prompt[:40:40], 1, 2, 3)
	if run := b.Run(next, 16); len(run) != 3 || run[2].D != 32 || !slices.Equal(run[2].Tokens, prompt) {
		t.Fatalf("run of a continuation: %+v, want the 2 chunks and [32, 40)", run)
	}
	other := append(prompt[:36:36], 5, 5, 5, 5, 5, 5, 5)
	if run := b.Run(other, 16); len(run) != 2 {
		t.Fatalf("run of a prompt that parts at 36: %d segments, want 2", len(run))
	}
	// Of two entries that start there the longer one the prompt continues.
	a.PutSegment(KindCached, Meta{D: 32, Tokens: prompt[:36]}, payload(100, 36))
	a.Flush()
	if run := b.Run(next, 16); len(run) != 3 || len(run[2].Tokens) != 40 {
		t.Fatalf("run of a continuation beside a shorter entry: %+v, want [32, 40)", run)
	}
	if run := b.Run(other, 16); len(run) != 3 || len(run[2].Tokens) != 36 {
		t.Fatalf("run of a prompt that parts at 36: %+v, want [32, 36)", run)
	}
	for k := 0; k < 40; k += 16 {
		m := Meta{D: k, Tokens: prompt[:min(k+16, 40)]}
		if !b.OnDiskOnly(m) {
			t.Fatalf("chunk %d: B must read it off the engine goroutine (OnDiskOnly)", k)
		}
		got, loc, err := b.Get(m)
		if err != nil || loc != Shared || !bytes.Equal(got, payload(100, byte(k))) {
			t.Fatalf("B's get of chunk %d: %v %q", k, err, loc)
		}
	}
	// Another prefix: not found, and a plain miss.
	if _, _, err := b.Get(meta(0, 16, 900)); Reason(err) != MissAbsent {
		t.Fatalf("absent entry: %v", err)
	}
	if st := a.Stats(); st.Level(Shared).Writes != 4 || st.Dropped != 0 {
		t.Fatalf("A's stats: %d shared writes (3 chunks, [32, 36)), %d dropped", st.Level(Shared).Writes, st.Dropped)
	}
}

// TestSharedConcurrentWriters: replicas writing the same content-addressed entry at
// once, while others read it, need no lock: every read is the whole entry or a miss,
// never part of one, and one file remains with no temporary file left behind.
func TestSharedConcurrentWriters(t *testing.T) {
	st, dir := sharedStores(t, 6, 1<<30)
	m := meta(0, 64, 3)
	want := payload(1<<20, 0x5a)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var bad []string
	for i, s := range st {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := range 20 {
				if i%2 == 0 {
					s.PutSegment(KindCached, m, bytes.Clone(want))
					s.Flush()
					continue
				}
				got, _, err := s.Get(m)
				if err == nil && !bytes.Equal(got, want) {
					mu.Lock()
					bad = append(bad, fmt.Sprintf("reader %d round %d: %d bytes that are not the entry", i, round, len(got)))
					mu.Unlock()
				}
				if err != nil && Reason(err) != MissAbsent {
					mu.Lock()
					bad = append(bad, fmt.Sprintf("reader %d round %d: %v", i, round, err))
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if len(bad) > 0 {
		t.Fatal(bad)
	}
	if n := len(kvFiles(t, dir)); n != 1 {
		t.Fatalf("%d entry files, want 1", n)
	}
	if tmps, _ := filepath.Glob(filepath.Join(dir, ".tmp-*")); len(tmps) != 0 {
		t.Fatalf("temporary files left: %v", tmps)
	}
	if got, loc, err := st[1].Get(m); err != nil || loc != Shared || !bytes.Equal(got, want) {
		t.Fatalf("after the writers: %v %q", err, loc)
	}
}

// TestSharedDamagedIsMiss: a shared file that is corrupt, cut short, another model's
// (whatever its name) or removed under the reader is a miss with its reason, never an
// error or a wrong payload; a damaged file is removed (it would never verify).
func TestSharedDamagedIsMiss(t *testing.T) {
	st, dir := sharedStores(t, 2, 1<<20)
	a, b := st[0], st[1]
	cases := []struct {
		name, reason string
		damage       func(path string)
	}{
		{"flipped byte", MissCorrupt, func(p string) {
			raw, _ := os.ReadFile(p)
			raw[len(raw)/2] ^= 0xff
			_ = os.WriteFile(p, raw, 0o644)
		}},
		{"truncated", MissTruncated, func(p string) {
			raw, _ := os.ReadFile(p)
			_ = os.WriteFile(p, raw[:len(raw)/3], 0o644)
		}},
		{"foreign model", MissForeign, func(p string) {
			m, pl, _ := DecodeFile(mustRead(p), "model-a")
			_ = os.WriteFile(p, EncodeFile("model-b", m, pl), 0o644)
		}},
		{"another prefix under this name", MissForeign, func(p string) {
			_, pl, _ := DecodeFile(mustRead(p), "model-a")
			_ = os.WriteFile(p, EncodeFile("model-a", meta(0, 10, 999), pl), 0o644)
		}},
		{"vanished", MissAbsent, func(p string) { _ = os.Remove(p) }},
	}
	for i, c := range cases {
		m := meta(0, 10, int32(100*(i+1)))
		a.PutSegment(KindCached, m, payload(200, byte(i)))
		a.Flush()
		p := filepath.Join(dir, MakeKey("model-a", m.D, m.Tokens).String()+".kv")
		if !b.Has(m) {
			t.Fatalf("%s: B does not see A's entry", c.name)
		}
		c.damage(p)
		got, _, err := b.Get(m)
		if err == nil || Reason(err) != c.reason {
			t.Fatalf("%s: got %d bytes, err %v; want a %s miss", c.name, len(got), err, c.reason)
		}
		if _, err := os.Stat(p); err == nil {
			t.Fatalf("%s: the damaged file is still there", c.name)
		}
		if b.Has(m) {
			t.Fatalf("%s: still listed after the miss", c.name)
		}
	}
}

func mustRead(p string) []byte {
	b, err := os.ReadFile(p)
	if err != nil {
		panic(err)
	}
	return b
}

// TestSharedLRUAcrossReplicas: the directory's budget holds across replicas, least
// recently used first out, whoever wrote or read an entry: a read by one replica keeps
// an entry another wrote.
func TestSharedLRUAcrossReplicas(t *testing.T) {
	probe := len(EncodeFile("model-a", meta(0, 10, 0), payload(1000, 0)))
	st, dir := sharedStores(t, 2, int64(3*probe)) // three entries fit, not four
	a, b := st[0], st[1]
	ms := []Meta{meta(0, 10, 100), meta(0, 10, 200), meta(0, 10, 300), meta(0, 10, 400)}
	put := func(s *Store, i int) {
		s.PutSegment(KindCached, ms[i], payload(1000, byte(i)))
		s.Flush()
		time.Sleep(20 * time.Millisecond) // distinct modification times
	}
	put(a, 0)
	put(b, 1)
	put(a, 2)
	// B reads A's oldest entry: it is now the most recently used.
	if _, _, err := b.Get(ms[0]); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	put(b, 3) // over the budget: the least recently used (B's own ms[1]) goes
	if n := len(kvFiles(t, dir)); n != 3 {
		t.Fatalf("%d files, want 3 within the budget", n)
	}
	for i, want := range []bool{true, false, true, true} {
		if got := a.Has(ms[i]); got != want {
			t.Fatalf("entry %d present %v, want %v", i, got, want)
		}
	}
	if st := b.Stats(); st.Level(Shared).Entries != 3 || st.Level(Shared).Bytes > int64(3*probe) {
		t.Fatalf("B's view: %d entries %d bytes", st.Level(Shared).Entries, st.Level(Shared).Bytes)
	}
}

type recorder struct{ events []string }

func (r *recorder) TierChanged(d int, tokens []int32, stored bool) {
	r.events = append(r.events, fmt.Sprintf("%v d=%d l=%d", stored, d, len(tokens)))
}

// TestObserverSeesLocalEntries (issue 44): the observer (the KV-event publisher) hears
// of an entry once when it lands in RAM or on disk, not when it moves between them, and
// once when it has left both (superseded, dropped by LRU); the shared level is not
// reported.
func TestObserverSeesLocalEntries(t *testing.T) {
	s := open(t, Config{RAMBytes: 250, Dir: t.TempDir(), DiskBytes: 250, SharedDir: t.TempDir(), SharedBytes: 1 << 20})
	r := &recorder{}
	s.SetObserver(r)
	for i := range 3 { // the third moves the first to disk
		s.PutSegment(KindCached, meta(0, 10+i, int32(100*i)), payload(100, byte(i)))
	}
	s.Flush()
	s.PutSegment(KindCached, meta(0, 20, 900), payload(200, 9)) // disk full: the oldest go
	s.Flush()
	s.Drop(meta(0, 12, 200))
	want := []string{"true d=0 l=10", "true d=0 l=11", "true d=0 l=12", "true d=0 l=20"}
	if len(r.events) < len(want) || !slices.Equal(r.events[:4], want) {
		t.Fatalf("events %v, want %v first", r.events, want)
	}
	gone := map[string]bool{}
	for _, e := range r.events[4:] {
		gone[e] = true
	}
	if !gone["false d=0 l=12"] || !gone["false d=0 l=10"] || len(r.events) != 4+len(gone) {
		t.Fatalf("removals %v, want the dropped entry and the disk's evicted LRU one, each once", r.events[4:])
	}
	for _, m := range []Meta{meta(0, 10, 0), meta(0, 12, 200)} {
		if !s.Has(m) {
			t.Fatalf("%+v: still on the shared level", m)
		}
	}
}

// lockedRecorder is a recorder safe for the store's announcing goroutine.
type lockedRecorder struct {
	mu sync.Mutex
	recorder
}

func (r *lockedRecorder) TierChanged(d int, tokens []int32, stored bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recorder.TierChanged(d, tokens, stored)
}

func (r *lockedRecorder) snapshot() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// TestObserverHearsEntriesFoundAtOpen (issue 44): a restarted replica announces what
// its --pool-dir held before the restart, without waiting for each entry to be stored
// again; a file of another model, a torn one and one not named by its own key are not
// announced.
func TestObserverHearsEntriesFoundAtOpen(t *testing.T) {
	dir := t.TempDir()
	s := open(t, Config{RAMBytes: 250, Dir: dir, DiskBytes: 1 << 20})
	for i := range 4 { // the first two are pushed to disk
		s.PutSegment(KindCached, meta(0, 10+i, int32(100*i)), payload(100, byte(i)))
	}
	s.Close()
	// Damaged and foreign files beside them.
	good, err := os.ReadFile(filepath.Join(dir, MakeKey("model-a", 0, meta(0, 10, 0).Tokens).String()+".kv"))
	if err != nil {
		t.Fatal(err)
	}
	misnamed := MakeKey("model-a", 0, meta(0, 30, 7).Tokens).String() + ".kv"
	torn := MakeKey("model-a", 0, meta(0, 31, 7).Tokens).String() + ".kv"
	foreign := MakeKey("model-a", 0, meta(0, 32, 7).Tokens).String() + ".kv"
	for name, b := range map[string][]byte{misnamed: good, torn: good[:10], foreign: encode("model-b", meta(0, 32, 7), payload(100, 1))} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	s2 := open(t, Config{RAMBytes: 250, Dir: dir, DiskBytes: 1 << 20})
	r := &lockedRecorder{}
	s2.SetObserver(r)
	deadline := time.Now().Add(10 * time.Second)
	for len(r.snapshot()) < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	s2.Close() // waits for the announcing goroutine
	got := r.snapshot()
	slices.Sort(got)
	if want := []string{"true d=0 l=10", "true d=0 l=11"}; !slices.Equal(got, want) {
		t.Fatalf("announced %v, want %v", got, want)
	}
}

// TestSharedEndsMarkers: the lengths listed per chunk start (ends/<StartKey>/<length>)
// find a partial chunk; one whose entry is gone is a plain "no" (the lookup stops at
// the whole chunks); and the markers of entries the directory's budget pushed out go
// with them when it is trimmed.
func TestSharedEndsMarkers(t *testing.T) {
	st, dir := sharedStores(t, 2, 1<<20)
	a, b := st[0], st[1]
	prompt := meta(0, 40, 7).Tokens
	for k := 0; k < 40; k += 16 {
		a.PutSegment(KindCached, Meta{D: k, Tokens: prompt[:min(k+16, 40)]}, payload(100, byte(k)))
	}
	a.Flush()
	marker := filepath.Join(dir, endsDir, StartKey("model-a", 32, prompt[:32]).String(), "40-"+MakeKey("model-a", 32, prompt).String())
	if _, err := os.Stat(marker); err != nil {
		t.Fatalf("no marker for [32, 40): %v", err)
	}
	next := append(prompt[:40:40], 1, 2, 3)
	if run := b.Run(next, 16); len(run) != 3 {
		t.Fatalf("run with the marker: %d segments, want 3", len(run))
	}
	if err := os.Remove(filepath.Join(dir, MakeKey("model-a", 32, prompt).String()+".kv")); err != nil {
		t.Fatal(err)
	}
	if run := b.Run(next, 16); len(run) != 2 {
		t.Fatalf("run after the entry went (its marker stays): %d segments, want 2", len(run))
	}

	// Trimming: a small budget (two entries); the third entry pushes the oldest out, and
	// its marker folder goes with it, while the others' stay.
	st, dir = sharedStores(t, 1, 1000)
	c := st[0]
	var folders []string
	for i := range 3 {
		m := Meta{D: 16, Tokens: meta(0, 20, int32(1000+100*i)).Tokens}
		c.PutSegment(KindCached, m, payload(300, byte(i)))
		c.Flush()
		folders = append(folders, filepath.Join(dir, endsDir, StartKey("model-a", 16, m.Tokens[:16]).String()))
		if i == 0 {
			past := time.Now().Add(-time.Hour) // the oldest, beyond doubt
			if err := os.Chtimes(kvFiles(t, dir)[0], past, past); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := len(kvFiles(t, dir)); n != 2 {
		t.Fatalf("%d entries within the budget, want 2", n)
	}
	if _, err := os.Stat(folders[0]); !os.IsNotExist(err) {
		t.Fatalf("the trimmed entry's marker folder: %v, want it gone", err)
	}
	for _, f := range folders[1:] {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("a kept entry's marker folder: %v", err)
		}
	}
}

// TestSharedCommonPart: where no stored entry is a prefix of the prompt, the one from
// the same chunk start that shares the most tokens with it (at least minCommonPart) is
// found under its own name: a teammate's chunk holding the end of the system prompt
// both share, then its own question. Fewer shared tokens than that: not found.
func TestSharedCommonPart(t *testing.T) {
	st, _ := sharedStores(t, 2, 1<<20)
	a, b := st[0], st[1]
	mate := meta(0, 128, 7).Tokens // the team's prompt to 100, then the teammate's question
	for k := 0; k < 128; k += 64 {
		a.PutSegment(KindCached, Meta{D: k, Tokens: mate[:k+64]}, payload(100, byte(k)))
	}
	a.Flush()
	mine := append(slices.Clone(mate[:100]), 900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 911, 912, 913, 914, 915, 916, 917, 918, 919, 920, 921, 922, 923, 924, 925, 926, 927, 928)
	run := b.Run(mine, 64)
	if len(run) != 2 || run[1].D != 64 || !slices.Equal(run[1].Tokens, mate) {
		t.Fatalf("run: %+v, want [0, 64) and the teammate's [64, 128) under its own name", run)
	}
	if _, _, err := b.Get(run[1]); err != nil {
		t.Fatalf("the entry found by its common part does not load: %v", err)
	}
	few := append(slices.Clone(mate[:70]), 900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 911, 912, 913, 914, 915, 916, 917, 918, 919, 920, 921, 922, 923, 924, 925, 926, 927, 928, 929, 930, 931, 932, 933, 934, 935, 936, 937, 938, 939, 940, 941, 942, 943, 944, 945, 946, 947)
	if run := b.Run(few, 64); len(run) != 1 {
		t.Fatalf("run sharing 6 tokens past the start: %d segments, want 1", len(run))
	}
}
