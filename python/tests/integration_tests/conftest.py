"""Live servers for the tests that need one (started by the test run itself)."""
from collections.abc import Iterator

import pytest

from polykv_langgraph.local_server import LocalServer


@pytest.fixture(scope="session")
def server() -> Iterator[str]:
    with LocalServer("-c", "4096", "--parallel", "6", "--pool-grace-ms", "0") as base:
        yield base


@pytest.fixture(scope="session")
def small_server() -> Iterator[str]:
    """A server whose context is small, so context pressure is easy to reach."""
    with LocalServer("-c", "1024", "--parallel", "2", "--pool-grace-ms", "0") as base:
        yield base


@pytest.fixture(scope="session")
def compact_server() -> Iterator[str]:
    """A 1,024-cell server with room for a neighbour, the conversation and a summariser."""
    with LocalServer("-c", "1024", "--parallel", "3", "--pool-grace-ms", "0", "-t", "1") as base:
        yield base


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the standard-suite tests the tiny model cannot pass as xfail, with reasons."""
    for item in items:
        reasons = getattr(getattr(item, "module", None), "XFAIL", {})
        reason = reasons.get(getattr(item, "originalname", item.name))
        if reason:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
