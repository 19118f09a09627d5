package tier

import (
	"bytes"
	"strings"
	"sync"
	"testing"

	"github.com/alicebob/miniredis/v2"
)

// remoteStores starts a Redis server in the test (miniredis) and opens n stores
// (replicas) over it, each without RAM or a directory of its own, so every entry they
// hold is the remote level's.
func remoteStores(t *testing.T, n int) ([]*Store, *miniredis.Miniredis) {
	t.Helper()
	srv := miniredis.RunT(t)
	var out []*Store
	for range n {
		out = append(out, open(t, Config{Remote: "redis://" + srv.Addr() + "/0"}))
	}
	return out, srv
}

// TestRemoteOtherReplica: an entry one store (replica A) puts into the remote store is
// found and read by another (replica B, which never stored it) by Has, Run and Get,
// from the remote level; a prompt nobody stored is a plain miss.
func TestRemoteOtherReplica(t *testing.T) {
	st, srv := remoteStores(t, 2)
	a, b := st[0], st[1]
	prompt := meta(0, 40, 7).Tokens
	for k := 0; k < 40; k += 16 {
		m := Meta{D: k, Tokens: prompt[:min(k+16, 40)]}
		if loc := a.PutSegment(KindCached, m, payload(100, byte(k))); loc != Remote {
			t.Fatalf("chunk %d went to %q, want remote (no RAM, no --pool-dir)", k, loc)
		}
	}
	a.Flush()
	if keys := entryKeys(srv); len(keys) != 3 || !strings.HasPrefix(keys[0], remotePrefix) {
		t.Fatalf("keys in the remote store: %v, want A's 3 chunks under %q", keys, remotePrefix)
	}
	if run := b.Run(prompt, 16); len(run) != 3 {
		t.Fatalf("B's run of the prompt: %d chunks, want the 3 A stored", len(run))
	}
	// The next turn finds the partial last chunk too, asked in one pipelined round trip.
	if run := b.Run(append(prompt[:40:40], 1, 2, 3), 16); len(run) != 3 || len(run[2].Tokens) != 40 {
		t.Fatalf("B's run of a continuation: %+v, want the 2 chunks and [32, 40)", run)
	}
	for k := 0; k < 40; k += 16 {
		m := Meta{D: k, Tokens: prompt[:min(k+16, 40)]}
		if !b.OnDiskOnly(m) {
			t.Fatalf("chunk %d: B must read it off the engine goroutine (OnDiskOnly)", k)
		}
		got, loc, err := b.Get(m)
		if err != nil || loc != Remote || !bytes.Equal(got, payload(100, byte(k))) {
			t.Fatalf("B's get of chunk %d: %v %q", k, err, loc)
		}
	}
	if _, _, err := b.Get(meta(0, 16, 900)); Reason(err) != MissAbsent {
		t.Fatalf("absent entry: %v", err)
	}
	if st := a.Stats(); st.Level(Remote).Writes != 3 || st.Level(Remote).Bytes == 0 {
		t.Fatalf("A's stats: %d remote writes, %d bytes", st.Level(Remote).Writes, st.Level(Remote).Bytes)
	}
}

// TestRemoteDamagedIsMiss: a value in the remote store that does not verify — a flipped
// byte, cut short, another model's, another prefix's under the name — is a miss, never
// bytes, and is deleted; a store that stops answering is a miss too (a prefill), not an
// error that fails the request.
func TestRemoteDamagedIsMiss(t *testing.T) {
	m := Meta{D: 0, Tokens: meta(0, 32, 3).Tokens}
	other := Meta{D: 0, Tokens: meta(0, 32, 4).Tokens}
	cases := []struct {
		name   string
		damage func(v string) string
		reason string
	}{
		{"flipped byte", func(v string) string {
			b := []byte(v)
			b[len(b)-3] ^= 0x40
			return string(b)
		}, MissCorrupt},
		{"truncated", func(v string) string { return v[:len(v)/2] }, MissTruncated},
		{"foreign model", func(string) string {
			return string(encode("another model", m, payload(64, 1)))
		}, MissForeign},
		{"another prefix under the name", func(string) string {
			return string(encode("", other, payload(64, 1)))
		}, MissForeign},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			st, srv := remoteStores(t, 2)
			a, b := st[0], st[1]
			a.PutSegment(KindSession, m, payload(64, 1))
			a.Flush()
			keys := entryKeys(srv)
			if len(keys) != 1 {
				t.Fatalf("keys %v, want one", keys)
			}
			v, err := srv.Get(keys[0])
			if err != nil {
				t.Fatal(err)
			}
			if err := srv.Set(keys[0], c.damage(v)); err != nil {
				t.Fatal(err)
			}
			got, _, err := b.Get(m)
			if err == nil || got != nil {
				t.Fatalf("got %d bytes, err %v: a damaged value must be a miss", len(got), err)
			}
			if r := Reason(err); r != c.reason {
				t.Fatalf("reason %q, want %q (%v)", r, c.reason, err)
			}
			if srv.Exists(keys[0]) {
				t.Fatal("the damaged value is still in the store")
			}
		})
	}
	t.Run("store down", func(t *testing.T) {
		st, srv := remoteStores(t, 2)
		a, b := st[0], st[1]
		a.PutSegment(KindSession, m, payload(64, 1))
		a.Flush()
		srv.Close()
		if b.Has(m) {
			t.Fatal("Has must say no when the store does not answer")
		}
		if got, _, err := b.Get(m); err == nil || got != nil || Reason(err) != MissIO {
			t.Fatalf("got %d bytes, err %v (reason %q), want an io miss", len(got), err, Reason(err))
		}
	})
}

// TestRemoteConcurrentWriters: replicas writing and reading the same entry at once
// (SET NX: content-addressed, the first write wins and the rest find it) — every read
// is the whole entry or a miss, never a part, and the store holds it once.
func TestRemoteConcurrentWriters(t *testing.T) {
	st, srv := remoteStores(t, 6)
	m := Meta{D: 0, Tokens: meta(0, 64, 5).Tokens}
	want := payload(1<<20, 9)
	var wg sync.WaitGroup
	errs := make(chan string, 64)
	for i, s := range st {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				s.PutSegment(KindCached, m, want)
				s.Flush()
				return
			}
			for range 20 {
				got, _, err := s.Get(m)
				if err == nil && !bytes.Equal(got, want) {
					errs <- "a read returned other bytes than the entry's"
				}
				if err != nil && Reason(err) != MissAbsent {
					errs <- "a read failed other than absent: " + err.Error()
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	if keys := entryKeys(srv); len(keys) != 1 {
		t.Fatalf("keys %v, want the one entry once", keys)
	}
	writes := int64(0)
	for _, s := range st {
		_, n := s.shr.Usage()
		writes += int64(n)
	}
	if writes != 1 {
		t.Fatalf("%d replicas counted the entry as theirs, want exactly 1 (SET NX)", writes)
	}
}

// TestRemoteAndSharedDirRefused: the fleet has one level.
func TestRemoteAndSharedDirRefused(t *testing.T) {
	_, err := Open(Config{SharedDir: t.TempDir(), Remote: "redis://127.0.0.1:1/0"})
	if err == nil || !strings.Contains(err.Error(), "cannot both be set") {
		t.Fatalf("err %v", err)
	}
	if _, err := Open(Config{Remote: "redis://127.0.0.1:1/0"}); err == nil || !strings.Contains(err.Error(), "does not answer") {
		t.Fatalf("a store that does not answer at open: err %v", err)
	}
}

// entryKeys is the store's entries (not the lengths listed per chunk start).
func entryKeys(srv *miniredis.Miniredis) []string {
	var out []string
	for _, k := range srv.Keys() {
		if strings.HasPrefix(k, remotePrefix) {
			out = append(out, k)
		}
	}
	return out
}
