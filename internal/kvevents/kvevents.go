// Package kvevents publishes the KV-cache events llm-d's precise-prefix scorer consumes:
// which full token blocks this replica holds. The wire format is vLLM's (what llm-d's
// kvevents package decodes): a ZMQ PUB socket sends three frames per message, the topic
// "kv@<pod-id>@<model>", an 8-byte big-endian sequence number, and a msgpack payload
// [ts, [events...], dp_rank], each event a positional array tagged BlockStored,
// BlockRemoved or AllBlocksCleared.
//
// What is announced (issue 27): every prefix a new request could reuse here. The
// engine reports each sequence's content as it changes (engine.ResidencyObserver): with
// the prefix cache on that is every sequence (sessions, cached anonymous sequences,
// running requests, pools), since a request without a pool or a known session starts
// from the longest prefix any of them holds; with it off, pools only. The publisher
// mirrors each sequence's tokens and the hashes of its full blocks, and keeps a
// reference count per block hash: a block is announced (BlockStored) when the first
// sequence holding it appears and removed (BlockRemoved) when the last one lets it go,
// so the router's index holds each resident block of this replica exactly once.
//
// Block hashes are the router's own keys for the same tokens (hash.go): block k of a
// sequence is named by a chain over every token before it, so the same tokens give the
// same hash on every replica, and a block's parent is always a block this replica has
// already announced (a hash's holders hold all blocks before it, so the new blocks of a
// sequence are always a suffix of its chain, and their parent is resident).
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
// blockSizeTokens of llm-d's token processor, so our block hashes are the router's keys
// without configuration, and a prefix is matched to within 16 tokens.
const DefaultBlockSize = 16

// Event tags, as vLLM and llm-d name them.
const (
	TagBlockStored      = "BlockStored"
	TagBlockRemoved     = "BlockRemoved"
	TagAllBlocksCleared = "AllBlocksCleared"
)

// Media (vLLM's BlockStored.medium and BlockRemoved.medium; issue 44). llm-d's event
// pool lower-cases the medium into the block's device tier (an event without one is
// "gpu") and its precise scorer adds, per consecutive block a pod holds, the highest
// weight of the tiers it holds the block in: backendConfigs, by default gpu 1.0 and
// cpu 0.8, and 1.0 for a tier it has no weight for. So the cells the model computes
// with are announced as GPU, and what the tier below them holds (host RAM or the
// replica's disk) as CPU: a replica holding a prefix only in its tier scores for it,
// below one holding it in cells, with the router's default configuration. (A medium
// of our own, "DISK" say, would score like a cell unless every router were given a
// weight for it.)
const (
	MediumCells = "GPU"
	MediumTier  = "CPU"
)

// Config configures a Publisher.
type Config struct {
	// Endpoint is where the PUB socket binds, e.g. tcp://127.0.0.2:5557 (the EPP dials
	// tcp://<pod address>:5557 by default).
	Endpoint  string
	BlockSize int    // tokens per block (DefaultBlockSize when 0)
	PodID     string // topic's pod id (the EPP keys events by the address it dialled)
	Model     string // topic's model name: the name requests use (the hash chain starts from it)
	// HashSeed is the router's tokenProcessorConfig.hashSeed ("" by default).
	HashSeed string
	Log      *slog.Logger
}

// Publisher is an engine.ResidencyObserver that sends KV events over ZMQ. The engine
// goroutine only queues changes; a goroutine of the publisher hashes, encodes and
// sends them.
//
// A PUB socket drops what it sends while nobody is subscribed, and a subscriber that
// joins later sees nothing of the past. So the publisher keeps its mirror of every
// sequence and, each time a subscriber joins (the socket goes from no subscriber to
// some, or, on tcp, a new connection was accepted: subscribeGrace later, once it has
// subscribed), it sends a snapshot: AllBlocksCleared, then BlockStored for every
// resident block, each chain's blocks parents first. PUB sends it to every subscriber:
// those already listening get the same state again (AllBlocksCleared first, so
// nothing is counted twice). A router that starts after PolyKV, restarts, or runs
// beside another router so learns the whole state, without vLLM's replay socket.
// Sequence numbers count the messages sent, from 0 for the first.
type Publisher struct {
	cfg     Config
	topic   string
	sock    zmq4.Socket
	accepts *atomic.Uint64 // connections accepted (tcp endpoints), nil otherwise
	ch      chan change
	done    chan struct{}
	closing sync.Once
	closeMu sync.RWMutex // TierChanged (any goroutine) against Close
	closed  bool
	// The publisher goroutine's own state.
	seq    uint64    // next sequence number
	live   bool      // someone was subscribed at the last look
	seen   uint64    // accepts already answered with a snapshot
	joined time.Time // when unanswered accepts were first seen (zero: none)
	init   uint64
	seqs   map[int]*mirror
	refs   map[uint64]int // block hash → sequences holding it
	// The tier's blocks (TierChanged): how many stored entries hold each, and what
	// each was announced with (for snapshots).
	tierRefs   map[uint64]int
	tierBlocks map[uint64]tierBlock
	// Sent, Snapshots and Dropped count messages sent, snapshots sent to newly joined
	// subscribers, and changes lost to a full queue.
	Sent      atomic.Uint64
	Snapshots atomic.Uint64
	Dropped   atomic.Uint64
}

// change is one queued change: a sequence's (seq) or the tier's (tier non-nil).
type change struct {
	seq  engine.SeqChange
	tier *tierChange
}

// tierChange is an entry of the tier below the cache stored or removed: the KV of
// tokens[d:] computed after tokens[:d].
type tierChange struct {
	d      int
	tokens []int32
	stored bool
}

// tierBlock is a block the tier holds, as announced: its position in its chain, its
// parent (nil: the chain's first) and its tokens.
type tierBlock struct {
	pos    int
	parent any
	tokens []int32
}

// mirror is what one sequence holds, as last reported, and its full blocks' hashes.
type mirror struct {
	tokens []int32
	chain  []uint64
}

// queueLen bounds the changes waiting to be sent. A decoding sequence reports a token a
// step, so a second of a busy replica is a few hundred; a full queue drops (and counts,
// polykv_kv_events_dropped_total) rather than block the engine. A dropped change leaves
// the mirror of that sequence wrong until the sequence is freed, so the router's view
// of this replica is then stale: restart the replica.
const queueLen = 1 << 16

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
	ep, accepts := countAccepts(cfg.Endpoint)
	if err := listenCounting(sock, ep, accepts); err != nil {
		_ = sock.Close()
		return nil, fmt.Errorf("kv events: bind %s: %w", cfg.Endpoint, err)
	}
	p := &Publisher{cfg: cfg, topic: "kv@" + cfg.PodID + "@" + cfg.Model, sock: sock, accepts: accepts,
		ch: make(chan change, queueLen), done: make(chan struct{}),
		init: InitHash(cfg.HashSeed, cfg.Model), seqs: map[int]*mirror{}, refs: map[uint64]int{},
		tierRefs: map[uint64]int{}, tierBlocks: map[uint64]tierBlock{}}
	go p.run()
	return p, nil
}

// Topic is the topic every message carries.
func (p *Publisher) Topic() string { return p.topic }

// BlockSize is the block size in tokens.
func (p *Publisher) BlockSize() int { return p.cfg.BlockSize }

// SeqChanged implements engine.ResidencyObserver.
func (p *Publisher) SeqChanged(c engine.SeqChange) { p.queue(change{seq: c}) }

// TierChanged implements tier.Observer: an entry of the tier below the cache, the KV of
// tokens[d:] after tokens[:d], was stored or removed. Its full blocks are announced
// with MediumTier. Safe from any goroutine, and after Close (then it does nothing).
func (p *Publisher) TierChanged(d int, tokens []int32, stored bool) {
	p.closeMu.RLock()
	defer p.closeMu.RUnlock()
	if !p.closed {
		p.queue(change{tier: &tierChange{d: d, tokens: tokens, stored: stored}})
	}
}

func (p *Publisher) queue(c change) {
	select {
	case p.ch <- c:
	default:
		if p.Dropped.Add(1) == 1 {
			p.cfg.Log.Warn("kv events: queue full, dropping changes (the router's view of this replica is now stale)")
		}
	}
}

// Close sends what is queued, then AllBlocksCleared (a replica shutting down tells
// its routers to forget its blocks at once, rather than route to them until discovery
// drops it), and closes the socket. The engine must not report changes after Close
// (close the engine first).
func (p *Publisher) Close() error {
	p.closing.Do(func() {
		p.closeMu.Lock()
		p.closed = true
		close(p.ch)
		p.closeMu.Unlock()
	})
	<-p.done
	if p.live {
		p.send([]any{[]any{TagAllBlocksCleared}})
		// zmq4 sends from its own goroutine: give the last message time to leave.
		time.Sleep(closeLinger)
	}
	return p.sock.Close()
}

// closeLinger is how long Close waits for its last message to be written.
const closeLinger = 100 * time.Millisecond

type subscribed interface{ Topics() []string }

// subscriberPoll is how often the publisher looks for a newly joined subscriber while
// no change arrives.
const subscriberPoll = 20 * time.Millisecond

// subscribeGrace is how long after a connection is accepted the publisher waits for
// its subscription before sending the snapshot: the SUB side sends it right after the
// handshake, and PUB sends a message only to the connections subscribed by then.
const subscribeGrace = 300 * time.Millisecond

func (p *Publisher) run() {
	defer close(p.done)
	tick := time.NewTicker(subscriberPoll)
	defer tick.Stop()
	for {
		select {
		case c, ok := <-p.ch:
			if !ok {
				return
			}
			p.look() // a snapshot, if any, goes out before this change
			events := p.apply(nil, c)
			// Batch what else is already queued into the same message.
		more:
			for len(events) < 256 {
				select {
				case next, ok := <-p.ch:
					if !ok {
						break more
					}
					events = p.apply(events, next)
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
	if !has {
		p.live = false
		return
	}
	if !p.live {
		// The connections accepted so far are this subscriber's (a second one that
		// connected in the same instant and has not subscribed yet would be missed).
		p.live = true
		if p.accepts != nil {
			p.seen, p.joined = p.accepts.Load(), time.Time{}
		}
		p.snapshot()
		return
	}
	if p.accepts == nil {
		return
	}
	// Another connection while someone listens: snapshot once it has had time to
	// subscribe (the newest accept restarts the wait).
	if n := p.accepts.Load(); n != p.seen {
		if p.joined.IsZero() {
			p.joined = time.Now()
		}
		if time.Since(p.joined) >= subscribeGrace {
			p.seen, p.joined = n, time.Time{}
			p.snapshot()
		}
	}
}

// snapshot sends AllBlocksCleared and every resident block.
func (p *Publisher) snapshot() {
	p.send(p.snapshotEvents())
	p.Snapshots.Add(1)
}

// snapshotEvents is AllBlocksCleared and every resident block, each once, parents first.
func (p *Publisher) snapshotEvents() []any {
	events := []any{[]any{TagAllBlocksCleared}}
	sent := map[uint64]bool{}
	ids := make([]int, 0, len(p.seqs))
	for q := range p.seqs {
		ids = append(ids, q)
	}
	slices.Sort(ids)
	for _, q := range ids {
		m := p.seqs[q]
		// The blocks already sent form a prefix of the chain (the same hash means the
		// same tokens before it).
		f := 0
		for f < len(m.chain) && sent[m.chain[f]] {
			f++
		}
		for _, h := range m.chain[f:] {
			sent[h] = true
		}
		events = p.stored(events, m, f, len(m.chain))
	}
	// The tier's blocks, parents first (a block's parent is at the position before
	// it): the same hash in cells and in the tier is two entries of the router's index,
	// one per medium.
	hs := make([]uint64, 0, len(p.tierBlocks))
	for h := range p.tierBlocks {
		hs = append(hs, h)
	}
	slices.SortFunc(hs, func(a, b uint64) int {
		if c := p.tierBlocks[a].pos - p.tierBlocks[b].pos; c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	for _, h := range hs {
		b := p.tierBlocks[h]
		events = append(events, []any{TagBlockStored, []uint64{h}, b.parent, b.tokens, p.cfg.BlockSize, nil, MediumTier})
	}
	return events
}

// apply applies one queued change.
func (p *Publisher) apply(events []any, c change) []any {
	if c.tier != nil {
		return p.takeTier(events, *c.tier)
	}
	return p.take(events, c.seq)
}

// takeTier counts a tier entry's full blocks in or out and appends the events: the
// blocks no entry held before, in runs of consecutive blocks (each run chained to the
// block before it), or those no entry holds any more. A block of the entry that starts
// below d is the previous entry's (chunks are aligned to blocks, so there is none).
func (p *Publisher) takeTier(events []any, c tierChange) []any {
	bs := p.cfg.BlockSize
	n := len(c.tokens) / bs
	first := (c.d + bs - 1) / bs
	if first >= n {
		return events
	}
	chain := BlockHashes(p.init, c.tokens[:n*bs], bs)
	if !c.stored {
		var gone []uint64
		for _, h := range chain[first:] {
			if p.tierRefs[h]--; p.tierRefs[h] <= 0 {
				delete(p.tierRefs, h)
				delete(p.tierBlocks, h)
				gone = append(gone, h)
			}
		}
		if len(gone) > 0 {
			events = append(events, []any{TagBlockRemoved, gone, MediumTier})
		}
		return events
	}
	run := -1 // the first block of the current run of new blocks
	flush := func(end int) {
		if run < 0 {
			return
		}
		var parent any
		if run > 0 {
			parent = chain[run-1]
		}
		events = append(events, []any{TagBlockStored, slices.Clone(chain[run:end]), parent, slices.Clone(c.tokens[run*bs : end*bs]), bs, nil, MediumTier})
		run = -1
	}
	for j := first; j < n; j++ {
		h := chain[j]
		if p.tierRefs[h]++; p.tierRefs[h] > 1 {
			flush(j)
			continue
		}
		var parent any
		if j > 0 {
			parent = chain[j-1]
		}
		p.tierBlocks[h] = tierBlock{pos: j, parent: parent, tokens: slices.Clone(c.tokens[j*bs : (j+1)*bs])}
		if run < 0 {
			run = j
		}
	}
	flush(n)
	return events
}

// stored appends BlockStored for m's blocks [from, to) (none when empty).
func (p *Publisher) stored(out []any, m *mirror, from, to int) []any {
	if from >= to {
		return out
	}
	bs := p.cfg.BlockSize
	var parent any // nil: the chain starts at the model's init hash
	if from > 0 {
		parent = m.chain[from-1]
	}
	// Copies: the mirror changes in place while a batch is still being built.
	return append(out, []any{TagBlockStored, slices.Clone(m.chain[from:to]), parent, slices.Clone(m.tokens[from*bs : to*bs]), bs, nil, MediumCells})
}

// take applies c to the mirror and the reference counts and appends the events: the
// blocks no sequence holds any more, then the blocks no sequence held before.
func (p *Publisher) take(events []any, c engine.SeqChange) []any {
	bs := p.cfg.BlockSize
	m := p.seqs[c.Seq]
	if m == nil {
		m = &mirror{}
		p.seqs[c.Seq] = m
	}
	keep := min(c.Keep, len(m.tokens))
	kb := keep / bs
	m.tokens = append(m.tokens[:keep], c.Tokens...)
	parent := p.init
	if kb > 0 {
		parent = m.chain[kb-1]
	}
	fresh := BlockHashes(parent, m.tokens[kb*bs:], bs)
	old := m.chain[kb:]
	same := 0
	for same < len(old) && same < len(fresh) && old[same] == fresh[same] {
		same++
	}
	var gone []uint64
	for _, h := range old[same:] {
		if p.refs[h]--; p.refs[h] <= 0 {
			delete(p.refs, h)
			gone = append(gone, h)
		}
	}
	first := -1 // the first block no sequence held: all after it are new too
	for i, h := range fresh[same:] {
		if p.refs[h]++; p.refs[h] == 1 && first < 0 {
			first = kb + same + i
		}
	}
	m.chain = append(m.chain[:kb+same], fresh[same:]...)
	if len(gone) > 0 {
		events = append(events, []any{TagBlockRemoved, gone, MediumCells})
	}
	if first >= 0 {
		events = p.stored(events, m, first, len(m.chain))
	}
	if len(m.tokens) == 0 {
		delete(p.seqs, c.Seq)
	}
	return events
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
