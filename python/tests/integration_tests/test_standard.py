"""langchain-tests' standard integration suite for ChatPolyKV against a live server.

Everything the server supports runs; what the 135M test model cannot do is marked
xfail with the reason (see XFAIL below)."""
from typing import Type

import httpx
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from polykv_langgraph import ChatPolyKV

_LOOPS = ("the 135M test model loops inside free-text string fields until max_tokens (128 in the suite): "
          "the grammar keeps the JSON valid, but the call never closes, so nothing parses")
# Features the server supports but the tiny model cannot carry out within the suite's
# budgets: test name -> (reason, exceptions that count, regular expression the exception's
# message must match). conftest.py marks these xfail(raises=..., strict=True): they run,
# only that failure counts as the expected one, a pass fails (the entry is then stale),
# and so does any other error: a 500 or a dead server (every response the test got must
# be a 200: HTTP_STATUSES), another exception, another message.
# The looping model's forced tool call never closes, so langchain's tool parser returns
# None: the suite's checks then fail on None (its dict check iterates it: TypeError), or,
# streaming, on a stream that yielded no parsed object.
_LOOPS_FAIL = r"Stream returned no chunks|isinstance\(None, |'NoneType' object is not iterable"
XFAIL: dict[str, tuple[str, tuple[type[BaseException], ...], str]] = {
    "test_structured_output": (_LOOPS, (AssertionError, TypeError), _LOOPS_FAIL),
    "test_structured_output_async": (_LOOPS, (AssertionError, TypeError), _LOOPS_FAIL),
    "test_structured_output_pydantic_2_v1": (_LOOPS, (AssertionError,), _LOOPS_FAIL),
    "test_structured_output_optional_param": (_LOOPS, (AssertionError,), _LOOPS_FAIL),
    "test_json_mode": (
        "json_object constrains the reply to a JSON object, not to the requested schema, "
        "which the 135M model does not follow from the prompt",
        (OutputParserException, AssertionError),
        # (pytest's rewritten assertions show values: the dict check's failure is a set diff)
        r"Failed to parse Joke from completion|Extra items in the (left|right) set|isinstance\("
        r"|Stream returned no chunks",
    ),
    "test_agent_loop": (
        "with tool_choice auto (unconstrained) the 135M model answers in prose instead of calling the tool",
        (AssertionError,),
        r"^assert ",
    ),
}

# Status of every HTTP response the suite's chat models got, in order (the transports
# below record them); conftest.py clears it before each XFAIL test and checks it after.
HTTP_STATUSES: list[int] = []


class _Recording(httpx.HTTPTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = super().handle_request(request)
        HTTP_STATUSES.append(resp.status_code)
        return resp


class _AsyncRecording(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await super().handle_async_request(request)
        HTTP_STATUSES.append(resp.status_code)
        return resp


class TestChatPolyKVIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _base(self, server: str) -> None:
        type(self)._base_url = server  # type: ignore[attr-defined]  # set per session, read by the properties

    @property
    def chat_model_class(self) -> Type[ChatPolyKV]:
        return ChatPolyKV

    @property
    def chat_model_params(self) -> dict:
        return {
            "base_url": getattr(type(self), "_base_url", "http://127.0.0.1:9"),
            "model": "smollm2",
            "temperature": 0,
            "max_tokens": 128,
            # New per model: an async transport's connections belong to one event loop.
            "transport": _Recording(),
            "async_transport": _AsyncRecording(),
        }

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "function_calling"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        # A PolyKV server serves one model: there is no other model name to switch to.
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A second turn of a session reads its first turn's prompt from the KV cache."""
        from langchain_core.messages import HumanMessage, SystemMessage

        llm = ChatPolyKV(**{**self.chat_model_params, "session_id": f"cache-read-{stream}", "max_tokens": 8})
        msgs = [SystemMessage("You are a helpful assistant. " * 20), HumanMessage("Say hi.")]
        llm.invoke(msgs)
        if not stream:
            return llm.invoke(msgs)
        full = None
        for chunk in llm.stream(msgs):
            full = chunk if full is None else full + chunk
        assert full is not None
        return full
