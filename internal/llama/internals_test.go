package llama

import (
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/testmodel"
)

// A test per function of internals.h (internals.cpp, the one file that reads llama.cpp's
// private headers): what each returns on the real and test models, checked against the
// models' metadata or against what the binding did to the cache, so that a bump of the
// pinned llama.cpp that changes the meaning of what internals.cpp reads fails here.

// loadForTest loads path (with opts) or fails the test.
func loadForTest(t *testing.T, path string, p ModelParams) *Model {
	t.Helper()
	m, err := LoadModelWith(path, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Free)
	return m
}

// contextForTest makes a context of m or fails the test.
func contextForTest(t *testing.T, m *Model, p ContextParams) *Context {
	t.Helper()
	c, err := NewContext(m, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Free)
	return c
}

// metaInt is a GGUF integer of m, or fails the test.
func metaInt(t *testing.T, m *Model, key string) int {
	t.Helper()
	v, err := strconv.Atoi(m.Meta(key))
	if err != nil {
		t.Fatalf("GGUF %s = %q: %v", key, m.Meta(key), err)
	}
	return v
}

// smolGeometry is SmolLM2's attention geometry from its GGUF: layers, KV heads, head size.
func smolGeometry(t *testing.T, m *Model) (layers, kvHeads, head int) {
	layers = metaInt(t, m, "llama.block_count")
	kvHeads = metaInt(t, m, "llama.attention.head_count_kv")
	head = metaInt(t, m, "llama.embedding_length") / metaInt(t, m, "llama.attention.head_count")
	return layers, kvHeads, head
}

// polykv_kv_bytes_per_cell: per layer, a K and a V row of n_head_kv × head size values of
// the cache types (q8_0: 34 bytes per 32 values).
func TestInternalsKVBytesPerCell(t *testing.T) {
	m := loadForTest(t, testmodel.SmolLM2(t), ModelParams{})
	layers, kvHeads, head := smolGeometry(t, m)
	row := kvHeads * head
	if got, want := m.KVBytesPerCellTyped("f16", "f16"), int64(layers*2*2*row); got != want {
		t.Errorf("f16: %d bytes per cell, want %d (%d layers, %d KV heads of %d)", got, want, layers, kvHeads, head)
	}
	if got, want := m.KVBytesPerCellTyped("q8_0", "f16"), int64(layers*(row/32*34+2*row)); got != want {
		t.Errorf("q8_0 K, f16 V: %d bytes per cell, want %d", got, want)
	}
}

// polykv_recurrent_bytes_per_seq: none on an attention-only model; on a hybrid, some, and
// more with rollback snapshots (n_rs_seq).
func TestInternalsRecurrentBytesPerSeq(t *testing.T) {
	smol := loadForTest(t, testmodel.SmolLM2(t), ModelParams{})
	if n := contextForTest(t, smol, ContextParams{NCtx: 256, NBatch: 32, NSeqMax: 2, NThreads: 1, KVUnified: true}).RecurrentBytesPerSeq(); n != 0 {
		t.Errorf("SmolLM2: %d recurrent bytes per sequence, want 0", n)
	}
	q := loadForTest(t, testmodel.Arch(t, "qwen35"), ModelParams{})
	p := ContextParams{NCtx: 256, NBatch: 32, NSeqMax: 2, NThreads: 1, KVUnified: true}
	plain := contextForTest(t, q, p).RecurrentBytesPerSeq()
	p.RSSeq = 2
	rolled := contextForTest(t, q, p)
	if plain <= 0 || rolled.RSSeq() != 2 || rolled.RecurrentBytesPerSeq() <= plain {
		t.Errorf("qwen35: %d recurrent bytes per sequence, %d with %d rollback snapshots: want some, and more with snapshots",
			plain, rolled.RecurrentBytesPerSeq(), rolled.RSSeq())
	}
}

// polykv_memory_bytes: an attention-only context's memory is its cells' KV.
func TestInternalsMemoryBytes(t *testing.T) {
	m := loadForTest(t, testmodel.SmolLM2(t), ModelParams{})
	c := contextForTest(t, m, ContextParams{NCtx: 512, NBatch: 32, NSeqMax: 2, NThreads: 1, KVUnified: true})
	if got, want := c.MemoryBytes(), int64(c.NCtx())*m.KVBytesPerCell(); got != want {
		t.Errorf("%d bytes of memory for %d cells, want %d", got, c.NCtx(), want)
	}
}

// polykv_model_mtp_loaded, polykv_set_embeddings_nextn, polykv_get_embeddings_nextn_ith,
// polykv_set_nextn_layer_offset: the MTP layers are loaded only when asked for (and a
// model without them has none); a target's unmasked NextN rows are one per batch entry,
// each its own; an MTP context's two NextN blocks (mimo2mtp) compute different drafts.
func TestInternalsNextN(t *testing.T) {
	if loadForTest(t, testmodel.SmolLM2(t), ModelParams{}).MTPLoaded() {
		t.Error("SmolLM2: MTP layers reported loaded")
	}
	path := testmodel.Arch(t, "mimo2mtp")
	if loadForTest(t, path, ModelParams{}).MTPLoaded() {
		t.Error("mimo2mtp loaded without LoadMTP: MTP layers reported loaded")
	}
	m := loadForTest(t, path, ModelParams{LoadMTP: true})
	if !m.MTPLoaded() || m.NLayerNextN() != 2 {
		t.Fatalf("mimo2mtp with LoadMTP: loaded %v, %d NextN blocks; want loaded, 2", m.MTPLoaded(), m.NLayerNextN())
	}
	tgt := contextForTest(t, m, mtpContextParams())
	tgt.SetEmbeddingsNextN(true, false)
	prompt := mtpPrompt(6)
	decodeAll(t, tgt, prompt, 0)
	rows := make([][]float32, len(prompt))
	for i := range prompt {
		rows[i] = tgt.EmbeddingsNextN(i)
		allFinite(t, "NextN row", rows[i], m.NEmbdOut())
	}
	if maxDiff(rows[0], rows[len(rows)-1]) == 0 {
		t.Error("the first and last entries' NextN rows are the same")
	}
	// Each block in a context of its own, fed the same entry: different logits.
	var logits [][]float32
	for block := range 2 {
		p := mtpContextParams()
		p.MTPTarget = tgt
		c := contextForTest(t, m, p)
		if err := c.SetNextNLayer(block); err != nil {
			t.Fatal(err)
		}
		c.SetEmbeddingsNextN(true, true)
		c.BatchClear()
		if _, err := c.BatchAddEmbd(prompt[0], 0, 0, true, rows[0]); err != nil {
			t.Fatal(err)
		}
		if err := c.Decode(); err != nil {
			t.Fatal(err)
		}
		logits = append(logits, c.Logits(0))
		allFinite(t, "draft logits", logits[block], m.NVocab())
		if c.EmbeddingsNextN(0) == nil {
			t.Errorf("block %d: no NextN row for the draft entry", block)
		}
	}
	if maxDiff(logits[0], logits[1]) == 0 {
		t.Error("NextN blocks 0 and 1 give the same logits: the layer offset did not take")
	}
}

// polykv_model_host_buffers: a CPU model's weights are in host buffers.
func TestInternalsModelHostBuffers(t *testing.T) {
	if n := loadForTest(t, testmodel.SmolLM2(t), ModelParams{}).modelHostBuffers(); n < 1 {
		t.Errorf("SmolLM2 on the CPU: %d host weight buffers, want at least 1", n)
	}
}

// polykv_attn_layers: every attention layer of every cache, with its K storage and head
// sizes; flash attention as the context was made; unified caches of one stream; the
// caches of an iSWA model (two) and of a hybrid (its attention layers only).
func TestInternalsAttnLayers(t *testing.T) {
	smol := loadForTest(t, testmodel.SmolLM2(t), ModelParams{})
	layers, kvHeads, head := smolGeometry(t, smol)
	p := ContextParams{NCtx: 256, NBatch: 32, NSeqMax: 2, NThreads: 1, KVUnified: true, FlashAttn: 1}
	ls, fa, unknown, plain := contextForTest(t, smol, p).attnLayers()
	if !fa || unknown || !plain || len(ls) != layers {
		t.Fatalf("SmolLM2: flash attention %v, unknown %v, plain %v, %d layers; want true, false, true, %d", fa, unknown, plain, len(ls), layers)
	}
	for i, l := range ls {
		if l.il != i || l.nStream != 1 || l.kdata == nil || l.cells == nil || l.dk != head || l.dv != head || l.kbytes != 256*kvHeads*head*2 {
			t.Errorf("SmolLM2 layer %d: %+v; want layer %d, one stream, host K of %d bytes, heads of %d", i, l, i, 256*kvHeads*head*2, head)
		}
	}
	p.FlashAttn = 0
	if _, fa, _, _ := contextForTest(t, smol, p).attnLayers(); fa {
		t.Error("SmolLM2 without flash attention: reported on")
	}
	p.FlashAttn = 1

	gemma := loadForTest(t, testmodel.Gemma(t), ModelParams{})
	p.SWAFull = true
	ls, _, unknown, _ = contextForTest(t, gemma, p).attnLayers()
	caches := map[string]bool{}
	for _, l := range ls {
		caches[strconv.FormatUint(uint64(uintptr(l.cells)), 16)] = true
	}
	if n := metaInt(t, gemma, "gemma3.block_count"); unknown || len(ls) != n || len(caches) != 2 {
		t.Errorf("Gemma 3: unknown %v, %d layers in %d caches; want false, %d in 2 (sliding-window and full)", unknown, len(ls), len(caches), n)
	}
	p.SWAFull = false

	q := loadForTest(t, testmodel.Arch(t, "qwen35"), ModelParams{})
	ls, _, unknown, _ = contextForTest(t, q, p).attnLayers()
	if n := metaInt(t, q, "qwen35.block_count"); unknown || len(ls) == 0 || len(ls) >= n {
		t.Errorf("qwen35 (hybrid): unknown %v, %d attention layers of %d; want false, some but not all", unknown, len(ls), n)
	}
}

// polykv_cell_positions: a prompt decoded into an empty cache holds positions 0..n-1 in
// cells 0..n-1; removed cells are empty (-1); another sequence's tokens then fill the
// first free cells with their own positions.
func TestInternalsCellPositions(t *testing.T) {
	m := loadForTest(t, testmodel.SmolLM2(t), ModelParams{})
	c := contextForTest(t, m, ContextParams{NCtx: 256, NBatch: 32, NSeqMax: 2, NThreads: 1, KVUnified: true, FlashAttn: 1})
	decode := func(seq int, toks []Token) {
		c.BatchClear()
		for i, tok := range toks {
			if _, err := c.BatchAdd(tok, i, seq, false); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Decode(); err != nil {
			t.Fatal(err)
		}
	}
	decode(0, []Token{1, 2, 3, 4, 5, 6, 7, 8, 9, 10})
	ls, _, _, _ := c.attnLayers()
	idx := []uint32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	want := []int32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1}
	check := func(what string) {
		t.Helper()
		if got := cellPositions(ls[0], idx); !slices.Equal(got, want) {
			t.Errorf("%s: cells 0..10 hold positions %v, want %v", what, got, want)
		}
	}
	check("after a 10-token prompt")
	c.SeqRm(0, 5, -1)
	want = []int32{0, 1, 2, 3, 4, -1, -1, -1, -1, -1, -1}
	check("after removing positions 5..")
	decode(1, []Token{11, 12, 13})
	want = []int32{0, 1, 2, 3, 4, 0, 1, 2, -1, -1, -1}
	check("after another sequence's 3 tokens")
}

// polykv_exp_row: exp(s - max) to within ggml's expf's error (1.5 ulp, checked at 4e-7
// relative), -1 for -inf (a hidden cell).
func TestInternalsExpRow(t *testing.T) {
	if !MatMulKernelAvailable() {
		t.Skip("this build has no AVX2/FMA: PolyKV's kernels (and their expf) are not compiled in")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	s := make([]float32, 64)
	for i := range s {
		s[i] = float32(-60 * rng.Float64())
	}
	s[3], s[17], s[63] = float32(math.Inf(-1)), 0, float32(math.Inf(-1))
	const max = 1.5
	got := expRow(s, max)
	for i, x := range s {
		if math.IsInf(float64(x), -1) {
			if got[i] != -1 {
				t.Errorf("s[%d] = -inf: %v, want -1", i, got[i])
			}
			continue
		}
		want := math.Exp(float64(x - max))
		if d := math.Abs(float64(got[i])-want) / want; d > 4e-7 {
			t.Errorf("exp(%v - %v) = %v, want %v (relative error %.2g)", x, max, got[i], want, d)
		}
	}
}

// polykv_hook_install, polykv_hook_installed, polykv_kernel_for, polykv_barrier: once a
// model is loaded and a context made, PolyKV's kernels are hooked into ggml-cpu and run
// for a context and model that chose them; with two threads (the matrix kernel waits at
// polykv_barrier between quantizing the activations and the products) a token's logits
// are the same bits as with one.
func TestInternalsHook(t *testing.T) {
	if !MatMulKernelAvailable() {
		t.Skip("this build has no AVX2/FMA: PolyKV's kernels are not compiled in")
	}
	m := loadForTest(t, testmodel.SmolLM2(t), ModelParams{})
	var logits [][]float32
	for _, threads := range []int{1, 2} {
		c := contextForTest(t, m, ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: threads, KVUnified: true, FlashAttn: 1})
		if !kernelsInstalled() {
			t.Fatal("a context was made, and PolyKV's kernels are not hooked into ggml-cpu")
		}
		fa, mm := FlashAttnKernelRuns(), MatMulKernelRuns()
		prompt := make([]Token, 40)
		for i := range prompt {
			prompt[i] = Token(100 + i*13)
		}
		decodeAll(t, c, prompt, 0)
		if FlashAttnKernelRuns() == fa || MatMulKernelRuns() == mm {
			t.Errorf("%d threads: PolyKV's attention kernel ran %v, its matrix kernel %v; want both", threads, FlashAttnKernelRuns() != fa, MatMulKernelRuns() != mm)
		}
		logits = append(logits, c.Logits(len(prompt)-1))
	}
	if d := maxDiff(logits[0], logits[1]); d != 0 {
		t.Errorf("logits with 2 threads differ from 1 thread's by up to %g", d)
	}
}

// privateIncludes walks the tree under root (skipping hidden directories and the ignored
// build outputs) and returns, per C, C++ or Go (cgo preamble) file, as a path relative to
// root, the llama.cpp private headers it includes: headers found under src/ or ggml/src/
// of the llama.cpp source tree, as paths in that tree. A quoted include of a file beside
// the includer is the includer's own header, not llama.cpp's.
func privateIncludes(root, tree string) (map[string][]string, error) {
	include := regexp.MustCompile(`(?m)^\s*#\s*include\s*([<"])([^>"]+)[>"]`)
	skip := map[string]bool{"bin": true, "lib": true, "build": true, "artifacts": true, "node_modules": true, "__pycache__": true}
	found := map[string][]string{}
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && (strings.HasPrefix(d.Name(), ".") || skip[d.Name()]) {
				return filepath.SkipDir
			}
			return nil
		}
		switch filepath.Ext(path) {
		case ".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".go":
		default:
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		for _, m := range include.FindAllStringSubmatch(string(data), -1) {
			h := m[2]
			if m[1] == `"` {
				if _, err := os.Stat(filepath.Join(filepath.Dir(path), h)); err == nil {
					continue // the includer's own header
				}
			}
			for _, d := range []string{"src", "ggml/src"} {
				if _, err := os.Stat(filepath.Join(tree, d, h)); err == nil {
					found[rel] = append(found[rel], d+"/"+h)
					break
				}
			}
		}
		return nil
	})
	return found, err
}

// llamaSource is the pinned llama.cpp source tree (scripts/llama.sh src).
func llamaSource(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("../../scripts/llama.sh", "src").Output()
	if err != nil {
		t.Fatalf("scripts/llama.sh src: %v", err)
	}
	tree := strings.TrimSpace(string(out))
	// The binding was compiled against this tree's headers, so it is there.
	if _, err := os.Stat(filepath.Join(tree, "src", "llama-model.h")); err != nil {
		t.Fatalf("the llama.cpp source tree %s has no src/llama-model.h: %v", tree, err)
	}
	return tree
}

// TestInternalsOnlyIncluder: no file of the repository but internal/llama/internals.cpp
// includes one of llama.cpp's private headers (under src/ or ggml/src/ of the pinned
// tree): not the rest of the binding, not the test-model generators in scripts/ (which
// use the public API only: llama.h, ggml.h, ggml-backend.h, gguf.h), not a file added
// later; and what `scripts/llama.sh internals` lists (what `make bump-llama` diffs) is
// exactly internals.cpp's.
func TestInternalsOnlyIncluder(t *testing.T) {
	tree := llamaSource(t)
	found, err := privateIncludes("../..", tree)
	if err != nil {
		t.Fatal(err)
	}
	const door = "internal/llama/internals.cpp"
	for f, hs := range found {
		if filepath.ToSlash(f) != door {
			t.Errorf("%s includes llama.cpp's private headers %v: only %s may (add what it needs to internals.h)", f, hs, door)
		}
	}
	ours := found[door]
	if len(ours) == 0 {
		t.Fatal("internals.cpp includes no private header: the scan found nothing (wrong source tree?)")
	}
	out, err := exec.Command("../../scripts/llama.sh", "internals").Output()
	if err != nil {
		t.Fatalf("scripts/llama.sh internals: %v", err)
	}
	listed := strings.Fields(string(out))
	slices.Sort(ours)
	ours = slices.Compact(ours)
	if !slices.Equal(listed, ours) {
		t.Errorf("scripts/llama.sh internals lists %v; internals.cpp includes %v", listed, ours)
	}
}

// TestPrivateIncludesFindsThem checks the scan TestInternalsOnlyIncluder relies on: in a
// tree of its own, a private header included from a C++ file, a header or a cgo preamble
// (quoted or in angle brackets, from any directory) is found, and public headers and a
// file's own header are not.
func TestPrivateIncludesFindsThem(t *testing.T) {
	tree := llamaSource(t)
	root := t.TempDir()
	files := map[string]string{
		"scripts/gen.cpp":      "#include \"own.h\"\n#include \"llama.h\"\n#include \"gguf.h\"\n#include <vector>\n",
		"scripts/own.h":        "#pragma once\n#include \"llama-model.h\"\n",
		"internal/x/x.go":      "package x\n\n/*\n#include <ggml-cpu/traits.h>\n*/\nimport \"C\"\n",
		"tools/y.cc":           "  #  include \"llama-kv-cache.h\"\n",
		".hidden/z.cpp":        "#include \"llama-model.h\"\n",
		"internal/x/public.go": "package x\n\n/*\n#include \"ggml-backend.h\"\n*/\nimport \"C\"\n",
	}
	for name, text := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	found, err := privateIncludes(root, tree)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{
		"scripts/own.h":   {"src/llama-model.h"},
		"internal/x/x.go": {"ggml/src/ggml-cpu/traits.h"},
		"tools/y.cc":      {"src/llama-kv-cache.h"},
	}
	if len(found) != len(want) {
		t.Errorf("found %v; want %v", found, want)
	}
	for f, hs := range want {
		if !slices.Equal(found[f], hs) {
			t.Errorf("%s: found %v; want %v", f, found[f], hs)
		}
	}
}
