"""ChatPolyKV: a LangChain chat model for the PolyKV server."""

from __future__ import annotations

import asyncio
import json
import random
import time
import weakref
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Optional, Sequence, cast

import httpx
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from .client import DEFAULT_BASE_URL, PolyKVError, _raise_for, auth_headers, error_for, transport_error

_RETRY_STATUSES = (429, 503)
_DONE = object()


def _backoff(attempt: int) -> float:
    """Exponential backoff with jitter for connection errors and timeouts: 0.5, 1, 2, ... s (max 8)."""
    return min(0.5 * 2**attempt, 8.0) * (0.75 + 0.5 * random.random())


class ChatPolyKV(BaseChatModel):
    """Chat model for a PolyKV server (OpenAI-compatible ``/v1/chat/completions``).

    ``pool_id`` attaches every request to a shared-prefix pool (the server finds the
    shared prefix itself); ``session_id`` keeps the agent on its own sequence across
    turns; ``overcommit`` skips an enforced pool's admission gate.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    base_url: str = DEFAULT_BASE_URL
    model_name: str = Field(default="polykv", alias="model")
    pool_id: Optional[int] = None
    session_id: Optional[str] = None
    temperature: Optional[float] = None
    max_tokens: Optional[int] = None
    timeout: Optional[float] = 120.0
    stop: Optional[list[str]] = Field(default=None, alias="stop_sequences")
    max_retries: int = 2
    overcommit: bool = False
    seed: Optional[int] = None
    logprobs: Optional[bool] = None
    """Ask for the log-probability of every sampled token (``response_metadata["logprobs"]``)."""
    api_key: Optional[SecretStr] = Field(default=None, exclude=True)
    """Key for a server started with ``--api-key``; None reads ``POLYKV_API_KEY``."""
    transport: Any = Field(default=None, exclude=True)
    async_transport: Any = Field(default=None, exclude=True)

    # One long-lived HTTP client per model instance (connection reuse); the async one
    # is per event loop, since an httpx.AsyncClient's connections belong to the loop
    # that opened them.
    _http: Optional[httpx.Client] = PrivateAttr(default=None)
    _ahttp: weakref.WeakKeyDictionary = PrivateAttr(default_factory=weakref.WeakKeyDictionary)
    _served_model: Optional[str] = PrivateAttr(default=None)
    _served_asked: bool = PrivateAttr(default=False)

    @property
    def _llm_type(self) -> str:
        return "polykv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model_name": self.model_name, "pool_id": self.pool_id}

    # clients ------------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(
                base_url=self.base_url, timeout=self.timeout, transport=self.transport, headers=self._auth()
            )
        return self._http

    def _aclient(self) -> httpx.AsyncClient:
        # Keyed by the loop itself, weakly: a loop that is gone takes its client with it
        # (an id() could be reused by a new loop and hand it a dead loop's connections).
        loop = asyncio.get_running_loop()
        client = self._ahttp.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=self.async_transport,
                                       headers=self._auth())
            self._ahttp[loop] = client
        return client

    def _auth(self) -> dict[str, str]:
        return auth_headers(self.api_key.get_secret_value() if self.api_key is not None else None)

    def close(self) -> None:
        """Close the synchronous HTTP client (it is reopened on the next call)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    async def aclose(self) -> None:
        """Close the current event loop's asynchronous HTTP client."""
        client = self._ahttp.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def served_model(self) -> str:
        """The model id the server serves (``GET /v1/models``), cached; ``model_name``
        when the server cannot be asked (one quick attempt per instance, no retries;
        every response also updates it)."""
        if self._served_model is None and not self._served_asked:
            self._served_asked = True
            try:
                resp = self._client().get("/v1/models", timeout=min(self.timeout or 5.0, 5.0))
                data = resp.json().get("data") or [] if resp.status_code == 200 else []
                if data and data[0].get("id"):
                    self._served_model = str(data[0]["id"])
            except Exception:  # noqa: BLE001 - any failure (down, blocked socket, odd body) falls back
                pass
        return self._served_model or self.model_name

    def _resolve_model_profile(self) -> ModelProfile | None:
        # What the server supports for every GGUF model; max_input_tokens depends on the
        # server's -c and is filled by refresh_profile().
        return ModelProfile(
            text_inputs=True, image_inputs=False, audio_inputs=False, video_inputs=False, pdf_inputs=False,
            text_outputs=True, tool_calling=True, tool_choice=True, tool_call_streaming=True,
            structured_output=True, temperature=True,
        )

    def refresh_profile(self) -> ModelProfile:
        """Fill ``profile["max_input_tokens"]`` from the server's ``/props`` ``n_ctx``
        (what fractional triggers of SummarizationMiddleware are measured against)."""
        props = self._client().get("/props").json()
        profile = ModelProfile(**{**(self.profile or {}), "max_input_tokens": int(props["n_ctx"])})
        self.profile = profile
        return profile

    # token counting through the server's own tokenizer (no local tokenizer needed)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` from the server's ``POST /tokenize`` (the served model's
        own vocabulary; no transformers import)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        resp = self._send("/tokenize", {"content": text, "add_special": False})
        return list(resp.json()["tokens"])

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "polykv"
        # The served model (what actually ran), unless the call names one explicitly.
        params["ls_model_name"] = kwargs.get("model") or self.served_model()
        if self.temperature is not None:
            params["ls_temperature"] = self.temperature
        if self.max_tokens is not None:
            params["ls_max_tokens"] = self.max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # request building -------------------------------------------------------------

    def _body(self, messages: list[BaseMessage], stop: Optional[list[str]], stream: bool, **kwargs: Any) -> dict:
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": convert_to_openai_messages(messages),
            "stream": stream,
        }
        for key, value in (("temperature", self.temperature), ("max_tokens", self.max_tokens), ("seed", self.seed),
                           ("pool_id", self.pool_id), ("session_id", self.session_id), ("logprobs", self.logprobs)):
            if value is not None:
                body[key] = value
        if self.overcommit:
            body["overcommit"] = True
        stops = stop if stop is not None else self.stop
        if stops:
            body["stop"] = stops
        if stream:
            body["stream_options"] = {"include_usage": True}
        for key, value in kwargs.items():
            if value is not None and key != "run_manager" and not key.startswith("ls_"):
                body[key] = value
        # LangChain asks for "any"; OpenAI and PolyKV call it "required".
        if body.get("tool_choice") == "any":
            body["tool_choice"] = "required"
        return body

    def _headers(self) -> dict:
        return {"Accept": "application/json"}

    def _retry_delay(self, resp: httpx.Response, attempt: int) -> float:
        ra = resp.headers.get("Retry-After")
        try:
            return min(float(ra), 30.0) if ra else _backoff(attempt)
        except ValueError:
            return 1.0

    def _send(self, path: str, body: dict) -> httpx.Response:
        """POST with retries: 429/503 after Retry-After, connection errors and timeouts
        with exponential backoff, at most ``max_retries`` times; then a typed error."""
        http = self._client()
        for attempt in range(self.max_retries + 1):
            try:
                resp = http.post(path, json=body, headers=self._headers())
            except httpx.TransportError as e:
                if attempt < self.max_retries:
                    time.sleep(_backoff(attempt))
                    continue
                raise transport_error(e) from e
            if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                time.sleep(self._retry_delay(resp, attempt))
                continue
            _raise_for(resp)
            return resp
        raise PolyKVError(0, "unreachable")

    async def _asend(self, path: str, body: dict) -> httpx.Response:
        http = self._aclient()
        for attempt in range(self.max_retries + 1):
            try:
                resp = await http.post(path, json=body, headers=self._headers())
            except httpx.TransportError as e:
                if attempt < self.max_retries:
                    await asyncio.sleep(_backoff(attempt))
                    continue
                raise transport_error(e) from e
            if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                await asyncio.sleep(self._retry_delay(resp, attempt))
                continue
            _raise_for(resp)
            return resp
        raise PolyKVError(0, "unreachable")

    # response parsing --------------------------------------------------------------

    @staticmethod
    def _backpressure(headers: httpx.Headers) -> dict:
        bp: dict[str, Any] = {}
        if "X-Sessions-Remaining" in headers:
            bp["sessions_remaining"] = int(headers["X-Sessions-Remaining"])
        if "X-PolyKV-Warning" in headers:
            bp["warning"] = headers["X-PolyKV-Warning"]
        return bp

    @staticmethod
    def _usage(usage: dict | None) -> UsageMetadata | None:
        if not usage:
            return None
        details = usage.get("prompt_tokens_details") or {}
        return cast(UsageMetadata, {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
            "total_tokens": usage.get("total_tokens", 0),
            "input_token_details": {"cache_read": details.get("cached_tokens", 0)},
        })

    def _metadata(self, data: dict, headers: httpx.Headers, finish: Optional[str]) -> dict:
        timings = data.get("timings") or {}
        if data.get("model"):
            self._served_model = str(data["model"])
        context = data.get("context") or {}
        return {
            "model_name": data.get("model", self.model_name),
            "model_provider": "polykv",
            "pool_id": data.get("pool_id", self.pool_id),
            "session_id": data.get("session_id") or self.session_id,
            "session_tps": timings.get("tps_ewma"),
            "timings": timings,
            "backpressure": self._backpressure(headers),
            "finish_reason": finish,
            # The session's own context pressure (issue 13), what CompactionNode watches.
            "context": context,
            "context_pressure": context.get("ctx_pressure"),
            "truncated": bool(data.get("truncated")),
        }

    def _result(self, resp: httpx.Response) -> ChatResult:
        data = resp.json()
        choice = data["choices"][0]
        msg = choice.get("message") or {}
        tool_calls = []
        invalid = []
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
                tool_calls.append({"name": fn.get("name", ""), "args": args, "id": call.get("id"), "type": "tool_call"})
            except json.JSONDecodeError as e:
                invalid.append(
                    {
                        "name": fn.get("name"),
                        "args": fn.get("arguments"),
                        "id": call.get("id"),
                        "error": str(e),
                        "type": "invalid_tool_call",
                    }
                )
        meta = self._metadata(data, resp.headers, choice.get("finish_reason"))
        if choice.get("logprobs"):
            meta["logprobs"] = choice["logprobs"]
        message = AIMessage(
            content=msg.get("content") or "",
            tool_calls=tool_calls,
            invalid_tool_calls=invalid,
            usage_metadata=self._usage(data.get("usage")),
            response_metadata=meta,
            id=data.get("id"),
        )
        return ChatResult(
            generations=[
                ChatGeneration(message=message, generation_info={"finish_reason": choice.get("finish_reason")})
            ]
        )

    def _line(self, line: str, headers: httpx.Headers) -> Any:
        """Parse one SSE line: a list of chunks, or _DONE at ``data: [DONE]``."""
        if not line.startswith("data: "):
            return []
        payload = line[6:]
        if payload == "[DONE]":
            return _DONE
        data = json.loads(payload)
        if "error" in data:
            err = data["error"]
            raise error_for(int(err.get("code") or 500), data, err.get("message", ""))
        return list(self._chunk(data, headers))

    def _chunk(self, data: dict, headers: httpx.Headers) -> Iterator[ChatGenerationChunk]:
        usage = self._usage(data.get("usage"))
        if not data.get("choices"):
            if usage:
                yield ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=usage))
            return
        choice = data["choices"][0]
        delta = choice.get("delta") or {}
        chunks = [
            tool_call_chunk(
                name=(tc.get("function") or {}).get("name"),
                args=(tc.get("function") or {}).get("arguments"),
                id=tc.get("id"),
                index=tc.get("index"),
            )
            for tc in delta.get("tool_calls") or []
        ]
        finish = choice.get("finish_reason")
        meta = self._metadata(data, headers, finish) if finish else {}
        if finish:
            meta.setdefault("timings", data.get("timings") or {})
        if choice.get("logprobs"):
            meta["logprobs"] = choice["logprobs"]
        msg = AIMessageChunk(content=delta.get("content") or "", tool_call_chunks=chunks, response_metadata=meta,
                             id=data.get("id"))
        yield ChatGenerationChunk(message=msg, generation_info={"finish_reason": finish} if finish else None)

    # BaseChatModel -----------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        return self._result(self._send("/v1/chat/completions", self._body(messages, stop, False, **kwargs)))

    async def _agenerate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        return self._result(await self._asend("/v1/chat/completions", self._body(messages, stop, False, **kwargs)))

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        body = self._body(messages, stop, True, **kwargs)
        http = self._client()
        for attempt in range(self.max_retries + 1):
            yielded = False
            try:
                with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                        resp.read()
                        time.sleep(self._retry_delay(resp, attempt))
                        continue
                    if resp.status_code >= 400:
                        resp.read()
                        _raise_for(resp)
                    for line in resp.iter_lines():
                        chunks = self._line(line, resp.headers)
                        if chunks is _DONE:
                            return
                        for chunk in chunks:
                            if run_manager and chunk.text:
                                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                            yielded = True
                            yield chunk
                    return
            except httpx.TransportError as e:
                # Retried only before the first chunk: a half-delivered reply is not replayed.
                if yielded or attempt >= self.max_retries:
                    raise transport_error(e) from e
                time.sleep(_backoff(attempt))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        body = self._body(messages, stop, True, **kwargs)
        http = self._aclient()
        for attempt in range(self.max_retries + 1):
            yielded = False
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                        await resp.aread()
                        await asyncio.sleep(self._retry_delay(resp, attempt))
                        continue
                    if resp.status_code >= 400:
                        await resp.aread()
                        _raise_for(resp)
                    # Each SSE line is parsed and yielded as it arrives: live tokens for
                    # astream, astream_events and LangGraph servers.
                    async for line in resp.aiter_lines():
                        chunks = self._line(line, resp.headers)
                        if chunks is _DONE:
                            return
                        for chunk in chunks:
                            if run_manager and chunk.text:
                                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                            yielded = True
                            yield chunk
                    return
            except httpx.TransportError as e:
                if yielded or attempt >= self.max_retries:
                    raise transport_error(e) from e
                await asyncio.sleep(_backoff(attempt))

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: Optional[str | dict | bool] = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind OpenAI-format tools. ``tool_choice``: "auto", "none", "any"/"required"/True,
        or a tool name (forces that tool)."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is True or tool_choice == "any":
            tool_choice = "required"
        elif isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict | type, *, include_raw: bool = False,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Structured output, enforced by the server's grammar: by a forced tool call
        (default), by ``response_format`` json_schema, or json_mode (any JSON object)."""
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        is_model = isinstance(schema, type) and issubclass(schema, BaseModel)
        if method == "json_schema":
            js = convert_to_json_schema(schema)
            llm = self.bind(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": js.get("title", "output"), "schema": js},
                },
                ls_structured_output_format={"kwargs": {"method": method}, "schema": js},
            )
        elif method == "json_mode":
            llm = self.bind(response_format={"type": "json_object"})
        else:
            raise ValueError(f"unknown method {method!r}")
        parser: Runnable = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()  # type: ignore[arg-type]
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
        return RunnableMap(raw=llm) | parsed
