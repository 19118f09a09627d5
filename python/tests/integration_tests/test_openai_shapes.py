"""Issue 9's OpenAI shapes, read through the official openai client's typed models."""
import openai
import pytest

from polykv_langgraph.local_server import LocalServer


@pytest.fixture()
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_chat_top_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].token == tok.token and tok.top_logprobs[0].logprob == tok.logprob
        assert all(alt.bytes and alt.logprob <= 0 for alt in tok.top_logprobs)


def test_legacy_completion_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                     temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(d) == 2 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == resp.choices[0].text


def test_max_tokens_zero_is_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_api_key() -> None:
    with LocalServer("-c", "256", "--parallel", "1", "--api-key", "sekrit") as base:
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == "SmolLM2-135M-Instruct.Q4_1"
