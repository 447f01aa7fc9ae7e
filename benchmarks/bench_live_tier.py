"""What the Redis tier costs a live vLLM 0.32 engine: save and load per block against step time.

A tiny-but-wide random-weight Qwen2 (``--hidden``, default 1024; 2 layers,
float32, blocks of 32; the live tests' model builder) serves
``--requests`` distinct prompts of 480 tokens (15 full blocks each), one new
token each, in vLLM's in-process mode (the worker is an object of this
process), against a Redis server this script starts. Engines, one per row:

- no tier: the store alone (the baseline step);
- tier, saving: the same prompts into an empty tier: every full block's KV
  (both layers) and hidden rows are saved behind (`WorkerTier.save`: the
  copy into the write-behind queue; the writer thread sends);
- tier, loading: a fresh engine, the same prompts: the scheduler asks which
  full blocks exist (`TierReader.held`, ``EXISTS``), and the worker fetches,
  verifies and loads them into the paged cache and the store
  (`WorkerTier.load`, one MGET) instead of computing them; vLLM holds each
  request one step while its blocks load.

Columns: the engine core's step time (median over the steps), the
workload's total step time and its ratio to the engine without a tier, the
tier's work per block (saving: the save calls; loading: the scheduler's
lookups and the worker's loads), and that work's share of the total. Medians over ``--repeats``
passes, each on fresh engines and a flushed database.

Run with the live engine's environment (``./dev live`` prepares ``.venv-live``):

    .venv-live/bin/python benchmarks/bench_live_tier.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from live_timing import Timed

from omnicache.demo.live import STAGED_BYTES, kv_budget
from omnicache.demo.tiny_models import build_text_model
from omnicache.integrations.vllm.common import (
    SCHEDULER_CLS,
    WORKER_CLS,
    store_kv_transfer_config,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer, server_binary

BLOCK_SIZE = 32
PROMPT_TOKENS = 480
MODES = ("no tier", "tier, saving", "tier, loading")


def prompts(count: int) -> list[dict[str, Any]]:
    # Token ids 1..300 are learned tokens; each prompt differs from its first token.
    return [
        {"prompt_token_ids": [(i * 37 + j * 7) % 300 + 1 for j in range(PROMPT_TOKENS)]}
        for i in range(count)
    ]


def engine(model: Path, url: str | None) -> Any:
    from vllm import LLM

    transfer: dict[str, Any] = store_kv_transfer_config(max_staged_bytes=STAGED_BYTES)
    if url is not None:
        transfer["kv_connector_extra_config"].update(tier_url=url, tier_namespace="bench")
        transfer["kv_load_failure_policy"] = "recompute"
    return LLM(
        model=str(model),
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=kv_budget(64 * 2**20, model, store=True),
        max_model_len=1024,
        max_num_seqs=16,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        scheduler_cls=SCHEDULER_CLS,
        worker_cls=WORKER_CLS,
        kv_transfer_config=transfer,
    )


def run(model: Path, url: str | None, count: int) -> dict[str, float]:
    """One engine serving the prompts: median step, tier work per call and per block (ms)."""
    from vllm import SamplingParams

    llm = engine(model, url)
    core = llm.llm_engine.engine_core.engine_core
    step = Timed(core, "step_fn")
    save = load = fetch = None
    # In process: the worker's store and tier, and the scheduler's tier reader.
    tier = core.model_executor.driver_worker.worker.omni_store.tier
    if tier is not None:
        save, load = Timed(tier, "save"), Timed(tier, "load")
        fetch = Timed(core.scheduler.omni_mirror._reader, "held")
    before = None if tier is None else (tier.stats.num_saved_blocks, tier.stats.num_loaded_blocks)
    llm.generate(prompts(count), SamplingParams(max_tokens=1), use_tqdm=False)
    result = {"step": 1e3 * statistics.median(step.times), "steps": 1e3 * sum(step.times)}
    if tier is not None and before is not None and save and load and fetch:
        saved = tier.stats.num_saved_blocks - before[0]
        loaded = tier.stats.num_loaded_blocks - before[1]
        assert llm.collective_rpc("omni_tier_flush") == [True]
        if loaded:
            assert loaded == count * ((PROMPT_TOKENS - 1) // BLOCK_SIZE), loaded
            work, blocks = sum(load.times) + sum(fetch.times), loaded
        else:
            assert saved == count * (PROMPT_TOKENS // BLOCK_SIZE), saved
            work, blocks = sum(save.times), saved
        result["tier"] = 1e3 * work
        result["block"] = 1e3 * work / blocks
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    passes: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer.start_private(Path(tmp) / "redis", server_binary())
        try:
            model = build_text_model(Path(tmp) / "qwen2-wide", hidden_size=args.hidden)
            for _ in range(args.repeats):
                server.client().flushdb()
                passes["no tier"].append(run(model, None, args.requests))
                passes["tier, saving"].append(run(model, server.url, args.requests))
                passes["tier, loading"].append(run(model, server.url, args.requests))
        finally:
            server.shut_for_good()

    print(
        f"\nhidden {args.hidden}, float32, 2 layers; {args.requests} x {PROMPT_TOKENS} tokens, "
        f"1 new token each; median step, median of {args.repeats} passes"
    )
    print(
        f"{'':<15}{'step ms':>10}{'total ms':>10}{'/ no tier':>10}{'tier ms/block':>15}"
        f"{'tier share':>12}"
    )
    base = statistics.median(p["steps"] for p in passes["no tier"])
    for mode, runs in passes.items():
        row = {k: statistics.median(p[k] for p in runs) for k in runs[0]}
        block = f"{row['block']:.3f}" if "block" in row else "-"
        # The tier's work over all the workload's steps, against their total time.
        share = f"{100 * row['tier'] / row['steps']:.1f}%" if "tier" in row else "-"
        print(
            f"{mode:<15}{row['step']:>10.3f}{row['steps']:>10.1f}{row['steps'] / base:>9.3f}x"
            f"{block:>15}{share:>12}"
        )


if __name__ == "__main__":
    main()
