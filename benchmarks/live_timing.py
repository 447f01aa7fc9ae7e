"""What the live-engine benchmarks share: timing an engine's methods from outside."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Timed"]


class Timed:
    """Wraps a bound method, adding each call's wall time to a list."""

    def __init__(self, owner: Any, name: str) -> None:
        self.times: list[float] = []
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - start)

        setattr(owner, name, timed)
