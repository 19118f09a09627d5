// Package llama is PolyKV's only cgo package: a thin binding over llama.cpp's C API
// (llama.h), linked against the static libraries that scripts/llama.sh builds from the
// pinned llama.cpp source release (llama.cpp.pin); the Makefile points cgo at them.
//
// It covers what the engine needs and nothing else: model and context lifetime, batches
// and llama_decode, the sequence operations of the unified KV cache, logits, the
// sampler chain, tokenization and chat templates. C failures come back as Go errors;
// nothing here panics across the boundary, and the C++ exceptions llama.cpp's grammar
// code throws are caught in sampler_shim.cpp before they could reach cgo (where any
// exception aborts the process).
//
// Concurrency: a Context (and everything that decodes or samples with it) belongs to one
// goroutine. Model methods that only read the vocabulary or metadata (Tokenize,
// TokenPiece, Detokenize, ApplyChatTemplate, ...) are safe from any goroutine.
package llama

/*
#cgo CFLAGS: -std=c11 -Wall
#cgo CXXFLAGS: -std=c++17 -Wall -Wextra
#cgo LDFLAGS: -lllama -lggml -lggml-cpu -lggml-base -lstdc++ -lm -lpthread -ldl
#include <stdlib.h>
#include <string.h>
#include "llama.h"
#include "internals.h"
#include "kquant.h"

static void polykv_quiet_log(enum ggml_log_level level, const char * text, void * user_data) {
	(void)text; (void)user_data;
	if (level == GGML_LOG_LEVEL_ERROR) {
		fputs(text, stderr);
	}
}

#include "ggml-cpu.h"

// The Makefile passes -DPOLYKV_LLAMA_BUILD_INFO=b<build>-pypi-<sha256 prefix> (the pinned
// release the headers came from); stringified in two steps so the macro expands first.
#define POLYKV_STR2(x) #x
#define POLYKV_STR(x) POLYKV_STR2(x)
static const char * polykv_build_info(void) {
#ifdef POLYKV_LLAMA_BUILD_INFO
	return POLYKV_STR(POLYKV_LLAMA_BUILD_INFO);
#else
	return "unknown";
#endif
}

// polykv_cpu_features packs the x86 features ggml-cpu was compiled with, one bit each
// in the order of cpuFeatureNames.
static unsigned polykv_cpu_features(void) {
	int f[] = {ggml_cpu_has_sse3(), ggml_cpu_has_ssse3(), ggml_cpu_has_avx(), ggml_cpu_has_avx2(),
		ggml_cpu_has_f16c(), ggml_cpu_has_fma(), ggml_cpu_has_bmi2(), ggml_cpu_has_avx_vnni(),
		ggml_cpu_has_avx512(), ggml_cpu_has_avx512_vbmi(), ggml_cpu_has_avx512_vnni(),
		ggml_cpu_has_avx512_bf16(), ggml_cpu_has_amx_int8(), ggml_cpu_has_llamafile()};
	unsigned bits = 0;
	for (unsigned i = 0; i < sizeof(f) / sizeof(f[0]); i++) {
		if (f[i]) bits |= 1u << i;
	}
	return bits;
}

static void polykv_set_quiet(int quiet) {
	llama_log_set(quiet ? polykv_quiet_log : NULL, NULL);
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"
)

// Token is a llama.cpp token id.
type Token = int32

var initOnce sync.Once

// Init initialises the llama.cpp backend once per process. Logging from llama.cpp is
// limited to errors unless POLYKV_LLAMA_LOG=1.
func Init() {
	initOnce.Do(func() {
		quiet := 1
		if os.Getenv("POLYKV_LLAMA_LOG") == "1" {
			quiet = 0
		}
		C.polykv_set_quiet(C.int(quiet))
		C.llama_backend_init()
	})
}

// Model is a loaded GGUF model.
type Model struct {
	m     *C.struct_llama_model
	vocab *C.struct_llama_vocab
	path  string
}

// LoadModel loads a GGUF model from path into CPU memory (mmap), with no GPU offload.
func LoadModel(path string) (*Model, error) { return LoadModelWith(path, ModelParams{}) }

// Free releases the model. No context created from it may be used afterwards.
func (m *Model) Free() {
	if m.m != nil {
		C.polykv_kq_model_forget(m.m)
		C.llama_model_free(m.m)
		m.m = nil
	}
}

// Path is the file the model was loaded from.
func (m *Model) Path() string { return m.path }

// Desc is llama.cpp's short description of the model (architecture, size, quant).
func (m *Model) Desc() string {
	buf := make([]byte, 256)
	n := C.llama_model_desc(m.m, (*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)))
	if n < 0 {
		return ""
	}
	return string(buf[:min(int(n), len(buf))])
}

// Meta returns a GGUF metadata string value, or "" when absent.
func (m *Model) Meta(key string) string {
	ckey := C.CString(key)
	defer C.free(unsafe.Pointer(ckey))
	n := C.llama_model_meta_val_str(m.m, ckey, nil, 0)
	if n < 0 {
		return ""
	}
	buf := make([]byte, int(n)+1)
	C.llama_model_meta_val_str(m.m, ckey, (*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)))
	return string(buf[:n])
}

// NVocab is the vocabulary size.
func (m *Model) NVocab() int { return int(C.llama_vocab_n_tokens(m.vocab)) }

// NCtxTrain is the context length the model was trained with.
func (m *Model) NCtxTrain() int { return int(C.llama_model_n_ctx_train(m.m)) }

// NLayer, NHead, NHeadKV and NEmbd describe the transformer's shape.
func (m *Model) NLayer() int { return int(C.llama_model_n_layer(m.m)) }

// NHead is the number of attention heads.
func (m *Model) NHead() int { return int(C.llama_model_n_head(m.m)) }

// NHeadKV is the number of key/value heads (GQA).
func (m *Model) NHeadKV() int { return int(C.llama_model_n_head_kv(m.m)) }

// NEmbd is the embedding width.
func (m *Model) NEmbd() int { return int(C.llama_model_n_embd(m.m)) }

// NSWA is the sliding-window size of the model's SWA layers (0 when it has none).
func (m *Model) NSWA() int { return int(C.llama_model_n_swa(m.m)) }

// IsRecurrent reports a recurrent-memory model (Mamba, RWKV, ...).
func (m *Model) IsRecurrent() bool { return bool(C.llama_model_is_recurrent(m.m)) }

// IsHybrid reports a model mixing attention and recurrent layers.
func (m *Model) IsHybrid() bool { return bool(C.llama_model_is_hybrid(m.m)) }

// ChatTemplate is the model's own chat template (GGUF tokenizer.chat_template), or "".
func (m *Model) ChatTemplate() string {
	t := C.llama_model_chat_template(m.m, nil)
	if t == nil {
		return ""
	}
	return C.GoString(t)
}

// IsEOG reports whether tok ends generation (EOS, EOT, ...).
func (m *Model) IsEOG(tok Token) bool { return bool(C.llama_vocab_is_eog(m.vocab, C.llama_token(tok))) }

// BOS is the beginning-of-sequence token (-1 when the model has none).
func (m *Model) BOS() Token { return Token(C.llama_vocab_bos(m.vocab)) }

// EOS is the end-of-sequence token (-1 when the model has none).
func (m *Model) EOS() Token { return Token(C.llama_vocab_eos(m.vocab)) }

// ValidToken reports whether tok is inside the vocabulary.
func (m *Model) ValidToken(tok Token) bool { return tok >= 0 && int(tok) < m.NVocab() }

// Tokenize converts text to tokens. addSpecial adds BOS/EOS as the model is configured;
// parseSpecial lets control tokens written in the text (e.g. "<|im_start|>") be parsed.
func (m *Model) Tokenize(text string, addSpecial, parseSpecial bool) ([]Token, error) {
	if len(text) > 1<<30 {
		return nil, errors.New("tokenize: text too long")
	}
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	capacity := len(text) + 8
	for range 2 {
		buf := make([]Token, capacity)
		n := C.llama_tokenize(m.vocab, ctext, C.int32_t(len(text)), (*C.llama_token)(unsafe.Pointer(&buf[0])),
			C.int32_t(capacity), C.bool(addSpecial), C.bool(parseSpecial))
		if n >= 0 {
			return buf[:n], nil
		}
		if n == C.INT32_MIN {
			return nil, errors.New("tokenize: result overflows")
		}
		capacity = int(-n)
	}
	return nil, errors.New("tokenize: buffer sizing failed")
}

// TokenPiece is the raw bytes a token stands for (special tokens rendered when special).
// A piece may be part of a multi-byte UTF-8 character.
func (m *Model) TokenPiece(tok Token, special bool) []byte {
	if !m.ValidToken(tok) {
		return nil
	}
	buf := make([]byte, 64)
	n := C.llama_token_to_piece(m.vocab, C.llama_token(tok), (*C.char)(unsafe.Pointer(&buf[0])), C.int32_t(len(buf)), 0, C.bool(special))
	if n < 0 {
		buf = make([]byte, int(-n))
		n = C.llama_token_to_piece(m.vocab, C.llama_token(tok), (*C.char)(unsafe.Pointer(&buf[0])), C.int32_t(len(buf)), 0, C.bool(special))
	}
	if n < 0 {
		return nil
	}
	return buf[:n]
}

// Detokenize converts tokens back to text. Every token must satisfy ValidToken.
func (m *Model) Detokenize(tokens []Token, removeSpecial, unparseSpecial bool) (string, error) {
	if len(tokens) == 0 {
		return "", nil
	}
	for i, t := range tokens {
		if !m.ValidToken(t) {
			return "", fmt.Errorf("detokenize: token %d at index %d is outside the vocabulary (0..%d)", t, i, m.NVocab()-1)
		}
	}
	capacity := len(tokens)*8 + 16
	for range 2 {
		buf := make([]byte, capacity)
		n := C.llama_detokenize(m.vocab, (*C.llama_token)(unsafe.Pointer(&tokens[0])), C.int32_t(len(tokens)),
			(*C.char)(unsafe.Pointer(&buf[0])), C.int32_t(capacity), C.bool(removeSpecial), C.bool(unparseSpecial))
		if n >= 0 {
			return string(buf[:n]), nil
		}
		capacity = int(-n)
	}
	return "", errors.New("detokenize: buffer sizing failed")
}

// ChatMessage is one role/content pair for ApplyChatTemplate.
type ChatMessage struct {
	Role    string
	Content string
}

// ApplyChatTemplate renders messages with tmpl (the model's own template when "") using
// llama.cpp's built-in template detection. addAssistant appends the assistant turn start.
func (m *Model) ApplyChatTemplate(tmpl string, msgs []ChatMessage, addAssistant bool) (string, error) {
	var ctmpl *C.char
	if tmpl == "" {
		ctmpl = C.llama_model_chat_template(m.m, nil)
		if ctmpl == nil {
			return "", errors.New("chat template: the model has no chat template")
		}
	} else {
		ctmpl = C.CString(tmpl)
		defer C.free(unsafe.Pointer(ctmpl))
	}
	n := len(msgs)
	cmsgs := (*[1 << 20]C.struct_llama_chat_message)(C.malloc(C.size_t(max(n, 1)) * C.size_t(unsafe.Sizeof(C.struct_llama_chat_message{}))))[:max(n, 1):max(n, 1)]
	defer C.free(unsafe.Pointer(&cmsgs[0]))
	total := 0
	for i, msg := range msgs {
		cmsgs[i].role = C.CString(msg.Role)
		cmsgs[i].content = C.CString(msg.Content)
		total += len(msg.Role) + len(msg.Content)
	}
	defer func() {
		for i := range msgs {
			C.free(unsafe.Pointer(cmsgs[i].role))
			C.free(unsafe.Pointer(cmsgs[i].content))
		}
	}()
	capacity := 2*total + 256
	for range 2 {
		buf := make([]byte, capacity)
		r := C.llama_chat_apply_template(ctmpl, &cmsgs[0], C.size_t(n), C.bool(addAssistant), (*C.char)(unsafe.Pointer(&buf[0])), C.int32_t(capacity))
		if r < 0 {
			return "", errors.New("chat template: llama.cpp does not support this template")
		}
		if int(r) <= capacity {
			return string(buf[:r]), nil
		}
		capacity = int(r)
	}
	return "", errors.New("chat template: buffer sizing failed")
}

// CacheType is a KV cache element type, named as llama-server's --cache-type-k/-v
// name them: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1. "" means f16.
type CacheType string

var cacheTypes = map[CacheType]C.enum_ggml_type{
	"f32": C.GGML_TYPE_F32, "f16": C.GGML_TYPE_F16, "bf16": C.GGML_TYPE_BF16,
	"q8_0": C.GGML_TYPE_Q8_0, "q4_0": C.GGML_TYPE_Q4_0, "q4_1": C.GGML_TYPE_Q4_1,
	"iq4_nl": C.GGML_TYPE_IQ4_NL, "q5_0": C.GGML_TYPE_Q5_0, "q5_1": C.GGML_TYPE_Q5_1,
}

// CacheTypeNames lists the accepted names, for flag help and errors.
const CacheTypeNames = "f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"

func (t CacheType) ggml() (C.enum_ggml_type, error) {
	if t == "" {
		return C.GGML_TYPE_F16, nil
	}
	g, ok := cacheTypes[t]
	if !ok {
		return 0, fmt.Errorf("unknown cache type %q (one of %s)", string(t), CacheTypeNames)
	}
	return g, nil
}

// Valid reports whether t names a cache type ("" counts as f16).
func (t CacheType) Valid() bool { _, err := t.ggml(); return err == nil }

// Quantized reports a block-quantized type (anything but f32, f16 and bf16).
func (t CacheType) Quantized() bool {
	switch t {
	case "", "f32", "f16", "bf16":
		return false
	}
	return t.Valid()
}

// rowBytes is the size of n elements of type t, as ggml stores them (whole blocks).
func (t CacheType) rowBytes(n int64) int64 {
	g, err := t.ggml()
	if err != nil || n <= 0 {
		return 0
	}
	return int64(C.ggml_row_size(g, C.int64_t(n)))
}

// KVBytesPerCell is the size of one KV cell (one token position across all layers) with
// an f16 cache: see KVBytesPerCellTyped.
func (m *Model) KVBytesPerCell() int64 { return m.KVBytesPerCellTyped("", "") }

// KVBytesPerCellTyped is the size of one KV cell (one token position across all
// layers) with K and V caches of types tk and tv: per layer that keeps K and V, one K
// row of n_head_kv × key_length elements and one V row of n_head_kv × value_length,
// sized by ggml_row_size (quantized types store whole blocks), the geometry read per
// layer from llama.cpp's hyperparameters (internals.cpp): a hybrid's recurrent layers keep
// no KV, and Gemma 4's sliding-window layers have smaller heads than its full layers.
func (m *Model) KVBytesPerCellTyped(tk, tv CacheType) int64 {
	gk, errK := tk.ggml()
	gv, errV := tv.ggml()
	if errK != nil || errV != nil {
		return 0
	}
	return int64(C.polykv_kv_bytes_per_cell(m.m, C.int(gk), C.int(gv)))
}

// BuildInfo names the linked llama.cpp the way llama-server's /props build_info does:
// b<build number>-<source id>; a source release has no commit, so the id is
// "pypi-" and the first ten hex digits of the pinned sdist's sha256.
func BuildInfo() string { return C.GoString(C.polykv_build_info()) }

var cpuFeatureNames = []string{"SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2", "AVX_VNNI",
	"AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8", "LLAMAFILE"}

// CPUFeatures lists the x86 features ggml's CPU backend was compiled with (chosen by the
// build's CPU target, see scripts/llama.sh), as llama-server's system info names them.
func CPUFeatures() []string {
	bits := uint(C.polykv_cpu_features())
	var out []string
	for i, name := range cpuFeatureNames {
		if bits&(1<<i) != 0 {
			out = append(out, name)
		}
	}
	return out
}
