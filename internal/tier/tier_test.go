package tier

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/testmodel"
)

func meta(d, n int, seed int32) Meta {
	m := Meta{D: d}
	for i := range n {
		m.Tokens = append(m.Tokens, seed+int32(i))
	}
	return m
}

func payload(n int, b byte) []byte { return bytes.Repeat([]byte{b}, n) }

func open(t *testing.T, cfg Config) *Store {
	t.Helper()
	if cfg.Model == "" {
		cfg.Model = "model-a"
	}
	s, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func TestRAMThenDiskLRU(t *testing.T) {
	dir := t.TempDir()
	s := open(t, Config{RAMBytes: 250, Dir: dir, DiskBytes: 1 << 20})
	for i := range 3 {
		if loc := s.Put(i+1, meta(0, 10, int32(i*100)), payload(100, byte(i))); loc != RAM {
			t.Fatalf("entry %d went to %q, want ram", i, loc)
		}
	}
	// 300 bytes > 250: the least recently used (entry 0) was demoted to disk.
	s.Flush()
	if loc, _ := s.Where(1); loc != Disk {
		t.Fatalf("LRU entry is in %q, want disk", loc)
	}
	if loc, n := s.Where(3); loc != RAM || n != 100 {
		t.Fatalf("newest entry: %q %d", loc, n)
	}
	got, loc, err := s.Get(meta(0, 10, 0))
	if err != nil || loc != Disk || !bytes.Equal(got, payload(100, 0)) {
		t.Fatalf("disk get: %v %q %v", err, loc, got[:4])
	}
	if _, _, err := s.Get(meta(0, 10, 999)); Reason(err) != MissAbsent {
		t.Fatalf("absent key: %v", err)
	}
	// Another branch position is another key, never the stored bytes.
	if _, _, err := s.Get(meta(1, 10, 0)); Reason(err) != MissAbsent {
		t.Fatalf("other d: %v", err)
	}
	st := s.Stats()
	if st.Level(RAM).Entries != 2 || st.Level(Disk).Entries != 1 || st.Spills != 3 {
		t.Fatalf("stats %+v", st)
	}
}

func TestNoRAMNoDiskDrops(t *testing.T) {
	s := open(t, Config{RAMBytes: 50})
	if loc := s.Put(1, meta(0, 4, 1), payload(100, 1)); loc != None {
		t.Fatalf("too large for RAM without disk: %q", loc)
	}
	if st := s.Stats(); st.Dropped != 1 {
		t.Fatalf("dropped %d", st.Dropped)
	}
}

// writeOne puts one entry on disk and returns the store's directory and the entry's path.
func writeOne(t *testing.T, m Meta, p []byte) (string, string) {
	dir := t.TempDir()
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	if loc := s.Put(1, m, p); loc != Disk {
		t.Fatalf("put: %q", loc)
	}
	s.Close()
	return dir, filepath.Join(dir, MakeKey("model-a", m.D, m.Tokens).String()+".kv")
}

func TestDiskFaultsAreMisses(t *testing.T) {
	m, p := meta(0, 32, 7), payload(4096, 0xab)
	for _, c := range []struct {
		name, model, reason string
		damage              func(path string)
	}{
		{"intact", "model-a", "", func(string) {}},
		{"truncated", "model-a", MissTruncated, func(path string) {
			b, _ := os.ReadFile(path)
			_ = os.WriteFile(path, b[:len(b)/2], 0o644)
		}},
		{"flipped byte", "model-a", MissCorrupt, func(path string) {
			b, _ := os.ReadFile(path)
			b[len(b)-100] ^= 0x10
			_ = os.WriteFile(path, b, 0o644)
		}},
		{"flipped header byte", "model-a", MissCorrupt, func(path string) {
			b, _ := os.ReadFile(path)
			b[2] ^= 0x01
			_ = os.WriteFile(path, b, 0o644)
		}},
		{"another model", "model-b", MissForeign, func(path string) {
			// model-b's name for the same prefix, holding model-a's bytes.
			_ = os.Rename(path, filepath.Join(filepath.Dir(path), MakeKey("model-b", m.D, m.Tokens).String()+".kv"))
		}},
		{"removed", "model-a", MissAbsent, func(path string) { _ = os.Remove(path) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir, path := writeOne(t, m, p)
			c.damage(path)
			s := open(t, Config{Model: c.model, Dir: dir, DiskBytes: 1 << 20})
			got, _, err := s.Get(m)
			if c.reason == "" {
				if err != nil || !bytes.Equal(got, p) {
					t.Fatalf("intact entry: %v", err)
				}
				return
			}
			if err == nil || Reason(err) != c.reason {
				t.Fatalf("got %v (reason %q), want a %q miss", err, Reason(err), c.reason)
			}
			// A file that does not verify is forgotten: the next lookup is absent.
			if _, _, err := s.Get(m); Reason(err) != MissAbsent {
				t.Fatalf("second lookup: %v", err)
			}
		})
	}
}

// An entry renamed to another key's name (a wrong file in the directory) holds another
// prefix: it is foreign, never returned for the key it sits under.
func TestRenamedEntryIsForeign(t *testing.T) {
	m := meta(0, 8, 1)
	dir, path := writeOne(t, m, payload(64, 1))
	other := meta(0, 8, 2)
	if err := os.Rename(path, filepath.Join(dir, MakeKey("model-a", 0, other.Tokens).String()+".kv")); err != nil {
		t.Fatal(err)
	}
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	if _, _, err := s.Get(other); Reason(err) != MissForeign {
		t.Fatalf("renamed entry: %v", err)
	}
}

func TestDiskBudgetLRU(t *testing.T) {
	dir := t.TempDir()
	s := open(t, Config{Dir: dir, DiskBytes: 2500})
	for i := range 3 {
		s.Put(i+1, meta(0, 4, int32(10*i)), payload(1000, byte(i)))
		s.Flush()
	}
	if loc, _ := s.Where(1); loc != None {
		t.Fatalf("oldest entry still on disk: %q", loc)
	}
	if st := s.Stats(); st.Level(Disk).Entries != 2 || st.Level(Disk).Bytes > 2500 {
		t.Fatalf("disk %d entries %d bytes", st.Level(Disk).Entries, st.Level(Disk).Bytes)
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.kv"))
	if len(files) != 2 {
		t.Fatalf("%d files on disk, want 2", len(files))
	}
}

// rec is the record of a pool holding m (parent 0: a root).
func rec(id, parent int, m Meta) Record {
	return Record{ID: id, Parent: parent, D: m.D, Tokens: m.Tokens, Pin: true, PrefixHash: fmt.Sprintf("h%d", id)}
}

func TestRecordSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	floor := s.IDFloor()
	root, child := meta(0, 20, 1), meta(12, 30, 1)
	child.Tokens = append(slices.Clone(root.Tokens[:12]), child.Tokens[12:]...)
	r1, r2 := rec(floor+1, 0, root), rec(floor+2, floor+1, child)
	r2.Admission = []byte(`{"TargetTPS":5}`)
	if !s.Record(r1, payload(300, 1)) || !s.Record(r2, payload(200, 2)) {
		t.Fatal("record refused")
	}
	s.Close()

	s2 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	got := s2.Recovered()
	if len(got) != 2 || !got[0].equal(r1) || !got[1].equal(r2) || !got[0].InTier || !got[1].InTier || len(s2.Lost()) != 0 {
		t.Fatalf("recovered %+v lost %+v", got, s2.Lost())
	}
	if s2.IDFloor() < floor+2 {
		t.Fatalf("id floor %d after ids up to %d were used", s2.IDFloor(), floor+2)
	}
	b, loc, err := s2.Get(child)
	if err != nil || loc != Disk || !bytes.Equal(b, payload(200, 2)) {
		t.Fatalf("recovered child's entry: %v %q", err, loc)
	}
	// Unrecorded: gone after the next restart (its record file too); its parent stays.
	s2.Forget(floor + 2)
	s2.Close()
	if _, err := os.Stat(filepath.Join(dir, recordName(floor+2))); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a forgotten pool's record is still there: %v", err)
	}
	s3 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	if got := s3.Recovered(); len(got) != 1 || got[0].ID != floor+1 {
		t.Fatalf("after forget: %+v", got)
	}
	s3.Close()
	// Another model: nothing is recovered, the pool is reported lost, and the ids still
	// move up.
	s4 := open(t, Config{Model: "model-b", Dir: dir, DiskBytes: 1 << 20})
	if len(s4.Recovered()) != 0 || s4.IDFloor() <= s3.IDFloor() {
		t.Fatalf("foreign manifest: recovered %d, floor %d after %d", len(s4.Recovered()), s4.IDFloor(), s3.IDFloor())
	}
	if lost := s4.Lost(); len(lost) != 1 || lost[0].ID != floor+1 || lost[0].Reason != MissForeign {
		t.Fatalf("foreign manifest: lost %+v", lost)
	}
}

// damage breaks a file as a bad disk would: a flipped byte, cut to a third, or removed.
func damage(t *testing.T, path, how string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	switch how {
	case "flip":
		b[len(b)/2] ^= 0x10
	case "truncate":
		b = b[:len(b)/3]
	case "delete":
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		return
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestDamagedEntriesKeepTheirPools (issue 45): a recorded pool's KV entry flipped, cut
// short or removed costs its KV, never the pool: its record still verifies, so it is
// recovered (not in the tier: the server prefills it), each damage is a counted miss,
// nothing is lost, and recording it again writes the entry back.
func TestDamagedEntriesKeepTheirPools(t *testing.T) {
	dir := t.TempDir()
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	root, child, other := meta(0, 20, 1), meta(20, 30, 1), meta(0, 25, 100)
	recs := []Record{rec(1, 0, root), rec(2, 1, child), rec(3, 0, other)}
	for i, r := range recs {
		s.Record(r, payload(100*(i+1), byte(i)))
	}
	s.Close()
	for i, how := range []string{"flip", "truncate", "delete"} {
		damage(t, filepath.Join(dir, MakeKey("model-a", recs[i].D, recs[i].Tokens).String()+".kv"), how)
	}
	s2 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	got := s2.Recovered()
	if len(got) != 3 || len(s2.Lost()) != 0 {
		t.Fatalf("recovered %+v, lost %+v: want all three pools", got, s2.Lost())
	}
	for i, r := range got {
		if !r.equal(recs[i]) || r.InTier {
			t.Fatalf("pool %d: %+v, want %+v not in the tier", recs[i].ID, r, recs[i])
		}
	}
	if st := s2.Stats(); st.Misses[MissCorrupt] != 1 || st.Misses[MissTruncated] != 1 || st.Misses[MissAbsent] != 1 || st.Level(Disk).Entries != 0 {
		t.Fatalf("misses %v, %d entries left", st.Misses, st.Level(Disk).Entries)
	}
	// The server prefills them and records them again: the entries are back.
	for i, r := range got {
		if !s2.Recorded(r.ID) || !s2.Record(r.Record, payload(100*(i+1), byte(i))) {
			t.Fatalf("pool %d: not recorded", r.ID)
		}
	}
	s2.Close()
	s3 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	for _, r := range s3.Recovered() {
		if !r.InTier {
			t.Fatalf("pool %d's entry was not written again", r.ID)
		}
	}
}

// TestDamagedRecordIsLost (issue 45): a record flipped, cut short or removed is reported
// lost by id with its reason, never skipped in silence; the damaged file is moved aside
// (reported once); the child of a lost pool is still recovered (its record holds all
// its tokens); a record pools.json does not list (a Record or Forget cut short) is
// removed.
func TestDamagedRecordIsLost(t *testing.T) {
	dir := t.TempDir()
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	a, b, c := meta(0, 20, 1), meta(0, 20, 50), meta(0, 20, 90)
	child := meta(20, 30, 1)
	for _, r := range []Record{rec(1, 0, a), rec(2, 0, b), rec(3, 0, c), rec(4, 1, child)} {
		s.Record(r, payload(100, 1))
	}
	s.Close()
	orphan := rec(99, 0, meta(0, 5, 7))
	if err := os.WriteFile(filepath.Join(dir, recordName(99)), encodeRecord("model-a", orphan), 0o644); err != nil {
		t.Fatal(err)
	}
	for i, how := range []string{"flip", "truncate", "delete"} {
		damage(t, filepath.Join(dir, recordName(i+1)), how)
	}
	s2 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	want := []Lost{{ID: 1, Reason: MissCorrupt}, {ID: 2, Reason: MissTruncated}, {ID: 3, Reason: MissAbsent}}
	lost := s2.Lost()
	if len(lost) != len(want) {
		t.Fatalf("lost %+v, want %+v", lost, want)
	}
	for i, l := range lost {
		if l.ID != want[i].ID || l.Reason != want[i].Reason || l.Err == "" {
			t.Fatalf("lost %+v, want %+v", lost, want)
		}
	}
	if got := s2.Recovered(); len(got) != 1 || got[0].ID != 4 || got[0].Parent != 1 || !got[0].InTier {
		t.Fatalf("recovered %+v, want the child 4", got)
	}
	for _, name := range []string{recordName(1) + damagedExt, recordName(2) + damagedExt} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Fatalf("damaged record not moved aside: %v", err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, recordName(99))); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("unlisted record left: %v", err)
	}
	s2.Close()
	s3 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	if got := s3.Recovered(); len(s3.Lost()) != 0 || len(got) != 1 || got[0].ID != 4 {
		t.Fatalf("second restart: recovered %+v lost %+v", got, s3.Lost())
	}
}

// TestDamagedManifestKeepsRecords: pools.json flipped or removed costs the listing, not
// the pools: every record found is recovered and new ids stay above theirs.
func TestDamagedManifestKeepsRecords(t *testing.T) {
	for _, how := range []string{"flip", "delete"} {
		t.Run(how, func(t *testing.T) {
			dir := t.TempDir()
			s := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
			id := s.IDFloor() + 7
			s.Record(rec(id, 0, meta(0, 20, 1)), payload(100, 1))
			s.Close()
			path := filepath.Join(dir, manifestName)
			if how == "flip" {
				// A digit of the recorded id: without the checksum it would name another pool.
				b, _ := os.ReadFile(path)
				i := bytes.Index(b, []byte(`"recorded"`))
				i += bytes.Index(b[i:], []byte(fmt.Sprint(id))) + len(fmt.Sprint(id)) - 1
				b[i] ^= 0x01
				_ = os.WriteFile(path, b, 0o644)
			} else {
				damage(t, path, how)
			}
			s2 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
			if got := s2.Recovered(); len(got) != 1 || got[0].ID != id || !got[0].InTier || len(s2.Lost()) != 0 {
				t.Fatalf("recovered %+v lost %+v", got, s2.Lost())
			}
			if s2.IDFloor() < id {
				t.Fatalf("id floor %d below a recorded id %d", s2.IDFloor(), id)
			}
		})
	}
}

// TestManifestV0IsTakenOver: a pools.json written before records were kept apart
// (version 0: each pool with its entry's key, the tokens only in the entry) is read as
// that version read it, and its pools' records are written: the next start reads them
// as version 2. A pool whose entry does not verify is reported lost (its tokens are
// gone with it); its child is still recovered.
func TestManifestV0IsTakenOver(t *testing.T) {
	dir := t.TempDir()
	root, child, other := meta(0, 20, 1), meta(20, 30, 1), meta(0, 10, 70)
	m := manifest{Model: "model-a", IDFloor: 3 << 20}
	for i, x := range []struct {
		id, parent int
		m          Meta
	}{{1, 0, root}, {2, 1, child}, {3, 0, other}} {
		k := MakeKey("model-a", x.m.D, x.m.Tokens)
		b := encode("model-a", x.m, payload(100, byte(i)))
		if x.id == 3 {
			b[len(b)/2] ^= 0x10
		}
		if err := os.WriteFile(filepath.Join(dir, k.String()+".kv"), b, 0o644); err != nil {
			t.Fatal(err)
		}
		m.Pools = append(m.Pools, recordV0{ID: x.id, Parent: x.parent, D: x.m.D, Key: k.String()})
	}
	b, _ := json.Marshal(m) // version 0, as that version wrote it
	if err := os.WriteFile(filepath.Join(dir, manifestName), b, 0o644); err != nil {
		t.Fatal(err)
	}
	check := func(s *Store) {
		t.Helper()
		got := s.Recovered()
		if len(got) != 2 || got[0].ID != 1 || !slices.Equal(got[0].Tokens, root.Tokens) || got[1].ID != 2 || got[1].Parent != 1 ||
			got[1].D != 20 || !slices.Equal(got[1].Tokens, child.Tokens) || !got[0].InTier || !got[1].InTier || s.IDFloor() < 3<<20 {
			t.Fatalf("recovered %+v, floor %d", got, s.IDFloor())
		}
	}
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	check(s)
	if lost := s.Lost(); len(lost) != 1 || lost[0].ID != 3 || lost[0].Reason != MissCorrupt {
		t.Fatalf("lost %+v", lost)
	}
	s.Close()
	b, _ = os.ReadFile(filepath.Join(dir, manifestName))
	if mm, err := decodeManifest(b); err != nil || mm.Version != manifestVersion || !slices.Equal(mm.Recorded, []int{1, 2}) {
		t.Fatalf("pools.json after the take-over: %+v %v", mm, err)
	}
	s2 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	check(s2)
	if len(s2.Lost()) != 0 {
		t.Fatalf("lost again: %+v", s2.Lost())
	}
}

// TestRecordUpdates: recording a pool again with another admission policy rewrites its
// record; recording it as a root (its parent's record lost) lets LRU drop its old entry.
func TestRecordUpdates(t *testing.T) {
	dir := t.TempDir()
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	child := meta(20, 30, 1)
	r := rec(2, 1, child)
	s.Record(r, payload(100, 1))
	r.Admission = []byte(`{"TargetTPS":9}`)
	s.Record(r, nil)
	rooted := Record{ID: 2, Tokens: child.Tokens, Pin: true}
	s.Record(rooted, payload(300, 2))
	s.mu.Lock()
	oldKept, newKept := s.kept[MakeKey("model-a", 20, child.Tokens)], s.kept[MakeKey("model-a", 0, child.Tokens)]
	s.mu.Unlock()
	if oldKept || !newKept {
		t.Fatalf("entries kept: old %v, new %v", oldKept, newKept)
	}
	s.Close()
	b, _ := os.ReadFile(filepath.Join(dir, manifestName))
	if m, err := decodeManifest(b); err != nil || !slices.Equal(m.Recorded, []int{2}) {
		t.Fatalf("pools.json: %+v %v", m, err)
	}
	s2 := open(t, Config{Dir: dir, DiskBytes: 1 << 20})
	if got := s2.Recovered(); len(got) != 1 || !got[0].equal(rooted) || !got[0].InTier {
		t.Fatalf("recovered %+v", got)
	}
}

// TestKill9DuringWrites kills a process that is writing entries at a random instant:
// every entry left under its name verifies with exactly the bytes written, temporary
// files are cleaned up, and nothing half-written is ever returned.
func TestKill9DuringWrites(t *testing.T) {
	if os.Getenv("POLYKV_TIER_WRITER") != "" {
		return
	}
	dir := t.TempDir()
	for round := range 3 {
		cmd := exec.Command(os.Args[0], "-test.run=^TestKill9Writer$")
		cmd.Env = append(os.Environ(), "POLYKV_TIER_WRITER="+dir)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(150+100*round) * time.Millisecond)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		s := open(t, Config{Dir: dir, DiskBytes: 1 << 30})
		ok := 0
		for i := range 10000 {
			m := meta(0, 16, int32(i))
			got, _, err := s.Get(m)
			if err != nil {
				if Reason(err) != MissAbsent {
					t.Fatalf("entry %d: %v (a rename is atomic: a named file is whole)", i, err)
				}
				continue
			}
			if !bytes.Equal(got, payload(64<<10, byte(i))) {
				t.Fatalf("entry %d returned other bytes", i)
			}
			ok++
		}
		tmps, _ := filepath.Glob(filepath.Join(dir, ".tmp-*"))
		if ok == 0 || len(tmps) != 0 {
			t.Fatalf("round %d: %d entries verified, %d temporary files left (writer output: %s)", round, ok, len(tmps), out.String())
		}
		s.Close()
	}
}

// TestKill9Writer is the process TestKill9DuringWrites kills: it writes entries until
// it dies.
func TestKill9Writer(t *testing.T) {
	dir := os.Getenv("POLYKV_TIER_WRITER")
	if dir == "" {
		t.Skip("helper process of TestKill9DuringWrites")
	}
	s, err := Open(Config{Model: "model-a", Dir: dir, DiskBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10000 {
		s.Put(i+1, meta(0, 16, int32(i)), payload(64<<10, byte(i)))
		s.Flush()
	}
}

func TestMissErrorReason(t *testing.T) {
	err := fmt.Errorf("wrapped: %w", miss(MissCorrupt, "x"))
	if Reason(err) != MissCorrupt || Reason(errors.New("other")) != MissIO || !strings.Contains(err.Error(), "corrupt") {
		t.Fatalf("reason: %v", err)
	}
}

// inTmpfs runs body on a tmpfs of size mounted at a fresh directory (readOnly: mounted
// read-only). Mounting needs no privilege: the test binary runs the test again in a child
// process with a user and a mount namespace of its own (the current user mapped to root
// there), where an unprivileged user may mount a tmpfs; the mount is the child's alone
// and goes with it. Where the kernel refuses user namespaces, root mounts it here
// instead; anyone else skips, or fails under make test (POLYKV_REQUIRE_MODEL).
func inTmpfs(t *testing.T, size string, readOnly bool, body func(t *testing.T, dir string)) {
	var flags uintptr
	if readOnly {
		flags = syscall.MS_RDONLY
	}
	if dir := os.Getenv("POLYKV_TIER_TMPFS"); dir != "" { // the child
		if err := syscall.Mount("tmpfs", dir, "tmpfs", flags, "size="+size); err != nil {
			t.Fatalf("mount a tmpfs in a user namespace: %v", err)
		}
		body(t, dir)
		return
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), "POLYKV_TIER_TMPFS="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}}}
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err == nil && bytes.Contains(out, []byte("--- PASS: "+t.Name())):
		return
	case err == nil || errors.As(err, &exit):
		t.Fatalf("in a tmpfs of %s (child process): %v\n%s", size, err, out)
	case os.Getuid() == 0:
		t.Logf("no user namespace (%v): mounting the tmpfs as root", err)
		if err := syscall.Mount("tmpfs", dir, "tmpfs", flags, "size="+size); err != nil {
			t.Fatalf("mount a tmpfs as root: %v", err)
		}
		t.Cleanup(func() { _ = syscall.Unmount(dir, 0) })
		body(t, dir)
	default:
		testmodel.SkipOrFail(t, fmt.Sprintf("cannot mount a tmpfs: no user namespace here (%v) and not root", err))
	}
}

// TestFullDisk: a disk that fills up is logged and counted; entries that did not fit
// are misses (never half entries), and the store keeps working.
func TestFullDisk(t *testing.T) {
	inTmpfs(t, "256k", false, testFullDisk)
}

func testFullDisk(t *testing.T, dir string) {
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 30}) // the budget allows it; the disk does not
	for i := range 6 {
		s.Put(i+1, meta(0, 8, int32(100*i)), payload(100<<10, byte(i)))
		s.Flush()
	}
	st := s.Stats()
	if st.DiskErrors == 0 || st.Level(Disk).Entries == 0 || st.Level(Disk).Entries == 6 {
		t.Fatalf("full disk: %d errors, %d entries on disk", st.DiskErrors, st.Level(Disk).Entries)
	}
	for i := range 6 {
		got, _, err := s.Get(meta(0, 8, int32(100*i)))
		switch {
		case err == nil && !bytes.Equal(got, payload(100<<10, byte(i))):
			t.Fatalf("entry %d: other bytes", i)
		case err != nil && Reason(err) != MissAbsent:
			t.Fatalf("entry %d: %v", i, err)
		}
	}
	if tmps, _ := filepath.Glob(filepath.Join(dir, ".tmp-*")); len(tmps) != 0 {
		t.Fatalf("temporary files left on the full disk: %v", tmps)
	}
}

// TestReadOnlyDir: a read-only directory is read, never written: spills stay in RAM
// (or are dropped and counted), and pools cannot be recorded.
func TestReadOnlyDir(t *testing.T) {
	inTmpfs(t, "1m", true, testReadOnlyDir)
}

func testReadOnlyDir(t *testing.T, dir string) {
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 20, RAMBytes: 100})
	if s.Durable() {
		t.Fatal("a read-only directory is durable")
	}
	if loc := s.Put(1, meta(0, 4, 1), payload(50, 1)); loc != RAM {
		t.Fatalf("small entry: %q", loc)
	}
	if loc := s.Put(2, meta(0, 4, 9), payload(500, 2)); loc != None {
		t.Fatalf("entry over RAM on a read-only disk: %q", loc)
	}
	if s.Record(rec(3, 0, meta(0, 4, 1)), payload(50, 1)) {
		t.Fatal("recorded a pool on a read-only directory")
	}
	if st := s.Stats(); st.DiskErrors == 0 || st.Dropped != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestKill9DuringReload kills processes that reopen a directory of recorded pools (a
// restart's reload, which writes the manifest's id floor) at random instants: the
// recorded pools always come back whole and the id floor never goes down.
func TestKill9DuringReload(t *testing.T) {
	if os.Getenv("POLYKV_TIER_RELOADER") != "" {
		return
	}
	dir := t.TempDir()
	s := open(t, Config{Dir: dir, DiskBytes: 1 << 30})
	root := meta(0, 64, 1)
	s.Record(rec(1, 0, root), payload(1<<20, 1))
	s.Record(rec(2, 1, meta(64, 80, 1)), payload(1<<19, 2))
	s.Close()
	floor := 0
	for round := range 4 {
		cmd := exec.Command(os.Args[0], "-test.run=^TestKill9Reloader$")
		cmd.Env = append(os.Environ(), "POLYKV_TIER_RELOADER="+dir)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(30+40*round) * time.Millisecond)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		s := open(t, Config{Dir: dir, DiskBytes: 1 << 30})
		rec := s.Recovered()
		if len(rec) != 2 || rec[1].Parent != 1 || len(rec[1].Tokens) != 80 || !rec[0].InTier || !rec[1].InTier || len(s.Lost()) != 0 || s.IDFloor() < floor {
			t.Fatalf("round %d: recovered %+v, lost %+v, floor %d after %d", round, rec, s.Lost(), s.IDFloor(), floor)
		}
		if got, _, err := s.Get(root); err != nil || !bytes.Equal(got, payload(1<<20, 1)) {
			t.Fatalf("round %d: root entry: %v", round, err)
		}
		floor = s.IDFloor()
		s.Close()
	}
}

// TestKill9Reloader is the process TestKill9DuringReload kills: it reloads until it dies.
func TestKill9Reloader(t *testing.T) {
	dir := os.Getenv("POLYKV_TIER_RELOADER")
	if dir == "" {
		t.Skip("helper process of TestKill9DuringReload")
	}
	for {
		s, err := Open(Config{Model: "model-a", Dir: dir, DiskBytes: 1 << 30})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range s.Recovered() {
			_, _, _ = s.Get(Meta{D: r.D, Tokens: r.Tokens})
		}
		s.Close()
	}
}
