"""ChatPolyKV: a LangChain chat model for the PolyKV server."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Optional, Sequence

import httpx
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field

from .client import DEFAULT_BASE_URL, _raise_for, PolyKVError

_RETRY_STATUSES = (429, 503)


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
    transport: Any = Field(default=None, exclude=True)
    async_transport: Any = Field(default=None, exclude=True)

    @property
    def _llm_type(self) -> str:
        return "polykv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model_name": self.model_name, "pool_id": self.pool_id}

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "polykv"
        params["ls_model_name"] = kwargs.get("model", self.model_name)
        if self.temperature is not None:
            params["ls_temperature"] = self.temperature
        if self.max_tokens is not None:
            params["ls_max_tokens"] = self.max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # request building -------------------------------------------------------------

    def _body(self, messages: list[BaseMessage], stop: Optional[list[str]], stream: bool, **kwargs: Any) -> dict:
        body: dict[str, Any] = {"model": self.model_name, "messages": convert_to_openai_messages(messages), "stream": stream}
        for key, value in (("temperature", self.temperature), ("max_tokens", self.max_tokens), ("seed", self.seed),
                           ("pool_id", self.pool_id), ("session_id", self.session_id)):
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
            return min(float(ra), 30.0) if ra else min(0.5 * 2**attempt, 8.0)
        except ValueError:
            return 1.0

    def _post(self, body: dict) -> httpx.Response:
        with httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=self.transport) as http:
            for attempt in range(self.max_retries + 1):
                resp = http.post("/v1/chat/completions", json=body, headers=self._headers())
                if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                    time.sleep(self._retry_delay(resp, attempt))
                    continue
                _raise_for(resp)
                return resp
        raise PolyKVError(0, "unreachable")

    async def _apost(self, body: dict) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=self.async_transport) as http:
            for attempt in range(self.max_retries + 1):
                resp = await http.post("/v1/chat/completions", json=body, headers=self._headers())
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
    def _usage(usage: dict | None) -> dict | None:
        if not usage:
            return None
        details = usage.get("prompt_tokens_details") or {}
        return {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
            "total_tokens": usage.get("total_tokens", 0),
            "input_token_details": {"cache_read": details.get("cached_tokens", 0)},
        }

    def _metadata(self, data: dict, headers: httpx.Headers, finish: Optional[str]) -> dict:
        timings = data.get("timings") or {}
        return {
            "model_name": data.get("model", self.model_name),
            "model_provider": "polykv",
            "pool_id": data.get("pool_id", self.pool_id),
            "session_id": data.get("session_id") or self.session_id,
            "session_tps": timings.get("tps_ewma"),
            "timings": timings,
            "backpressure": self._backpressure(headers),
            "finish_reason": finish,
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
                invalid.append({"name": fn.get("name"), "args": fn.get("arguments"), "id": call.get("id"), "error": str(e), "type": "invalid_tool_call"})
        message = AIMessage(
            content=msg.get("content") or "",
            tool_calls=tool_calls,
            invalid_tool_calls=invalid,
            usage_metadata=self._usage(data.get("usage")),
            response_metadata=self._metadata(data, resp.headers, choice.get("finish_reason")),
            id=data.get("id"),
        )
        return ChatResult(generations=[ChatGeneration(message=message, generation_info={"finish_reason": choice.get("finish_reason")})])

    def _chunks(self, lines: Iterator[str], headers: httpx.Headers) -> Iterator[ChatGenerationChunk]:
        for line in lines:
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                return
            data = json.loads(payload)
            if "error" in data:
                err = data["error"]
                raise PolyKVError(err.get("code", 500), err.get("message", ""), err.get("type", ""), data)
            yield from self._chunk(data, headers)

    def _chunk(self, data: dict, headers: httpx.Headers) -> Iterator[ChatGenerationChunk]:
        usage = self._usage(data.get("usage"))
        if not data.get("choices"):
            if usage:
                yield ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=usage))
            return
        choice = data["choices"][0]
        delta = choice.get("delta") or {}
        chunks = [
            tool_call_chunk(name=(tc.get("function") or {}).get("name"), args=(tc.get("function") or {}).get("arguments"),
                            id=tc.get("id"), index=tc.get("index"))
            for tc in delta.get("tool_calls") or []
        ]
        finish = choice.get("finish_reason")
        meta = self._metadata(data, headers, finish) if finish else {}
        if finish:
            meta.setdefault("timings", data.get("timings") or {})
        msg = AIMessageChunk(content=delta.get("content") or "", tool_call_chunks=chunks, response_metadata=meta,
                             id=data.get("id"))
        yield ChatGenerationChunk(message=msg, generation_info={"finish_reason": finish} if finish else None)

    # BaseChatModel -----------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        return self._result(self._post(self._body(messages, stop, False, **kwargs)))

    async def _agenerate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        return self._result(await self._apost(self._body(messages, stop, False, **kwargs)))

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        body = self._body(messages, stop, True, **kwargs)
        with httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=self.transport) as http:
            for attempt in range(self.max_retries + 1):
                with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                        resp.read()
                        time.sleep(self._retry_delay(resp, attempt))
                        continue
                    if resp.status_code >= 400:
                        resp.read()
                        _raise_for(resp)
                    for chunk in self._chunks(resp.iter_lines(), resp.headers):
                        if run_manager and chunk.text:
                            run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                        yield chunk
                    return

    async def _astream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        body = self._body(messages, stop, True, **kwargs)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=self.async_transport) as http:
            for attempt in range(self.max_retries + 1):
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                        await resp.aread()
                        await asyncio.sleep(self._retry_delay(resp, attempt))
                        continue
                    if resp.status_code >= 400:
                        await resp.aread()
                        _raise_for(resp)
                    lines = [line async for line in resp.aiter_lines()]
                    for chunk in self._chunks(iter(lines), resp.headers):
                        if run_manager and chunk.text:
                            await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                        yield chunk
                    return

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: Optional[str | dict | bool] = None, **kwargs: Any) -> Runnable[LanguageModelInput, BaseMessage]:
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
            llm = self.bind(response_format={"type": "json_schema", "json_schema": {"name": js.get("title", "output"), "schema": js}},
                            ls_structured_output_format={"kwargs": {"method": method}, "schema": js})
        elif method == "json_mode":
            llm = self.bind(response_format={"type": "json_object"})
        else:
            raise ValueError(f"unknown method {method!r}")
        parser = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
        return RunnableMap(raw=llm) | parsed
