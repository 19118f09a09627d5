package llama

// MTP (multi-token prediction, "NextN") drafting through llama.cpp b11434. A model with
// NextN layers (llama_model_n_layer_nextn > 0; qwen35, glm4-moe, deepseek2, ...) is
// loaded once with ModelParams.LoadMTP; the target context is a normal Context that also
// outputs each token's NextN embedding h (the hidden state its LM head reads:
// SetEmbeddingsNextN, EmbeddingsNextN); the draft context is a second Context on the same
// model (ContextParams.MTPTarget) whose graph runs only the NextN layer(s), with a KV cache
// of their own, fed per entry a token and the target's h of the position before it
// (BatchAddEmbd). An MTP assistant (Gemma 4's: a model file of its own, IsAssistant) gets
// such a context too, over its target's context, whose cells its layers read instead of
// keeping any (SharesTargetKV). How a driver keeps them in step is in docs/speculative.md
// (MTP); this file only binds the calls.

/*
#include <stdlib.h>
#include "llama.h"
#include "internals.h"
*/
import "C"

import (
	"fmt"
	"slices"
	"unsafe"
)

// NLayerNextN is the number of MTP (NextN) layers the model file has, loaded or not;
// NLayer does not count them.
func (m *Model) NLayerNextN() int { return int(C.llama_model_n_layer_nextn(m.m)) }

// MTPLoaded reports whether the model's MTP layers are loaded (LoadMTP on a model that
// has them), which an MTP context needs.
func (m *Model) MTPLoaded() bool { return bool(C.polykv_model_mtp_loaded(m.m)) }

// NEmbdOut is the width of the model's output embeddings, NextN rows included.
func (m *Model) NEmbdOut() int { return int(C.llama_model_n_embd_out(m.m)) }

// IsMTP reports whether c is an MTP draft context (ContextParams.MTPTarget).
func (c *Context) IsMTP() bool { return c.embdRow > 0 }

// assistantArchs are the architectures of MTP drafters shipped as a model file of their
// own that read their target's KV cache instead of keeping one (b11434: Gemma 4's).
var assistantArchs = map[string]string{"gemma4-assistant": "gemma4"}

// IsAssistant reports whether m is an MTP assistant: a drafter for another model (its
// target) whose context keeps no KV cache but attends over the target's (llama.cpp shares
// the target's last sliding and last full layer's cells with it), fed the target's hidden
// state like an MTP head. Gemma 4 ships its MTP drafter so.
func (m *Model) IsAssistant() bool {
	_, ok := assistantArchs[m.Meta("general.architecture")]
	return ok
}

// checkAssistant refuses assistant a for target t unless a is written for t's architecture
// with t's vocabulary and hidden width: llama.cpp's assistant graph takes the target's
// token embeddings, hidden state and KV layers as they come and would abort (GGML_ASSERT)
// or read garbage on another model.
func checkAssistant(t, a *Model) error {
	want := assistantArchs[a.Meta("general.architecture")]
	if got := t.Meta("general.architecture"); got != want {
		return fmt.Errorf("a %s assistant drafts for %s models, not %s", a.Meta("general.architecture"), want, got)
	}
	if err := CheckDraftVocab(t, a); err != nil {
		return err
	}
	if w, h := int(C.llama_model_n_embd_inp(a.m)), t.NEmbdOut(); w != h {
		return fmt.Errorf("the assistant reads hidden states of %d values, the target's are %d", w, h)
	}
	return nil
}

// SharesTargetKV reports whether c is an MTP assistant's context (IsAssistant): it has no
// cells of its own, its sequences' cells are its target's, and every cell operation on it
// (SeqRm, SeqCp, state save and load) does nothing in llama.cpp.
func (c *Context) SharesTargetKV() bool { return c.IsMTP() && c.model.IsAssistant() }

// initMTPBatch gives an MTP context's batch an embedding row per entry beside its token:
// llama.cpp's batch conversion takes both (the MTP graph reads the token's embedding and
// h). llama_batch_free frees the row buffer with the rest (both are malloc'd).
func (c *Context) initMTPBatch() {
	c.embdRow = int(C.llama_model_n_embd_inp(c.model.m))
	c.batch.embd = (*C.float)(C.malloc(C.size_t(c.nb*c.embdRow) * C.size_t(unsafe.Sizeof(C.float(0)))))
}

// SetNextNLayer makes MTP context c run the model's NextN block i (0, the default: the
// first) from its next decode on. A model with several blocks (MiMo-V2, Step-3.5) chains
// them, one per draft step; i must be below Model.NLayerNextN (llama.cpp aborts otherwise).
func (c *Context) SetNextNLayer(i int) error {
	if !c.IsMTP() || i < 0 || i >= c.model.NLayerNextN() {
		return fmt.Errorf("NextN block %d: the context is not an MTP context of a model with that many blocks (%d)", i, c.model.NLayerNextN())
	}
	C.polykv_set_nextn_layer_offset(c.c, C.int32_t(i))
	return nil
}

// SetEmbeddingsNextN turns the NextN rows of c's decodes on or off. A draft-mtp target
// wants them unmasked (one row for every batch entry, whatever its logits flag: the
// draft context needs h at every position, prefill included); the MTP context masked
// (rows only for entries with logits: the draft steps chain on them).
func (c *Context) SetEmbeddingsNextN(on, masked bool) {
	C.polykv_set_embeddings_nextn(c.c, C.bool(on), C.bool(masked))
}

// EmbeddingsNextN returns a copy of the NextN row of batch entry i from the last Decode
// (unmasked: i is any entry's batch index; masked: an entry that asked for logits), or
// nil if there is none.
// Masked rows are right only where every entry of the batch asked for logits (or none
// did): b11434 copies the head's first n_outputs rows, not those of the entries that
// asked (src/llama-context.cpp, the nextn extraction in decode), so an MTP batch that
// mixes catch-up entries with a draft entry reads another position's row
// (TestMTPDraftsMatchReference in internal/runner found it). runner.MTP never mixes.
func (c *Context) EmbeddingsNextN(i int) []float32 {
	v := c.EmbeddingsNextNView(i)
	if v == nil {
		return nil
	}
	return slices.Clone(v)
}

// EmbeddingsNextNView is EmbeddingsNextN without the copy: the slice is c's output
// buffer, valid only until c's next Decode or Free, and must not be written. A target's
// decode has a row per batch entry; a caller that needs few of them past the decode
// (runner.MTP keeps a sequence's last few) copies only those.
func (c *Context) EmbeddingsNextNView(i int) []float32 {
	p := C.polykv_get_embeddings_nextn_ith(c.c, C.int32_t(i))
	if p == nil {
		return nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(p)), c.model.NEmbdOut())
}

// BatchAddEmbd appends an entry to an MTP context's batch: token tok at pos for seq with
// h, the target's NextN row of the position before pos (the draft steps: the MTP
// context's own row of the entry before). It returns the entry's batch index.
func (c *Context) BatchAddEmbd(tok Token, pos int, seq int, logits bool, h []float32) (int, error) {
	if c.embdRow == 0 {
		return -1, fmt.Errorf("batch add: not an MTP context")
	}
	if len(h) != c.embdRow {
		return -1, fmt.Errorf("batch add: embedding of %d values, the MTP context takes %d", len(h), c.embdRow)
	}
	i, err := c.BatchAdd(tok, pos, seq, logits)
	if err != nil {
		return -1, err
	}
	row := unsafe.Slice((*float32)(unsafe.Pointer(c.batch.embd)), c.nb*c.embdRow)[i*c.embdRow : (i+1)*c.embdRow]
	copy(row, h)
	return i, nil
}
