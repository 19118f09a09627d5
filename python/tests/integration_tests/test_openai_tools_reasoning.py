"""The official openai client reads tool_calls and reasoning_content back unchanged (issue 11)."""
import json
from collections.abc import Iterator

import openai
import pytest
from pytest import TempPathFactory

from polykv_langgraph.local_server import LocalServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture()
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_tool_calls_read_back_and_round_trip(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                          temperature=0, max_tokens=60)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # Streamed, the deltas add up to the same call.
    stream = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                            temperature=0, max_tokens=60, stream=True)
    name, args, ids, finish = "", "", set(), None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                if d.id:
                    ids.add(d.id)
                if d.function and d.function.name:
                    name += d.function.name
                if d.function and d.function.arguments:
                    args += d.function.arguments
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and name == "get_weather" and len(ids) == 1
    assert json.loads(args) == json.loads(call.function.arguments)
    # The assistant message goes back as the client dumps it, with the tool's answer.
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    again = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], temperature=0, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory: TempPathFactory) -> Iterator[openai.OpenAI]:
    # SmolLM2 does not think; a template whose generation prompt opens a think block (as
    # DeepSeek R1's does) makes everything it writes reasoning.
    path = tmp_path_factory.mktemp("tmpl") / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    with LocalServer("-c", "1024", "--parallel", "1", "--chat-template-file", str(path)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_reasoning_content_read_back(thinking_client: openai.OpenAI) -> None:
    resp = thinking_client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=12)
    msg = resp.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)  # a llama.cpp extension the SDK does not type
    assert reasoning and not msg.content
    stream = thinking_client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=12, stream=True)
    streamed = "".join(getattr(c.delta, "reasoning_content", None) or "" for ch in stream for c in ch.choices)
    assert streamed.strip() == reasoning
    # reasoning_format "none" keeps it in content.
    raw = thinking_client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=12,
                                                  extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content and not getattr(raw.choices[0].message, "reasoning_content", None)
