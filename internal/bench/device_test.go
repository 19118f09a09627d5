package bench

import (
	"bytes"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/testmodel"
)

// The benchmark's first line says which device it runs on (the CPU here, and why).
func TestBenchPrintsDevice(t *testing.T) {
	model := testmodel.SmolLM2(t)
	t.Setenv(app.LibraryPathEnv, t.TempDir())
	cfg := app.DefaultConfig()
	cfg.ModelPath = model
	cfg = cfg.Resolved()
	var out bytes.Buffer
	if err := printDevice(&out, cfg); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "device: CPU (no GPU device: no GPU backend library") {
		t.Fatalf("bench device line: %q", out.String())
	}
	cfg.GPULayers = "all"
	if err := printDevice(&out, cfg); err == nil || !strings.Contains(err.Error(), "no GPU device") {
		t.Fatalf("bench -ngl all without a GPU: %v", err)
	}
}
