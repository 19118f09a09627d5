package tier

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"slices"
)

// Key names one stored entry: a sha256 over the model key (everything that makes KV
// bytes valid besides the tokens: ModelKey), the branch position and the tokens. Two
// pools with the same key hold interchangeable KV; any other difference is a different
// key, so a lookup can never return another model's or another prefix's bytes.
type Key [32]byte

// String is the key in hex, which is also the entry's file name (without ".kv").
func (k Key) String() string { return hex.EncodeToString(k[:]) }

// MakeKey is the key of the KV of tokens[d:] (positions [d, len)) computed after
// tokens[:d], under model.
func MakeKey(model string, d int, tokens []int32) Key {
	return tagKey("polykv-tier-v1", model, d, tokens)
}

// StartKey names a chunk start: the model key, the position d and the d tokens before
// it. A fleet level lists under it what is stored from there (endsIndex). Its own tag
// keeps it apart from every entry's name.
func StartKey(model string, d int, prefix []int32) Key {
	return tagKey("polykv-tier-start-v1", model, d, prefix)
}

// tagKey hashes tag, model, d and tokens (their count, then each little-endian).
func tagKey(tag, model string, d int, tokens []int32) Key {
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%s\x00%d\x00%d\x00", tag, model, d, len(tokens))
	var b [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:], uint32(t))
		h.Write(b[:])
	}
	var k Key
	h.Sum(k[:0])
	return k
}

// Meta is what an entry is the KV of: tokens [0, L) with the stored cells at [D, L).
type Meta struct {
	D      int
	Tokens []int32
}

// Entry file layout (all integers little-endian):
//
//	magic "PKVTIER1" | u32 header length | header JSON | tokens (u32 each) | payload | u32 CRC-32C
//
// The CRC covers every byte before it, so a torn write (a prefix of the file), a flipped
// byte or a file cut short is detected before llama.cpp ever sees the payload. Writes go
// to a temporary file that is fsynced and renamed (disk.go), so a crash leaves either the
// whole old state or the whole new entry, never a half one under the entry's name.
const magic = "PKVTIER1"

type header struct {
	Model      string `json:"model"`
	D          int    `json:"d"`
	L          int    `json:"l"`
	PayloadLen int    `json:"payload_len"`
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Miss reasons: why a lookup found no usable entry (metrics label them).
const (
	MissAbsent    = "absent"    // nothing stored under the key (never spilled, or dropped by LRU)
	MissTruncated = "truncated" // the file is shorter than its header says (torn write)
	MissCorrupt   = "corrupt"   // bad magic, header or checksum
	MissForeign   = "foreign"   // another model, build, cache type or prefix
	MissIO        = "io"        // the file could not be read
	MissRejected  = "rejected"  // llama.cpp refused the bytes (layout) or found no cells
)

// MissError is a lookup or load that found no usable entry; Reason is one of the Miss
// constants.
type MissError struct {
	Reason string
	Err    error
}

func (e *MissError) Error() string { return fmt.Sprintf("tier miss (%s): %v", e.Reason, e.Err) }

func (e *MissError) Unwrap() error { return e.Err }

func miss(reason string, format string, args ...any) error {
	return &MissError{Reason: reason, Err: fmt.Errorf(format, args...)}
}

// Reason is err's miss reason (MissIO for an error that is not a MissError).
func Reason(err error) string {
	var m *MissError
	if errors.As(err, &m) {
		return m.Reason
	}
	return MissIO
}

// encode lays an entry out as a file.
func encode(model string, m Meta, payload []byte) []byte {
	hdr := entryHeader(model, m, payload)
	out := make([]byte, 0, fileLen(hdr, m, payload))
	out = append(out, magic...)
	out = binary.LittleEndian.AppendUint32(out, uint32(len(hdr)))
	out = append(out, hdr...)
	for _, t := range m.Tokens {
		out = binary.LittleEndian.AppendUint32(out, uint32(t))
	}
	out = append(out, payload...)
	return binary.LittleEndian.AppendUint32(out, crc32.Checksum(out, castagnoli))
}

// encodedLen is the length of encode's file, without laying it out: the disk writer
// makes room within the budget for the exact size before the level writes it.
func encodedLen(model string, m Meta, payload []byte) int64 {
	return int64(fileLen(entryHeader(model, m, payload), m, payload))
}

// entryHeader is the JSON header of an entry file.
func entryHeader(model string, m Meta, payload []byte) []byte {
	hdr, _ := json.Marshal(header{Model: model, D: m.D, L: len(m.Tokens), PayloadLen: len(payload)})
	return hdr
}

// fileLen is the length of an entry file: magic, header length, header, tokens,
// payload, CRC-32C.
func fileLen(hdr []byte, m Meta, payload []byte) int {
	return len(magic) + 4 + len(hdr) + 4*len(m.Tokens) + len(payload) + 4
}

// decode checks a file against what the caller expects (model, and m when it is not
// nil) and returns the entry. Every check that fails is a miss with its reason.
func decode(b []byte, model string, want *Meta) (Meta, []byte, error) {
	h, off, err := decodeHeader(b)
	if err != nil {
		return Meta{}, nil, err
	}
	total := off + 4*h.L + h.PayloadLen + 4
	switch {
	case len(b) < total:
		return Meta{}, nil, miss(MissTruncated, "%d of %d bytes", len(b), total)
	case len(b) > total:
		return Meta{}, nil, miss(MissCorrupt, "%d trailing bytes", len(b)-total)
	}
	if got, sum := crc32.Checksum(b[:total-4], castagnoli), binary.LittleEndian.Uint32(b[total-4:]); got != sum {
		return Meta{}, nil, miss(MissCorrupt, "checksum %08x, stored %08x", got, sum)
	}
	if h.Model != model {
		return Meta{}, nil, miss(MissForeign, "written for model key %.16s…, this server is %.16s…", h.Model, model)
	}
	m := Meta{D: h.D, Tokens: readTokens(b[off:], h.L)}
	off += 4 * h.L
	if want != nil && (want.D != m.D || !slices.Equal(want.Tokens, m.Tokens)) {
		return Meta{}, nil, miss(MissForeign, "the entry holds another prefix (d=%d, %d tokens)", m.D, len(m.Tokens))
	}
	return m, b[off : off+h.PayloadLen], nil
}

// readTokens reads n tokens (u32 little-endian each) from the start of b, which holds
// them (entry and record files).
func readTokens(b []byte, n int) []int32 {
	toks := make([]int32, n)
	for i := range toks {
		toks[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return toks
}

// decodeHeader reads an entry's magic and header from the start of b and returns the
// header and the offset of the tokens after it.
func decodeHeader(b []byte) (header, int, error) {
	if len(b) < len(magic)+4 {
		return header{}, 0, miss(MissTruncated, "%d bytes is shorter than a header", len(b))
	}
	if !bytes.Equal(b[:len(magic)], []byte(magic)) {
		return header{}, 0, miss(MissCorrupt, "bad magic")
	}
	hl := int(binary.LittleEndian.Uint32(b[len(magic):]))
	off := len(magic) + 4
	if hl > 1<<16 {
		return header{}, 0, miss(MissCorrupt, "header length %d", hl)
	}
	if len(b) < off+hl {
		return header{}, 0, miss(MissTruncated, "file ends inside the header")
	}
	var h header
	if err := json.Unmarshal(b[off:off+hl], &h); err != nil {
		return header{}, 0, miss(MissCorrupt, "header: %v", err)
	}
	if h.L < 1 || h.D < 0 || h.D >= h.L || h.PayloadLen < 1 || h.L > 1<<24 {
		return header{}, 0, miss(MissCorrupt, "header d=%d l=%d payload=%d", h.D, h.L, h.PayloadLen)
	}
	return h, off + hl, nil
}

// readHead reads what the entry file at path is the KV of (header and tokens, not the
// KV itself, which is not checked here: a load checks the whole file), and checks that
// it was written under model and is named by its own key k.
func readHead(path, model string, k Key) (Meta, error) {
	f, err := os.Open(path)
	if err != nil {
		return Meta{}, miss(MissIO, "%v", err)
	}
	defer f.Close()
	b := make([]byte, len(magic)+4)
	if _, err := io.ReadFull(f, b); err != nil {
		return Meta{}, miss(MissTruncated, "%v", err)
	}
	hl := int(binary.LittleEndian.Uint32(b[len(magic):]))
	if hl > 1<<16 {
		return Meta{}, miss(MissCorrupt, "header length %d", hl)
	}
	b = append(b, make([]byte, hl)...)
	if _, err := io.ReadFull(f, b[len(magic)+4:]); err != nil {
		return Meta{}, miss(MissTruncated, "%v", err)
	}
	h, _, err := decodeHeader(b)
	if err != nil {
		return Meta{}, err
	}
	if h.Model != model {
		return Meta{}, miss(MissForeign, "written for model key %.16s…, this server is %.16s…", h.Model, model)
	}
	tb := make([]byte, 4*h.L)
	if _, err := io.ReadFull(f, tb); err != nil {
		return Meta{}, miss(MissTruncated, "%v", err)
	}
	m := Meta{D: h.D, Tokens: readTokens(tb, h.L)}
	if MakeKey(model, m.D, m.Tokens) != k {
		return Meta{}, miss(MissCorrupt, "the file's tokens are not its name's")
	}
	return m, nil
}

// EncodeFile lays out a file holding the KV of m (a session's saved slot, say) under
// model, in the entry format: header, tokens, payload and a CRC-32C.
func EncodeFile(model string, m Meta, payload []byte) []byte { return encode(model, m, payload) }

// DecodeFile checks a file written by EncodeFile (checksum, model key) and returns what
// it holds, or a *MissError with the reason.
func DecodeFile(b []byte, model string) (Meta, []byte, error) { return decode(b, model, nil) }
