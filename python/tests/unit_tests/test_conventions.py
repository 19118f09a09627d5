"""Issue 13's LangChain conventions for ChatPolyKV, offline (httpx.MockTransport, no sockets)."""
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelConnectionError,
    ModelInvalidRequestError,
    ModelRateLimitError,
    ModelTimeoutError,
)
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from pytest import MonkeyPatch

import polykv_langgraph
import polykv_langgraph.chat_model as chat_model_mod
from polykv_langgraph import ChatPolyKV, PolyKVError, PoolSaturatedError, create_model_pool
from polykv_langgraph.local_server import LocalServer, find_polykv

from .test_offline import FakeServer, chat_response, err

BASE = {"id": "c", "model": "smol", "object": "chat.completion.chunk"}


def delta(text: str, finish: str | None = None, **extra: Any) -> dict:
    return {
        **BASE,
        **extra,
        "choices": [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}],
    }


def sse_bytes(*chunks: dict) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode()


@pytest.fixture
def no_backoff(monkeypatch: MonkeyPatch) -> None:
    monkeypatch.setattr(chat_model_mod, "_backoff", lambda attempt: 0.0)


# --- streaming ------------------------------------------------------------------------


async def test_astream_yields_each_chunk_as_it_arrives() -> None:
    """The server holds the rest of the reply until the client has seen the first token:
    an _astream that reads the whole body before yielding never sees it (and times out)."""
    seen_first = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield sse_bytes(delta("Hel"))
        await asyncio.wait_for(seen_first.wait(), 3)
        yield sse_bytes(delta("lo"), delta("", "stop", timings={"tps_ewma": 5.0}))
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"Content-Type": "text/event-stream"})

    llm = ChatPolyKV(base_url="http://polykv.test", async_transport=httpx.MockTransport(handler), max_retries=0)
    llm._served_asked = True  # no /v1/models round trip in this test
    got = []
    async for chunk in llm.astream("hi"):
        got.append(chunk.content)
        if chunk.content == "Hel":
            seen_first.set()
    assert "".join(got) == "Hello" and got.index("Hel") < got.index("lo")


async def test_astream_events_carry_live_tokens() -> None:
    seen_first = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield sse_bytes(delta("A"))
        await asyncio.wait_for(seen_first.wait(), 3)
        yield sse_bytes(delta("B"), delta("", "stop")) + b"data: [DONE]\n\n"

    llm = ChatPolyKV(base_url="http://polykv.test", max_retries=0,
                     async_transport=httpx.MockTransport(lambda r: httpx.Response(200, content=body())))
    llm._served_asked = True
    tokens = []
    async for ev in llm.astream_events("hi", version="v2"):
        if ev["event"] == "on_chat_model_stream":
            tokens.append(ev["data"]["chunk"].content)
            seen_first.set()
    assert tokens[:2] == ["A", "B"]


# --- errors and retries ---------------------------------------------------------------


def test_errors_map_to_langchain_core_types() -> None:
    fs = FakeServer()
    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(fs), max_retries=0)
    cases = [
        (err(400, "exceed_context_size_error", "prompt of 5000 tokens does not fit n_ctx 4096"), ContextOverflowError),
        (err(429, "pool_saturated_error", "full", {"Retry-After": "2"}), ModelRateLimitError),
        (err(503, "unavailable_error", "queue full"), ModelAPIError),
        (err(500, "server_error", "boom"), ModelAPIError),
        (err(400, "invalid_request_error", "bad"), ModelInvalidRequestError),
    ]
    for handler, typ in cases:
        fs.on("POST", "/v1/chat/completions", handler)
        with pytest.raises(typ) as e:
            llm.invoke("hi")
        assert isinstance(e.value, PolyKVError)  # and still the package's own type
    with pytest.raises(PoolSaturatedError):
        fs.on("POST", "/v1/chat/completions", err(429, "pool_saturated_error", "full"))
        llm.invoke("hi")


def test_connection_errors_and_timeouts_are_retried_with_backoff(no_backoff: None) -> None:
    calls = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/v1/chat/completions" and len([c for c in calls if c == request.url.path]) <= 2:
            raise httpx.ConnectError("refused")
        return chat_response("ok")(request, None)

    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(flaky), max_retries=2)
    assert llm.invoke("hi").content == "ok"
    assert calls.count("/v1/chat/completions") == 3

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with pytest.raises(ModelConnectionError):
        ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(down), max_retries=1).invoke("hi")

    timeouts = []

    def slow(request: httpx.Request) -> httpx.Response:
        timeouts.append(1)
        raise httpx.ReadTimeout("slow")

    with pytest.raises(ModelTimeoutError):
        ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(slow), max_retries=2).invoke("hi")
    assert len(timeouts) >= 3  # 1 + 2 retries (+ the one /v1/models lookup)


async def test_async_retries_and_stream_errors(no_backoff: None) -> None:
    n = {"chat": 0}

    def flaky(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            n["chat"] += 1
            if n["chat"] == 1:
                raise httpx.ConnectTimeout("slow")
            return httpx.Response(200, content=sse_bytes(delta("x"), delta("", "stop")) + b"data: [DONE]\n\n")
        return httpx.Response(404)

    llm = ChatPolyKV(base_url="http://polykv.test", async_transport=httpx.MockTransport(flaky), max_retries=1)
    out = [c.content async for c in llm.astream("hi")]
    assert "".join(out) == "x" and n["chat"] == 2
    # An error the server reports inside the stream is typed as well.
    bad = httpx.MockTransport(
        lambda r: httpx.Response(
            200, content=b'data: {"error": {"code": 503, "type": "unavailable_error", "message": "x"}}\n\n'
        )
    )
    with pytest.raises(ModelAPIError):
        async for _ in ChatPolyKV(base_url="http://polykv.test", async_transport=bad, max_retries=0).astream("hi"):
            pass


def test_summarization_middleware_reacts_to_context_overflow() -> None:
    """SummarizationMiddleware retries its summary call with a shorter prompt on a
    ContextOverflowError: what PolyKV's 400 exceed_context_size_error now raises."""
    from langchain.agents.middleware import SummarizationMiddleware

    fs = FakeServer()
    answers = [err(400, "exceed_context_size_error", "does not fit"), chat_response("short summary")]
    fs.on("POST", "/v1/chat/completions", lambda r, b: answers.pop(0)(r, b))
    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(fs), max_retries=0)
    mw = SummarizationMiddleware(llm, trigger=("messages", 4))
    history = [HumanMessage("q" * 200), AIMessage("a" * 200)] * 5
    assert mw._create_summary(history) == "short summary"
    assert len(fs.bodies()) == 2


# --- one client, tokens, metadata, profile ---------------------------------------------


def test_one_long_lived_client_per_instance() -> None:
    fs = FakeServer()
    fs.on("POST", "/v1/chat/completions", chat_response("hi"))
    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(fs))
    llm.invoke("a")
    first = llm._http
    llm.invoke("b")
    assert first is not None and llm._http is first and not first.is_closed
    llm.close()
    assert first.is_closed


async def test_one_async_client_per_event_loop() -> None:
    fs = FakeServer()
    fs.on("POST", "/v1/chat/completions", chat_response("hi"))
    llm = ChatPolyKV(base_url="http://polykv.test", async_transport=httpx.MockTransport(fs))
    llm._served_asked = True
    await llm.ainvoke("a")
    client = llm._aclient()
    await llm.ainvoke("b")
    assert llm._aclient() is client
    await llm.aclose()


def test_token_counting_goes_through_tokenize() -> None:
    fs = FakeServer()
    fs.on(
        "POST", "/tokenize", lambda r, b: httpx.Response(200, json={"tokens": list(range(len(b["content"].split())))})
    )
    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(fs))
    assert llm.get_token_ids("one two three") == [0, 1, 2]
    assert llm.get_num_tokens("a b c d") == 4
    assert fs.bodies("/tokenize")[0] == {"content": "one two three", "add_special": False}
    assert llm.get_num_tokens_from_messages([HumanMessage("x y")]) > 0


def test_ls_model_name_is_the_served_model_and_logprobs_in_metadata() -> None:
    fs = FakeServer()
    fs.on("GET", "/v1/models", lambda r, b: httpx.Response(200, json={"data": [{"id": "SmolLM2-135M-Instruct.Q4_1"}]}))
    lp = {"content": [{"token": "hi", "logprob": -0.25, "bytes": [104, 105], "top_logprobs": []}]}
    data = {
        "id": "x",
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "context": {"ctx_used": 30, "ctx_headroom_tokens": 994, "ctx_pressure": 0.029},
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "logprobs": lp}
        ],
    }
    fs.on("POST", "/v1/chat/completions", lambda r, b: httpx.Response(200, json=data))
    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(fs), logprobs=True)
    assert llm._get_ls_params()["ls_model_name"] == "SmolLM2-135M-Instruct.Q4_1"
    out = llm.invoke("hi")
    assert fs.bodies()[0]["logprobs"] is True
    assert out.response_metadata["logprobs"] == lp
    assert out.response_metadata["context_pressure"] == 0.029 and out.response_metadata["context"]["ctx_used"] == 30
    # Streamed, each chunk's logprobs are merged into the final message's metadata.
    chunks = [delta("h", logprobs=None), delta("i"), delta("", "stop")]
    chunks[0]["choices"][0]["logprobs"] = {"content": [lp["content"][0]]}
    chunks[1]["choices"][0]["logprobs"] = {"content": [{**lp["content"][0], "token": "i"}]}
    fs.on(
        "POST",
        "/v1/chat/completions",
        lambda r, b: httpx.Response(200, content=sse_bytes(*chunks) + b"data: [DONE]\n\n"),
    )
    full = None
    for c in llm.stream("hi"):
        full = c if full is None else full + c
    assert [t["token"] for t in full.response_metadata["logprobs"]["content"]] == ["hi", "i"]


def test_profile_and_refresh_from_props() -> None:
    fs = FakeServer()
    fs.on("GET", "/props", lambda r, b: httpx.Response(200, json={"n_ctx": 4096}))
    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(fs))
    assert llm.profile["tool_calling"] is True and llm.profile["structured_output"] is True
    assert llm.refresh_profile()["max_input_tokens"] == 4096 and llm.profile["max_input_tokens"] == 4096


def test_py_typed_ships() -> None:
    assert (Path(polykv_langgraph.__file__).parent / "py.typed").is_file()


# --- LocalServer and the pool helper ---------------------------------------------------


def test_local_server_finds_polykv(monkeypatch: MonkeyPatch, tmp_path: Path) -> None:
    exe = tmp_path / "polykv"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("POLYKV_BIN", str(exe))
    assert find_polykv() == str(exe) and LocalServer().binary == str(exe)
    monkeypatch.setenv("POLYKV_BIN", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="POLYKV_BIN"):
        find_polykv()
    monkeypatch.delenv("POLYKV_BIN")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_polykv() == str(exe)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError) as e:
        LocalServer()
    assert "POLYKV_BIN" in str(e.value) and "PATH" in str(e.value)


def test_create_model_pool_sends_system_and_bound_tools() -> None:
    fs = FakeServer()
    fs.on("POST", "/polykv/pools", lambda r, b: httpx.Response(201, json={"pool_id": 3, "prefix_len": 50}))

    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(fs))
    pool = create_model_pool(fs.client(), llm.bind_tools([lookup]), SystemMessage("You are a guide."), pin=True)
    body = fs.bodies("/polykv/pools")[0]
    assert pool["pool_id"] == 3
    assert body["messages"] == [{"role": "system", "content": "You are a guide."}] and body["pin"] is True
    assert body["tools"][0]["function"]["name"] == "lookup"
    create_model_pool(fs.client(), llm, "plain")
    assert "tools" not in fs.bodies("/polykv/pools")[1]
