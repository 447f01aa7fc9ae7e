"""Which requests vLLM keeps off its prefix cache may read it from omnicache's store.

vLLM's own ``Request`` and ``SamplingParams`` / ``PoolingParams`` (0.33 in
``.venv``, 0.32 in the live engine's environment); the live engine's
behaviour is in ``test_vllm_live_scoring``.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_vllm_integration import VLLM_MISSING, needs_vllm

pytestmark = needs_vllm

if VLLM_MISSING is None:
    import torch
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from omnicache.integrations.vllm.scheduler import reads_prefix_from_store

PROMPT = list(range(1, 70))


def request(*, sampling: Any = None, pooling: Any = None, embeds: bool = False) -> Any:
    return Request(
        request_id="r",
        prompt_token_ids=None if embeds else list(PROMPT),
        prompt_embeds=torch.zeros(len(PROMPT), 8) if embeds else None,
        sampling_params=sampling,
        pooling_params=pooling,
        block_hasher=None,
    )


@pytest.mark.parametrize(
    ("fields", "skipped", "expected"),
    [
        ({"prompt_logprobs": 1}, True, True),
        ({"prompt_logprobs": 0}, True, True),
        ({"prompt_logprobs": -1}, True, True),
        # Off the cache for another reason than its prompt logprobs: kept off.
        ({"skip_reading_prefix_cache": True}, True, False),
        # vLLM serves these with its V2 model runner only.
        ({"prompt_logprobs": 1, "prompt_logprob_token_ids": [[1, 2]]}, True, False),
        # On the cache already.
        ({}, False, False),
    ],
)
def test_prompt_logprobs_read_the_cache_from_the_store(
    fields: dict[str, Any], skipped: bool, expected: bool
) -> None:
    made = request(sampling=SamplingParams(max_tokens=1, **fields))
    assert made.skip_reading_prefix_cache is skipped
    assert reads_prefix_from_store(made, chunked_prefill=True) is expected


def test_prompt_embeddings_keep_vllms_behaviour() -> None:
    made = request(sampling=SamplingParams(max_tokens=1, prompt_logprobs=1), embeds=True)
    assert made.skip_reading_prefix_cache is True
    assert reads_prefix_from_store(made, chunked_prefill=True) is False


@pytest.mark.parametrize(
    ("task", "chunked_prefill", "expected"),
    [
        ("token_embed", True, True),
        # vLLM's pooler gathers a prompt's rows chunk by chunk only with chunked prefill.
        ("token_embed", False, False),
        ("token_classify", True, False),
    ],
)
def test_per_token_embeddings_read_the_cache_with_chunked_prefill(
    task: str, chunked_prefill: bool, expected: bool
) -> None:
    # NOTE: vLLM sets the flag when it checks the parameters against the model.
    made = request(pooling=PoolingParams(task=task, skip_reading_prefix_cache=True))
    assert made.skip_reading_prefix_cache is True
    assert reads_prefix_from_store(made, chunked_prefill=chunked_prefill) is expected
