"""Real OpenAI-compatible servers on loopback for `kq compare`'s tests: `transformers serve`
(transformers' own server, its FastAPI app under uvicorn) pinned to one checkpoint folder, run as a
subprocess on a free 127.0.0.1 port, ready when /health answers, killed in teardown."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_available() -> bool:
    from transformers.utils.import_utils import is_accelerate_available, is_serve_available
    return is_serve_available() and is_accelerate_available()  # accelerate: transformers' FP8 loader needs it


class TransformersServer:
    def __init__(self, model: Path, log: Path, ready_timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model), "--host", "127.0.0.1",
             "--port", str(self.port), "--device", "cpu", "--log-level", "warning"],
            stdout=self._out, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve {model} exited {self.proc.returncode}:\n"
                                   + log.read_text(errors="replace")[-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"transformers serve {model} not ready in {ready_timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._out.close()
