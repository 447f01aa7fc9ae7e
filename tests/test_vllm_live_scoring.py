"""Prompt logprobs from the store in a live engine: chunked prefill, preemption, modes, attacks.

vLLM keeps a request that asks for prompt logprobs off the prefix cache; with
omnicache's store it reads it, and the worker scores the hit's positions from
their stored rows. Here engines with the store (in process, where the
worker can be reached) serve scoring workloads that vLLM's scheduler bends:
prefills cut into chunks of a few blocks, a KV cache too small for its batch
(requests preempted and resumed, hitting their own blocks again), every
``k`` from 0 to the whole vocabulary, and ``logprobs_mode="raw_logits"``.
The oracle is the same model with prefix caching off, which computes every
position. Then a hostile turn: rows that vanish from the worker behind the
scheduler's back are never served as scores, bad requests change nothing,
and rows still follow the batch order when the model runner builds its
request ids anew each step.

The store and tier tests (``test_vllm_live_store``, ``test_vllm_live_tier``)
score multimodal prompts in vLLM's multiprocess mode, under evictions and
through the Redis tier; the server's completions are in ``test_vllm_server``.
Same conventions as ``test_vllm_live``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_vllm_live as live

pytestmark = live.pytestmark

WORKER = "omnicache.integrations.vllm.worker.OmniCPUWorker"
# The bound on the staged steps' rows, which the budget holds too.
STAGED_BYTES = 256 * 2**10
CONNECTOR = {
    "kv_connector": "OmniStoreConnector",
    "kv_connector_module_path": "omnicache.integrations.vllm.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"max_staged_bytes": STAGED_BYTES},
}
# 2 layers x K and V x 2 heads x 32 values x 4 bytes per token.
BLOCK_BYTES = 2 * 2 * 2 * 32 * live.BLOCK_SIZE * 4
# The store's rows of a block (128 float32 values a token), in the same budget.
STORE_BYTES = 128 * live.BLOCK_SIZE * 4
# A few-shot prefix of 10 blocks, then each request's question: 354 tokens.
PREFIX = [(7 * i) % 300 + 1 for i in range(10 * live.BLOCK_SIZE)]


def question(index: int) -> list[int]:
    return [(13 * index + 5 * j) % 300 + 1 for j in range(34)]


# The first wave computes the prefix; the second scores four questions behind
# it with k of 3, the whole vocabulary, 0 and 5, and decodes long enough that
# the store engine's 19 usable blocks cannot hold the batch (10 prefix blocks
# shared, 3 of each request's own): vLLM preempts and resumes requests.
WAVES = [[(0, 3, 4)], [(1, 3, 40), (2, -1, 40), (3, 0, 40), (4, 5, 40)]]
NUM_BLOCKS = 20
CHUNK = 3 * live.BLOCK_SIZE  # max_num_batched_tokens: prefills in chunks of 3 blocks


def store_args(model: Path, **overrides: Any) -> dict[str, Any]:
    return live.engine_args(
        model,
        scheduler_cls=live.SCHEDULER,
        worker_cls=WORKER,
        kv_transfer_config=dict(CONNECTOR),
        max_logprobs=-1,
        **overrides,
    )


def off_args(model: Path, **overrides: Any) -> dict[str, Any]:
    return live.engine_args(model, enable_prefix_caching=False, max_logprobs=-1, **overrides)


def serve(llm: Any, waves: list[list[tuple[int, int, int]]]) -> dict[str, Any]:
    from vllm import SamplingParams

    outputs: list[Any] = []
    for wave in waves:
        prompts = [{"prompt_token_ids": PREFIX + question(index)} for index, _, _ in wave]
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=k)
            for _, k, max_tokens in wave
        ]
        outputs += llm.generate(prompts, params, use_tqdm=False)
    metrics = {
        metric.name: metric.value for metric in llm.get_metrics() if hasattr(metric, "value")
    }
    run = {
        "hits": [output.num_cached_tokens for output in outputs],
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "prompt_logprobs": [output.prompt_logprobs for output in outputs],
        "preemptions": metrics["vllm:num_preemptions"],
    }
    if llm.llm_engine.vllm_config.kv_transfer_config is not None:
        (run["stats"],) = llm.collective_rpc("omni_live_store_stats")
    live.shut(llm)
    return run


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnicache.demo.tiny_models import build_text_model

    return build_text_model(tmp_path_factory.mktemp("live-scoring") / "qwen2-tiny")


@pytest.fixture(scope="module")
def pressed(text_model: Path, in_process: None) -> dict[str, dict[str, Any]]:
    """WAVES through the store engine under pressure, and through an engine without caching."""
    from vllm import LLM

    store = LLM(
        **store_args(
            text_model,
            kv_cache_memory_bytes=NUM_BLOCKS * (BLOCK_BYTES + STORE_BYTES) + STAGED_BYTES,
            max_num_batched_tokens=CHUNK,
            max_model_len=512,
        )
    )
    return {"store": serve(store, WAVES), "off": serve(LLM(**off_args(text_model)), WAVES)}


def test_scores_equal_an_engine_without_caching_through_chunks_and_preemption(
    pressed: dict[str, dict[str, Any]],
) -> None:
    store, off = pressed["store"], pressed["off"]
    # vLLM bent the store engine's schedule: prefills in chunks, and the
    # second wave preempted and resumed.
    assert store["preemptions"] > 0
    assert off["preemptions"] == 0
    assert store["tokens"] == off["tokens"]
    differences = [
        live.prompt_logprobs_difference(got, want)
        for got, want in zip(store["prompt_logprobs"], off["prompt_logprobs"], strict=True)
    ]
    assert max(differences) <= live.LOGPROB_ATOL, differences
    vocab = len(off["prompt_logprobs"][2][1])
    assert vocab > 500  # k=-1: every token of the vocabulary, at every position
    assert [len(store["prompt_logprobs"][3][p]) for p in (1, 100, 353)] == [1, 1, 1]  # k=0


def test_scoring_requests_hit_the_prefix_and_every_hit_was_scored_from_the_store(
    pressed: dict[str, dict[str, Any]],
) -> None:
    store = pressed["store"]
    prefix = len(PREFIX)
    # Each question hit the prefix at its first admission (a resumed request
    # may hit more: its own blocks, if vLLM kept them).
    assert store["hits"][0] == 0
    assert all(hit == prefix for hit in store["hits"][1:]), store["hits"]
    assert pressed["off"]["hits"] == [0] * 5
    stats = store["stats"]
    # Admissions after a preemption hit too; those whose prompt logprobs
    # vLLM had not finished were scored again.
    assert stats["num_hit_requests"] > stats["num_scored_requests"] >= 4
    assert stats["num_scored_tokens"] >= 4 * prefix
    assert stats["num_scored_tokens"] % live.BLOCK_SIZE == 0
    assert stats["num_score_failures"] == stats["num_stale_hit_blocks"] == 0


def test_raw_logits_mode_scores_as_vllm_does(text_model: Path, in_process: None) -> None:
    from vllm import LLM

    waves = [[(0, 4, 1)], [(1, 4, 1), (2, 0, 1)]]
    runs = {
        name: serve(LLM(**args(text_model, logprobs_mode="raw_logits")), waves)
        for name, args in (("store", store_args), ("off", off_args))
    }
    assert runs["store"]["hits"] == [0, len(PREFIX), len(PREFIX)]
    assert runs["store"]["stats"]["num_scored_tokens"] == 2 * len(PREFIX)
    # In process, the second wave's two requests start in one step: the
    # prefix's blocks they both hit are read once.
    assert runs["store"]["stats"]["store_num_hit_blocks_read"] == len(PREFIX) // live.BLOCK_SIZE
    for got, want in zip(
        runs["store"]["prompt_logprobs"], runs["off"]["prompt_logprobs"], strict=True
    ):
        assert live.prompt_logprobs_difference(got, want) <= live.LOGPROB_ATOL
        # Raw logits, not logprobs: some are positive.
        assert any(value.logprob > 0 for position in got[1:] for value in position.values())


# -- a hostile turn ---------------------------------------------------------------------


@pytest.fixture
def store_llm(text_model: Path, in_process: None) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(**store_args(text_model, enable_prompt_embeds=True))
    yield llm
    live.shut(llm)


def forget_every_row(worker: Any) -> None:
    """Clears the worker's stamps behind the scheduler's back (its table still holds them).

    The rows waiting to be written are written first: they are rows the worker holds.
    """
    worker.omni_store.flush()
    worker.omni_store.store.invalidate_all()


def stats_of(llm: Any) -> dict[str, Any]:
    (stats,) = llm.collective_rpc("omni_live_store_stats")
    return dict(stats)


def test_rows_gone_behind_the_schedulers_back_are_never_served_as_scores(
    store_llm: Any,
) -> None:
    from vllm import SamplingParams

    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    params = SamplingParams(
        max_tokens=1,
        temperature=0,
        prompt_logprobs=2,
        extra_args={"omnicache_prompt_hidden_states": True},
    )
    first = store_llm.generate({"prompt_token_ids": PREFIX + question(0)}, params, use_tqdm=False)
    store_llm.collective_rpc(forget_every_row)
    (hit,) = store_llm.generate({"prompt_token_ids": PREFIX + question(1)}, params, use_tqdm=False)
    # The scheduler promised the prefix; the worker found no rows for it.
    assert hit.num_cached_tokens == len(PREFIX)
    stats = stats_of(store_llm)
    assert stats["num_stale_hit_blocks"] == len(PREFIX) // live.BLOCK_SIZE
    assert stats["num_score_failures"] == 1
    assert stats["num_scored_requests"] == 0
    # Never another block's score: each of the hit's positions holds its
    # prompt token alone, with a NaN logprob; the rest are vLLM's.
    prompt = PREFIX + question(1)
    cached = hit.prompt_logprobs[1 : len(PREFIX) + 1]
    assert [list(position) for position in cached] == [[token] for token in prompt[1:321]]
    assert all(
        math.isnan(position[token].logprob)
        for position, token in zip(cached, prompt[1:321], strict=True)
    )
    computed = hit.prompt_logprobs[len(PREFIX) + 1 :]
    assert not any(
        math.isnan(value.logprob) for position in computed for value in position.values()
    )
    assert take_prompt_hidden_states(store_llm, [*first, hit])[1] is None


def test_bad_scoring_requests_change_nothing(store_llm: Any) -> None:
    import torch
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    prompt = {"prompt_token_ids": PREFIX + question(0)}
    store_llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    before = stats_of(store_llm)
    # k above the engine's max_logprobs: vLLM refuses it before it is scheduled.
    with pytest.raises(VLLMValidationError, match="prompt logprobs of 1000000, which is greater"):
        store_llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=10**6))
    assert stats_of(store_llm) == before
    # Prompt embeddings: vLLM computes no prompt logprobs for them (the
    # server refuses the request); omnicache leaves such a request off the
    # cache as vLLM does.
    embeds = torch.randn(len(PREFIX) + 2, 128)
    for _ in range(2):
        (output,) = store_llm.generate(
            {"prompt_embeds": embeds},
            SamplingParams(max_tokens=1, prompt_logprobs=1),
            use_tqdm=False,
        )
        assert output.prompt_logprobs == [None]
        assert output.num_cached_tokens == 0
    after = stats_of(store_llm)
    assert after["num_scored_requests"] == after["num_score_failures"] == 0
    assert after["num_hit_requests"] == before["num_hit_requests"]


def test_rows_follow_the_batch_order_when_vllm_builds_its_request_ids_anew(
    store_llm: Any,
) -> None:
    """The capture reads the input batch's own list of request ids when ``req_ids`` is
    that list (vLLM 0.32's property), and otherwise calls the property each step."""
    import torch
    from vllm import SamplingParams

    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    def serve_four(salt: str) -> tuple[list[list[int]], list[Any]]:
        # Every position's rows, gathered step by step; the requests finish at
        # different steps, so vLLM condenses the batch and its order changes.
        prompts = [{"prompt_token_ids": question(i) * 2, "cache_salt": salt} for i in range(4)]
        params = [
            SamplingParams(
                max_tokens=n, temperature=0, extra_args={"omnicache_all_hidden_states": True}
            )
            for n in (3, 9, 5, 12)
        ]
        outputs = store_llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        return tokens, take_prompt_hidden_states(store_llm, outputs)

    def rebuild_request_ids(worker: Any) -> bool:
        runner = worker.model_runner
        batch = runner.input_batch
        direct = bool(runner._model_forward.direct)

        class Rebuilt(type(batch)):  # type: ignore[misc]
            @property
            def req_ids(self) -> list[str]:
                return list(self._req_ids)

        batch.__class__ = Rebuilt
        # As when vLLM hands the runner a new input batch: looked at again.
        runner._model_forward.batch = None
        return direct

    tokens, states = serve_four("direct")
    (was_direct,) = store_llm.collective_rpc(rebuild_request_ids)
    assert was_direct is True
    rebuilt_tokens, rebuilt_states = serve_four("rebuilt")
    (direct,) = store_llm.collective_rpc(lambda worker: worker.model_runner._model_forward.direct)
    assert direct is False
    assert rebuilt_tokens == tokens
    for n, got, want in zip((3, 9, 5, 12), rebuilt_states, states, strict=True):
        assert got is not None and want is not None
        assert tuple(got.shape) == tuple(want.shape) == (68 + n - 1, 128)
        assert torch.equal(got, want)


# -- per-token embeddings ---------------------------------------------------------------


def embed(llm: Any, indices: list[int]) -> list[Any]:
    outputs: list[Any] = []
    for index in indices:
        outputs += llm.encode(
            [{"prompt_token_ids": PREFIX + question(index)}],
            pooling_task="token_embed",
            use_tqdm=False,
        )
    return outputs


def test_per_token_embeddings_of_a_hit_come_from_the_store(
    text_model: Path, in_process: None
) -> None:
    import torch
    from vllm import LLM

    pooling = {"runner": "pooling", "pooler_config": {"task": "token_embed"}}
    # Prefills in chunks of 3 blocks: vLLM's pooler gathers the rows chunk by chunk.
    store = LLM(**store_args(text_model, max_num_batched_tokens=CHUNK, **pooling))
    got = embed(store, [0, 1, 2, 1])
    (stats,) = store.collective_rpc("omni_live_store_stats")
    live.shut(store)
    off = LLM(**off_args(text_model, **pooling))
    want = embed(off, [0, 1, 2, 1])
    live.shut(off)
    full = (len(PREFIX) + 34 - 1) // live.BLOCK_SIZE * live.BLOCK_SIZE
    assert [output.num_cached_tokens for output in got] == [0, len(PREFIX), len(PREFIX), full]
    assert [output.num_cached_tokens for output in want] == [0, 0, 0, 0]
    for mine, theirs in zip(got, want, strict=True):
        assert tuple(mine.outputs.data.shape) == (len(PREFIX) + 34, 128)
        assert torch.allclose(mine.outputs.data, theirs.outputs.data, atol=1e-5, rtol=1e-5)
    assert stats["num_scored_requests"] == 3
    assert stats["num_scored_tokens"] == 2 * len(PREFIX) + full
