package api

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// The dashboard is mounted on the API's router: GET / and /ui lead to the page, and
// every other unknown path keeps the JSON 404. No engine is needed for static files.
func TestDashboardRoutes(t *testing.T) {
	h := New(nil, nil, nil, Info{}, nil, nil).Handler()
	get := func(path string) *http.Response {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		return rec.Result()
	}
	if res := get("/"); res.StatusCode != http.StatusFound || res.Header.Get("Location") != "/ui/" {
		t.Errorf("GET /: %d %q", res.StatusCode, res.Header.Get("Location"))
	}
	res := get("/ui/")
	body, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK || !strings.Contains(string(body), "PolyKV dashboard") {
		t.Errorf("GET /ui/: %d %.80q", res.StatusCode, body)
	}
	res = get("/nope")
	body, _ = io.ReadAll(res.Body)
	if res.StatusCode != http.StatusNotFound || !strings.Contains(string(body), `"not_found_error"`) {
		t.Errorf("GET /nope: %d %s", res.StatusCode, body)
	}
}
