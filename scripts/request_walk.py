"""How one live request walks through the project's modules: moves, and calls back.

A tiny random-weight Qwen2 is served in process by vLLM's CPU engine with
omnicache's scheduler, worker and connector. A first request fills the
cache; the measured one hits its first 3 blocks and asks for its prompt
hidden states and prompt logprobs, and its hidden states are taken. From
its ``generate`` call through `take_prompt_hidden_states`, a profile hook
follows every call into a function of ``omnicache/`` or ``hashing/`` (of the
checkout imported: run from another with ``PYTHONPATH=<checkout>``). Its
caller is the innermost project frame below it (vLLM's frames in between
do not count). The figures:

- modules entered;
- moves: calls from one module into another, and the distinct (caller,
  callee) pairs among them;
- calls back (A -> B -> A): calls into a module that is already on the stack
  below the caller, that is, a call that runs back into a module it left;
- pairs both ways: modules that call each other, at any time of the walk.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMNICACHE_REQUIRE_VLLM_LIVE=1 \\
        .venv-live/bin/python scripts/request_walk.py [--json] [--by-file-only-integration]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler, worker and model in this process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import omnicache

ROOT = Path(omnicache.__file__).resolve().parent.parent
PACKAGES = ("omnicache", "hashing")
INTEGRATION = "omnicache.integrations.vllm"
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
PREFIX = [(7 * i) % 300 + 1 for i in range(3 * BLOCK_SIZE)]  # learned ids are 0..~430
FIRST = PREFIX + [(11 * i) % 300 + 1 for i in range(20)]
MEASURED = PREFIX + [(13 * i) % 300 + 1 for i in range(20)]
LABELS = {
    "modules entered": "num_modules",
    "moves": "num_moves",
    "distinct moves": "num_distinct_moves",
    "calls back": "num_calls_back",
    "pairs both ways": "num_pairs_both_ways",
}


class Walk:
    """Every call into a project module, and the project's stack, as a profile hook."""

    def __init__(self) -> None:
        # (caller module or None: from outside the project, callee module, whether
        # the callee was on the stack below the caller).
        self.calls: list[tuple[str | None, str, bool]] = []
        self._stacks: dict[int, list[str]] = {}
        self._code_to_module: dict[CodeType, str | None] = {}

    def module(self, code: CodeType) -> str | None:
        """The dotted module of a project code object; None for any other code."""
        if code not in self._code_to_module:
            path = Path(code.co_filename).resolve()
            name = None
            if path.suffix == ".py" and path.is_relative_to(ROOT):
                parts = path.relative_to(ROOT).with_suffix("").parts
                if parts[0] in PACKAGES:
                    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self._code_to_module[code] = name
        return self._code_to_module[code]

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        # NOTE: a frame left by an exception has its "return" event too, and a
        # generator's every resume and yield a "call" and a "return": each
        # thread's stack of project frames stays balanced.
        if event not in ("call", "return"):
            return  # c_call and friends: C code is no project frame
        module = self.module(frame.f_code)
        if module is None:
            return
        stack = self._stacks.setdefault(threading.get_ident(), [])
        if event == "return":
            if stack:
                stack.pop()
            return
        caller = stack[-1] if stack else None
        if caller != module:
            self.calls.append((caller, module, module in stack))
        stack.append(module)


def _by_count(item: tuple[tuple[str, str], int]) -> tuple[int, tuple[str, str]]:
    return -item[1], item[0]


def figures(calls: list[tuple[str | None, str, bool]]) -> dict[str, Any]:
    """The walk's figures (see the module)."""
    moves = [(a, b, back) for a, b, back in calls if a is not None]
    pairs = {(a, b) for a, b, _ in moves}
    back = Counter((b, a) for a, b, is_back in moves if is_back)
    both = sorted({tuple(sorted(pair)) for pair in pairs if pair[::-1] in pairs})
    return {
        "num_modules": len({b for _, b, _ in calls}),
        "modules": sorted({b for _, b, _ in calls}),
        "num_moves": len(moves),
        "num_distinct_moves": len(pairs),
        "num_calls_back": sum(back.values()),
        "calls_back": [
            [a, b, n] for (a, b), n in sorted(back.items(), key=lambda p: (-p[1], p[0]))
        ],
        "num_pairs_both_ways": len(both),
        "pairs_both_ways": [list(pair) for pair in both],
    }


def measure() -> tuple[list[tuple[str | None, str, bool]], dict[str, Any]]:
    """The measured request's walk, and facts about the request."""
    from vllm import LLM, SamplingParams

    from omnicache.demo.tiny_models import build_text_model
    from omnicache.integrations.vllm.common import (
        PROMPT_HIDDEN_STATES,
        SCHEDULER_CLS,
        WORKER_CLS,
        store_kv_transfer_config,
    )
    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    model = build_text_model(Path(tempfile.mkdtemp()) / "qwen2-tiny")
    llm = LLM(
        model=str(model),
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=512,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        scheduler_cls=SCHEDULER_CLS,
        worker_cls=WORKER_CLS,
        kv_transfer_config=store_kv_transfer_config(),
    )
    params = SamplingParams(
        max_tokens=4, temperature=0, prompt_logprobs=1, extra_args={PROMPT_HIDDEN_STATES: True}
    )
    # The first request asks the same, so first-use paths (imports, caches) are behind us.
    first = llm.generate({"prompt_token_ids": FIRST}, params, use_tqdm=False)
    take_prompt_hidden_states(llm, first)
    walk = Walk()
    threading.setprofile(walk)
    sys.setprofile(walk)
    try:
        outputs = llm.generate({"prompt_token_ids": MEASURED}, params, use_tqdm=False)
        (rows,) = take_prompt_hidden_states(llm, outputs)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    (output,) = outputs
    assert output.num_cached_tokens >= 2 * BLOCK_SIZE, output.num_cached_tokens
    assert rows is not None and output.prompt_logprobs is not None
    facts = {
        "num_prompt_tokens": len(MEASURED),
        "num_cached_tokens": output.num_cached_tokens,
        "hidden_states": list(rows.shape),
    }
    llm.llm_engine.engine_core.shutdown()
    return walk.calls, facts


def print_table(title: str, result: dict[str, Any]) -> None:
    print(f"\n{title}")
    for label, key in LABELS.items():
        print(f"  {label:<18}{result[key]:>6}")
    print("  modules:", *result["modules"], sep="\n    ")
    print("  calls back (A -> B -> A: A, B, count):")
    for a, b, n in result["calls_back"]:
        print(f"    {n:>5}  {a} -> {b} -> {a}")
    print("  pairs both ways:")
    for a, b in result["pairs_both_ways"]:
        print(f"    {a} <-> {b}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON dict")
    parser.add_argument(
        "--by-file-only-integration",
        action="store_true",
        help=f"also the walk restricted to {INTEGRATION} (other modules dropped, repeats merged)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    calls, facts = measure()
    result: dict[str, Any] = {"omnicache": omnicache.__file__, **facts, "all": figures(calls)}
    if args.by_file_only_integration:
        inside = f"{INTEGRATION}."
        result["integration"] = figures(
            [c for c in calls if f"{c[1]}.".startswith(inside) and f"{c[0]}.".startswith(inside)]
        )
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"request_walk: omnicache from {result['omnicache']}; {facts['num_cached_tokens']} of "
        f"{facts['num_prompt_tokens']} prompt tokens cached; hidden states "
        f"{tuple(facts['hidden_states'])}; {result['wall_seconds']} s"
    )
    print_table("whole project (omnicache/, hashing/)", result["all"])
    if "integration" in result:
        print_table(f"{INTEGRATION} only", result["integration"])


if __name__ == "__main__":
    main()
