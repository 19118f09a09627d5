"""The live dashboard (GET /ui/) in a real browser: headless Chromium driven by selenium
against a live server holding a 3-level pool tree with 16 decoding sessions.

It checks that the tree and live values appear and update, that sessions under their
pool's floor are marked, that every pool shows a capacity verdict, that the page works
behind an API key (entered once, then remembered), and that the page's JS logs no errors.
Screenshots go to artifacts/ui/ (gitignored).

The browser comes from Debian's chromium and chromium-driver (scripts/install-browser.sh,
run by `make test`). Without them the tests skip, unless POLYKV_REQUIRE_BROWSER=1 (set by
`make test-python`), which turns a missing browser into a failure.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from polykv_langgraph.local_server import LocalServer

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[3] / "artifacts" / "ui"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1440,1500"]
N_SESSIONS = 16
API_KEY = "dash-test-key-123"

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the venv pins selenium
    webdriver = None  # type: ignore[assignment]


def _browser_missing() -> str:
    if webdriver is None:
        return "selenium is not installed"
    for p in (CHROMIUM, CHROMEDRIVER):
        if not os.access(p, os.X_OK):
            return f"{p} missing (scripts/install-browser.sh installs it)"
    return ""


_missing = _browser_missing()
if _missing and os.environ.get("POLYKV_REQUIRE_BROWSER") == "1":
    raise RuntimeError(f"POLYKV_REQUIRE_BROWSER=1 but {_missing}")
pytestmark = pytest.mark.skipif(bool(_missing), reason=_missing)


# ---- server with a pool tree and decoding sessions ------------------------------------

SYSTEM = ("You are one agent in a team that plans a small vegetable garden. Keep answers short, "
          "list concrete steps, and name the plants you mean.")


def _tokenize(c: httpx.Client, text: str) -> list[int]:
    r = c.post("/tokenize", json={"content": text, "add_special": False})
    r.raise_for_status()
    return r.json()["tokens"]


def _fork(c: httpx.Client, parent: int, branch_pos: int, tokens: list[int]) -> dict:
    r = c.post(f"/polykv/pools/{parent}/fork", json={"branch_pos": branch_pos, "tokens": tokens})
    assert r.status_code == 201, r.text
    return r.json()


class Agents:
    """16 streaming completions attached to the pools, decoding until stopped (each one
    closes its stream, which cancels its task on the server)."""

    def __init__(self, base: str, plan: list[tuple[str, int, list[int]]]) -> None:
        self.base, self.plan = base, plan
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=p, daemon=True) for p in plan]

    def _run(self, session: str, pool_id: int, prompt: list[int]) -> None:
        body = {"prompt": prompt, "pool_id": pool_id, "session_id": session, "max_tokens": 900,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with (
                httpx.Client(base_url=self.base, timeout=120) as c,
                c.stream("POST", "/v1/completions", json=body) as r,
            ):
                if r.status_code != 200:
                    self.errors.append(f"{session}: HTTP {r.status_code} {r.read()!r}")
                    return
                for _ in r.iter_lines():
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as e:
            if not self.stop.is_set():
                self.errors.append(f"{session}: {e!r}")

    def __enter__(self) -> Agents:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=15)


@pytest.fixture(scope="module")
def live() -> Iterator[dict[str, Any]]:
    """A server with a 3-level tree: root, A extends root, G extends A, B branches root
    5 tokens before its end; 4 decoding agents on each. B's floor is above what any
    session reaches (all its agents are under it); A's is far below."""
    # 16 agents x (prompt + 900 tokens) + the pools fit in 16384 cells, so no agent is cut
    # short by a full cache; 900 tokens outlast the test even on an idle machine (~75 s).
    with LocalServer("-c", "16384", "--parallel", str(N_SESSIONS + 1), "--pool-grace-ms", "0") as base, \
            httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/polykv/pools", json={"prompt": SYSTEM})
        assert r.status_code == 201, r.text
        root = r.json()
        root_toks = c.get(f"/polykv/pools/{root['pool_id']}").json()["tokens"]
        L = len(root_toks)
        a_toks = root_toks + _tokenize(c, " Agent team A: soil and compost.")
        a = _fork(c, root["pool_id"], L, a_toks)
        g = _fork(c, a["pool_id"], len(a_toks), a_toks + _tokenize(c, " Sub-task: a watering rota."))
        b = _fork(c, root["pool_id"], L - 5, root_toks[:L - 5] + _tokenize(c, " Team B plans pest control instead."))
        pools = {"root": root, "A": a, "G": g, "B": b}
        for name, floor in (("A", 0.01), ("B", 200.0)):
            r = c.post(f"/polykv/pools/{pools[name]['pool_id']}/admission", json={"target_tps_per_session": floor})
            assert r.status_code == 200, r.text
        prefix = {name: c.get(f"/polykv/pools/{p['pool_id']}").json()["tokens"] for name, p in pools.items()}
        # Beside the tree: an evicted root pool, and an idle session without a pool.
        r = c.post("/polykv/pools", json={"prompt": "A spare prefix nobody uses."})
        assert r.status_code == 201, r.text
        spare = r.json()["pool_id"]
        assert c.post(f"/polykv/pools/{spare}/evict").status_code == 200
        # Evicted from the cache: its KV went to the pool tier (ram, with the default
        # --pool-ram-mb) or, without a tier, nowhere ("evicted").
        # The spill to the tier finishes after the evict answers: until then the pool reads
        # "evicted", and the dashboard, read later, would show "ram". Wait for it to settle.
        tiered = "pool_tier" in c.get("/props").json()["polykv"]
        settle = time.monotonic() + 30
        while True:
            spare_residency = c.get(f"/polykv/pools/{spare}").json()["residency"]
            if not tiered or spare_residency != "evicted" or time.monotonic() > settle:
                break
            time.sleep(0.1)
        assert spare_residency in ("ram", "disk", "evicted"), spare_residency
        r = c.post(
            "/v1/completions", json={"prompt": "Hello", "session_id": "solo-idle", "max_tokens": 4, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        plan = []
        for i in range(N_SESSIONS):
            name = ("root", "A", "G", "B")[i % 4]
            tail = _tokenize(c, f" Agent {i} asks: what should we plant in bed {i}?")
            plan.append((f"agent-{name}-{i:02d}", pools[name]["pool_id"], prefix[name] + tail))
        with Agents(base, plan) as agents:
            # Wait until every agent decodes, so the page sees a full, live picture.
            deadline = time.time() + 240  # the shared CI machine can be slow
            while time.time() < deadline:
                snap = c.get("/polykv/tps", params={"once": 1}).json()
                if sum(1 for s in snap["sessions"] if s["state"] == "decode" and s["n_decoded"] >= 4) >= N_SESSIONS:
                    break
                assert not agents.errors, agents.errors
                time.sleep(0.3)
            else:
                pytest.fail(f"agents did not all start decoding: {snap}")
            yield {"base": base, "pools": {k: v["pool_id"] for k, v in pools.items()}, "agents": agents,
                   "branch_pos_B": L - 5, "spare": spare, "spare_residency": spare_residency}
            assert not agents.errors, agents.errors


@pytest.fixture()
def browser() -> Iterator[webdriver.Chrome]:
    profile = tempfile.mkdtemp(prefix="polykv-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS + [f"--user-data-dir={profile}"]:
        opts.add_argument(f)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium look for a driver online
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(drv: webdriver.Chrome, cond: Callable[[Any], Any], timeout: int = 60, what: str = "") -> Any:
    return WebDriverWait(drv, timeout, poll_frequency=0.2).until(lambda d: cond(d), message=what)


def _rows(drv: webdriver.Chrome) -> dict[str, dict]:
    """Every session row the page shows: session id -> what the row says."""
    return drv.execute_script("""
        const out = {};
        for (const r of document.querySelectorAll('.srow')) {
          const li = r.closest('li[data-pool]');
          out[r.dataset.session] = {pool: li ? Number(li.dataset.pool) : null, state: r.dataset.state,
            tps: r.querySelector('.tps').textContent, decoded: r.querySelector('.dec').textContent,
            under: r.classList.contains('under'), warming: r.classList.contains('warming'),
            fill: r.querySelector('.fill').style.width};
        }
        return out;""")


def _js_errors(drv: webdriver.Chrome, allow: tuple[str, ...] = ()) -> list[dict]:
    return [e for e in drv.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allow)]


def _save(drv: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    drv.save_screenshot(str(path))
    return path


def _events(drv: webdriver.Chrome) -> int:
    return int(drv.find_element(By.ID, "updated").get_attribute("data-events") or 0)


# ---- tests ---------------------------------------------------------------------------

def test_dashboard_shows_live_tree(live: dict[str, Any], browser: webdriver.Chrome) -> None:
    base, pools = live["base"], live["pools"]
    assert httpx.get(base + "/", follow_redirects=False).headers["location"] == "/ui/"
    browser.get(base + "/")  # the redirect lands on the page
    assert browser.title == "PolyKV dashboard"

    # The tree: 4 pools, nested as created (G inside A inside root, B inside root), and
    # the evicted spare root.
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "li[data-pool]")) == 5, what="5 pools")
    def sel(*ids: str) -> str:
        return " ".join(f"li[data-pool='{pools[i]}']" for i in ids)
    for path in (("root", "A", "G"), ("root", "B")):
        assert browser.find_elements(By.CSS_SELECTOR, "#tree > " + sel(*path)), path
    def edge(name: str) -> str:
        return browser.find_element(By.CSS_SELECTOR, sel(name) + " > .pool .edge").text
    assert edge("root") == "root"
    assert edge("A") == f"extends #{pools['root']}"
    assert edge("B") == f"branches #{pools['root']} @{live['branch_pos_B']}"
    spare = browser.find_element(By.CSS_SELECTOR, f"#tree > li[data-pool='{live['spare']}'] > .pool")
    assert live["spare_residency"] in spare.find_element(By.CSS_SELECTOR, ".badges").text
    assert spare.find_element(By.CSS_SELECTOR, ".none").is_displayed()  # "no sessions attached"
    _wait(browser, lambda d: _rows(d).get("solo-idle", {}).get("pool", 0) is None, what="unpooled idle session")
    assert _rows(browser)["solo-idle"]["state"] == "idle"
    assert browser.find_element(By.CSS_SELECTOR, "#loose .srow[data-session='solo-idle']")

    # Every agent under its pool, decoding, with a speed.
    def all_live(d: Any) -> Any:
        rows = {k: v for k, v in _rows(d).items() if k.startswith("agent-")}
        ok = len(rows) == N_SESSIONS and all(r["state"] == "decode" and r["tps"] != "—" for r in rows.values())
        return rows if ok else False
    rows = _wait(browser, all_live, what="16 decoding agents with tps")
    for sid, r in rows.items():
        assert r["pool"] == pools[sid.split("-")[1]], (sid, r)
        assert float(r["tps"]) > 0 and r["fill"] not in ("", "0", "0%"), (sid, r)

    # Floors: B's 200 tok/s floor (above the whole machine's decode rate) puts all its agents
    # under it, A's 0.01 none.
    def floors_applied(d: Any) -> bool:
        rs = _rows(d)
        b = [r for k, r in rs.items() if k.startswith("agent-B-")]
        a = [r for k, r in rs.items() if k.startswith("agent-A-")]
        return len(b) == 4 and all(r["under"] for r in b) and not any(r["under"] for r in a)
    _wait(browser, floors_applied, what="B under its floor, A not")
    assert int(browser.find_element(By.ID, "under-n").text) >= 4
    assert browser.find_element(By.CSS_SELECTOR, sel("B") + " > .pool .floor b").text == "200"

    # A capacity verdict on every pool.
    def verdicts(d: Any) -> Any:
        v = {name: d.find_element(By.CSS_SELECTOR, sel(name) + " > .pool .verdict").get_attribute("data-admit")
             for name in pools}
        return v if all(x in ("yes", "no") for x in v.values()) else False
    _wait(browser, verdicts, what="capacity verdicts")

    # Live values move: more tps events, more decoded tokens for every agent, more chart
    # points (waited for, not slept: the shared 2-core machine stalls the stream at times).
    before, ev0 = _rows(browser), _events(browser)
    def pts(d: Any) -> int:
        return int(d.find_element(By.ID, "tps-chart").get_attribute("data-points"))
    pts0 = pts(browser)
    _wait(browser, lambda d: _events(d) >= ev0 + 3, what="3 more tps events")
    _wait(browser, lambda d: pts(d) > pts0, what="chart grows")

    def all_grew(d: Any) -> bool:
        after = _rows(d)
        return all(int(after[s]["decoded"]) > int(before[s]["decoded"]) for s in before if s.startswith("agent-"))
    _wait(browser, all_grew, what="every agent's decoded count grows")
    _wait(browser, lambda d: d.find_element(By.ID, "conn").get_attribute("data-state") == "live", what="stream live")
    assert float(browser.find_element(By.ID, "agg-tps").text) > 0
    assert float(browser.find_element(By.ID, "kv-pct").text) > 0

    # No layout jumps: the tree's boxes keep their place while values update.
    rects = (
        "return [...document.querySelectorAll('li[data-pool] > .pool, .srow')]"
        ".map(e => {const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]})"
    )
    r0 = browser.execute_script(rects)
    time.sleep(2)
    assert browser.execute_script(rects) == r0

    shot = _save(browser, "dashboard.png")
    assert shot.stat().st_size > 10_000
    assert _js_errors(browser) == []
    # ...and that check would see one: an uncaught error thrown in the page shows up.
    browser.execute_script("setTimeout(() => { throw new Error('dashboard-probe') })")
    _wait(browser, lambda d: any("dashboard-probe" in e["message"] for e in _js_errors(d)), timeout=10,
          what="a thrown error reaches the browser log")


def _public(path: str) -> bool:
    """What a browser fetches without a header: the page itself (and /health)."""
    return path in ("/", "/health", "/ui") or path.startswith("/ui/")


class _AuthProxy:
    """A loopback reverse proxy that demands `Authorization: Bearer KEY` on every route
    but /health and the page's own files, as `--api-key` does. It streams responses
    through unbuffered, so the tps SSE stream works across it."""

    def __init__(self, upstream: str, key: str) -> None:
        self.up = urlsplit(upstream)
        self.key = key
        self.seen: list[tuple[str, bool]] = []  # (path, authorized)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                ok = self.headers.get("Authorization") == f"Bearer {proxy.key}"
                public = _public(path)
                proxy.seen.append((path, ok))
                if not ok and not public:
                    body = json.dumps({"error": {"code": 401, "type": "authentication_error",
                                                 "message": "missing or wrong API key"}}).encode()
                    self.send_response(401)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                conn = http.client.HTTPConnection(proxy.up.hostname, proxy.up.port, timeout=60)
                try:
                    conn.request(
                        "GET", self.path, headers={k: v for k, v in self.headers.items() if k.lower() != "host"}
                    )
                    resp = conn.getresponse()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    pass
                finally:
                    conn.close()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_dashboard_with_api_key(live: dict[str, Any], browser: webdriver.Chrome) -> None:
    proxy = _AuthProxy(live["base"], API_KEY)
    try:
        browser.get(proxy.base + "/ui/")
        # Refused: the page says a key is needed instead of showing stale or broken data.
        _wait(browser, lambda d: d.find_element(By.ID, "conn").get_attribute("data-state") == "auth", what="auth state")
        assert "needed" in browser.find_element(By.ID, "keyform").get_attribute("class")
        assert not browser.find_element(By.ID, "banner").get_attribute("hidden")
        assert browser.find_elements(By.CSS_SELECTOR, "li[data-pool]") == []
        _save(browser, "dashboard-key-needed.png")
        # Waiting for the key, the page stops asking (no request storm of 401s).
        def refused() -> int:
            return sum(1 for p, ok in proxy.seen if not ok and not _public(p))
        n = refused()
        time.sleep(2)
        assert refused() - n <= 1

        # Entered once: the data appears, streamed with the key.
        browser.find_element(By.ID, "apikey").send_keys(API_KEY)
        browser.find_element(By.ID, "key-save").click()
        _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "li[data-pool]")) == 5, what="tree after key")
        _wait(
            browser, lambda d: d.find_element(By.ID, "conn").get_attribute("data-state") == "live", what="live stream"
        )
        assert browser.find_element(By.ID, "banner").get_attribute("hidden")
        assert ("/polykv/tps", True) in proxy.seen

        # Remembered: a reload goes straight to live data, without a single refused request.
        mark = len(proxy.seen)
        browser.refresh()
        _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".srow[data-state='decode']")) >= N_SESSIONS,
              what="rows after reload")
        _wait(browser, lambda d: d.find_element(By.ID, "conn").get_attribute("data-state") == "live",
              what="live stream after reload")
        assert [p for p, ok in proxy.seen[mark:] if not ok and not _public(p)] == []
        _save(browser, "dashboard-api-key.png")
        # The only errors allowed are the browser's own log lines for the first 401s.
        assert _js_errors(browser, allow=("status of 401",)) == []
    finally:
        proxy.close()
