"""What the tenant scope costs: a picture another tenant sent is processed and encoded again.

With a ``cache_salt``, the identifier vLLM receives for an item is scoped to
the salt (`omnicache.identity.tenant_identifier`), so vLLM's processor cache
and encoder cache no longer answer one tenant with what another sent. The
price: a second tenant's copy of a picture runs the model's processor and
vision encoder again. This measures it on a live vLLM 0.32 engine (in
process, tiny Qwen2-VL of `omnicache.demo.tiny_models`, float32, blocks of
32), one request at a time, each request's text new from its first token (no
prefix hit ever covers the picture, so only those two caches can spare work):

- "first": a picture no request sent before;
- "same tenant": the picture its tenant sent before (caches hit);
- "other tenant": the picture another tenant sent before.

Rows: vLLM alone (no omnicache: its caches are shared by all tenants, which
is the side channel) and omnicache with the front end (``install_mm_uuids``,
what ``OMNICACHE_MM_UUIDS=1`` installs). Columns: median time a request
(end to end, ``LLM.generate`` of 1 token) with the spread (min-max of the
medians of ``--repeats`` passes), the encoder's runs, and the processor
cache's hits. Pictures of ``--side`` pixels (224: 64 image tokens).

Run with the live engine's environment (``./dev live`` prepares ``.venv-live``):

    .venv-live/bin/python benchmarks/bench_tenant_scope.py [--repeats N] [--side PIXELS]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from omnicache.demo.tiny_models import IMAGE_PAD, build_vl_model
from omnicache.integrations.vllm.common import SCHEDULER_CLS

KINDS = ("first", "same tenant", "other tenant")
MODES = ("vLLM alone", "omnicache")


def picture(seed: int, side: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8), "RGB")


def prompt(serial: int, image: Image.Image, salt: str) -> dict[str, Any]:
    return {
        "prompt": (
            f"Request {serial}. <|im_start|>user\nDescribe it.<|vision_start|>{IMAGE_PAD}"
            "<|vision_end|>Which colour is it?<|im_end|>\n<|im_start|>assistant\n"
        ),
        "multi_modal_data": {"image": image},
        "cache_salt": salt,
    }


def engine(model: Path, mode: str) -> Any:
    from vllm import LLM

    args: dict[str, Any] = {
        "model": str(model),
        "block_size": 32,
        "kv_cache_memory_bytes": 64 * 2**20,
        "max_model_len": 2048,
        "max_num_seqs": 4,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
        "limit_mm_per_prompt": {"image": 1},
    }
    if mode == "omnicache":
        args["scheduler_cls"] = SCHEDULER_CLS
    return LLM(**args)


def processor_cache_hits(llm: Any) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:mm_cache_hits")


def one_pass(llm: Any, runs: list[int], side: int, first_seed: int, serial: int) -> dict[str, Any]:
    """Eight pictures, each sent by tenant a, then a again, then b: times and counts by kind."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    found: dict[str, Any] = {kind: {"s": [], "encoder": 0, "hits": 0.0} for kind in KINDS}
    for index in range(8):
        image = picture(first_seed + index, side)
        for kind, salt in zip(KINDS, ("a", "a", "b"), strict=True):
            serial += 1
            before, hits = len(runs), processor_cache_hits(llm)
            start = time.perf_counter()
            llm.generate(prompt(serial, image, salt), params, use_tqdm=False)
            found[kind]["s"].append(time.perf_counter() - start)
            found[kind]["encoder"] += len(runs) - before
            found[kind]["hits"] += processor_cache_hits(llm) - hits
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed passes a mode")
    parser.add_argument("--side", type=int, default=224, help="the pictures' side in pixels")
    args = parser.parse_args()

    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    from omnicache.integrations.vllm.frontend import install_mm_uuids

    runs: list[int] = []
    original = Qwen2VLForConditionalGeneration.embed_multimodal

    def counted(self: Any, **kwargs: Any) -> Any:
        runs.append(1)
        return original(self, **kwargs)

    Qwen2VLForConditionalGeneration.embed_multimodal = counted
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as folder:
        model = build_vl_model(Path(folder) / "qwen2-vl-tiny")
        for mode in MODES:
            if mode == "omnicache":
                install_mm_uuids()  # for every engine from here on
            llm = engine(model, mode)
            one_pass(llm, runs, args.side, 10_000, 0)  # warm-up: other pictures
            passes = [
                one_pass(llm, runs, args.side, 100 * (repeat + 1), 1_000 * (repeat + 1))
                for repeat in range(args.repeats)
            ]
            rows[mode] = {
                kind: {
                    "medians": [statistics.median(p[kind]["s"]) for p in passes],
                    "encoder": sum(p[kind]["encoder"] for p in passes),
                    "hits": sum(p[kind]["hits"] for p in passes),
                    "requests": sum(len(p[kind]["s"]) for p in passes),
                }
                for kind in KINDS
            }
            llm.llm_engine.engine_core.shutdown()
            del llm
    print(
        f"tiny Qwen2-VL, {args.side}x{args.side} pictures, one request at a time, "
        f"{args.repeats} passes of 8 pictures x 3 requests a mode"
    )
    print(
        f"{'mode':<12} {'request':<14} {'median ms':>10} {'spread ms':>13} "
        f"{'encoder runs':>13} {'proc. hits':>11}"
    )
    for mode, kinds in rows.items():
        for kind, row in kinds.items():
            medians = row["medians"]
            spread = f"{min(medians) * 1e3:.1f}-{max(medians) * 1e3:.1f}"
            print(
                f"{mode:<12} {kind:<14} {statistics.median(medians) * 1e3:>10.1f} "
                f"{spread:>13} {row['encoder']:>6}/{row['requests']:<6} "
                f"{int(row['hits']):>5}/{row['requests']:<5}"
            )
    ours = rows["omnicache"]
    cost = statistics.median(ours["other tenant"]["medians"]) / statistics.median(
        ours["same tenant"]["medians"]
    )
    shared = statistics.median(rows["vLLM alone"]["other tenant"]["medians"])
    print(
        f"tenant scope: another tenant's copy takes {cost:.2f}x a cached copy "
        f"({statistics.median(ours['other tenant']['medians']) * 1e3:.1f} ms against "
        f"{statistics.median(ours['same tenant']['medians']) * 1e3:.1f} ms; vLLM alone "
        f"{shared * 1e3:.1f} ms, answered from what the other tenant sent)"
    )


if __name__ == "__main__":
    main()
