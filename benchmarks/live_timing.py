"""What the live-engine benchmarks share: timing an engine's methods from outside."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["PerStep", "Timed"]


def _wrap(owner: Any, name: str, times: list[float]) -> Callable[[], None] | None:
    """Replaces ``owner.name`` with a wrapper that appends each call's wall time to ``times``.

    ``owner`` may be a class (the wrapper is then its method): returns what
    puts the class's attribute back (None for an object, whose wrapper goes
    with it).
    """
    inner = getattr(owner, name)
    # A class's own attribute (None: the class inherits it; `restore` deletes the wrapper).
    before = vars(owner).get(name) if isinstance(owner, type) else None
    # NOTE: the clock and the list's append in the closure, and nothing else
    # done inside the interval: each timed call pays for what the wrapper
    # does, and a lookup or a Python-level call there counts in every one
    # (about 1 us a call inside the engine, where each comes cold, with a
    # function that added to a dict of totals).
    clock = time.perf_counter
    append = times.append

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            append(clock() - start)

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
        _wrap(owner, name, self.times)


class PerStep:
    """Wraps an engine's step method; adds up, by group, the time of calls made inside each step.

    One thread: calls to the methods of a group (`time`) made during a step
    add to that step's total of the group, and count in its number of timed
    calls (``counts``); a step without any counts 0. Calls made between
    steps count nowhere.
    """

    def __init__(self, owner: Any, name: str) -> None:
        self.step_times: list[float] = []
        self.totals: dict[str, list[float]] = {}
        self.counts: dict[str, list[int]] = {}
        # Each timed method's group, sign and the times of its calls in the step.
        self._timed: list[tuple[str, float, list[float]]] = []
        self._restores: list[Callable[[], None]] = []
        inner = getattr(owner, name)

        def step(*args: Any, **kwargs: Any) -> Any:
            for _, _, times in self._timed:
                times.clear()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step_times.append(time.perf_counter() - start)
                self._add_up()

        setattr(owner, name, step)

    def _add_up(self) -> None:
        totals = dict.fromkeys(self.totals, 0.0)
        calls = dict.fromkeys(self.totals, 0)
        # NOTE: the lists are emptied when the next step begins (calls made
        # between steps count nowhere).
        for group, sign, times in self._timed:
            totals[group] += sign * sum(times)
            calls[group] += len(times)
        for group, total in totals.items():
            self.totals[group].append(total)
            self.counts[group].append(calls[group])

    def time(self, group: str, owner: Any, name: str, *, subtract: bool = False) -> None:
        """Counts the calls of ``owner.name`` made inside steps in ``group``.

        ``owner``: an object, or a class (every instance's calls, and a
        subclass's method's ``super()`` call of it, until `restore`).

        ``subtract``: takes their time away instead (a call inside a counted
        one that is not the group's work: a wrapper's inner call).
        """
        self.totals.setdefault(group, [])
        self.counts.setdefault(group, [])
        times: list[float] = []
        self._timed.append((group, -1.0 if subtract else 1.0, times))
        restore = _wrap(owner, name, times)
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
