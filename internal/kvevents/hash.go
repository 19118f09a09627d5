package kvevents

import (
	"encoding/binary"
	"hash/fnv"
)

// Block hashes are computed exactly as llm-d's router computes the keys of a request's
// blocks (llm-d-router, pkg/kvcache/kvblock/token_processor.go, the default
// "cbor-fnv" algorithm, at commit ebab687927f5331c1b39defcb579a07951bce56c):
//
//	seed  = FNV-64a(HashSeed)
//	init  = FNV-64a(CBOR([seed, null, model]))
//	key_k = FNV-64a(CBOR([key_{k-1}, tokens of block k, null]))   key_{-1} = init
//
// with CBOR in canonical form (smallest integer encodings) and tokens as unsigned
// integers. So the hash PolyKV announces for a block is the very key the router looks
// up for the same tokens of a request naming the same model: the router maps an
// event's engine keys to keys it recomputes from the event's tokens anyway, but with
// both equal nothing depends on that mapping, and a block's hash chains every token
// before it, the same on every replica.

// cborHead appends a CBOR item head: major type mt with argument v, smallest form.
func cborHead(b []byte, mt byte, v uint64) []byte {
	mt <<= 5
	switch {
	case v < 24:
		return append(b, mt|byte(v))
	case v <= 0xff:
		return append(b, mt|24, byte(v))
	case v <= 0xffff:
		return binary.BigEndian.AppendUint16(append(b, mt|25), uint16(v))
	case v <= 0xffffffff:
		return binary.BigEndian.AppendUint32(append(b, mt|26), uint32(v))
	default:
		return binary.BigEndian.AppendUint64(append(b, mt|27), v)
	}
}

const cborNull = 0xf6

func fnv64a(b []byte) uint64 {
	h := fnv.New64a()
	_, _ = h.Write(b)
	return h.Sum64()
}

// InitHash is the parent of a prefix's first block: the seed and the model name.
func InitHash(seed, model string) uint64 {
	b := cborHead(nil, 4, 3)
	b = cborHead(b, 0, fnv64a([]byte(seed)))
	b = append(b, cborNull)
	b = cborHead(b, 3, uint64(len(model)))
	b = append(b, model...)
	return fnv64a(b)
}

// BlockHash is the key of a block holding tokens whose preceding block's key is parent.
func BlockHash(parent uint64, tokens []int32) uint64 {
	b := make([]byte, 0, 16+5*len(tokens))
	b = cborHead(b, 4, 3)
	b = cborHead(b, 0, parent)
	b = cborHead(b, 4, uint64(len(tokens)))
	for _, t := range tokens {
		b = cborHead(b, 0, uint64(uint32(t)))
	}
	b = append(b, cborNull)
	return fnv64a(b)
}

// BlockHashes are the keys of tokens' full blocks of bs tokens, chained from parent.
func BlockHashes(parent uint64, tokens []int32, bs int) []uint64 {
	out := make([]uint64, 0, len(tokens)/bs)
	for k := 0; (k+1)*bs <= len(tokens); k++ {
		parent = BlockHash(parent, tokens[k*bs:(k+1)*bs])
		out = append(out, parent)
	}
	return out
}
