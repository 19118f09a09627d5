// Exception-safe wrappers around llama.cpp's sampler calls (sampler_shim.cpp).
//
// llama.cpp's grammar code reports a token that does not fit the grammar by throwing
// std::runtime_error (llama_grammar_accept_token: "Unexpected empty grammar stack"), and
// a lazy grammar's trigger regexes can throw std::regex_error. A C++ exception that
// unwinds into Go's cgo frames aborts the whole process, so every call that may reach
// grammar code goes through these wrappers, which catch everything and return a code.
#ifndef POLYKV_SAMPLER_SHIM_H
#define POLYKV_SAMPLER_SHIM_H

#include <stddef.h>
#include <stdint.h>
#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Result codes of the wrappers.
enum {
	POLYKV_SAMPLE_OK = 0,
	POLYKV_SAMPLE_APPLY_FAILED = 1,  // the chain threw while masking the candidates
	POLYKV_SAMPLE_NO_TOKEN = 2,      // every candidate was masked: nothing fits the grammar
	POLYKV_SAMPLE_ACCEPT_FAILED = 3, // the drawn token (in *out) does not fit the grammar
	POLYKV_SAMPLE_BAD_INDEX = 4      // no logits for that batch index
};

// polykv_grammar_init builds a grammar sampler; lazy != 0 makes it wait for one of the
// trigger patterns (full-match regexes over the output so far; the grammar is fed from
// the first capture group) or trigger tokens. NULL on failure, with a message in err.
struct llama_sampler * polykv_grammar_init(const struct llama_vocab * vocab, const char * grammar,
	int lazy, const char ** patterns, size_t n_patterns, const llama_token * tokens, size_t n_tokens,
	char * err, size_t err_len);

// polykv_sampler_sample is llama_sampler_sample without its aborts, over a grammar
// sampler (NULL: none) followed by a chain: it applies both to batch index idx's
// logits, draws, and accepts the draw into both. On POLYKV_SAMPLE_ACCEPT_FAILED *out
// holds the drawn token, which the chain has accepted. After a failure the grammar's
// state is undefined and it must only be freed; the chain stays usable.
int polykv_sampler_sample(struct llama_sampler * grammar, struct llama_sampler * chain,
	struct llama_context * ctx, int32_t idx, llama_token * out, char * err, size_t err_len);

// polykv_sampler_accept is llama_sampler_accept that reports an exception instead of
// letting it unwind.
int polykv_sampler_accept(struct llama_sampler * smpl, llama_token tok, char * err, size_t err_len);

// polykv_grammar_fits reports how many of tokens[0..n), in order, grammar allows after
// what it has accepted so far, walking a clone (the grammar itself is not touched): the
// index of the first token it would mask, or n. An end-of-generation token it allows
// ends the walk (nothing follows it). A lazy grammar still waiting for its trigger
// allows everything (it masks nothing). When llama.cpp throws, the tokens before the one
// it threw on count, and err says why.
int polykv_grammar_fits(const struct llama_sampler * grammar, const struct llama_vocab * vocab,
	const llama_token * tokens, int n, char * err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif
