package tier

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The shared level (issue 44): a directory that several replicas mount (one host's
// directory for the replicas on that host, a network file system across hosts), below
// each replica's own RAM and --pool-dir. It is a second level, not --pool-dir itself:
// --pool-dir also holds one replica's pool records and manifest (pool ids are a
// replica's own), which two replicas must never share, while the shared level holds only
// content-addressed entries, which any replica serving the same model key can use.
//
// Entries are immutable files named by their Key (<key>.kv, the entry format of
// entry.go), so concurrent writers need no lock: each writes a temporary file, fsyncs it
// and renames it over the name; two replicas writing the same key write the same bytes,
// and a reader sees a whole old file, a whole new one or none. A reader checks the
// checksum, the model key, the branch position and every token before a byte is used;
// anything else is a miss (a damaged file is removed: it would never verify). The
// directory is bounded (--tier-shared-mb) with least-recently-used order across
// replicas kept in the files' modification times: a read touches its file, and a writer
// whose write takes the directory over the budget removes the oldest files. A file that
// another replica removes under a reader is a miss, never an error.

// Shared is the shared level's Location.
const Shared Location = "shared"

// staleTemp is how old a temporary file in the shared directory must be before a
// replica removes it as a write a crash cut short (younger ones may be another
// replica's write in progress).
const staleTemp = time.Hour

// SharedLocation is the fleet level's Location (Shared or Remote; None without one).
func (s *Store) SharedLocation() Location {
	if s.shr == nil {
		return None
	}
	return s.shr.Location()
}

type sharedLevel struct {
	dir    string
	model  string
	budget int64
	mu     sync.Mutex
	bytes  int64 // as of the last scan (Usage)
	n      int
}

var _ Level = (*sharedLevel)(nil)

func newSharedLevel(dir, model string, budget int64) (*sharedLevel, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	l := &sharedLevel{dir: dir, model: model, budget: budget}
	l.trim()
	return l, nil
}

func (l *sharedLevel) Location() Location { return Shared }

// Caps: the markers under ends/ list what is stored per chunk start (Ends, Starts),
// and a file's head is read on its own (Head).
func (l *sharedLevel) Caps() LevelCaps { return LevelCaps{Ends: l, Starts: l, Head: l} }

func (l *sharedLevel) path(k Key) string { return filepath.Join(l.dir, k.String()+".kv") }

func (l *sharedLevel) Has(k Key) bool {
	_, err := os.Stat(l.path(k))
	return err == nil
}

// Get reads k's file and checks it (want nil: the entry must hash to its name). A file
// that does not verify is removed; one that is gone is a miss.
func (l *sharedLevel) Get(k Key, want *Meta) ([]byte, error) {
	b, err := readEntryFile(l.path(k))
	if err != nil {
		return nil, err
	}
	payload, err := verifyNamed(b, l.model, k, want)
	if err != nil {
		_ = os.Remove(l.path(k))
		return nil, err
	}
	l.Touch(k)
	return payload, nil
}

// Put writes k's file unless it exists (content-addressed: the same name holds the
// same bytes, whoever wrote it; an existing file is only touched), then keeps the
// directory within its budget.
func (l *sharedLevel) Put(k Key, m Meta, payload []byte) error {
	if l.Has(k) {
		l.Touch(k)
		return nil
	}
	b := encode(l.model, m, payload)
	if int64(len(b)) > l.budget {
		return errors.New("the entry is larger than the shared level's budget")
	}
	if err := atomicWrite(l.dir, k.String()+".kv", b); err != nil {
		return err
	}
	l.addEnd(k, m)
	l.trim()
	return nil
}

// endsDir holds, per chunk start, an empty file for each entry stored from there,
// named by the entry's length and key: ends/<StartKey>/<length>-<key> (LevelCaps.Ends,
// Starts). Creating a file is atomic and
// concurrent writers of one name agree, so it needs no lock either. Trimming an entry
// removes its marker; a marker that outlives its entry otherwise (a damaged file
// removed, a crash between the two) is a Has that says no.
const endsDir = "ends"

func (l *sharedLevel) endPath(k Key, m Meta) (dir, name string) {
	return filepath.Join(l.dir, endsDir, StartKey(l.model, m.D, m.Tokens[:m.D]).String()),
		strconv.Itoa(len(m.Tokens)) + "-" + k.String()
}

func (l *sharedLevel) addEnd(k Key, m Meta) {
	if m.D == 0 {
		return // every prompt's first chunk starts there; Store.partial never looks at 0
	}
	d, name := l.endPath(k, m)
	if os.MkdirAll(d, 0o755) != nil {
		return // only hides the entry from a partial lookup
	}
	if f, err := os.OpenFile(filepath.Join(d, name), os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
		_ = f.Close()
	}
}

// dropEnd removes the marker of the entry file at path (named by k), read from the
// file's head before the file goes, and its folder when that is left empty.
func (l *sharedLevel) dropEnd(path string, k Key) {
	m, err := readHead(path, l.model, k)
	if err != nil || m.D == 0 {
		return
	}
	d, name := l.endPath(k, m)
	_ = os.Remove(filepath.Join(d, name))
	_ = os.Remove(d) // fails while other markers are in it
}

// markers lists the names of the markers under start ("<length>-<key>").
func (l *sharedLevel) markers(start Key) []string {
	ents, err := os.ReadDir(filepath.Join(l.dir, endsDir, start.String()))
	if err != nil {
		return nil
	}
	names := make([]string, len(ents))
	for i, de := range ents {
		names[i] = de.Name()
	}
	return names
}

// Ends lists the lengths stored from start.
func (l *sharedLevel) Ends(start Key) []int { return parseEnds(l.markers(start)) }

// EntriesFrom lists the keys of the entries stored from start (StartEntries).
func (l *sharedLevel) EntriesFrom(start Key) []Key {
	var out []Key
	for _, name := range l.markers(start) {
		if _, hex, ok := strings.Cut(name, "-"); ok {
			if k, ok := parseKey(hex); ok {
				out = append(out, k)
			}
		}
	}
	return out
}

// Head reads k's branch position and tokens from its file's head, checked to be
// named by them (not the KV: a load checks that).
func (l *sharedLevel) Head(k Key) (Meta, error) { return readHead(l.path(k), l.model, k) }

// parseEnds reads the lengths of markers ("<length>" or "<length>-<key>"), each once,
// skipping anything that is not one.
func parseEnds(names []string) []int {
	var out []int
	for _, n := range names {
		n, _, _ = strings.Cut(n, "-")
		if v, err := strconv.Atoi(n); err == nil && v > 0 && !slices.Contains(out, v) {
			out = append(out, v)
		}
	}
	return out
}

func (l *sharedLevel) Delete(k Key) { _ = os.Remove(l.path(k)) }

// Touch sets k's file's modification time to now: the LRU order every replica reads.
func (l *sharedLevel) Touch(k Key) {
	now := time.Now()
	_ = os.Chtimes(l.path(k), now, now)
}

type sharedFile struct {
	name  string
	size  int64
	mtime time.Time
}

// scan lists the directory's entries, oldest first, removing temporary files that are
// stale (a crashed writer's).
func (l *sharedLevel) scan() []sharedFile {
	ents, err := os.ReadDir(l.dir)
	if err != nil {
		return nil
	}
	var out []sharedFile
	for _, de := range ents {
		name := de.Name()
		info, err := de.Info()
		if err != nil {
			continue // removed meanwhile
		}
		switch {
		case strings.HasPrefix(name, ".tmp-"):
			if time.Since(info.ModTime()) > staleTemp {
				_ = os.Remove(filepath.Join(l.dir, name))
			}
		case strings.HasSuffix(name, ".kv"):
			if _, ok := parseKey(strings.TrimSuffix(name, ".kv")); ok {
				out = append(out, sharedFile{name, info.Size(), info.ModTime()})
			}
		}
	}
	slices.SortFunc(out, func(a, b sharedFile) int { return a.mtime.Compare(b.mtime) })
	return out
}

// trim removes the least recently used files (any replica's) until the directory is
// within its budget. It lists the directory each time: other replicas write too, and a
// listing costs little beside the fsync of a write of megabytes.
func (l *sharedLevel) trim() {
	l.mu.Lock()
	defer l.mu.Unlock()
	files := l.scan()
	var total int64
	for _, f := range files {
		total += f.size
	}
	for len(files) > 0 && total > l.budget {
		path := filepath.Join(l.dir, files[0].name)
		if k, ok := parseKey(strings.TrimSuffix(files[0].name, ".kv")); ok {
			l.dropEnd(path, k)
		}
		_ = os.Remove(path) // gone already: another replica trimmed it
		total -= files[0].size
		files = files[1:]
	}
	l.bytes, l.n = total, len(files)
}

func (l *sharedLevel) Oldest(skip func(Key) bool) (Key, bool) {
	for _, f := range l.scan() {
		if k, ok := parseKey(strings.TrimSuffix(f.name, ".kv")); ok && !skip(k) {
			return k, true
		}
	}
	return Key{}, false
}

// Usage is the directory's size as of the last scan or write of this replica.
func (l *sharedLevel) Usage() (int64, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.bytes, l.n
}

// readEntryFile reads an entry's file; a file that is not there is an absent miss, any
// other failure an io miss.
func readEntryFile(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, miss(MissAbsent, "%v", err)
		}
		return nil, miss(MissIO, "%v", err)
	}
	return b, nil
}

// verifyNamed checks an entry read from a level several replicas write (the shared
// directory, the remote store) against the model key and want, or, when want is nil
// (nothing to compare with), that the entry hashes to its name k; it returns the
// payload or a *MissError.
func verifyNamed(b []byte, model string, k Key, want *Meta) ([]byte, error) {
	m, payload, err := decode(b, model, want)
	if err == nil && want == nil && MakeKey(model, m.D, m.Tokens) != k {
		err = miss(MissForeign, "the entry does not hash to its name")
	}
	return payload, err
}
