package app

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/polykv/polykv/internal/llama"
)

// LibraryPathEnv names the environment variable that replaces the default GPU library
// directories (a list in the OS's PATH syntax). Set but empty: load no GPU library.
const LibraryPathEnv = "POLYKV_LIBRARY_PATH"

// allLayers is llama.cpp's own "every layer" (llama_model_default_params uses 999): more
// than any model has, the output layer included.
const allLayers = 999

// LibraryDirs is where GPU backend libraries are looked for: $POLYKV_LIBRARY_PATH when it is
// set, else lib/ beside the executable and ../lib (bin/polykv finds the repo's lib/).
func LibraryDirs(exe, env string, envSet bool) []string {
	if envSet {
		var dirs []string
		for _, d := range filepath.SplitList(env) {
			if d != "" {
				dirs = append(dirs, d)
			}
		}
		return dirs
	}
	if r, err := filepath.EvalSymlinks(exe); err == nil {
		exe = r
	}
	dir := filepath.Dir(exe)
	return []string{filepath.Join(dir, "lib"), filepath.Clean(filepath.Join(dir, "..", "lib"))}
}

// defaultLibraryDirs applies LibraryDirs to this process.
func defaultLibraryDirs() []string {
	exe, err := os.Executable()
	if err != nil {
		exe = "."
	}
	env, set := os.LookupEnv(LibraryPathEnv)
	return LibraryDirs(exe, env, set)
}

// ParseGPULayers reads an -ngl value: "auto" (every layer when a GPU device exists, else
// the CPU), "all" (every layer; a GPU is required) or a count N >= 0 (N > 0 requires a GPU).
// It returns the layer count to ask llama.cpp for and whether a GPU is required.
func ParseGPULayers(v string) (layers int, required bool, err error) {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "auto":
		return allLayers, false, nil
	case "all":
		return allLayers, true, nil
	}
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 0 {
		return 0, false, fmt.Errorf("-ngl/--n-gpu-layers must be auto, all or a layer count >= 0, got %q", v)
	}
	return n, n > 0, nil
}

// Offload is where the model runs: the devices ggml found, the GPU layers chosen and why.
// /props reports it as "compute" and the benchmark prints Summary.
type Offload struct {
	Backend     string              `json:"backend"`      // "CPU" or the GPU backend in use (CUDA, Vulkan, ...)
	Requested   string              `json:"n_gpu_layers"` // the -ngl value as given
	GPULayers   int                 `json:"gpu_layers"`   // layers stored and computed on the GPU
	Layers      int                 `json:"layers"`       // the model's layers, output layer included
	GPUDevices  []string            `json:"gpu_devices"`  // devices the layers are spread over
	SplitMode   string              `json:"split_mode"`   // layer, row or none
	Devices     []llama.Device      `json:"devices"`      // every registered device, the CPU included
	LibraryDirs []string            `json:"library_dirs"` // where GPU libraries were looked for
	Libraries   []llama.BackendLoad `json:"libraries"`    // GPU libraries found there and how they loaded
	CPUReason   string              `json:"cpu_reason"`   // why the model runs on the CPU ("" when offloaded)
	params      llama.ModelParams
}

// Summary is one line for logs and benchmark headers.
func (o Offload) Summary() string {
	if o.GPULayers == 0 {
		return "CPU (" + o.CPUReason + ")"
	}
	desc := make([]string, 0, len(o.GPUDevices))
	for _, name := range o.GPUDevices {
		for _, d := range o.Devices {
			if d.Name == name {
				desc = append(desc, fmt.Sprintf("%s %s (%.1f GiB)", d.Name, d.Description, float64(d.TotalBytes)/(1<<30)))
			}
		}
	}
	return fmt.Sprintf("%s, %d/%d layers on %s", o.Backend, o.GPULayers, o.Layers, strings.Join(desc, ", "))
}

// PlanOffload decides the GPU layers and devices from the flags and the registered
// devices, before the model is loaded. It fails when the flags ask for GPU layers (-ngl N
// > 0 or all, or --device NAME) and no such GPU exists: a silent CPU run would be a surprise
// an order of magnitude slower than the user planned for.
func PlanOffload(cfg Config, devices []llama.Device, libs []llama.BackendLoad) (Offload, error) {
	// Empty lists, not nil: /props shows [] rather than null.
	o := Offload{Requested: cfg.GPULayers, SplitMode: cfg.SplitMode, Devices: devices, Libraries: libs, Backend: "CPU",
		GPUDevices: []string{}}
	if o.Libraries == nil {
		o.Libraries = []llama.BackendLoad{}
	}
	layers, required, err := ParseGPULayers(cfg.GPULayers)
	if err != nil {
		return o, err
	}
	var gpus []llama.Device
	for _, d := range devices {
		if d.IsGPU() {
			gpus = append(gpus, d)
		}
	}
	names := strings.TrimSpace(cfg.Device)
	if strings.EqualFold(names, "none") {
		if required {
			return o, fmt.Errorf("--device none keeps the model on the CPU, but -ngl %s asks for GPU layers", cfg.GPULayers)
		}
		o.CPUReason = "--device none"
		return o, nil
	}
	var chosen []llama.Device
	if names != "" {
		for _, name := range strings.Split(names, ",") {
			name = strings.TrimSpace(name)
			found := false
			for _, d := range gpus {
				if d.Name == name {
					chosen = append(chosen, d)
					found = true
				}
			}
			if !found {
				return o, fmt.Errorf("--device %s: no such GPU device; %s", name, describeDevices(gpus, libs))
			}
		}
		required = required || layers > 0
	} else {
		chosen = gpus
	}
	if layers == 0 {
		o.CPUReason = "-ngl 0"
		return o, nil
	}
	if len(chosen) == 0 {
		if required {
			return o, fmt.Errorf("-ngl %s asks for GPU layers, but there is no GPU device: %s", cfg.GPULayers, describeDevices(gpus, libs))
		}
		o.CPUReason = "no GPU device: " + describeDevices(gpus, libs)
		return o, nil
	}
	o.Backend = chosen[0].Backend
	for _, d := range chosen {
		o.GPUDevices = append(o.GPUDevices, d.Name)
	}
	o.GPULayers = layers // the model's layer count caps it once the model is loaded
	o.params = llama.ModelParams{GPULayers: layers, Devices: o.GPUDevices, SplitMode: cfg.SplitMode}
	return o, nil
}

// describeDevices says what was found, for errors and the CPU fallback note.
func describeDevices(gpus []llama.Device, libs []llama.BackendLoad) string {
	if len(gpus) > 0 {
		names := make([]string, len(gpus))
		for i, d := range gpus {
			names[i] = d.Name
		}
		return "GPU devices: " + strings.Join(names, ", ")
	}
	if len(libs) == 0 {
		return "no GPU backend library (libggml-cuda.so, libggml-vulkan.so) in the library directories (make build-cuda, or set " + LibraryPathEnv + ")"
	}
	var parts []string
	for _, l := range libs {
		switch {
		case l.Error != "":
			parts = append(parts, fmt.Sprintf("%s did not load: %s", filepath.Base(l.Path), l.Error))
		default:
			parts = append(parts, fmt.Sprintf("%s loaded but found no %s device", filepath.Base(l.Path), l.Backend))
		}
	}
	return strings.Join(parts, "; ")
}

// finish caps the planned layers by the loaded model's count.
func (o *Offload) finish(m *llama.Model) {
	o.Layers = m.NLayer() + 1
	o.GPULayers = min(o.GPULayers, o.Layers)
}

// ListDevices loads the GPU libraries from the default directories and describes every
// device, for `polykv serve --list-devices`.
func ListDevices() (dirs []string, libs []llama.BackendLoad, devices []llama.Device) {
	dirs = defaultLibraryDirs()
	libs = llama.LoadBackends(dirs)
	return dirs, libs, llama.Devices()
}

// LoadModel loads the GPU backend libraries (once per process), places the model's layers as
// cfg's -ngl, --device and --split-mode say, and loads it. Open and the benchmark's raw
// decode loop use it, so both run on the same devices.
func LoadModel(cfg Config) (*llama.Model, Offload, error) {
	spec, err := cfg.specPlan()
	if err != nil {
		return nil, Offload{}, err
	}
	return loadModel(cfg, spec.mtpLayers())
}

// loadModel is LoadModel, with the model's MTP layers when mtpLayers (the drafter is
// the model's MTP head: draft-mtp).
func loadModel(cfg Config, mtpLayers bool) (*llama.Model, Offload, error) {
	// GPU backends load before the model: llama.cpp places layers on the devices that
	// ggml's registry holds when the model is loaded.
	dirs := defaultLibraryDirs()
	libs := llama.LoadBackends(dirs)
	off, err := PlanOffload(cfg, llama.Devices(), libs)
	off.LibraryDirs = dirs
	if err != nil {
		return nil, off, fmt.Errorf("%w (library directories: %s)", err, strings.Join(dirs, ", "))
	}
	params := off.params
	params.MatMulKernel = llama.KernelNamed(cfg.MMKernel) // this model's, not the process's
	params.LoadMTP = mtpLayers                            // the MTP head drafts (draft-mtp)
	model, err := llama.LoadModelWith(cfg.ModelPath, params)
	if err != nil {
		return nil, off, err
	}
	off.finish(model)
	return model, off, nil
}
