"""StoreMirror and tier loads, driven as vLLM's scheduler drives them (vLLM's manager, no engine).

A request whose first blocks come from the tier (vLLM's external tokens) has
them stamped in the mirror when vLLM allocates them; the step's plan orders
their load and extends the request's hit with them; a request that another
one schedules after it hits them locally; a load that is not scheduled is
undone, and a failed one clears its stamps in the mirror and, through the
next plan, in the worker.
"""

from __future__ import annotations

from typing import Any

import pytest
import test_vllm_integration as integration

from omnicache.integrations.vllm import OmniKVCacheManager

pytestmark = integration.needs_vllm

BS = integration.BLOCK_SIZE
PROMPT = list(range(1, 3 * BS + 5))  # 3 full blocks, then 4 tokens


class Scheduler:
    """The manager wrapped and mirrored, as `OmniScheduler` sets them up."""

    def __init__(self) -> None:
        from omnicache.integrations.vllm.manager import StoreMirror

        manager = integration.kv_cache_manager(16)
        self.wrapper = OmniKVCacheManager(manager)
        self.mirror = StoreMirror(self.wrapper)
        self.hasher = integration.RequestBlockHasher(BS, namespace=integration.NAMESPACE)

    def admit(self, request_id: str, num_external: int) -> Any:
        """Lookup, then allocation with ``num_external`` tokens from the tier."""
        request = integration.make_request(request_id, PROMPT, self.hasher)
        blocks, num_hit, _ = self.wrapper.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit - num_external
        allocated = self.wrapper.allocate_slots(
            request, num_new, num_hit, blocks, num_external_computed_tokens=num_external
        )
        assert allocated is not None
        request.hit = num_hit
        return request

    def load(self, request: Any, num_blocks: int) -> tuple[int, ...]:
        ids = tuple(self.wrapper.request_block_ids(request.request_id)[:num_blocks])
        keys = request.block_hashes[:num_blocks]
        values = [(b"h%d" % i, b"k%d" % i) for i in range(num_blocks)]
        self.mirror.on_loaded(request.request_id, ids, keys, values)
        return ids

    def stamped(self, ids: tuple[int, ...], request: Any) -> int:
        return self.mirror.table.num_valid(list(ids), request.block_hashes[: len(ids)])


def test_loaded_blocks_are_stamped_at_allocation_ordered_and_part_of_the_hit() -> None:
    s = Scheduler()
    first = s.admit("a", 3 * BS)
    ids = s.load(first, 3)
    assert s.stamped(ids, first) == 3
    # Scheduled after it in the same step, a twin hits the loading blocks locally.
    twin = s.admit("b", 0)
    assert twin.hit == 3 * BS
    plan = s.mirror.plan([("a", 3 * BS, 4), ("b", 3 * BS, 4)], {}, [])
    (load,) = plan.loads
    assert (load.req_id, load.block_ids, load.block_keys) == (
        "a",
        ids,
        tuple(first.block_hashes[:3]),
    )
    assert load.values == ((b"h0", b"k0"), (b"h1", b"k1"), (b"h2", b"k2"))
    by_id = {item.req_id: item for item in plan.requests}
    assert by_id["a"].hit_block_ids == ids  # no local hit, then the loaded blocks
    assert by_id["b"].hit_block_ids == ids
    assert plan.invalidated_block_ids == ()
    # Handed out in this step, the blocks are also in the step's cleared list:
    # the worker clears before it loads (LiveStore.begin), so the load's stamps stay.
    assert set(ids) <= set(plan.cleared_block_ids)


def test_a_load_not_scheduled_is_undone_and_a_failed_one_cleared() -> None:
    s = Scheduler()
    first = s.admit("a", 3 * BS)
    ids = s.load(first, 3)
    plan = s.mirror.plan([], {}, [])  # vLLM took "a" back before the step
    assert plan.loads == ()
    assert set(ids) <= set(plan.invalidated_block_ids)
    assert s.stamped(ids, first) == 0
    # Loaded, then reported failed by the worker: cleared here and, next step, there.
    s.wrapper.free(first)
    second = s.admit("c", 3 * BS)
    ids = s.load(second, 3)
    s.mirror.plan([("c", 3 * BS, 4)], {}, [])
    s.mirror.on_load_errors(ids)
    assert s.stamped(ids, second) == 0
    assert s.mirror.plan([], {}, []).cleared_block_ids == ids


def test_on_loaded_names_mismatched_lengths() -> None:
    s = Scheduler()
    request = s.admit("a", 3 * BS)
    with pytest.raises(ValueError, match=r"expected 2 of each \(one per block\), found 2 and 1"):
        s.mirror.on_loaded("a", (1, 2), request.block_hashes[:2], [(b"",)])
    # Nothing recorded: the step orders no load.
    assert s.mirror.plan([("a", 3 * BS, 4)], {}, []).loads == ()
