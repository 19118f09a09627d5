"""Compaction by re-fork (docs/design.md §13.2): a prompt rewrite, never an in-place KV edit."""

from __future__ import annotations

from typing import Any, Optional

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, RemoveMessage, SystemMessage, convert_to_openai_messages
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from .client import PolyKVClient

SUMMARY_PREFIX = "[Summary of the conversation so far] "


class CompactionNode:
    """Watches the session's own context pressure and, past ``threshold``, summarises
    the conversation through ``model``, forks the stable system pool
    (``state[system_pool_key]``, whose prefix is the rendered system message) with
    system + summary, swaps ``state[pool_key]`` to the new pool, trims ``messages`` to
    system + summary + the last ``keep_last`` messages, and releases the old working
    subtree.

    Pressure is the session's own (``state[session_key]``): ``/capacity?session_id=``'s
    ``session_pressure``, its context against what it can still grow into, with idle
    neighbours' cells and released pools in their grace counted as free. So a busy
    neighbour that is only idle, or the pool the last compaction released, does not make
    a short conversation compact. A session under ``min_headroom`` tokens of headroom
    compacts too. Without a session known to the server nothing fires (the server-wide
    ``compaction_pressure`` is not a session's).

    Hysteresis: after a compaction it does not fire again until the session has grown by
    ``rearm_fraction`` of what the compaction freed (never twice in a row without
    growth), so a summary that is itself long cannot make it compact on every turn. The
    bookkeeping lives in ``state["compaction"]`` (add a ``compaction: dict`` key to the
    graph state).

    Usable as a graph node or as a ``pre_model_hook``: it returns a state update, empty
    when nothing needs doing. Give it a ``model`` that does not use the conversation's
    ``session_id`` (an anonymous one), so the summary call does not overwrite the
    session's cached context.
    """

    def __init__(self, model: BaseChatModel, client: PolyKVClient, *, threshold: float = 0.8, min_headroom: int = 256,
                 keep_last: int = 2, pool_key: str = "pool_id", system_pool_key: str = "system_pool_id",
                 session_key: Optional[str] = "session_id", summary_prompt: Optional[str] = None,
                 rearm_fraction: float = 0.5, state_key: str = "compaction"):
        self.model, self.client = model, client
        self.threshold, self.min_headroom, self.keep_last = threshold, min_headroom, keep_last
        self.pool_key, self.system_pool_key, self.session_key = pool_key, system_pool_key, session_key
        self.rearm_fraction, self.state_key = rearm_fraction, state_key
        self.summary_prompt = (
            summary_prompt
            or "Summarise the conversation above in a few sentences, keeping facts, decisions and open tasks."
        )

    def pressure(self, state: dict) -> tuple[bool, dict]:
        """Whether to compact now, and what the decision read."""
        session = state.get(self.session_key) if self.session_key else None
        info: dict[str, Any] = {"session_id": session}
        if not session:
            info["skipped"] = "no session_id: a session's own pressure needs one"
            return False, info
        cap = self.client.capacity(state[self.pool_key], session_id=session)
        info["compaction_pressure"] = cap.get("compaction_pressure")  # server-wide, for reference only
        ctx = cap.get("session")
        if not ctx:
            info["skipped"] = "the session holds no context on the server"
            return False, info
        used, headroom, pressure = (
            ctx.get("ctx_used", 0),
            ctx.get("ctx_headroom_tokens", 0),
            ctx.get("ctx_pressure", 0.0),
        )
        info.update(ctx_used=used, ctx_headroom_tokens=headroom, session_pressure=pressure)
        over = pressure >= self.threshold or headroom < self.min_headroom
        last = state.get(self.state_key) or {}
        if (
            over
            and last.get("new_pool") is not None
            and ctx.get("pool_id") is not None
            and ctx["pool_id"] != state[self.pool_key]
        ):
            # The session still holds its pre-compaction context (it has not run on the
            # new pool yet): that is not growth.
            info["skipped"] = "hysteresis: the session has not run since the last compaction"
            return False, info
        if over and last.get("ctx_after") is not None and last.get("session_id") == session:
            # Hysteresis: re-armed only once the session grew past what it was right
            # after the last compaction by rearm_fraction of what that compaction freed.
            after, before = int(last["ctx_after"]), int(last.get("ctx_before") or last["ctx_after"])
            need = after + max(1, int(self.rearm_fraction * max(0, before - after)))
            info["rearm_at_ctx_used"] = need
            if used < need:
                info["skipped"] = "hysteresis: no growth since the last compaction"
                return False, info
        return over, info

    def __call__(self, state: dict) -> dict:
        needed, info = self.pressure(state)
        if not needed:
            return {}
        return self.compact(state, info)

    def _tokens(self, messages: list[BaseMessage]) -> int:
        return sum(len(self.client.tokenize(str(m.content))) for m in messages if m.content)

    def compact(self, state: dict, info: Optional[dict] = None) -> dict:
        """Compact now, whatever the pressure."""
        messages: list[BaseMessage] = list(state["messages"])
        system = next((m for m in messages if isinstance(m, SystemMessage)), None)
        if system is None:
            raise ValueError("compaction needs the system message the system pool was built from")
        body = [m for m in messages if m is not system]
        tail = body[-self.keep_last:] if self.keep_last else []
        summary = self.model.invoke(messages + [HumanMessage(self.summary_prompt)]).content
        summary_msg = HumanMessage(SUMMARY_PREFIX + str(summary).strip())
        ancestor = state[self.system_pool_key]
        d_sys = self.client.pool(ancestor)["prefix_len"]
        new = self.client.fork_pool(ancestor, d_sys, messages=convert_to_openai_messages([system, summary_msg]))
        old = state.get(self.pool_key)
        released: list[int] = []
        if old is not None and old != ancestor:
            released = self.client.release_subtree(old)
        info = dict(info or {})
        # What the session will hold right after: the new pool plus the kept tail (an
        # estimate: the tail's template markup is not counted).
        ctx_after = int(new["prefix_len"]) + self._tokens(tail)
        record = {**info, "new_pool": new["pool_id"], "released": released, "prefix_len": new["prefix_len"],
                  "ctx_before": info.get("ctx_used"), "ctx_after": ctx_after,
                  "count": int((state.get(self.state_key) or {}).get("count", 0)) + 1}
        return {
            self.pool_key: new["pool_id"],
            "messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), system, summary_msg, *tail],
            self.state_key: record,
        }
