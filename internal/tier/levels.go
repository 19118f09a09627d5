package tier

import (
	"cmp"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
)

// Level is one place below the cache where entries live (issue 43, 44): host RAM, a
// local directory, a directory several replicas share. The Store composes levels and
// owns the policy (which level an entry goes to, what is kept, the LRU order across
// them, the disk writer); a level only stores, finds, reads and removes entries by Key
// and keeps its own byte count. Every method is safe for concurrent use; Get and Put
// may do I/O and are called without the Store's lock.
type Level interface {
	// Location names the level (Where, Stats, metrics labels).
	Location() Location
	// Has reports whether an entry for k is stored (a Get may still miss: a file can
	// be damaged or vanish meanwhile).
	Has(k Key) bool
	// Get returns k's payload after checking it against the model key and, when want
	// is not nil, the entry's branch position and tokens; any failure is a *MissError.
	Get(k Key, want *Meta) ([]byte, error)
	// Put stores the entry under k (a whole entry or none: a reader never sees part).
	Put(k Key, m Meta, payload []byte) error
	// Delete removes k's entry (nothing when there is none).
	Delete(k Key)
	// Touch marks k's entry used now, for the least-recently-used order.
	Touch(k Key)
	// Oldest is the least recently used entry that skip does not exclude.
	Oldest(skip func(Key) bool) (Key, bool)
	// Usage is the bytes and entries stored.
	Usage() (bytes int64, entries int)
	// Caps is what the level can do besides the above (LevelCaps).
	Caps() LevelCaps
}

// LevelCaps are a level's optional abilities, declared once by the level (nil: it
// has not that ability), as engine.Caps declares a backend's: the Store asks a field
// rather than probing the level's type, so what each level offers is in one place and
// a new level states it instead of matching an interface by accident.
type LevelCaps struct {
	// Ends lists, per chunk start, the lengths of the entries stored from there:
	// Store.partial finds the chunk a prompt only partly continues by them (the shared
	// directory, the remote store).
	Ends EndsIndex
	// Starts lists the entries stored from a chunk start by key (the shared directory;
	// a remote store keeps no such list). Head reads an entry's branch position and
	// tokens without its KV (the shared directory, --pool-dir). With both,
	// Store.commonPart finds the entry sharing the most tokens with a prompt; with
	// List, SetObserver announces what --pool-dir held at Open.
	Starts StartEntries
	Head   HeadReader
	// Close releases what the level holds open (the remote store's connections), once
	// the Store's writer is done with it.
	Close io.Closer
	// Peek reads an entry without marking it used: a demotion moves the least recently
	// used entry out and a recorded pool's entry is copied to disk, and neither is a
	// use (RAM).
	Peek Peeker
	// Size is an entry's stored size without reading it: Where reports it, and a
	// pool's estimated restore cost is scaled by it (RAM, --pool-dir).
	Size Sizer
	// List lists the entries, most recently used first: those found on --pool-dir at
	// Open are announced to the router in that order (SetObserver) (--pool-dir).
	List Lister
	// Read reads a whole entry, checked, with what it is the KV of, where nothing
	// names the entry expected: a version-0 manifest listed pools by key alone
	// (--pool-dir).
	Read EntryReader
}

// Peeker is a level that reads an entry without marking it used.
type Peeker interface {
	// Peek is k's entry (false when there is none).
	Peek(k Key) (Meta, []byte, bool)
}

// Sizer is a level that knows its entries' sizes without reading them.
type Sizer interface {
	// Size is k's stored size in bytes (0 when absent).
	Size(k Key) int64
}

// Lister is a level that lists its entries.
type Lister interface {
	// Keys lists the entries, most recently used first.
	Keys() []Key
}

// EntryReader is a level that reads an entry whole together with its branch position
// and tokens.
type EntryReader interface {
	// ReadEntry returns k's entry after checking it against the model key (not against
	// its name: the caller checks what it needs); any failure is a *MissError.
	ReadEntry(k Key) (Meta, []byte, error)
}

// EndsIndex is a level that keeps, per chunk start, the lengths of the entries stored
// from there (partial chunks are found by them). A listed length whose entry is gone,
// or whose tokens are not the prompt's, is only a Has that says no.
type EndsIndex interface {
	// Ends lists the lengths stored under start (StartKey), in no order.
	Ends(start Key) []int
}

// StartEntries is a level that lists the entries stored from a chunk start by key.
type StartEntries interface {
	// EntriesFrom lists the keys of the entries stored from start (StartKey).
	EntriesFrom(start Key) []Key
}

// HeadReader is a level that reads what an entry is the KV of (its head: branch
// position and tokens, checked to be named by k) without reading the KV itself.
type HeadReader interface {
	// Head is k's branch position and tokens; any failure is a *MissError.
	Head(k Key) (Meta, error)
}

// clock orders uses across a store's levels (LRU): a counter, so the order does not
// depend on the wall clock's resolution; a disk level found at Open starts it above its
// files' modification times.
type clock struct {
	mu  sync.Mutex
	now int64
}

func (c *clock) tick() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now++
	return c.now
}

func (c *clock) atLeast(t int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = max(c.now, t)
}

type ramEntry struct {
	meta    Meta
	payload []byte
	used    int64 // LRU clock
}

// ramLevel keeps entries' payloads in host memory.
type ramLevel struct {
	clock *clock
	mu    sync.Mutex
	m     map[Key]*ramEntry
	bytes int64
}

var _ Level = (*ramLevel)(nil)

func newRAMLevel(c *clock) *ramLevel { return &ramLevel{clock: c, m: map[Key]*ramEntry{}} }

func (l *ramLevel) Location() Location { return RAM }

// Caps: an entry is read without a use (Peek) and its size is known (Size).
func (l *ramLevel) Caps() LevelCaps { return LevelCaps{Peek: l, Size: l} }

func (l *ramLevel) Has(k Key) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.m[k] != nil
}

// Get returns the bytes as they were put (they never left memory: nothing to check).
func (l *ramLevel) Get(k Key, _ *Meta) ([]byte, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.m[k]
	if e == nil {
		return nil, miss(MissAbsent, "no entry %s in RAM", k)
	}
	e.used = l.clock.tick()
	return e.payload, nil
}

func (l *ramLevel) Put(k Key, m Meta, payload []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if old := l.m[k]; old != nil {
		l.bytes -= int64(len(old.payload))
	}
	l.m[k] = &ramEntry{meta: m, payload: payload, used: l.clock.tick()}
	l.bytes += int64(len(payload))
	return nil
}

func (l *ramLevel) Delete(k Key) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.m[k]; e != nil {
		delete(l.m, k)
		l.bytes -= int64(len(e.payload))
	}
}

func (l *ramLevel) Touch(k Key) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.m[k]; e != nil {
		e.used = l.clock.tick()
	}
}

func (l *ramLevel) Oldest(skip func(Key) bool) (Key, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var victim Key
	var v *ramEntry
	for k, e := range l.m {
		if !skip(k) && (v == nil || e.used < v.used) {
			victim, v = k, e
		}
	}
	return victim, v != nil
}

func (l *ramLevel) Usage() (int64, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.bytes, len(l.m)
}

// Peek is k's entry without marking it used.
func (l *ramLevel) Peek(k Key) (Meta, []byte, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.m[k]; e != nil {
		return e.meta, e.payload, true
	}
	return Meta{}, nil, false
}

// Size is k's payload size (0 when absent).
func (l *ramLevel) Size(k Key) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.m[k]; e != nil {
		return int64(len(e.payload))
	}
	return 0
}

type diskEntry struct {
	size int64
	used int64
}

// diskLevel keeps entries as files <key>.kv in one replica's directory (--pool-dir),
// with an in-memory listing of them (read at Open; this process is the directory's
// only writer). Files are written whole (atomicWrite) and checked when read (decode).
type diskLevel struct {
	dir   string
	model string
	clock *clock
	mu    sync.Mutex
	m     map[Key]*diskEntry
	bytes int64
	// readOnly: the directory takes no writes (a read-only mount); Delete forgets an
	// entry without removing its file.
	readOnly bool
}

var _ Level = (*diskLevel)(nil)

func newDiskLevel(dir, model string, c *clock) *diskLevel {
	return &diskLevel{dir: dir, model: model, clock: c, m: map[Key]*diskEntry{}}
}

func (l *diskLevel) Location() Location { return Disk }

// Caps: the listing kept in memory gives sizes and the LRU order (Size, List); a
// file's head is read on its own (Head) and a file whole with its tokens (Read).
func (l *diskLevel) Caps() LevelCaps { return LevelCaps{Size: l, List: l, Head: l, Read: l} }

func (l *diskLevel) path(k Key) string { return filepath.Join(l.dir, k.String()+".kv") }

func (l *diskLevel) Has(k Key) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.m[k] != nil
}

// Keys lists the entries, most recently used first.
func (l *diskLevel) Keys() []Key {
	l.mu.Lock()
	defer l.mu.Unlock()
	ks := make([]Key, 0, len(l.m))
	for k := range l.m {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b Key) int { return cmp.Compare(l.m[b].used, l.m[a].used) })
	return ks
}

// found lists a file seen at Open.
func (l *diskLevel) found(k Key, size, mtime int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.m[k] = &diskEntry{size: size, used: mtime}
	l.bytes += size
	l.clock.atLeast(mtime)
}

func (l *diskLevel) Get(k Key, want *Meta) ([]byte, error) {
	crashPoint("read", k.String()+".kv")
	b, err := readEntryFile(l.path(k))
	if err != nil {
		return nil, err
	}
	_, payload, err := decode(b, l.model, want)
	return payload, err
}

// Head reads k's branch position and tokens from its file's head, checked to be named
// by them (not the KV).
func (l *diskLevel) Head(k Key) (Meta, error) { return readHead(l.path(k), l.model, k) }

// ReadEntry reads k's file whole; any failure to read it, a missing file included, is
// an io miss.
func (l *diskLevel) ReadEntry(k Key) (Meta, []byte, error) {
	b, err := os.ReadFile(l.path(k))
	if err != nil {
		return Meta{}, nil, miss(MissIO, "%v", err)
	}
	return decode(b, l.model, nil)
}

// Put writes the entry's file (encodedLen bytes) and lists it. The budget is the
// Store's to keep.
func (l *diskLevel) Put(k Key, m Meta, payload []byte) error {
	b := encode(l.model, m, payload)
	if err := atomicWrite(l.dir, k.String()+".kv", b); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if old := l.m[k]; old != nil {
		l.bytes -= old.size
	}
	l.m[k] = &diskEntry{size: int64(len(b)), used: l.clock.tick()}
	l.bytes += int64(len(b))
	return nil
}

func (l *diskLevel) Delete(k Key) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.m[k]; e != nil {
		l.bytes -= e.size
		delete(l.m, k)
		if !l.readOnly {
			_ = os.Remove(l.path(k))
		}
	}
}

func (l *diskLevel) Touch(k Key) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.m[k]; e != nil {
		e.used = l.clock.tick()
	}
}

func (l *diskLevel) Oldest(skip func(Key) bool) (Key, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var victim Key
	var v *diskEntry
	for k, e := range l.m {
		if !skip(k) && (v == nil || e.used < v.used) {
			victim, v = k, e
		}
	}
	return victim, v != nil
}

func (l *diskLevel) Usage() (int64, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.bytes, len(l.m)
}

// Size is k's file size (0 when absent).
func (l *diskLevel) Size(k Key) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.m[k]; e != nil {
		return e.size
	}
	return 0
}
