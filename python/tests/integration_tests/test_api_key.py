"""A server started with --api-key: the package's clients send the key, and without
it every route but /health answers a typed 401."""
from collections.abc import Iterator

import httpx
import pytest
from pytest import MonkeyPatch

from polykv_langgraph import AuthenticationError, ChatPolyKV, PolyKVClient
from polykv_langgraph.local_server import LocalServer


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[str]:
    with LocalServer("-c", "512", "--parallel", "1", "--api-key", "sk-test-1") as base:
        yield base


def test_clients_send_the_key(keyed_server: str, monkeypatch: MonkeyPatch) -> None:
    monkeypatch.delenv("POLYKV_API_KEY", raising=False)
    assert httpx.get(keyed_server + "/health").status_code == 200
    with pytest.raises(AuthenticationError):
        PolyKVClient(keyed_server).pools()
    assert "pools" in PolyKVClient(keyed_server, api_key="sk-test-1").pools()
    llm = ChatPolyKV(base_url=keyed_server, api_key="sk-test-1", max_tokens=4, temperature=0)
    assert llm.invoke("Say hi.").response_metadata["finish_reason"] in ("stop", "length")
    monkeypatch.setenv("POLYKV_API_KEY", "sk-test-1")
    assert "pools" in PolyKVClient(keyed_server).pools()
    with pytest.raises(AuthenticationError):
        ChatPolyKV(base_url=keyed_server, api_key="wrong", max_tokens=4, max_retries=0).invoke("x")
