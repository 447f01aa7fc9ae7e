"""The Redis tier from live engines: a second engine serves the blocks a first one computed.

Engine A, in process with the tier on (a real Redis server), serves a
multimodal workload (images, cache salts) and is shut down. Engine B, in
vLLM's default multiprocess mode (its scheduler and its worker each in a
process of their own, so every loaded value crosses a process boundary in
the step's plan), with an empty local cache and the same tier, serves the
same prompts and some that share only a prefix: it takes the KV
and hidden rows of A's blocks from Redis (vLLM's external tokens) instead of
computing them. Between the two runs one value is deleted from Redis and
one is overwritten with bytes that do not verify: each of those requests
gets exactly the shorter hit (the scheduler fetches and verifies a block's
values at the lookup). The oracle is an engine with prefix
caching off (in process), whose prompt hidden states are all computed.

Same conventions as ``test_vllm_live``: skipped without the live CPU engine
of vLLM 0.32, failed instead under ``CI=true`` or
``OMNICACHE_REQUIRE_VLLM_LIVE=1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import test_vllm_live as live

from omnicache.annotations import TokenRangeAnnotation

if TYPE_CHECKING:
    from redis_server import RedisServer

pytestmark = live.pytestmark

WORKER = "omnicache.integrations.vllm.worker.OmniCPUWorker"
NAMESPACE = "live-tier"
PREFIX = "omnicache-test"
ENTRIES = [
    "hidden_states",
    "kv.tp0of1.language_model.model.layers.0.self_attn.attn",
    "kv.tp0of1.language_model.model.layers.1.self_attn.attn",
]
# (image seed, cache salt) per request, one generate call per wave.
A_WAVES: list[list[tuple[int, str | None]]] = [
    [(1, None)],
    [(2, None)],
    [(1, "b")],
    [(4, None)],
    [(5, None)],
]
# B: a twin after the first request hits the blocks it loaded locally (one
# admitted while they load may load them too, or wait: vLLM's timing decides);
# (3, None) shares only the text block with what A computed.
B_WAVES: list[list[tuple[int, str | None]]] = [
    [(1, None)],
    [(1, None)],
    [(2, None), (3, None)],
    [(1, "b"), (4, None)],
    [(5, None)],
]
DELETED = (4, None)  # its block 2's KV of layer 0 is deleted from Redis before B starts
CORRUPT = (5, None)  # its block 2's hidden rows are overwritten with bytes that do not verify
FULL = 4 * live.BLOCK_SIZE  # a whole prompt's hit: all but its last, partial block
TEXT = live.BLOCK_SIZE  # the block of text before the image
# Per B request: (tokens its admission took from the tier, vLLM's cached
# tokens, the hit the worker verified and served).
B_EXPECTED = [
    (FULL, FULL, FULL),  # (1, None): every full block from A's run
    (0, FULL, FULL),  # its twin, in the next wave: a local hit on the blocks the first loaded
    (FULL - TEXT, FULL, FULL),  # (2, None): text block local, the rest loaded
    (0, TEXT, TEXT),  # (3, None): A never saw image 3
    (FULL, FULL, FULL),  # (1, "b"): another salt, another chain, all from A
    (TEXT, 2 * TEXT, 2 * TEXT),  # (4, None): text local, block 1 loaded, block 2's value deleted
    # (5, None): text local; the lookup found blocks 1-3, the load stopped at
    # block 2's damaged value, and vLLM recomputed from there (through the
    # image). vLLM's cached count is its admission's, not corrected after the
    # failed load; what loaded is the external count.
    (TEXT, FULL, 2 * TEXT),
]


PROMPT_LOGPROBS = 2


def tier_args(model: Path, url: str, **overrides: Any) -> dict[str, Any]:
    return live.engine_args(
        model,
        worker_cls=WORKER,
        scheduler_cls=live.SCHEDULER,
        kv_transfer_config={
            "kv_connector": "OmniStoreConnector",
            "kv_connector_module_path": "omnicache.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "tier_url": url,
                "tier_namespace": NAMESPACE,
                "tier_prefix": PREFIX,
            },
        },
        max_model_len=512,
        limit_mm_per_prompt={"image": 1},
        **overrides,
    )


def serve(llm: Any, waves: list[list[tuple[int, str | None]]], *, tier: bool) -> dict[str, Any]:
    from vllm import SamplingParams

    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    params = SamplingParams(
        max_tokens=live.MAX_TOKENS,
        temperature=0,
        extra_args={"omnicache_prompt_hidden_states": True},
        # Scored from the rows of loaded blocks too.
        prompt_logprobs=PROMPT_LOGPROBS,
    )
    outputs: list[Any] = []
    for wave in waves:
        prompts = [live.image_prompt(live.picture(seed), salt) for seed, salt in wave]
        outputs += llm.generate(prompts, params, use_tqdm=False)
    run: dict[str, Any] = {
        "requests": [item for wave in waves for item in wave],
        "hits": [output.num_cached_tokens for output in outputs],
        "external": [
            (output.kv_transfer_params or {}).get("omnicache_external_tokens") for output in outputs
        ],
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "computed": [live.computed_tokens(output) for output in outputs],
        "span": live.placeholder_span(llm, outputs[0], live.IMAGE_PAD),
        "states": take_prompt_hidden_states(llm, outputs),
        "prompt_logprobs": [output.prompt_logprobs for output in outputs],
    }
    # NOTE: the tier drained first: the flush writes the rows still waiting
    # and saves their blocks, and the counters then hold every write.
    if tier:
        (run["flushed"],) = llm.collective_rpc("omni_tier_flush")
    (run["stats"],) = llm.collective_rpc("omni_live_store_stats")
    live.shut(llm)
    return run


def block_keys(model: Path, run: dict[str, Any], index: int) -> list[bytes]:
    """omnicache's keys of the full blocks request ``index`` of ``run`` computed."""
    seed, salt = run["requests"][index]
    offset, length = run["span"]
    digest = live.item_digest(live.picture(seed), "image", salt)
    annotation = TokenRangeAnnotation(offset, length, digest, 0, length)
    keys = live.full_block_keys(model, run["computed"][index], [annotation], salt)
    return [bytes(key) for key in keys]


def value_name(key: bytes, entry: str) -> str:
    return f"{PREFIX}:{NAMESPACE}:{key.hex()}:{entry}"


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnicache.demo.tiny_models import build_vl_model

    return build_vl_model(tmp_path_factory.mktemp("live-tier") / "qwen2-vl-tiny")


@pytest.fixture(scope="module")
def runs(vl_model: Path, redis_server_session: RedisServer) -> Iterator[dict[str, Any]]:
    from vllm import LLM

    client = redis_server_session.client()
    stale = list(client.scan_iter(f"{PREFIX}:{NAMESPACE}:*"))
    if stale:
        client.delete(*stale)
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    url = redis_server_session.url
    results: dict[str, Any] = {}
    # NOTE: A and the oracle run in process, which starts in seconds; B, the
    # engine that loads, in vLLM's default multiprocess mode.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        results["a"] = serve(LLM(**tier_args(vl_model, url)), A_WAVES, tier=True)
        results["saved"] = {name.decode() for name in client.scan_iter(f"{PREFIX}:{NAMESPACE}:*")}
        a_index = {item: index for index, item in enumerate(results["a"]["requests"])}
        deleted = block_keys(vl_model, results["a"], a_index[DELETED])[2]
        corrupt = block_keys(vl_model, results["a"], a_index[CORRUPT])[2]
        assert client.delete(value_name(deleted, ENTRIES[1])) == 1
        assert client.set(value_name(corrupt, ENTRIES[0]), b"not a value of the tier") is True
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        results["b"] = serve(LLM(**tier_args(vl_model, url)), B_WAVES, tier=True)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        off = live.engine_args(
            vl_model,
            worker_cls=WORKER,
            kv_transfer_config={
                "kv_connector": "OmniStoreConnector",
                "kv_connector_module_path": "omnicache.integrations.vllm.connector",
                "kv_role": "kv_both",
            },
            enable_prefix_caching=False,
            max_model_len=512,
            limit_mm_per_prompt={"image": 1},
        )
        oracle_waves = [[item] for item in dict.fromkeys(i for w in B_WAVES for i in w)]
        results["off"] = serve(LLM(**off), oracle_waves, tier=False)
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
    yield results


def test_engine_a_saves_every_block_it_computed_and_loads_nothing(
    runs: dict[str, Any], vl_model: Path
) -> None:
    a = runs["a"]
    assert a["flushed"] is True
    assert a["external"] == [0] * len(A_WAVES)
    # Local hits only: the text block, once A computed it.
    assert a["hits"] == [0, TEXT, 0, TEXT, TEXT]
    expected = {
        value_name(key, entry)
        for index in range(len(a["requests"]))
        for key in block_keys(vl_model, a, index)
        for entry in ENTRIES
    }
    assert runs["saved"] == expected
    stats = a["stats"]
    assert stats["tier_num_saved_blocks"] == len(expected) // len(ENTRIES)
    assert stats["redis_num_written_values"] == len(expected)
    assert stats["tier_num_load_requests"] == stats["tier_num_loaded_blocks"] == 0
    assert stats["redis_num_dropped_values"] == stats["redis_num_write_errors"] == 0


def test_engine_b_takes_exactly_the_blocks_the_tier_holds(runs: dict[str, Any]) -> None:
    b = runs["b"]
    assert list(zip(b["external"], b["hits"], strict=True)) == [row[:2] for row in B_EXPECTED]
    # The damaged request's recompute starts inside its image: the worker's copy
    # of the request must carry the image's data (vLLM sends it after the load).
    offset, length = b["span"]
    assert offset < 2 * TEXT < offset + length
    stats = b["stats"]
    # Every request with external tokens loaded them; the damaged one its first block only.
    assert stats["tier_num_load_requests"] == sum(1 for row in B_EXPECTED if row[0])
    assert stats["tier_num_loaded_blocks"] == sum(row[0] for row in B_EXPECTED) // live.BLOCK_SIZE
    assert stats["tier_num_failed_loads"] == 1
    assert stats["redis_num_rejected_values"] == 1
    # The loaded blocks were read as hits by their requests, and their
    # positions' prompt logprobs scored from their rows.
    assert stats["num_hit_blocks"] == sum(row[2] for row in B_EXPECTED) // live.BLOCK_SIZE
    assert stats["num_scored_tokens"] == sum(row[2] for row in B_EXPECTED)
    assert stats["num_scored_requests"] == sum(1 for row in B_EXPECTED if row[2])
    assert stats["num_score_failures"] == 0


def test_engine_b_serves_what_engines_without_a_tier_compute(runs: dict[str, Any]) -> None:
    import torch

    off = runs["off"]
    oracle = {item: index for index, item in enumerate(off["requests"])}
    assert off["hits"] == [0] * len(off["requests"])
    for name in ("a", "b"):
        run = runs[name]
        for index, item in enumerate(run["requests"]):
            want = off["states"][oracle[item]]
            got = run["states"][index]
            where = (name, index, item)
            assert run["tokens"][index] == off["tokens"][oracle[item]], where
            assert got is not None and want is not None, where
            assert got.dtype == torch.float32, where
            assert tuple(got.shape) == tuple(want.shape), where
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), where
            difference = live.prompt_logprobs_difference(
                run["prompt_logprobs"][index], off["prompt_logprobs"][oracle[item]]
            )
            assert difference <= live.LOGPROB_ATOL, (where, difference)
        stats = run["stats"]
        assert stats["num_stale_hit_blocks"] == 0, name
        assert stats["store_num_stale_reads"] == 0, name
        assert stats["num_slot_mismatches"] == 0, name
        assert stats["num_prompt_failures"] == 0, name
        assert stats["num_prompt_results"] == len(run["requests"]), name
