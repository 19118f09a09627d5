package llama

/*
#include <string.h>
#include "llama.h"
*/
import "C"

import (
	"fmt"
	"math"
	"unsafe"
)

// Draft models (speculative decoding with --model-draft, issue 23). The draft model
// runs in its own Context; this file has what that needs beyond a plain context: the
// vocabulary check and a greedy pick with its probability that reads the logits in
// place (a draft step reads one row per drafting session, and copying 49k floats per
// row through Logits would cost more than the pick).

// draftVocabCheckFrom and draftVocabMaxDiff are llama.cpp's
// SPEC_VOCAB_CHECK_START_TOKEN_ID and SPEC_VOCAB_MAX_SIZE_DIFFERENCE (common/speculative.cpp).
const (
	draftVocabCheckFrom = 5
	draftVocabMaxDiff   = 128
)

// CheckDraftVocab reports why draft cannot draft for target, or nil when it can: the
// check of llama.cpp's common_speculative_are_compatible (same vocabulary type, the
// same BOS and EOS use and ids, at most 128 tokens' difference in size, the same token
// texts from id 5 on), repeated here because common/ is not linked into the server.
func CheckDraftVocab(target, draft *Model) error {
	vt, vd := target.vocab, draft.vocab
	if a, b := C.llama_vocab_type(vt), C.llama_vocab_type(vd); a != b {
		return fmt.Errorf("draft model's vocabulary type %d differs from the target's %d", int(b), int(a))
	}
	if bool(C.llama_vocab_get_add_bos(vt)) != bool(C.llama_vocab_get_add_bos(vd)) ||
		(bool(C.llama_vocab_get_add_bos(vt)) && C.llama_vocab_bos(vt) != C.llama_vocab_bos(vd)) {
		return fmt.Errorf("draft model's BOS token (id %d) differs from the target's (id %d)", int(C.llama_vocab_bos(vd)), int(C.llama_vocab_bos(vt)))
	}
	if bool(C.llama_vocab_get_add_eos(vt)) != bool(C.llama_vocab_get_add_eos(vd)) ||
		(bool(C.llama_vocab_get_add_eos(vt)) && C.llama_vocab_eos(vt) != C.llama_vocab_eos(vd)) {
		return fmt.Errorf("draft model's EOS token (id %d) differs from the target's (id %d)", int(C.llama_vocab_eos(vd)), int(C.llama_vocab_eos(vt)))
	}
	nt, nd := target.NVocab(), draft.NVocab()
	if d := nt - nd; d > draftVocabMaxDiff || -d > draftVocabMaxDiff {
		return fmt.Errorf("draft model's vocabulary has %d tokens, the target's %d (at most %d apart)", nd, nt, draftVocabMaxDiff)
	}
	for i := draftVocabCheckFrom; i < min(nt, nd); i++ {
		a, b := C.llama_vocab_get_text(vt, C.llama_token(i)), C.llama_vocab_get_text(vd, C.llama_token(i))
		if C.strcmp(a, b) != 0 {
			return fmt.Errorf("draft model's token %d is %q, the target's %q", i, C.GoString(b), C.GoString(a))
		}
	}
	return nil
}

// VocabSize is the number of tokens a draft pick may return: the smaller of the two
// vocabularies, so a draft token is always valid in the target.
func VocabSize(target, draft *Model) int { return min(target.NVocab(), draft.NVocab()) }

// Greedy returns the most likely token among the first n of batch index i's output row
// from the last Decode, and its softmax probability over the whole row. ok is false
// when the row has no output.
func (c *Context) Greedy(i, n int) (tok Token, p float32, ok bool) {
	ptr := C.llama_get_logits_ith(c.c, C.int32_t(i))
	if ptr == nil {
		return 0, 0, false
	}
	row := unsafe.Slice((*float32)(unsafe.Pointer(ptr)), c.model.NVocab())
	best := 0
	for j := 1; j < n; j++ {
		if row[j] > row[best] {
			best = j
		}
	}
	mx := row[best]
	for _, v := range row[n:] {
		mx = max(mx, v)
	}
	// Logits more than 16 below the maximum add under 1.2e-7 each to the sum: skipped,
	// as exp over the whole vocabulary per draft row would cost more than the pick. The
	// probability only decides whether to keep drafting (--draft-p-min).
	var sum float64
	for _, v := range row {
		if v > mx-16 {
			sum += math.Exp(float64(v - mx))
		}
	}
	return Token(best), float32(math.Exp(float64(row[best]-mx)) / sum), true
}
