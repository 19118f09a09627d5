"""Compaction by re-fork (design §13.2): a prompt rewrite, never an in-place KV edit."""

from __future__ import annotations

from typing import Any, Optional

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, RemoveMessage, SystemMessage, convert_to_openai_messages
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from .client import PolyKVClient

SUMMARY_PREFIX = "[Summary of the conversation so far] "


class CompactionNode:
    """Watches context pressure and, past ``threshold``, summarises the conversation
    through ``model``, forks the stable system pool (``state[system_pool_key]``, whose
    prefix is the rendered system message) with system + summary, swaps
    ``state[pool_key]`` to the new pool, trims ``messages`` to system + summary + the
    last ``keep_last`` messages, and releases the old working subtree.

    Usable as a graph node or as a ``pre_model_hook``: it returns a state update, empty
    when nothing needs doing. Pressure is the server's ``compaction_pressure`` (0..1) or,
    when ``session_id`` is known, the session's context headroom under ``min_headroom``.
    """

    def __init__(self, model: BaseChatModel, client: PolyKVClient, *, threshold: float = 0.8, min_headroom: int = 256,
                 keep_last: int = 2, pool_key: str = "pool_id", system_pool_key: str = "system_pool_id",
                 session_key: Optional[str] = "session_id", summary_prompt: Optional[str] = None):
        self.model, self.client = model, client
        self.threshold, self.min_headroom, self.keep_last = threshold, min_headroom, keep_last
        self.pool_key, self.system_pool_key, self.session_key = pool_key, system_pool_key, session_key
        self.summary_prompt = summary_prompt or "Summarise the conversation above in a few sentences, keeping facts, decisions and open tasks."

    def pressure(self, state: dict) -> tuple[bool, dict]:
        cap = self.client.capacity(state[self.pool_key])
        info = {"compaction_pressure": cap.get("compaction_pressure", 0.0)}
        session = state.get(self.session_key) if self.session_key else None
        if session:
            s = self.client.session_tps(session)
            if s is not None:
                info["ctx_headroom_tokens"] = s.get("ctx_headroom_tokens")
        low_headroom = info.get("ctx_headroom_tokens") is not None and info["ctx_headroom_tokens"] < self.min_headroom
        return info["compaction_pressure"] >= self.threshold or low_headroom, info

    def __call__(self, state: dict) -> dict:
        needed, info = self.pressure(state)
        if not needed:
            return {}
        return self.compact(state, info)

    def compact(self, state: dict, info: Optional[dict] = None) -> dict:
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
        update: dict[str, Any] = {
            self.pool_key: new["pool_id"],
            "messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), system, summary_msg, *tail],
            "compaction": {"new_pool": new["pool_id"], "released": released, "prefix_len": new["prefix_len"], **(info or {})},
        }
        return update
