"""Long fuzzing run: millions of inputs through the checks of tests/test_fuzz.py.

Each input is one call of a ``check_*`` function (one prompt for
annotate_prompt and BlockHasher, one sequence of operations for
AnnotatedTokens, BlockPool and TensorStore), checked against the reference
models written in that test file. Targets take turns. Input ``i`` draws from
``random.Random(f"{seed}-{i}")``, so a failure is replayed with
``--seed S --start i --iterations 1``.

    .venv/bin/python scripts/fuzz_long.py --iterations 1000000

Prints progress lines while it runs and ends with one summary line::

    fuzz_long: 1000000 inputs (... operations) in ... s, ... inputs/s, 0 failures

Exit status: 0 without failures, 1 with any. Kept out of CI (CI runs the same
checks under hypothesis with a few hundred inputs each).
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"


def load_checks() -> dict[str, Callable[[random.Random], int]]:
    """The ``CHECKS`` of tests/test_fuzz.py (the tests folder is no package)."""
    sys.path.insert(0, str(TESTS))
    checks: dict[str, Callable[[random.Random], int]] = importlib.import_module("test_fuzz").CHECKS
    return checks


CHECKS = load_checks()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=1_000_000, help="inputs to check")
    parser.add_argument("--seed", default="0", help="seed of every input's random source")
    parser.add_argument("--start", type=int, default=0, help="index of the first input")
    parser.add_argument(
        "--targets", nargs="+", choices=sorted(CHECKS), default=sorted(CHECKS), help="targets"
    )
    parser.add_argument("--progress", type=float, default=30.0, help="seconds between lines")
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="stop after this long (default: never)"
    )
    parser.add_argument("--max-failures", type=int, default=20, help="stop after this many")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations: expected >= 1, found {args.iterations}")
    # NOTE: one thread: the checks are tiny tensors, and the run shares the machine.
    torch.set_num_threads(1)

    targets = [(name, CHECKS[name]) for name in args.targets]
    inputs = {name: 0 for name, _ in targets}
    operations = {name: 0 for name, _ in targets}
    failures: list[str] = []
    start = time.perf_counter()
    last = start
    done = 0
    stopped = ""
    for index in range(args.start, args.start + args.iterations):
        name, check = targets[index % len(targets)]
        rng = random.Random(f"{args.seed}-{index}")
        try:
            operations[name] += check(rng)
        except Exception:
            failures.append(
                f"input {index} ({name}, seed {args.seed!r}):\n{traceback.format_exc()}"
            )
            print(failures[-1], file=sys.stderr, flush=True)
        inputs[name] += 1
        done += 1
        now = time.perf_counter()
        if now - last >= args.progress:
            last = now
            print(
                f"  {done}/{args.iterations} inputs, {done / (now - start):.0f} inputs/s, "
                f"{len(failures)} failures",
                flush=True,
            )
        if len(failures) >= args.max_failures:
            stopped = f" (stopped after {len(failures)} failures)"
            break
        if args.max_seconds is not None and now - start >= args.max_seconds:
            stopped = f" (stopped after {args.max_seconds:.0f} s)"
            break
    elapsed = time.perf_counter() - start
    for name, _ in targets:
        print(f"  {name:16s} {inputs[name]:>9d} inputs {operations[name]:>10d} operations")
    print(
        f"fuzz_long: {done} inputs ({sum(operations.values())} operations) in {elapsed:.1f} s, "
        f"{done / elapsed:.0f} inputs/s, {len(failures)} failures{stopped}",
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
