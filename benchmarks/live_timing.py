"""What the live-engine benchmarks share: timing an engine's methods from outside, and the
KV budgets that give every engine as many blocks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omnicache.demo.live import KV_BYTES_PER_TOKEN, store_bytes_per_token

__all__ = ["Timed", "kv_budget"]


def kv_budget(kv_bytes: int, model: Path, *, store: bool) -> int:
    """``kv_cache_memory_bytes`` for ``kv_bytes`` of a tiny model's KV cache.

    An engine with omnicache's store holds its rows in the same budget on
    the CPU: it is given their bytes beside, for as many blocks as an engine
    without it (the tiny models' KV a token: `KV_BYTES_PER_TOKEN`).
    """
    if not store:
        return kv_bytes
    per_token = KV_BYTES_PER_TOKEN + store_bytes_per_token(model)
    return kv_bytes * per_token // KV_BYTES_PER_TOKEN


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
