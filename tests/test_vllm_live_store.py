"""The hidden-state store inside a live vLLM engine, checked against an engine without caching.

An engine in vLLM's default multiprocess mode (scheduler in the engine
core's process, model runner in a worker process) runs with prefix caching,
`OmniScheduler`, `OmniStoreConnector` and `OmniCPUWorker`, and a KV cache of
a couple of dozen blocks, so that blocks are evicted and handed out again.
Every request asks for its prompt's hidden states. The oracle is the same
model in an engine with prefix caching off, whose prompt hidden states are
all computed; the hits are those of vLLM's own prefix caching on the same
workload.

Same conventions as ``test_vllm_live``: skipped without the live CPU engine
of vLLM 0.32, failed instead under ``CI=true`` or
``OMNICACHE_REQUIRE_VLLM_LIVE=1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_vllm_live as live

pytestmark = live.pytestmark

WORKER = "omnicache.integrations.vllm.worker.OmniCPUWorker"
# Blocks of the KV cache, vLLM's null block included: 23 usable, of 32 tokens
# (2 layers x K and V x 2 heads x 32 values x 4 bytes per token).
NUM_BLOCKS = 24
BLOCK_BYTES = 2 * 2 * 2 * 32 * live.BLOCK_SIZE * 4
# The store's rows of a block (128 float32 values a token): an engine with the
# store holds them in the same budget, so it is given both for as many blocks.
STORE_BYTES = 128 * live.BLOCK_SIZE * 4
# The bound on the staged steps' rows, which the budget holds too.
STAGED_BYTES = 256 * 2**10
# Waves of (image seed, cache salt): each wave is one generate call, so its
# requests run in the same steps; a request repeated within a wave hits the
# blocks its twin computes in the same step.
WAVES: list[list[tuple[int, str | None]]] = [
    [(1, None), (1, None)],
    [(2, None)],
    [(1, "b"), (2, "b"), (3, None)],
    [(3, "c"), (1, None), (2, "b")],
    [(1, "c"), (3, None), (2, None), (1, "b")],
    [(3, "c"), (1, None), (2, "c")],
    [(2, "b"), (1, "b"), (3, None), (3, "c")],
]
# vLLM's own prefix caching on WAVES, request by request (the reference
# engine checks it too): 128 is a whole prompt but its last block, 32 the
# text before the image, 0 a chain evicted or never seen.
WAVES_FLAT = [request for wave in WAVES for request in wave]
EXPECTED_HITS = [0, 128, 32, 0, 32, 32, 0, 128, 128, 32, 128, 32, 32, 32, 64, 32, 32, 128, 32, 96]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnicache.demo.tiny_models import build_vl_model

    return build_vl_model(tmp_path_factory.mktemp("live-store") / "qwen2-vl-tiny")


def store_args(model: Path, **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "worker_cls": WORKER,
        # As a user passes it (README): LLM turns the dict into a KVTransferConfig.
        "kv_transfer_config": {
            "kv_connector": "OmniStoreConnector",
            "kv_connector_module_path": "omnicache.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"max_staged_bytes": STAGED_BYTES},
        },
        "kv_cache_memory_bytes": NUM_BLOCKS * (BLOCK_BYTES + STORE_BYTES) + STAGED_BYTES,
        "max_model_len": 512,
        "limit_mm_per_prompt": {"image": 1},
    }
    args.update(overrides)
    return live.engine_args(model, **args)


# Every other request also asks for its prompt's logprobs (vLLM's own prefix
# caching would give those no hit), so that steps mix requests that score
# their prompt with requests that do not.
PROMPT_LOGPROBS = 3


def scores(index: int) -> bool:
    return index % 2 == 1


def run_waves(llm: Any, *, ask: bool = True) -> list[Any]:
    from vllm import SamplingParams

    extra = {"omnicache_prompt_hidden_states": True} if ask else None
    outputs: list[Any] = []
    for wave in WAVES:
        prompts = [live.image_prompt(live.picture(seed), salt) for seed, salt in wave]
        params = [
            SamplingParams(
                max_tokens=live.MAX_TOKENS,
                temperature=0,
                extra_args=extra,
                prompt_logprobs=PROMPT_LOGPROBS if ask and scores(len(outputs) + i) else None,
            )
            for i in range(len(wave))
        ]
        outputs += llm.generate(prompts, params, use_tqdm=False)
    return outputs


def served(llm: Any, *, ask: bool = True) -> dict[str, Any]:
    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    outputs = run_waves(llm, ask=ask)
    run: dict[str, Any] = {
        "hits": [output.num_cached_tokens for output in outputs],
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "num_prompt": [len(output.prompt_token_ids) for output in outputs],
        "prompt_logprobs": [output.prompt_logprobs for output in outputs],
    }
    if ask:
        run["states"] = take_prompt_hidden_states(llm, outputs)
        (run["stats"],) = llm.collective_rpc("omni_live_store_stats")
        # Taken once: a second take finds nothing.
        with pytest.raises(ValueError, match=r"found none for \["):
            take_prompt_hidden_states(llm, outputs[:1])
    live.shut(llm)
    return run


@pytest.fixture(scope="module")
def runs(vl_model: Path) -> Iterator[dict[str, dict[str, Any]]]:
    from vllm import LLM

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    results: dict[str, dict[str, Any]] = {}
    # NOTE: the multiprocess engine first (see test_vllm_live); the two
    # references then run in process, which starts in seconds.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    results["store"] = served(LLM(**store_args(vl_model, scheduler_cls=live.SCHEDULER)))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    results["off"] = served(LLM(**store_args(vl_model, enable_prefix_caching=False)))
    results["vllm"] = served(
        LLM(
            **live.engine_args(
                vl_model,
                kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_BYTES,
                max_model_len=512,
                limit_mm_per_prompt={"image": 1},
            )
        ),
        ask=False,
    )
    if saved is None:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
    yield results


def test_prompt_hidden_states_equal_an_engine_without_caching(
    runs: dict[str, dict[str, Any]],
) -> None:
    import torch

    store, off = runs["store"], runs["off"]
    assert store["num_prompt"] == off["num_prompt"]
    assert len(store["states"]) == sum(len(wave) for wave in WAVES)
    for index, (got, want, num_prompt) in enumerate(
        zip(store["states"], off["states"], store["num_prompt"], strict=True)
    ):
        assert got is not None and want is not None, index
        assert tuple(got.shape) == tuple(want.shape) == (num_prompt, 128), index
        assert got.dtype == torch.float32
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), index
    assert store["tokens"] == off["tokens"]
    assert off["hits"] == [0] * len(off["hits"])


def test_prompt_logprobs_equal_an_engine_without_caching(
    runs: dict[str, dict[str, Any]],
) -> None:
    store, off = runs["store"], runs["off"]
    asked = [index for index in range(len(WAVES_FLAT)) if scores(index)]
    for index in range(len(WAVES_FLAT)):
        got, want = store["prompt_logprobs"][index], off["prompt_logprobs"][index]
        if index not in asked:
            assert got is None and want is None, index
            continue
        assert len(got) == store["num_prompt"][index], index
        assert all(len(position) in (1 + PROMPT_LOGPROBS, PROMPT_LOGPROBS) for position in got[1:])
        difference = live.prompt_logprobs_difference(got, want)
        assert difference <= live.LOGPROB_ATOL, (index, difference)
    # The requests that scored their prompt hit as the others do: the
    # positions of their hits came from the store.
    stats = store["stats"]
    scored = [store["hits"][index] for index in asked]
    assert sum(scored) > 0
    assert stats["num_scored_requests"] == sum(1 for hit in scored if hit)
    assert stats["num_scored_tokens"] == sum(scored)
    assert stats["num_score_failures"] == 0


def distinct_hit_blocks(hits: list[int]) -> int:
    """The hit blocks of each wave, each counted once: block 0 holds the text before the
    image (the salt's), the others the image's (the salt's and the image's)."""
    total, index = 0, 0
    for wave in WAVES:
        blocks = set()
        for seed, salt in wave:
            for block in range(hits[index] // live.BLOCK_SIZE):
                blocks.add((salt, None if block == 0 else seed, block))
            index += 1
        total += len(blocks)
    return total


def test_hits_are_vllms_own_and_every_hit_read_its_stamped_rows(
    runs: dict[str, dict[str, Any]],
) -> None:
    store, stats = runs["store"], runs["store"]["stats"]
    hits = store["hits"]
    assert hits == runs["vllm"]["hits"] == EXPECTED_HITS
    num_prompt = store["num_prompt"][0]
    full = (num_prompt - 1) // live.BLOCK_SIZE * live.BLOCK_SIZE
    # The twin in the first wave hits the blocks computed in the same step;
    # the next image behind the same text hits the text's block.
    assert hits[:3] == [0, full, live.BLOCK_SIZE]
    assert sum(hits) > 0
    # The worker verified exactly the hits the scheduler served, and read
    # each one from its own store: nothing stale, nothing missing.
    assert stats["num_hit_blocks"] == sum(hits) // live.BLOCK_SIZE
    assert stats["num_hit_requests"] == sum(1 for hit in hits if hit)
    # Each hit block was read once in its step, however many of the step's
    # requests hit it: at least once per wave, and at most once per hit.
    # NOTE: a wave's requests reach the engine core over one or more steps, as
    # the multiprocess timing falls, so how many of them start together (and
    # share a read) is the timing's; in process it is not, and
    # test_vllm_live_scoring checks that two requests starting in one step
    # read their shared blocks once.
    reads = stats["store_num_hit_blocks_read"]
    assert distinct_hit_blocks(hits) <= reads <= stats["num_hit_blocks"]
    assert stats["num_stale_hit_blocks"] == 0
    assert stats["store_num_stale_reads"] == 0
    assert stats["num_slot_mismatches"] == 0
    assert stats["num_prompt_failures"] == 0
    assert stats["num_prompt_results"] == len(hits)
    assert stats["num_pending_results"] == 0
    assert stats["num_results_dropped"] == stats["num_incomplete_dropped"] == 0
    # The KV cache was too small for the workload: blocks were handed out
    # again, and their stamps cleared before their new rows were written.
    assert stats["num_cleared_blocks"] > 0
    assert stats["num_rows_written"] == sum(store["num_prompt"]) - sum(hits) + len(hits) * (
        live.MAX_TOKENS - 1
    )


def test_the_kv_cache_and_the_store_share_the_budget_the_engine_was_given(
    runs: dict[str, dict[str, Any]],
) -> None:
    # Given NUM_BLOCKS x (KV + store rows) and the staged steps' bound, the
    # engine with the store has NUM_BLOCKS blocks, as vLLM alone given
    # NUM_BLOCKS x KV (the same hits: see above), and the three fill the
    # budget exactly.
    stats = runs["store"]["stats"]
    assert stats["kv_cache_nbytes"] == NUM_BLOCKS * BLOCK_BYTES
    assert stats["store_nbytes"] == NUM_BLOCKS * STORE_BYTES
    assert stats["max_staged_nbytes"] == STAGED_BYTES
    assert (
        stats["kv_cache_nbytes"] + stats["store_nbytes"] + stats["max_staged_nbytes"]
        == NUM_BLOCKS * (BLOCK_BYTES + STORE_BYTES) + STAGED_BYTES
    )


@pytest.mark.parametrize("budget", [STAGED_BYTES, STAGED_BYTES - 1])
def test_a_budget_the_staged_steps_bound_fills_is_refused_at_start(
    vl_model: Path, in_process: None, budget: int
) -> None:
    from vllm import LLM

    with pytest.raises(
        ValueError,
        match=r"OmniCPUWorker: expected a KV cache budget over the staged steps' 262144 bytes "
        rf"\(kv_connector_extra_config\['max_staged_bytes'\]\), found {budget} bytes",
    ):
        LLM(**store_args(vl_model, kv_cache_memory_bytes=budget))
