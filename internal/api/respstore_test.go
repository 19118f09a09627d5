package api

import (
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/api/wire"
)

// Stored responses expire with the session TTL and are bounded in bytes: the oldest
// go first, and one larger than the whole bound is not kept.
func TestResponseStoreExpiryAndBytes(t *testing.T) {
	now := time.Unix(1000, 0)
	st := newResponseStore(time.Minute, 10, 5000)
	st.now = func() time.Time { return now }
	text := strings.Repeat("x", 1000)
	put := func(id string) {
		st.put(&storedResponse{resp: wire.Response{ID: id}, history: []chatTurnMsg{{Role: "user", Content: &text}}})
	}
	put("a")
	now = now.Add(30 * time.Second)
	put("b")
	if st.get("a") == nil || st.get("b") == nil {
		t.Fatal("both live within the TTL")
	}
	now = now.Add(45 * time.Second) // a is 75 s old, b 45 s
	if st.get("a") != nil || st.get("b") == nil {
		t.Fatal("a expired after the TTL, b not yet")
	}
	put("c")
	put("d") // b, c, d: about 1.5 kB each, 4.4 kB of the 5 kB bound
	if st.get("b") == nil {
		t.Fatal("b fits the byte bound")
	}
	put("e") // over 5 kB: b, the oldest, goes
	if st.get("b") != nil || st.get("c") == nil || st.get("e") == nil {
		t.Fatalf("over the byte bound the oldest goes first (%d bytes held)", st.bytes)
	}
	huge := strings.Repeat("y", 5000)
	st.put(&storedResponse{resp: wire.Response{ID: "huge"}, history: []chatTurnMsg{{Role: "user", Content: &huge}}})
	if st.get("huge") != nil || st.get("e") == nil {
		t.Fatal("a response larger than the bound is not kept, and does not push others out")
	}
	if !st.remove("c") || st.remove("c") || st.get("c") != nil {
		t.Fatal("remove deletes once")
	}
}
