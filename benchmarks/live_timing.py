"""What the live-engine benchmarks share: timing an engine's methods from outside."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["PerStep", "Timed"]


def _wrap(owner: Any, name: str, record: Callable[[float], None]) -> Callable[[], None] | None:
    """Replaces ``owner.name`` with a wrapper that hands each call's wall time to ``record``.

    ``owner`` may be a class (the wrapper is then its method): returns what
    puts the class's attribute back (None for an object, whose wrapper goes
    with it).
    """
    inner = getattr(owner, name)
    # A class's own attribute (None: the class inherits it; `restore` deletes the wrapper).
    before = vars(owner).get(name) if isinstance(owner, type) else None
    # NOTE: the clock in a closure: the module and attribute lookups of
    # ``time.perf_counter`` would count in every timed call.
    clock = time.perf_counter

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            record(clock() - start)

    setattr(owner, name, timed)
    if not isinstance(owner, type):
        return None

    def restore() -> None:
        if before is None:
            delattr(owner, name)
        else:
            setattr(owner, name, before)

    return restore


class Timed:
    """Wraps a bound method, adding each call's wall time to a list."""

    def __init__(self, owner: Any, name: str) -> None:
        self.times: list[float] = []
        _wrap(owner, name, self.times.append)


class PerStep:
    """Wraps an engine's step method; adds up, by group, the time of calls made inside each step.

    One thread: calls to the methods of a group (`time`) made during a step
    add to that step's total of the group, and count in its number of timed
    calls (``counts``); a step without any counts 0.
    """

    def __init__(self, owner: Any, name: str) -> None:
        self.step_times: list[float] = []
        self.totals: dict[str, list[float]] = {}
        self.counts: dict[str, list[int]] = {}
        self._current: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self._restores: list[Callable[[], None]] = []
        inner = getattr(owner, name)

        def step(*args: Any, **kwargs: Any) -> Any:
            self._current = dict.fromkeys(self.totals, 0.0)
            self._calls = dict.fromkeys(self.totals, 0)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step_times.append(time.perf_counter() - start)
                for group, total in self._current.items():
                    self.totals[group].append(total)
                    self.counts[group].append(self._calls[group])
                self._current = {}

        setattr(owner, name, step)

    def time(self, group: str, owner: Any, name: str, *, subtract: bool = False) -> None:
        """Counts the calls of ``owner.name`` made inside steps in ``group``.

        ``owner``: an object, or a class (every instance's calls, and a
        subclass's method's ``super()`` call of it, until `restore`).

        ``subtract``: takes their time away instead (a call inside a counted
        one that is not the group's work: a wrapper's inner call).
        """
        self.totals.setdefault(group, [])
        self.counts.setdefault(group, [])
        sign = -1.0 if subtract else 1.0

        def record(seconds: float) -> None:
            if group in self._current:
                self._current[group] += sign * seconds
                self._calls[group] += 1

        restore = _wrap(owner, name, record)
        if restore is not None:
            self._restores.append(restore)

    def restore(self) -> None:
        """Puts back the classes' methods `time` wrapped (a class outlives its engine)."""
        while self._restores:
            self._restores.pop()()

    def clear(self) -> None:
        self.step_times.clear()
        for totals in self.totals.values():
            totals.clear()
        for counts in self.counts.values():
            counts.clear()
