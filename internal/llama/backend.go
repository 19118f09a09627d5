package llama

/*
#include <stdlib.h>
#include <dlfcn.h>
#include "llama.h"
#include "ggml-backend.h"
#include "kquant.h"

// polykv_dl_check opens path the way ggml will (RTLD_NOW | RTLD_LOCAL), so a missing
// dependency (libcudart, libvulkan, ...) comes back as dlerror's text instead of the silent
// NULL that ggml_backend_load gives. Returns NULL when the library opens. The handle is
// kept, not closed: ggml_backend_load's own dlopen then finds the library already mapped
// instead of unloading and reloading the CUDA runtime and cuBLAS (hundreds of MB).
static const char * polykv_dl_check(const char * path) {
	void * h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char * e = dlerror();
		return e ? e : "dlopen failed";
	}
	return NULL;
}

static ggml_backend_dev_t * polykv_dev_list(int n) {
	return (ggml_backend_dev_t *)calloc((size_t)n + 1, sizeof(ggml_backend_dev_t));
}

static void polykv_dev_list_set(ggml_backend_dev_t * list, int i, ggml_backend_dev_t d) { list[i] = d; }
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"unsafe"
)

// GPUBackends are the ggml backends PolyKV looks for as run-time libraries, in the order
// ggml_backend_load_all tries them. The CPU backend is compiled into the binary and is
// never loaded from a file (a second CPU device would appear).
var GPUBackends = []string{"cuda", "hip", "vulkan"}

// BackendLoad is what happened to one backend library found in a library directory.
type BackendLoad struct {
	Path    string `json:"path"`
	Backend string `json:"backend"`         // ggml's registry name (CUDA, Vulkan, ...) once loaded
	Devices int    `json:"devices"`         // devices the backend found (0: library fine, no usable device)
	Error   string `json:"error,omitempty"` // why the library could not be loaded
}

var (
	loadMu sync.Mutex
	loaded = map[string]BackendLoad{}
)

// LoadBackends loads the GPU backend libraries (libggml-<name>.so for each of GPUBackends)
// found in dirs into ggml's device registry. A library that does not load is reported, not
// fatal: the caller decides whether running on the CPU is acceptable. Each file is loaded
// at most once per process (ggml's registry is process-wide); a repeated call reports the
// earlier outcome. Must be called before the model is loaded.
func LoadBackends(dirs []string) []BackendLoad {
	Init()
	loadMu.Lock()
	defer loadMu.Unlock()
	var out []BackendLoad
	for _, dir := range dirs {
		for _, name := range GPUBackends {
			path := filepath.Join(dir, "libggml-"+name+".so")
			if abs, err := filepath.Abs(path); err == nil {
				path = abs
			}
			if st, err := os.Stat(path); err != nil || !st.Mode().IsRegular() {
				continue
			}
			if prev, ok := loaded[path]; ok {
				out = append(out, prev)
				continue
			}
			out = append(out, loadBackend(path))
			loaded[path] = out[len(out)-1]
		}
	}
	return out
}

func loadBackend(path string) BackendLoad {
	res := BackendLoad{Path: path}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	if e := C.polykv_dl_check(cpath); e != nil {
		res.Error = C.GoString(e)
		return res
	}
	reg := C.ggml_backend_load(cpath)
	if reg == nil {
		res.Error = "ggml could not initialise the backend (wrong ggml version, or ggml_backend_init failed)"
		return res
	}
	res.Backend = C.GoString(C.ggml_backend_reg_name(reg))
	res.Devices = int(C.ggml_backend_reg_dev_count(reg))
	return res
}

// Device is one compute device in ggml's registry (the built-in CPU and whatever the
// loaded GPU backends found).
type Device struct {
	Name        string `json:"name"`        // registry name, e.g. CPU, CUDA0, Vulkan0: what --device takes
	Description string `json:"description"` // e.g. the card's marketing name
	Backend     string `json:"backend"`     // CPU, CUDA, Vulkan, ...
	Type        string `json:"type"`        // cpu, gpu, igpu or accel
	FreeBytes   uint64 `json:"free_bytes"`
	TotalBytes  uint64 `json:"total_bytes"`
}

// IsGPU reports a device llama.cpp can offload layers to (a discrete or integrated GPU).
func (d Device) IsGPU() bool { return d.Type == "gpu" || d.Type == "igpu" }

// Devices lists ggml's registered devices with their memory as the backend reports it now.
func Devices() []Device {
	Init()
	n := int(C.ggml_backend_dev_count())
	out := make([]Device, 0, n)
	for i := range n {
		dev := C.ggml_backend_dev_get(C.size_t(i))
		var free, total C.size_t
		C.ggml_backend_dev_memory(dev, &free, &total)
		d := Device{
			Name:        C.GoString(C.ggml_backend_dev_name(dev)),
			Description: C.GoString(C.ggml_backend_dev_description(dev)),
			Backend:     C.GoString(C.ggml_backend_reg_name(C.ggml_backend_dev_backend_reg(dev))),
			FreeBytes:   uint64(free),
			TotalBytes:  uint64(total),
		}
		switch C.ggml_backend_dev_type(dev) {
		case C.GGML_BACKEND_DEVICE_TYPE_CPU:
			d.Type = "cpu"
		case C.GGML_BACKEND_DEVICE_TYPE_GPU:
			d.Type = "gpu"
		case C.GGML_BACKEND_DEVICE_TYPE_IGPU:
			d.Type = "igpu"
		default:
			d.Type = "accel"
		}
		out = append(out, d)
	}
	return out
}

// ModelParams says where a model's layers go. The zero value is CPU only.
type ModelParams struct {
	// GPULayers is how many layers (counting the output layer, so NLayer()+1 is all) are
	// stored and computed on the GPU devices; 0 keeps everything on the CPU and hands no
	// device to llama.cpp at all, so no operation is offloaded either.
	GPULayers int
	// Devices names the GPU devices to use (Device.Name); empty: every GPU device.
	Devices []string
	// SplitMode spreads layers over several GPUs: "layer" (llama.cpp's default), "row" or
	// "none" (MainGPU only).
	SplitMode string
	// MainGPU is the index into the chosen devices used when SplitMode is "none".
	MainGPU int
	// LoadMTP loads the model's MTP (NextN) layers too (llama_model_params.load_mtp), which
	// an MTP draft context (ContextParams.MTPTarget) runs; without it llama.cpp skips them.
	LoadMTP bool
	// MatMulKernel is the CPU kernel for products with this model's Q4_1, Q4_K and Q6_K
	// weights (PolyKV's unless set; Model.SetMatMulKernel changes it). Per model, not per
	// context: the choice is about the weights, which every context of the model shares,
	// and ggml tells kquant.cpp whose product it is by the weights alone (kquant.cpp).
	MatMulKernel Kernel
}

// LoadModelWith loads a GGUF model with its layers placed as p says. The devices named in
// p must be registered GPU devices (see LoadBackends and Devices).
func LoadModelWith(path string, p ModelParams) (*Model, error) {
	Init()
	if p.MatMulKernel != KernelPolyKV && p.MatMulKernel != KernelGGML {
		return nil, fmt.Errorf("load model: unknown matrix kernel %d", p.MatMulKernel)
	}
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("load model: %w", err)
	}
	params := C.llama_model_default_params()
	params.n_gpu_layers = C.int32_t(max(p.GPULayers, 0))
	switch p.SplitMode {
	case "", "layer":
		params.split_mode = C.LLAMA_SPLIT_MODE_LAYER
	case "row":
		params.split_mode = C.LLAMA_SPLIT_MODE_ROW
	case "none":
		params.split_mode = C.LLAMA_SPLIT_MODE_NONE
	default:
		return nil, fmt.Errorf("load model: unknown split mode %q (layer, row or none)", p.SplitMode)
	}
	params.main_gpu = C.int32_t(p.MainGPU)
	params.load_mtp = C.bool(p.LoadMTP)
	// No extra buffer types for weights: ggml-cpu's only one is runtime repacking (Q4_0,
	// Q4_K, Q8_0, IQ4_NL into interleaved tiles), whose kernels give a token different
	// logits in batches of different sizes (Gemma 3: up to 1.28 between 13- and 256-token
	// chunks), breaking PolyKV's batch-invariance guarantee. PolyKV's own kernels are
	// installed as a compute-only extra (fattn.cpp) and need no weight buffer.
	params.use_extra_bufts = false
	// The device list is always explicit: NULL would let llama.cpp pick every GPU device
	// even with 0 layers (it offloads large batches' matrix products to them), and a CPU-only
	// run must be exactly the CPU run PolyKV has always made.
	var chosen []C.ggml_backend_dev_t
	if p.GPULayers > 0 {
		byName := map[string]C.ggml_backend_dev_t{}
		var gpus []C.ggml_backend_dev_t
		for i := range int(C.ggml_backend_dev_count()) {
			dev := C.ggml_backend_dev_get(C.size_t(i))
			t := C.ggml_backend_dev_type(dev)
			if t == C.GGML_BACKEND_DEVICE_TYPE_GPU || t == C.GGML_BACKEND_DEVICE_TYPE_IGPU {
				byName[C.GoString(C.ggml_backend_dev_name(dev))] = dev
				gpus = append(gpus, dev)
			}
		}
		if len(p.Devices) == 0 {
			chosen = gpus
		}
		for _, name := range p.Devices {
			dev, ok := byName[name]
			if !ok {
				return nil, fmt.Errorf("load model: no GPU device named %q", name)
			}
			chosen = append(chosen, dev)
		}
		if len(chosen) == 0 {
			return nil, fmt.Errorf("load model: %d GPU layers asked for, but no GPU device is registered", p.GPULayers)
		}
	}
	list := C.polykv_dev_list(C.int(len(chosen)))
	defer C.free(unsafe.Pointer(list))
	for i, d := range chosen {
		C.polykv_dev_list_set(list, C.int(i), d)
	}
	params.devices = list
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	m := C.llama_model_load_from_file(cpath, params)
	if m == nil {
		return nil, fmt.Errorf("load model %s: llama.cpp could not load the file (with %d GPU layers)", path, p.GPULayers)
	}
	model := &Model{m: m, vocab: C.llama_model_get_vocab(m), path: path}
	if p.MatMulKernel != KernelPolyKV { // (PolyKV's needs no record: kquant.cpp)
		if err := model.SetMatMulKernel(p.MatMulKernel); err != nil {
			C.llama_model_free(m)
			return nil, fmt.Errorf("load model %s: %w", path, err)
		}
	}
	return model, nil
}
