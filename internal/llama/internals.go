package llama

// Go views of the parts of internals.h that only the binding's C++ uses (cellorder.cpp,
// kquant.cpp, fattn.cpp), so that internals_test.go can check each function of that API
// on its own. (The rest of internals.h is Go API already: KVBytesPerCellTyped,
// RecurrentBytesPerSeq, MemoryBytes, MTPLoaded, SetEmbeddingsNextN, SetNextNLayer,
// EmbeddingsNextN.)

/*
#include <stdlib.h>
#include "internals.h"
*/
import "C"

import "unsafe"

// attnLayer is a polykv_attn_layer.
type attnLayer struct {
	cells, kdata unsafe.Pointer
	kbytes       int
	il, nStream  int
	dk, dv       int
}

// attnLayers is polykv_attn_layers: the context's attention layers and what it reports
// of the context (flash attention on, memory it cannot read, neither ALiBi nor soft-cap).
func (c *Context) attnLayers() (layers []attnLayer, flashAttn, unknown, plain bool) {
	var info C.struct_polykv_attn_info
	n := int(C.polykv_attn_layers(c.c, &info, nil, 0))
	out := make([]C.struct_polykv_attn_layer, max(n, 1))
	n = int(C.polykv_attn_layers(c.c, &info, &out[0], C.int(len(out))))
	for _, l := range out[:n] {
		layers = append(layers, attnLayer{cells: unsafe.Pointer(l.cells), kdata: unsafe.Pointer(l.kdata), kbytes: int(l.kbytes),
			il: int(l.il), nStream: int(l.n_stream), dk: int(l.dk), dv: int(l.dv)})
	}
	return layers, bool(info.flash_attn), bool(info.unknown), bool(info.plain)
}

// cellPositions is polykv_cell_positions over a layer's cells.
func cellPositions(l attnLayer, idx []uint32) []int32 {
	if len(idx) == 0 {
		return nil
	}
	ci := C.malloc(C.size_t(4 * len(idx)))
	defer C.free(ci)
	cp := C.malloc(C.size_t(4 * len(idx)))
	defer C.free(cp)
	copy(unsafe.Slice((*uint32)(ci), len(idx)), idx)
	C.polykv_cell_positions(l.cells, (*C.uint32_t)(ci), C.int(len(idx)), (*C.int32_t)(cp))
	return append([]int32(nil), unsafe.Slice((*int32)(cp), len(idx))...)
}

// modelHostBuffers is polykv_model_host_buffers: how many distinct host buffers hold
// m's weights.
func (m *Model) modelHostBuffers() int { return int(C.polykv_model_host_buffers(m.m, nil, 0)) }

// expRow is polykv_exp_row over a copy of s (len(s) a multiple of 8).
func expRow(s []float32, max float32) []float32 {
	p := C.malloc(C.size_t(4 * len(s)))
	defer C.free(p)
	copy(unsafe.Slice((*float32)(p), len(s)), s)
	C.polykv_exp_row((*C.float)(p), C.int64_t(len(s)), C.float(max))
	return append([]float32(nil), unsafe.Slice((*float32)(p), len(s))...)
}
