package api

import (
	"bytes"
	"fmt"
	"net/http/httptest"
	"path/filepath"
	"testing"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/pool"
)

// TestGoldenErrors pins the error bodies the fake engine cannot provoke over HTTP
// (a saturated pool's 429 with its verdict, an engine failure inside a stream, a wait
// past the queue timeout), byte for byte, with their headers.
func TestGoldenErrors(t *testing.T) {
	mean, drop := 3.5, 0.25
	known := true
	sat := &engine.SaturatedError{Pool: 7, Verdict: admission.Verdict{Reason: admission.ReasonFloor, MeanActiveTPS: &mean,
		DropPerAdmitEWMA: &drop, HeadroomSessions: 0, KVHeadroomPct: 12.5, FreeCells: 64, NActive: 3, NPoolSessions: 3,
		KnownSession: &known, TargetTPS: 4, Mode: admission.ModeEnforced, RetryAfterS: 0}}
	var out bytes.Buffer
	for _, c := range []struct {
		name string
		e    *apiError
	}{
		{"saturated", errorFor(sat)},
		{"queue_full", errorFor(engine.ErrQueueFull)},
		{"queue_timeout", errorFor(fmt.Errorf("%w: waited 30s for KV cells held by running requests or pinned pools (queue timeout 30s)", engine.ErrQueueTimeout))},
		// A pool_id request whose pool's creation timed out: busy (503), not missing.
		{"pool_creation_timeout", errorFor(fmt.Errorf("%w: pool 3 was not created: %w", pool.ErrNotFound,
			fmt.Errorf("%w: waited 30s for KV cells held by running requests or pinned pools (queue timeout 30s)", engine.ErrQueueTimeout)))},
		{"conflict", errorFor(fmt.Errorf("wrapped: %w", pool.ErrHasChildren))},
		{"closed", errorFor(engine.ErrEngineClosed)},
		{"server", errorFor(fmt.Errorf("boom"))},
		{"param", invalidParam("logprobs", "bad %s", "logprobs")},
	} {
		rec := httptest.NewRecorder()
		writeAPIError(rec, c.e)
		fmt.Fprintf(&out, "%s: %d Retry-After=%q\n%s", c.name, rec.Code, rec.Header().Get("Retry-After"), rec.Body.Bytes())
	}
	checkGolden(t, filepath.Join("testdata", "golden", "errors.txt"), out.Bytes())
}
