"""Free TCP ports for the servers the tests start, below the kernel's ephemeral ports.

A port found free by binding port 0 comes from the kernel's ephemeral range
(32768-60999 by Linux's default), which the kernel hands to the next socket
that binds port 0 or connects out: another socket can take it before the
server binds it, or while a test holds the server stopped to restart it on
the same port. Below that range only an explicit bind takes a port.

``python tests/ports.py`` prints one (``scripts/redis-test-server.sh``).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence

__all__ = ["HIGHEST", "LOWEST", "free_port"]

LOWEST = 20000
HIGHEST = 32767


def free_port(highest: int = HIGHEST, *, offsets: Sequence[int] = (0,)) -> int:
    """A port p in ``LOWEST .. highest`` such that p + each of ``offsets`` is free now.

    Raises:
        RuntimeError: no such port in 200 tries.
    """
    for _ in range(200):
        port = random.randint(LOWEST, highest)
        try:
            for offset in offsets:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port in {LOWEST}-{highest} (with offsets {list(offsets)})")


if __name__ == "__main__":
    print(free_port())
