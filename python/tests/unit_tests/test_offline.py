"""Offline tests: the client, the chat model and the graph nodes against httpx.MockTransport."""
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.types import Command
from pytest import MonkeyPatch

from polykv_langgraph import (
    AuthenticationError,
    CapacityError,
    ChatPolyKV,
    CompactionNode,
    PolyKVClient,
    PoolNotFoundError,
    PoolSaturatedError,
    PrefixContractError,
    capacity_gate,
    capacity_reducer,
    make_pool_tools,
)

# Handler answers one request to the fake server (its parsed JSON body beside it).
Handler = Callable[[httpx.Request, Any], httpx.Response]


class FakeServer:
    """Routes requests to handlers and records them."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any, dict[str, str]]] = []
        self.routes: dict[tuple[str, str], Handler] = {}
        # reservation_server's state
        self.granted: list[str] = []
        self.limit = 0

    def on(self, method: str, path: str, handler: Handler) -> None:
        self.routes[(method, path)] = handler

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body, dict(request.url.params)))
        handler = self.routes.get((request.method, request.url.path))
        if handler is None:
            return httpx.Response(404, json={"error": {"code": 404, "type": "not_found_error", "message": "no route"}})
        return handler(request, body)

    def client(self) -> PolyKVClient:
        return PolyKVClient("http://polykv.test", transport=httpx.MockTransport(self))

    def bodies(self, path: str = "/v1/chat/completions") -> list[Any]:
        """Bodies of the requests to path (the chat model also asks /v1/models once)."""
        return [r[2] for r in self.requests if r[1] == path]


def err(status: int, typ: str, msg: str, headers: dict[str, str] | None = None) -> Handler:
    return lambda req, body: httpx.Response(
        status, json={"error": {"code": status, "type": typ, "message": msg}}, headers=headers or {}
    )


def test_errors_are_typed() -> None:
    fs = FakeServer()
    fs.on("GET", "/polykv/pools/4/capacity", err(429, "pool_saturated_error", "full", {"Retry-After": "3"}))
    fs.on("GET", "/polykv/pools/9", err(404, "not_found_error", "pool 9 does not exist"))
    fs.on("POST", "/polykv/pools/4/fork", err(409, "conflict_error", "token 12 differs"))
    fs.on("POST", "/polykv/pools", err(503, "unavailable_error", "no pool sequence ids left"))
    c = fs.client()
    with pytest.raises(PoolSaturatedError) as e:
        c.capacity(4)
    assert e.value.retry_after == 3.0 and e.value.status == 429
    with pytest.raises(PoolNotFoundError):
        c.pool(9)
    with pytest.raises(PrefixContractError, match="token 12"):
        c.fork_pool(4, 10, tokens=[1, 2, 3])
    with pytest.raises(CapacityError):
        c.create_pool(prompt="x")
    with pytest.raises(ValueError):
        c.create_pool(prompt="x", tokens=[1])


def test_compact_by_refork_builds_full_prefix_and_releases_subtree() -> None:
    fs = FakeServer()
    fs.on(
        "GET",
        "/polykv/pools/4",
        lambda r, b: httpx.Response(
            200, json={"pool_id": 4, "tokens": [1, 2, 3, 4, 5], "prefix_len": 5, "children": [5]}
        ),
    )
    fs.on(
        "GET",
        "/polykv/pools/5",
        lambda r, b: httpx.Response(200, json={"pool_id": 5, "tokens": [1, 2, 3, 4, 5, 6], "children": [6]}),
    )
    fs.on("GET", "/polykv/pools/6", lambda r, b: httpx.Response(200, json={"pool_id": 6, "tokens": [], "children": []}))
    fs.on("POST", "/tokenize", lambda r, b: httpx.Response(200, json={"tokens": [70, 71]}))
    fs.on(
        "POST",
        "/polykv/pools/4/fork",
        lambda r, b: httpx.Response(201, json={"pool_id": 7, "prefix_len": len(b["tokens"])}),
    )
    for pid in (5, 6):
        fs.on("DELETE", f"/polykv/pools/{pid}", lambda r, b: httpx.Response(200, json={"released": True}))
    out = fs.client().compact_by_refork(4, 3, compacted_text="summary", release_pool=5)
    fork = [r for r in fs.requests if r[1] == "/polykv/pools/4/fork"][0]
    assert fork[2] == {"tokens": [1, 2, 3, 70, 71], "branch_pos": 3}
    assert out["pool_id"] == 7 and out["released"] == [6, 5]
    deletes = [r[1] for r in fs.requests if r[0] == "DELETE"]
    assert deletes == ["/polykv/pools/6", "/polykv/pools/5"]  # children first


def chat_response(
    content: str = "", tool_calls: list[dict] | None = None, finish: str = "stop", headers: dict[str, str] | None = None
) -> Handler:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    data = {
        "id": "chatcmpl-1",
        "model": "smol",
        "pool_id": 4,
        "session_id": "s1",
        "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": 30,
            "completion_tokens": 5,
            "total_tokens": 35,
            "prompt_tokens_details": {"cached_tokens": 20},
        },
        "timings": {"tps_ewma": 42.5, "cache_n": 20, "predicted_per_second": 41.0},
    }
    return lambda req, body: httpx.Response(200, json=data, headers=headers or {})


def model_for(fs: FakeServer, **kw: Any) -> ChatPolyKV:
    return ChatPolyKV(
        base_url="http://polykv.test", transport=httpx.MockTransport(fs), pool_id=4, session_id="s1", **kw
    )


def test_chat_model_request_and_metadata() -> None:
    fs = FakeServer()
    fs.on("POST", "/v1/chat/completions", chat_response("hello", headers={"X-Sessions-Remaining": "3"}))
    llm = model_for(fs, temperature=0, max_tokens=16, overcommit=True, stop=["END"])
    out = llm.invoke([SystemMessage("sys"), HumanMessage("hi")])
    body = fs.bodies()[0]
    assert body["pool_id"] == 4 and body["session_id"] == "s1" and body["overcommit"] is True
    assert body["temperature"] == 0 and body["max_tokens"] == 16 and body["stop"] == ["END"]
    assert body["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert out.content == "hello"
    assert out.usage_metadata["input_token_details"]["cache_read"] == 20
    md = out.response_metadata
    assert md["pool_id"] == 4 and md["session_tps"] == 42.5 and md["model_provider"] == "polykv"
    assert md["backpressure"] == {"sessions_remaining": 3} and md["timings"]["cache_n"] == 20


def test_chat_model_tool_calls_and_history() -> None:
    fs = FakeServer()
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    fs.on("POST", "/v1/chat/completions", chat_response("", calls, "tool_calls"))

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = model_for(fs).bind_tools([add], tool_choice="any")
    out = llm.invoke("1+2?")
    assert out.tool_calls == [{"name": "add", "args": {"a": 1, "b": 2}, "id": "call_1", "type": "tool_call"}]
    body = fs.bodies()[0]
    assert body["tool_choice"] == "required" and body["tools"][0]["function"]["name"] == "add"
    # A tool round trip is sent back in OpenAI's shapes.
    model_for(fs).invoke([HumanMessage("1+2?"), out, ToolMessage("3", tool_call_id="call_1")])
    hist = fs.bodies()[1]["messages"]
    assert hist[1]["tool_calls"][0]["function"]["name"] == "add" and hist[2] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "3",
    }


def sse(*chunks: dict) -> Handler:
    lines = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return lambda req, body: httpx.Response(200, text=lines, headers={"Content-Type": "text/event-stream"})


def test_chat_model_stream_reassembles_text_and_tool_calls() -> None:
    base = {"id": "c", "model": "smol", "object": "chat.completion.chunk"}
    fs = FakeServer()
    fs.on(
        "POST",
        "/v1/chat/completions",
        sse(
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": "call_9",
                                    "type": "function",
                                    "function": {"name": "f", "arguments": ""},
                                }
                            ]
                        },
                        "finish_reason": None,
                    }
                ],
            },
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]},
                        "finish_reason": None,
                    }
                ],
            },
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                        "finish_reason": None,
                    }
                ],
            },
            {
                **base,
                "pool_id": 4,
                "timings": {"tps_ewma": 9.0},
                "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
            },
            {
                **base,
                "choices": [],
                "usage": {
                    "prompt_tokens": 3,
                    "completion_tokens": 4,
                    "total_tokens": 7,
                    "prompt_tokens_details": {"cached_tokens": 1},
                },
            },
        ),
    )
    full = None
    for chunk in model_for(fs).stream("hi"):
        full = chunk if full is None else full + chunk
    assert full.content == "Hello"
    assert full.tool_calls == [{"name": "f", "args": {"x": 1}, "id": "call_9", "type": "tool_call"}]
    assert full.usage_metadata["total_tokens"] == 7 and full.usage_metadata["input_token_details"]["cache_read"] == 1
    assert full.response_metadata["finish_reason"] == "tool_calls" and full.response_metadata["session_tps"] == 9.0


def test_chat_model_retries_429_then_raises() -> None:
    fs = FakeServer()
    fs.on("POST", "/v1/chat/completions", err(429, "pool_saturated_error", "full", {"Retry-After": "0"}))
    with pytest.raises(PoolSaturatedError):
        model_for(fs, max_retries=2).invoke("hi")
    assert len(fs.bodies()) == 3


def capacity(ok: bool, **kw: Any) -> Handler:
    return lambda req, body: httpx.Response(
        200,
        json={
            "can_admit": ok,
            "reason": "ok" if ok else "projected mean tps below floor",
            "headroom_sessions": 5 if ok else 0,
            "mean_active_tps": 30.0,
            **kw,
        },
    )


def test_capacity_gate_routes() -> None:
    fs = FakeServer()
    fs.on("GET", "/polykv/pools/4/capacity", capacity(True))
    gate = capacity_gate(fs.client(), spawn="spawn", hold="hold", reserve=False)
    cmd = gate({"pool_id": 4})
    assert isinstance(cmd, Command) and cmd.goto == "spawn"
    assert (
        cmd.update["capacity_ok"] is True
        and cmd.update["headroom_sessions"] == 5
        and cmd.update["mean_active_tps"] == 30.0
    )
    fs.on("GET", "/polykv/pools/4/capacity", capacity(False))
    assert gate({"pool_id": 4}).goto == "hold"


def test_capacity_gate_waits_for_settle() -> None:
    fs = FakeServer()
    answers = iter([capacity(False, settling=True, settle_remaining_ms=10), capacity(True)])
    fs.on("GET", "/polykv/pools/4/capacity", lambda r, b: next(answers)(r, b))
    cmd = capacity_gate(
        fs.client(), spawn="go", hold="wait", pool_id=4, wait_for_capacity=True, poll_s=0.01, reserve=False
    )({})
    assert cmd.goto == "go" and len(fs.requests) == 2


def test_capacity_reducer_keeps_latest() -> None:
    assert capacity_reducer({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}
    assert capacity_reducer({"a": 1}, None) == {"a": 1}


def test_tools_answer_errors_as_data() -> None:
    fs = FakeServer()
    fs.on("DELETE", "/polykv/pools/4", err(409, "conflict_error", "pool 4 has children [5]"))
    fs.on("GET", "/polykv/pools/4/capacity", capacity(True))
    tools = {t.name: t for t in make_pool_tools(fs.client())}
    assert set(tools) == {"create_pool", "fork_pool", "pool_status", "session_tps", "capacity", "release_pool"}
    assert tools["release_pool"].invoke({"pool_id": 4})["error"]["status"] == 409
    assert tools["capacity"].invoke({"pool_id": 4})["can_admit"] is True


class FakeSummarizer(ChatPolyKV):
    def served_model(self) -> str:
        return "fake"

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any
    ) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=AIMessage("they discussed X"))])


def session_capacity(pressure: float, used: int, headroom: int = 1000, server_wide: float = 0.1) -> Handler:
    return lambda req, body: httpx.Response(
        200,
        json={
            "can_admit": True,
            "compaction_pressure": server_wide,
            "session_pressure": pressure,
            "session": {"ctx_used": used, "ctx_headroom_tokens": headroom, "ctx_pressure": pressure},
        },
    )


def compaction_server() -> FakeServer:
    fs = FakeServer()
    fs.on(
        "GET",
        "/polykv/pools/4",
        lambda r, b: httpx.Response(200, json={"pool_id": 4, "prefix_len": 12, "children": [5]}),
    )
    fs.on("GET", "/polykv/pools/5", lambda r, b: httpx.Response(200, json={"pool_id": 5, "children": []}))
    fs.on("GET", "/polykv/pools/6", lambda r, b: httpx.Response(200, json={"pool_id": 6, "children": []}))
    fs.on("POST", "/polykv/pools/4/fork", lambda r, b: httpx.Response(201, json={"pool_id": 6, "prefix_len": 40}))
    fs.on("DELETE", "/polykv/pools/5", lambda r, b: httpx.Response(200, json={"released": True}))
    fs.on("DELETE", "/polykv/pools/6", lambda r, b: httpx.Response(200, json={"released": True}))
    fs.on("POST", "/tokenize", lambda r, b: httpx.Response(200, json={"tokens": [1] * 10}))
    return fs


def test_compaction_node_reroots_and_releases() -> None:
    fs = compaction_server()
    fs.on("GET", "/polykv/pools/5/capacity", session_capacity(0.93, 900, 60))
    node = CompactionNode(FakeSummarizer(), fs.client(), threshold=0.8, keep_last=1)
    state = {"pool_id": 5, "system_pool_id": 4, "session_id": "s1",
             "messages": [SystemMessage("sys"), HumanMessage("a"), AIMessage("b"), HumanMessage("c")]}
    update = node(state)
    assert fs.requests[0][3] == {"session_id": "s1"}  # the session's own pressure is asked for
    fork = [r for r in fs.requests if r[1] == "/polykv/pools/4/fork"][0][2]
    assert fork["branch_pos"] == 12 and fork["messages"][0] == {"role": "system", "content": "sys"}
    assert "they discussed X" in fork["messages"][1]["content"]
    assert update["pool_id"] == 6 and update["compaction"]["released"] == [5]
    assert update["compaction"]["ctx_before"] == 900 and update["compaction"]["ctx_after"] == 40 + 10
    kept = update["messages"][1:]
    assert [m.content for m in kept][-1] == "c" and kept[0].content == "sys"
    # Below the threshold it does nothing.
    fs.on("GET", "/polykv/pools/5/capacity", session_capacity(0.1, 90))
    assert node(state) == {}


def test_compaction_reads_the_sessions_own_pressure_not_the_servers() -> None:
    """Issue 13: a busy server (server-wide pressure 0.95) with a short conversation."""
    fs = compaction_server()
    fs.on("GET", "/polykv/pools/5/capacity", session_capacity(0.05, 60, 1100, server_wide=0.95))
    node = CompactionNode(FakeSummarizer(), fs.client(), threshold=0.3)
    state = {
        "pool_id": 5,
        "system_pool_id": 4,
        "session_id": "s1",
        "messages": [SystemMessage("sys"), HumanMessage("a")],
    }
    assert node(state) == {}
    # No session: nothing to measure, nothing fires (the server-wide figure is not the session's).
    assert node({**state, "session_id": None}) == {}


def test_compaction_hysteresis_never_twice_without_growth() -> None:
    fs = compaction_server()
    fs.on("GET", "/polykv/pools/5/capacity", session_capacity(0.9, 900, 100))
    node = CompactionNode(FakeSummarizer(), fs.client(), threshold=0.3, keep_last=1)
    msgs = [SystemMessage("sys"), HumanMessage("a"), AIMessage("b"), HumanMessage("c")]
    state = {"pool_id": 5, "system_pool_id": 4, "session_id": "s1", "messages": msgs}
    first = node(state)
    assert first["compaction"]["count"] == 1 and first["compaction"]["ctx_after"] == 50
    state = {**state, "pool_id": 6, "compaction": first["compaction"]}
    # Called again before the session ran on the new pool: its stale context is no growth.
    stale = session_capacity(0.9, 900, 100)
    fs.on("GET", "/polykv/pools/6/capacity", lambda r, b: httpx.Response(200, json={**stale(r, b).json(), "session": {
        "ctx_used": 900, "ctx_headroom_tokens": 100, "ctx_pressure": 0.9, "pool_id": 5}}))
    assert node(state) == {}
    # Still over the threshold right after (a long summary, say): no second compaction
    # until the session grew by half of what the first one freed (900 -> 50: 425 tokens).
    for used in (50, 120, 470):
        fs.on("GET", "/polykv/pools/6/capacity", session_capacity(0.5, used))
        assert node(state) == {}, used
    fs.on("GET", "/polykv/pools/6/capacity", session_capacity(0.6, 480))
    second = node(state)
    assert second["compaction"]["count"] == 2 and second["compaction"]["released"] == [6]


def test_capacity_gate_interrupt_blocks_until_resumed() -> None:
    from typing import TypedDict

    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph

    class S(TypedDict, total=False):
        pool_id: int
        capacity_ok: bool
        headroom_sessions: int
        mean_active_tps: float
        capacity: dict
        route: str

    fs = FakeServer()
    answers = [capacity(False), capacity(True)]
    fs.on(
        "GET", "/polykv/pools/4/capacity", lambda r, b: answers.pop(0)(r, b) if len(answers) > 1 else answers[0](r, b)
    )
    g = StateGraph(S)
    g.add_node("gate", capacity_gate(fs.client(), spawn="spawn", hold="hold", use_interrupt=True, reserve=False))
    g.add_node("spawn", lambda s: {"route": "spawn"})
    g.add_node("hold", lambda s: {"route": "hold"})
    g.add_edge(START, "gate")
    g.add_edge("spawn", END)
    g.add_edge("hold", END)
    graph = g.compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t1"}}
    first = graph.invoke({"pool_id": 4}, cfg)
    assert "__interrupt__" in first and first["__interrupt__"][0].value["reason"] == "projected mean tps below floor"
    resumed = graph.invoke(Command(resume=True), cfg)  # capacity came back meanwhile
    assert resumed["route"] == "spawn" and resumed["capacity_ok"] is True


def reservation_server(limit: int) -> FakeServer:
    """A fake pool that grants at most `limit` reservations at once (the real server
    decides them one at a time on its engine goroutine)."""
    fs = FakeServer()
    fs.limit = limit

    def reserve(req: httpx.Request, body: Any) -> httpx.Response:
        if len(fs.granted) < fs.limit:
            rid = f"rsv-{len(fs.granted)}"
            fs.granted.append(rid)
            return httpx.Response(
                200,
                json={
                    "granted": True,
                    "reservation_id": rid,
                    "verdict": {"can_admit": True, "reason": "guaranteed minimum"},
                },
            )
        return httpx.Response(
            200,
            json={
                "granted": False,
                "reservation_id": None,
                "verdict": {
                    "can_admit": False,
                    "reason": "measurement settling",
                    "settling": True,
                    "settle_remaining_ms": 0,
                },
            },
        )

    fs.on("POST", "/polykv/pools/4/reservations", reserve)
    return fs


def fanout_graph(gate: Any) -> Any:
    import operator
    from typing import Annotated, TypedDict

    from langgraph.graph import START, StateGraph
    from langgraph.types import Send

    class Main(TypedDict, total=False):
        pool_id: int
        spawned: Annotated[list, operator.add]
        held: Annotated[list, operator.add]

    g = StateGraph(Main)
    g.add_node("gate", gate)
    g.add_node("agent", lambda s: {"spawned": [(s["index"], s["reservation_id"])]})
    g.add_node("held", lambda s: {"held": [s["index"]]})
    g.add_conditional_edges(START, lambda s: [Send("gate", {"pool_id": s["pool_id"], "index": i}) for i in range(6)])
    return g


def test_capacity_gate_reserves_so_a_send_fanout_cannot_overshoot() -> None:
    fs = reservation_server(limit=2)
    out = (
        fanout_graph(capacity_gate(fs.client(), spawn="agent", hold="held", send=True)).compile().invoke({"pool_id": 4})
    )
    assert len(out["spawned"]) == 2 and len(out["held"]) == 4
    # Each spawned branch carries its own reservation, to send with its first request.
    assert sorted(r for _, r in out["spawned"]) == ["rsv-0", "rsv-1"]
    assert len(fs.bodies("/polykv/pools/4/reservations")) == 6 and not fs.bodies("/polykv/pools/4/capacity")
    assert fs.bodies("/polykv/pools/4/reservations")[0] == {"ttl_ms": 30000}


def test_several_interrupted_gates_resume_at_once() -> None:
    """Four branches held by use_interrupt resume with one Command(resume={id: ...})."""
    from langgraph.checkpoint.memory import InMemorySaver

    fs = reservation_server(limit=2)
    gate = capacity_gate(fs.client(), spawn="agent", hold="held", send=True, use_interrupt=True)
    graph = fanout_graph(gate).compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "fan"}}
    first = graph.invoke({"pool_id": 4}, cfg)
    pending = graph.get_state(cfg).interrupts
    assert len(first["__interrupt__"]) == 4 and len(pending) == 4
    assert {i.value["reason"] for i in pending} == {"measurement settling"}
    fs.limit = 6  # capacity came back: the first agents finished
    out = graph.invoke(Command(resume={i.id: True for i in pending}), cfg)
    assert len(out["spawned"]) == 6 and not out.get("held")
    assert sorted(r for _, r in out["spawned"]) == sorted(fs.granted)


def test_api_key_is_sent_from_argument_or_env_and_401_is_typed(monkeypatch: MonkeyPatch) -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != "Bearer k1":
            return httpx.Response(
                401, json={"error": {"code": 401, "type": "authentication_error", "message": "Invalid API Key"}}
            )
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "smol"}]})
        return (
            chat_response("hi")(request, None)
            if request.url.path == "/v1/chat/completions"
            else httpx.Response(200, json={"pools": []})
        )

    monkeypatch.delenv("POLYKV_API_KEY", raising=False)
    PolyKVClient("http://polykv.test", transport=httpx.MockTransport(handler), api_key="k1").pools()
    assert seen[-1] == "Bearer k1"
    monkeypatch.setenv("POLYKV_API_KEY", "k1")
    PolyKVClient("http://polykv.test", transport=httpx.MockTransport(handler)).pools()
    assert seen[-1] == "Bearer k1"
    with pytest.raises(AuthenticationError) as e:
        PolyKVClient("http://polykv.test", transport=httpx.MockTransport(handler), api_key="").pools()
    assert seen[-1] is None and e.value.status == 401
    monkeypatch.delenv("POLYKV_API_KEY")
    llm = ChatPolyKV(base_url="http://polykv.test", transport=httpx.MockTransport(handler), api_key="k1", max_retries=0)
    assert llm.invoke("hello").content == "hi"
    assert seen[-1] == "Bearer k1"
    assert "k1" not in repr(llm)  # a SecretStr: logs and tracebacks do not show the key
    with pytest.raises(AuthenticationError):
        ChatPolyKV(
            base_url="http://polykv.test", transport=httpx.MockTransport(handler), api_key="wrong", max_retries=0
        ).invoke("x")
