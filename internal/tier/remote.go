package tier

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// The remote level (issue 44): the fleet's level in an existing store that every replica
// reaches over the network, behind the same Level interface as the shared directory
// (shared.go), in its place. Redis was picked because it is the store a fleet most
// likely runs already (llm-d's own indexer keeps its block index in Redis or Valkey),
// because go-redis is the maintained Go client, and because a Redis server starts inside
// a test with no binary (miniredis, pure Go), so the level is tested end to end here.
//
// Entries are immutable values under "polykv:kv:<key>" in the checked entry format of
// entry.go (model key, branch position, tokens, checksum), written with SET NX: the same
// key holds the same bytes whoever wrote it, so concurrent writers need no lock. A
// reader checks every byte before one is used; a value that does not verify is a miss and
// is deleted (it never would). The store's size and order are Redis's own: run it with a
// maxmemory and an LRU policy (allkeys-lru), and every replica's reads keep what they use;
// PolyKV never trims the remote level itself (Oldest reports none). Every call has a
// deadline, so a store that is down or slow costs a miss (a prefill), never a hung
// request.

// Remote is the remote level's Location.
const Remote Location = "remote"

// remoteTimeout bounds each call to the remote store: a lookup runs before a request
// is queued (Store.Run) and a read on the way to its restore, so a slow store must
// turn into a miss quickly.
const remoteTimeout = 2 * time.Second

// remotePrefix namespaces PolyKV's entries in a store other programs may use too.
const remotePrefix = "polykv:kv:"

type remoteLevel struct {
	rdb   *redis.Client
	model string
	mu    sync.Mutex
	bytes int64 // what this replica put (the store's own size is Redis's to report)
	n     int
}

var _ Level = (*remoteLevel)(nil)

// newRemoteLevel connects to the Redis server at url (redis://[user:pass@]host:port/db
// or rediss:// for TLS) and checks that it answers.
func newRemoteLevel(url, model string) (*remoteLevel, error) {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("remote tier %q: %w", url, err)
	}
	rdb := redis.NewClient(opt)
	ctx, cancel := context.WithTimeout(context.Background(), remoteTimeout)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		_ = rdb.Close()
		return nil, fmt.Errorf("remote tier %q does not answer: %w", url, err)
	}
	return &remoteLevel{rdb: rdb, model: model}, nil
}

func (l *remoteLevel) Location() Location { return Remote }

// Caps: a set per chunk start lists the lengths stored there (Ends); the connection
// pool is closed with the Store (Close). Nothing lists entries by start or reads a head
// alone: a value is read whole.
func (l *remoteLevel) Caps() LevelCaps { return LevelCaps{Ends: l, Close: l} }

func (l *remoteLevel) key(k Key) string { return remotePrefix + k.String() }

func ctxRemote() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), remoteTimeout)
}

// Has reports whether the store holds k (an error, e.g. the store down, is "no").
func (l *remoteLevel) Has(k Key) bool {
	ctx, cancel := ctxRemote()
	defer cancel()
	n, err := l.rdb.Exists(ctx, l.key(k)).Result()
	return err == nil && n > 0
}

// remoteEnds names the set of lengths stored from a chunk start (EndsIndex).
const remoteEnds = "polykv:ends:"

// Ends lists the lengths stored from start: a set the store evicts like any key, never
// trimmed by PolyKV (as the entries are not); a length whose entry the store evicted
// is a Has that says no.
func (l *remoteLevel) Ends(start Key) []int {
	ctx, cancel := ctxRemote()
	defer cancel()
	vals, err := l.rdb.SMembers(ctx, remoteEnds+start.String()).Result()
	if err != nil {
		return nil
	}
	return parseEnds(vals)
}

// Get reads k's value and checks it (want nil: the entry must hash to its name). A value
// that does not verify is deleted; a missing one, or a store that does not answer, is a
// miss.
func (l *remoteLevel) Get(k Key, want *Meta) ([]byte, error) {
	ctx, cancel := ctxRemote()
	defer cancel()
	b, err := l.rdb.Get(ctx, l.key(k)).Bytes()
	if err != nil {
		if errors.Is(err, redis.Nil) {
			return nil, miss(MissAbsent, "no entry %s in the remote tier", k)
		}
		return nil, miss(MissIO, "remote tier: %v", err)
	}
	payload, err := verifyNamed(b, l.model, k, want)
	if err != nil {
		l.Delete(k)
		return nil, err
	}
	return payload, nil
}

// Put stores k's entry unless the store has it (SET NX: content-addressed, so an existing
// value holds the same bytes).
func (l *remoteLevel) Put(k Key, m Meta, payload []byte) error {
	b := encode(l.model, m, payload)
	ctx, cancel := ctxRemote()
	defer cancel()
	set, err := l.rdb.SetNX(ctx, l.key(k), b, 0).Result()
	if err != nil {
		return fmt.Errorf("remote tier: %w", err)
	}
	// The length under its chunk start, for Store.partial (a failure only hides it;
	// partial never looks at 0).
	if m.D > 0 {
		_ = l.rdb.SAdd(ctx, remoteEnds+StartKey(l.model, m.D, m.Tokens[:m.D]).String(), strconv.Itoa(len(m.Tokens))).Err()
	}
	if set {
		l.mu.Lock()
		l.bytes += int64(len(b))
		l.n++
		l.mu.Unlock()
	}
	return nil
}

func (l *remoteLevel) Delete(k Key) {
	ctx, cancel := ctxRemote()
	defer cancel()
	_ = l.rdb.Del(ctx, l.key(k)).Err()
}

// Touch marks k used in the store's own LRU order (a GET does too).
func (l *remoteLevel) Touch(k Key) {
	ctx, cancel := ctxRemote()
	defer cancel()
	_ = l.rdb.Touch(ctx, l.key(k)).Err()
}

// Oldest reports none: the store evicts by its own policy (maxmemory with allkeys-lru).
func (l *remoteLevel) Oldest(func(Key) bool) (Key, bool) { return Key{}, false }

// Usage is what this replica has put into the store (not the store's whole size, which
// other replicas and the store's own eviction change).
func (l *remoteLevel) Usage() (int64, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.bytes, l.n
}

// Close closes the connection pool.
func (l *remoteLevel) Close() error { return l.rdb.Close() }
