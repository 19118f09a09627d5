package tier

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Pool records (issue 45). A recorded pool's record — id, parent, branch position,
// every token, pin, prefix_hash and admission policy — is a small file of its own,
// pool-<id>.rec, apart from its KV entry (<key>.kv): the KV can always be computed
// again from the tokens, the record is the one thing that cannot. So a damaged or
// missing entry costs a prefill, never the pool; a damaged record is reported by id
// (Lost), never skipped in silence. pools.json lists the recorded ids (so a record
// that disappeared is reported too) and the pool id floor, under a CRC-32C of its own.
//
// Record file layout (little-endian), the entry format's discipline:
//
//	magic "PKVPOOL1" | u32 header length | header JSON | tokens (u32 each) | u32 CRC-32C
//
// The CRC covers every byte before it. Written like an entry: temporary file, fsync,
// rename, fsync of the directory.
const (
	recordMagic = "PKVPOOL1"
	recordExt   = ".rec"
	// damagedExt is added to a record that does not verify: it is moved aside (kept for
	// the operator to look at, never read again) and its pool reported lost once.
	damagedExt = ".damaged"
)

// Record is a pool recorded for restarts: everything needed to put it back in the tree
// under its id without its KV.
type Record struct {
	ID     int
	Parent int // 0: a root
	D      int // branch position: the pool's own cells are [D, len(Tokens))
	Tokens []int32
	Pin    bool
	// PrefixHash is the prefix_hash the API showed for the pool (checked again after a
	// restart).
	PrefixHash string
	// Admission is the pool's admission policy when one was set (JSON of the engine's
	// admission.Policy; nil: the default). The tier does not read it.
	Admission json.RawMessage
}

// equal reports whether two records would be written as the same file.
func (r Record) equal(o Record) bool {
	return r.ID == o.ID && r.Parent == o.Parent && r.D == o.D && r.Pin == o.Pin && r.PrefixHash == o.PrefixHash &&
		bytes.Equal(r.Admission, o.Admission) && slices.Equal(r.Tokens, o.Tokens)
}

func (r Record) clone() Record {
	r.Tokens = slices.Clone(r.Tokens)
	r.Admission = bytes.Clone(r.Admission)
	return r
}

// Recovered is a recorded pool read back at Open. InTier: its KV entry is stored and
// verified, so it can be restored; otherwise it is built again by a prefill.
type Recovered struct {
	Record
	InTier bool
}

// Lost is a recorded pool that could not be put back: its id, why (a Miss reason for
// its record, or LostRefused) and the error.
type Lost struct {
	ID     int
	Reason string
	Err    string
}

// LostRefused: the record verified but the server refused the pool (its prefix no
// longer fits the context, say); the record is kept for a later start.
const LostRefused = "refused"

type recordHeader struct {
	Model      string          `json:"model"`
	ID         int             `json:"id"`
	Parent     int             `json:"parent,omitempty"`
	D          int             `json:"d"`
	L          int             `json:"l"`
	Pin        bool            `json:"pin"`
	PrefixHash string          `json:"prefix_hash,omitempty"`
	Admission  json.RawMessage `json:"admission,omitempty"`
}

// recordName is pool id's record file name.
func recordName(id int) string { return "pool-" + strconv.Itoa(id) + recordExt }

// parseRecordName reads the pool id from a record file name.
func parseRecordName(name string) (int, bool) {
	s, ok := strings.CutPrefix(name, "pool-")
	if !ok {
		return 0, false
	}
	if s, ok = strings.CutSuffix(s, recordExt); !ok {
		return 0, false
	}
	id, err := strconv.Atoi(s)
	if err != nil || id <= 0 || strconv.Itoa(id) != s {
		return 0, false
	}
	return id, true
}

func encodeRecord(model string, r Record) []byte {
	hdr, _ := json.Marshal(recordHeader{Model: model, ID: r.ID, Parent: r.Parent, D: r.D, L: len(r.Tokens), Pin: r.Pin,
		PrefixHash: r.PrefixHash, Admission: r.Admission})
	out := make([]byte, 0, len(recordMagic)+4+len(hdr)+4*len(r.Tokens)+4)
	out = append(out, recordMagic...)
	out = binary.LittleEndian.AppendUint32(out, uint32(len(hdr)))
	out = append(out, hdr...)
	for _, t := range r.Tokens {
		out = binary.LittleEndian.AppendUint32(out, uint32(t))
	}
	return binary.LittleEndian.AppendUint32(out, crc32.Checksum(out, castagnoli))
}

// decodeRecord checks a record file written for pool id under model and returns it;
// every check that fails is a *MissError with its reason (truncated, corrupt, foreign).
func decodeRecord(b []byte, model string, id int) (Record, error) {
	if len(b) < len(recordMagic)+4 {
		return Record{}, miss(MissTruncated, "%d bytes is shorter than a record header", len(b))
	}
	if !bytes.Equal(b[:len(recordMagic)], []byte(recordMagic)) {
		return Record{}, miss(MissCorrupt, "bad magic")
	}
	hl := int(binary.LittleEndian.Uint32(b[len(recordMagic):]))
	off := len(recordMagic) + 4
	if hl > 1<<16 {
		return Record{}, miss(MissCorrupt, "header length %d", hl)
	}
	if len(b) < off+hl {
		return Record{}, miss(MissTruncated, "file ends inside the header")
	}
	var h recordHeader
	if err := json.Unmarshal(b[off:off+hl], &h); err != nil {
		return Record{}, miss(MissCorrupt, "header: %v", err)
	}
	off += hl
	if h.L < 1 || h.L > 1<<24 || h.D < 0 || h.D >= h.L || h.ID <= 0 || h.Parent < 0 || (h.Parent == 0 && h.D != 0) {
		return Record{}, miss(MissCorrupt, "header id=%d parent=%d d=%d l=%d", h.ID, h.Parent, h.D, h.L)
	}
	total := off + 4*h.L + 4
	switch {
	case len(b) < total:
		return Record{}, miss(MissTruncated, "%d of %d bytes", len(b), total)
	case len(b) > total:
		return Record{}, miss(MissCorrupt, "%d trailing bytes", len(b)-total)
	}
	if got, sum := crc32.Checksum(b[:total-4], castagnoli), binary.LittleEndian.Uint32(b[total-4:]); got != sum {
		return Record{}, miss(MissCorrupt, "checksum %08x, stored %08x", got, sum)
	}
	if h.Model != model {
		return Record{}, miss(MissForeign, "written for model key %.16s…, this server is %.16s…", h.Model, model)
	}
	if h.ID != id {
		return Record{}, miss(MissCorrupt, "the record of pool %d is named for pool %d", h.ID, id)
	}
	return Record{ID: h.ID, Parent: h.Parent, D: h.D, Tokens: readTokens(b[off:], h.L), Pin: h.Pin, PrefixHash: h.PrefixHash, Admission: h.Admission}, nil
}

// manifest is pools.json: the model key its pools were recorded under, the pool id
// floor and the recorded pool ids, under a CRC-32C of the rest (crc32c computed with
// itself 0), so a flipped digit in an id cannot silently name another pool.
//
// Version 0 (every release before records were kept apart) listed the pools with the
// key of their KV entry instead, the tokens living only in the entry; Open still reads
// it (readManifestV0) and writes the records it can.
type manifest struct {
	Version  int    `json:"version"`
	Model    string `json:"model"`
	IDFloor  int    `json:"id_floor"`
	Recorded []int  `json:"recorded"`
	CRC      uint32 `json:"crc32c"`
	// Pools is version 0's list; never written.
	Pools []recordV0 `json:"pools,omitempty"`
}

// manifestVersion is the manifest format written now.
const manifestVersion = 2

// recordV0 is a pool in a version-0 manifest.
type recordV0 struct {
	ID     int    `json:"id"`
	Parent int    `json:"parent,omitempty"`
	D      int    `json:"d"`
	Key    string `json:"key"`
}

func (m manifest) checksum() uint32 {
	m.CRC, m.Pools = 0, nil
	b, _ := json.Marshal(m)
	return crc32.Checksum(b, castagnoli)
}

func encodeManifest(m manifest) ([]byte, error) {
	m.Version, m.Pools = manifestVersion, nil
	if m.Recorded == nil {
		m.Recorded = []int{}
	}
	m.CRC = m.checksum()
	return json.MarshalIndent(m, "", " ")
}

// decodeManifest parses pools.json; a version-2 file must match its checksum.
func decodeManifest(b []byte) (manifest, error) {
	var m manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return manifest{}, err
	}
	switch {
	case m.Version == 0:
		return m, nil
	case m.Version != manifestVersion:
		return manifest{}, fmt.Errorf("unknown version %d", m.Version)
	case m.checksum() != m.CRC:
		return manifest{}, fmt.Errorf("checksum %08x, stored %08x", m.checksum(), m.CRC)
	}
	return m, nil
}

// Recovered lists the pools earlier runs recorded whose records verified at Open, in
// id order (a parent's id is below its children's).
func (s *Store) Recovered() []Recovered { return slices.Clone(s.recovered) }

// Lost lists the recorded pools that could not be put back after the restart: records
// that did not verify or were missing at Open, and pools the server refused (MarkLost).
func (s *Store) Lost() []Lost {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.lost)
}

// MarkLost reports a recovered pool the server could not put back (LostRefused). Its
// record is kept: a later start (a larger context, say) may take it.
func (s *Store) MarkLost(id int, reason string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.loseLocked(id, reason, err)
}

func (s *Store) loseLocked(id int, reason string, err error) {
	s.lost = append(s.lost, Lost{ID: id, Reason: reason, Err: err.Error()})
	s.log.Error("recorded pool lost: it is not back after the restart and its id answers 404", "pool", id, "reason", reason, "err", err)
}

// Record makes a pool survive restarts: its record is written (unless an identical one
// is) and its KV entry, the KV of r.Tokens[r.D:], too (payload, unless the store holds
// the entry already; without either, the record alone: the pool is prefilled after a
// restart). The entry is kept (never dropped by LRU) while the pool is recorded. It
// reports false when there is no usable disk tier.
func (s *Store) Record(r Record, payload []byte) bool {
	m := Meta{D: r.D, Tokens: r.Tokens}
	k := MakeKey(s.cfg.Model, m.D, m.Tokens)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cfg.Dir == "" || s.diskOff != "" {
		return false
	}
	if s.recs == nil {
		s.recs = map[int]Record{}
	}
	old, had := s.byPool[r.ID]
	s.byPool[r.ID] = k
	if had && old != k {
		s.unkeep(old) // the pool was recorded at another branch position (recovered as a root)
	}
	s.kept[k] = true
	if o, ok := s.recs[r.ID]; !ok || !o.equal(r) {
		r = r.clone()
		s.recs[r.ID] = r
		if !s.enqueueLocked(job{record: &r}) {
			delete(s.recs, r.ID) // a later Record tries again
			return false
		}
	}
	if s.dsk.Has(k) || s.pending[k] != nil {
		return true
	}
	var e *ramEntry
	if p := s.mem.Caps().Peek; p != nil {
		if m, b, ok := p.Peek(k); ok {
			e = &ramEntry{meta: m, payload: b}
		}
	}
	if e == nil && payload != nil {
		e = &ramEntry{meta: Meta{D: r.D, Tokens: slices.Clone(r.Tokens)}, payload: payload}
	}
	if e != nil && s.queueWrite(k, e) {
		s.noteStored(k, e.meta)
	}
	return true
}

// Forget drops pool's record (it was unpinned or released): after a restart it is not
// recovered. Its entry stays as an ordinary LRU entry.
func (s *Store) Forget(pool int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.recs[pool]; !ok {
		return
	}
	delete(s.recs, pool)
	if k, ok := s.byPool[pool]; ok {
		s.unkeep(k)
	}
	if s.cfg.Dir != "" && s.diskOff == "" {
		s.enqueueLocked(job{forget: pool})
	}
}

// Recorded reports whether pool is recorded (or queued to be).
func (s *Store) Recorded(pool int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.recs[pool]
	return ok
}

// unkeep lets LRU drop k's entry unless another recorded pool's entry is k.
func (s *Store) unkeep(k Key) {
	for id := range s.recs {
		if s.byPool[id] == k {
			return
		}
	}
	delete(s.kept, k)
}

// writeRecord writes a pool's record, then lists it in the manifest (writer goroutine):
// a crash between the two leaves an unlisted record, removed at the next Open as an
// unfinished Record.
func (s *Store) writeRecord(r Record) {
	err := atomicWrite(s.cfg.Dir, recordName(r.ID), encodeRecord(s.cfg.Model, r))
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		s.stats.DiskErrors++
		s.logOnce("pool record write failed; the pool may not survive a restart", "pool", r.ID, "err", err)
		if o, ok := s.recs[r.ID]; ok && o.equal(r) {
			delete(s.recs, r.ID) // the next OpRecord tries again
		}
		return
	}
	if slices.Contains(s.man.Recorded, r.ID) && r.ID < s.man.IDFloor {
		return // a new version of a listed record (its admission policy, say)
	}
	if !slices.Contains(s.man.Recorded, r.ID) {
		s.man.Recorded = append(s.man.Recorded, r.ID)
		slices.Sort(s.man.Recorded)
	}
	if r.ID >= s.man.IDFloor {
		s.man.IDFloor = r.ID + idBlock
	}
	s.saveManifestLocked()
}

// dropRecord unlists a pool's record, then removes its file (writer goroutine): a
// crash between the two leaves an unlisted record, removed at the next Open.
func (s *Store) dropRecord(id int) {
	s.mu.Lock()
	n := len(s.man.Recorded)
	s.man.Recorded = slices.DeleteFunc(s.man.Recorded, func(r int) bool { return r == id })
	if len(s.man.Recorded) != n {
		s.saveManifestLocked()
	}
	s.mu.Unlock()
	_ = os.Remove(filepath.Join(s.cfg.Dir, recordName(id)))
}

// readRecords reads pools.json and the records it lists (files: the pool ids with a
// record file) at Open. A record that verifies is recovered whatever its KV entry's
// state (Recovered.InTier says whether the entry verified too); one that does not, or
// is listed and missing, is reported lost (Lost, and a log line) and moved aside. A
// manifest that is missing or does not verify costs the id floor, not the pools: every
// record found is read. A version-0 manifest is taken over (readManifestV0).
func (s *Store) readRecords(files map[int]bool) {
	if s.recs == nil {
		s.recs = map[int]Record{}
	}
	var ids []int
	trusted := false // the listing is valid: a record it does not list is a leftover
	b, err := os.ReadFile(filepath.Join(s.cfg.Dir, manifestName))
	var m manifest
	if err == nil {
		m, err = decodeManifest(b)
	}
	switch {
	case errors.Is(err, os.ErrNotExist):
		if len(files) > 0 {
			s.log.Warn("pool manifest is missing; recovering every pool record found (new pool ids may repeat an earlier run's unrecorded ones)", "records", len(files))
		}
		ids = slices.Collect(maps.Keys(files))
	case err != nil:
		s.log.Warn("pool manifest unreadable; recovering every pool record found (new pool ids may repeat an earlier run's unrecorded ones)", "records", len(files), "err", err)
		ids = slices.Collect(maps.Keys(files))
	case m.Model != s.cfg.Model:
		s.man.IDFloor = m.IDFloor
		s.log.Warn("pool manifest was written for another model, build or cache type; no pools recovered", "model_key", m.Model)
		for _, r := range m.Pools {
			m.Recorded = append(m.Recorded, r.ID)
		}
		for _, id := range m.Recorded {
			s.man.IDFloor = max(s.man.IDFloor, id)
			s.loseLocked(id, MissForeign, errors.New("pools.json was written for another model, build or cache type"))
		}
		return
	case m.Version == 0:
		s.man.IDFloor = m.IDFloor
		s.readManifestV0(m)
		trusted = true
	default:
		s.man.IDFloor = m.IDFloor
		ids, trusted = m.Recorded, true
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	writable := s.diskOff == ""
	for _, id := range ids {
		s.man.IDFloor = max(s.man.IDFloor, id)
		r, err := s.readRecord(id, files[id])
		if err != nil {
			reason := Reason(err)
			s.loseLocked(id, reason, err)
			switch {
			case reason == MissIO:
				s.man.Recorded = append(s.man.Recorded, id) // perhaps readable at the next start
			case reason != MissAbsent && writable:
				name := filepath.Join(s.cfg.Dir, recordName(id))
				_ = os.Rename(name, name+damagedExt)
			}
			continue
		}
		s.recoverRecord(r, nil)
	}
	if trusted && writable {
		for id := range files {
			if !slices.Contains(s.man.Recorded, id) {
				_ = os.Remove(filepath.Join(s.cfg.Dir, recordName(id))) // a Record or Forget a crash cut short
			}
		}
	}
}

// readRecord reads and verifies pool id's record (exists: its file was there).
func (s *Store) readRecord(id int, exists bool) (Record, error) {
	if !exists {
		return Record{}, miss(MissAbsent, "the record %s listed in %s is missing", recordName(id), manifestName)
	}
	b, err := os.ReadFile(filepath.Join(s.cfg.Dir, recordName(id)))
	if err != nil {
		return Record{}, miss(MissIO, "%v", err)
	}
	return decodeRecord(b, s.cfg.Model, id)
}

// recoverRecord puts a verified record among the recovered pools and checks its KV
// entry (inTier non-nil: already checked, with that result). An entry that is missing
// or does not verify is counted as a miss and logged; the pool is kept and will be
// prefilled.
func (s *Store) recoverRecord(r Record, inTier *bool) {
	k := MakeKey(s.cfg.Model, r.D, r.Tokens)
	ok := inTier != nil && *inTier
	if inTier == nil {
		var err error
		if !s.dsk.Has(k) {
			err = miss(MissAbsent, "no entry %s", k)
		} else {
			_, err = s.dsk.Get(k, &Meta{D: r.D, Tokens: r.Tokens})
		}
		if err != nil {
			s.stats.Misses[Reason(err)]++
			s.log.Warn("recorded pool's KV entry does not verify; the pool is kept and will be prefilled", "pool", r.ID, "reason", Reason(err), "err", err)
			s.dropDisk(k)
		}
		ok = err == nil
	}
	s.byPool[r.ID] = k
	s.kept[k] = true
	s.recs[r.ID] = r
	s.man.Recorded = append(s.man.Recorded, r.ID)
	s.recovered = append(s.recovered, Recovered{Record: r, InTier: ok})
}

// readManifestV0 takes over a version-0 manifest, which listed each pool with its KV
// entry's key: its tokens were only in the entry. So, as that version did, each entry
// is verified (parents first) and read for the tokens; a pool whose entry verifies is
// recovered and its record written now (pools.json is rewritten as version 2 by Open),
// and one whose entry does not is lost with it (reported, its tokens being gone). A
// child whose parent is lost still is recovered (the server makes it a root).
func (s *Store) readManifestV0(m manifest) {
	slices.SortFunc(m.Pools, func(a, b recordV0) int { return a.ID - b.ID })
	const why = "a version-0 record: the pool's tokens were only in its KV entry"
	for _, v := range m.Pools {
		s.man.IDFloor = max(s.man.IDFloor, v.ID)
		k, good := parseKey(v.Key)
		if !good {
			s.loseLocked(v.ID, MissCorrupt, fmt.Errorf("%s, and its key is malformed", why))
			continue
		}
		if !s.dsk.Has(k) {
			s.stats.Misses[MissAbsent]++
			s.loseLocked(v.ID, MissAbsent, fmt.Errorf("%s, which is missing", why))
			continue
		}
		meta, _, err := s.readEntryMeta(k)
		if err == nil && meta.D != v.D {
			err = miss(MissForeign, "entry branch position %d, recorded %d", meta.D, v.D)
		}
		if err == nil && MakeKey(s.cfg.Model, meta.D, meta.Tokens) != k {
			err = miss(MissForeign, "entry does not hash to its name")
		}
		if err != nil {
			s.stats.Misses[Reason(err)]++
			s.loseLocked(v.ID, Reason(err), fmt.Errorf("%s, which does not verify: %w", why, err))
			s.dropDisk(k)
			continue
		}
		r := Record{ID: v.ID, Parent: v.Parent, D: v.D, Tokens: meta.Tokens, Pin: true}
		in := true
		s.recoverRecord(r, &in)
		if s.diskOff == "" {
			if err := atomicWrite(s.cfg.Dir, recordName(r.ID), encodeRecord(s.cfg.Model, r)); err != nil {
				// Not listed: the pool's next Record (once it is resident) writes it.
				s.log.Warn("cannot write the record of a pool taken over from a version-0 manifest", "pool", r.ID, "err", err)
				delete(s.recs, r.ID)
				s.man.Recorded = slices.DeleteFunc(s.man.Recorded, func(id int) bool { return id == r.ID })
			}
		}
	}
}
