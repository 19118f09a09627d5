"""Fan-out with LangGraph on PolyKV.

A main agent runs on a root pool (its system prompt and tools, prefilled once). It
nests a task pool (fork with D == parent.L: system + the task) and spawns N sub-agents
with ``Send``; each passes the capacity gate before it runs, attached to the task pool,
so it prefills only its own question. At the end the pool tree and every agent's
experienced tps are printed.

    python examples/fanout.py --base-url http://127.0.0.1:8080 --agents 4
    python examples/fanout.py --start-server   # starts bin/polykv on the test model
"""

from __future__ import annotations

import argparse
import operator
import sys
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage, convert_to_openai_messages
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from polykv_langgraph import ChatPolyKV, PolyKVClient, capacity_gate, capacity_reducer  # noqa: E402
from polykv_langgraph.local_server import LocalServer  # noqa: E402

SYSTEM = (
    "You are the lead of a research team. Tools: search(query), summarise(text), cite(source). "
    "Sub-agents answer one question each, in one or two sentences."
)
TASK = "Task: prepare a short briefing about the planet Mars."
QUESTIONS = [
    "How far is Mars from the Sun?",
    "What is the surface of Mars like?",
    "Does Mars have moons?",
    "Could humans live on Mars?",
    "What colour is Mars and why?",
    "How long is a day on Mars?",
]


class Main(TypedDict, total=False):
    task_pool: int
    results: Annotated[list, operator.add]


def _last(_old: Any, new: Any) -> Any:
    return new


class Sub(TypedDict, total=False):
    task_pool: int
    question: str
    index: int
    # Sub-agents run in parallel branches: the gate's readings need a reducer.
    capacity_ok: Annotated[bool, _last]
    headroom_sessions: Annotated[int, _last]
    mean_active_tps: Annotated[float, _last]
    capacity: Annotated[dict, capacity_reducer]
    reservation_id: Annotated[str, _last]
    results: Annotated[list, operator.add]


def build(base_url: str, client: PolyKVClient, n: int) -> Any:
    system = SystemMessage(SYSTEM)
    task = HumanMessage(TASK)

    def plan(state: Main) -> dict:
        root = client.create_pool(messages=convert_to_openai_messages([system]))
        # Nesting: the task pool extends the root (D == root.L) with the task message.
        child = client.fork_pool(
            root["pool_id"], root["prefix_len"], messages=convert_to_openai_messages([system, task])
        )
        return {"task_pool": child["pool_id"]}

    def fan_out(state: Main) -> list[Send]:
        return [
            Send("gate", {"task_pool": state["task_pool"], "question": q, "index": i})
            for i, q in enumerate(QUESTIONS[:n])
        ]

    # Each branch reserves its place atomically; a held branch re-enters the gate in the
    # next superstep, after the sub-agents granted in this one have run.
    gate = capacity_gate(client, spawn="sub_agent", hold="gate", pool_key="task_pool", send=True, hold_delay_s=0.2)

    def sub_agent(state: Sub) -> dict:
        llm = ChatPolyKV(
            base_url=base_url,
            pool_id=state["task_pool"],
            session_id=f"sub-{state['index']}",
            temperature=0,
            max_tokens=48,
        )
        msg = llm.invoke([system, task, HumanMessage(state["question"])], reservation_id=state["reservation_id"])
        md = msg.response_metadata
        return {
            "results": [
                {
                    "agent": state["index"],
                    "question": state["question"],
                    "answer": msg.content.strip(),
                    "tps": md["session_tps"],
                    "cached": msg.usage_metadata["input_token_details"]["cache_read"],
                    "prompt": msg.usage_metadata["input_tokens"],
                }
            ]
        }

    g = StateGraph(Main)
    g.add_node("plan", plan)
    g.add_node("gate", gate)
    g.add_node("sub_agent", sub_agent)
    g.add_edge(START, "plan")
    g.add_conditional_edges("plan", fan_out, ["gate"])
    g.add_edge("sub_agent", END)
    return g.compile()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--start-server", action="store_true", help="start bin/polykv on the test model for the run")
    args = ap.parse_args()
    server = LocalServer("-c", "4096", "--parallel", str(args.agents)) if args.start_server else None
    base = server.start() if server else args.base_url
    try:
        with PolyKVClient(base) as client:
            out = build(base, client, args.agents).invoke({}, {"recursion_limit": 100})
            for r in sorted(out["results"], key=lambda r: r["agent"]):
                print(f"[sub-{r['agent']}] {r['question']}\n  -> {r['answer']}\n"
                      f"  {r['cached']} of {r['prompt']} prompt tokens from the pool, {r['tps']:.1f} tok/s experienced")
            tree = client.pools()
            print("\npool tree:")
            for p in tree["pools"]:
                indent = "  " * (p["tree_depth"] - 1)
                print(f"{indent}pool {p['pool_id']} (parent {p['parent']}, D={p['branch_pos']}, L={p['prefix_len']}): "
                      f"own {p['own_kv_bytes'] // 1024} KiB, subtree {p['subtree_kv_bytes'] // 1024} KiB, "
                      f"{len(p['sessions'])} sessions, children {p['children']}")
            print(f"KV cells in use: {tree['kv_cells_used']} of {tree['kv_cells_max']}")
    finally:
        if server:
            server.stop()


if __name__ == "__main__":
    main()
