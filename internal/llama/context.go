package llama

/*
#include <stdlib.h>
#include "llama.h"
#include "sampler_shim.h"
#include "cellorder.h"
#include "internals.h"

static void polykv_batch_set(struct llama_batch * b, int i, llama_token tok, llama_pos pos, llama_seq_id seq, int logits) {
	b->token[i] = tok;
	b->pos[i] = pos;
	b->n_seq_id[i] = 1;
	b->seq_id[i][0] = seq;
	b->logits[i] = (int8_t)logits;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"strings"
	"unsafe"
)

// ContextParams configures a llama.cpp context.
type ContextParams struct {
	NCtx      int       // KV cells in the (unified) cache
	NBatch    int       // max tokens per llama_decode call
	NUBatch   int       // physical micro-batch size
	NSeqMax   int       // distinct sequence ids (sessions + pools)
	NThreads  int       // threads for generation and batch processing
	KVUnified bool      // one cell buffer shared by all sequences (required for prefix sharing)
	FlashAttn int       // -1 auto (llama.cpp decides), 0 off, 1 on
	TypeK     CacheType // K cache element type ("" = f16)
	TypeV     CacheType // V cache element type ("" = f16); quantized V needs FlashAttn 1
	SWAFull   bool      // full-size sliding-window cache (see NewContext)
	// RSSeq is llama.cpp's n_rs_seq: recurrent-state snapshots kept per sequence so that
	// SeqRm can drop up to RSSeq trailing positions of a recurrent or hybrid model's
	// sequence (rejected drafts); 0 = none. Clamped to 0 by llama.cpp for architectures
	// without rollback.
	RSSeq int
	// MTPTarget, if set, makes this an MTP draft context (LLAMA_CONTEXT_TYPE_MTP) over
	// MTPTarget's model (loaded with LoadMTP): its graph runs the NextN layer(s) only,
	// with a KV cache of their own, and its batches carry the target's NextN embedding
	// per token (BatchAddEmbd). See mtp.go. The model may instead be a separate MTP
	// assistant for MTPTarget's (Model.IsAssistant: Gemma 4's), whose context keeps no
	// cache of its own: its layers read MTPTarget's (SharesTargetKV).
	MTPTarget *Context
	// AttnKernel is this context's CPU flash-attention kernel (PolyKV's unless set). Per
	// context, not per model: the kernel reads the context's own cache, and fattn.cpp
	// tells a node's context by its K view.
	AttnKernel Kernel
}

// Context is a llama.cpp context: the KV cache and the compute graph. One goroutine only.
type Context struct {
	c     *C.struct_llama_context
	mem   C.llama_memory_t
	model *Model
	batch C.struct_llama_batch
	nb    int // batch capacity
	n     int // tokens currently in the batch

	// embdRow (MTP contexts only, see mtp.go): values per row of batch.embd, the
	// embedding each entry carries beside its token; 0 for other contexts.
	embdRow int

	compactBuf  unsafe.Pointer // C buffer reused by Compact (grows, never shrinks)
	compactSize C.size_t

	// valueTypesOK: K and V are both f16 or both f32, the caches PolyKV's attention
	// kernel reads (see OrderedAttention).
	valueTypesOK bool
}

// NewContext creates a context for model.
func NewContext(model *Model, p ContextParams) (*Context, error) {
	if p.NCtx <= 0 || p.NBatch <= 0 || p.NSeqMax <= 0 || p.NThreads <= 0 {
		return nil, fmt.Errorf("new context: invalid parameters %+v", p)
	}
	if p.NSeqMax > 256 {
		return nil, fmt.Errorf("new context: n_seq_max %d exceeds llama.cpp's limit of 256", p.NSeqMax)
	}
	if p.AttnKernel != KernelPolyKV && p.AttnKernel != KernelGGML {
		return nil, fmt.Errorf("new context: unknown attention kernel %d", p.AttnKernel)
	}
	if p.NUBatch <= 0 || p.NUBatch > p.NBatch {
		p.NUBatch = p.NBatch
	}
	tk, err := p.TypeK.ggml()
	if err != nil {
		return nil, fmt.Errorf("new context: K cache: %w", err)
	}
	tv, err := p.TypeV.ggml()
	if err != nil {
		return nil, fmt.Errorf("new context: V cache: %w", err)
	}
	if p.TypeV.Quantized() && p.FlashAttn == 0 {
		// llama.cpp refuses a quantized V cache without flash attention (the plain
		// attention path multiplies by V transposed, which quantized rows cannot be).
		return nil, fmt.Errorf("new context: a quantized V cache (%s) needs flash attention (--flash-attn on)", p.TypeV)
	}
	installKernels()
	cp := C.llama_context_default_params()
	cp.type_k = tk
	cp.type_v = tv
	cp.swa_full = C.bool(p.SWAFull)
	cp.n_ctx = C.uint32_t(p.NCtx)
	cp.n_batch = C.uint32_t(p.NBatch)
	cp.n_ubatch = C.uint32_t(p.NUBatch)
	cp.n_seq_max = C.uint32_t(p.NSeqMax)
	cp.n_threads = C.int32_t(p.NThreads)
	cp.n_threads_batch = C.int32_t(p.NThreads)
	cp.kv_unified = C.bool(p.KVUnified)
	switch p.FlashAttn {
	case 0:
		cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
	case 1:
		cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED
	default:
		cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_AUTO
	}
	cp.no_perf = true
	cp.n_rs_seq = C.uint32_t(max(p.RSSeq, 0))
	if p.MTPTarget != nil {
		switch {
		case model.IsAssistant():
			if err := checkAssistant(p.MTPTarget.model, model); err != nil {
				return nil, fmt.Errorf("new context: %w", err)
			}
		case p.MTPTarget.model != model:
			return nil, errors.New("new context: an MTP context runs on its target's model (or is an MTP assistant's)")
		case !model.MTPLoaded():
			return nil, fmt.Errorf("new context: an MTP context needs the model's MTP layers (%d in the file; load it with LoadMTP)", model.NLayerNextN())
		}
		cp.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
		cp.ctx_other = p.MTPTarget.c
	}
	c := C.llama_init_from_model(model.m, cp)
	if c == nil {
		return nil, errors.New("new context: llama.cpp could not create the context (out of memory?)")
	}
	ctx := &Context{c: c, mem: C.llama_get_memory(c), model: model, nb: p.NBatch}
	ctx.batch = C.llama_batch_init(C.int32_t(p.NBatch), 0, 1)
	if p.MTPTarget != nil {
		ctx.initMTPBatch()
	}
	ctx.valueTypesOK = orderedType(p.TypeK) && p.TypeK.normal() == p.TypeV.normal()
	if kernelsInstalled() {
		// Every context records its kernel; only those over caches the kernel orders by
		// position record their cells too.
		order := C.int(0)
		if ctx.valueTypesOK {
			order = 1
		}
		C.polykv_cells_register(c, order, p.AttnKernel.code())
	}
	return ctx, nil
}

// Free releases the context and its batch.
func (c *Context) Free() {
	if c.c != nil {
		C.polykv_cells_unregister(c.c)
		C.llama_batch_free(c.batch)
		C.llama_free(c.c)
		if c.compactBuf != nil {
			C.free(c.compactBuf)
			c.compactBuf = nil
		}
		c.c = nil
	}
}

// NCtx is the number of KV cells.
func (c *Context) NCtx() int { return int(C.llama_n_ctx(c.c)) }

// NSeqMax is the number of sequence ids the context accepts.
func (c *Context) NSeqMax() int { return int(C.llama_n_seq_max(c.c)) }

// BatchCap is the most tokens one Decode accepts.
func (c *Context) BatchCap() int { return c.nb }

// BatchClear empties the pending batch.
func (c *Context) BatchClear() { c.n = 0 }

// BatchAdd appends one token at pos for seq; logits asks for its output row.
// It returns the token's index in the batch (the index Sample and Logits take).
func (c *Context) BatchAdd(tok Token, pos int, seq int, logits bool) (int, error) {
	if c.n >= c.nb {
		return -1, fmt.Errorf("batch add: batch is full (%d tokens)", c.nb)
	}
	l := 0
	if logits {
		l = 1
	}
	i := c.n
	C.polykv_batch_set(&c.batch, C.int(i), C.llama_token(tok), C.llama_pos(pos), C.llama_seq_id(seq), C.int(l))
	c.n++
	return i, nil
}

// BatchLen is the number of tokens in the pending batch.
func (c *Context) BatchLen() int { return c.n }

// ErrNoKVSlot is returned by Decode when the cache has no room for the batch.
var ErrNoKVSlot = errors.New("decode: no free KV cells for the batch")

// Decode runs the pending batch through the model. On ErrNoKVSlot the cache is unchanged;
// on other errors some micro-batches may remain in the cache (see llama.h).
func (c *Context) Decode() error {
	if c.n == 0 {
		return nil
	}
	c.batch.n_tokens = C.int32_t(c.n)
	r := C.llama_decode(c.c, c.batch)
	switch {
	case r == 0:
		return nil
	case r == 1:
		return ErrNoKVSlot
	case r == 2:
		return errors.New("decode: aborted")
	case r == -1:
		return errors.New("decode: invalid batch")
	default:
		return fmt.Errorf("decode: llama_decode failed with code %d", int(r))
	}
}

// Logits returns a copy of the output row of batch index i from the last Decode.
func (c *Context) Logits(i int) []float32 {
	p := C.llama_get_logits_ith(c.c, C.int32_t(i))
	if p == nil {
		return nil
	}
	n := c.model.NVocab()
	out := make([]float32, n)
	copy(out, unsafe.Slice((*float32)(unsafe.Pointer(p)), n))
	return out
}

// SeqRm removes seq's cells with positions in [p0, p1) (p1 < 0: to the end).
func (c *Context) SeqRm(seq, p0, p1 int) bool {
	return bool(C.llama_memory_seq_rm(c.mem, C.llama_seq_id(seq), C.llama_pos(p0), C.llama_pos(p1)))
}

// SeqCp makes dst a member of src's cells in [p0, p1): in a unified cache nothing is copied.
func (c *Context) SeqCp(src, dst, p0, p1 int) {
	C.llama_memory_seq_cp(c.mem, C.llama_seq_id(src), C.llama_seq_id(dst), C.llama_pos(p0), C.llama_pos(p1))
}

// SeqPosMin is the smallest position held by seq, or -1 when empty.
func (c *Context) SeqPosMin(seq int) int {
	return int(C.llama_memory_seq_pos_min(c.mem, C.llama_seq_id(seq)))
}

// SeqPosMax is the largest position held by seq, or -1 when empty.
func (c *Context) SeqPosMax(seq int) int {
	return int(C.llama_memory_seq_pos_max(c.mem, C.llama_seq_id(seq)))
}

// orderedType: a cache type PolyKV's attention kernel reads (f16, the default, f32, q8_0
// or q4_0; K and V alike).
func orderedType(t CacheType) bool {
	switch t.normal() {
	case "f16", "f32", "q8_0", "q4_0":
		return true
	}
	return false
}

// normal names "" as what it means, f16.
func (t CacheType) normal() CacheType {
	if t == "" {
		return "f16"
	}
	return t
}

// OrderedAttention reports whether every attention node of this context sums a query's
// cells in position order wherever llama.cpp placed them: PolyKV's flash-attention
// kernel, on the CPU, over an f16, f32, q8_0 or q4_0 cache (K and V of one type) it has
// registered (fattn.cpp, cellorder.cpp). Then holes left by freed cells change no output
// and the cache never needs Compact. False for other or mixed cache types, llama.cpp's
// own kernel (AttnKernel KernelGGML: --fa-kernel ggml),
// flash attention off, GPU offload, or a model one of whose attention nodes PolyKV's
// kernel does not take (it turns false once such a node has run).
func (c *Context) OrderedAttention() bool {
	return c.valueTypesOK && kernelsInstalled() && C.polykv_cells_ordered(c.c) == 1
}

// Compact moves every used KV cell to the bottom of the cache, cells 0..used-1, keeping
// their relative order, their positions and every sequence membership (shared pool cells
// stay shared), and points the cache's search head at the first free cell.
//
// Why: llama.cpp places a batch's tokens in the first free cells from its head, and
// removing cells moves the head down to the hole they leave. A sequence that keeps
// decoding then gets its next cells below its older ones, and the CPU attention kernel
// accumulates over a sequence's cells in cell order, so the same token's logits come out
// rounded differently than on a quiet server. With no holes every new cell lands above
// all existing ones, so each sequence's cells stay in position order whatever other
// sequences did. This build of llama.cpp has no defragmentation (it was removed in
// favour of nothing), but restoring the whole-cache state (llama_state_seq_*_data with
// seq_id -1) writes the saved cells contiguously from cell 0 in saved (= cell) order.
//
// Cost: one copy of the used cells out and back in and a clear of the K/V buffers. On
// failure the cache may be empty (llama.cpp clears it when a restore fails); the caller
// must treat that as fatal for every sequence.
func (c *Context) Compact() error {
	size := C.llama_state_seq_get_size(c.c, -1)
	if size == 0 {
		return errors.New("compact: llama.cpp reports an empty state")
	}
	if size > c.compactSize {
		if c.compactBuf != nil {
			C.free(c.compactBuf)
		}
		c.compactBuf = C.malloc(size)
		if c.compactBuf == nil {
			c.compactSize = 0
			return errors.New("compact: out of memory")
		}
		c.compactSize = size
	}
	buf := (*C.uint8_t)(c.compactBuf)
	if n := C.llama_state_seq_get_data(c.c, buf, size, -1); n != size {
		return fmt.Errorf("compact: saved %d of %d bytes", uint64(n), uint64(size))
	}
	if n := C.llama_state_seq_set_data(c.c, buf, size, -1); n != size {
		return fmt.Errorf("compact: restored %d of %d bytes; the KV cache was cleared", uint64(n), uint64(size))
	}
	return nil
}

// RecurrentBytesPerSeq is the size of one sequence's recurrent state (a hybrid or
// recurrent model's r and s tensors for every recurrent layer, with llama.cpp's rollback
// snapshots), read from the context's memory; 0 on a model without recurrent layers.
// Every sequence holding any tokens has its own copy: unlike KV cells it is not shared
// between a pool and the sessions attached to it.
func (c *Context) RecurrentBytesPerSeq() int64 { return int64(C.polykv_recurrent_bytes_per_seq(c.c)) }

// RSSeq is the rollback depth llama.cpp built the context with (llama_n_rs_seq): how
// many trailing positions of a recurrent or hybrid sequence one SeqRm may drop after a
// decode. It is 0 where ContextParams.RSSeq was 0 or the architecture has no rollback
// (llama.cpp clamps it silently, so callers read it back rather than trust the request).
func (c *Context) RSSeq() int { return int(C.llama_n_rs_seq(c.c)) }

// MemoryBytes is the size of the context's whole sequence memory (KV caches and
// recurrent state) as llama.cpp reports it. Tests check the per-cell and per-sequence
// accounting against it.
func (c *Context) MemoryBytes() int64 { return int64(C.polykv_memory_bytes(c.c)) }

// SeqStateSize is the size of seq's saved state (llama_state_seq_get_size): its cells'
// positions and memberships plus their K and V rows in every layer, as llama.cpp stores
// them. Tests use it to check KV byte accounting against the real cache types.
func (c *Context) SeqStateSize(seq int) int64 {
	return int64(C.llama_state_seq_get_size(c.c, C.llama_seq_id(seq)))
}

// SamplerParams configures a sampler chain. Temperature <= 0 means greedy.
type SamplerParams struct {
	Temperature      float32
	TopK             int
	TopP             float32
	MinP             float32
	Seed             uint32
	RepeatPenalty    float32 // 1 = off
	RepeatLastN      int
	FrequencyPenalty float32
	PresencePenalty  float32
	Grammar          string // GBNF with a root rule; "" = unconstrained
	// GrammarTriggers make Grammar lazy (llama.cpp's lazy grammars): tokens are free
	// until one of the triggers appears in the output, and the grammar constrains the
	// output from the trigger on (the trigger text itself must fit the grammar's start).
	// None: Grammar constrains from the first token.
	GrammarTriggers []GrammarTrigger
}

// GrammarTrigger is one way a lazy grammar starts. Exactly one field is set.
type GrammarTrigger struct {
	// Word is literal text anywhere in the output; the grammar starts at the word.
	// When the word is a single token of the vocabulary, that token triggers too.
	Word string
	// Pattern is a regular expression (ECMAScript syntax, as std::regex) that must
	// match the whole output so far; the grammar starts at its first non-empty
	// capture group (or at the match when there is none).
	Pattern string
}

// ErrGrammar wraps every failure of a grammar while sampling: llama.cpp found that
// the output no longer fits it. The sampler is unusable afterwards.
var ErrGrammar = errors.New("grammar")

// Sampler is a llama.cpp sampler chain, with its grammar (if any) kept apart so that
// it can be dropped while the chain goes on. It keeps state (RNG, penalty history).
type Sampler struct {
	s *C.struct_llama_sampler
	g *C.struct_llama_sampler // grammar, applied before the chain; nil: none
	// failed is set once the grammar failed: llama.cpp leaves it with no parse
	// stacks, and the next apply would abort the process (GGML_ASSERT).
	failed error
}

// NewSampler builds the chain: grammar → penalties → top-k → top-p → min-p →
// temperature → dist, or grammar → penalties → greedy when Temperature <= 0. The
// grammar (if any) masks every token that would break it, so the draw is always valid.
// The grammar is a sampler of its own, applied before the chain (as llama.cpp's
// common_sampler does), so DropGrammar can end it without touching the chain.
func NewSampler(m *Model, p SamplerParams) (*Sampler, error) {
	var g *C.struct_llama_sampler
	if p.Grammar != "" {
		var err error
		if g, err = m.grammarSampler(p.Grammar, p.GrammarTriggers); err != nil {
			return nil, err
		}
	}
	chain := C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
	if (p.RepeatPenalty != 0 && p.RepeatPenalty != 1) || p.FrequencyPenalty != 0 || p.PresencePenalty != 0 {
		rp := p.RepeatPenalty
		if rp == 0 {
			rp = 1
		}
		lastN := p.RepeatLastN
		if lastN == 0 {
			lastN = 64
		}
		C.llama_sampler_chain_add(chain, C.llama_sampler_init_penalties(C.int32_t(m.NVocab()), C.int32_t(lastN), C.float(rp), C.float(p.FrequencyPenalty), C.float(p.PresencePenalty)))
	}
	if p.Temperature <= 0 {
		C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
		return &Sampler{s: chain, g: g}, nil
	}
	if p.TopK > 0 {
		C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(C.int32_t(p.TopK)))
	}
	if p.TopP > 0 && p.TopP < 1 {
		C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(C.float(p.TopP), 1))
	}
	if p.MinP > 0 {
		C.llama_sampler_chain_add(chain, C.llama_sampler_init_min_p(C.float(p.MinP), 1))
	}
	C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(C.float(p.Temperature)))
	C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(C.uint32_t(p.Seed)))
	return &Sampler{s: chain, g: g}, nil
}

// regexSpecial are the characters std::regex (ECMAScript) treats as syntax.
const regexSpecial = `.^$|()*+?[]{}\`

// escapeRegex quotes s for std::regex.
func escapeRegex(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(regexSpecial, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// TriggerPatterns is how NewSampler hands triggers to llama.cpp: a Word becomes
// "anything, then the word, then anything" with the word as the capture group (as
// llama.cpp's common/sampling.cpp does), plus its token when the word is one token.
// Every pattern is anchored (^(?:...)$): llama.cpp full-matches an anchored pattern
// once per token but regex_searches any other from every start position, which for
// "anything, then the word" is quadratic in the output per token (a 17,000-character
// reply then took minutes; see TestLazyGrammarLongFreeText).
func (m *Model) TriggerPatterns(triggers []GrammarTrigger) ([]string, []Token) {
	var pats []string
	var toks []Token
	for _, t := range triggers {
		if t.Pattern != "" {
			pats = append(pats, anchor(t.Pattern))
			continue
		}
		if t.Word == "" {
			continue
		}
		pats = append(pats, anchor(`[\s\S]*?(`+escapeRegex(t.Word)+`)[\s\S]*`))
		if ids, err := m.Tokenize(t.Word, false, true); err == nil && len(ids) == 1 && string(m.TokenPiece(ids[0], true)) == t.Word {
			toks = append(toks, ids[0])
		}
	}
	return pats, toks
}

// anchor makes p a whole-output match (see TriggerPatterns) without renumbering its
// capture groups.
func anchor(p string) string {
	if strings.HasPrefix(p, "^") && strings.HasSuffix(p, "$") {
		return p
	}
	return "^(?:" + p + ")$"
}

func (m *Model) grammarSampler(g string, triggers []GrammarTrigger) (*C.struct_llama_sampler, error) {
	cg := C.CString(g)
	defer C.free(unsafe.Pointer(cg))
	pats, toks := m.TriggerPatterns(triggers)
	lazy := 0
	if len(triggers) > 0 {
		lazy = 1
	}
	// C arrays: cgo forbids passing Go memory that holds Go pointers.
	var cpats **C.char
	if len(pats) > 0 {
		cpats = (**C.char)(C.malloc(C.size_t(len(pats)) * C.size_t(unsafe.Sizeof(uintptr(0)))))
		defer C.free(unsafe.Pointer(cpats))
		ps := unsafe.Slice(cpats, len(pats))
		for i, p := range pats {
			ps[i] = C.CString(p)
			defer C.free(unsafe.Pointer(ps[i]))
		}
	}
	var ctoks *C.llama_token
	if len(toks) > 0 {
		ctoks = (*C.llama_token)(unsafe.Pointer(&toks[0]))
	}
	var errBuf [256]C.char
	s := C.polykv_grammar_init(m.vocab, cg, C.int(lazy), cpats, C.size_t(len(pats)), ctoks, C.size_t(len(toks)), &errBuf[0], C.size_t(len(errBuf)))
	if s == nil {
		return nil, fmt.Errorf("grammar: %s", C.GoString(&errBuf[0]))
	}
	return s, nil
}

// CheckGrammar reports whether llama.cpp accepts a GBNF grammar (with a root rule).
func (m *Model) CheckGrammar(g string) error {
	s, err := m.grammarSampler(g, nil)
	if err != nil {
		return err
	}
	C.llama_sampler_free(s)
	return nil
}

// Accept records tok as if it had been sampled: in the chain (the penalties' history)
// and in the grammar (an error wrapping ErrGrammar when tok does not fit it; the chain
// has recorded tok all the same).
func (s *Sampler) Accept(tok Token) error {
	var errBuf [256]C.char
	if s.g != nil {
		if s.failed != nil {
			return s.failed
		}
		if C.polykv_sampler_accept(s.g, C.llama_token(tok), &errBuf[0], C.size_t(len(errBuf))) != C.POLYKV_SAMPLE_OK {
			s.failed = fmt.Errorf("%w: token %d: %s", ErrGrammar, tok, C.GoString(&errBuf[0]))
		}
	}
	if C.polykv_sampler_accept(s.s, C.llama_token(tok), &errBuf[0], C.size_t(len(errBuf))) != C.POLYKV_SAMPLE_OK {
		return fmt.Errorf("accept: %s", C.GoString(&errBuf[0]))
	}
	return s.failed
}

// Sample picks a token from batch index i of ctx's last Decode and accepts it. When the
// grammar fails (the text after a lazy trigger, or the drawn token, does not fit it;
// or it masks every token) the error wraps ErrGrammar and the returned token is the
// draw when there was one (the chain has accepted it), else -1; the sampler then
// refuses to sample until DropGrammar.
func (s *Sampler) Sample(ctx *Context, i int) (Token, error) {
	if s.failed != nil {
		return -1, s.failed
	}
	var errBuf [256]C.char
	tok := C.llama_token(-1)
	r := C.polykv_sampler_sample(s.g, s.s, ctx.c, C.int32_t(i), &tok, &errBuf[0], C.size_t(len(errBuf)))
	switch r {
	case C.POLYKV_SAMPLE_OK:
		return Token(tok), nil
	case C.POLYKV_SAMPLE_BAD_INDEX:
		return -1, fmt.Errorf("sample: batch index %d has no logits", i)
	case C.POLYKV_SAMPLE_ACCEPT_FAILED:
		s.failed = fmt.Errorf("%w: token %d does not fit: %s", ErrGrammar, int32(tok), C.GoString(&errBuf[0]))
		return Token(tok), s.failed
	}
	s.failed = fmt.Errorf("%w: %s", ErrGrammar, C.GoString(&errBuf[0]))
	return -1, s.failed
}

// StartGrammar starts grammar g on a sampler without one, the way a lazy grammar
// starts at its trigger, when the caller found the trigger itself: toks are the tokens
// already accepted from the one the trigger starts in, and the grammar is fed their
// text from byte skip of the first token's piece on (llama.cpp feeds a lazy grammar
// the output from its trigger, not from a token boundary). It uses llama.cpp's lazy
// sampler with a trigger that fires at once on that text: llama.cpp has no public call
// that feeds text to a grammar, and its trigger regexes then only ever see these few
// tokens (they overflow the stack on long output). An error wraps ErrGrammar when the
// text does not fit g; the sampler then goes on without a grammar.
func (s *Sampler) StartGrammar(m *Model, g string, skip int, toks []Token) error {
	if s.g != nil {
		return fmt.Errorf("%w: the sampler has a grammar already", ErrGrammar)
	}
	if skip < 0 || len(toks) == 0 || skip >= len(m.TokenPiece(toks[0], true)) {
		return fmt.Errorf("%w: the trigger is not in its first token", ErrGrammar)
	}
	gs, err := m.grammarSampler(g, []GrammarTrigger{{Pattern: fmt.Sprintf(`[\s\S]{%d}([\s\S]+)`, skip)}})
	if err != nil {
		return fmt.Errorf("%w: %v", ErrGrammar, err)
	}
	var errBuf [256]C.char
	for _, tok := range toks {
		if C.polykv_sampler_accept(gs, C.llama_token(tok), &errBuf[0], C.size_t(len(errBuf))) != C.POLYKV_SAMPLE_OK {
			C.llama_sampler_free(gs)
			return fmt.Errorf("%w: token %d: %s", ErrGrammar, tok, C.GoString(&errBuf[0]))
		}
	}
	s.g, s.failed = gs, nil
	return nil
}

// GrammarFits reports how many of toks, in order, the sampler's grammar allows after
// what it has accepted so far: the index of the first token it would mask, or
// len(toks) (an allowed end-of-generation token ends the count). It walks a clone, so
// the sampler is unchanged. Without a grammar (none, dropped, failed) every token fits.
// Speculative decoding uses it to cut a draft at the first token a grammar-constrained
// sampler could never draw, before the draft costs a batch row.
func (s *Sampler) GrammarFits(m *Model, toks []Token) int {
	if s.g == nil || s.failed != nil || len(toks) == 0 {
		return len(toks)
	}
	var errBuf [256]C.char
	n := int(C.polykv_grammar_fits(s.g, m.vocab, (*C.llama_token)(unsafe.Pointer(&toks[0])), C.int(len(toks)), &errBuf[0], C.size_t(len(errBuf))))
	return max(n, 0)
}

// HasGrammar reports whether a grammar still constrains the sampler.
func (s *Sampler) HasGrammar() bool { return s.g != nil }

// DropGrammar frees the grammar (failed or not): the chain goes on unconstrained, with
// its RNG and penalty history intact.
func (s *Sampler) DropGrammar() {
	if s.g != nil {
		C.llama_sampler_free(s.g)
		s.g = nil
	}
	s.failed = nil
}

// Free releases the chain and the grammar.
func (s *Sampler) Free() {
	s.DropGrammar()
	if s.s != nil {
		C.llama_sampler_free(s.s)
		s.s = nil
	}
}

// SeqStateGet copies out what sequence seq holds (llama_state_seq_get_data): every cell
// it is a member of, with its position and its K and V rows in every layer, in the
// cache's own element types and layout. The bytes are only meaningful to a context of
// the same model, llama.cpp build, cache types and flash-attention setting (V layout);
// callers key what they store by all of them (package tier).
func (c *Context) SeqStateGet(seq int) ([]byte, error) {
	return c.seqStateGet(seq, C.LLAMA_STATE_SEQ_FLAGS_NONE)
}

// SeqPartialStateGet copies out only the partial part of what seq holds
// (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY): a recurrent or hybrid model's recurrent state,
// without its attention cells. For the same reuse as SeqStateGet.
func (c *Context) SeqPartialStateGet(seq int) ([]byte, error) {
	return c.seqStateGet(seq, C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
}

func (c *Context) seqStateGet(seq int, flags C.llama_state_seq_flags) ([]byte, error) {
	size := C.llama_state_seq_get_size_ext(c.c, C.llama_seq_id(seq), flags)
	if size == 0 {
		return nil, fmt.Errorf("save sequence %d: llama.cpp reports an empty state", seq)
	}
	buf := make([]byte, int(size))
	if n := C.llama_state_seq_get_data_ext(c.c, (*C.uint8_t)(unsafe.Pointer(&buf[0])), size, C.llama_seq_id(seq), flags); n != size {
		return nil, fmt.Errorf("save sequence %d: wrote %d of %d bytes", seq, uint64(n), uint64(size))
	}
	return buf, nil
}

// SeqStateSet loads bytes from SeqStateGet into sequence seq (llama_state_seq_set_data):
// seq's cells are removed first, then the saved cells are written to free cells at their
// saved positions, owned by seq alone. llama.cpp checks the layout (layers, element
// types, row sizes, V transposition) and refuses a mismatch; on failure seq holds
// nothing.
func (c *Context) SeqStateSet(seq int, data []byte) error {
	return c.seqStateSet(seq, data, C.LLAMA_STATE_SEQ_FLAGS_NONE)
}

// SeqPartialStateSet loads bytes from SeqPartialStateGet into seq: its recurrent state
// is replaced, its attention cells are left as they are. On failure seq holds nothing.
func (c *Context) SeqPartialStateSet(seq int, data []byte) error {
	return c.seqStateSet(seq, data, C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
}

func (c *Context) seqStateSet(seq int, data []byte, flags C.llama_state_seq_flags) error {
	if len(data) == 0 {
		return fmt.Errorf("load sequence %d: no data", seq)
	}
	// The buffer is only read during the call (cgo pointer rules allow Go memory).
	n := C.llama_state_seq_set_data_ext(c.c, (*C.uint8_t)(unsafe.Pointer(&data[0])), C.size_t(len(data)), C.llama_seq_id(seq), flags)
	if n == 0 {
		C.llama_memory_seq_rm(c.mem, C.llama_seq_id(seq), -1, -1)
		return fmt.Errorf("load sequence %d: llama.cpp refused the %d bytes (layout or size mismatch, or no free cells)", seq, len(data))
	}
	return nil
}
