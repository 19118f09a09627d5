package app

// GPU offload: flag values, library directories, the offload plan, the CPU fallback and its
// /props report. On a machine without a GPU (CI) these run on the CPU; the library tests
// load a broken file and, when `make build-cuda` has run, the real CUDA backend.
// POLYKV_REQUIRE_GPU=1 (scripts/gpu-check.sh) makes TestGPUOffloadAllLayers demand a GPU.

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/llama"
)

func TestParseGPULayers(t *testing.T) {
	for _, tc := range []struct {
		in       string
		layers   int
		required bool
		bad      bool
	}{
		{in: "auto", layers: allLayers}, {in: "AUTO", layers: allLayers},
		{in: "all", layers: allLayers, required: true},
		{in: "0", layers: 0}, {in: "12", layers: 12, required: true},
		{in: "-1", bad: true}, {in: "", bad: true}, {in: "lots", bad: true}, {in: "1.5", bad: true},
	} {
		layers, required, err := ParseGPULayers(tc.in)
		if (err != nil) != tc.bad {
			t.Fatalf("ParseGPULayers(%q): err %v, want error %v", tc.in, err, tc.bad)
		}
		if !tc.bad && (layers != tc.layers || required != tc.required) {
			t.Fatalf("ParseGPULayers(%q) = %d, %v; want %d, %v", tc.in, layers, required, tc.layers, tc.required)
		}
	}
	cfg := DefaultConfig()
	cfg.ModelPath = "m.gguf"
	if cfg.GPULayers != "auto" || cfg.SplitMode != "layer" || cfg.Validate() != nil {
		t.Fatalf("defaults: -ngl %q, --split-mode %q, valid: %v", cfg.GPULayers, cfg.SplitMode, cfg.Validate())
	}
	cfg.GPULayers = "many"
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "-ngl") {
		t.Fatalf("bad -ngl validates: %v", err)
	}
	cfg.GPULayers, cfg.SplitMode = "all", "diagonal"
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "--split-mode") {
		t.Fatalf("bad --split-mode validates: %v", err)
	}
}

func TestLibraryDirs(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "repo", "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(bin, "polykv")
	if err := os.WriteFile(exe, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	want := []string{filepath.Join(bin, "lib"), filepath.Join(dir, "repo", "lib")}
	if got := LibraryDirs(exe, "", false); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("beside the executable: %v, want %v", got, want)
	}
	// A symlinked binary (e.g. /usr/local/bin/polykv) finds the libraries of its real home.
	link := filepath.Join(dir, "polykv")
	if err := os.Symlink(exe, link); err != nil {
		t.Fatal(err)
	}
	if got := LibraryDirs(link, "", false); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("through a symlink: %v, want %v", got, want)
	}
	env := "/opt/a" + string(os.PathListSeparator) + string(os.PathListSeparator) + "/opt/b"
	if got := LibraryDirs(exe, env, true); strings.Join(got, "|") != "/opt/a|/opt/b" {
		t.Fatalf("%s=%q: %v", LibraryPathEnv, env, got)
	}
	if got := LibraryDirs(exe, "", true); len(got) != 0 {
		t.Fatalf("%s set but empty must load nothing, got %v", LibraryPathEnv, got)
	}
}

func TestPlanOffload(t *testing.T) {
	cpu := llama.Device{Name: "CPU", Backend: "CPU", Type: "cpu"}
	gpu0 := llama.Device{Name: "CUDA0", Description: "NVIDIA H200", Backend: "CUDA", Type: "gpu", TotalBytes: 140 << 30}
	gpu1 := llama.Device{Name: "CUDA1", Description: "NVIDIA H200", Backend: "CUDA", Type: "gpu", TotalBytes: 140 << 30}
	noDev := []llama.BackendLoad{{Path: "/x/lib/libggml-cuda.so", Backend: "CUDA", Devices: 0}}
	plan := func(ngl, dev string, devices []llama.Device, libs []llama.BackendLoad) (Offload, error) {
		cfg := DefaultConfig()
		cfg.GPULayers, cfg.Device = ngl, dev
		return PlanOffload(cfg, devices, libs)
	}
	// CPU only: auto falls back and says why; explicit layers are an error that says why.
	o, err := plan("auto", "", []llama.Device{cpu}, nil)
	if err != nil || o.GPULayers != 0 || o.Backend != "CPU" || !strings.Contains(o.CPUReason, "no GPU backend library") {
		t.Fatalf("auto without libraries: %+v, %v", o, err)
	}
	o, err = plan("auto", "", []llama.Device{cpu}, noDev)
	if err != nil || o.GPULayers != 0 || !strings.Contains(o.CPUReason, "libggml-cuda.so loaded but found no CUDA device") {
		t.Fatalf("auto with a CUDA library and no device: %+v, %v", o, err)
	}
	for _, ngl := range []string{"1", "all"} {
		if _, err := plan(ngl, "", []llama.Device{cpu}, noDev); err == nil || !strings.Contains(err.Error(), "no GPU device") ||
			!strings.Contains(err.Error(), "found no CUDA device") {
			t.Fatalf("-ngl %s without a GPU: %v, want a clear error", ngl, err)
		}
	}
	if o, err := plan("0", "", []llama.Device{cpu, gpu0}, nil); err != nil || o.GPULayers != 0 || o.CPUReason != "-ngl 0" {
		t.Fatalf("-ngl 0 with a GPU: %+v, %v", o, err)
	}
	// With GPUs: auto and all take every layer on every GPU; --device picks.
	for _, ngl := range []string{"auto", "all"} {
		o, err := plan(ngl, "", []llama.Device{cpu, gpu0, gpu1}, nil)
		if err != nil || o.GPULayers != allLayers || o.Backend != "CUDA" || strings.Join(o.GPUDevices, ",") != "CUDA0,CUDA1" ||
			o.params.GPULayers != allLayers || len(o.params.Devices) != 2 {
			t.Fatalf("-ngl %s with two GPUs: %+v, %v", ngl, o, err)
		}
	}
	if o, err := plan("20", "CUDA1", []llama.Device{cpu, gpu0, gpu1}, nil); err != nil || o.GPULayers != 20 || strings.Join(o.params.Devices, ",") != "CUDA1" {
		t.Fatalf("-ngl 20 --device CUDA1: %+v, %v", o, err)
	}
	if _, err := plan("auto", "CUDA7", []llama.Device{cpu, gpu0}, nil); err == nil || !strings.Contains(err.Error(), "CUDA7") || !strings.Contains(err.Error(), "CUDA0") {
		t.Fatalf("unknown --device: %v", err)
	}
	if _, err := plan("auto", "CPU", []llama.Device{cpu, gpu0}, nil); err == nil {
		t.Fatal("--device CPU is not a GPU to offload to, want an error")
	}
	if o, err := plan("auto", "none", []llama.Device{cpu, gpu0}, nil); err != nil || o.GPULayers != 0 || o.CPUReason != "--device none" {
		t.Fatalf("--device none: %+v, %v", o, err)
	}
	if _, err := plan("all", "none", []llama.Device{cpu, gpu0}, nil); err == nil {
		t.Fatal("--device none with -ngl all contradict, want an error")
	}
	if s := (Offload{Backend: "CUDA", GPULayers: 31, Layers: 31, GPUDevices: []string{"CUDA0"}, Devices: []llama.Device{gpu0}}).Summary(); s != "CUDA, 31/31 layers on CUDA0 NVIDIA H200 (140.0 GiB)" {
		t.Fatalf("summary: %q", s)
	}
}

// skipIfGPU skips the CPU-fallback tests in a process where a GPU backend with devices is
// already registered (ggml's registry is process-wide: gpu-check.sh runs this package with
// the CUDA library loaded).
func skipIfGPU(t *testing.T) {
	for _, d := range llama.Devices() {
		if d.IsGPU() {
			t.Skipf("a GPU device (%s) is registered in this process", d.Name)
		}
	}
}

// Without GPU libraries the server runs on the CPU, says so once in the log, and /props
// reports the devices and the (absent) offload; -ngl N is a startup error.
func TestCPUFallbackAndProps(t *testing.T) {
	path := modelPath(t)
	skipIfGPU(t)
	t.Setenv(LibraryPathEnv, t.TempDir())
	var logBuf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logBuf, nil))
	cfg := DefaultConfig()
	cfg.ModelPath = path
	a, err := Open(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if n := strings.Count(logBuf.String(), "running on the CPU"); n != 1 {
		t.Fatalf("the CPU fallback is said %d times at startup, want once:\n%s", n, logBuf.String())
	}
	if !strings.Contains(logBuf.String(), "no GPU backend library") {
		t.Fatalf("the startup message does not say why:\n%s", logBuf.String())
	}
	if a.Offload.GPULayers != 0 || a.Offload.Layers != a.Model.NLayer()+1 {
		t.Fatalf("offload %+v", a.Offload)
	}
	rec := httptestProps(t, a)
	var props struct {
		Compute struct {
			Backend     string         `json:"backend"`
			Requested   string         `json:"n_gpu_layers"`
			GPULayers   *int           `json:"gpu_layers"`
			Layers      int            `json:"layers"`
			Devices     []llama.Device `json:"devices"`
			LibraryDirs []string       `json:"library_dirs"`
			CPUReason   string         `json:"cpu_reason"`
		} `json:"compute"`
	}
	if err := json.Unmarshal(rec, &props); err != nil {
		t.Fatal(err)
	}
	c := props.Compute
	if c.Backend != "CPU" || c.Requested != "auto" || c.GPULayers == nil || *c.GPULayers != 0 || c.Layers != a.Model.NLayer()+1 ||
		len(c.LibraryDirs) != 1 || c.CPUReason == "" {
		t.Fatalf("/props compute: %s", rec)
	}
	if len(c.Devices) == 0 || c.Devices[0].Type != "cpu" || c.Devices[0].Name == "" {
		t.Fatalf("/props lists no CPU device: %s", rec)
	}
	for _, ngl := range []string{"4", "all"} {
		cfg.GPULayers = ngl
		if b, err := Open(cfg, nil); err == nil {
			b.Close()
			t.Fatalf("-ngl %s without a GPU started", ngl)
		} else if !strings.Contains(err.Error(), "no GPU device") || !strings.Contains(err.Error(), "make build-cuda") {
			t.Fatalf("-ngl %s without a GPU: unclear error %q", ngl, err)
		}
	}
}

func httptestProps(t *testing.T, a *App) []byte {
	t.Helper()
	rec := httptest.NewRecorder()
	a.API.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/props", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("/props: %d %s", rec.Code, rec.Body.String())
	}
	return rec.Body.Bytes()
}

// A file that is not a loadable library is reported with the loader's reason and the
// server falls back to the CPU; asking for layers then names the broken file.
func TestBrokenGPULibraryFallsBack(t *testing.T) {
	path := modelPath(t)
	skipIfGPU(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "libggml-cuda.so"), []byte("not an ELF file"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(LibraryPathEnv, dir)
	cfg := DefaultConfig()
	cfg.ModelPath = path
	m, off, err := LoadModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Free()
	if len(off.Libraries) != 1 || off.Libraries[0].Error == "" || !strings.Contains(off.CPUReason, "libggml-cuda.so did not load") {
		t.Fatalf("broken library: %+v", off)
	}
	cfg.GPULayers = "all"
	if _, _, err := LoadModel(cfg); err == nil || !strings.Contains(err.Error(), "libggml-cuda.so did not load") {
		t.Fatalf("-ngl all with a broken library: %v", err)
	}
}

// When `make build-cuda` has run, the real CUDA backend loads into this process; without an
// NVIDIA driver or device it must report "no CUDA device" cleanly, not crash, and the
// server runs on the CPU.
func TestBuiltCUDALibraryLoads(t *testing.T) {
	path := modelPath(t)
	lib, _ := filepath.Abs(filepath.Join("..", "..", "lib"))
	if _, err := os.Stat(filepath.Join(lib, "libggml-cuda.so")); err != nil {
		t.Skip("lib/libggml-cuda.so not built (make build-cuda)")
	}
	t.Setenv(LibraryPathEnv, lib)
	loads := llama.LoadBackends([]string{lib})
	if len(loads) != 1 || loads[0].Error != "" || loads[0].Backend != "CUDA" {
		t.Fatalf("lib/libggml-cuda.so: %+v", loads)
	}
	if loads[0].Devices > 0 {
		t.Skipf("%d CUDA device(s) here: TestGPUOffloadAllLayers covers this machine", loads[0].Devices)
	}
	cfg := DefaultConfig()
	cfg.ModelPath = path
	m, off, err := LoadModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Free()
	if off.GPULayers != 0 || !strings.Contains(off.CPUReason, "libggml-cuda.so loaded but found no CUDA device") {
		t.Fatalf("CUDA library without a device: %+v", off)
	}
	cfg.GPULayers = "all"
	if _, _, err := LoadModel(cfg); err == nil || !strings.Contains(err.Error(), "found no CUDA device") {
		t.Fatalf("-ngl all with the CUDA library and no device: %v", err)
	}
}

// On a GPU machine (POLYKV_REQUIRE_GPU=1 with the CUDA library in $POLYKV_LIBRARY_PATH)
// the default -ngl auto puts every layer on the GPU, which is what the other real-model
// tests of the same run then exercise; a pooled greedy completion still equals the
// unpooled one there (TestPooledMatchesUnpooled in pools_test.go runs in the same process).
func TestGPUOffloadAllLayers(t *testing.T) {
	path := modelPath(t)
	if os.Getenv("POLYKV_REQUIRE_GPU") != "1" {
		t.Skip("POLYKV_REQUIRE_GPU=1 not set (scripts/gpu-check.sh sets it on a GPU machine)")
	}
	cfg := DefaultConfig()
	cfg.ModelPath = path
	cfg.GPULayers = "all"
	a, err := Open(cfg, nil)
	if err != nil {
		t.Fatalf("-ngl all on the GPU machine: %v", err)
	}
	defer a.Close()
	if a.Offload.GPULayers != a.Offload.Layers || a.Offload.Backend == "CPU" {
		t.Fatalf("offload %+v: want every layer on a GPU", a.Offload)
	}
	t.Logf("offload: %s", a.Offload.Summary())
	rec := httptestProps(t, a)
	if !bytes.Contains(rec, []byte(`"gpu_layers":`+itoa(a.Offload.Layers))) {
		t.Fatalf("/props does not report the offload: %s", rec)
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }
