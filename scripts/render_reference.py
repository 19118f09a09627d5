"""Reference chat-template renderer for PolyKV's template corpus test.

Renders templates exactly as Hugging Face transformers' apply_chat_template does: jinja2's
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, the loopcontrols extension,
a pass-through {% generation %} block (transformers' AssistantTracker, inactive when no
assistant mask is asked for), tojson as json.dumps(ensure_ascii=False, indent, separators,
sort_keys), raise_exception and strftime_now; render(messages=..., tools=..., documents=None,
add_generation_prompt=..., **special tokens, **chat_template_kwargs). The setup is copied
from transformers/utils/chat_template_utils.py (_compile_jinja_template, render_jinja_template)
so the test needs jinja2 only, not transformers and torch.

Input (stdin, JSON): {"templates": {name: source}, "cases": [{"name", "messages", "tools"
(or null), "add_generation_prompt", "kwargs" (optional)}], "special": {bos_token, eos_token}}.
Output (stdout, JSON): {"<template>/<case>": {"text": ...} | {"error": ...}}.
"""

import json
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class AssistantTracker(jinja2.ext.Extension):
    """transformers' {% generation %} tag; with no assistant mask requested it only
    renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def compile_template(source):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def main():
    job = json.load(sys.stdin)
    special = job.get("special", {})
    out = {}
    for name, source in job["templates"].items():
        try:
            tmpl = compile_template(source)
        except Exception as e:  # noqa: BLE001 - any failure means "no reference"
            for case in job["cases"]:
                out[f"{name}/{case['name']}"] = {"error": f"compile: {type(e).__name__}: {e}"}
            continue
        for case in job["cases"]:
            try:
                text = tmpl.render(messages=case["messages"], tools=case.get("tools"), documents=None,
                                   add_generation_prompt=case["add_generation_prompt"],
                                   **special, **case.get("kwargs", {}))
                out[f"{name}/{case['name']}"] = {"text": text}
            except Exception as e:  # noqa: BLE001
                out[f"{name}/{case['name']}"] = {"error": f"{type(e).__name__}: {e}"}
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
