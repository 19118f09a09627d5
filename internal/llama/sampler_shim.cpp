// Exception-safe sampler calls; see sampler_shim.h for why.

#include "sampler_shim.h"

#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

namespace {

void set_err(char * err, size_t err_len, const char * msg) {
	if (err != nullptr && err_len > 0) {
		snprintf(err, err_len, "%s", msg);
	}
}

} // namespace

extern "C" struct llama_sampler * polykv_grammar_init(const struct llama_vocab * vocab, const char * grammar,
	int lazy, const char ** patterns, size_t n_patterns, const llama_token * tokens, size_t n_tokens,
	char * err, size_t err_len) {
	try {
		struct llama_sampler * s = lazy
			? llama_sampler_init_grammar_lazy_patterns(vocab, grammar, "root", patterns, n_patterns, tokens, n_tokens)
			: llama_sampler_init_grammar(vocab, grammar, "root");
		if (s == nullptr) {
			set_err(err, err_len, "llama.cpp could not parse the grammar");
		}
		return s;
	} catch (const std::exception & e) {
		set_err(err, err_len, e.what()); // e.g. std::regex_error from a trigger pattern
	} catch (...) {
		set_err(err, err_len, "unknown C++ exception");
	}
	return nullptr;
}

extern "C" int polykv_sampler_sample(struct llama_sampler * grammar, struct llama_sampler * chain,
	struct llama_context * ctx, int32_t idx, llama_token * out, char * err, size_t err_len) {
	// One candidate buffer per thread, reused: only the engine goroutine samples, and
	// llama.cpp itself allocates this vector on every call.
	thread_local std::vector<llama_token_data> cur;
	const float * logits = llama_get_logits_ith(ctx, idx);
	if (logits == nullptr) {
		set_err(err, err_len, "no logits for the batch index");
		return POLYKV_SAMPLE_BAD_INDEX;
	}
	const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
	try {
		cur.resize(n_vocab);
		for (llama_token id = 0; id < n_vocab; id++) {
			cur[id] = llama_token_data{id, logits[id], 0.0f};
		}
		llama_token_data_array cur_p = {cur.data(), cur.size(), -1, false};
		if (grammar != nullptr) {
			llama_sampler_apply(grammar, &cur_p);
		}
		llama_sampler_apply(chain, &cur_p);
		// llama_sampler_sample asserts here (an abort); when the grammar masked every
		// candidate, greedy still picks one, with logit -inf: neither may be accepted,
		// since a grammar aborts (GGML_ABORT, uncatchable) on an end-of-generation
		// token it did not allow.
		if (cur_p.selected < 0 || cur_p.selected >= (int64_t) cur_p.size) {
			set_err(err, err_len, "the sampler chain selected no token");
			return POLYKV_SAMPLE_NO_TOKEN;
		}
		const llama_token_data & sel = cur_p.data[cur_p.selected];
		if (std::isinf(sel.logit) && sel.logit < 0) {
			set_err(err, err_len, "no token fits the grammar");
			return POLYKV_SAMPLE_NO_TOKEN;
		}
		*out = sel.id;
	} catch (const std::exception & e) {
		set_err(err, err_len, e.what());
		return POLYKV_SAMPLE_APPLY_FAILED;
	} catch (...) {
		set_err(err, err_len, "unknown C++ exception");
		return POLYKV_SAMPLE_APPLY_FAILED;
	}
	// The chain takes the token whatever the grammar says: it was drawn, and the
	// caller keeps it when it drops a failed grammar.
	int r = POLYKV_SAMPLE_OK;
	if (grammar != nullptr && polykv_sampler_accept(grammar, *out, err, err_len) != POLYKV_SAMPLE_OK) {
		r = POLYKV_SAMPLE_ACCEPT_FAILED;
	}
	char chain_err[8];
	if (polykv_sampler_accept(chain, *out, r == POLYKV_SAMPLE_OK ? err : chain_err, r == POLYKV_SAMPLE_OK ? err_len : sizeof chain_err) != POLYKV_SAMPLE_OK) {
		r = POLYKV_SAMPLE_ACCEPT_FAILED;
	}
	return r;
}

extern "C" int polykv_sampler_accept(struct llama_sampler * smpl, llama_token tok, char * err, size_t err_len) {
	try {
		llama_sampler_accept(smpl, tok);
	} catch (const std::exception & e) {
		set_err(err, err_len, e.what());
		return POLYKV_SAMPLE_ACCEPT_FAILED;
	} catch (...) {
		set_err(err, err_len, "unknown C++ exception");
		return POLYKV_SAMPLE_ACCEPT_FAILED;
	}
	return POLYKV_SAMPLE_OK;
}

extern "C" int polykv_grammar_fits(const struct llama_sampler * grammar, const struct llama_vocab * vocab,
	const llama_token * tokens, int n, char * err, size_t err_len) {
	struct llama_sampler * g = nullptr;
	int fit = 0;
	try {
		g = llama_sampler_clone(grammar);
		for (; fit < n; fit++) {
			// One candidate: the grammar masks it (logit -inf) or leaves it. Only an
			// allowed token is accepted, so the clone never meets the forbidden
			// end-of-generation token on which llama.cpp aborts.
			llama_token_data cand = {tokens[fit], 0.0f, 0.0f};
			llama_token_data_array cur_p = {&cand, 1, -1, false};
			llama_sampler_apply(g, &cur_p);
			if (std::isinf(cand.logit)) {
				break;
			}
			llama_sampler_accept(g, tokens[fit]);
			if (llama_vocab_is_eog(vocab, tokens[fit])) {
				fit++;
				break;
			}
		}
	} catch (const std::exception & e) {
		set_err(err, err_len, e.what()); // fit: the tokens before the one that threw
	} catch (...) {
		set_err(err, err_len, "unknown C++ exception");
	}
	if (g != nullptr) {
		llama_sampler_free(g);
	}
	return fit;
}
