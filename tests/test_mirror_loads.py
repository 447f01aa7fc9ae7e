"""StoreMirror and tier loads, driven as vLLM's scheduler drives them (vLLM's manager, no engine).

A request whose first blocks the tier holds (vLLM's external tokens, loaded
asynchronously) has them stamped in the mirror when vLLM allocates them; the
step's plan orders their load while vLLM holds the request back, and the
step that first schedules it extends its hit with them. A load the worker
reports failed clears its blocks here and, through the next plan, in the
worker; the request's hit stops before the first failed block and it never
asks the tier again. A request that ends while its load runs keeps its
blocks until the worker is done; one that ends before it ran gives up the
stamps of what it loaded. The lookup asks Redis (a real server) once per
waiting request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import test_vllm_integration as integration

from omnicache.integrations.vllm import OmniKVCacheManager

if TYPE_CHECKING:
    from redis_server import RedisServer

    from omnicache.integrations.vllm.kv_tier import TierReader

pytestmark = integration.needs_vllm

BS = integration.BLOCK_SIZE
PROMPT = list(range(1, 3 * BS + 5))  # 3 full blocks, then 4 tokens


def holds(num_blocks: int) -> TierReader:
    """A reader whose tier holds the first ``num_blocks`` of any chain (the last test: Redis)."""
    from omnicache.integrations.vllm.kv_tier import TierConfig, TierReader

    class Holds(TierReader):
        def held(self, keys: Any) -> int:
            return min(num_blocks, len(keys))

    # NOTE: a plain server is first asked at the first read or write: never here.
    return Holds(TierConfig("redis://127.0.0.1:1/0", "none", "test"), ["hidden_states"])


class Scheduler:
    """The manager wrapped and mirrored, as `OmniScheduler` sets them up."""

    def __init__(self, reader: TierReader | None = None) -> None:

        manager = integration.kv_cache_manager(16)
        self.wrapper = OmniKVCacheManager(manager)
        self.mirror = self.wrapper.attach_mirror(reader)
        self.hasher = integration.RequestBlockHasher(BS, namespace=integration.NAMESPACE)

    def request(self, request_id: str) -> Any:
        return integration.make_request(request_id, PROMPT, self.hasher)

    def admit_async(self, request: Any, num_external: int) -> tuple[int, ...]:
        """Lookup, then vLLM's allocation of a load (no new tokens), then its order."""
        blocks, num_hit, _ = self.wrapper.get_computed_blocks(request)
        assert self.mirror.num_external_tokens(request, num_hit) >= num_external
        allocated = self.wrapper.allocate_slots(
            request,
            0,
            num_hit,
            blocks,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=True,
        )
        assert allocated is not None
        ids = self.wrapper.request_block_ids(request.request_id)
        self.mirror.on_external_allocated(request, ids, num_external)
        request.num_computed_tokens = num_hit + num_external
        request.hit = num_hit
        return tuple(ids[num_hit // BS : (num_hit + num_external) // BS])

    def schedule(self, request: Any) -> None:
        """The step after the load: vLLM allocates the rest and schedules it."""
        num_new = request.num_tokens - request.num_computed_tokens
        assert self.wrapper.allocate_slots(request, num_new) is not None

    def stamped(self, ids: tuple[int, ...], request: Any) -> int:
        return self.mirror.table.num_valid(list(ids), request.block_hashes[: len(ids)])


def test_a_load_is_ordered_while_vllm_holds_the_request_and_joins_its_hit_later() -> None:
    s = Scheduler(holds(3))
    first = s.request("a")
    ids = s.admit_async(first, 3 * BS)
    assert s.stamped(ids, first) == 3
    plan = s.mirror.plan([], {}, [])  # "a" waits: not scheduled, its load ordered
    (load,) = plan.loads
    assert (load.req_id, load.block_ids, load.block_keys) == (
        "a",
        ids,
        tuple(first.block_hashes[:3]),
    )
    assert plan.requests == () and plan.invalidated_block_ids == ()
    # Handed out in this step, the blocks are also in its cleared list: the
    # worker clears before it loads (LiveStore.begin), so the load's stamps stay.
    assert set(ids) <= set(plan.cleared_block_ids)
    s.mirror.on_loads_done(["a"], [])
    s.schedule(first)
    plan = s.mirror.plan([("a", 3 * BS, 4)], {}, [])
    (item,) = plan.requests
    assert (item.start, item.hit_block_ids, item.hit_block_keys) == (
        3 * BS,
        ids,
        tuple(first.block_hashes[:3]),
    )
    assert plan.loads == ()
    assert s.mirror.finished(first) == (False, {"omnicache_external_tokens": 3 * BS})
    assert s.stamped(ids, first) == 3  # it ran: vLLM cached them, and keeps them


def test_a_failed_load_clears_its_blocks_and_the_hit_stops_before_them() -> None:
    s = Scheduler(holds(3))
    request = s.request("c")
    ids = s.admit_async(request, 3 * BS)
    s.mirror.plan([], {}, [])
    # The worker loaded the first block only: vLLM truncates at the second.
    s.mirror.on_loads_done(["c"], ids[1:])
    assert s.stamped(ids, request) == 1
    assert s.mirror.plan([], {}, []).cleared_block_ids == ids[1:]
    request.num_computed_tokens = BS
    s.schedule(request)
    (item,) = s.mirror.plan([("c", BS, request.num_tokens - BS)], {}, []).requests
    assert (item.hit_block_ids, item.hit_block_keys) == (ids[:1], (request.block_hashes[0],))
    # No further lookup for it; it reports what it loaded.
    assert s.mirror.num_external_tokens(request, 0) == 0
    assert s.mirror.finished(request) == (False, {"omnicache_external_tokens": BS})


@pytest.mark.parametrize("loading", [True, False])
def test_a_request_that_ends_before_it_ran_gives_up_its_loaded_stamps(loading: bool) -> None:
    s = Scheduler(holds(2))
    request = s.request("d")
    ids = s.admit_async(request, 2 * BS)
    s.mirror.plan([], {}, [])
    if not loading:
        s.mirror.on_loads_done(["d"], [])
    # Aborted before its first step; while its load runs, vLLM must keep its blocks.
    assert s.mirror.finished(request) == (loading, {"omnicache_external_tokens": 2 * BS})
    assert s.stamped(ids, request) == 0
    assert set(ids) <= set(s.mirror.plan([], {}, []).cleared_block_ids)


def test_external_tokens_in_whole_blocks_the_lookup_found_or_an_error() -> None:
    s = Scheduler(holds(1))
    request = s.request("e")
    with pytest.raises(RuntimeError, match=r"request e: expected external blocks the tier "):
        s.mirror.on_external_allocated(request, [1, 2], BS)
    with pytest.raises(RuntimeError, match=r"expected external tokens in whole blocks of the"):
        s.mirror.on_external_allocated(request, [1, 2], BS + 1)
    assert s.mirror.num_external_tokens(request, 0) == BS
    with pytest.raises(RuntimeError, match=r"its lookup: \(0, 1\)\), found 2"):
        s.mirror.on_external_allocated(request, [1, 2], 2 * BS)
    with pytest.raises(ValueError, match=r"expected 2 \(one per block\), found 1"):
        s.mirror.on_loaded("e", (1, 2), request.block_hashes[:1])
    assert s.mirror.plan([], {}, []).loads == ()  # nothing recorded


def test_the_lookup_asks_redis_once_per_waiting_request(redis_server: RedisServer) -> None:
    import torch

    from omnicache.integrations.vllm.kv_tier import TierConfig, TierReader, WorkerTier
    from omnicache.store import HIDDEN_STATES, TensorStore

    namespace = "mirror-loads"
    client = redis_server.client()
    stale = list(client.scan_iter(f"test:{namespace}:*"))
    if stale:
        client.delete(*stale)
    config = TierConfig(redis_server.url, namespace, "test")
    s = Scheduler()
    request = s.request("r")
    # A worker saves the request's first two blocks.
    store = TensorStore(8, BS, hidden_size=3, hidden_dtype=torch.float32)
    store.write_blocks(
        HIDDEN_STATES, torch.ones(2 * BS, 3), [1, 2], block_keys=request.block_hashes[:2]
    )
    worker = WorkerTier(config, {"l": torch.zeros(8, 1, BS, 2)}, store)
    worker.save(store, {1: request.block_hashes[0], 2: request.block_hashes[1]})
    assert worker.flush(10.0)
    worker.close()
    reader = TierReader(config, [HIDDEN_STATES, "kv.tp0of1.l"])
    s = Scheduler(reader)
    request = s.request("r")
    assert s.mirror.num_external_tokens(request, 0) == 2 * BS
    # vLLM could not admit it this step: asked again, answered from the lookup,
    # also after a local hit of the first block appeared.
    assert s.mirror.num_external_tokens(request, 0) == 2 * BS
    assert s.mirror.num_external_tokens(request, BS) == BS
    assert reader.tier.stats.num_held_calls == 1
    assert s.mirror.finished(request) == (False, {"omnicache_external_tokens": 0})
    # A new request asks again.
    assert s.mirror.num_external_tokens(s.request("q"), 0) == 2 * BS
    assert reader.tier.stats.num_held_calls == 2
    reader.close()
