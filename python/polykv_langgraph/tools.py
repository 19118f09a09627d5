"""Pool-control tools, so an agent can manage its own pool tree through ToolNode."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar, Union

from langchain_core.messages import SystemMessage
from langchain_core.tools import BaseTool, StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from .client import PolyKVClient, PolyKVError

F = TypeVar("F", bound=Callable[..., Any])


def bound_tools(model: Any) -> list[dict]:
    """The OpenAI-format tools bound to ``model`` (a ``model.bind_tools(...)`` result, or
    a plain model: none)."""
    tools = (getattr(model, "kwargs", None) or {}).get("tools") or []
    return [t if isinstance(t, dict) and t.get("type") == "function" else convert_to_openai_tool(t) for t in tools]


def create_model_pool(
    client: PolyKVClient, model: Any, system: Union[str, SystemMessage], *, pin: bool = False
) -> dict:
    """Create a root pool holding the prefix that ``ChatPolyKV`` requests of ``model``
    start with: the system message, rendered by the server's chat template together
    with the tools bound to ``model`` (``bind_tools``), exactly as a chat request with
    that system message and those tools renders. Attach the agent with
    ``ChatPolyKV(pool_id=pool["pool_id"], ...)``.

    The server renders ``messages`` with ``tools`` on pool creation exactly as a chat
    request with those tools renders its start, so the whole prefix is shared."""
    text = system.content if isinstance(system, SystemMessage) else system
    tools = bound_tools(model)
    return client.create_pool(messages=[{"role": "system", "content": text}], tools=tools or None, pin=pin)


def _safe(fn: F) -> F:
    """Tools answer errors as data: an agent should read "pool 7 has children", not crash."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PolyKVError as e:
            return {"error": {"status": e.status, "type": e.type, "message": e.message}}

    return wrapper  # type: ignore[return-value]


def make_pool_tools(client: PolyKVClient) -> list[BaseTool]:
    """create_pool, fork_pool, pool_status, session_tps, capacity and release_pool,
    bound to ``client``, for an agent that manages its own pool tree. To create the pool
    a tool-bound agent itself attaches to, use :func:`create_model_pool`."""

    @_safe
    def create_pool(
        prompt: Optional[str] = None,
        system_message: Optional[str] = None,
        from_session: Optional[str] = None,
        pin: bool = False,
    ) -> dict:
        """Create a root pool (a shared prefix other agents can attach to) from raw prompt
        text, a system message (rendered exactly like a chat's start), or a live session."""
        messages = [{"role": "system", "content": system_message}] if system_message is not None else None
        out = client.create_pool(prompt=prompt, messages=messages, from_session=from_session, pin=pin)
        return {k: out[k] for k in ("pool_id", "parent", "branch_pos", "prefix_len", "prefix_hash")}

    @_safe
    def fork_pool(pool_id: int, extra_text: Optional[str] = None, branch_pos: Optional[int] = None,
                  from_session: Optional[str] = None) -> dict:
        """Fork a child pool: by default extend the parent's whole prefix with extra_text
        (nesting for sub-agents); with branch_pos < the parent's length, branch from there."""
        if from_session is not None:
            parent = client.pool(pool_id)
            d = parent["prefix_len"] if branch_pos is None else branch_pos
            out = client.fork_pool(pool_id, d, from_session=from_session)
        else:
            parent = client.pool(pool_id)
            d = parent["prefix_len"] if branch_pos is None else branch_pos
            tail = client.tokenize(extra_text or "", add_special=False)
            out = client.fork_pool(pool_id, d, tokens=parent["tokens"][:d] + tail)
        return {k: out[k] for k in ("pool_id", "parent", "branch_pos", "prefix_len")}

    @_safe
    def pool_status(pool_id: Optional[int] = None) -> dict:
        """The pool tree (or one pool): prefix lengths, KV bytes by ownership, children and attached sessions."""
        if pool_id is None:
            return client.pools()
        out = client.pool(pool_id)
        out.pop("tokens", None)
        return out

    @_safe
    def session_tps(session_id: Optional[str] = None) -> dict:
        """Experienced decode speed: one session's tps, or the server's aggregate and mean."""
        if session_id is not None:
            return client.session_tps(session_id) or {"error": {"message": f"session {session_id!r} holds no sequence"}}
        snap = client.tps()
        return {k: snap[k] for k in ("aggregate_tps", "mean_active_tps", "n_active", "n_warming")}

    @_safe
    def capacity(pool_id: int, expected_tokens: Optional[int] = None) -> dict:
        """Whether the pool can take one more agent: can_admit, reason, projected tps, headroom, context pressure."""
        return client.capacity(pool_id, expected_tokens=expected_tokens)

    @_safe
    def release_pool(pool_id: int) -> dict:
        """Release a pool (children first): no new attaches; its cells are freed once unused."""
        return client.release_pool(pool_id)

    return [
        StructuredTool.from_function(f)
        for f in (create_pool, fork_pool, pool_status, session_tps, capacity, release_pool)
    ]
