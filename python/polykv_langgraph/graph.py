"""LangGraph nodes: a capacity gate for spawning sub-agents, and state reducers."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from langgraph.types import Command, Send, interrupt

from .client import PolyKVClient


def capacity_reducer(old: Optional[dict], new: Optional[dict]) -> Optional[dict]:
    """Reducer for a ``capacity`` state key: the newest live reading wins, keeping what it lacks."""
    if new is None:
        return old
    return {**(old or {}), **new}


def _summary(cap: dict) -> dict:
    return {
        "capacity_ok": bool(cap.get("can_admit")),
        "headroom_sessions": cap.get("headroom_sessions", 0),
        "mean_active_tps": cap.get("mean_active_tps"),
    }


def capacity_gate(client: PolyKVClient, *, spawn: str, hold: str, pool_id: Optional[int] = None,
                  pool_key: str = "pool_id", expected_tokens: Optional[int] = None,
                  wait_for_capacity: bool = False, use_interrupt: bool = False, poll_s: float = 0.5,
                  max_wait_s: float = 60.0, capacity_key: Optional[str] = "capacity",
                  send: bool = False) -> Callable[[dict], Command]:
    """Build a node that reads the pool's ``/capacity`` and routes to ``spawn`` or
    ``hold`` with ``Command(update={"capacity_ok", "headroom_sessions", "mean_active_tps"})``.

    The pool comes from ``pool_id`` or from ``state[pool_key]``. ``wait_for_capacity``
    polls (honouring the server's settle clock) until admission is possible or
    ``max_wait_s`` passes; ``use_interrupt`` pauses the graph with ``interrupt()`` instead,
    to be resumed when the orchestrator decides. ``capacity_key`` also stores the whole
    reading in state (pair it with ``capacity_reducer``). ``send=True`` routes with
    ``Send(target, state + update)``, so a gate reached through ``Send`` (one branch per
    sub-agent) hands its branch's own state on instead of the shared graph state.
    """

    def node(state: dict) -> Command:
        pid = pool_id if pool_id is not None else state[pool_key]
        cap = client.capacity(pid, expected_tokens=expected_tokens)
        deadline = time.monotonic() + max_wait_s
        while not cap.get("can_admit") and wait_for_capacity and time.monotonic() < deadline:
            wait = max(poll_s, cap.get("settle_remaining_ms", 0) / 1000) if cap.get("settling") else poll_s
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            cap = client.capacity(pid, expected_tokens=expected_tokens)
        if not cap.get("can_admit") and use_interrupt:
            interrupt({"reason": cap.get("reason"), "pool_id": pid, "capacity": cap})
            cap = client.capacity(pid, expected_tokens=expected_tokens)
        update: dict[str, Any] = _summary(cap)
        if capacity_key:
            update[capacity_key] = cap
        target = spawn if cap.get("can_admit") else hold
        if send:
            return Command(goto=Send(target, {**state, **update}))
        return Command(update=update, goto=target)

    return node
