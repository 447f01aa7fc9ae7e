"""A live vLLM 0.32 engine serving a multimodal workload: caching off, vLLM's own, omnicache.

Workload (``--requests``, default 48): a tiny random-weight Qwen2-VL (the
live tests' model, built here, float32, blocks of 32), each request a shared
system preamble (~100 tokens), one of ``--images`` pictures (224 x 224: 64
image tokens; most repeat) and one of 4 questions, under one of 3
``cache_salt``s (tenants), ``--max-tokens`` greedy tokens each. The whole
workload goes to ``LLM.generate`` at once (``max_num_seqs`` 8), so requests
batch as they would on a busy server.

Rows, one engine each (vLLM's in-process mode, so the engine core's step and
the scheduler can be timed from here):

- off: prefix caching off;
- vLLM: vLLM's own prefix caching (its block keys, its image hashes);
- omnicache: ``scheduler_cls`` = `OmniScheduler` and each prompt's
  ``multi_modal_uuids`` from `multi_modal_uuids` (computed inside the timed
  region: what a user pays for the digests).

Columns: requests/s and prompt tokens/s over the wall time of the workload,
mean time to first token (vLLM's per-request first-token latency), the
prefix-cache hit rate (vLLM's counters: hit tokens / queried tokens), the
engine core's step time and the scheduler's own time per step
(``schedule`` + ``update_from_output``). Each row is the median of
``--repeats`` passes; the modes take turns, each pass on a fresh engine after
one warm-up pass of its own (other salts), the prefix cache reset in between.
A second table times one image's identifier: omnicache's content digest
against vLLM's own multimodal hash.

Run with the live engine's environment (``./dev live`` prepares ``.venv-live``):

    .venv-live/bin/python benchmarks/bench_live_engine.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# In-process engines: the engine core and its scheduler are objects of this process.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from live_timing import Timed

from omnicache.demo.tiny_models import IMAGE_PAD, build_vl_model
from omnicache.integrations.vllm import multi_modal_uuids
from omnicache.integrations.vllm.common import SCHEDULER_CLS

BLOCK_SIZE = 32
SALTS = ("tenant-0", "tenant-1", "tenant-2")
QUESTIONS = (
    "Which colour is it?",
    "What is in the picture?",
    "Describe it in one word.",
    "Is it bright or dark?",
)
PREAMBLE = "Describe the picture in one sentence, please, and name every colour in it. " * 3
MODES = ("off", "vLLM", "omnicache")


def picture(seed: int, side: int = 224) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8), "RGB")


def workload(num_requests: int, num_images: int, seed: int) -> list[tuple[str, int, str]]:
    """(salt, image seed, question) per request: images and questions repeat within a salt."""
    rng = np.random.default_rng(seed)
    return [
        (
            SALTS[i % len(SALTS)],
            int(rng.integers(num_images)),
            QUESTIONS[int(rng.integers(len(QUESTIONS)))],
        )
        for i in range(num_requests)
    ]


def prompt(salt: str, image: Image.Image, question: str, *, with_uuids: bool) -> dict[str, Any]:
    mm_data = {"image": image}
    text = (
        f"<|im_start|>user\n{PREAMBLE}<|vision_start|>{IMAGE_PAD}<|vision_end|>"
        f"{question}<|im_end|>\n<|im_start|>assistant\n"
    )
    built: dict[str, Any] = {"prompt": text, "multi_modal_data": mm_data, "cache_salt": salt}
    if with_uuids:
        built["multi_modal_uuids"] = multi_modal_uuids(mm_data, cache_salt=salt)
    return built


def counters(llm: Any) -> tuple[float, float]:
    names = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    values = {metric.name: metric.value for metric in llm.get_metrics() if metric.name in names}
    return values[names[0]], values[names[1]]


def run_mode(
    mode: str, model: Path, requests: list[tuple[str, int, str]], args: argparse.Namespace
) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    options: dict[str, Any] = {
        "model": str(model),
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": 256 * 2**20,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "enable_prefix_caching": mode != "off",
        "disable_log_stats": False,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
        "limit_mm_per_prompt": {"image": 1},
    }
    if mode == "omnicache":
        options["scheduler_cls"] = SCHEDULER_CLS
    llm = LLM(**options)
    core = llm.llm_engine.engine_core.engine_core
    schedule = Timed(core.scheduler, "schedule")
    update = Timed(core.scheduler, "update_from_output")
    step = Timed(core, "step_fn")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    images = {seed: picture(1000 + seed) for seed in range(args.images)}
    with_uuids = mode == "omnicache"

    def one_pass(salt_prefix: str) -> dict[str, float]:
        llm.reset_prefix_cache()
        for timer in (schedule, update, step):
            timer.times.clear()
        queries0, hits0 = counters(llm)
        start = time.perf_counter()
        prompts = [
            prompt(salt_prefix + salt, images[seed], question, with_uuids=with_uuids)
            for salt, seed, question in requests
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        queries, hits = counters(llm)
        prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        steps = len(step.times)
        return {
            "req/s": len(outputs) / wall,
            "prompt tok/s": prompt_tokens / wall,
            "TTFT ms": 1e3 * statistics.fmean(o.metrics.first_token_latency for o in outputs),
            # Caching off queries nothing: its hit rate is 0.
            "hit rate": (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0,
            "step ms": 1e3 * sum(step.times) / steps,
            "sched us/step": 1e6 * (sum(schedule.times) + sum(update.times)) / steps,
        }

    one_pass("warm-up/")
    measured = one_pass("")
    llm.llm_engine.engine_core.shutdown()
    return measured


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def digest_costs(repeats: int) -> list[tuple[str, float, float]]:
    """Per image side: omnicache's digest and vLLM's own multimodal hash, in seconds."""
    from vllm.multimodal.hasher import MultiModalHasher

    rows = []
    for side in (224, 448, 1024):
        image = picture(7, side)
        ours = median_time(lambda image=image: multi_modal_uuids({"image": image}), repeats)
        theirs = median_time(
            lambda image=image: MultiModalHasher.hash_kwargs("blake3", model_id="m", image=image),
            repeats,
        )
        rows.append((f"{side} x {side}", ours, theirs))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    requests = workload(args.requests, args.images, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_vl_model(Path(tmp) / "qwen2-vl-tiny")
        # Modes take turns, a fresh engine each pass, so that noise spreads over all of them.
        passes: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                passes[mode].append(run_mode(mode, model, requests, args))
    rows = {
        mode: {name: statistics.median(p[name] for p in runs) for name in runs[0]}
        for mode, runs in passes.items()
    }

    names = list(rows["off"])
    print(
        f"\n{args.requests} requests ({len(SALTS)} salts, {args.images} images, "
        f"{len(QUESTIONS)} questions), {args.max_tokens} tokens each; "
        f"median of {args.repeats} passes"
    )
    print(f"{'':<11}" + "".join(f"{name:>15}" for name in names))
    for mode, row in rows.items():
        print(f"{mode:<11}" + "".join(f"{row[name]:>15.3f}" for name in names))
    for label, top, bottom in (("omni/vLLM", "omnicache", "vLLM"), ("vLLM/off", "vLLM", "off")):
        ratios = [
            f"{rows[top][n] / rows[bottom][n]:>14.3f}x" if rows[bottom][n] else f"{'-':>15}"
            for n in names
        ]
        print(f"{label:<11}" + "".join(ratios))

    print("\nOne image's identifier (median of 20)")
    print(f"{'image':<12}{'omnicache ms':>14}{'vLLM ms':>10}{'ratio':>8}")
    for side, ours, theirs in digest_costs(20):
        print(f"{side:<12}{1e3 * ours:>14.3f}{1e3 * theirs:>10.3f}{ours / theirs:>7.2f}x")


if __name__ == "__main__":
    main()
