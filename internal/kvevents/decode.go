package kvevents

import (
	"encoding/binary"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Event is one decoded KV event.
type Event struct {
	Tag       string
	Hashes    []uint64
	Parent    *uint64
	Tokens    []int32
	BlockSize int
	// Medium is the event's medium as sent (MediumCells, MediumTier; "" when absent,
	// which llm-d reads as "gpu").
	Medium string
}

// Message is one decoded ZMQ message.
type Message struct {
	Topic  string
	Seq    uint64
	TS     float64
	Events []Event
}

// Decode parses the three frames of a message the way llm-d's vLLM adapter does
// (positional arrays decoded generically, integers of any msgpack width), so tests
// and tools read exactly what a router would.
func Decode(frames [][]byte) (Message, error) {
	var m Message
	if len(frames) != 3 || len(frames[1]) != 8 {
		return m, fmt.Errorf("want 3 frames with an 8-byte sequence number, got %d frames", len(frames))
	}
	m.Topic, m.Seq = string(frames[0]), binary.BigEndian.Uint64(frames[1])
	var batch []any
	if err := msgpack.Unmarshal(frames[2], &batch); err != nil {
		return m, fmt.Errorf("payload: %w", err)
	}
	if len(batch) < 2 {
		return m, fmt.Errorf("payload: want [ts, events, dp_rank], got %d elements", len(batch))
	}
	ts, ok := batch[0].(float64)
	if !ok {
		return m, fmt.Errorf("payload: ts is %T, not a float", batch[0])
	}
	m.TS = ts
	evs, ok := batch[1].([]any)
	if !ok {
		return m, fmt.Errorf("payload: events is %T, not an array", batch[1])
	}
	for i, raw := range evs {
		f, ok := raw.([]any)
		if !ok || len(f) == 0 {
			return m, fmt.Errorf("event %d: not a tagged array", i)
		}
		var ev Event
		if ev.Tag, ok = f[0].(string); !ok {
			return m, fmt.Errorf("event %d: tag is %T", i, f[0])
		}
		var err error
		switch ev.Tag {
		case TagBlockStored:
			if len(f) < 5 {
				return m, fmt.Errorf("event %d: BlockStored has %d fields, want at least 5", i, len(f))
			}
			if ev.Hashes, err = hashes(f[1]); err != nil {
				return m, fmt.Errorf("event %d: block_hashes: %w", i, err)
			}
			if f[2] != nil {
				h, err := hash(f[2])
				if err != nil {
					return m, fmt.Errorf("event %d: parent: %w", i, err)
				}
				ev.Parent = &h
			}
			toks, err := uints(f[3])
			if err != nil {
				return m, fmt.Errorf("event %d: token_ids: %w", i, err)
			}
			for _, t := range toks {
				ev.Tokens = append(ev.Tokens, int32(t))
			}
			bs, err := toUint(f[4])
			if err != nil {
				return m, fmt.Errorf("event %d: block_size: %w", i, err)
			}
			ev.BlockSize = int(bs)
			if len(f) > 6 && f[6] != nil {
				if ev.Medium, ok = f[6].(string); !ok {
					return m, fmt.Errorf("event %d: medium is %T", i, f[6])
				}
			}
		case TagBlockRemoved:
			if len(f) < 2 {
				return m, fmt.Errorf("event %d: BlockRemoved without hashes", i)
			}
			if ev.Hashes, err = hashes(f[1]); err != nil {
				return m, fmt.Errorf("event %d: block_hashes: %w", i, err)
			}
			if len(f) > 2 && f[2] != nil {
				if ev.Medium, ok = f[2].(string); !ok {
					return m, fmt.Errorf("event %d: medium is %T", i, f[2])
				}
			}
		case TagAllBlocksCleared:
		default:
			return m, fmt.Errorf("event %d: unknown tag %q", i, ev.Tag)
		}
		m.Events = append(m.Events, ev)
	}
	return m, nil
}

func uints(raw any) ([]uint64, error) {
	arr, ok := raw.([]any)
	if !ok {
		return nil, fmt.Errorf("%T is not an array", raw)
	}
	out := make([]uint64, len(arr))
	for i, v := range arr {
		n, err := toUint(v)
		if err != nil {
			return nil, err
		}
		out[i] = n
	}
	return out, nil
}

func toUint(v any) (uint64, error) {
	switch n := v.(type) {
	case uint64:
		return n, nil
	case uint32:
		return uint64(n), nil
	case uint16:
		return uint64(n), nil
	case uint8:
		return uint64(n), nil
	case int64:
		return uint64(n), nil
	case int32:
		return uint64(n), nil
	case int16:
		return uint64(n), nil
	case int8:
		return uint64(n), nil
	}
	return 0, fmt.Errorf("%T is not an integer", v)
}

// hash accepts only what llm-d's getHashAsUint64 accepts: a uint64 or int64 (a hash
// sent as a small msgpack integer would decode narrower and be refused there).
func hash(v any) (uint64, error) {
	switch n := v.(type) {
	case uint64:
		return n, nil
	case int64:
		return uint64(n), nil
	}
	return 0, fmt.Errorf("hash decodes as %T; llm-d accepts uint64, int64 or bytes", v)
}

func hashes(raw any) ([]uint64, error) {
	arr, ok := raw.([]any)
	if !ok {
		return nil, fmt.Errorf("%T is not an array", raw)
	}
	out := make([]uint64, len(arr))
	for i, v := range arr {
		h, err := hash(v)
		if err != nil {
			return nil, err
		}
		out[i] = h
	}
	return out, nil
}
