"""Tensor parallelism in live engines: the store's oracle and the tier at tensor_parallel_size=2.

A child interpreter (``VLLM_CPU_OMP_THREADS_BIND="0|1"``: one core a rank)
runs three engines of the tiny Qwen2 (4 heads, 2 KV heads: one KV head a
rank) at ``tensor_parallel_size=2``, each with two worker processes:

1. the oracle: prefix caching off, every prompt's hidden states computed;
2. engine A, with omnicache and the Redis tier: requests that share
   prefixes hit what earlier ones computed;
3. engine B, with an empty cache and the same tier: it loads A's blocks,
   each rank its own KV shard (vLLM's external tokens);

then an engine at ``tensor_parallel_size=1`` on the same tier, which finds
nothing there: the values of another layout have other names. Every
request asks for its prompt's hidden states; every other one also for its
prompt logprobs (scored from the stored rows through vLLM's
vocabulary-parallel LM head on both ranks: the first rank keeps the rows
and hands a scored hit's to the other). The child prints what it saw,
and the tests check it.

Same conventions as ``test_vllm_live``: skipped without the live CPU engine
of vLLM 0.32, failed instead under ``CI=true`` or
``OMNICACHE_REQUIRE_VLLM_LIVE=1``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import test_vllm_live as live

if TYPE_CHECKING:
    from redis_server import RedisServer

pytestmark = live.pytestmark

NAMESPACE = "live-tp2"
PREFIX = "omnicache-test"
P1 = live.LONG  # 4 full blocks, then 2 tokens
P2 = live.LONG[:96] + live.OTHER[:40]  # P1's first 3 blocks, then its own
P3 = live.LONG[:64] + live.OTHER[:66]  # P1's first 2 blocks, then its own
A_WAVES = [["P1"], ["P1", "P2"], ["P3"]]
B_WAVES = [["P2"], ["P3"], ["P1"]]
# Per request: vLLM's cached tokens (the hit), and what its admission took from the tier.
A_HITS = [0, 128, 96, 64]
B_HITS = [128, 128, 128]
# B: P2's 4 blocks all from A; P3's first 2 are P2's (local), 2 loaded;
# P1's first 3 are local (P2's and P3's), its 4th loaded.
B_EXTERNAL = [128, 64, 32]

CHILD = """
import json, sys
from pathlib import Path
import test_vllm_live as t
from vllm import LLM, SamplingParams
from omnicache.integrations.vllm.results import take_prompt_hidden_states

model, url, namespace, prefix = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
prompts = json.loads(sys.argv[5])
waves = json.loads(sys.argv[6])


def engine(*, caching, tier, tp=2):
    extra = {"tier_url": url, "tier_namespace": namespace, "tier_prefix": prefix} if tier else {}
    overrides = {"scheduler_cls": t.SCHEDULER} if caching else {}
    return LLM(**t.engine_args(
        model,
        worker_cls="omnicache.integrations.vllm.worker.OmniCPUWorker",
        tensor_parallel_size=tp,
        enable_prefix_caching=caching,
        kv_transfer_config={
            "kv_connector": "OmniStoreConnector",
            "kv_connector_module_path": "omnicache.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
        **overrides,
    ))


def serve(llm, run_waves, *, tier, score_all=False):
    outputs, asked = [], 0
    for wave in run_waves:
        params = []
        for _ in wave:
            params.append(SamplingParams(
                max_tokens=t.MAX_TOKENS, temperature=0,
                extra_args={"omnicache_prompt_hidden_states": True},
                prompt_logprobs=3 if score_all or asked % 2 else None,
            ))
            asked += 1
        outputs += llm.generate(
            [{"prompt_token_ids": prompts[name]} for name in wave], params, use_tqdm=False
        )
    run = {
        "names": [name for wave in run_waves for name in wave],
        "hits": [o.num_cached_tokens for o in outputs],
        "external": [
            (o.kv_transfer_params or {}).get("omnicache_external_tokens") for o in outputs
        ],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "states": take_prompt_hidden_states(llm, outputs),
        "prompt_logprobs": [o.prompt_logprobs for o in outputs],
        "stats": llm.collective_rpc("omni_live_store_stats"),
    }
    if tier:
        run["flushed"] = llm.collective_rpc("omni_tier_flush")
    t.shut(llm)
    return run


off = serve(
    engine(caching=False, tier=False), [[name] for name in prompts], tier=False, score_all=True
)
reference = dict(zip(off["names"], zip(off["states"], off["tokens"], off["prompt_logprobs"])))
report = {}
for label, run_waves, tp in (("a", waves["a"], 2), ("b", waves["b"], 2), ("single", [["P1"]], 1)):
    run = serve(engine(caching=True, tier=True, tp=tp), run_waves, tier=True)
    differences, logprobs = [], []
    for name, states, tokens, scored in zip(
        run["names"], run["states"], run["tokens"], run["prompt_logprobs"]
    ):
        want_states, want_tokens, want_scored = reference[name]
        differences.append(
            None if states is None or states.shape != want_states.shape
            else float((states - want_states).abs().max())
        )
        assert tokens == want_tokens, (label, name)
        logprobs.append(
            None if scored is None else t.prompt_logprobs_difference(scored, want_scored)
        )
    report[label] = {
        "hits": run["hits"],
        "external": run["external"],
        "differences": differences,
        "logprobs": logprobs,
        "flushed": run["flushed"],
        "stats": run["stats"],
    }
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, redis_server_session: RedisServer) -> Any:
    from omnicache.demo.tiny_models import build_text_model

    model = build_text_model(tmp_path_factory.mktemp("live-tp2") / "qwen2-tiny")
    client = redis_server_session.client()
    stale = list(client.scan_iter(f"{PREFIX}:{NAMESPACE}:*"))
    if stale:
        client.delete(*stale)
    line = live.run_child(
        CHILD,
        str(model),
        redis_server_session.url,
        NAMESPACE,
        PREFIX,
        json.dumps({"P1": P1, "P2": P2, "P3": P3}),
        json.dumps({"a": A_WAVES, "b": B_WAVES}),
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        # NOTE: vLLM's executor logs its shutdown at exit, after the child's
        # last line, unless its log is limited to errors.
        VLLM_LOGGING_LEVEL="ERROR",
        timeout_s=600,
    )
    saved = sorted(
        {name.decode().rsplit(":", 1)[1] for name in client.scan_iter(f"{PREFIX}:{NAMESPACE}:*")}
    )
    return {**json.loads(line), "entries": saved}


def test_prompt_hidden_states_at_tp2_equal_an_engine_without_caching(report: Any) -> None:
    a, b = report["a"], report["b"]
    assert a["hits"] == A_HITS
    assert b["hits"] == B_HITS
    for run in (a, b):
        assert all(d is not None and d <= 1e-5 for d in run["differences"]), run["differences"]
        # Every other request scored its prompt, its hit's positions from the stored rows.
        scored = run["logprobs"][1::2]
        assert all(d is not None and d <= live.LOGPROB_ATOL for d in scored), scored
        assert run["logprobs"][0::2] == [None] * len(run["logprobs"][0::2])
    # Both ranks verified the same hits against their own stamps; only the
    # first rank gathered results, and every one was taken.
    for run, requests in ((a, 4), (b, 3)):
        first, second = run["stats"]
        for field in (
            "num_hit_blocks",
            "num_hit_requests",
            "num_rows_written",
            "num_steps",
            "num_decode_steps",
        ):
            assert first[field] == second[field], field
        # Both ranks staged the same steady decode steps by their plans alone.
        assert first["num_decode_steps"] > 0
        assert first["num_hit_blocks"] == sum(run["hits"]) // live.BLOCK_SIZE
        assert first["num_stale_hit_blocks"] == second["num_stale_hit_blocks"] == 0
        assert first["num_slot_mismatches"] == second["num_slot_mismatches"] == 0
        assert first["num_scored_requests"] == second["num_scored_requests"] > 0
        assert first["num_score_failures"] == second["num_score_failures"] == 0
        # The rows are on the first rank only: the other keeps a byte a row.
        assert second["store_nbytes"] * 128 * 4 == first["store_nbytes"] > 0
        # Each rank's KV shard, store and staged steps' bound (by default a
        # sixteenth of the budget, on every rank) fit the 64 MiB the engine was
        # given, with less than a block to spare on the first (1 KV head a
        # rank: 16 KiB a block, and 16 KiB of rows); the other has the first's
        # blocks.
        block = 2 * 2 * 1 * 32 * live.BLOCK_SIZE * 4
        rows = 128 * live.BLOCK_SIZE * 4
        budget = 64 * 2**20
        staged = budget // 16
        assert first["max_staged_nbytes"] == second["max_staged_nbytes"] == staged
        assert first["kv_cache_nbytes"] == second["kv_cache_nbytes"]
        total = first["kv_cache_nbytes"] + first["store_nbytes"] + staged
        assert budget - (block + rows) < total <= budget
        assert first["num_prompt_results"] == requests
        assert second["num_prompt_results"] == 0
        assert first["num_pending_results"] == second["num_pending_results"] == 0


def test_tier_between_tp2_engines_loads_each_ranks_own_shard(report: Any) -> None:
    a, b = report["a"], report["b"]
    assert a["flushed"] == b["flushed"] == [True, True]
    # Hidden rows once (the first rank's), each layer's KV once per rank.
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    assert report["entries"] == sorted(
        ["hidden_states"]
        + [f"kv.tp{rank}of2.{layer}" for layer in layers for rank in range(2)]
        + [f"kv.tp0of1.{layer}" for layer in layers]
    )
    # A: its hits were local; B: from the tier, as B_EXTERNAL says.
    assert a["external"] == [0, 0, 0, 0]
    assert b["external"] == B_EXTERNAL
    first, second = b["stats"]
    assert (
        first["tier_num_loaded_blocks"]
        == second["tier_num_loaded_blocks"]
        == sum(B_EXTERNAL) // live.BLOCK_SIZE
    )
    assert first["tier_num_failed_loads"] == second["tier_num_failed_loads"] == 0
    # A saved each distinct full block once, on each rank.
    a_first, a_second = a["stats"]
    assert a_first["tier_num_saved_blocks"] == a_second["tier_num_saved_blocks"] == 4 + 1 + 2


def test_an_engine_of_another_layout_loads_nothing_a_tp2_engine_saved(report: Any) -> None:
    single = report["single"]
    assert single["hits"] == [0]
    assert single["external"] == [0]
    assert single["differences"][0] is not None and single["differences"][0] <= 1e-5
    (stats,) = single["stats"]
    assert stats["tier_num_loaded_blocks"] == 0
    assert stats["tier_num_saved_blocks"] == 4
