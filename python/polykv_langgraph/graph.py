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
                  send: bool = False, reserve: bool = True, reservation_ttl_ms: int = 30000,
                  reservation_key: str = "reservation_id", hold_delay_s: float = 0.0) -> Callable[[dict], Command]:
    """Build a node that asks the pool for room for one more agent and routes to
    ``spawn`` or ``hold`` with ``Command(update={"capacity_ok", "headroom_sessions",
    "mean_active_tps", reservation_key})``.

    With ``reserve=True`` (the default) the gate takes an atomic reservation
    (``POST /polykv/pools/{id}/reservations``): every branch of a ``Send`` fan-out runs
    its gate in the same step, and reservations are decided one at a time on the
    server, so no more branches spawn than the pool admits. A granted reservation's id
    is put in state under ``reservation_key``; the spawned agent must send it with its
    first request (``model.invoke(messages, reservation_id=state["reservation_id"])``),
    which is what lets it past an enforced gate. An unused reservation expires after
    ``reservation_ttl_ms``. ``reserve=False`` reads ``/capacity`` only (advisory, racy
    under fan-out).

    Fan-out with ``Send`` (one gate per branch): use ``send=True`` and make the gate its
    own ``hold`` target (``hold="gate"``, with ``hold_delay_s`` so a held branch does not
    spin). A held branch then re-enters the gate in the next superstep, after the agents
    spawned in this one have run and freed their places; it spawns as capacity returns.
    Do not use ``wait_for_capacity`` there: LangGraph starts the next superstep only
    when every branch of this one has finished, so a gate that waits in place also
    keeps the already-granted agents from starting (and their reservations expire).
    Each re-entry is a superstep: raise ``recursion_limit`` for long waits.

    The pool comes from ``pool_id`` or ``state[pool_key]``. ``wait_for_capacity`` asks
    again (honouring the server's settle clock) until granted or ``max_wait_s`` passes;
    ``use_interrupt`` pauses the graph with ``interrupt()`` instead and asks again when
    resumed (an interrupt pauses the whole superstep: granted siblings start only after
    the resume). Several branches held at once each raise their own interrupt; resume them
    all with one ``Command(resume={interrupt.id: value, ...})`` over
    ``graph.get_state(config).interrupts`` (or resume them one by one).
    ``capacity_key`` also stores the whole reading (pair it with ``capacity_reducer``).
    ``send=True`` routes with ``Send(target, state + update)``, so a gate reached
    through ``Send`` hands its branch's own state on.
    """

    def ask(pid: int) -> dict:
        if not reserve:
            return client.capacity(pid, expected_tokens=expected_tokens)
        r = client.reserve(pid, ttl_ms=reservation_ttl_ms, expected_tokens=expected_tokens)
        cap = dict(r.get("verdict") or {})
        cap["can_admit"] = bool(r.get("granted"))
        cap["reservation_id"] = r.get("reservation_id")
        return cap

    def node(state: dict) -> Command:
        pid = pool_id if pool_id is not None else state[pool_key]
        cap = ask(pid)
        deadline = time.monotonic() + max_wait_s
        while not cap.get("can_admit") and wait_for_capacity and time.monotonic() < deadline:
            wait = max(poll_s, cap.get("settle_remaining_ms", 0) / 1000) if cap.get("settling") else poll_s
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            cap = ask(pid)
        if not cap.get("can_admit") and use_interrupt:
            interrupt({"reason": cap.get("reason"), "pool_id": pid, "capacity": cap})
            cap = ask(pid)
        if not cap.get("can_admit") and hold_delay_s > 0:
            time.sleep(hold_delay_s)
        update: dict[str, Any] = _summary(cap)
        if reserve:
            update[reservation_key] = cap.get("reservation_id")
        if capacity_key:
            update[capacity_key] = cap
        target = spawn if cap.get("can_admit") else hold
        if send:
            return Command(goto=Send(target, {**state, **update}))
        return Command(update=update, goto=target)

    return node
