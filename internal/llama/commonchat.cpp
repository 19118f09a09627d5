//go:build commonchat

// Measurement-only binding of llama.cpp's common/chat (docs/chat.md); see commonchat.h.
#include "commonchat.h"

#include "chat.h"

#include <cstdlib>
#include <cstring>
#include <string>

struct pk_cc {
    common_chat_templates_ptr t;
};

static char * dup_str(const std::string & s) {
    char * p = static_cast<char *>(malloc(s.size() + 1));
    memcpy(p, s.data(), s.size());
    p[s.size()] = 0;
    return p;
}

template <typename F> static auto guard(char ** err, F f) -> decltype(f()) {
    try {
        return f();
    } catch (const std::exception & e) {
        *err = dup_str(std::string("C++ exception: ") + e.what());
    } catch (...) {
        *err = dup_str("C++ exception of unknown type");
    }
    return nullptr;
}

pk_cc * pk_cc_init(const char * tmpl, const char * bos, const char * eos, char ** err) {
    return guard(err, [&]() -> pk_cc * {
        auto * t = new pk_cc;
        t->t     = common_chat_templates_init(nullptr, tmpl, bos, eos);
        return t;
    });
}

void pk_cc_free(pk_cc * t) {
    delete t;
}

char * pk_cc_apply(pk_cc * t, const char * messages, const char * tools, int add_gen, int parallel, int thinking, char ** err) {
    return guard(err, [&]() -> char * {
        common_chat_templates_inputs in;
        in.messages = common_chat_msgs_parse_oaicompat(common_json::parse(messages));
        if (tools && *tools) {
            in.tools = common_chat_tools_parse_oaicompat(common_json::parse(tools));
        }
        in.add_generation_prompt = add_gen != 0;
        in.parallel_tool_calls   = parallel != 0;
        in.enable_thinking       = thinking != 0;
        // llama-server's default (reasoning_format auto reads as deepseek): reasoning
        // goes to reasoning_content; the parser built here depends on it.
        in.reasoning_format = COMMON_REASONING_FORMAT_DEEPSEEK;
        auto p = common_chat_templates_apply(t->t.get(), in);
        common_json out = common_json::object();
        out["prompt"]            = p.prompt;
        out["format"]            = static_cast<int>(p.format);
        out["format_name"]       = std::string(common_chat_format_name(p.format));
        out["grammar"]           = p.grammar;
        out["lazy"]              = p.grammar_lazy;
        out["parser"]            = p.parser;
        out["generation_prompt"] = p.generation_prompt;
        common_json trig         = common_json::array();
        for (const auto & g : p.grammar_triggers) {
            trig.push_back(g.value);
        }
        out["triggers"] = trig;
        return dup_str(out.dump());
    });
}

char * pk_cc_parse(int format, const char * parser, const char * generation_prompt, const char * text, int partial,
                   char ** err) {
    return guard(err, [&]() -> char * {
        common_chat_parser_params pp;
        pp.format            = static_cast<common_chat_format>(format);
        pp.generation_prompt = generation_prompt;
        pp.reasoning_format  = COMMON_REASONING_FORMAT_DEEPSEEK;
        if (parser && *parser) {
            pp.parser.load(parser);
        }
        auto msg = common_chat_parse(text, partial != 0, pp);
        return dup_str(msg.to_json_oaicompat().dump());
    });
}
