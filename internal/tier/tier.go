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
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/pool"
)

// Location is where an entry lives.
type Location string

// Locations. None: the store holds nothing for the pool.
// Shared (shared.go): the directory several replicas share.
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
	// SharedDir is the shared level's directory (--tier-shared-dir; shared.go), which
	// other replicas serving the same model may mount too; "": none. Every entry put
	// is also written there, and a lookup that misses RAM and --pool-dir reads it.
	SharedDir string
	// SharedBytes is the shared directory's budget (--tier-shared-mb), kept by every
	// replica that writes there.
	SharedBytes int64
	// Remote is the URL of a Redis server (--tier-remote; remote.go) that takes the
	// shared level's place: a store every replica reaches over the network; "": none.
	// At most one of SharedDir and Remote.
	Remote string
	Log    *slog.Logger
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

// Store is the tier: its levels (levels.go) and the policy over them. It holds each
// level by its role (which level an entry goes to, which one the writer fills, which one
// other replicas read) and only as a Level: what a level can do besides is in its Caps.
// Create it with Open, stop it with Close.
type Store struct {
	cfg Config
	log *slog.Logger

	clock clock
	// mem is host RAM, within cfg.RAMBytes: where a put goes first. dsk is --pool-dir
	// (an empty one without it): what RAM demotes to, and what holds recorded pools'
	// entries across restarts. shr is the fleet's level, written through on every put
	// and read last: the shared directory or the remote store; nil: none.
	mem, dsk, shr Level

	mu        sync.Mutex
	pending   map[Key]*ramEntry // queued for the disk writer (readable meanwhile)
	shPending map[Key]*ramEntry // queued for the shared level's write (readable meanwhile)
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
	obs       Observer              // nil: none (observe.go)
	held      map[Key]Meta          // entries reported to obs as held
	bg        sync.WaitGroup        // announceFound, which Close waits for

	jobs chan job
	done chan struct{}
}

// Stats are the store's counters and sizes (metrics, the benchmark).
type Stats struct {
	// Levels is each level's part, in the order a lookup asks them: RAM, --pool-dir,
	// then the fleet's level when there is one. The same fields for every level, so a
	// reader (metrics' tier label) goes over them instead of naming each.
	Levels             []LevelStats
	Spills, SpillBytes int64
	Restores           map[Location]int64
	RestoreSeconds     map[Location]float64
	Misses             map[string]int64 // by reason
	DiskErrors         int64            // failed writes (disk full, read-only, ...)
	Dropped            int64            // entries that fit no tier and were dropped
	Prefetches         int64            // entries read from disk into RAM ahead of a load
	// Kinds splits the work by what the entries hold (KindPool, KindSession,
	// KindCached).
	Kinds map[string]KindStats
}

// LevelStats is one level's part of Stats.
type LevelStats struct {
	// Location names the level.
	Location Location
	// Bytes and Entries are what the level holds (Level.Usage): --pool-dir's include
	// the entries queued for it; the shared directory's are all replicas' entries as of
	// this replica's last write there; the remote store's are what this replica put.
	Bytes, Entries int64
	// Writes are the entries the store's writer wrote to the level (--pool-dir, the
	// fleet level; RAM takes its puts directly), Errors the writes that failed
	// (--pool-dir's also count in DiskErrors).
	Writes, Errors int64
}

// Level is the part of the level at loc (only loc, the rest zero, when the store has
// no such level).
func (st Stats) Level(loc Location) LevelStats {
	for _, l := range st.Levels {
		if l.Location == loc {
			return l
		}
	}
	return LevelStats{Location: loc}
}

// Open starts a store: with a directory, it scans the entries there (removing
// temporary files a crash left behind), reads the manifest of recorded pools and
// checks that the directory takes writes (else the disk tier only reads).
func Open(cfg Config) (*Store, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	s := &Store{cfg: cfg, log: cfg.Log, pending: map[Key]*ramEntry{}, shPending: map[Key]*ramEntry{},
		byPool: map[int]Key{}, kept: map[Key]bool{}, logged: map[string]bool{}, jobs: make(chan job, 256), done: make(chan struct{}), kinds: map[string]*KindStats{},
		stats: Stats{Restores: map[Location]int64{}, RestoreSeconds: map[Location]float64{}, Misses: map[string]int64{}}}
	s.mem = newRAMLevel(&s.clock)
	dsk := newDiskLevel(cfg.Dir, cfg.Model, &s.clock)
	s.dsk = dsk
	if cfg.Dir != "" {
		if err := s.openDir(dsk); err != nil {
			return nil, err
		}
	}
	switch {
	case cfg.SharedDir != "" && cfg.Remote != "":
		return nil, errors.New("a shared tier directory and a remote tier cannot both be set: the fleet has one level")
	case cfg.SharedDir != "":
		shr, err := newSharedLevel(cfg.SharedDir, cfg.Model, cfg.SharedBytes)
		if err != nil {
			return nil, fmt.Errorf("shared tier directory: %w", err)
		}
		s.shr = shr
	case cfg.Remote != "":
		r, err := newRemoteLevel(cfg.Remote, cfg.Model)
		if err != nil {
			return nil, err
		}
		s.shr = r
	}
	for _, l := range s.levels() {
		s.stats.Levels = append(s.stats.Levels, LevelStats{Location: l.Location()})
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
	s.bg.Wait()
	for _, l := range s.levels() {
		if c := l.Caps().Close; c != nil {
			_ = c.Close() // the remote store's connections, once the writer is done
		}
	}
}

// Flush waits until every disk write queued so far is done (tests, shutdown).
func (s *Store) Flush() {
	ch := make(chan struct{})
	if s.enqueue(job{flushed: ch}) {
		<-ch
	}
}

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
	local := s.mem.Has(k) || s.pending[k] != nil || s.dsk.Has(k) || s.shPending[k] != nil
	s.mu.Unlock()
	// The fleet level is asked outside the store's lock: its answer is a stat or a network
	// round trip (the remote store's, up to its deadline), which must not hold up the
	// engine goroutine's puts and gets behind another goroutine's lookup.
	return local || (s.shr != nil && s.shr.Has(k))
}

// OnDiskOnly reports whether m's entry is on disk (--pool-dir or the shared level) and
// nowhere in memory: a Get would read a file.
func (s *Store) OnDiskOnly(m Meta) bool {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	inMemory := s.mem.Has(k) || s.pending[k] != nil || s.shPending[k] != nil
	onDisk := s.dsk.Has(k)
	s.mu.Unlock()
	return !inMemory && (onDisk || (s.shr != nil && s.shr.Has(k))) // the fleet level outside the lock, as in Has
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

// putLocked stores payload under k (nil: touch an entry the caller found with Has), in
// RAM or on disk, and writes it through to the shared level when there is one: there
// another replica finds it. An entry only the shared level took is Shared, unless it
// is kept (a pin is never left to another replica's LRU).
func (s *Store) putLocked(k Key, kind string, m Meta, payload []byte) Location {
	loc := s.putLocal(k, kind, m, payload)
	if len(payload) == 0 {
		return loc
	}
	if loc != None {
		s.noteStored(k, m)
	}
	if s.queueShared(k, m, payload) && loc == None && !s.kept[k] {
		return s.shr.Location()
	}
	if loc == None {
		s.stats.Dropped++
	}
	return loc
}

// queueShared hands an entry to the writer for the shared level; false without one.
func (s *Store) queueShared(k Key, m Meta, payload []byte) bool {
	if s.shr == nil {
		return false
	}
	if s.shPending[k] != nil {
		return true
	}
	e := &ramEntry{meta: m, payload: payload}
	s.shPending[k] = e
	if !s.enqueueLocked(job{key: k, e: e, shared: true}) {
		delete(s.shPending, k)
		return false
	}
	return true
}

// putLocal is putLocked's RAM and disk part; None: it fits neither.
func (s *Store) putLocal(k Key, kind string, m Meta, payload []byte) Location {
	s.stats.Spills++
	s.stats.SpillBytes += int64(len(payload))
	ks := s.kind(kind)
	ks.Spills++
	ks.SpillBytes += int64(len(payload))
	if s.mem.Has(k) {
		s.mem.Touch(k)
		return RAM
	}
	if s.pending[k] != nil {
		return Disk
	}
	if s.dsk.Has(k) {
		s.dsk.Touch(k)
		return Disk
	}
	if len(payload) == 0 {
		return None // the caller thought it was stored (Has) and it went meanwhile
	}
	size := int64(len(payload))
	if size <= s.cfg.RAMBytes {
		for s.ramBytes()+size > s.cfg.RAMBytes && s.demoteLRU() {
		}
		if s.ramBytes()+size <= s.cfg.RAMBytes {
			_ = s.mem.Put(k, m, payload)
			return RAM
		}
	}
	if s.queueWrite(k, &ramEntry{meta: m, payload: payload}) {
		return Disk
	}
	return None
}

// demoteLRU moves the least recently used RAM entry to disk (or drops it). A kept entry
// (a pinned pool's) is never dropped: without a disk tier to take it, it stays. False
// when nothing could be moved.
func (s *Store) demoteLRU() bool {
	diskOK := s.cfg.Dir != "" && s.diskOff == ""
	victim, ok := s.mem.Oldest(func(k Key) bool { return !diskOK && s.kept[k] })
	if !ok {
		return false
	}
	peek := s.mem.Caps().Peek
	if peek == nil {
		return false // a RAM level that cannot hand an entry over keeps it
	}
	meta, payload, _ := peek.Peek(victim)
	v := &ramEntry{meta: meta, payload: payload}
	s.mem.Delete(victim)
	if s.dsk.Has(victim) {
		return true // the disk has it already (it was promoted from there)
	}
	if !s.queueWrite(victim, v) {
		s.stats.Dropped++
		if s.kept[victim] { // the disk refused it after all: back in RAM, over the budget
			_ = s.mem.Put(victim, v.meta, v.payload)
			return false
		}
		s.noteGone(victim)
	}
	return true
}

// Get returns the payload stored for m and where it was found, or a *MissError.
func (s *Store) Get(m Meta) ([]byte, Location, error) {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	if b, err := s.mem.Get(k, nil); err == nil {
		s.mu.Unlock()
		return b, RAM, nil
	}
	if e := s.pending[k]; e != nil {
		s.mu.Unlock()
		return e.payload, Disk, nil // being written: the bytes are still in memory
	}
	if e := s.shPending[k]; e != nil {
		s.mu.Unlock()
		return e.payload, s.shr.Location(), nil
	}
	onDisk := s.dsk.Has(k)
	if onDisk {
		s.dsk.Touch(k)
	}
	s.mu.Unlock()
	err := miss(MissAbsent, "no entry %s", k)
	if onDisk {
		payload, derr := s.dsk.Get(k, &m)
		if derr == nil {
			return payload, Disk, nil
		}
		s.mu.Lock()
		s.dropDisk(k) // it will never verify: forget it (the file is removed)
		s.mu.Unlock()
		err = derr
	}
	if s.shr != nil {
		// Another replica's entry, or this one's that left RAM and --pool-dir. A file
		// that vanished meanwhile (another replica's LRU) is a miss like any other.
		payload, serr := s.shr.Get(k, &m)
		if serr == nil {
			return payload, s.shr.Location(), nil
		}
		if !onDisk {
			err = serr
		}
	}
	return nil, None, err
}

// Run is the run of chunk-aligned segments (engine/spill.go: [j·chunk, min((j+1)·chunk,
// L)), each named by the whole prefix up to its end) of tokens that some level holds,
// from position 0 on: every whole chunk while one is stored, then, where the next one
// is not, the longest entry that starts there and ends inside it (partial). It reads
// no payload (a stat per chunk on the shared level): a replica asks it before a request
// goes to its scheduler, whose index only knows what this replica stored, so that
// entries another replica (or this one before a restart) wrote are loaded instead of
// prefilled. A listed entry may still miss when loaded; that costs a prefill of the
// rest, never a wrong token.
func (s *Store) Run(tokens []int32, chunk int) []Meta {
	if chunk <= 0 {
		return nil
	}
	var out []Meta
	for k := 0; k < len(tokens); k += chunk {
		m := Meta{D: k, Tokens: tokens[:min(k+chunk, len(tokens))]}
		if !s.Has(m) {
			if p, ok := s.partial(tokens, k, len(m.Tokens)); ok {
				out = append(out, p)
			}
			break
		}
		out = append(out, m)
	}
	return out
}

// partial is the longest entry [k, e), k < e < end, that the fleet level holds. A
// prompt's last chunk is stored as the prompt ends (a request's write-through, a
// session's spill), so the next turn of the same conversation, longer by its reply and
// new words, finds it only here: without it another replica would prefill up to a
// chunk less one token of what the fleet holds. Entries are named by a hash of their
// whole prefix, so the level keeps, per chunk start, the lengths of the entries that
// start there (LevelCaps.Ends); each listed length the prompt could continue is asked
// like a chunk, longest first, at most maxEnds of them. When none is a prefix of the
// prompt, the entry from there that shares the most tokens with it (commonPart) is
// the answer, under its own name: the scheduler loads it whole into a scratch
// sequence and takes the part that matches, as it does with its own entries. This
// replica's own levels are not asked: the scheduler's index already knows what it
// stored.
func (s *Store) partial(tokens []int32, k, end int) (Meta, bool) {
	ix := s.fleetCaps().Ends
	if ix == nil || k == 0 || end-k < 2 {
		return Meta{}, false // at 0 nothing was found: a cold prompt, no conversation to continue
	}
	start := StartKey(s.cfg.Model, k, tokens[:k])
	ends := ix.Ends(start)
	slices.SortFunc(ends, func(a, b int) int { return b - a })
	tried := 0
	for _, e := range ends {
		if e <= k || e >= end {
			continue
		}
		if tried++; tried > maxEnds {
			break
		}
		if m := (Meta{D: k, Tokens: tokens[:e]}); s.Has(m) {
			return m, true
		}
	}
	return s.commonPart(start, tokens, k, end)
}

// minCommonPart is the fewest tokens an entry must share with a prompt past its start
// to be loaded for them (it is read whole: a few shared tokens are not worth a chunk).
const minCommonPart = 16

// commonPart is the entry stored from chunk start start (LevelCaps.Starts) that shares
// the most tokens with tokens[k:end], at least minCommonPart: a teammate's chunk holding
// the end of a system prompt both share, followed by its own question. Its head
// (position and tokens, not the KV) is read from the level; at most maxEnds of them.
func (s *Store) commonPart(start Key, tokens []int32, k, end int) (Meta, bool) {
	c := s.fleetCaps()
	if c.Starts == nil || c.Head == nil {
		return Meta{}, false
	}
	var best Meta
	bestN := minCommonPart - 1
	for i, key := range c.Starts.EntriesFrom(start) {
		if i >= maxEnds {
			break
		}
		m, err := c.Head.Head(key)
		if err != nil || m.D != k || len(m.Tokens) <= k || !slices.Equal(m.Tokens[:k], tokens[:k]) {
			continue
		}
		if n := pool.CommonPrefix(m.Tokens[k:], tokens[k:end]); n > bestN {
			best, bestN = m, n
		}
	}
	return best, bestN >= minCommonPart
}

// maxEnds bounds the lengths partial asks about at one chunk start: many agents whose
// prompts share a chunk start each stored their own end there.
const maxEnds = 32

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
	if s.mem.Has(k) {
		return RAM, sizeIn(s.mem, k)
	}
	if e := s.pending[k]; e != nil {
		return Disk, int64(len(e.payload))
	}
	if s.dsk.Has(k) {
		return Disk, sizeIn(s.dsk, k)
	}
	return None, 0
}

// sizeIn is k's size in l (0 when l does not know it).
func sizeIn(l Level, k Key) int64 {
	if sz := l.Caps().Size; sz != nil {
		return sz.Size(k)
	}
	return 0
}

// Stats copies the counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stats
	st.Levels = slices.Clone(s.stats.Levels)
	for i, l := range s.levels() {
		ls := &st.Levels[i]
		b, n := l.Usage()
		ls.Bytes, ls.Entries = b, int64(n)
		if l != s.dsk {
			continue
		}
		for k, e := range s.pending { // queued for the writer: a Get finds them on Disk already
			if !s.dsk.Has(k) {
				ls.Bytes += int64(len(e.payload))
				ls.Entries++
			}
		}
	}
	st.Restores, st.RestoreSeconds, st.Misses = cloneMap(s.stats.Restores), cloneMap(s.stats.RestoreSeconds), cloneMap(s.stats.Misses)
	st.Kinds = map[string]KindStats{}
	for k, v := range s.kinds {
		st.Kinds[k] = *v
	}
	return st
}

// levels are the store's levels in the order a lookup asks them: RAM, --pool-dir, then
// the fleet's level when there is one.
func (s *Store) levels() []Level {
	if s.shr == nil {
		return []Level{s.mem, s.dsk}
	}
	return []Level{s.mem, s.dsk, s.shr}
}

// wrote counts a write of the store's writer to l (failed when err is not nil).
func (s *Store) wrote(l Level, err error) {
	for i := range s.stats.Levels {
		if st := &s.stats.Levels[i]; st.Location == l.Location() {
			if err != nil {
				st.Errors++
			} else {
				st.Writes++
			}
			return
		}
	}
}

// fleetCaps is the fleet level's abilities (none without a fleet level).
func (s *Store) fleetCaps() LevelCaps {
	if s.shr == nil {
		return LevelCaps{}
	}
	return s.shr.Caps()
}

// ramBytes is what the RAM level holds.
func (s *Store) ramBytes() int64 { b, _ := s.mem.Usage(); return b }

func cloneMap[K comparable, V any](m map[K]V) map[K]V {
	out := make(map[K]V, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}
