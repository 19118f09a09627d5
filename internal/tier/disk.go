package tier

import (
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// The disk tier: one file per entry, <key>.kv; one per recorded (pinned) pool,
// pool-<id>.rec (records.go); and pools.json, the manifest of recorded pool ids and the
// pool id floor. Every write is a temporary file that is fsynced, renamed over its name
// and followed by an fsync of the directory, so after a crash at any instant (kill -9,
// power) a name holds a whole old or a whole new file; temporary files left behind are
// removed at the next Open.

const manifestName = "pools.json"

// idBlock is how many pool ids one run may use before a later run could see them
// again: each Open moves the recorded floor up by this much, and recording a pool
// beyond the floor moves it again, so ids are never reused across restarts (a run that
// crashes after creating more than this many unrecorded pools is the exception).
const idBlock = 1 << 20

type job struct {
	key     Key
	e       *ramEntry
	record  *Record // write this pool's record and list it in the manifest
	forget  int     // drop this pool's record (0: none)
	shared  bool    // e goes to the shared level
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

// openDir scans --pool-dir into d (the Store's disk level, still its concrete type:
// what Open finds there is listed before the level is used) and reads the records.
func (s *Store) openDir(d *diskLevel) error {
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
	records := map[int]bool{} // pool ids with a record file
	for _, de := range ents {
		name := de.Name()
		switch {
		case strings.HasPrefix(name, ".tmp-"):
			_ = os.Remove(filepath.Join(dir, name)) // a write a crash interrupted
		case strings.HasSuffix(name, recordExt):
			if id, ok := parseRecordName(name); ok {
				records[id] = true
			}
		case strings.HasSuffix(name, ".kv"):
			k, ok := parseKey(strings.TrimSuffix(name, ".kv"))
			if !ok {
				continue
			}
			if info, err := de.Info(); err == nil {
				// LRU order for what was found: older files first; new uses count above
				// them all (found moves the clock past every file's time).
				d.found(k, info.Size(), info.ModTime().UnixNano())
			}
		}
	}
	// Probe that the directory takes writes: a read-only mount is served from, not
	// written to (every spill then stays in RAM or is dropped, and is counted).
	if f, err := os.CreateTemp(dir, ".tmp-probe-*"); err != nil {
		s.diskOff = err.Error()
		d.readOnly = true
		s.log.Warn("pool tier directory is not writable; reading it only", "dir", dir, "err", err)
	} else {
		f.Close()
		_ = os.Remove(f.Name())
	}
	s.readRecords(records)
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

// Durable reports whether pools can be recorded for restarts (a writable directory).
func (s *Store) Durable() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cfg.Dir != "" && s.diskOff == ""
}

// IDFloor is the highest pool id an earlier run may have used: this run's ids start
// above it (0 without a disk tier).
func (s *Store) IDFloor() int { return s.floor }

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
func (s *Store) queueWrite(k Key, e *ramEntry) bool {
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
	if !s.enqueueLocked(job{key: k, e: e}) {
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
		case j.e != nil && j.shared:
			s.writeShared(j.key, j.e)
		case j.e != nil:
			s.writeEntry(j.key, j.e)
		case j.record != nil:
			s.writeRecord(*j.record)
		case j.forget != 0:
			s.dropRecord(j.forget)
		}
	}
}

func (s *Store) writeEntry(k Key, e *ramEntry) {
	size := encodedLen(s.cfg.Model, e.meta, e.payload)
	s.mu.Lock()
	for s.diskBytes()+size > s.cfg.DiskBytes && s.dropDiskLRU(k) {
	}
	s.mu.Unlock()
	err := s.dsk.Put(k, e.meta, e.payload)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pending[k] == e {
		delete(s.pending, k)
	}
	s.wrote(s.dsk, err)
	if err != nil {
		s.noteGone(k)
		s.stats.DiskErrors++
		reason := "io"
		if errors.Is(err, syscall.ENOSPC) {
			reason = "disk full"
		}
		s.logOnce("pool tier disk write failed; the pool will be prefilled when needed", "reason", reason, "err", err)
	}
}

// writeShared writes an entry to the shared level (writer goroutine).
func (s *Store) writeShared(k Key, e *ramEntry) {
	err := s.shr.Put(k, e.meta, e.payload)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shPending[k] == e {
		delete(s.shPending, k)
	}
	s.wrote(s.shr, err)
	if err != nil {
		s.logOnce("shared tier write failed; other replicas will prefill this entry", "err", err)
	}
}

// diskBytes is what the disk level holds.
func (s *Store) diskBytes() int64 { b, _ := s.dsk.Usage(); return b }

func (s *Store) saveManifestLocked() {
	if err := s.writeManifest(); err != nil {
		s.stats.DiskErrors++
		s.logOnce("pool manifest write failed; recorded pools may not survive a restart", "err", err)
	}
}

func (s *Store) writeManifest() error {
	b, err := encodeManifest(s.man)
	if err != nil {
		return err
	}
	return atomicWrite(s.cfg.Dir, manifestName, b)
}

// dropDiskLRU removes the least recently used disk entry that is not kept (and not
// except); false when there is none.
func (s *Store) dropDiskLRU(except Key) bool {
	victim, ok := s.dsk.Oldest(func(k Key) bool { return k == except || s.kept[k] })
	if !ok {
		return false
	}
	s.dropDisk(victim)
	return true
}

// dropDisk removes k's entry from the disk level (its file too, unless the directory
// is read-only).
func (s *Store) dropDisk(k Key) {
	s.dsk.Delete(k)
	s.noteGone(k)
}

// readEntryMeta reads k's entry from the disk level with its branch position and tokens.
func (s *Store) readEntryMeta(k Key) (Meta, []byte, error) {
	r := s.dsk.Caps().Read
	if r == nil {
		return Meta{}, nil, miss(MissIO, "the disk level does not read whole entries")
	}
	return r.ReadEntry(k)
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
