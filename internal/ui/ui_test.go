package ui

import (
	"encoding/json"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
)

func serve(t *testing.T, method, path string) *http.Response {
	t.Helper()
	mux := http.NewServeMux()
	Register(mux)
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(method, path, nil))
	return rec.Result()
}

func TestServesPageAndAssets(t *testing.T) {
	for path, ctype := range map[string]string{
		"/ui/":          "text/html",
		"/ui/app.js":    "text/javascript",
		"/ui/style.css": "text/css",
	} {
		res := serve(t, "GET", path)
		body, _ := io.ReadAll(res.Body)
		if res.StatusCode != http.StatusOK || !strings.HasPrefix(res.Header.Get("Content-Type"), ctype) || len(body) < 500 {
			t.Errorf("GET %s: %d %q, %d bytes", path, res.StatusCode, res.Header.Get("Content-Type"), len(body))
		}
		if res.Header.Get("Cache-Control") != "no-cache" {
			t.Errorf("GET %s: Cache-Control %q", path, res.Header.Get("Cache-Control"))
		}
	}
	res := serve(t, "GET", "/ui/")
	body, _ := io.ReadAll(res.Body)
	for _, want := range []string{`src="app.js"`, `href="style.css"`, `id="tree"`, `id="apikey"`} {
		if !strings.Contains(string(body), want) {
			t.Errorf("index.html lacks %s", want)
		}
	}
}

func TestRootAndBareUIRedirect(t *testing.T) {
	for _, path := range []string{"/", "/ui"} {
		res := serve(t, "GET", path)
		if res.StatusCode != http.StatusFound || res.Header.Get("Location") != "/ui/" {
			t.Errorf("GET %s: %d Location %q, want 302 to /ui/", path, res.StatusCode, res.Header.Get("Location"))
		}
	}
	// Only exactly "/" redirects: other unknown paths stay unrouted here (the API's 404).
	if res := serve(t, "GET", "/v1/nope"); res.StatusCode != http.StatusNotFound {
		t.Errorf("GET /v1/nope: %d", res.StatusCode)
	}
	if res := serve(t, "POST", "/ui/"); res.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /ui/: %d, want 405", res.StatusCode)
	}
}

func TestUnknownAssetIsJSON404(t *testing.T) {
	res := serve(t, "GET", "/ui/nope.js")
	var body struct {
		Error struct {
			Code int    `json:"code"`
			Type string `json:"type"`
		} `json:"error"`
	}
	if err := json.NewDecoder(res.Body).Decode(&body); err != nil || res.StatusCode != 404 || body.Error.Code != 404 || body.Error.Type != "not_found_error" {
		t.Fatalf("GET /ui/nope.js: %d %+v %v", res.StatusCode, body, err)
	}
}

// The page must work with no network but the server's own: no URL to another host in
// any asset (scripts, styles, fonts, images).
func TestAssetsReferenceNoOtherHost(t *testing.T) {
	ext := regexp.MustCompile(`(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}|@import|url\(\s*['"]?https?:`)
	err := fs.WalkDir(Assets(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(Assets(), path)
		if err != nil {
			return err
		}
		if m := ext.Find(b); m != nil {
			t.Errorf("%s references %q", path, m)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestPublic(t *testing.T) {
	for _, c := range []struct {
		method, path string
		want         bool
	}{
		{"GET", "/", true}, {"GET", "/ui", true}, {"GET", "/ui/", true}, {"HEAD", "/ui/app.js", true},
		{"POST", "/ui/", false}, {"GET", "/props", false}, {"GET", "/polykv/tps", false},
		{"GET", "/uix", false}, {"GET", "/v1/models", false},
	} {
		if got := Public(httptest.NewRequest(c.method, c.path, nil)); got != c.want {
			t.Errorf("Public(%s %s) = %v, want %v", c.method, c.path, got, c.want)
		}
	}
}
