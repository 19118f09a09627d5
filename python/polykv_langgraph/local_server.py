"""Start a local polykv server (for tests, examples and demos)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

DEFAULT_MODEL = Path.home() / ".cache/polykv/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``with LocalServer("-c", "4096") as base: ...`` runs ``polykv serve`` on a free
    loopback port until the block ends. The binary is ``$POLYKV_BIN`` (default
    ``bin/polykv`` of the repo) and the model ``$POLYKV_MODEL`` (default: the cache)."""

    def __init__(self, *args: str, binary: str | None = None, model: str | None = None, startup_s: float = 60):
        root = Path(__file__).resolve().parents[2]
        self.binary = binary or os.environ.get("POLYKV_BIN") or str(root / "bin/polykv")
        self.model = model or os.environ.get("POLYKV_MODEL") or str(DEFAULT_MODEL)
        self.args, self.startup_s = args, startup_s
        self.proc: subprocess.Popen | None = None
        self.base_url = ""

    def start(self) -> str:
        if not Path(self.model).exists():
            raise FileNotFoundError(f"model missing: {self.model} (run `make model`)")
        port = _free_port()
        self.proc = subprocess.Popen([self.binary, "serve", "-m", self.model, "--port", str(port), *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"polykv exited: {self.proc.stderr.read().decode()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self.base_url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("polykv did not become healthy")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
