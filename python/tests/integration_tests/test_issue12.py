"""Issue 12 against live servers, with the official ``openai`` client and no PolyKV field
at all (no pool_id, no session_id): what agent frameworks send. The server reuses any
cached prefix by itself: a fan-out shares its system prompt, an agent loop reuses its own
history turn after turn, and greedy output equals a server with reuse turned off."""
import operator
from collections.abc import Iterator
from typing import Optional

import httpx
import openai
import pytest
from langgraph.graph import START, StateGraph
from langgraph.types import Send
from typing_extensions import Annotated, TypedDict

from polykv_langgraph.local_server import LocalServer

SERVER_ARGS = ("-c", "4096", "--parallel", "4", "--pool-grace-ms", "0")
REUSE_OFF = ("--prefix-cache", "off")

# A system prompt long enough that sharing it is visible in the cell count (~300 tokens).
SYSTEM = (
    "You are one of several research agents. Call tools, read their results, and report briefly. Tools:\n"
    + "".join(
        f"- lookup_{i}(key: string): the record for key in area {i * 13}; use it for questions about area {i * 13}.\n"
        for i in range(12)
    )
)


def cache_info(base: str) -> Optional[dict]:
    """The server's prefix-cache block in /props, or None on a server without automatic
    prefix reuse."""
    props = httpx.get(base + "/props", timeout=10).json()
    info = props.get("polykv", {}).get("prefix_cache")
    return info if isinstance(info, dict) else None


def cells_used(base: str) -> int:
    return int(httpx.get(base + "/props", timeout=10).json()["usage"]["kv_cells_used"])


@pytest.fixture(scope="module")
def reuse_server() -> Iterator[str]:
    with LocalServer(*SERVER_ARGS) as base:
        info = cache_info(base)
        if info is None:
            pytest.skip("this server reports no automatic prefix cache (/props polykv.prefix_cache)")
        assert info["enabled"] is True, info
        yield base


@pytest.fixture(scope="module")
def off_server(reuse_server: str) -> Iterator[str]:
    with LocalServer(*SERVER_ARGS, *REUSE_OFF) as base:
        info = cache_info(base)
        assert info is not None and info["enabled"] is False, info
        yield base


def client_for(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_plain_fanout_shares_the_system_prompt(reuse_server: str) -> None:
    """A LangGraph Send fan-out whose agents call the plain openai client with the same
    system prompt, all at once: every agent after the first reuses the prompt, and the
    cache holds it once, not once per agent."""
    client = client_for(reuse_server)
    n, gen = 3, 8
    before = cells_used(reuse_server)
    hits_before = cache_info(reuse_server)["hit_tokens"]

    class State(TypedDict, total=False):
        task: str
        usage: Annotated[list, operator.add]

    def agent(state: dict) -> dict:
        resp = client.chat.completions.create(
            model="m", max_tokens=gen, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": state["task"]}])
        return {"usage": [resp.usage]}

    def fan_out(state: dict) -> list:
        return [Send("agent", {"task": f"Agent {i}: look up area {i * 13} and report."}) for i in range(n)]

    g = StateGraph(State)
    g.add_node("agent", agent)
    g.add_conditional_edges(START, fan_out, ["agent"])
    usages = g.compile().invoke({})["usage"]
    assert len(usages) == n
    cached = sorted(u.prompt_tokens_details.cached_tokens for u in usages)
    system_tokens = min(u.prompt_tokens for u in usages) - 24  # the user turn is under 24 tokens
    # The first agent to be served may find nothing; every later one finds the system prompt.
    assert all(c >= system_tokens for c in cached[1:]), (cached, system_tokens)
    copy_everything = sum(u.prompt_tokens + u.completion_tokens for u in usages)
    # /props counts the same reuse the responses report.
    assert cache_info(reuse_server)["hit_tokens"] - hits_before == sum(cached)
    held = cells_used(reuse_server) - before
    # Each agent's own turn and reply are its own; the system prompt is held once.
    assert 0 < held <= copy_everything - (n - 1) * system_tokens, (held, copy_everything, system_tokens)


def test_agent_loop_without_session_reuses_its_history(reuse_server: str) -> None:
    """Each turn re-sends the whole history plus a tool result and no session_id: the
    previous turn's prompt is found in the cache every time."""
    client = client_for(reuse_server)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find the record for area 39."}]
    prev_prompt = 0
    for turn in range(4):
        resp = client.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True})
        usage = resp.usage
        if turn > 0:
            # Only the re-tokenized tail of the reply may differ from what was decoded.
            assert usage.prompt_tokens_details.cached_tokens >= prev_prompt - 4, (turn, usage, prev_prompt)
        assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        prev_prompt = usage.prompt_tokens
        msgs += [
            {"role": "assistant", "content": resp.choices[0].message.content},
            {
                "role": "user",
                "content": f"Tool result {turn}: area 39 row {turn} = {turn * 17 % 100}; rows checked {turn + 1}.",
            },
        ]


def test_greedy_with_reuse_equals_reuse_off(reuse_server: str, off_server: str) -> None:
    """Greedy tokens and logprobs of a request whose prefix came from another request's
    cells equal those of the same request on a server that prefills everything."""
    on, off = client_for(reuse_server), client_for(off_server)
    # A donor that shares the system prompt and diverges in the user turn.
    on.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Report on area 0."}])
    kwargs = dict(
        model="m",
        max_tokens=32,
        temperature=0,
        logprobs=True,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What does lookup_5 return? Answer briefly."},
        ],
    )
    warm = on.chat.completions.create(**kwargs)
    cold = off.chat.completions.create(**kwargs)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert [t.token for t in warm.choices[0].logprobs.content] == [t.token for t in cold.choices[0].logprobs.content]
    assert [t.logprob for t in warm.choices[0].logprobs.content] == [
        t.logprob for t in cold.choices[0].logprobs.content
    ]
