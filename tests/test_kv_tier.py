"""The live engine's Redis tier without an engine: configuration, save, fetch and load, on a
real server.

`TierReader` tells which blocks Redis holds (no values); `WorkerTier` moves
blocks between KV caches in vLLM's per-layer view ``(num_blocks, heads,
block_size, content)``, a store's hidden rows and Redis, loading the leading
blocks that verify; `LiveStore` reports the blocks of a load that did not
load. The live engines' test is ``test_vllm_live_tier``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
from test_vllm_integration import VLLM_MISSING

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.kv_tier import (
    TierConfig,
    TierReader,
    WorkerTier,
    entry_names,
    kv_entry_name,
    tier_config,
)
from omnicache.integrations.vllm.plan import LoadOrder, PlannedRequest, StepPlan
from omnicache.store import HIDDEN_STATES, TensorStore

# NOTE: the worker's module imports vLLM (it is the worker's room); its store needs no engine.
pytestmark = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")
if VLLM_MISSING is None:
    from omnicache.integrations.vllm.live_store import LiveStore, follower_store

if TYPE_CHECKING:
    from redis_server import RedisServer

BS = 4
HIDDEN = 3
HEADS, HEAD2 = 2, 6  # KV heads, 2 * head size
LAYERS = ("model.layers.1.attn", "model.layers.0.attn")
K = [BlockHash(bytes([i + 1]) * 32) for i in range(4)]


def caches(seed: int | None, heads: int = HEADS) -> dict[str, torch.Tensor]:
    """Each layer's KV cache: random values from ``seed``, or zeros (None)."""
    if seed is None:
        return {name: torch.zeros(8, heads, BS, HEAD2) for name in LAYERS}
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn((8, heads, BS, HEAD2), generator=gen) for name in LAYERS}


def assert_same_kv(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], blocks: dict[int, int]
) -> None:
    """Every layer's block ``got_id`` of ``got`` equals its block ``blocks[got_id]`` of ``want``."""
    for name in LAYERS:
        for got_id, want_id in blocks.items():
            assert torch.equal(got[name][got_id], want[name][want_id]), (name, got_id)


def store() -> TensorStore:
    return TensorStore(8, BS, hidden_size=HIDDEN, hidden_dtype=torch.float32)


def rank_store(rank: int) -> TensorStore:
    """A tensor-parallel rank's store: the rows on the first rank, a follower's on the others."""
    return store() if rank == 0 else follower_store(8, BS)


def reader(config: TierConfig) -> TierReader:
    return TierReader(config, entry_names(LAYERS))


@pytest.fixture
def config(redis_server: RedisServer, request: pytest.FixtureRequest) -> TierConfig:
    namespace = f"kv-tier-{request.node.name}".replace("[", "-").replace("]", "")
    client = redis_server.client()
    stale = list(client.scan_iter(f"test:{namespace}:*"))
    if stale:
        client.delete(*stale)
    return TierConfig(redis_server.url, namespace, "test")


def saved_blocks(config: TierConfig) -> tuple[WorkerTier, dict[str, torch.Tensor], TensorStore]:
    """A worker that computed blocks 1 and 2 (keys K[0], K[1]) and saved them."""
    kv, st = caches(seed=7), store()
    rows = torch.arange(2 * BS * HIDDEN, dtype=torch.float32).reshape(2 * BS, HIDDEN)
    st.write_blocks(HIDDEN_STATES, rows, [1, 2], block_keys=[K[0], K[1]])
    tier = WorkerTier(config, kv, st)
    tier.save(st, {1: K[0], 2: K[1]})
    assert tier.flush(10.0)
    tier.close()
    return tier, kv, st


def test_tier_config_is_none_without_a_url_and_names_what_is_wrong() -> None:
    assert tier_config(None) is None
    assert tier_config({"max_prompt_results": 3}) is None
    got = tier_config({"tier_url": "redis://h:1/0", "tier_namespace": "m"})
    assert got == TierConfig("redis://h:1/0", "m", "omnicache")
    with pytest.raises(
        ValueError, match=r"expected 'tier_url' with \['tier_namespace'\], found none"
    ):
        tier_config({"tier_namespace": "m"})
    with pytest.raises(ValueError, match=r"expected a redis:// URL, found 'http://h'"):
        tier_config({"tier_url": "http://h", "tier_namespace": "m"})
    with pytest.raises(ValueError, match=r"expected 'tier_namespace' with 'tier_url'"):
        tier_config({"tier_url": "redis://h:1/0"})
    with pytest.raises(ValueError, match=r"tier_namespace.*found 'a:b'"):
        tier_config({"tier_url": "redis://h:1/0", "tier_namespace": "a:b"})


def test_a_worker_refuses_kv_caches_of_another_layout(config: TierConfig) -> None:
    bad = {"l": torch.zeros(8, HEADS, BS + 1, HEAD2)}
    with pytest.raises(ValueError, match=r"kv_caches\['l'\]: expected vLLM's per-layer view"):
        WorkerTier(config, bad, store())


def test_saved_blocks_load_into_other_blocks_of_another_worker(config: TierConfig) -> None:
    _, kv, st = saved_blocks(config)
    index = reader(config)
    assert index.held([K[0], K[1], K[2]]) == 2  # K[2] was never saved
    assert index.held([K[2], K[0]]) == 0  # leading blocks only
    index.close()
    target_kv, target = caches(seed=None), store()
    tier = WorkerTier(config, target_kv, target)
    assert tier.load(target, LoadOrder("r", (5, 6), (K[0], K[1]))) == 2
    assert_same_kv(target_kv, kv, {5: 1, 6: 2})
    assert not any(target_kv[name][1].any() for name in LAYERS)
    assert target.probe([5, 6], [K[0], K[1]]) == 2
    assert torch.equal(
        target.read_blocks(HIDDEN_STATES, [5, 6], [K[0], K[1]]),
        st.read_blocks(HIDDEN_STATES, [1, 2], [K[0], K[1]]),
    )
    assert (tier.stats.num_load_requests, tier.stats.num_loaded_blocks) == (1, 2)
    assert tier.stats.num_failed_loads == 0
    tier.close()


def test_entries_name_each_tensor_parallel_rank_and_the_layout() -> None:
    assert entry_names(LAYERS) == [
        "hidden_states",
        "kv.tp0of1.model.layers.0.attn",
        "kv.tp0of1.model.layers.1.attn",
    ]
    assert entry_names(LAYERS, 2) == [
        "hidden_states",
        "kv.tp0of2.model.layers.0.attn",
        "kv.tp1of2.model.layers.0.attn",
        "kv.tp0of2.model.layers.1.attn",
        "kv.tp1of2.model.layers.1.attn",
    ]
    with pytest.raises(ValueError, match=r"rank: expected 0 <= rank < 2, found 2"):
        kv_entry_name("l", 2, 2)


def test_tensor_parallel_ranks_each_load_their_own_shard_and_no_other_layout_does(
    config: TierConfig,
) -> None:
    # Two ranks of a tensor-parallel engine, each with its own heads (one each).
    rows = torch.arange(2 * BS * HIDDEN, dtype=torch.float32).reshape(2 * BS, HIDDEN)
    saved: list[dict[str, torch.Tensor]] = []
    workers = []
    for rank in range(2):
        # The first rank's store keeps the rows; the other's is a follower's (stamps).
        kv, st = caches(seed=10 + rank, heads=1), rank_store(rank)
        marks = rows if rank == 0 else torch.zeros(2 * BS, 1, dtype=torch.uint8)
        st.write_blocks(HIDDEN_STATES, marks, [1, 2], block_keys=[K[0], K[1]])
        workers.append((WorkerTier(config, kv, st, rank=rank, num_ranks=2), st))
        saved.append(kv)
    both = TierReader(config, entry_names(LAYERS, 2))
    one = TierReader(config, entry_names(LAYERS, 1))
    # Rank 1 alone saved: its shard is no block yet, and it saved no hidden rows.
    tier1, st1 = workers[1]
    tier1.save(st1, {1: K[0], 2: K[1]})
    assert tier1.flush(10.0)
    assert tier1.stats.num_saved_blocks == 2
    assert both.tier.count_held([K[0]], [HIDDEN_STATES]) == 0
    assert both.held([K[0], K[1]]) == 0
    tier0, st0 = workers[0]
    tier0.save(st0, {1: K[0], 2: K[1]})
    assert tier0.flush(10.0)
    assert both.held([K[0], K[1], K[2]]) == 2
    # An engine of another layout looks under other names: nothing.
    assert one.held([K[0], K[1]]) == 0
    for reader_ in (both, one):
        reader_.close()
    for rank in range(2):
        target_kv, target = caches(seed=None, heads=1), rank_store(rank)
        tier = WorkerTier(config, target_kv, target, rank=rank, num_ranks=2)
        assert tier.load(target, LoadOrder("r", (5, 6), (K[0], K[1]))) == 2
        assert_same_kv(target_kv, saved[rank], {5: 1, 6: 2})
        assert not torch.equal(target_kv[LAYERS[0]][5], saved[1 - rank][LAYERS[0]][1])
        # Both stamped the loaded blocks; only the first rank's store has their rows.
        assert target.probe([5, 6], [K[0], K[1]]) == 2
        if rank == 0:
            assert torch.equal(target.read_blocks(HIDDEN_STATES, [5, 6], [K[0], K[1]]), rows)
        tier.close()
    single_kv, single = caches(seed=None), store()
    tier = WorkerTier(config, single_kv, single)
    assert tier.load(single, LoadOrder("r", (5, 6), (K[0], K[1]))) == 0
    assert not any(single_kv[name].any() for name in LAYERS)
    tier.close()
    for tier_, _ in workers:
        tier_.close()


def test_a_shard_gone_from_one_rank_only_is_recomputed_and_both_ranks_agree_again(
    config: TierConfig, redis_server: RedisServer
) -> None:
    rows = torch.arange(2 * BS * HIDDEN, dtype=torch.float32).reshape(2 * BS, HIDDEN)
    for rank in range(2):
        kv, st = caches(seed=10 + rank, heads=1), rank_store(rank)
        marks = rows if rank == 0 else torch.zeros(2 * BS, 1, dtype=torch.uint8)
        st.write_blocks(HIDDEN_STATES, marks, [1, 2], block_keys=[K[0], K[1]])
        tier = WorkerTier(config, kv, st, rank=rank, num_ranks=2)
        tier.save(st, {1: K[0], 2: K[1]})
        assert tier.flush(10.0)
        tier.close()
    # After the scheduler's lookup, the second rank's shard of K[1] is evicted.
    client = redis_server.client()
    assert client.delete(f"test:{config.namespace}:{K[1].hex()}:kv.tp1of2.{LAYERS[0]}") == 1
    lives = []
    for rank in range(2):
        target = rank_store(rank)
        tier = WorkerTier(config, caches(seed=None, heads=1), target, rank=rank, num_ranks=2)
        # NOTE: no hit is scored here: the ranks' share is never called.
        lives.append(
            LiveStore(target, max_results=4, tier=tier, share=lambda r: r, keeps_results=rank == 0)
        )
    leader, follower = lives
    load = StepPlan(caching=True, loads=(LoadOrder("r", (5, 6), (K[0], K[1])),))
    assert leader.start_step(load) == set()
    assert follower.start_step(load) == {6}
    # vLLM joins the ranks' failed blocks ({6}) and recomputes the request from
    # block 6, behind its hit on block 5: the step stamps block 6 on both ranks
    # again, with the recomputed rows on the first.
    recomputed = rows[BS:] + 100
    step = StepPlan(
        caching=True,
        requests=(PlannedRequest("r", BS, BS, (6,), (5,), (K[0],)),),
        block_keys={6: K[1]},
    )
    slots = torch.arange(6 * BS, 7 * BS)
    for live in lives:
        # Its hit is in no block the step writes: its rows wait, then stamp block 6.
        assert live.apply(step, ["r"], recomputed, slots) == {}
        assert live.flush() == {6: K[1]}
        assert live.store.probe([5, 6], [K[0], K[1]]) == 2
        assert live.stats.num_hit_blocks == 1 and live.stats.num_stale_hit_blocks == 0
    assert torch.equal(
        leader.store.read_blocks(HIDDEN_STATES, [5, 6], [K[0], K[1]]),
        torch.cat([rows[:BS], recomputed]),
    )
    for live in lives:
        live.close()


@pytest.mark.parametrize("damage", ["deleted", "overwritten"])
def test_a_block_gone_or_damaged_after_the_lookup_ends_the_load_there(
    config: TierConfig, redis_server: RedisServer, damage: str
) -> None:
    saved_blocks(config)
    index = reader(config)
    assert index.held([K[0], K[1]]) == 2
    # Between the scheduler's lookup and the worker's load, block K[1] loses a value.
    name = f"test:{config.namespace}:{K[1].hex()}:kv.tp0of1.{LAYERS[0]}"
    client = redis_server.client()
    if damage == "deleted":
        assert client.delete(name) == 1
        assert index.held([K[0], K[1]]) == 1
    else:
        assert client.set(name, b"not a value") is True
        assert index.held([K[0], K[1]]) == 2  # it exists: only the load can tell
    index.close()
    target_kv, target = caches(seed=None), store()
    tier = WorkerTier(config, target_kv, target)
    live = LiveStore(target, max_results=4, tier=tier)
    plan = StepPlan(caching=True, loads=(LoadOrder("r", (5, 6), (K[0], K[1])),))
    assert live.start_step(plan) == {6}
    assert target.probe([5, 6], [K[0], K[1]]) == 1
    assert all(not cache[6].any() for cache in target_kv.values())
    assert (tier.stats.num_loaded_blocks, tier.stats.num_failed_loads) == (1, 1)
    assert tier.tier.stats.num_rejected_values == (damage == "overwritten")
    live.close()


def test_a_load_that_does_not_decode_loads_nothing(config: TierConfig) -> None:
    saved_blocks(config)
    # A worker whose KV has other heads than the values: nothing of the order is loaded.
    target_kv, target = caches(seed=None, heads=HEADS + 1), store()
    tier = WorkerTier(config, target_kv, target)
    assert tier.load(target, LoadOrder("r", (5, 6), (K[0], K[1]))) == 0
    assert target.probe([5], [K[0]]) == 0
    assert not any(cache.any() for cache in target_kv.values())
    assert tier.stats.num_failed_loads == 1
    tier.close()


def test_a_lookup_of_a_tier_that_is_down_is_a_miss_without_raising() -> None:
    index = TierReader(TierConfig("redis://127.0.0.1:1/0", "down", "test"), ["hidden_states"])
    assert index.held([K[0], K[1]]) == 0
    stats = index.tier.stats
    assert (stats.num_held_calls, stats.num_read_errors, stats.num_faults) == (1, 1, 1)
    # Backing off: the next lookup does not ask.
    assert index.held([K[0]]) == 0
    assert index.tier.stats.num_skipped_calls == 1
    index.close()


def test_a_plan_carries_at_most_a_few_dozen_bytes_a_loaded_block() -> None:
    import pickle

    from omnicache.integrations.vllm.connector import OmniStepMetadata

    def size(num_blocks: int) -> int:
        keys = tuple(BlockHash(i.to_bytes(32, "big")) for i in range(num_blocks))
        order = LoadOrder("request-0", tuple(range(1000, 1000 + num_blocks)), keys)
        # NOTE: vLLM pickles the SchedulerOutput to its worker processes.
        return len(pickle.dumps(OmniStepMetadata(StepPlan(caching=True, loads=(order,)))))

    per_block = (size(257) - size(1)) / 256
    # A 32-byte key and a block id: the values stay in Redis until the worker reads them.
    assert 32 < per_block <= 64


def test_a_tier_without_the_recompute_policy_is_refused_at_start() -> None:
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from omnicache.integrations.vllm.connector import OmniStoreConnector

    def config(**transfer: object) -> SimpleNamespace:
        return SimpleNamespace(
            kv_transfer_config=KVTransferConfig(
                kv_connector="OmniStoreConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"tier_url": "redis://h:1/0", "tier_namespace": "n"},
                **transfer,
            ),
            cache_config=SimpleNamespace(enable_prefix_caching=True),
            speculative_config=None,
            parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1),
        )

    with pytest.raises(
        ValueError,
        match=r"expected kv_load_failure_policy='recompute' with a tier \(tier_url\).*found 'fail'",
    ):
        OmniStoreConnector(config(), KVConnectorRole.SCHEDULER, None)
    connector = OmniStoreConnector(
        config(kv_load_failure_policy="recompute"), KVConnectorRole.SCHEDULER, None
    )
    assert connector.tier == TierConfig("redis://h:1/0", "n", "omnicache")


def test_pipeline_and_context_parallelism_are_refused_at_start() -> None:
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from omnicache.integrations.vllm.connector import OmniStoreConnector

    def config(**parallel: int) -> SimpleNamespace:
        sizes = {
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 1,
            "prefill_context_parallel_size": 1,
            "decode_context_parallel_size": 1,
            **parallel,
        }
        return SimpleNamespace(
            kv_transfer_config=KVTransferConfig(
                kv_connector="OmniStoreConnector", kv_role="kv_both"
            ),
            cache_config=SimpleNamespace(enable_prefix_caching=True),
            speculative_config=None,
            parallel_config=SimpleNamespace(**sizes),
        )

    slots = "each rank holds some of a request's tokens, in slots the store's plan does not name"
    for field, why in (
        ("pipeline_parallel_size", "only the last stage has the model's final hidden states"),
        ("prefill_context_parallel_size", slots),
        ("decode_context_parallel_size", slots),
    ):
        layout = config(**{field: 2})
        with pytest.raises(ValueError) as refused:
            OmniStoreConnector(layout, KVConnectorRole.SCHEDULER, None)
        assert str(refused.value) == (f"OmniStoreConnector: expected {field} 1 ({why}), found 2")
    assert OmniStoreConnector(config(), KVConnectorRole.SCHEDULER, None).tier is None


def test_kv_caches_of_another_physical_layout_load_through_the_view(config: TierConfig) -> None:
    _, kv, _ = saved_blocks(config)  # saved from contiguous caches
    # vLLM's view (blocks, heads, tokens, content) over memory laid out (tokens, blocks, heads,
    # content), as a backend with the block dimension inside may allocate it.
    target_kv = {name: torch.zeros(BS, 8, HEADS, HEAD2).permute(1, 2, 0, 3) for name in LAYERS}
    assert not target_kv[LAYERS[0]].is_contiguous()
    target = store()
    tier = WorkerTier(config, target_kv, target)
    assert tier.load(target, LoadOrder("r", (5, 6), (K[0], K[1]))) == 2
    assert_same_kv(target_kv, kv, {5: 1, 6: 2})
    # And back: saved through the strided view, loaded into contiguous caches.
    tier.save(target, {5: K[0], 6: K[1]})
    assert tier.flush(10.0)
    tier.close()
    again_kv, again = caches(seed=None), store()
    again_tier = WorkerTier(config, again_kv, again)
    assert again_tier.load(again, LoadOrder("r", (3, 4), (K[0], K[1]))) == 2
    assert_same_kv(again_kv, kv, {3: 1, 4: 2})
    again_tier.close()


def test_a_block_cleared_after_its_staged_rows_are_written_is_not_saved(
    config: TierConfig,
) -> None:
    # Block 1's rows wait (staged) when vLLM hands it out again: the step's
    # clear writes them first, then clears the block, which the tier never
    # gets (its rows are no longer the key's).
    st = store()
    live = LiveStore(st, max_results=8, tier=WorkerTier(config, caches(seed=3), st))
    prefill = StepPlan(
        caching=True, requests=(PlannedRequest("a", 0, BS, (1,)),), block_keys={1: K[0]}
    )
    values = torch.arange(BS * HIDDEN, dtype=torch.float32).reshape(BS, HIDDEN)
    assert live.apply(prefill, ["a"], values, torch.arange(BS, 2 * BS)) == {}
    clears = StepPlan(
        caching=True,
        requests=(PlannedRequest("b", 0, 1, (1,)),),
        cleared_block_ids=(1,),
        finished_req_ids=("a",),
    )
    assert live.apply(clears, ["b"], values[:1].clone(), torch.tensor([BS])) == {}
    assert live.stats.num_rows_written == BS and live.store.stamp_of(HIDDEN_STATES, 1) is None
    assert live.flush() == {}
    assert live.tier is not None and live.tier.flush(10.0)
    assert live.tier.stats.num_saved_blocks == 0
    live.close()
