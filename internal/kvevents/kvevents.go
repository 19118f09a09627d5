// Package kvevents publishes the KV-cache events llm-d's precise-prefix scorer consumes:
// which full token blocks of which prefixes this replica holds. The wire format is
// vLLM's (what llm-d's kvevents package decodes): a ZMQ PUB socket sends three frames
// per message, the topic "kv@<pod-id>@<model>", an 8-byte big-endian sequence number,
// and a msgpack payload [ts, [events...], dp_rank], each event a positional array
// tagged BlockStored, BlockRemoved or AllBlocksCleared.
//
// What is announced: the pools (shared prefixes) the engine reports through
// engine.PrefixObserver, as full blocks only. Sessions' own cells are not announced:
// PolyKV reuses a session's cells only for that same session (session affinity routes
// those), and automatic prefix sharing across requests (issue 12) is not built yet.
//
// Block hashes are the engine's opaque keys, which llm-d maps to its own recomputed
// keys from the token ids: block k of a prefix is named by pool.RollingHash at its
// last token, a content address of the whole prefix [0, (k+1)·B). So the hash of a
// block already chains its parent's, the same tokens give the same hash on every
// replica and in every pool, and a child pool's first block names its parent block by
// the same value the parent announced. Each pool announces the blocks it owns: from
// the block holding its branch position D to its last full block; the blocks before
// are its ancestors'. llm-d reference-counts repeated announcements of one hash, so a
// block two pools both announce (a branch whose first block happens to equal the
// parent's) is removed from its index only when both have removed it.
package kvevents

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/polykv/polykv/internal/engine"
)

// DefaultBlockSize is 16 tokens: vLLM's default block size and the default
// blockSizeTokens of llm-d's token processor, so the EPP's recomputed block keys and
// ours line up one to one without configuration, and a prefix is matched to within 16
// tokens. A block costs 8 bytes of hash and 4 per token in an event, and pools are few.
const DefaultBlockSize = 16

// Event tags, as vLLM and llm-d name them.
const (
	TagBlockStored      = "BlockStored"
	TagBlockRemoved     = "BlockRemoved"
	TagAllBlocksCleared = "AllBlocksCleared"
)

// Blocks is the run of full blocks a pool owns.
type Blocks struct {
	Hashes []uint64 // one per block, in order; each chains all tokens before it
	Parent *uint64  // the hash of the block before the first (nil: the run starts at 0)
	Tokens []int32  // len(Hashes)·blockSize tokens
}

// OwnedBlocks is the full blocks of c that c's pool owns: block k covers tokens
// [k·bs, (k+1)·bs); the run starts at the block containing D (blocks wholly before D
// are the parent's) and ends at the last full block. A partial last block is left
// out: the router only counts full blocks.
func OwnedBlocks(c engine.PrefixChange, bs int) Blocks {
	var b Blocks
	if bs <= 0 {
		return b
	}
	first, end := c.D/bs, len(c.Tokens)/bs
	if first >= end || len(c.Hash) != len(c.Tokens) {
		return b
	}
	for k := first; k < end; k++ {
		b.Hashes = append(b.Hashes, c.Hash[(k+1)*bs-1])
	}
	if first > 0 {
		h := c.Hash[first*bs-1]
		b.Parent = &h
	}
	b.Tokens = c.Tokens[first*bs : end*bs]
	return b
}

// Config configures a Publisher.
type Config struct {
	// Endpoint is where the PUB socket binds, e.g. tcp://127.0.0.2:5557 (the EPP dials
	// tcp://<pod address>:5557 by default).
	Endpoint  string
	BlockSize int    // tokens per block (DefaultBlockSize when 0)
	PodID     string // topic's pod id (the EPP keys events by the address it dialled)
	Model     string // topic's model name: the name requests use
	Log       *slog.Logger
}

type change struct {
	stored bool
	c      engine.PrefixChange
}

// Publisher is an engine.PrefixObserver that sends KV events over ZMQ. The engine
// goroutine only queues changes; a goroutine of the publisher encodes and sends them.
//
// A PUB socket drops what it sends while nobody is subscribed, and a subscriber that
// joins later sees nothing of the past. So the publisher keeps a mirror of the pools
// that are resident and, each time the socket goes from no subscriber to some, it
// sends a snapshot first: AllBlocksCleared, then BlockStored for every resident pool
// (parents before children), then live changes. A router that starts after PolyKV, or
// restarts, so learns the whole state without vLLM's replay socket. Sequence numbers
// count the messages sent, from 0 for the first subscriber.
type Publisher struct {
	cfg      Config
	topic    string
	sock     zmq4.Socket
	ch       chan change
	done     chan struct{}
	closing  sync.Once
	seq      uint64           // next sequence number (publisher goroutine only)
	live     bool             // someone was subscribed at the last look
	resident map[int]resident // pool id → its stored prefix (publisher goroutine only)
	order    uint64
	// Sent, Snapshots and Dropped count messages sent, snapshots sent to newly joined
	// subscribers, and changes lost to a full queue.
	Sent      atomic.Uint64
	Snapshots atomic.Uint64
	Dropped   atomic.Uint64
}

type resident struct {
	c     engine.PrefixChange
	order uint64 // when it was stored: a parent is always stored before its child
}

// queueLen bounds the changes waiting to be sent. A change is one pool becoming
// resident or being dropped, so even a burst is a few hundred; a full queue drops
// (and counts) rather than block the engine.
const queueLen = 1 << 14

// Open binds the PUB socket. The first subscriber receives AllBlocksCleared as
// message 0, so a router forgets whatever an earlier run of this replica announced.
func Open(cfg Config) (*Publisher, error) {
	if cfg.BlockSize == 0 {
		cfg.BlockSize = DefaultBlockSize
	}
	if cfg.BlockSize < 1 {
		return nil, fmt.Errorf("kv block size must be positive, got %d", cfg.BlockSize)
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	sock := zmq4.NewPub(context.Background())
	if err := sock.Listen(cfg.Endpoint); err != nil {
		_ = sock.Close()
		return nil, fmt.Errorf("kv events: bind %s: %w", cfg.Endpoint, err)
	}
	p := &Publisher{cfg: cfg, topic: "kv@" + cfg.PodID + "@" + cfg.Model, sock: sock,
		ch: make(chan change, queueLen), done: make(chan struct{}), resident: map[int]resident{}}
	go p.run()
	return p, nil
}

// Topic is the topic every message carries.
func (p *Publisher) Topic() string { return p.topic }

// BlockSize is the block size in tokens.
func (p *Publisher) BlockSize() int { return p.cfg.BlockSize }

// PrefixStored implements engine.PrefixObserver.
func (p *Publisher) PrefixStored(c engine.PrefixChange) { p.enqueue(change{stored: true, c: c}) }

// PrefixRemoved implements engine.PrefixObserver.
func (p *Publisher) PrefixRemoved(c engine.PrefixChange) { p.enqueue(change{c: c}) }

func (p *Publisher) enqueue(ch change) {
	select {
	case p.ch <- ch:
	default:
		if p.Dropped.Add(1) == 1 {
			p.cfg.Log.Warn("kv events: queue full, dropping changes (the router's view of this replica is now stale)")
		}
	}
}

// Close sends what is queued and closes the socket. The engine must not report
// changes after Close (close the engine first).
func (p *Publisher) Close() error {
	p.closing.Do(func() { close(p.ch) })
	<-p.done
	return p.sock.Close()
}

type subscribed interface{ Topics() []string }

// subscriberPoll is how often the publisher looks for a newly joined subscriber while
// no change arrives.
const subscriberPoll = 20 * time.Millisecond

func (p *Publisher) run() {
	defer close(p.done)
	tick := time.NewTicker(subscriberPoll)
	defer tick.Stop()
	for {
		select {
		case ch, ok := <-p.ch:
			if !ok {
				return
			}
			p.look() // a snapshot, if any, goes out before this change
			var events []any
			events = p.take(events, ch)
			// Batch what else is already queued into the same message.
		more:
			for len(events) < 256 {
				select {
				case next, ok := <-p.ch:
					if !ok {
						break more
					}
					events = p.take(events, next)
				default:
					break more
				}
			}
			if p.live && len(events) > 0 {
				p.send(events)
			}
		case <-tick.C:
			p.look()
		}
	}
}

// look notices subscribers joining (and sends them the snapshot) or all leaving.
func (p *Publisher) look() {
	s, ok := p.sock.(subscribed)
	has := !ok || len(s.Topics()) > 0
	switch {
	case has && !p.live:
		p.live = true
		p.snapshot()
	case !has:
		p.live = false
	}
}

// snapshot sends AllBlocksCleared and the resident pools, parents first.
func (p *Publisher) snapshot() {
	pools := make([]resident, 0, len(p.resident))
	for _, r := range p.resident {
		pools = append(pools, r)
	}
	slices.SortFunc(pools, func(a, b resident) int { return cmp.Compare(a.order, b.order) })
	events := []any{[]any{TagAllBlocksCleared}}
	for _, r := range pools {
		events = p.events(events, change{stored: true, c: r.c})
	}
	p.send(events)
	p.Snapshots.Add(1)
}

// take applies ch to the mirror and appends its event.
func (p *Publisher) take(events []any, ch change) []any {
	if ch.stored {
		p.order++
		p.resident[ch.c.Pool] = resident{c: ch.c, order: p.order}
	} else {
		delete(p.resident, ch.c.Pool)
	}
	return p.events(events, ch)
}

// events appends ch's event (none when the pool owns no full block).
func (p *Publisher) events(out []any, ch change) []any {
	b := OwnedBlocks(ch.c, p.cfg.BlockSize)
	if len(b.Hashes) == 0 {
		return out
	}
	if !ch.stored {
		return append(out, []any{TagBlockRemoved, b.Hashes})
	}
	var parent any
	if b.Parent != nil {
		parent = *b.Parent
	}
	return append(out, []any{TagBlockStored, b.Hashes, parent, b.Tokens, p.cfg.BlockSize})
}

func (p *Publisher) send(events []any) {
	ts := float64(time.Now().UnixNano()) / 1e9
	payload, err := msgpack.Marshal([]any{ts, events, nil})
	if err != nil {
		p.cfg.Log.Error("kv events: encode", "err", err)
		return
	}
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], p.seq)
	p.seq++
	msg := zmq4.NewMsgFrom([]byte(p.topic), seq[:], payload)
	if err := p.sock.Send(msg); err != nil && !errors.Is(err, context.Canceled) {
		p.cfg.Log.Warn("kv events: send", "err", err)
		return
	}
	p.Sent.Add(1)
}

// Addr is the address the PUB socket listens on (useful with port 0).
func (p *Publisher) Addr() string {
	if a := p.sock.Addr(); a != nil {
		return a.String()
	}
	return ""
}
