// Package ui is PolyKV's live dashboard: one static page (HTML, CSS and plain JS, no
// build step, no third-party code) embedded in the binary. It holds no server state and
// reads no engine data itself: the page's script polls and streams the public routes
// (/props, /polykv/pools, /polykv/pools/{id}/capacity, /slots, /polykv/tps) with the
// API key the operator enters, so the dashboard sees exactly what any client sees.
//
// Because the assets carry no data, they are safe to serve without the API key (a
// browser navigating to the page cannot attach an Authorization header); every data
// request the page makes carries it.
package ui

import (
	"embed"
	"encoding/json"
	"fmt"
	"io/fs"
	"net/http"
	"strings"
)

//go:embed static
var static embed.FS

// Prefix is the path the dashboard lives under; GET / redirects here.
const Prefix = "/ui/"

// Assets is the embedded file tree (index.html, app.js, style.css), exposed for tests.
func Assets() fs.FS {
	sub, err := fs.Sub(static, "static")
	if err != nil { // unreachable: the directory is embedded at build time
		panic(err)
	}
	return sub
}

// Register routes the dashboard on mux: GET /ui/… serves the page and its assets, and
// GET / (exactly) redirects there, so a browser pointed at the server's address lands
// on the dashboard. Other unknown paths keep the API's JSON 404.
func Register(mux *http.ServeMux) {
	assets := Assets()
	files := http.StripPrefix(Prefix, http.FileServerFS(assets))
	mux.Handle("GET "+Prefix, noStore(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name := strings.TrimPrefix(r.URL.Path, Prefix)
		if name != "" {
			if _, err := fs.Stat(assets, name); err != nil {
				notFound(w, r)
				return
			}
		}
		files.ServeHTTP(w, r)
	})))
	mux.Handle("GET /ui", http.RedirectHandler(Prefix, http.StatusFound))
	mux.Handle("GET /{$}", http.RedirectHandler(Prefix, http.StatusFound))
}

// Public reports whether r asks for the page itself (GET or HEAD of /, /ui or a file
// under /ui/), which an API-key check must let through: a browser navigating to the
// dashboard cannot attach an Authorization header, and the files carry no data. Every
// request the page's script makes for data carries the key.
func Public(r *http.Request) bool {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		return false
	}
	p := r.URL.Path
	return p == "/" || p == "/ui" || strings.HasPrefix(p, Prefix)
}

// noStore keeps browsers from caching an old page across server upgrades: the assets
// are small and loaded once per visit, so revalidating costs nothing.
func noStore(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-cache")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		h.ServeHTTP(w, r)
	})
}

// notFound answers an unknown asset with the API's JSON error shape, like every other
// unknown path of the server.
func notFound(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusNotFound)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
		"code": http.StatusNotFound, "type": "not_found_error",
		"message": fmt.Sprintf("no dashboard file %s", r.URL.Path),
	}})
}
