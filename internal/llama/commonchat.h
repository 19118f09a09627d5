// Measurement-only binding of llama.cpp's common/chat (docs/chat.md): built with the
// "commonchat" build tag only, never into bin/polykv. Every call catches C++ exceptions
// and returns them as an error string: an exception crossing cgo would kill the process.
#ifndef POLYKV_COMMONCHAT_H
#define POLYKV_COMMONCHAT_H
#ifdef __cplusplus
extern "C" {
#endif

typedef struct pk_cc pk_cc;

// pk_cc_init parses a template; NULL with *err set (malloc'd) on failure.
pk_cc * pk_cc_init(const char * tmpl, const char * bos, const char * eos, char ** err);
void    pk_cc_free(pk_cc * t);
// pk_cc_apply renders OpenAI-form messages and tools (JSON; tools may be "") and returns
// (thinking: enable_thinking, llama-server's default is on) a JSON object {prompt, format, format_name, grammar, lazy, triggers, parser,
// generation_prompt} (malloc'd), or NULL with *err set.
char * pk_cc_apply(pk_cc * t, const char * messages, const char * tools, int add_gen, int parallel, int thinking,
                    char ** err);
// pk_cc_parse parses generated text with what pk_cc_apply returned (format, parser,
// generation_prompt) and returns the OpenAI-form message as JSON, or NULL with *err set.
char * pk_cc_parse(int format, const char * parser, const char * generation_prompt, const char * text, int partial,
                   char ** err);

#ifdef __cplusplus
}
#endif
#endif
