// Package tier keeps evicted KV below the cache: in host RAM up to a byte budget, then
// on disk under a directory up to another, least recently used first out of each, so
// that what was evicted is restored instead of prefilled. Its entries are pools' own
// cells (issue 25; pinned pools also survive a restart) and segments of sessions' and
// cached sequences' cells (issue 40, segments.go), both named by content.
//
// The store holds bytes, never decides: the engine's scheduler plans a spill when it
// evicts a pool and a restore when an evicted pool is needed; the runner copies the
// cells out of or into llama.cpp (llama.Context.SeqStateGet/Set) and hands the bytes
// here. Its methods are safe for concurrent use: the engine goroutine puts and gets,
// one writer goroutine does every disk write (so a slow disk never stalls decoding),
// and the HTTP handlers read locations and counters.
//
// Never wrong output: an entry is found by Key, a hash of everything that makes KV
// bytes valid (ModelKey: the GGUF's sha256, the llama.cpp build, the cache types and
// the V layout; plus the branch position and every token), and a disk entry is checked
// byte for byte (CRC-32C, header, model key, tokens) before its payload is returned. A
// missing, torn, corrupt or foreign entry is a miss with a reason, logged once and
// counted; the caller then prefills. Disk errors (full, read-only) are logged and
// counted and the server keeps serving from RAM and prefill.
package tier

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"
)

// Location is where an entry lives.
type Location string

// Locations. None: the store holds nothing for the pool.
const (
	None Location = ""
	RAM  Location = "ram"
	Disk Location = "disk"
)

// Config sizes a store.
type Config struct {
	// Model is the model key (ModelKey): entries written under another are foreign.
	Model string
	// RAMBytes is the host-RAM budget (--pool-ram-mb); 0: no RAM tier.
	RAMBytes int64
	// Dir is the disk tier's directory (--pool-dir); "": no disk tier, no restarts.
	Dir string
	// DiskBytes is the disk budget (--pool-disk-mb).
	DiskBytes int64
	Log       *slog.Logger
}

// ModelKey is everything besides the tokens that makes stored KV bytes valid: the
// GGUF's content (sha256, so a renamed or re-quantized file with the same name is a
// different model), the llama.cpp build, the K and V element types, flash attention
// (it decides whether V is stored transposed) and whether the sliding-window cache is
// full-size. n_ctx, n_batch and the thread count are not in it: llama.cpp stores each
// cell with its position, and a restore writes the cells wherever there is room.
func ModelKey(ggufSHA256, build, typeK, typeV, flashAttn string, swaFull bool) string {
	h := sha256.Sum256(fmt.Appendf(nil, "gguf=%s\x00llama=%s\x00k=%s\x00v=%s\x00fa=%s\x00swa_full=%v", ggufSHA256, build, typeK, typeV, flashAttn, swaFull))
	return hex.EncodeToString(h[:])
}

var fileHashes sync.Map // path+size+mtime -> sha256 hex

// FileSHA256 hashes a model file once per process (cached by path, size and mtime: a
// 100-250 MB GGUF takes a fraction of a second, and tests open many servers).
func FileSHA256(path string) (string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	id := fmt.Sprintf("%s\x00%d\x00%d", path, st.Size(), st.ModTime().UnixNano())
	if v, ok := fileHashes.Load(id); ok {
		return v.(string), nil
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	sum := hex.EncodeToString(h.Sum(nil))
	fileHashes.Store(id, sum)
	return sum, nil
}

type ramEntry struct {
	meta    Meta
	payload []byte
	used    int64 // LRU clock
}

type diskEntry struct {
	size int64
	used int64
}

// Store is the RAM and disk tier. Create it with Open, stop it with Close.
type Store struct {
	cfg Config
	log *slog.Logger

	mu        sync.Mutex
	clock     int64
	ram       map[Key]*ramEntry
	ramBytes  int64
	pending   map[Key]*ramEntry // queued for the disk writer (readable meanwhile)
	disk      map[Key]*diskEntry
	diskBytes int64
	byPool    map[int]Key
	kept      map[Key]bool // entries of recorded (pinned) pools: never dropped by LRU
	diskOff   string       // why the disk tier takes no writes ("" = it does)
	logged    map[string]bool
	man       manifest
	recs      map[int]Record // recorded pools (read at Open or recorded since), by id
	recovered []Recovered
	lost      []Lost
	floor     int
	stats     Stats
	kinds     map[string]*KindStats // per kind of holder (segments.go)

	jobs chan job
	done chan struct{}
}

// Stats are the store's counters and sizes (metrics, the benchmark).
type Stats struct {
	RAMBytes, RAMEntries   int64
	DiskBytes, DiskEntries int64
	Spills, SpillBytes     int64
	Restores               map[Location]int64
	RestoreSeconds         map[Location]float64
	Misses                 map[string]int64 // by reason
	DiskErrors             int64            // failed writes (disk full, read-only, ...)
	Dropped                int64            // entries that fit no tier and were dropped
	Prefetches             int64            // entries read from disk into RAM ahead of a load
	// Kinds splits the work by what the entries hold (KindPool, KindSession,
	// KindCached).
	Kinds map[string]KindStats
}

// Open starts a store: with a directory, it scans the entries there (removing
// temporary files a crash left behind), reads the manifest of recorded pools and
// checks that the directory takes writes (else the disk tier only reads).
func Open(cfg Config) (*Store, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	s := &Store{cfg: cfg, log: cfg.Log, ram: map[Key]*ramEntry{}, pending: map[Key]*ramEntry{}, disk: map[Key]*diskEntry{},
		byPool: map[int]Key{}, kept: map[Key]bool{}, logged: map[string]bool{}, jobs: make(chan job, 256), done: make(chan struct{}), kinds: map[string]*KindStats{},
		stats: Stats{Restores: map[Location]int64{}, RestoreSeconds: map[Location]float64{}, Misses: map[string]int64{}}}
	if cfg.Dir != "" {
		if err := s.openDir(); err != nil {
			return nil, err
		}
	}
	go s.writer(s.jobs)
	return s, nil
}

// Close waits for queued disk writes to finish.
func (s *Store) Close() {
	s.mu.Lock()
	if s.jobs == nil {
		s.mu.Unlock()
		return
	}
	close(s.jobs)
	s.jobs = nil
	s.mu.Unlock()
	<-s.done
}

// Flush waits until every disk write queued so far is done (tests, shutdown).
func (s *Store) Flush() {
	ch := make(chan struct{})
	if s.enqueue(job{flushed: ch}) {
		<-ch
	}
}

func (s *Store) tick() int64 { s.clock++; return s.clock }

// logOnce logs a problem the first time it is seen (each distinct message once), so a
// full disk does not write a line per spill.
func (s *Store) logOnce(msg string, args ...any) {
	key := msg + fmt.Sprint(args...)
	if s.logged[key] {
		return
	}
	s.logged[key] = true
	s.log.Warn(msg, args...)
}

// Has reports whether an entry for m is stored (so a spill can skip copying it out).
func (s *Store) Has(m Meta) bool {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ram[k] != nil || s.pending[k] != nil || s.disk[k] != nil
}

// OnDiskOnly reports whether m's entry is on disk and nowhere in memory: a Get would
// read a file.
func (s *Store) OnDiskOnly(m Meta) bool {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ram[k] == nil && s.pending[k] == nil && s.disk[k] != nil
}

// Put stores the KV of pool's [m.D, L) (payload from llama.Context.SeqStateGet): in RAM
// when the budget allows (the least recently used entries move to disk, or are
// dropped without a disk tier), else straight to disk. It returns where the entry
// went (None: dropped, nothing fits).
func (s *Store) Put(pool int, m Meta, payload []byte) Location {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byPool[pool] = k
	return s.putLocked(k, KindPool, m, payload)
}

// putLocked stores payload under k (nil: touch an entry the caller found with Has).
func (s *Store) putLocked(k Key, kind string, m Meta, payload []byte) Location {
	s.stats.Spills++
	s.stats.SpillBytes += int64(len(payload))
	ks := s.kind(kind)
	ks.Spills++
	ks.SpillBytes += int64(len(payload))
	if e := s.ram[k]; e != nil {
		e.used = s.tick()
		return RAM
	}
	if s.pending[k] != nil {
		return Disk
	}
	if e := s.disk[k]; e != nil {
		e.used = s.tick()
		return Disk
	}
	if len(payload) == 0 {
		return None // the caller thought it was stored (Has) and it went meanwhile
	}
	size := int64(len(payload))
	if size <= s.cfg.RAMBytes {
		for s.ramBytes+size > s.cfg.RAMBytes && s.demoteLRU() {
		}
		if s.ramBytes+size <= s.cfg.RAMBytes {
			s.ram[k] = &ramEntry{meta: m, payload: payload, used: s.tick()}
			s.ramBytes += size
			return RAM
		}
	}
	if s.queueWrite(k, &ramEntry{meta: m, payload: payload}) {
		return Disk
	}
	s.stats.Dropped++
	return None
}

// demoteLRU moves the least recently used RAM entry to disk (or drops it). A kept entry
// (a pinned pool's) is never dropped: without a disk tier to take it, it stays. False
// when nothing could be moved.
func (s *Store) demoteLRU() bool {
	diskOK := s.cfg.Dir != "" && s.diskOff == ""
	var victim Key
	var v *ramEntry
	for k, e := range s.ram {
		if (diskOK || !s.kept[k]) && (v == nil || e.used < v.used) {
			victim, v = k, e
		}
	}
	if v == nil {
		return false
	}
	delete(s.ram, victim)
	s.ramBytes -= int64(len(v.payload))
	if s.disk[victim] != nil {
		return true // the disk has it already (it was promoted from there)
	}
	if !s.queueWrite(victim, v) {
		s.stats.Dropped++
		if s.kept[victim] { // the disk refused it after all: back in RAM, over the budget
			s.ram[victim] = v
			s.ramBytes += int64(len(v.payload))
			return false
		}
	}
	return true
}

// Get returns the payload stored for m and where it was found, or a *MissError.
func (s *Store) Get(m Meta) ([]byte, Location, error) {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	if e := s.ram[k]; e != nil {
		e.used = s.tick()
		s.mu.Unlock()
		return e.payload, RAM, nil
	}
	if e := s.pending[k]; e != nil {
		s.mu.Unlock()
		return e.payload, Disk, nil // being written: the bytes are still in memory
	}
	d := s.disk[k]
	if d != nil {
		d.used = s.tick()
	}
	s.mu.Unlock()
	if d == nil {
		return nil, None, miss(MissAbsent, "no entry %s", k)
	}
	payload, err := s.readEntry(k, &m)
	if err != nil {
		s.mu.Lock()
		s.dropDisk(k) // it will never verify: forget it (the file is removed)
		s.mu.Unlock()
		return nil, None, err
	}
	return payload, Disk, nil
}

// Miss counts a lookup or load that could not be used, and logs it once per reason.
func (s *Store) Miss(pool int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := Reason(err)
	s.stats.Misses[r]++
	s.kind(KindPool).Misses++
	s.logOnce("pool KV not restored from the tier; prefilling it instead", "pool", pool, "reason", r, "err", err)
}

// Restored counts a pool restore from loc that took d.
func (s *Store) Restored(loc Location, d time.Duration) { s.RestoredKind(KindPool, loc, d, 0) }

// RestoredKind counts a restore of kind's entry from loc that took d and brought back
// n bytes.
func (s *Store) RestoredKind(kind string, loc Location, d time.Duration, n int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stats.Restores[loc]++
	s.stats.RestoreSeconds[loc] += d.Seconds()
	ks := s.kind(kind)
	ks.Restores++
	ks.RestoreBytes += n
	ks.RestoreSeconds += d.Seconds()
}

// Where reports where pool's entry lives and its size (None, 0 when the store holds
// nothing for it).
func (s *Store) Where(pool int) (Location, int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k, ok := s.byPool[pool]
	if !ok {
		return None, 0
	}
	if e := s.ram[k]; e != nil {
		return RAM, int64(len(e.payload))
	}
	if e := s.pending[k]; e != nil {
		return Disk, int64(len(e.payload))
	}
	if e := s.disk[k]; e != nil {
		return Disk, e.size
	}
	return None, 0
}

// Stats copies the counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stats
	st.RAMBytes, st.RAMEntries = s.ramBytes, int64(len(s.ram))
	st.DiskBytes, st.DiskEntries = s.diskBytes, int64(len(s.disk))
	for k, e := range s.pending {
		if s.disk[k] == nil {
			st.DiskBytes += int64(len(e.payload))
			st.DiskEntries++
		}
	}
	st.Restores, st.RestoreSeconds, st.Misses = cloneMap(s.stats.Restores), cloneMap(s.stats.RestoreSeconds), cloneMap(s.stats.Misses)
	st.Kinds = map[string]KindStats{}
	for k, v := range s.kinds {
		st.Kinds[k] = *v
	}
	return st
}

func cloneMap[K comparable, V any](m map[K]V) map[K]V {
	out := make(map[K]V, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}
