"""Starts a real polykv server (bin/polykv on the test model) for the Python tests."""
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _model() -> str:
    path = os.environ.get("POLYKV_MODEL") or str(
        Path.home() / ".cache/polykv/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    if not Path(path).exists():
        pytest.fail(f"test model missing: {path} (run `make model`)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    binary = os.environ.get("POLYKV_BIN") or str(ROOT / "bin/polykv")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "serve", "-m", _model(), "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"polykv exited: {proc.stderr.read().decode()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("polykv did not become healthy")


@pytest.fixture(scope="session")
def server():
    proc, base = start_server("-c", "4096", "--parallel", "4")
    yield base
    proc.terminate()
    proc.wait(timeout=10)
