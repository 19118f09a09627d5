"""Start a local polykv server (for tests, examples and demos)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import httpx

DEFAULT_MODEL = Path.home() / ".cache/polykv/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_polykv(binary: Optional[str] = None) -> str:
    """The ``polykv`` executable: ``binary`` if given, else ``$POLYKV_BIN``, else
    ``polykv`` on ``PATH``. Raises FileNotFoundError naming both places otherwise."""
    if binary:
        return binary
    env = os.environ.get("POLYKV_BIN")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"POLYKV_BIN={env} does not exist (build it with `make build`)")
        return env
    found = shutil.which("polykv")
    if found:
        return found
    raise FileNotFoundError("polykv server binary not found: set POLYKV_BIN to its path, or put `polykv` on PATH "
                            "(`make build` writes bin/polykv in a PolyKV checkout)")


class LocalServer:
    """``with LocalServer("-c", "4096") as base_url: ...`` runs ``polykv serve`` on a free
    loopback port until the block ends.

    The binary is found by :func:`find_polykv` (``binary=``, ``$POLYKV_BIN``, then
    ``PATH``), so it works from an installed package; the model is ``model=``,
    ``$POLYKV_MODEL`` or ``~/.cache/polykv/models/SmolLM2-135M-Instruct.Q4_1.gguf``
    (``make model``). Extra arguments go to ``polykv serve``.
    """

    def __init__(self, *args: str, binary: Optional[str] = None, model: Optional[str] = None, startup_s: float = 60):
        self.binary = find_polykv(binary)
        self.model = model or os.environ.get("POLYKV_MODEL") or str(DEFAULT_MODEL)
        self.args, self.startup_s = args, startup_s
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.base_url = ""

    def start(self) -> str:
        if not Path(self.model).exists():
            raise FileNotFoundError(f"model missing: {self.model} (run `make model`, or set POLYKV_MODEL)")
        port = _free_port()
        self.proc = subprocess.Popen([self.binary, "serve", "-m", self.model, "--port", str(port), *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"polykv exited: {err}")
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
                self.proc.wait()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
