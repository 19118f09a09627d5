"""Agent frameworks that speak the Responses or Messages API run against polykv
unchanged (issue 26): LangChain's ChatOpenAI(use_responses_api=True) and ChatAnthropic,
and the OpenAI Agents SDK running an agent with two tools. Everything stays on
loopback: tracing is off and every client points at the local server."""
import asyncio

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled
from langchain_anthropic import ChatAnthropic
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pytest import MonkeyPatch

SYSTEM = "You are a helpful assistant. Answer in one short sentence."


@tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"18 degrees and sunny in {city}"


def test_langchain_chat_openai_responses(server: str) -> None:
    llm = ChatOpenAI(  # type: ignore[call-arg]  # max_tokens: a pydantic alias mypy does not see
        base_url=server + "/v1",
        api_key="unused",
        model="m",
        use_responses_api=True,
        temperature=0,
        max_tokens=32,
        max_retries=0,
    )
    reply = llm.invoke([("system", SYSTEM), ("human", "What is the capital of France?")])
    assert "Paris" in reply.text
    assert reply.usage_metadata and reply.usage_metadata["input_tokens"] > 0
    chunks = list(llm.stream([("system", SYSTEM), ("human", "Say hello.")]))
    assert "".join(c.text for c in chunks)
    # A forced call needs room: the tool's schema makes it longer than a short answer.
    caller = llm.model_copy(update={"max_tokens": 80})
    call = caller.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert (
        call.tool_calls
        and call.tool_calls[0]["name"] == "get_weather"
        and isinstance(call.tool_calls[0]["args"]["city"], str)
    )


def test_langchain_chat_anthropic(server: str) -> None:
    llm = ChatAnthropic(  # type: ignore[call-arg]  # model, max_tokens: pydantic aliases
        base_url=server, api_key="unused", model="claude-polykv", temperature=0, max_tokens=32, max_retries=0
    )
    reply = llm.invoke([("system", SYSTEM), ("human", "What is the capital of France?")])
    assert "Paris" in reply.text
    assert reply.usage_metadata and reply.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream([("system", SYSTEM), ("human", "Say hello.")]))
    assert "".join(c.text for c in chunks)
    caller = llm.model_copy(update={"max_tokens": 80})
    call = caller.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert (
        call.tool_calls
        and call.tool_calls[0]["name"] == "get_weather"
        and isinstance(call.tool_calls[0]["args"]["city"], str)
    )


def test_agents_sdk_two_tools(server: str) -> None:
    set_tracing_disabled(True)
    used: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """Current weather for a city."""
        used.append("weather")
        return f"18 degrees and sunny in {city}"

    @function_tool
    def population(city: str) -> str:
        """Population of a city."""
        used.append("population")
        return f"{city} has 2 million inhabitants"

    model = OpenAIResponsesModel(
        model="m", openai_client=openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    )
    # tool_choice "required" makes the tiny test model call a tool on its first turn;
    # the SDK resets it after the call, so the agent can then answer in text.
    agent = Agent(
        name="city",
        instructions="Use the tools to answer questions about cities.",
        tools=[weather, population],
        model=model,
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )
    result = asyncio.run(
        Runner.run(
            agent,
            "What is the weather and population of Paris?",
            max_turns=4,
            run_config=RunConfig(tracing_disabled=True),
        )
    )
    assert used and set(used) <= {"weather", "population"}
    assert isinstance(result.final_output, str)
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(calls) == len(outputs) == len(used)


@pytest.fixture(autouse=True)
def _no_network_but_loopback(monkeypatch: MonkeyPatch) -> None:
    """No test may reach the network other than loopback: the SDKs read these."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
