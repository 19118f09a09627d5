"""Issue 13 against live servers: live async streaming, a Send fan-out behind
reservations, and compaction on the session's own pressure."""
import operator
import threading
import time
from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import START, StateGraph
from langgraph.types import Send
from typing_extensions import Annotated, TypedDict

from polykv_langgraph import ChatPolyKV, CompactionNode, PolyKVClient, capacity_gate

SYSTEM = "You are one of several worker agents. Answer in one short sentence."


async def test_astream_first_chunk_arrives_well_before_the_last(server: str) -> None:
    llm = ChatPolyKV(base_url=server, temperature=0, max_tokens=64)
    t0 = time.monotonic()
    stamps = []
    async for chunk in llm.astream("Tell me a long story about a lighthouse.", ignore_eos=True):
        if chunk.content:
            stamps.append(time.monotonic() - t0)
    assert len(stamps) >= 32, len(stamps)
    first, last = stamps[0], stamps[-1]
    # Tokens arrive as they are decoded: the first long before the last (a buffered
    # reply would deliver them all at the end, within a few milliseconds).
    assert first < 0.5 * last and last - first > 0.2, (first, last)


class CountingClient(PolyKVClient):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.reserve_calls = 0
        self._lock = threading.Lock()

    def reserve(self, *a: Any, **kw: Any) -> dict:
        with self._lock:
            self.reserve_calls += 1
        return super().reserve(*a, **kw)


def test_send_fanout_behind_reservations_never_overshoots(server: str) -> None:
    """6 concurrent Send branches against a pool whose policy allows 2 sessions: at most 2
    agents run at once, the others hold in their gate and spawn as capacity returns."""
    client = CountingClient(server)
    with client:
        pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
        pid = pool["pool_id"]
        client.set_admission(pid, target_tps_per_session=1e6, mode="enforced", guarantee_min_sessions=2,
                             settle_tokens=4, settle_max_ms=500)
        running, peak, lock = [0], [0], threading.Lock()

        class Main(TypedDict, total=False):
            pool_id: int
            done: Annotated[list, operator.add]
            held: Annotated[list, operator.add]

        def agent(state: dict) -> dict:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            try:
                # Anonymous agents: their sequence (and pool place) is freed when they end.
                llm = ChatPolyKV(base_url=server, pool_id=pid, temperature=0, max_tokens=12, max_retries=0, timeout=600)
                msg = llm.invoke([SystemMessage(SYSTEM), HumanMessage(f"Worker {state['index']}: name a number.")],
                                 ignore_eos=True, reservation_id=state["reservation_id"])
            finally:
                with lock:
                    running[0] -= 1
            return {"done": [(state["index"], msg.response_metadata["backpressure"], bool(msg.content))]}

        g = StateGraph(Main)
        # A held branch goes back to its gate in the next superstep (after the agents
        # granted in this one have run), so it spawns as capacity returns.
        g.add_node("gate", capacity_gate(client, spawn="agent", hold="gate", send=True, hold_delay_s=0.1))
        g.add_node("agent", agent)
        g.add_conditional_edges(
            START, lambda s: [Send("gate", {"pool_id": s["pool_id"], "index": i}) for i in range(6)]
        )
        out = g.compile().invoke({"pool_id": pid}, {"recursion_limit": 200})
        assert peak[0] <= 2, f"{peak[0]} agents ran at once; the pool admits 2"
        assert sorted(i for i, _, _ in out["done"]) == list(range(6)) and not out.get("held")
        assert all(ok for _, _, ok in out["done"])
        assert client.reserve_calls > 6  # the held branches asked again until capacity returned
        client.set_admission(pid, mode="advisory")


def test_compaction_ignores_a_busy_neighbour(compact_server: str) -> None:
    with PolyKVClient(compact_server) as client:
        # A neighbour session holds most of the cache, idle between its turns.
        hog = ChatPolyKV(base_url=compact_server, session_id="hog", temperature=0, max_tokens=1)
        hog.invoke("word " * 650)
        sys_pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
        msgs = [SystemMessage(SYSTEM), HumanMessage("Hi, what is 2+2?")]
        llm = ChatPolyKV(
            base_url=compact_server, pool_id=sys_pool["pool_id"], session_id="chat", temperature=0, max_tokens=16
        )
        reply = llm.invoke(msgs)
        state = {
            "messages": msgs + [reply],
            "pool_id": sys_pool["pool_id"],
            "system_pool_id": sys_pool["pool_id"],
            "session_id": "chat",
        }
        cap = client.capacity(sys_pool["pool_id"], session_id="chat")
        assert cap["compaction_pressure"] > 0.6, cap  # the server is busy...
        assert cap["session_pressure"] < 0.15, cap  # ...but this conversation is short
        assert reply.response_metadata["context_pressure"] < 0.15
        summariser = ChatPolyKV(base_url=compact_server, temperature=0, max_tokens=32)
        assert CompactionNode(summariser, client, threshold=0.3)(state) == {}


def test_a_conversation_that_fills_its_context_compacts_once_and_continues(compact_server: str) -> None:
    with PolyKVClient(compact_server) as client:
        sys_pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
        state = {
            "messages": [SystemMessage(SYSTEM)],
            "pool_id": sys_pool["pool_id"],
            "system_pool_id": sys_pool["pool_id"],
            "session_id": "filler",
            "compaction": {},
        }
        summariser = ChatPolyKV(base_url=compact_server, temperature=0, max_tokens=48, timeout=600)
        # Each turn adds ~10% of the context: it crosses 0.6 after ~6 turns; the compacted
        # context (system, summary, last 2 messages) has room for two more turns.
        node = CompactionNode(summariser, client, threshold=0.6, keep_last=2)
        filler = " ".join(f"Fact {i}: the meeting room {i} has {i + 3} chairs." for i in range(6))
        compactions, turns_after, pressures = 0, 0, []
        for turn in range(14):
            update = node(state)
            if update:
                compactions += 1
                state = {
                    **state,
                    "pool_id": update["pool_id"],
                    "messages": update["messages"][1:],
                    "compaction": update["compaction"],
                }
                # Never twice in a row without growth: asked again at once, it holds.
                assert node(state) == {}
            llm = ChatPolyKV(
                base_url=compact_server,
                pool_id=state["pool_id"],
                session_id="filler",
                temperature=0,
                max_tokens=24,
                timeout=600,
            )
            ask = HumanMessage(f"Turn {turn}. {filler} How many chairs are in room {turn}?")
            reply = llm.invoke(state["messages"] + [ask], ignore_eos=True)
            assert reply.content
            pressures.append(reply.response_metadata["context_pressure"])
            state = {**state, "messages": state["messages"] + [ask, reply]}
            if compactions:
                turns_after += 1
                if turns_after == 2:
                    break
        assert compactions == 1, (compactions, pressures)
        assert turns_after == 2  # the conversation went on after its compaction
        assert max(pressures) >= 0.6 and pressures[-2] < max(pressures), pressures
        # The conversation moved to a fork of the system pool (system + summary); the
        # system pool itself was its working pool, so nothing was released.
        assert state["pool_id"] == state["compaction"]["new_pool"] != sys_pool["pool_id"]
        assert client.pool(state["pool_id"])["parent"] == sys_pool["pool_id"] and state["compaction"]["released"] == []
