"""The official openai client's Responses API works against polykv unchanged (issue 26):
create, streaming, a function-calling round trip, a previous_response_id chain that
reuses its session's KV, and structured output through responses.parse."""
import json

import openai
import pytest
from pydantic import BaseModel

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SYSTEM = "You are a helpful assistant. Answer in one short sentence."


@pytest.fixture()
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_create(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model="m", instructions=SYSTEM, input="What is the capital of France?", max_output_tokens=32, temperature=0
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete")
    assert "Paris" in resp.output_text
    assert resp.usage is not None and resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    # Stored by default: GET returns the same response, DELETE removes it.
    again = client.responses.retrieve(resp.id)
    assert again.id == resp.id and again.output_text == resp.output_text
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_stream_matches_create(client: openai.OpenAI) -> None:
    kwargs = dict(model="m", instructions=SYSTEM, input="Say hello.", max_output_tokens=48, temperature=0, store=False)
    whole = client.responses.create(**kwargs)
    deltas, types = [], []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response() if whole.status == "completed" else None
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert "".join(deltas) == whole.output_text
    if final is not None:
        assert final.output_text == whole.output_text


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="m",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    # The tool's answer goes back by previous_response_id, as function_call_output.
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        tools=[WEATHER],
        max_output_tokens=24,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature_c": 18}'}],
    )
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # Streamed, the argument deltas add up to the call the stream completes with.
    args = ""
    with client.responses.stream(model="m", input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=60, temperature=0, store=False) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                args += event.delta
        done = stream.get_final_response()
    streamed = [item for item in done.output if item.type == "function_call"]
    assert len(streamed) == 1 and streamed[0].arguments == args and json.loads(args)
    # An output for a call never made is a 400 naming the field.
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model="m", input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
        )
    assert "call_id" in str(err.value)


def test_previous_response_id_chain_reuses_kv(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="m", instructions=SYSTEM, input="Name a fruit.", max_output_tokens=12, temperature=0
    )
    second = client.responses.create(
        model="m",
        instructions=SYSTEM,
        input="Name another one.",
        previous_response_id=first.id,
        max_output_tokens=12,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    # The second turn continues the first's session: its history is not prefilled again.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert err.value.param == "previous_response_id"


class City(BaseModel):
    name: str
    country: str


def test_structured_output_parse(client: openai.OpenAI) -> None:
    resp = client.responses.parse(
        model="m",
        input="Give the capital of France as JSON with name and country.",
        text_format=City,
        max_output_tokens=60,
        temperature=0,
    )
    city = resp.output_parsed
    assert isinstance(city, City) and city.name and city.country
