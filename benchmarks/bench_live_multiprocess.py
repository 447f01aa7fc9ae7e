"""What a KV connector costs a live vLLM 0.32 CPU engine in its multiprocess mode.

vLLM's multiprocess mode (the server's, and ``LLM``'s default) runs the
engine core and the worker in processes of their own, which pass each step
through shared-memory queues. This benchmark serves the same requests on:

- vLLM alone;
- vLLM with its own ``DecodeBenchConnector`` (``startup_fill``): a connector
  of vLLM's that fills a request's prompt KV with dummy values instead of
  computing it, so its engine does less work than the others (no prefill);
- omnicache (its scheduler, worker and connector), nothing asked;
- both connectors again with `omnicache.integrations.vllm.common.cpu_server_env`'s
  environment (vLLM's CPU core reservation as without a connector);

each in vLLM's multiprocess mode, and vLLM alone and omnicache again in
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The model is a tiny
random-weight Qwen2 (``--hidden``, default 128; 2 layers, float32, blocks
of 32); the requests are distinct prompts of 512 tokens, 16 tokens out,
one at a time. Columns: the median wall time of a request; the worker's
time in ``execute_model`` over the timed requests (a subclass of the
worker times it) and, for omnicache, the store's part of it
(`LiveStore.apply`); and, in multiprocess mode, the CPU time the worker's
and the engine core's processes spent over the timed requests (psutil).
Medians over ``--repeats`` passes, each on a fresh engine after a warm-up.

On a machine with few cores the processes of the multiprocess mode spin on
their queues and compete for the cores: the CPU columns show where the
time goes when it is not in the worker's steps.

Run with the live engine's environment (``./dev live`` prepares ``.venv-live``):

    .venv-live/bin/python benchmarks/bench_live_multiprocess.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

# NOTE: the worker classes below are named by module for vLLM's worker
# process, which finds this folder through PYTHONPATH.
_HERE = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

from live_timing import Timed  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

from omnicache.demo.live import STAGED_BYTES, kv_budget  # noqa: E402
from omnicache.integrations.vllm.worker import OmniCPUWorker  # noqa: E402

ENV = " + env"
MODES = (
    ("vLLM", True),
    ("vLLM + DecodeBenchConnector", True),
    ("omnicache", True),
    ("vLLM + DecodeBenchConnector" + ENV, True),
    ("omnicache" + ENV, True),
    ("vLLM", False),
    ("omnicache", False),
)
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 16
WARMUP = 5


class _Timing:
    """Times ``execute_model`` (and, with the store, `LiveStore.apply`) inside the worker."""

    bench_timers: dict[str, Timed]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self.bench_timers = {"execute_model": Timed(self, "execute_model")}

    def bench_times(self, reset: bool = False) -> dict[str, float]:
        found = {name: sum(timer.times) for name, timer in self.bench_timers.items()}
        if reset:
            for timer in self.bench_timers.values():
                timer.times.clear()
        return found


class TimedCPUWorker(_Timing, CPUWorker):
    pass


class TimedOmniWorker(_Timing, OmniCPUWorker):
    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)
        self.bench_timers["store"] = Timed(self.omni_store, "apply")


def engine(mode: str, multiprocess: bool, model: Path) -> Any:
    import vllm.envs
    from vllm import LLM

    from omnicache.integrations.vllm.common import (
        RESERVED_CPU_ENV,
        SCHEDULER_CLS,
        cpu_server_env,
        store_kv_transfer_config,
    )

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.pop(RESERVED_CPU_ENV, None)
    if mode.endswith(ENV):
        os.environ.update(cpu_server_env())
        mode = mode.removesuffix(ENV)
    vllm.envs.disable_envs_cache()
    options: dict[str, Any] = {
        "model": str(model),
        "block_size": 32,
        "kv_cache_memory_bytes": kv_budget(64 * 2**20, model, store=mode == "omnicache"),
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
        "worker_cls": f"{Path(__file__).stem}."
        + ("TimedOmniWorker" if mode == "omnicache" else "TimedCPUWorker"),
    }
    if mode == "omnicache":
        options["scheduler_cls"] = SCHEDULER_CLS
        options["kv_transfer_config"] = store_kv_transfer_config(max_staged_bytes=STAGED_BYTES)
    elif mode != "vLLM":
        options["kv_transfer_config"] = {
            "kv_connector": "DecodeBenchConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"startup_fill": True},
        }
    return LLM(**options)


def _cpu(processes: list[Any]) -> list[float]:
    return [p.cpu_times().user + p.cpu_times().system for p in processes]


def run_pass(
    mode: str, multiprocess: bool, model: Path, args: argparse.Namespace
) -> dict[str, Any]:
    import psutil
    from vllm import SamplingParams

    llm = engine(mode, multiprocess, model)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)

    def prompt(i: int, salt: str) -> dict[str, Any]:
        # Token ids 1..300 are learned tokens; every prompt differs from its first token.
        ids = [(i * 37 + j * 7) % 300 + 1 for j in range(PROMPT_TOKENS)]
        return {"prompt_token_ids": ids, "cache_salt": salt}

    for i in range(WARMUP):
        llm.generate([prompt(i, "warm-up")], params, use_tqdm=False)
    llm.collective_rpc("bench_times", args=(True,))
    me = psutil.Process()
    named = {p.name(): p for p in me.children(recursive=True)}
    procs = [named[n] for n in ("VLLM::EngineCore", "VLLM::Worker") if n in named]
    before = _cpu(procs)
    times = []
    for i in range(args.requests):
        start = time.perf_counter()
        llm.generate([prompt(i, "measured")], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    after = _cpu(procs)
    (worker,) = llm.collective_rpc("bench_times")
    llm.llm_engine.engine_core.shutdown()
    cpu = [b - a for a, b in zip(before, after, strict=True)] if len(procs) == 2 else None
    return {"ms": 1e3 * statistics.median(times), "worker": worker, "cpu": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    from omnicache.demo.tiny_models import build_text_model

    passes: dict[tuple[str, bool], list[dict[str, Any]]] = {key: [] for key in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_text_model(Path(tmp) / "qwen2", hidden_size=args.hidden)
        # NOTE: the multiprocess engines first: an in-process engine core
        # changes how this process's threads are bound.
        for where in (True, False):
            for _ in range(args.repeats):
                for mode, multiprocess in MODES:
                    if multiprocess == where:
                        passes[(mode, multiprocess)].append(
                            run_pass(mode, multiprocess, model, args)
                        )

    print(
        f"\nhidden {args.hidden}, float32, 2 layers; {args.requests} requests of {PROMPT_TOKENS} "
        f"tokens, {OUTPUT_TOKENS} out, one at a time; {os.cpu_count()} cores; median of "
        f"{args.repeats} pass(es)"
    )
    print(
        f"{'':<40}{'process':>9}{'request ms':>12}{'/ vLLM':>8}{'worker steps s':>16}"
        f"{'store s':>9}{'worker CPU s':>14}{'core CPU s':>12}"
    )
    base = {mp: statistics.median([p["ms"] for p in passes[("vLLM", mp)]]) for mp in (True, False)}
    for (mode, multiprocess), runs in passes.items():
        ms = statistics.median([r["ms"] for r in runs])
        steps = statistics.median([r["worker"]["execute_model"] for r in runs])
        store = statistics.median([r["worker"].get("store", 0.0) for r in runs])
        cpus = [r["cpu"] for r in runs if r["cpu"] is not None]
        worker_cpu = f"{statistics.median([c[1] for c in cpus]):.2f}" if cpus else "-"
        core_cpu = f"{statistics.median([c[0] for c in cpus]):.2f}" if cpus else "-"
        where = "multi" if multiprocess else "in"
        store_s = f"{store:.3f}" if mode.startswith("omnicache") else "-"
        print(
            f"{mode:<40}{where:>9}{ms:>12.1f}{ms / base[multiprocess]:>7.2f}x{steps:>16.3f}"
            f"{store_s:>9}{worker_cpu:>14}{core_cpu:>12}"
        )


if __name__ == "__main__":
    main()
