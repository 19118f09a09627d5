"""Skips are visible and checked: a skip that scripts/skips.allow does not list fails.

`make test-python` runs pytest with -rs, so each skip is listed with its reason at the
end; this hook turns a skip that no allow-list rule covers into a failure naming it. A
rule is `TEST REASON`: regular expressions on the test's node id (a full match, its
parameters' [...] allowed) and on the skip's reason (a search); the Go suite's
cmd/testreport reads the same file. xfails are not skips here (integration_tests/
conftest.py checks those).
"""
import re
from collections.abc import Generator
from pathlib import Path

import pytest

_ALLOW = Path(__file__).resolve().parents[2] / "scripts" / "skips.allow"


def _rules() -> list[tuple[re.Pattern[str], re.Pattern[str]]]:
    rules = []
    for line in _ALLOW.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        test, _, reason = line.partition(" ")
        # (a parametrized test's ids, [...], are covered by its rule)
        rules.append((re.compile(f"(?:{test})(?:\\[.*\\])?"), re.compile(reason.strip())))
    return rules


_RULES = _rules()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep: pytest.TestReport = yield
    if rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not any(rt.fullmatch(rep.nodeid) and rr.search(reason) for rt, rr in _RULES):
            rep.outcome = "failed"
            rep.longrepr = (f"skipped ({reason}), and no rule in {_ALLOW} allows it: "
                            "make the test run here, or allow it there with the reason")
    return rep
