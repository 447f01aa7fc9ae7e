"""A thinker -> talker pipeline on two live engines, prefix caching on in both, exact.

The staged demo (`omnicache.demo.staged`) serves the synthetic trace (three
tenants with their salts, repeated and distinct images and audio clips,
multi-turn conversations) through the tiny Qwen2.5-Omni thinker and a tiny
talker that reads the thinker's rows at every position
(`omnicache.pipeline`), three times: caching off in both stages (the
oracle), vLLM's own caching, omnicache. The KV caches are small, so blocks
are evicted and handed out again in both stages. The thinker runs in
process and the talker in vLLM's multiprocess mode. Then a hostile turn on
every position's rows in process: a forged key, a forged count, a second
take, stop strings and ``n``; and `Pipeline` itself handing back the talker's
prompt rows when asked, on a hit in both stages. Same conventions as ``test_vllm_live``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import test_vllm_live as live

pytestmark = live.pytestmark

NUM_REQUESTS = 24
NUM_BLOCKS = 80  # a request of 2,048 tokens fits (65 blocks); the trace does not


@pytest.fixture(scope="module")
def report() -> Any:
    from omnicache.demo.live import LiveDemoConfig
    from omnicache.demo.staged import run_staged_demo
    from omnicache.demo.workloads import SyntheticConfig, synthetic_trace

    trace = synthetic_trace(SyntheticConfig(num_requests=NUM_REQUESTS), seed=0)
    return run_staged_demo(trace, LiveDemoConfig(num_blocks=NUM_BLOCKS))


def test_every_output_of_both_stages_equals_the_pipeline_without_caching(report: Any) -> None:
    import torch

    from omnicache.demo.staged import TALKER_TOKENS, THINKER_TOKENS

    off, _, omni = report.runs
    assert len(off.outputs) == len(omni.outputs) == NUM_REQUESTS
    for want, got in zip(off.outputs, omni.outputs, strict=True):
        num_prompt = len(got.thinker.prompt_token_ids)
        assert list(got.thinker.prompt_token_ids) == list(want.thinker.prompt_token_ids)
        assert list(got.thinker.outputs[0].token_ids) == list(want.thinker.outputs[0].token_ids)
        # Every position the thinker computed: its prompt, its tokens but the last.
        assert got.thinker_hidden_states.shape == (num_prompt + THINKER_TOKENS - 1, 128)
        assert torch.allclose(
            got.thinker_hidden_states, want.thinker_hidden_states, atol=1e-5, rtol=1e-5
        )
        # The talker's prompt: one row a thinker row, then its start token.
        assert got.talker_hidden_states.shape == (num_prompt + THINKER_TOKENS, 64)
        assert torch.allclose(
            got.talker_hidden_states, want.talker_hidden_states, atol=1e-5, rtol=1e-5
        )
        tokens = list(got.talker.outputs[0].token_ids)
        assert tokens == list(want.talker.outputs[0].token_ids) and len(tokens) == TALKER_TOKENS
    assert report.num_mismatches == 0 and report.mismatched_requests == []
    assert report.num_stale_reads == 0 and report.ok


def test_both_stages_hit_within_each_tenant_and_reuse_blocks(report: Any) -> None:
    off, own, omni = report.runs
    for stage in (omni.thinker, omni.talker):
        assert stage.num_hit_tokens > 0
        # Never more than an infinite cache over the tenant's own keys: no
        # hit crosses a salt.
        for hit, best in zip(stage.hit_tokens, stage.best_hit_tokens, strict=True):
            assert hit <= best
        assert stage.stats["num_stale_hit_blocks"] == 0
        assert stage.stats["num_hit_blocks"] * 32 == stage.num_hit_tokens
        # The KV cache was too small for the trace: blocks were handed out again.
        assert stage.stats["num_cleared_blocks"] > 0
    assert off.thinker.num_hit_tokens == off.talker.num_hit_tokens == 0
    # vLLM's caching: its thinker keeps caching off (it returns no rows); its
    # talker keys the same embeddings as omnicache's talker.
    assert own.thinker.num_hit_tokens == 0
    assert own.talker.num_hit_tokens > 0


# -- every position's rows, attacked ------------------------------------------------------


@pytest.fixture(scope="module")
def talker_llm(tmp_path_factory: pytest.TempPathFactory, report: Any) -> Iterator[Any]:
    """A talker for ``text_llm``'s rows, in vLLM's multiprocess mode (before ``text_llm``)."""
    from vllm import LLM

    from omnicache.demo.tiny_models import build_talker_model

    model = build_talker_model(tmp_path_factory.mktemp("live-talker") / "talker-tiny")
    llm = LLM(
        **live.engine_args(
            model,
            enable_prompt_embeds=True,
            scheduler_cls=live.SCHEDULER,
            worker_cls="omnicache.integrations.vllm.worker.OmniCPUWorker",
            kv_transfer_config={
                "kv_connector": "OmniStoreConnector",
                "kv_connector_module_path": "omnicache.integrations.vllm.connector",
                "kv_role": "kv_both",
            },
        )
    )
    yield llm
    live.shut(llm)


@pytest.fixture(scope="module")
def text_llm(
    tmp_path_factory: pytest.TempPathFactory, talker_llm: Any, in_process: None, report: Any
) -> Iterator[Any]:
    """An in-process engine with the store (after the multiprocess engines)."""
    from vllm import LLM

    from omnicache.demo.tiny_models import build_text_model

    model = build_text_model(tmp_path_factory.mktemp("live-every") / "qwen2-tiny")
    llm = LLM(
        **live.engine_args(
            model,
            scheduler_cls=live.SCHEDULER,
            worker_cls="omnicache.integrations.vllm.worker.OmniCPUWorker",
            kv_transfer_config={
                "kv_connector": "OmniStoreConnector",
                "kv_connector_module_path": "omnicache.integrations.vllm.connector",
                "kv_role": "kv_both",
            },
        )
    )
    yield llm
    live.shut(llm)


def test_every_positions_rows_are_taken_once_by_their_key_and_count(text_llm: Any) -> None:
    import torch
    from vllm import SamplingParams

    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    every = {"omnicache_all_hidden_states": True}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args=every)
    prompt = {"prompt_token_ids": live.LONG}
    (first,) = text_llm.generate([prompt], params, use_tqdm=False)
    (rows,) = take_prompt_hidden_states(text_llm, [first])
    assert first.kv_transfer_params["omnicache_num_positions"] == len(live.LONG) + 5
    assert rows is not None and rows.shape == (len(live.LONG) + 5, 128)
    # Again: a hit of 4 blocks, its rows from the store, the rest computed.
    (second,) = text_llm.generate([prompt], params, use_tqdm=False)
    assert second.num_cached_tokens == 128
    handle = dict(second.kv_transfer_params)
    forged = type(
        "Forged", (), {"kv_transfer_params": {**handle, "omnicache_result_key": "0" * 32}}
    )
    with pytest.raises(ValueError, match=r"found none for \["):
        take_prompt_hidden_states(text_llm, [forged])
    (again,) = take_prompt_hidden_states(text_llm, [second])
    assert again is not None and torch.allclose(again, rows, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"found none for \["):
        take_prompt_hidden_states(text_llm, [second])
    # A count past the rows the engine computed: nothing is served.
    (third,) = text_llm.generate([prompt], params, use_tqdm=False)
    counted = dict(third.kv_transfer_params)
    counted["omnicache_num_positions"] += 1
    taller = type("Taller", (), {"kv_transfer_params": counted})
    assert take_prompt_hidden_states(text_llm, [taller]) == [None]
    # Stop strings end a request in the front end, after the engine computed
    # past them; n > 1 would have one result for several choices: refused.
    for bad, reason in (
        ({"stop": ["a"]}, "expected no stop strings"),
        ({"n": 2}, "expected n=1"),
    ):
        with pytest.raises(ValueError, match=reason):
            text_llm.generate(
                [prompt], SamplingParams(max_tokens=2, extra_args=every, **bad), use_tqdm=False
            )


def test_the_pipeline_hands_back_the_talkers_prompt_rows_when_asked(
    text_llm: Any, talker_llm: Any
) -> None:
    import torch
    from vllm import SamplingParams

    from omnicache.pipeline import Pipeline

    pipe = Pipeline(text_llm, talker_llm, talker_hidden_states=True)
    thinker = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    talker = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": live.OTHER + [5] * 60, "cache_salt": "pipeline"}
    (first,) = pipe.generate([prompt], thinker, talker)
    (second,) = pipe.generate([prompt], thinker, talker)
    positions = len(prompt["prompt_token_ids"]) + 6 - 1
    assert first.thinker.num_cached_tokens == first.talker.num_cached_tokens == 0
    # Again: both stages hit, every full block of the talker's prompt included.
    assert second.thinker.num_cached_tokens == 128
    assert second.talker.num_cached_tokens == (positions + 1) // 32 * 32
    for output in (first, second):
        assert output.talker_hidden_states is not None
        assert output.talker_hidden_states.shape == (positions + 1, 64)
    assert torch.allclose(
        second.talker_hidden_states, first.talker_hidden_states, atol=1e-5, rtol=1e-5
    )
    assert list(second.talker.outputs[0].token_ids) == list(first.talker.outputs[0].token_ids)
