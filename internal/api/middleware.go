package api

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"net/http"
	"strings"

	"github.com/polykv/polykv/internal/ui"
)

// RequireAPIKeys makes every route but /health (and CORS preflights) require
// "Authorization: Bearer KEY" or "x-api-key: KEY" (Anthropic's clients send that) with
// one of keys, as llama-server's --api-key does. No keys (the default) leaves the
// server open. Call it before Handler.
func (s *Server) RequireAPIKeys(keys []string) {
	s.apiKeys = s.apiKeys[:0]
	for _, k := range keys {
		// Keys are kept as SHA-256 digests: comparing fixed-length digests in constant
		// time also hides the keys' lengths, which subtle.ConstantTimeCompare on the raw
		// strings would leak by returning early.
		s.apiKeys = append(s.apiKeys, sha256.Sum256([]byte(k)))
	}
}

// publicPaths answer without an API key: a load balancer's health probe has no key.
var publicPaths = map[string]bool{"/health": true}

// auth refuses requests without a valid bearer key when keys are configured.
func (s *Server) auth(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The dashboard's static files hold no data and a browser cannot add a header
		// when it navigates: the page asks for the key and sends it on its API calls.
		if len(s.apiKeys) == 0 || publicPaths[r.URL.Path] || ui.Public(r) || s.validKey(r.Header) {
			h.ServeHTTP(w, r)
			return
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="polykv"`)
		e := &apiError{status: http.StatusUnauthorized, typ: "authentication_error", msg: "Invalid API Key"}
		if strings.HasPrefix(r.URL.Path, "/v1/messages") {
			writeAnthropicError(w, e) // Anthropic's clients read their own error shape
			return
		}
		writeAPIError(w, e)
	})
}

// validKey checks the request's key (Authorization: Bearer, else x-api-key) against
// every configured key without an early exit, so the time taken says nothing about
// which key (or how much of one) matched.
func (s *Server) validKey(h http.Header) bool {
	token, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer ")
	if !ok {
		if token = h.Get("X-Api-Key"); token == "" {
			return false
		}
	}
	got := sha256.Sum256([]byte(strings.TrimSpace(token)))
	match := 0
	for i := range s.apiKeys {
		match |= subtle.ConstantTimeCompare(got[:], s.apiKeys[i][:])
	}
	return match == 1
}

// corsMethods are the methods PolyKV's routes use.
const corsMethods = "GET, POST, DELETE, OPTIONS"

// cors lets browser clients (web UIs on another origin) call the API, as llama-server
// does: every reply allows the caller's origin, and a preflight OPTIONS is answered
// here, before authentication (browsers never send credentials on a preflight).
func cors(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hd := w.Header()
		origin := r.Header.Get("Origin")
		if origin != "" {
			hd.Set("Access-Control-Allow-Origin", origin)
			hd.Set("Access-Control-Allow-Credentials", "true")
			hd.Add("Vary", "Origin")
		} else {
			hd.Set("Access-Control-Allow-Origin", "*")
		}
		if r.Method != http.MethodOptions {
			h.ServeHTTP(w, r)
			return
		}
		hd.Set("Access-Control-Allow-Methods", corsMethods)
		// "*" in Allow-Headers does not cover Authorization (Fetch standard), so name the
		// headers clients send, plus whatever this preflight asks for.
		allow := "Authorization, Content-Type, Accept, X-Requested-With, X-Api-Key, Anthropic-Version"
		if req := r.Header.Get("Access-Control-Request-Headers"); req != "" {
			allow += ", " + req
		}
		hd.Set("Access-Control-Allow-Headers", allow)
		hd.Set("Access-Control-Max-Age", "86400")
		w.WriteHeader(http.StatusNoContent)
	})
}

// routeErrors answers requests no route takes with the JSON error shape: 405 with the
// Allow header when the path exists under another method, else 404. ServeMux's own
// replies for these are plain text.
func routeErrors(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, pattern := mux.Handler(r)
		if pattern != "" {
			mux.ServeHTTP(w, r)
			return
		}
		// No pattern: ServeMux would answer 404 or 405 (or redirect a path it cleans).
		// Run its handler against a scratch writer to learn which, and with what Allow.
		probe := &headerProbe{header: http.Header{}}
		h.ServeHTTP(probe, r)
		switch probe.status {
		case http.StatusMethodNotAllowed:
			allow := probe.header.Get("Allow")
			w.Header().Set("Allow", allow)
			writeError(w, http.StatusMethodNotAllowed, "invalid_request_error",
				fmt.Sprintf("method %s is not allowed on %s (allowed: %s)", r.Method, r.URL.Path, allow))
		case http.StatusNotFound:
			writeError(w, http.StatusNotFound, "not_found_error", fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
		default:
			mux.ServeHTTP(w, r)
		}
	})
}

// headerProbe records what a handler would answer, without sending anything.
type headerProbe struct {
	header http.Header
	status int
}

func (p *headerProbe) Header() http.Header { return p.header }
func (p *headerProbe) WriteHeader(code int) {
	if p.status == 0 {
		p.status = code
	}
}
func (p *headerProbe) Write(b []byte) (int, error) {
	p.WriteHeader(http.StatusOK)
	return len(b), nil
}
