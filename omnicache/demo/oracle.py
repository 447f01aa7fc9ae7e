"""The exactness oracle: every request served with the cache and computed from scratch.

`run_cached` computes every request from scratch without the cache
(`compute_reference`, right before serving it, so both timings see the same
machine load) and requires the hidden states of all prompt tokens and the
next-token logits served with the cache to match, ``torch.allclose(atol=ATOL,
rtol=RTOL)`` with 1e-5 each. Both paths run the same float32 kernels and
differ only in how rows are grouped into matrix products, which moves results
by ~1e-6 at most on the demo. The totals (`RunReport`) are what the command
line prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from omnicache.block_hash import BlockHash
from omnicache.demo.config import CacheConfig
from omnicache.demo.engine import ServingEngine, salt_of
from omnicache.demo.model import TinyOmniModel
from omnicache.demo.processor import Processor
from omnicache.demo.workloads import Trace, TraceRequest

__all__ = ["ATOL", "RTOL", "RunReport", "run_cached"]

ATOL = 1e-5
RTOL = 1e-5

ProgressFn = Callable[[int, int], None]


def best_hit_tokens(
    prompts: Iterable[Sequence[BlockHash]], num_tokens: Iterable[int], block_size: int
) -> list[int]:
    """Per prompt, the hit an infinite cache gives when prompts arrive in this order.

    Every full block of every earlier prompt is cached; a hit is the longest
    run of leading keys seen before, capped at ``num_tokens - 1`` tokens in
    whole blocks (the last prompt token is always computed).

    Args:
        prompts: Per prompt, the keys of its full blocks.
        num_tokens: Per prompt, its length in tokens.
        block_size: Tokens per block.
    """
    seen: set[BlockHash] = set()
    hits: list[int] = []
    for keys, length in zip(prompts, num_tokens, strict=True):
        cap = (length - 1) // block_size
        num_hit = 0
        while num_hit < cap and keys[num_hit] in seen:
            num_hit += 1
        hits.append(num_hit * block_size)
        seen.update(keys)
    return hits


class Reference(NamedTuple):
    """A request computed from scratch without the cache."""

    hidden_states: torch.Tensor
    logits: torch.Tensor
    seconds: float
    num_items_encoded: int


def compute_reference(
    model: TinyOmniModel, processor: Processor, request: TraceRequest
) -> Reference:
    """Computes one prompt from scratch, without the cache, and times it."""
    t0 = time.perf_counter()
    tokenized = processor.tokenize(request.messages)
    embeds, num_encoded = model.embed(tokenized)
    out = model.forward(embeds)
    return Reference(out.hidden_states, out.logits, time.perf_counter() - t0, num_encoded)


def run_reference(
    model: TinyOmniModel,
    processor: Processor,
    trace: Trace,
    progress: ProgressFn | None = None,
) -> list[Reference]:
    """Computes every prompt of the trace from scratch: the oracle's answers and baseline time."""
    references: list[Reference] = []
    for index, request in enumerate(trace.requests):
        references.append(compute_reference(model, processor, request))
        if progress is not None:
            progress(index + 1, trace.num_requests)
    return references


@dataclass(slots=True)
class RunReport:
    """Totals of one pass over a trace with the cache, checked against the references."""

    num_blocks: int
    block_size: int
    block_algorithm: str
    content_algorithm: str
    num_requests: int = 0
    num_tenants: int = 0
    num_prompt_tokens: int = 0
    num_hit_tokens: int = 0
    # Hit tokens filled from the tier (a part of num_hit_tokens).
    num_tier_hit_tokens: int = 0
    num_best_hit_tokens: int = 0
    # Distinct full-block keys in the trace: a pool this large never evicts.
    num_distinct_blocks: int = 0
    flops_full: int = 0
    flops_cached: int = 0
    num_items: int = 0
    num_items_encoded: int = 0
    seconds_reference: float = 0.0
    seconds_cached: float = 0.0
    num_evictions: int = 0
    num_stale_reads: int = 0
    num_mismatches: int = 0
    max_abs_diff: float = 0.0
    mismatched_requests: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def best_hit_rate(self) -> float:
        total = self.num_prompt_tokens
        return self.num_best_hit_tokens / total if total else 0.0

    @property
    def flops_saved(self) -> float:
        return 1.0 - self.flops_cached / self.flops_full if self.flops_full else 0.0

    @property
    def speedup(self) -> float:
        return self.seconds_reference / self.seconds_cached if self.seconds_cached else 0.0

    @property
    def ok(self) -> bool:
        return self.num_mismatches == 0 and self.num_stale_reads == 0


def check_fits(
    model: TinyOmniModel, processor: Processor, trace: Trace, cache_config: CacheConfig
) -> int:
    """Checks that every prompt fits the model and the pool; returns the longest prompt's tokens.

    Raises:
        ValueError: A prompt is longer than ``max_positions``, or needs more
            blocks than the pool has (it could never be admitted).
    """
    longest = 0
    longest_id = ""
    for request in trace.requests:
        num_tokens = len(processor.tokenize(request.messages).token_ids)
        if num_tokens > longest:
            longest, longest_id = num_tokens, request.request_id
    max_positions = model.config.max_positions
    if longest > max_positions:
        raise ValueError(
            f"request {longest_id!r}: expected at most {max_positions} tokens "
            f"(the model's max_positions), found {longest}"
        )
    bs = cache_config.block_size
    needed = -(-longest // bs)
    if needed > cache_config.num_blocks:
        raise ValueError(
            f"num_blocks: expected at least {needed} (request {longest_id!r} has {longest} "
            f"tokens, {needed} blocks of {bs}), found {cache_config.num_blocks}"
        )
    return longest


def run_cached(
    model: TinyOmniModel,
    processor: Processor,
    trace: Trace,
    cache_config: CacheConfig,
    references: MutableSequence[Reference],
    progress: ProgressFn | None = None,
    *,
    engine: ServingEngine | None = None,
) -> RunReport:
    """Serves the trace with the cache and checks every request against its reference.

    Args:
        model, processor: As for `run_reference`.
        trace: The requests, served in order.
        cache_config: The cache's geometry and keys.
        references: References of the first ``len(references)`` requests
            (`run_reference`); each missing one is computed right before its
            request is served with the cache and appended, so that both
            timings of a request see the same machine load.
        progress: Called as ``progress(done, total)`` after each request.
        engine: An engine to serve with (default: a new one from ``cache_config``).

    Returns:
        The totals; ``report.ok`` is False when any request mismatched its
        reference or hit a stale block.
    """
    if len(references) > trace.num_requests:
        raise ValueError(
            f"references: expected at most {trace.num_requests} (one per request), "
            f"found {len(references)}"
        )
    check_fits(model, processor, trace, cache_config)
    if engine is None:
        engine = ServingEngine(model, processor, cache_config)
    bs = cache_config.block_size
    report = RunReport(
        num_blocks=cache_config.num_blocks,
        block_size=bs,
        block_algorithm=cache_config.block_algorithm,
        content_algorithm=processor.algorithm,
        num_requests=trace.num_requests,
        num_tenants=len({salt_of(cache_config, r) for r in trace.requests}),
    )
    # The best any cache could do, from the keys alone (not timed).
    all_keys: list[list[BlockHash]] = []
    lengths: list[int] = []
    for request in trace.requests:
        prompt = processor.annotate(processor.tokenize(request.messages))
        all_keys.append(engine.block_hashes(request, prompt))
        lengths.append(len(prompt))
    report.num_best_hit_tokens = sum(best_hit_tokens(all_keys, lengths, bs))
    report.num_distinct_blocks = len({key for keys in all_keys for key in keys})
    evictions_before = engine.pool.num_evictions
    for index, request in enumerate(trace.requests):
        if index == len(references):
            references.append(compute_reference(model, processor, request))
        ref = references[index]
        t0 = time.perf_counter()
        served = engine.serve(request)
        report.seconds_cached += time.perf_counter() - t0
        report.seconds_reference += ref.seconds
        report.num_prompt_tokens += served.num_tokens
        report.num_hit_tokens += served.num_hit_tokens
        report.num_tier_hit_tokens += served.num_tier_hit_tokens
        report.flops_full += model.config.flops(served.num_tokens)
        report.flops_cached += model.config.flops(
            served.num_tokens, served.num_tokens - served.num_computed_tokens
        )
        report.num_items += ref.num_items_encoded
        report.num_items_encoded += served.num_items_encoded
        report.num_stale_reads += int(served.stale)
        same_shape = served.hidden_states.shape == ref.hidden_states.shape
        if same_shape:
            diff = max(
                float((served.hidden_states - ref.hidden_states).abs().max()),
                float((served.logits - ref.logits).abs().max()),
            )
            report.max_abs_diff = max(report.max_abs_diff, diff)
        if not (
            same_shape
            and torch.allclose(served.hidden_states, ref.hidden_states, atol=ATOL, rtol=RTOL)
            and torch.allclose(served.logits, ref.logits, atol=ATOL, rtol=RTOL)
        ):
            report.num_mismatches += 1
            report.mismatched_requests.append(request.request_id)
        if progress is not None:
            progress(index + 1, trace.num_requests)
    report.num_evictions = engine.pool.num_evictions - evictions_before
    return report
