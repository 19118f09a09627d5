"""HTTP clients for the PolyKV server's pool, capacity and tps routes."""

from __future__ import annotations

import json
import os
from typing import Any, AsyncIterator, Iterator, Sequence

import httpx
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelConnectionError,
    ModelInvalidRequestError,
    ModelRateLimitError,
    ModelTimeoutError,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
API_KEY_ENV = "POLYKV_API_KEY"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header for a server started with ``--api-key``.

    ``api_key`` None falls back to the ``POLYKV_API_KEY`` environment variable (as the
    OpenAI client reads ``OPENAI_API_KEY``); an empty string sends no header.
    """
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class PolyKVError(Exception):
    """An error answered by the server (status, OpenAI-style type and message)."""

    def __init__(self, status: int, message: str, type_: str = "", body: dict | None = None):
        super().__init__(f"{status} {type_}: {message}" if type_ else f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type_
        self.body = body or {}


# Every error is also the matching langchain-core type, so LangChain code that catches
# those (SummarizationMiddleware reacts to ContextOverflowError, retry middleware to
# ModelRateLimitError, ...) works with PolyKV unchanged, and code catching PolyKVError
# keeps working too.


class PoolSaturatedError(PolyKVError, ModelRateLimitError):
    """429: an enforced pool refused a new session. ``retry_after`` is in seconds."""

    def __init__(
        self, status: int, message: str, type_: str = "", body: dict | None = None, retry_after: float | None = None
    ):
        super().__init__(status, message, type_, body)
        self.retry_after = retry_after
        self.capacity = (body or {}).get("error", {}).get("capacity")


class PoolNotFoundError(PolyKVError, ModelInvalidRequestError):
    """404: the pool (or session, or reservation) does not exist or was released."""


class PrefixContractError(PolyKVError, ModelInvalidRequestError):
    """409: a fork's prefix does not match its parent, or the operation's order is wrong."""


class CapacityError(PolyKVError, ModelAPIError):
    """503: sequence ids, queue slots or cells are exhausted (retryable)."""


class AuthenticationError(PolyKVError, ModelAPIError):
    """401: the server wants an API key (``api_key=`` or ``POLYKV_API_KEY``) it did not get."""


class InvalidRequestError(PolyKVError, ModelInvalidRequestError):
    """400: the server refused the request as malformed or out of range."""


class PolyKVContextOverflowError(PolyKVError, ContextOverflowError):
    """400 ``exceed_context_size_error``: the prompt does not fit the server's context."""


class ServerError(PolyKVError, ModelAPIError):
    """5xx other than 503: the server failed."""


class PolyKVConnectionError(PolyKVError, ModelConnectionError):
    """The server could not be reached (after the retries)."""


class PolyKVTimeoutError(PolyKVError, ModelTimeoutError):
    """The request timed out (after the retries)."""


def error_for(status: int, body: Any, text: str = "", retry_after: str | None = None) -> PolyKVError:
    """The typed error for an error response of the server."""
    if not isinstance(body, dict):
        body = {"error": {"message": text}}
    err = body.get("error", {}) if isinstance(body.get("error"), dict) else {}
    msg, typ = err.get("message", text), err.get("type", "")
    if status == 429:
        try:
            ra = float(retry_after) if retry_after else None
        except ValueError:
            ra = None
        return PoolSaturatedError(status, msg, typ, body, retry_after=ra)
    if status == 400 and typ == "exceed_context_size_error":
        return PolyKVContextOverflowError(status, msg, typ, body)
    by_status: dict[int, type[PolyKVError]] = {
        401: AuthenticationError,
        404: PoolNotFoundError,
        409: PrefixContractError,
        503: CapacityError,
    }
    cls = by_status.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else InvalidRequestError if 400 <= status < 500 else PolyKVError
    return cls(status, msg, typ, body)


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
    except ValueError:
        body = None
    raise error_for(resp.status_code, body, resp.text, resp.headers.get("Retry-After"))


def transport_error(e: httpx.TransportError) -> PolyKVError:
    """Map an httpx transport failure to the langchain-core typed error."""
    if isinstance(e, httpx.TimeoutException):
        return PolyKVTimeoutError(0, f"request timed out: {e!r}", "timeout")
    return PolyKVConnectionError(0, f"cannot reach the server: {e!r}", "connection_error")


def _prefix_body(
    tokens: list[int] | None = None,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    from_session: str | None = None,
) -> dict:
    body: dict[str, Any] = {
        k: v
        for k, v in {"tokens": tokens, "prompt": prompt, "messages": messages, "from_session": from_session}.items()
        if v is not None
    }
    if len(body) != 1:
        raise ValueError("give exactly one of tokens, prompt, messages or from_session")
    return body


class _Routes:
    """Request builders shared by the sync and async clients (no I/O here)."""

    @staticmethod
    def create_pool(
        tokens: list[int] | None = None,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        from_session: str | None = None,
        pin: bool = False,
        tools: list[dict] | None = None,
    ) -> tuple[str, str, dict]:
        body = _prefix_body(tokens, prompt, messages, from_session)
        if pin:
            body["pin"] = True
        if tools:
            body["tools"] = tools
        return "POST", "/polykv/pools", body

    @staticmethod
    def fork_pool(
        pool_id: int,
        branch_pos: int,
        tokens: list[int] | None = None,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        from_session: str | None = None,
        pin: bool = False,
    ) -> tuple[str, str, dict]:
        body = _prefix_body(tokens, prompt, messages, from_session)
        body["branch_pos"] = branch_pos
        if pin:
            body["pin"] = True
        return "POST", f"/polykv/pools/{pool_id}/fork", body


    @staticmethod
    def reserve(pool_id: int, ttl_ms: int | None, expected_tokens: int | None) -> tuple[str, str, dict]:
        body = {k: v for k, v in {"ttl_ms": ttl_ms, "expected_tokens": expected_tokens}.items() if v is not None}
        return "POST", f"/polykv/pools/{pool_id}/reservations", body


class PolyKVClient:
    """Synchronous client. Every method raises a PolyKVError subclass on failure."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        timeout: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport,
                                  headers=auth_headers(api_key))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PolyKVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, body: dict | None = None, params: dict | None = None) -> Any:
        resp = self._http.request(method, path, json=body, params=params)
        _raise_for(resp)
        return resp.json()

    # pools
    def create_pool(
        self,
        *,
        tokens: Sequence[int] | None = None,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        from_session: str | None = None,
        pin: bool = False,
        tools: list[dict] | None = None,
    ) -> dict:
        """Create a root pool. ``tools`` (OpenAI format) go with ``messages`` so the pool
        renders like a chat request with those tools."""
        return self._call(
            *_Routes.create_pool(
                list(tokens) if tokens is not None else None, prompt, messages, from_session, pin, tools
            )
        )

    def fork_pool(
        self,
        pool_id: int,
        branch_pos: int,
        *,
        tokens: Sequence[int] | None = None,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        from_session: str | None = None,
        pin: bool = False,
    ) -> dict:
        return self._call(
            *_Routes.fork_pool(
                pool_id, branch_pos, list(tokens) if tokens is not None else None, prompt, messages, from_session, pin
            )
        )

    def pools(self) -> dict:
        return self._call("GET", "/polykv/pools")

    def pool(self, pool_id: int) -> dict:
        return self._call("GET", f"/polykv/pools/{pool_id}")

    def pin(self, pool_id: int) -> dict:
        return self._call("POST", f"/polykv/pools/{pool_id}/pin")

    def unpin(self, pool_id: int) -> dict:
        return self._call("POST", f"/polykv/pools/{pool_id}/unpin")

    def evict(self, pool_id: int) -> dict:
        return self._call("POST", f"/polykv/pools/{pool_id}/evict")

    def flush(self, pool_id: int) -> dict:
        return self._call("POST", f"/polykv/pools/{pool_id}/flush")

    def release_pool(self, pool_id: int) -> dict:
        return self._call("DELETE", f"/polykv/pools/{pool_id}")

    def release_subtree(self, pool_id: int) -> list[int]:
        """Release a pool and all its descendants, leaves first. Returns the ids released."""
        released: list[int] = []
        for child in self.pool(pool_id).get("children", []):
            released += self.release_subtree(child)
        self.release_pool(pool_id)
        return released + [pool_id]

    # admission and speed
    def capacity(self, pool_id: int, *, expected_tokens: int | None = None, session_id: str | None = None) -> dict:
        params = {
            k: v for k, v in {"expected_tokens": expected_tokens, "session_id": session_id}.items() if v is not None
        }
        return self._call("GET", f"/polykv/pools/{pool_id}/capacity", params=params)

    def set_admission(self, pool_id: int, **policy: Any) -> dict:
        return self._call("POST", f"/polykv/pools/{pool_id}/admission", policy)

    def reserve(self, pool_id: int, *, ttl_ms: int | None = None, expected_tokens: int | None = None) -> dict:
        """Atomically reserve one new-session slot of the pool: ``{reservation_id,
        granted, verdict}``. A granted reservation counts as a session until a request
        carrying ``reservation_id`` uses it, it is released, or ``ttl_ms`` passes."""
        return self._call(*_Routes.reserve(pool_id, ttl_ms, expected_tokens))

    def release_reservation(self, pool_id: int, reservation_id: str) -> dict:
        return self._call("DELETE", f"/polykv/pools/{pool_id}/reservations/{reservation_id}")

    def admission(self, pool_id: int) -> dict:
        return self._call("GET", f"/polykv/pools/{pool_id}/admission")

    def tps(self) -> dict:
        return self._call("GET", "/polykv/tps", params={"once": "1"})

    def tps_stream(self, interval_ms: int = 500) -> Iterator[dict]:
        """Yield /polykv/tps snapshots from the SSE stream until the caller stops."""
        with self._http.stream(
            "GET", "/polykv/tps", params={"interval_ms": interval_ms}, headers={"Accept": "text/event-stream"}
        ) as resp:
            _raise_for(resp)
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])

    def session_tps(self, session_id: str) -> dict | None:
        for s in self.tps().get("sessions", []):
            if s.get("session_id") == session_id:
                return s
        return None

    # tokens and server
    def tokenize(self, content: str, add_special: bool = False) -> list[int]:
        return self._call("POST", "/tokenize", {"content": content, "add_special": add_special})["tokens"]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._call("POST", "/detokenize", {"tokens": list(tokens)})["content"]

    def props(self) -> dict:
        return self._call("GET", "/props")

    def slots(self) -> list[dict]:
        return self._call("GET", "/slots")

    def compact_by_refork(self, ancestor_pool: int, branch_pos: int, *, compacted_tokens: Sequence[int] | None = None,
                          compacted_text: str | None = None, release_pool: int | None = None) -> dict:
        """Compaction as a prompt rewrite (docs/design.md §13.2): fork ``ancestor_pool`` at
        ``branch_pos`` (its stable system prefix) with a compacted continuation, then
        release the old working subtree ``release_pool``. The child's full prefix is the
        ancestor's tokens [0, branch_pos) + the compacted tokens. Returns the new pool."""
        if (compacted_tokens is None) == (compacted_text is None):
            raise ValueError("give exactly one of compacted_tokens or compacted_text")
        base = self.pool(ancestor_pool)["tokens"][:branch_pos]
        tail = (
            list(compacted_tokens)
            if compacted_tokens is not None
            else self.tokenize(str(compacted_text), add_special=False)
        )
        new = self.fork_pool(ancestor_pool, branch_pos, tokens=base + tail)
        if release_pool is not None and release_pool != ancestor_pool:
            new["released"] = self.release_subtree(release_pool)
        return new


class AsyncPolyKVClient:
    """Asynchronous twin of PolyKVClient."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        timeout: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, transport=transport,
                                  headers=auth_headers(api_key))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncPolyKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: str, path: str, body: dict | None = None, params: dict | None = None) -> Any:
        resp = await self._http.request(method, path, json=body, params=params)
        _raise_for(resp)
        return resp.json()

    async def create_pool(
        self,
        *,
        tokens: Sequence[int] | None = None,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        from_session: str | None = None,
        pin: bool = False,
        tools: list[dict] | None = None,
    ) -> dict:
        return await self._call(
            *_Routes.create_pool(
                list(tokens) if tokens is not None else None, prompt, messages, from_session, pin, tools
            )
        )

    async def fork_pool(
        self,
        pool_id: int,
        branch_pos: int,
        *,
        tokens: Sequence[int] | None = None,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        from_session: str | None = None,
        pin: bool = False,
    ) -> dict:
        return await self._call(
            *_Routes.fork_pool(
                pool_id, branch_pos, list(tokens) if tokens is not None else None, prompt, messages, from_session, pin
            )
        )

    async def pools(self) -> dict:
        return await self._call("GET", "/polykv/pools")

    async def pool(self, pool_id: int) -> dict:
        return await self._call("GET", f"/polykv/pools/{pool_id}")

    async def pin(self, pool_id: int) -> dict:
        return await self._call("POST", f"/polykv/pools/{pool_id}/pin")

    async def unpin(self, pool_id: int) -> dict:
        return await self._call("POST", f"/polykv/pools/{pool_id}/unpin")

    async def evict(self, pool_id: int) -> dict:
        return await self._call("POST", f"/polykv/pools/{pool_id}/evict")

    async def flush(self, pool_id: int) -> dict:
        return await self._call("POST", f"/polykv/pools/{pool_id}/flush")

    async def release_pool(self, pool_id: int) -> dict:
        return await self._call("DELETE", f"/polykv/pools/{pool_id}")

    async def release_subtree(self, pool_id: int) -> list[int]:
        released: list[int] = []
        for child in (await self.pool(pool_id)).get("children", []):
            released += await self.release_subtree(child)
        await self.release_pool(pool_id)
        return released + [pool_id]

    async def capacity(
        self, pool_id: int, *, expected_tokens: int | None = None, session_id: str | None = None
    ) -> dict:
        params = {
            k: v for k, v in {"expected_tokens": expected_tokens, "session_id": session_id}.items() if v is not None
        }
        return await self._call("GET", f"/polykv/pools/{pool_id}/capacity", params=params)

    async def set_admission(self, pool_id: int, **policy: Any) -> dict:
        return await self._call("POST", f"/polykv/pools/{pool_id}/admission", policy)

    async def reserve(self, pool_id: int, *, ttl_ms: int | None = None, expected_tokens: int | None = None) -> dict:
        return await self._call(*_Routes.reserve(pool_id, ttl_ms, expected_tokens))

    async def release_reservation(self, pool_id: int, reservation_id: str) -> dict:
        return await self._call("DELETE", f"/polykv/pools/{pool_id}/reservations/{reservation_id}")

    async def admission(self, pool_id: int) -> dict:
        return await self._call("GET", f"/polykv/pools/{pool_id}/admission")

    async def tps(self) -> dict:
        return await self._call("GET", "/polykv/tps", params={"once": "1"})

    async def tps_stream(self, interval_ms: int = 500) -> AsyncIterator[dict]:
        async with self._http.stream(
            "GET", "/polykv/tps", params={"interval_ms": interval_ms}, headers={"Accept": "text/event-stream"}
        ) as resp:
            _raise_for(resp)
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])

    async def session_tps(self, session_id: str) -> dict | None:
        for s in (await self.tps()).get("sessions", []):
            if s.get("session_id") == session_id:
                return s
        return None

    async def tokenize(self, content: str, add_special: bool = False) -> list[int]:
        return (await self._call("POST", "/tokenize", {"content": content, "add_special": add_special}))["tokens"]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return (await self._call("POST", "/detokenize", {"tokens": list(tokens)}))["content"]

    async def props(self) -> dict:
        return await self._call("GET", "/props")

    async def slots(self) -> list[dict]:
        return await self._call("GET", "/slots")

    async def compact_by_refork(
        self,
        ancestor_pool: int,
        branch_pos: int,
        *,
        compacted_tokens: Sequence[int] | None = None,
        compacted_text: str | None = None,
        release_pool: int | None = None,
    ) -> dict:
        if (compacted_tokens is None) == (compacted_text is None):
            raise ValueError("give exactly one of compacted_tokens or compacted_text")
        base = (await self.pool(ancestor_pool))["tokens"][:branch_pos]
        tail = (
            list(compacted_tokens)
            if compacted_tokens is not None
            else await self.tokenize(str(compacted_text), add_special=False)
        )
        new = await self.fork_pool(ancestor_pool, branch_pos, tokens=base + tail)
        if release_pool is not None and release_pool != ancestor_pool:
            new["released"] = await self.release_subtree(release_pool)
        return new
