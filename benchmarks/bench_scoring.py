"""Multiple-choice scoring on a live vLLM 0.32 engine: prompt logprobs from the prefix cache.

An evaluation harness scores each answer choice by the log-likelihood of its
tokens after a long few-shot prompt: one request per (item, choice), each
with ``prompt_logprobs``, and every request shares the prompt's prefix. vLLM
keeps such requests off its prefix cache; omnicache scores a hit's positions
from the rows its store keeps. The model is a tiny-but-wide random-weight
Qwen2-VL (``--hidden``, default 1024; 2 layers, ``--dtype`` float32, blocks of 32; the
live tests' builder). The few-shot prefix holds two pictures and question /
answer lines, at least 1,500 tokens in all; ``--items`` items of 4 choices
follow it, all sent in one ``generate`` call, as a harness batches them,
with lm-evaluation-harness's parameters (``prompt_logprobs=1``, one token
out, ``detokenize=False``).

Modes, one in-process engine each, in one run: prefix caching off; vLLM's
own prefix caching; omnicache (its scheduler, worker and connector); and,
for reference, vLLM's caching on the same requests without prompt logprobs
(what caching saves when nothing needs the prefix's rows). Columns: wall
time of the batch (median of ``--repeats`` passes, each on a fresh engine
after a warm-up batch under another salt), prefix-cache hit tokens, the
ratio to vLLM's caching, whether every prompt logprob equals the engine's
without caching (the same token ids and ranks at every position, values
within 1e-5), and for omnicache the worker's time in the store (its step
work) and, inside it, scoring the hits' positions.

Run with the live engine's environment (``./dev live`` prepares ``.venv-live``):

    .venv-live/bin/python benchmarks/bench_scoring.py [--hidden 1024] [--items 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np
from live_timing import Timed
from PIL import Image

from omnicache.demo.live import STAGED_BYTES, kv_budget
from omnicache.demo.tiny_models import build_vl_model
from omnicache.integrations.vllm.common import (
    SCHEDULER_CLS,
    WORKER_CLS,
    store_kv_transfer_config,
)

BLOCK_SIZE = 32
MODES = ("caching off", "vLLM caching", "omnicache", "vLLM, no prompt logprobs")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
CHOICES = (" blue", " green", " red", " the colour of grass")
ATOL = 1e-5


def picture(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def requests(items: int, salt: str) -> list[dict[str, Any]]:
    """One prompt per (item, choice): the few-shot prefix, the item's question, the choice."""
    shots = " ".join(
        f"Question {i}: which colour is the sky at noon? Answer: blue." for i in range(30)
    )
    prefix = (
        f"<|im_start|>user\nLook at both pictures.{IMAGE}{IMAGE}Describe the picture in one "
        f"sentence, please, and name every colour in it. {shots}"
    )
    pictures = {"image": [picture(1), picture(2)]}
    return [
        {
            "prompt": f"{prefix} Question {100 + item}: which colour is it? Answer:{choice}",
            "multi_modal_data": pictures,
            "cache_salt": salt,
        }
        for item in range(items)
        for choice in CHOICES
    ]


def engine(mode: str, model: Path, dtype: str) -> Any:
    from vllm import LLM

    options: dict[str, Any] = {
        "model": str(model),
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": kv_budget(64 * 2**20, model, store=mode == "omnicache"),
        "max_model_len": 2048,
        "max_num_seqs": 32,
        "enable_prefix_caching": mode != "caching off",
        "enforce_eager": True,
        "dtype": dtype,
        "seed": 0,
        "limit_mm_per_prompt": {"image": 2},
    }
    if mode == "omnicache":
        options.update(
            scheduler_cls=SCHEDULER_CLS,
            worker_cls=WORKER_CLS,
            kv_transfer_config=store_kv_transfer_config(max_staged_bytes=STAGED_BYTES),
        )
    return LLM(**options)


class TimedHitLogprobs:
    """The worker's `HitLogprobs`, adding each call's wall time to a list."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.times: list[float] = []

    def wants(self, req_id: str) -> bool:
        return bool(self.inner.wants(req_id))

    def score(self, *args: Any) -> None:
        start = time.perf_counter()
        self.inner.score(*args)
        self.times.append(time.perf_counter() - start)


def run_pass(mode: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    llm = engine(mode, model, args.dtype)
    items = args.items
    scoring = mode != "vLLM, no prompt logprobs"
    # NOTE: as lm-evaluation-harness's vLLM backend asks for log-likelihoods:
    # the values only, no detokenized tokens.
    params = SamplingParams(
        max_tokens=1,
        temperature=0,
        prompt_logprobs=1 if scoring else None,
        detokenize=False,
    )
    apply: Timed | None = None
    score: TimedHitLogprobs | None = None
    if mode == "omnicache":
        worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        apply = Timed(worker.omni_store, "apply")
        score = TimedHitLogprobs(worker.omni_store.hits.logprobs)
        worker.omni_store.hits.logprobs = score
    llm.generate(requests(items, "warm-up"), params, use_tqdm=False)
    for timed in (apply, score):
        if timed is not None:
            timed.times.clear()
    start = time.perf_counter()
    outputs = llm.generate(requests(items, "measured"), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.llm_engine.engine_core.shutdown()
    return {
        "seconds": seconds,
        "hits": sum(output.num_cached_tokens for output in outputs),
        "tokens": sum(len(output.prompt_token_ids) for output in outputs),
        "logprobs": [output.prompt_logprobs for output in outputs] if scoring else None,
        "store s": sum(apply.times) if apply is not None else None,
        "scoring s": sum(score.times) if score is not None else None,
    }


def compare(got: list[Any], want: list[Any]) -> tuple[int, int, float]:
    """Positions whose token ids or ranks differ, positions in all, and the largest logprob
    difference of the tokens both have, over every request."""
    differ = total = 0
    largest = 0.0
    for mine, theirs in zip(got, want, strict=True):
        for a, b in zip(mine[1:], theirs[1:], strict=True):
            total += 1
            if sorted(a) != sorted(b) or any(a[t].rank != b[t].rank for t in a):
                differ += 1
            largest = max(largest, *(abs(a[t].logprob - b[t].logprob) for t in a if t in b))
    return differ, total, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--items", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    passes: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_vl_model(Path(tmp) / "qwen2-vl-wide", hidden_size=args.hidden)
        for _ in range(args.repeats):
            for mode in MODES:
                passes[mode].append(run_pass(mode, model, args))

    first = passes["caching off"][0]
    num_requests = args.items * len(CHOICES)
    print(
        f"\nhidden {args.hidden}, {args.dtype}, 2 layers; {num_requests} requests "
        f"({args.items} items x {len(CHOICES)} choices) of {first['tokens'] // num_requests} "
        "tokens each, sharing a few-shot prefix with 2 pictures; one token out; median of "
        f"{args.repeats} passes"
    )
    print(
        f"{'':<26}{'time s':>9}{'hit tokens':>18}{'/ vLLM caching':>16}"
        f"{'logprobs == off':>20}{'store s':>9}{'scoring s':>10}"
    )
    reference = statistics.median(p["seconds"] for p in passes["vLLM caching"])
    for mode, runs in passes.items():
        seconds = statistics.median(p["seconds"] for p in runs)
        hits = f"{runs[0]['hits']:,} of {runs[0]['tokens']:,}"
        if runs[0]["logprobs"] is None:
            equal = "-"
        else:
            found = [compare(p["logprobs"], first["logprobs"]) for p in runs]
            differ, largest = max(f[0] for f in found), max(f[2] for f in found)
            equal = f"yes ({largest:.0e})" if not differ else f"{differ} differ ({largest:.0e})"
        store = runs[0]["store s"]
        cells = (
            f"{statistics.median(p['store s'] for p in runs):>9.3f}"
            f"{statistics.median(p['scoring s'] for p in runs):>10.3f}"
            if store is not None
            else f"{'-':>9}{'-':>10}"
        )
        print(f"{mode:<26}{seconds:>9.3f}{hits:>18}{reference / seconds:>15.1f}x{equal:>20}{cells}")


if __name__ == "__main__":
    main()
