"""What keeping hidden states costs a live vLLM 0.32 engine: capture + store per step.

A tiny-but-wide random-weight Qwen2 (``--hidden``, default 1024; 2 layers,
float32, blocks of 32; the live tests' model builder) serves two workloads in
vLLM's in-process mode, where the worker is an object of this process:

- prefill: ``--prefill-requests`` distinct prompts of 480 tokens, one new
  token each;
- rows: the same prompts again, asking for their prompt's hidden states
  (every full block a hit: its rows come from the store, and each request's
  480 rows are gathered for the caller; the modes without the store serve
  the hits without rows);
- decode: 4 prompts of 64 tokens, ``--decode-tokens`` new tokens each.

Rows, one engine each: vLLM's own prefix caching (the baseline); omnicache's
keys (``scheduler_cls`` only); omnicache's keys and the store (plus
`OmniCPUWorker` and `OmniStoreConnector`, every step's rows written at their
slots). Columns: the engine core's step time (median over the workload's
steps), the worker's store work per step (`LiveStore.apply`: clears, row
writes, hit checks, prompt results; median) and its share of the steps (the
workload's store time over its step time: the steps that write the rows of
the staged decode steps count in full, and so does the write of those the
workload's last steps left staged). Medians over
``--repeats`` passes; the modes take turns, each pass on a fresh engine
after a warm-up workload of its own.

Run with the live engine's environment (``./dev live`` prepares ``.venv-live``):

    .venv-live/bin/python benchmarks/bench_live_store.py [--repeats N]
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

from live_timing import Timed

from omnicache.demo.live import kv_budget
from omnicache.demo.tiny_models import build_text_model
from omnicache.integrations.vllm.common import (
    SCHEDULER_CLS,
    WORKER_CLS,
    store_kv_transfer_config,
)
from omnicache.integrations.vllm.staged_steps import MAX_STAGED_BYTES

BLOCK_SIZE = 32
MODES = ("vLLM", "omnicache keys", "keys + store")
WORKLOADS = ("prefill", "rows", "decode")


def prompts(workload: str, args: argparse.Namespace, salt: str) -> list[dict[str, Any]]:
    if workload == "prefill":
        count, length = args.prefill_requests, 480
    else:
        count, length = 4, 64
    # Token ids 1..300 are learned tokens; each prompt differs from its first token.
    return [
        {
            "prompt_token_ids": [(i * 37 + j * 7) % 300 + 1 for j in range(length)],
            "cache_salt": salt,
        }
        for i in range(count)
    ]


def engine(mode: str, model: Path) -> Any:
    from vllm import LLM

    options: dict[str, Any] = {
        "model": str(model),
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": kv_budget(
            32 * 2**20, model, store=mode == "keys + store", staged_bytes=MAX_STAGED_BYTES
        ),
        "max_model_len": 1024,
        "max_num_seqs": 16,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
    }
    if mode != "vLLM":
        options["scheduler_cls"] = SCHEDULER_CLS
    if mode == "keys + store":
        options["worker_cls"] = WORKER_CLS
        options["kv_transfer_config"] = store_kv_transfer_config(max_staged_bytes=MAX_STAGED_BYTES)
    return LLM(**options)


def run_pass(mode: str, model: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from vllm import SamplingParams

    llm = engine(mode, model)
    core = llm.llm_engine.engine_core.engine_core
    step = Timed(core, "step_fn")
    apply: Timed | None = None
    live = None
    if mode == "keys + store":
        live = core.model_executor.driver_worker.worker.omni_store
        apply = Timed(live, "apply")
    ask = {"omnicache_prompt_hidden_states": True} if mode == "keys + store" else None
    results: dict[str, dict[str, float]] = {}
    for salt in ("warm-up", "measured"):
        for workload in WORKLOADS:
            step.times.clear()
            if apply is not None:
                apply.times.clear()
            kind = "decode" if workload == "decode" else "prefill"
            # NOTE: the rows pass sends the prefill pass's prompts again.
            batch = prompts(kind, args, f"{salt}/{kind}")
            if workload == "decode":
                params = SamplingParams(max_tokens=args.decode_tokens)
            else:
                extra = ask if workload == "rows" else None
                params = SamplingParams(max_tokens=1, extra_args=extra)
            outputs = llm.generate(batch, params, use_tqdm=False)
            if workload == "rows" and ask is not None:
                from omnicache.integrations.vllm.results import take_prompt_hidden_states

                states = take_prompt_hidden_states(llm, outputs)
                assert all(s is not None and s.shape[0] == 480 for s in states)
            if workload == "rows":
                assert all(o.num_cached_tokens == 479 // BLOCK_SIZE * BLOCK_SIZE for o in outputs)
            # NOTE: the rows of the workload's last staged decode steps wait for
            # the engine's next step (here the next workload's): written now,
            # and counted with this workload's store work.
            flush_s = 0.0
            if live is not None:
                start = time.perf_counter()
                live.flush()
                flush_s = time.perf_counter() - start
            step_s = statistics.median(step.times)
            apply_s = statistics.median(apply.times) if apply is not None else 0.0
            # NOTE: the share is of the totals: a step that writes the staged
            # decode steps' rows counts in full.
            share = (sum(apply.times) + flush_s) / sum(step.times) if apply is not None else 0.0
            results[workload] = {"step ms": 1e3 * step_s, "store ms": 1e3 * apply_s, "share": share}
    llm.llm_engine.engine_core.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--prefill-requests", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    passes: dict[str, list[dict[str, dict[str, float]]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_text_model(Path(tmp) / "qwen2-wide", hidden_size=args.hidden)
        for _ in range(args.repeats):
            for mode in MODES:
                passes[mode].append(run_pass(mode, model, args))

    print(
        f"\nhidden {args.hidden}, float32; prefill: {args.prefill_requests} x 480 tokens; rows: "
        f"the same again, asking for their prompt rows (hits); decode: 4 x 64 tokens + "
        f"{args.decode_tokens} new; median step, median of {args.repeats} passes"
    )
    header = f"{'':<16}" + "".join(
        f"{w + ' step ms':>20}{'store ms':>10}{'share':>8}{'/ vLLM':>8}" for w in WORKLOADS
    )
    print(header)
    rows = {
        mode: {
            w: {
                k: statistics.median(p[w][k] for p in runs)
                for k in ("step ms", "store ms", "share")
            }
            for w in WORKLOADS
        }
        for mode, runs in passes.items()
    }
    for mode, row in rows.items():
        cells = []
        for w in WORKLOADS:
            step_ms, store_ms = row[w]["step ms"], row[w]["store ms"]
            share = f"{100 * row[w]['share']:.2f}%" if store_ms else "-"
            ratio = step_ms / rows["vLLM"][w]["step ms"]
            cells.append(f"{step_ms:>20.3f}{store_ms:>10.3f}{share:>8}{ratio:>7.3f}x")
        print(f"{mode:<16}" + "".join(cells))


if __name__ == "__main__":
    main()
