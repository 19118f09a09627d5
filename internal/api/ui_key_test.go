package api_test

import (
	"net/http"
	"testing"

	"github.com/polykv/polykv/internal/engine/enginetest"
)

// With --api-key the page itself loads without a key (a browser cannot send one when it
// navigates); the data it reads still needs the key.
func TestDashboardLoadsBehindAPIKey(t *testing.T) {
	base, _ := newServer(t, enginetest.Bytes("x"), "secret")
	for path, want := range map[string]int{"/ui/": 200, "/slots": 401, "/polykv/pools": 401} {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("GET %s without a key: %d, want %d", path, resp.StatusCode, want)
		}
	}
}
