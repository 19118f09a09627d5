"""The official anthropic client's Messages API works against polykv unchanged (issue
26): create, streaming, a tool-use round trip, count_tokens, and errors in Anthropic's
shape."""
import anthropic
import pytest

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
# This anthropic client has no temperature argument; polykv reads it from the body
# (greedy decoding makes a stream and a create of the same request comparable).
NO_SAMPLING = {"temperature": 0}


@pytest.fixture()
def client(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def test_create(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model="m", system=SYSTEM, max_tokens=32, extra_body=NO_SAMPLING,
                                 messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert "Paris" in text
    assert msg.usage.output_tokens > 0 and msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0


def test_stream_matches_create(client: anthropic.Anthropic) -> None:
    kwargs = dict(
        model="m",
        system=SYSTEM,
        max_tokens=40,
        extra_body=NO_SAMPLING,
        messages=[{"role": "user", "content": "Say hello."}],
    )
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(
        model="m", max_tokens=60, extra_body=NO_SAMPLING, tools=[WEATHER], tool_choice={"type": "any"}, messages=ask
    )
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    history = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees and sunny"}],
        },
    ]
    second = client.messages.create(model="m", max_tokens=24, extra_body=NO_SAMPLING, tools=[WEATHER], messages=history)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # Streamed, the input_json deltas add up to the tool input of the final message.
    with client.messages.stream(
        model="m",
        max_tokens=60,
        extra_body=NO_SAMPLING,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ask,
    ) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert len(streamed) == 1 and streamed[0].input == uses[0].input
    # A tool_result without its tool_use is refused in Anthropic's error shape.
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}],
        )
    assert err.value.body["type"] == "error" and "tool_use_id" in err.value.body["error"]["message"]


def test_count_tokens(client: anthropic.Anthropic) -> None:
    short = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Hi"}])
    longer = client.messages.count_tokens(
        model="m", system=SYSTEM, messages=[{"role": "user", "content": "Hi, how are you today?"}]
    )
    assert 0 < short.input_tokens < longer.input_tokens
    msg = client.messages.create(
        model="m", system=SYSTEM, max_tokens=4, messages=[{"role": "user", "content": "Hi, how are you today?"}]
    )
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == longer.input_tokens
