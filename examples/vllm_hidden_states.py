"""Prompt hidden states from a live vLLM engine with omnicache, end to end on CPU.

A tiny Qwen2-VL with random weights is built locally (nothing is downloaded)
and served by vLLM's CPU engine with omnicache's scheduler, worker and
connector. The same picture is asked about twice and another picture once,
by two tenants: the second request hits the first one's blocks, and every
request gets its prompt's hidden states, those of the cached prefix read from
the worker's store, equal to an engine without caching.

Run it in the live engine's environment (``./dev live`` prepares it):

    .venv-live/bin/python examples/vllm_hidden_states.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from omnicache.integrations.vllm.common import (
    SCHEDULER_CLS,
    WORKER_CLS,
    live_engine_missing,
    store_kv_transfer_config,
)

PROMPT = (
    "<|im_start|>user\nDescribe the picture in one sentence, please, and name every colour "
    "in it.<|vision_start|><|image_pad|><|vision_end|>Which colour is it?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def picture(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def main() -> None:
    missing = live_engine_missing()
    if missing is not None:
        sys.exit(f"{missing}: run ./dev live once to prepare .venv-live")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process: starts in seconds
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from vllm import LLM, SamplingParams

    from omnicache.demo.tiny_models import build_vl_model
    from omnicache.integrations.vllm import multi_modal_uuids
    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    model = build_vl_model(Path(tempfile.mkdtemp()) / "qwen2-vl-tiny")
    common = dict(
        model=str(model),
        block_size=32,
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=512,
        enforce_eager=True,
        dtype="float32",
        worker_cls=WORKER_CLS,
        kv_transfer_config=store_kv_transfer_config(),
        limit_mm_per_prompt={"image": 1},
    )
    params = SamplingParams(
        max_tokens=4, temperature=0, extra_args={"omnicache_prompt_hidden_states": True}
    )
    requests = [(1, "tenant-a"), (1, "tenant-a"), (2, "tenant-a"), (1, "tenant-b")]

    def serve(llm: LLM) -> tuple[list[int], list[torch.Tensor | None]]:
        outputs = []
        for seed, salt in requests:
            mm_data = {"image": picture(seed)}
            prompt = {
                "prompt": PROMPT,
                "multi_modal_data": mm_data,
                "multi_modal_uuids": multi_modal_uuids(mm_data, cache_salt=salt),
                "cache_salt": salt,
            }
            outputs += llm.generate(prompt, params, use_tqdm=False)
        return [o.num_cached_tokens for o in outputs], take_prompt_hidden_states(llm, outputs)

    llm = LLM(**common, enable_prefix_caching=True, scheduler_cls=SCHEDULER_CLS)
    hits, states = serve(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    reference = LLM(**common, enable_prefix_caching=False)
    _, expected = serve(reference)
    print(f"{'request':<22} {'cached tokens':>13} {'hidden states':>15} {'== no caching':>13}")
    for (seed, salt), hit, got, want in zip(requests, hits, states, expected, strict=True):
        assert got is not None and want is not None
        same = torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        print(f"picture {seed}, {salt:<11} {hit:>13} {tuple(got.shape)!s:>15} {same!s:>13}")


if __name__ == "__main__":
    main()
