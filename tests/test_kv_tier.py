"""The live engine's Redis tier without an engine: configuration, save, fetch and load, on a
real server.

`WorkerTier` and `TierReader` move blocks between KV caches in CPU
attention's layout ``(num_blocks, heads, block_size, 2 * head)``, a store's
hidden rows and Redis; `LiveStore` keeps rows computed over a failed load
unstamped. The live engines' test is ``test_vllm_live_tier``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from test_vllm_integration import VLLM_MISSING

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.plan import LoadOrder, PlannedRequest, StepPlan
from omnicache.integrations.vllm.tier import (
    TierConfig,
    TierReader,
    WorkerTier,
    entry_specs,
    tier_config,
)
from omnicache.store import HIDDEN_STATES, TensorStore

# NOTE: the worker's module imports vLLM (it is the worker's room); its store needs no engine.
pytestmark = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")
if VLLM_MISSING is None:
    from omnicache.integrations.vllm.worker import LiveStore

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


def store() -> TensorStore:
    return TensorStore(8, BS, hidden_size=HIDDEN, hidden_dtype=torch.float32)


def reader(config: TierConfig) -> TierReader:
    kv = dict.fromkeys(LAYERS, (HEADS, HEAD2))
    return TierReader(config, entry_specs(HIDDEN, torch.float32, kv, torch.float32), BS)


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
    with pytest.raises(ValueError, match=r"kv_caches\['l'\]: expected CPU attention's layout"):
        WorkerTier(config, bad, store())


def test_saved_blocks_load_into_other_blocks_of_another_worker(config: TierConfig) -> None:
    _, kv, st = saved_blocks(config)
    fetched = reader(config).fetch([K[0], K[1], K[2]])
    assert len(fetched) == 2  # K[2] was never saved
    target_kv, target = caches(seed=None), store()
    tier = WorkerTier(config, target_kv, target)
    assert tier.load(target, LoadOrder("r", (5, 6), (K[0], K[1]), tuple(fetched)))
    for name in LAYERS:
        assert torch.equal(target_kv[name][5], kv[name][1])
        assert torch.equal(target_kv[name][6], kv[name][2])
        assert not target_kv[name][1].any()
    assert target.probe([5, 6], [K[0], K[1]]) == 2
    assert torch.equal(
        target.read_blocks(HIDDEN_STATES, [5, 6], [K[0], K[1]]),
        st.read_blocks(HIDDEN_STATES, [1, 2], [K[0], K[1]]),
    )
    assert (tier.stats.num_load_requests, tier.stats.num_loaded_blocks) == (1, 2)
    tier.close()


@pytest.mark.parametrize("damage", ["deleted", "overwritten"])
def test_a_block_missing_or_damaged_in_redis_ends_the_fetch_there(
    config: TierConfig, redis_server: RedisServer, damage: str
) -> None:
    saved_blocks(config)
    name = f"test:{config.namespace}:{K[1].hex()}:kv.{LAYERS[0]}"
    client = redis_server.client()
    if damage == "deleted":
        assert client.delete(name) == 1
    else:
        assert client.set(name, b"not a value") is True
    index = reader(config)
    assert len(index.fetch([K[0], K[1]])) == 1
    assert index.num_rejected_values == (damage == "overwritten")


def test_a_load_that_does_not_decode_loads_nothing(config: TierConfig) -> None:
    saved_blocks(config)
    fetched = reader(config).fetch([K[0], K[1]])
    # A worker whose KV has other heads than the values: nothing of the order is loaded.
    target_kv, target = caches(seed=None, heads=HEADS + 1), store()
    tier = WorkerTier(config, target_kv, target)
    assert not tier.load(target, LoadOrder("r", (5, 6), (K[0], K[1]), tuple(fetched)))
    assert target.probe([5], [K[0]]) == 0
    assert not any(cache.any() for cache in target_kv.values())
    assert tier.stats.num_failed_loads == 1
    tier.close()


def test_rows_over_a_failed_load_stamp_nothing_and_feed_no_prompt() -> None:
    live = LiveStore(store(), max_results=4)
    # "r" loaded blocks 1 and 2 (failed) and computes its tokens 8..9 in block 3.
    plan = StepPlan(
        caching=True,
        requests=(PlannedRequest("r", 8, 2, (3,), (1, 2), (K[0], K[1])),),
        prompt_requests={"r": 10},
        cleared_block_ids=(3,),
        loads=(LoadOrder("r", (1, 2), (K[0], K[1])),),
    )
    live.begin(plan)
    live.fail_loads(["r"])
    slots = torch.from_numpy(np.array([12, 13], dtype=np.int64))
    assert live.apply(plan, ["r"], torch.ones(2, HIDDEN), slots) == {}
    stats = live.stats
    assert (stats.num_failed_load_requests, stats.num_hit_requests, stats.num_prompt_results) == (
        1,
        0,
        0,
    )
    assert stats.num_cleared_blocks == 1  # begun once, not again by apply
    # vLLM recomputes "r" from its first loaded block: the whole prompt, rows stamped.
    again = StepPlan(
        caching=True,
        requests=(PlannedRequest("r", 0, 10, (1, 2, 3)),),
        block_keys={1: K[0], 2: K[1]},
    )
    rows = torch.arange(10 * HIDDEN, dtype=torch.float32).reshape(10, HIDDEN)
    slots = torch.from_numpy(np.array([4, 5, 6, 7, 8, 9, 10, 11, 12, 13], dtype=np.int64))
    assert live.apply(again, ["r"], rows, slots) == {1: K[0], 2: K[1]}
    assert torch.equal(live.take(["r"])["r"], rows)  # type: ignore[arg-type]
