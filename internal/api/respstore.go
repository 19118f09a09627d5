package api

import (
	"encoding/json"
	"sync"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
)

// Defaults of the stored-response bounds (Info.ResponsesMax, Info.ResponsesMaxBytes).
const (
	defaultResponsesMax      = 1024
	defaultResponsesMaxBytes = 64 << 20
)

// storedResponse is a response kept for GET, DELETE and previous_response_id: the
// answer as sent, and what a continuation needs: the conversation through its reply
// (in chat's terms, instructions left out as OpenAI leaves them out of a chain), the
// calls made in it, and the session whose KV holds it.
type storedResponse struct {
	resp    wire.Response
	history []chatTurnMsg
	calls   map[string]string
	session string
	at      time.Time
	size    int64
}

// responseStore holds stored responses, bounded in number and bytes (the oldest go
// first) and expiring after ttl, the session TTL: by then the chain's session has lost
// its KV too. It is the HTTP layer's own state; the engine knows only the session.
type responseStore struct {
	mu       sync.Mutex
	ttl      time.Duration // 0: no expiry
	maxN     int
	maxBytes int64
	now      func() time.Time
	byID     map[string]*storedResponse
	order    []string // ids oldest first; deleted ones are skipped
	bytes    int64
}

func newResponseStore(ttl time.Duration, maxN int, maxBytes int64) *responseStore {
	if maxN <= 0 {
		maxN = defaultResponsesMax
	}
	if maxBytes <= 0 {
		maxBytes = defaultResponsesMaxBytes
	}
	return &responseStore{ttl: ttl, maxN: maxN, maxBytes: maxBytes, now: time.Now, byID: map[string]*storedResponse{}}
}

// put stores r under its response's id, dropping the oldest (and the expired) beyond
// the bounds. A response larger than the byte bound alone is not stored.
func (st *responseStore) put(r *storedResponse) {
	b, _ := json.Marshal(r.resp)
	h, _ := json.Marshal(r.history)
	r.size = int64(len(b) + len(h))
	st.mu.Lock()
	defer st.mu.Unlock()
	r.at = st.now()
	st.drop(r.resp.ID)
	if r.size > st.maxBytes {
		return
	}
	st.byID[r.resp.ID] = r
	st.order = append(st.order, r.resp.ID)
	st.bytes += r.size
	st.sweep()
}

// get returns the live response with that id (nil: unknown, deleted or expired).
func (st *responseStore) get(id string) *storedResponse {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.sweep()
	return st.byID[id]
}

// remove deletes a stored response; false when there was none.
func (st *responseStore) remove(id string) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.sweep()
	return st.drop(id)
}

func (st *responseStore) drop(id string) bool {
	r, ok := st.byID[id]
	if ok {
		delete(st.byID, id)
		st.bytes -= r.size
	}
	return ok
}

// sweep drops the oldest responses while over a bound or expired, and compacts order.
func (st *responseStore) sweep() {
	now := st.now()
	i := 0
	for ; i < len(st.order); i++ {
		r, ok := st.byID[st.order[i]]
		if !ok {
			continue
		}
		expired := st.ttl > 0 && now.Sub(r.at) > st.ttl
		if !expired && len(st.byID) <= st.maxN && st.bytes <= st.maxBytes {
			break
		}
		st.drop(st.order[i])
	}
	st.order = st.order[i:]
	if len(st.order) > 2*len(st.byID)+64 {
		live := st.order[:0]
		for _, id := range st.order {
			if _, ok := st.byID[id]; ok {
				live = append(live, id)
			}
		}
		st.order = live
	}
}
