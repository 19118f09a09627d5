"""Live tests against a real polykv server on the tiny model."""
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from typing_extensions import Annotated, TypedDict

from polykv_langgraph import (
    ChatPolyKV,
    CompactionNode,
    PolyKVClient,
    PoolNotFoundError,
    PoolSaturatedError,
    capacity_gate,
    capacity_reducer,
    make_pool_tools,
)

SYSTEM = "You are a careful assistant in a team of agents. Answer briefly."


@pytest.fixture()
def client(server: str) -> Iterator[PolyKVClient]:
    with PolyKVClient(server) as c:
        yield c


def system_pool(client: PolyKVClient, text: str = SYSTEM) -> dict:
    return client.create_pool(messages=[{"role": "system", "content": text}])


def test_chat_model_attaches_to_pool(server: str, client: PolyKVClient) -> None:
    pool = system_pool(client)
    llm = ChatPolyKV(base_url=server, pool_id=pool["pool_id"], session_id="live-1", temperature=0, max_tokens=16)
    out = llm.invoke([SystemMessage(SYSTEM), HumanMessage("Name a colour.")])
    assert out.content
    assert out.usage_metadata["input_token_details"]["cache_read"] >= pool["prefix_len"]
    md = out.response_metadata
    assert md["pool_id"] == pool["pool_id"] and md["model_provider"] == "polykv" and md["session_tps"] > 0
    assert md["timings"]["cache_n"] >= pool["prefix_len"]
    chunks = list(llm.stream([SystemMessage(SYSTEM), HumanMessage("Name a fruit.")]))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content and full.usage_metadata["total_tokens"] > 0
    assert full.response_metadata["finish_reason"] in ("stop", "length")


async def test_chat_model_async(server: str) -> None:
    llm = ChatPolyKV(base_url=server, temperature=0, max_tokens=8)
    out = await llm.ainvoke("Say hi.")
    assert out.content
    parts = [c async for c in llm.astream("Say hello.")]
    assert "".join(p.content for p in parts if isinstance(p.content, str))


def test_bind_tools_and_structured_output(server: str) -> None:
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return "sunny"

    llm = ChatPolyKV(base_url=server, temperature=0, max_tokens=80)
    out = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Rome?")
    assert (
        out.tool_calls
        and out.tool_calls[0]["name"] == "get_weather"
        and isinstance(out.tool_calls[0]["args"]["city"], str)
    )
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        """A short answer."""

        answer: str = Field(max_length=40)
        confident: bool

    for method in ("function_calling", "json_schema"):
        res = llm.with_structured_output(Answer, method=method).invoke("Is water wet?")
        assert isinstance(res, Answer)


def test_pool_tools(server: str, client: PolyKVClient) -> None:
    tools = {t.name: t for t in make_pool_tools(client)}
    root = tools["create_pool"].invoke({"system_message": SYSTEM})
    child = tools["fork_pool"].invoke({"pool_id": root["pool_id"], "extra_text": " Sub-task: list three facts."})
    assert child["parent"] == root["pool_id"] and child["branch_pos"] == root["prefix_len"]
    status = tools["pool_status"].invoke({"pool_id": root["pool_id"]})
    assert status["children"] == [child["pool_id"]] and "tokens" not in status
    assert "can_admit" in tools["capacity"].invoke({"pool_id": child["pool_id"]})
    assert "aggregate_tps" in tools["session_tps"].invoke({})
    assert tools["release_pool"].invoke({"pool_id": root["pool_id"]})["error"]["status"] == 409  # children first
    assert tools["release_pool"].invoke({"pool_id": child["pool_id"]})["released"] is True
    assert tools["release_pool"].invoke({"pool_id": root["pool_id"]})["released"] is True


class GateState(TypedDict, total=False):
    pool_id: int
    capacity_ok: bool
    headroom_sessions: int
    mean_active_tps: float
    capacity: Annotated[dict, capacity_reducer]
    reservation_id: str
    route: str


def gate_graph(client: PolyKVClient) -> Any:
    g = StateGraph(GateState)
    g.add_node("gate", capacity_gate(client, spawn="spawn", hold="hold"))
    g.add_node("spawn", lambda s: {"route": "spawn"})
    g.add_node("hold", lambda s: {"route": "hold"})
    g.add_edge(START, "gate")
    g.add_edge("spawn", END)
    g.add_edge("hold", END)
    return g.compile()


def test_gate_routes_under_enforced_pool(server: str, client: PolyKVClient) -> None:
    pool = system_pool(client, SYSTEM + " Gate test.")
    pid = pool["pool_id"]
    graph = gate_graph(client)
    spawned = graph.invoke({"pool_id": pid})
    assert spawned["route"] == "spawn" and spawned["reservation_id"]  # guaranteed first session, reserved
    client.set_admission(pid, target_tps_per_session=1e6, mode="enforced", on_saturation="reject", settle_tokens=8)
    first = ChatPolyKV(base_url=server, pool_id=pid, session_id="gate-first", max_tokens=200, temperature=0)
    done = threading.Event()
    result = {}

    def run() -> None:
        # The spawned agent's first request uses the gate's reservation.
        result["msg"] = first.invoke(
            [SystemMessage(SYSTEM + " Gate test."), HumanMessage("Count to fifty.")],
            ignore_eos=True,
            reservation_id=spawned["reservation_id"],
        )
        done.set()

    t = threading.Thread(target=run)
    t.start()
    try:
        # Wait until the first session decodes and its settle window closed.
        for _ in range(100):
            cap = client.capacity(pid)
            if cap["n_pool_sessions"] >= 1 and not cap["settling"] and cap.get("mean_active_tps"):
                break
            done.wait(0.1)
        out = graph.invoke({"pool_id": pid})
        assert out["route"] == "hold" and out["capacity_ok"] is False and out["capacity"]["reason"]
        second = ChatPolyKV(base_url=server, pool_id=pid, session_id="gate-second", max_tokens=4, max_retries=0)
        with pytest.raises(PoolSaturatedError) as e:
            second.invoke([SystemMessage(SYSTEM + " Gate test."), HumanMessage("hi")])
        assert e.value.retry_after and e.value.retry_after >= 1
    finally:
        t.join()
    assert result["msg"].content
    client.set_admission(pid, mode="advisory")
    assert client.capacity(pid)["n_pool_sessions"] >= 1


def test_compact_by_refork_end_to_end(server: str, client: PolyKVClient) -> None:
    sys_msg = SystemMessage(SYSTEM + " Compaction test.")
    sys_pool = system_pool(client, sys_msg.content)
    # The working pool: the system block plus the conversation so far.
    convo = [
        sys_msg,
        HumanMessage("We are planning a trip to Rome in May."),
        AIMessage("Great, May is pleasant in Rome."),
        HumanMessage("We like museums and food."),
        AIMessage("Then visit the Vatican Museums and Trastevere."),
    ]
    from langchain_core.messages import convert_to_openai_messages

    work = client.fork_pool(sys_pool["pool_id"], sys_pool["prefix_len"], messages=convert_to_openai_messages(convo))
    llm = ChatPolyKV(base_url=server, pool_id=work["pool_id"], session_id="compact-agent", temperature=0, max_tokens=24)
    turn = llm.invoke(convo + [HumanMessage("What should we eat?")])
    assert turn.usage_metadata["input_token_details"]["cache_read"] >= work["prefix_len"]
    state = {"messages": convo + [HumanMessage("What should we eat?"), turn], "pool_id": work["pool_id"],
             "system_pool_id": sys_pool["pool_id"], "session_id": "compact-agent"}
    node = CompactionNode(ChatPolyKV(base_url=server, temperature=0, max_tokens=48), client, threshold=0.0, keep_last=2)
    update = node(state)  # threshold 0: always compact
    new_pool = update["pool_id"]
    assert new_pool != work["pool_id"] and update["compaction"]["released"] == [work["pool_id"]]
    with pytest.raises(PoolNotFoundError):
        client.pool(work["pool_id"])  # released and reclaimed (grace 0)
    info = client.pool(new_pool)
    assert info["parent"] == sys_pool["pool_id"] and info["branch_pos"] == sys_pool["prefix_len"]
    # The migrated session runs coherently on the new pool and reuses its cells.
    kept = [m for m in update["messages"][1:]]
    llm2 = llm.model_copy(update={"pool_id": new_pool})
    out = llm2.invoke(kept + [HumanMessage("And one museum?")])
    assert out.content
    assert out.usage_metadata["input_token_details"]["cache_read"] >= info["prefix_len"]
    assert out.response_metadata["pool_id"] == new_pool


def test_context_pressure_visible(small_server: str) -> None:
    with PolyKVClient(small_server) as c:
        pool = c.create_pool(messages=[{"role": "system", "content": SYSTEM}])
        llm = ChatPolyKV(
            base_url=small_server, pool_id=pool["pool_id"], session_id="pressure", temperature=0, max_tokens=400
        )
        llm.invoke([SystemMessage(SYSTEM), HumanMessage("Write a long story.")], ignore_eos=True)
        cap = c.capacity(pool["pool_id"], expected_tokens=5000)
        assert cap["can_admit"] is False and cap["reason"] == "context headroom exhausted"
        assert 0.3 < cap["compaction_pressure"] <= 1.0
        s = c.session_tps("pressure")
        assert s["ctx_used"] > 400 and s["ctx_headroom_tokens"] < 1024 - 400
