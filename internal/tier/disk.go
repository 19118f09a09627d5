package tier

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// The disk tier: one file per entry, <key>.kv, and pools.json, the manifest of recorded
// (pinned) pools and the pool id floor. Every write is a temporary file that is fsynced,
// renamed over its name and followed by an fsync of the directory, so after a crash at
// any instant (kill -9, power) a name holds a whole old or a whole new file; temporary
// files left behind are removed at the next Open.

const manifestName = "pools.json"

// idBlock is how many pool ids one run may use before a later run could see them
// again: each Open moves the recorded floor up by this much, and recording a pool
// beyond the floor moves it again, so ids are never reused across restarts (a run that
// crashes after creating more than this many unrecorded pools is the exception).
const idBlock = 1 << 20

// Record is a pool recorded for restarts: its id, its parent's (0 for a root), its
// branch position and the key of its entry.
type Record struct {
	ID     int    `json:"id"`
	Parent int    `json:"parent,omitempty"`
	D      int    `json:"d"`
	Key    string `json:"key"`
}

// Recovered is a recorded pool whose entry verified at Open: everything needed to put
// it back in the tree.
type Recovered struct {
	Record
	Tokens []int32
}

type manifest struct {
	Version int      `json:"version"`
	Model   string   `json:"model"`
	IDFloor int      `json:"id_floor"`
	Pools   []Record `json:"pools"`
}

type job struct {
	key     Key
	e       *ramEntry
	record  *Record // record the pool once its entry is on disk
	forget  int     // drop this pool's record (0: none)
	flushed chan struct{}
}

// parseKey reads a key written by Key.String.
func parseKey(s string) (Key, bool) {
	var k Key
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != len(k) {
		return k, false
	}
	copy(k[:], b)
	return k, true
}

func (s *Store) path(k Key) string { return filepath.Join(s.cfg.Dir, k.String()+".kv") }

func (s *Store) openDir() error {
	dir := s.cfg.Dir
	if err := os.MkdirAll(dir, 0o755); err != nil {
		s.diskOff = err.Error()
		s.log.Warn("pool tier directory unusable; pools will not survive restarts", "dir", dir, "err", err)
		return nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		s.diskOff = err.Error()
		s.log.Warn("pool tier directory unreadable; pools will not survive restarts", "dir", dir, "err", err)
		return nil
	}
	for _, de := range ents {
		name := de.Name()
		switch {
		case strings.HasPrefix(name, ".tmp-"):
			_ = os.Remove(filepath.Join(dir, name)) // a write a crash interrupted
		case strings.HasSuffix(name, ".kv"):
			k, ok := parseKey(strings.TrimSuffix(name, ".kv"))
			if !ok {
				continue
			}
			if info, err := de.Info(); err == nil {
				s.disk[k] = &diskEntry{size: info.Size(), used: info.ModTime().UnixNano()}
				s.diskBytes += info.Size()
			}
		}
	}
	// LRU order for what was found: older files first; new uses count above them all.
	for _, e := range s.disk {
		s.clock = max(s.clock, e.used)
	}
	// Probe that the directory takes writes: a read-only mount is served from, not
	// written to (every spill then stays in RAM or is dropped, and is counted).
	if f, err := os.CreateTemp(dir, ".tmp-probe-*"); err != nil {
		s.diskOff = err.Error()
		s.log.Warn("pool tier directory is not writable; reading it only", "dir", dir, "err", err)
	} else {
		f.Close()
		_ = os.Remove(f.Name())
	}
	s.readManifest()
	floor := s.man.IDFloor
	s.man.IDFloor += idBlock
	s.man.Model = s.cfg.Model
	if s.diskOff == "" {
		if err := s.writeManifest(); err != nil {
			s.log.Warn("cannot record the pool id floor; ids after a restart may repeat this run's", "err", err)
		}
	}
	s.floor = floor
	return nil
}

// readManifest loads pools.json and verifies each recorded pool's entry, parents
// before children; what does not verify is skipped with one log line (and its
// descendants with it: a child's cells need its parent's).
func (s *Store) readManifest() {
	b, err := os.ReadFile(filepath.Join(s.cfg.Dir, manifestName))
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	var m manifest
	if err == nil {
		err = json.Unmarshal(b, &m)
	}
	if err != nil {
		s.log.Warn("pool manifest unreadable; no pools recovered", "err", err)
		return
	}
	s.man.IDFloor = m.IDFloor
	for _, r := range m.Pools {
		s.man.IDFloor = max(s.man.IDFloor, r.ID)
	}
	if m.Model != s.cfg.Model {
		s.log.Warn("pool manifest was written for another model, build or cache type; no pools recovered", "model_key", m.Model)
		return
	}
	slices.SortFunc(m.Pools, func(a, b Record) int { return a.ID - b.ID })
	ok := map[int]bool{}
	for _, r := range m.Pools {
		k, good := parseKey(r.Key)
		if !good {
			s.log.Warn("recorded pool has a malformed key; skipped", "pool", r.ID)
			continue
		}
		if r.Parent != 0 && !ok[r.Parent] {
			s.log.Warn("recorded pool's parent was not recovered; skipped", "pool", r.ID, "parent", r.Parent)
			continue
		}
		if s.disk[k] == nil {
			s.stats.Misses[MissAbsent]++
			s.log.Warn("recorded pool's entry is missing; skipped", "pool", r.ID)
			continue
		}
		meta, _, err := s.readEntryMeta(k)
		if err == nil && meta.D != r.D {
			err = miss(MissForeign, "entry branch position %d, recorded %d", meta.D, r.D)
		}
		if err == nil && MakeKey(s.cfg.Model, meta.D, meta.Tokens) != k {
			err = miss(MissForeign, "entry does not hash to its name")
		}
		if err != nil {
			s.stats.Misses[Reason(err)]++
			s.log.Warn("recorded pool's entry does not verify; skipped (it will be prefilled if created again)", "pool", r.ID, "reason", Reason(err), "err", err)
			s.dropDisk(k)
			continue
		}
		ok[r.ID] = true
		s.kept[k] = true
		s.byPool[r.ID] = k
		s.man.Pools = append(s.man.Pools, r)
		s.recovered = append(s.recovered, Recovered{Record: r, Tokens: meta.Tokens})
	}
}

// Durable reports whether pools can be recorded for restarts (a writable directory).
func (s *Store) Durable() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cfg.Dir != "" && s.diskOff == ""
}

// IDFloor is the highest pool id an earlier run may have used: this run's ids start
// above it (0 without a disk tier).
func (s *Store) IDFloor() int { return s.floor }

// Recovered lists the recorded pools whose entries verified at Open, parents first.
func (s *Store) Recovered() []Recovered { return slices.Clone(s.recovered) }

// Record makes pool survive restarts: its entry is written to disk (payload, unless the
// store already holds it) and the pool recorded in the manifest once the entry is
// there. It reports false when there is no usable disk tier.
func (s *Store) Record(r Record, m Meta, payload []byte) bool {
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	r.Key = k.String()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cfg.Dir == "" || s.diskOff != "" {
		return false
	}
	s.byPool[r.ID] = k
	s.kept[k] = true
	e := s.ram[k]
	if e == nil {
		e = s.pending[k]
	}
	if e == nil && payload != nil {
		e = &ramEntry{meta: m, payload: payload}
	}
	if s.disk[k] != nil || e == nil {
		return s.enqueueLocked(job{record: &r})
	}
	return s.queueWrite(k, e, &r)
}

// Forget drops pool's record (it was unpinned or released): after a restart it is not
// recovered. Its entry stays as an ordinary LRU entry.
func (s *Store) Forget(pool int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if k, ok := s.byPool[pool]; ok {
		delete(s.kept, k)
	}
	if s.cfg.Dir != "" && s.diskOff == "" {
		s.enqueueLocked(job{forget: pool})
	}
}

// Recorded reports whether pool is in the manifest (or queued to be).
func (s *Store) Recorded(pool int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	k, ok := s.byPool[pool]
	return ok && s.kept[k]
}

func (s *Store) enqueue(j job) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.enqueueLocked(j)
}

func (s *Store) enqueueLocked(j job) bool {
	if s.jobs == nil {
		return false
	}
	select {
	case s.jobs <- j:
		return true
	default:
		s.stats.DiskErrors++
		s.logOnce("pool tier disk writer is behind; an entry was not written")
		return false
	}
}

// queueWrite hands an entry to the disk writer; it stays readable (pending) until it
// is on disk. False: no usable disk tier, or it does not fit the budget.
func (s *Store) queueWrite(k Key, e *ramEntry, r *Record) bool {
	if s.cfg.Dir == "" || s.diskOff != "" {
		if s.cfg.Dir != "" {
			s.stats.DiskErrors++
			s.logOnce("pool tier disk is not writable; the entry is dropped", "reason", s.diskOff)
		}
		return false
	}
	if int64(len(e.payload)) > s.cfg.DiskBytes {
		s.logOnce("a pool's KV is larger than --pool-disk-mb; it is dropped", "bytes", len(e.payload))
		return false
	}
	s.pending[k] = e
	if !s.enqueueLocked(job{key: k, e: e, record: r}) {
		delete(s.pending, k)
		return false
	}
	return true
}

// writer does every disk write, in order, off the engine goroutine.
func (s *Store) writer(jobs <-chan job) {
	defer close(s.done)
	for j := range jobs {
		switch {
		case j.flushed != nil:
			close(j.flushed)
		case j.e != nil:
			s.writeEntry(j.key, j.e, j.record)
		case j.record != nil:
			s.mu.Lock()
			s.recordLocked(*j.record)
			s.mu.Unlock()
		case j.forget != 0:
			s.mu.Lock()
			n := len(s.man.Pools)
			s.man.Pools = slices.DeleteFunc(s.man.Pools, func(r Record) bool { return r.ID == j.forget })
			if len(s.man.Pools) != n {
				s.saveManifestLocked()
			}
			s.mu.Unlock()
		}
	}
}

func (s *Store) writeEntry(k Key, e *ramEntry, r *Record) {
	b := encode(s.cfg.Model, e.meta, e.payload)
	size := int64(len(b))
	s.mu.Lock()
	for s.diskBytes+size > s.cfg.DiskBytes && s.dropDiskLRU(k) {
	}
	s.mu.Unlock()
	err := atomicWrite(s.cfg.Dir, k.String()+".kv", b)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pending[k] == e {
		delete(s.pending, k)
	}
	if err != nil {
		s.stats.DiskErrors++
		reason := "io"
		if errors.Is(err, syscall.ENOSPC) {
			reason = "disk full"
		}
		s.logOnce("pool tier disk write failed; the pool will be prefilled when needed", "reason", reason, "err", err)
		return
	}
	if old := s.disk[k]; old != nil {
		s.diskBytes -= old.size
	}
	s.disk[k] = &diskEntry{size: size, used: s.tick()}
	s.diskBytes += size
	if r != nil {
		s.recordLocked(*r)
	}
}

func (s *Store) recordLocked(r Record) {
	s.man.Pools = slices.DeleteFunc(s.man.Pools, func(o Record) bool { return o.ID == r.ID })
	s.man.Pools = append(s.man.Pools, r)
	slices.SortFunc(s.man.Pools, func(a, b Record) int { return a.ID - b.ID })
	if r.ID >= s.man.IDFloor {
		s.man.IDFloor = r.ID + idBlock
	}
	s.saveManifestLocked()
}

func (s *Store) saveManifestLocked() {
	if err := s.writeManifest(); err != nil {
		s.stats.DiskErrors++
		s.logOnce("pool manifest write failed; recorded pools may not survive a restart", "err", err)
	}
}

func (s *Store) writeManifest() error {
	b, err := json.MarshalIndent(s.man, "", " ")
	if err != nil {
		return err
	}
	return atomicWrite(s.cfg.Dir, manifestName, b)
}

// dropDiskLRU removes the least recently used disk entry that is not kept (and not
// except); false when there is none.
func (s *Store) dropDiskLRU(except Key) bool {
	var victim Key
	var v *diskEntry
	for k, e := range s.disk {
		if k != except && !s.kept[k] && (v == nil || e.used < v.used) {
			victim, v = k, e
		}
	}
	if v == nil {
		return false
	}
	s.dropDisk(victim)
	return true
}

func (s *Store) dropDisk(k Key) {
	if e := s.disk[k]; e != nil {
		s.diskBytes -= e.size
		delete(s.disk, k)
		if s.diskOff == "" {
			_ = os.Remove(s.path(k))
		}
	}
}

// readEntry reads and verifies k's file.
func (s *Store) readEntry(k Key, want *Meta) ([]byte, error) {
	crashPoint("read", k.String()+".kv")
	b, err := os.ReadFile(s.path(k))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, miss(MissAbsent, "%v", err)
		}
		return nil, miss(MissIO, "%v", err)
	}
	_, payload, err := decode(b, s.cfg.Model, want)
	return payload, err
}

func (s *Store) readEntryMeta(k Key) (Meta, []byte, error) {
	b, err := os.ReadFile(s.path(k))
	if err != nil {
		return Meta{}, nil, miss(MissIO, "%v", err)
	}
	return decode(b, s.cfg.Model, nil)
}

// WriteFileAtomic writes dir/name as a whole or not at all: temporary file, fsync,
// rename, fsync of the directory.
func WriteFileAtomic(dir, name string, b []byte) error { return atomicWrite(dir, name, b) }

func atomicWrite(dir, name string, b []byte) error {
	f, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		crashPoint("write", name)
		err = os.Rename(tmp, filepath.Join(dir, name))
	}
	if err != nil {
		_ = os.Remove(tmp)
		return err
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}
