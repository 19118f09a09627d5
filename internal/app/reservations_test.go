package app

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"

	"github.com/polykv/polykv/internal/api/wire"
)

// Issue 13 over HTTP: six concurrent reservations on a pool whose policy allows two
// sessions grant exactly two; requests carrying them pass the enforced gate, and every
// response reports the session's own context.
func TestReservationsOverHTTP(t *testing.T) {
	a, base := startServer(t, Config{NCtx: 2048, Parallel: 4})
	id := num(createPool(t, base, map[string]any{"prompt": longSystem(t, a, 20)})["pool_id"])
	var info wire.PoolInfo
	get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
	prompt := func(k int) []int32 { return append(slices.Clone(info.Tokens), int32(100+k)) }
	if code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/admission", base, id), map[string]any{
		"target_tps_per_session": 1e6, "mode": "enforced", "guarantee_min_sessions": 2, "settle_max_ms": 200}); code != 200 {
		t.Fatalf("set admission: %d %v", code, out)
	}
	var mu sync.Mutex
	var granted []string
	var wg sync.WaitGroup
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/reservations", base, id), map[string]any{"ttl_ms": 60000})
			if code != 200 {
				t.Errorf("reserve: %d %v", code, out)
				return
			}
			if out["granted"] == true {
				mu.Lock()
				granted = append(granted, out["reservation_id"].(string))
				mu.Unlock()
			} else if out["reservation_id"] != nil || out["verdict"].(map[string]any)["can_admit"] != false {
				t.Errorf("refused reservation: %v", out)
			}
		}()
	}
	wg.Wait()
	if len(granted) != 2 {
		t.Fatalf("granted %d of 6 concurrent reservations, the policy allows 2", len(granted))
	}
	for i, rid := range granted {
		body, _ := json.Marshal(map[string]any{"prompt": prompt(i), "pool_id": id, "reservation_id": rid, "max_tokens": 4})
		resp, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var out map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("X-PolyKV-Reservation") != "used" {
			t.Fatalf("reserved request: %d %q %v", resp.StatusCode, resp.Header.Get("X-PolyKV-Reservation"), out)
		}
		ctx, ok := out["context"].(map[string]any)
		if !ok || ctx["ctx_used"].(float64) < float64(len(info.Tokens)) || ctx["ctx_pressure"].(float64) <= 0 {
			t.Fatalf("response context: %v", out["context"])
		}
	}
	// A used reservation is gone: a second request naming it goes through the gate
	// (whose verdict the engine tests cover) instead.
	body, _ := json.Marshal(map[string]any{"prompt": prompt(9), "pool_id": id, "reservation_id": granted[0], "max_tokens": 2})
	resp, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.Header.Get("X-PolyKV-Reservation") != "" {
		t.Fatalf("a used reservation was used again: %d", resp.StatusCode)
	}
	for _, bad := range []map[string]any{{"ttl_ms": 0}, {"ttl_ms": 1e9}, {"expected_tokens": -1}, {"ttl_ms": "x"}} {
		if code, out := post(t, fmt.Sprintf("%s/polykv/pools/%d/reservations", base, id), bad); code != 400 {
			t.Fatalf("bad reservation body %v: %d %v", bad, code, out)
		}
	}
	if code, _ := post(t, base+"/polykv/pools/999/reservations", map[string]any{}); code != 404 {
		t.Fatalf("reservation on an unknown pool: %d", code)
	}
	if code, _ := post(t, base+"/v1/completions", map[string]any{"prompt": "x", "reservation_id": "r", "max_tokens": 1}); code != 400 {
		t.Fatalf("reservation_id without pool_id: %d", code)
	}
	req, _ := http.NewRequest(http.MethodDelete, fmt.Sprintf("%s/polykv/pools/%d/reservations/nope", base, id), nil)
	resp, err = http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 404 {
		t.Fatalf("release of an unknown reservation: %v %v", err, resp.Status)
	}
	resp.Body.Close()
}
