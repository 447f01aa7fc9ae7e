"""What keeping hidden states costs a live vLLM 0.32 engine: capture + store per step.

A tiny-but-wide random-weight Qwen2 (``--hidden``, default 1024; 2 layers,
float32, blocks of 32; the live tests' model builder) serves these workloads
in vLLM's in-process mode, where the worker is an object of this process:

- prefill: ``--prefill-requests`` distinct prompts of 480 tokens, one new
  token each;
- rows: the same prompts again, asking for their prompt's hidden states
  (every full block a hit: its rows come from the store, and each request's
  480 rows are gathered for the caller; the modes without the store serve
  the hits without rows);
- decode: 4 prompts of 64 tokens, ``--decode-tokens`` new tokens each;
- batch: 16 prompts of 64 to 79 tokens, ``--decode-tokens`` new tokens
  each: each request starts its blocks at another step, so that most steps
  take a block from vLLM's free queue (which clears it).

Rows, one engine each: vLLM's own prefix caching (the baseline); omnicache's
keys (``scheduler_cls`` only); omnicache's keys and the store (plus
`OmniCPUWorker` and `OmniStoreConnector`, every step's rows written at their
slots). Columns: the engine core's step time (median over the workload's
steps); the step's time besides the model's forward pass ("other": every
mode's own work, and vLLM's, per step); the store's work in a step (median
over the steps), on each side: the worker's (the capture around the forward
pass: the step's slots and batch order, read before it, and `LiveStore.apply`
after it: row writes, hit checks, prompt results; omnicache's worker's own
``execute_model`` around vLLM's; and the connector's worker hooks vLLM calls
each step, ``start_load_kv`` with `LiveStore.start_step`
among them; not its per-layer hooks, which return at once: one of them
times the timers, below) and the scheduler's (the mirror's
records of vLLM's allocations and reuses, `StoreMirror.on_allocated` and
``on_cleared``, the cap of each hit to the stamped blocks, and the
connector's scheduler hooks, ``build_connector_meta`` with the step's plan
among them; a decode token's allocation, which the manager only queues,
is recorded inside whichever of these reads the mirror's table first);
their shares of the steps (the workload's store time over its step time: the
steps that write the rows of the staged decode steps count in full, and so
does the write of those the workload's last steps left staged); the store's
other time over the keys' alone, as a share of its step ("+other": what the
store adds a step, timed or not: vLLM's own work for a KV connector,
omnicache's that no timer here counts, and the timers; a noisy difference of
two medians); and the step time over vLLM's (engines differ by 5-40% from
one start to the next here: the timed store work is the measure, not this
ratio). The timers' own cost is counted in the store's: about 0.2 us a
timed call warm, but 1.2-1.5 us in the engine, where each call comes cold.
A second table measures it in the same passes: the store's timed calls a
step, what timing a hook that returns at once took (the connector's
``wait_for_layer_load``, which vLLM calls at each layer inside the forward
pass), and their product as a share of the steps (an estimate: the store's
share less this one is what the store's work would be without the timers).
Medians over ``--repeats`` passes; the modes take turns, each pass on a
fresh engine after a warm-up workload of its own.

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

from live_timing import PerStep

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
WORKLOADS = ("prefill", "rows", "decode", "batch")
BATCH_REQUESTS = 16
SIDES = ("worker", "scheduler")


def prompts(workload: str, args: argparse.Namespace, salt: str) -> list[dict[str, Any]]:
    if workload == "prefill":
        lengths = [480] * args.prefill_requests
    elif workload == "batch":
        lengths = [64 + i for i in range(BATCH_REQUESTS)]
    else:
        lengths = [64] * 4
    # Token ids 1..300 are learned tokens; each prompt differs from its first token.
    return [
        {
            "prompt_token_ids": [(i * 37 + j * 7) % 300 + 1 for j in range(length)],
            "cache_salt": salt,
        }
        for i, length in enumerate(lengths)
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


# The connector's methods vLLM calls on each side every step (or for a
# request). NOTE: not its per-layer hooks (``wait_for_layer_load``,
# ``save_kv_layer``), which return at once: a timer would cost more than they do.
WORKER_HOOKS = ("start_load_kv", "wait_for_save", "get_finished", "get_block_ids_with_load_errors")
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)


def run_pass(mode: str, model: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = engine(mode, model)
    core = llm.llm_engine.engine_core.engine_core
    steps = PerStep(core, "step_fn")
    live = None
    worker = core.model_executor.driver_worker.worker
    if mode != "keys + store":
        steps.time("model", worker.model_runner, "_model_forward")
    else:
        live = worker.omni_store
        # NOTE: omnicache's capture stands where vLLM's runner calls the model
        # (`_model_forward`): its time but the model's is the store's
        # (`LiveStore.apply`, and finding the step's slots and batch order).
        capture = worker.model_runner._model_forward
        steps.time("worker", worker.model_runner, "_model_forward")
        # NOTE: and omnicache's worker's own part of the step (`execute_model`
        # around vLLM's, which it calls through ``super()``: the class's).
        steps.time("worker", type(worker), "execute_model")
        steps.time("worker", vllm_worker_class(worker), "execute_model", subtract=True)
        steps.time("worker", capture, "forward", subtract=True)
        steps.time("model", capture, "forward")
        # NOTE: vLLM calls each by attribute, every step (and a layer's, every layer).
        worker_side = get_kv_transfer_group()
        for name in WORKER_HOOKS:
            steps.time("worker", worker_side, name)
        scheduler = core.scheduler
        # NOTE: the mirror's records of vLLM's allocations and reuses, and the
        # cap of each hit to its table (the manager's: a lookup with a hit).
        for name in ("on_allocated", "on_cleared"):
            steps.time("scheduler", scheduler.omni_mirror, name)
        steps.time("scheduler", type(scheduler.omni_manager), "_cap_hit")
        for name in SCHEDULER_HOOKS:
            steps.time("scheduler", scheduler.connector, name)
        # NOTE: what a timer adds to the time it counts, in this run: a hook
        # vLLM calls at each layer in the forward pass, which returns at once.
        steps.time("timer", worker_side, "wait_for_layer_load")
    ask = {"omnicache_prompt_hidden_states": True} if mode == "keys + store" else None
    results: dict[str, dict[str, float]] = {}
    for salt in ("warm-up", "measured"):
        for workload in WORKLOADS:
            steps.clear()
            # NOTE: the rows pass sends the prefill pass's prompts again.
            kind = "prefill" if workload == "rows" else workload
            batch = prompts(kind, args, f"{salt}/{kind}")
            if workload in ("decode", "batch"):
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
                began = time.perf_counter()
                live.flush()
                flush_s = time.perf_counter() - began
            total_s = sum(steps.step_times)
            result = {"step ms": 1e3 * statistics.median(steps.step_times)}
            # NOTE: everything the step does but the model's forward pass: the
            # store's work, and vLLM's that a connector adds, timed or not.
            result["other ms"] = 1e3 * statistics.median(
                step - model
                for step, model in zip(steps.step_times, steps.totals["model"], strict=True)
            )
            if live is not None:
                # Each step's timed calls of the store's groups, and what one timed
                # call that returns at once took (the step's mean, over its layers).
                calls = [sum(c) for c in zip(*(steps.counts[side] for side in SIDES), strict=True)]
                timer = [
                    t / n
                    for t, n in zip(steps.totals["timer"], steps.counts["timer"], strict=True)
                    if n
                ]
                one = statistics.median(timer) if timer else float("nan")
                result["timed calls"] = statistics.median(calls)
                result["timer us"] = 1e6 * one
                result["timers share"] = sum(calls) * one / total_s
            for side in SIDES:
                times = steps.totals.get(side, [0.0])
                extra_s = flush_s if side == "worker" else 0.0
                result[f"{side} ms"] = 1e3 * statistics.median(times)
                # NOTE: shares of the totals: a step that writes the staged decode
                # steps' rows counts in full.
                result[f"{side} share"] = (sum(times) + extra_s) / total_s
            results[workload] = result
    llm.llm_engine.engine_core.shutdown()
    steps.restore()
    return results


def vllm_worker_class(worker: Any) -> type:
    """The class whose ``execute_model`` omnicache's worker calls through ``super()``."""
    from omnicache.integrations.vllm.worker import OmniWorkerMixin

    mro = type(worker).__mro__
    after = mro[mro.index(OmniWorkerMixin) + 1 :]
    return next(cls for cls in after if "execute_model" in vars(cls))


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
        f"{args.decode_tokens} new; batch: {BATCH_REQUESTS} x 64-{63 + BATCH_REQUESTS} tokens + "
        f"{args.decode_tokens} new; median step, median of {args.repeats} passes; the store's "
        f"work a step in the worker and in the scheduler, and their shares of the steps"
    )
    keys = ("step ms", "other ms", "worker ms", "scheduler ms", "worker share", "scheduler share")
    print(
        f"{'workload':<9}{'mode':<16}{'step ms':>10}{'other ms':>10}{'worker ms':>11}"
        f"{'sched ms':>10}{'worker':>8}{'sched':>8}{'store':>8}{'+other':>8}{'/ vLLM':>9}"
    )
    for w in WORKLOADS:
        vllm_step = statistics.median(p[w]["step ms"] for p in passes["vLLM"])
        keys_other = statistics.median(p[w]["other ms"] for p in passes["omnicache keys"])
        for mode, runs in passes.items():
            row = {k: statistics.median(p[w][k] for p in runs) for k in keys}
            # NOTE: the store's share is each pass's two shares added, then the median.
            store = statistics.median(p[w]["worker share"] + p[w]["scheduler share"] for p in runs)
            other = (row["other ms"] - keys_other) / row["step ms"]
            cells = (
                f"{row['worker ms']:>11.3f}{row['scheduler ms']:>10.3f}"
                f"{100 * row['worker share']:>7.2f}%{100 * row['scheduler share']:>7.2f}%"
                f"{100 * store:>7.2f}%{100 * other:>7.2f}%"
                if mode == "keys + store"
                else f"{'-':>11}{'-':>10}{'-':>8}{'-':>8}{'-':>8}{'-':>8}"
            )
            ratio = row["step ms"] / vllm_step
            print(
                f"{w:<9}{mode:<16}{row['step ms']:>10.3f}{row['other ms']:>10.3f}{cells}"
                f"{ratio:>8.3f}x"
            )
    print(
        "\nthe timers' own cost, in the store's share (keys + store): timed calls a step, "
        "what a timed call that returns at once took (a per-layer hook, in the forward pass), "
        "and their product over the steps"
    )
    for w in WORKLOADS:
        runs = passes["keys + store"]
        calls = statistics.median(p[w]["timed calls"] for p in runs)
        timer = statistics.median(p[w]["timer us"] for p in runs)
        share = statistics.median(p[w]["timers share"] for p in runs)
        print(f"{w:<9}{calls:>6.1f} calls a step{timer:>8.2f} us a call{100 * share:>8.2f}%")


if __name__ == "__main__":
    main()
