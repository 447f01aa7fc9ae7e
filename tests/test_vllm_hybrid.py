"""OmniKVCacheManager over vLLM's real hybrid KV cache managers (0.32 and 0.33, scheduler side).

One configuration per kind of model vLLM prefix-caches: full attention only;
full attention beside sliding-window, chunked local attention or Mamba
layers, or beside a circular buffer (never cached) and a sliding window; a
full-attention group coarser than the hash blocks; and hash blocks finer than
the KV blocks with an aligned Mamba group, where vLLM hits partial blocks and
copies the shared tail on write. For each:

- the wrapper's hits and block tables equal those of vLLM's own manager
  driven with the same requests (where vLLM hits a partial block, the
  wrapper's hit is the one vLLM's lookup finds at the whole-block length);
- different images and different salts never share blocks past their
  common text;
- a tail block vLLM copies on write is never stamped, the mirror's plans
  stamp a worker's store as the mirror, and what the store cannot follow is
  refused, as is every kind of group vLLM itself does not prefix-cache (the
  error says why).

The randomized run per configuration is in ``test_vllm_hybrid_sim.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from test_vllm_integration import (
    BLUE_HEX,
    HIDDEN,
    IMAGE_TOKEN,
    NAMESPACE,
    RED_HEX,
    VLLM_MISSING,
    image_feature,
    recompute,
)
from vllm_harness import EngineHarness
from vllm_managers import new_hybrid_kv_cache_manager

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm import OmniKVCacheManager, RequestBlockHasher, make_request

pytestmark = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")

if VLLM_MISSING is None:
    import vllm
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
        MambaSpec,
        RSWASpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import RequestStatus

HASH_BLOCK = 16
NULL = 0  # vLLM's null block: stands in every table for blocks a group skips


class Config(NamedTuple):
    name: str
    # (kind, block size, window or chunk) per group, in group order.
    groups: tuple[tuple[str, int, int], ...]
    num_blocks: int

    def specs(self) -> list[Any]:
        common = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
        specs: list[Any] = []
        for kind, block_size, extent in self.groups:
            if kind == "full":
                specs.append(FullAttentionSpec(block_size=block_size, **common))
            elif kind == "sliding":
                specs.append(
                    SlidingWindowSpec(block_size=block_size, sliding_window=extent, **common)
                )
            elif kind == "chunked":
                specs.append(
                    ChunkedLocalAttentionSpec(
                        block_size=block_size, attention_chunk_size=extent, **common
                    )
                )
            elif kind == "ring":
                specs.append(CircularBufferSpec(block_size=block_size, **common))
            else:
                assert kind == "mamba"
                specs.append(
                    MambaSpec(
                        block_size=block_size,
                        shapes=((2, 2),),
                        dtypes=(torch.float32,),
                        mamba_cache_mode="align",
                    )
                )
        return specs

    @property
    def store_block_size(self) -> int:
        return self.groups[0][1]


CONFIGS = [
    Config("full", (("full", 16, 0),), 40),
    Config("full+sliding", (("full", 16, 0), ("sliding", 16, 32)), 48),
    Config("full+chunked", (("full", 16, 0), ("chunked", 16, 32)), 48),
    Config("full+mamba", (("full", 16, 0), ("mamba", 16, 0)), 48),
    Config("full32+sliding16", (("full", 32, 0), ("sliding", 16, 32)), 48),
    # A circular buffer: one scratch block per request, left out of vLLM's lookups.
    Config("full+ring+sliding", (("full", 16, 0), ("ring", 16, 0), ("sliding", 16, 32)), 48),
    Config("finer-hashes", (("full", 64, 0), ("mamba", 64, 0)), 32),
]
CONFIG_IDS = [config.name for config in CONFIGS]


def new_manager(config: Config) -> Any:
    return new_hybrid_kv_cache_manager(
        config.num_blocks, config.specs(), max_model_len=2048, hash_block_size=HASH_BLOCK
    )


def new_harness(config: Config) -> EngineHarness:
    """vLLM's manager of ``config`` under omnicache, and a worker's store."""
    return EngineHarness(new_manager(config), lambda r: recompute(r)["hidden_states"], HIDDEN)


def hasher() -> RequestBlockHasher:
    return RequestBlockHasher(HASH_BLOCK, namespace=NAMESPACE)


def group_keys(request: Any, block_size: int) -> list[BlockHash]:
    scale = block_size // HASH_BLOCK
    return list(request.block_hashes[scale - 1 :: scale])


# -- hits equal vLLM's own ---------------------------------------------------------------

TEXT = list(range(1, 65))  # 64 tokens of text
IMAGE = 64
SUFFIX = list(range(300, 324))  # 24 tokens: the prompt ends inside a 64-token block


def image_prompt(extra: int = 0) -> list[int]:
    return TEXT + [IMAGE_TOKEN] * IMAGE + SUFFIX + list(range(400, 400 + extra))


# (request id, image, salt, extra tokens after the prompt)
SCENARIO = [
    ("red", RED_HEX, None, 0),
    ("red-again", RED_HEX, None, 0),
    ("blue", BLUE_HEX, None, 0),
    ("red-salted", RED_HEX, "tenant-b", 0),
    ("red-longer", RED_HEX, None, 40),
    ("red-longer-again", RED_HEX, None, 40),
    ("blue-again", BLUE_HEX, None, 0),
]


def scenario_request(rid: str, image: str, salt: str | None, extra: int) -> Any:
    return make_request(
        rid,
        image_prompt(extra),
        hasher(),
        mm_features=[image_feature(image, len(TEXT), IMAGE)],
        cache_salt=salt,
    )


def vllm_whole_block_hit(manager: Any, request: Any, block_size: int) -> tuple[Any, int, int]:
    """vLLM's own hit; one ending inside a store block is vLLM's hit at the whole-block length.

    Returns the blocks, the hit and vLLM's first (possibly partial) hit.
    """
    blocks, num_hit, _ = manager.get_computed_blocks(request)
    first = num_hit
    if num_hit % block_size:
        length = num_hit - num_hit % block_size
        if vllm.__version__.startswith("0.33."):
            blocks, num_hit, _ = manager.get_computed_blocks(request, max_cache_hit_length=length)
        else:  # 0.32's manager takes no length: its coordinator does
            found, num_hit, _ = manager.coordinator.find_longest_cache_hit(
                request.block_hashes, length
            )
            blocks = manager.create_kv_cache_blocks(found)
    return blocks, num_hit, first


def prefill_chunks(request: Any, start: int) -> list[int]:
    """Chunk ends from ``start`` to the prompt's end, as vLLM's scheduler splits for Mamba.

    With an aligned Mamba group, vLLM keeps a reusable state only where a
    chunk ends: its scheduler ends prefill chunks at block boundaries and at
    the prompt's last hash boundary (the checkpoint a resend resumes at).
    Every configuration is driven so, for one request sequence throughout.
    """
    num_tokens = request.num_tokens
    checkpoint = (num_tokens - 1) // HASH_BLOCK * HASH_BLOCK
    ends = {num_tokens, checkpoint, *range(64, num_tokens, 64)}
    return sorted(end for end in ends if end > start)


def allocated_chunks(
    manager: Any, request: Any, num_hit: int, blocks: Any
) -> Iterator[tuple[int, int]]:
    """Allocates the prompt chunk by chunk as vLLM's scheduler does, the hit with the first chunk.

    Yields each chunk's ``(start, end)`` once its slots are allocated; the
    request's computed tokens move to ``end`` when the caller asks for the next.
    """
    start = num_hit
    for end in prefill_chunks(request, num_hit):
        if start == num_hit:
            assert manager.allocate_slots(request, end - start, num_hit, blocks)
            request.num_computed_tokens = num_hit
        else:
            manager.new_step_starts()
            assert manager.allocate_slots(request, end - start)
        yield start, end
        request.num_computed_tokens = start = end


def run_scenario_plain(config: Config) -> list[tuple[str, int, int, tuple[list[int], ...]]]:
    manager = new_manager(config)
    results = []
    for rid, image, salt, extra in SCENARIO:
        request = scenario_request(rid, image, salt, extra)
        manager.new_step_starts()
        blocks, num_hit, first = vllm_whole_block_hit(manager, request, config.store_block_size)
        for _ in allocated_chunks(manager, request, num_hit, blocks):
            pass
        results.append((rid, first, num_hit, manager.get_block_ids(rid)))
        request.status = RequestStatus.FINISHED_STOPPED
        manager.free(request)
    return results


def admit_and_compute(h: EngineHarness, request: Any) -> int:
    """Lookup, then chunk by chunk: allocation and a step each; the prompt rows come back exact."""
    h.wrapper.new_step_starts()
    blocks, num_hit, _ = h.wrapper.get_computed_blocks(request)
    for start, end in allocated_chunks(h.wrapper, request, num_hit, blocks):
        h.step([(request, end - start)])
    rows = h.take(request.request_id)
    assert rows is not None
    assert torch.equal(rows, recompute(request)["hidden_states"])
    return int(num_hit)


def run_scenario_wrapped(config: Config) -> list[tuple[str, int, tuple[list[int], ...]]]:
    h = new_harness(config)
    results = []
    for rid, image, salt, extra in SCENARIO:
        request = scenario_request(rid, image, salt, extra)
        num_hit = admit_and_compute(h, request)
        results.append((rid, num_hit, h.wrapper.get_block_ids(rid)))
        h.finish(request)
    assert h.wrapper.stats.num_capped_blocks == 0
    assert h.live.stats.num_stale_hit_blocks == 0
    return results


# Per configuration: vLLM's first hit of each scenario request (before a
# partial block is dropped), then the hit the wrapper adopts.
EXPECTED_HITS = {
    "full": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
    "full+sliding": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
    "full+chunked": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
    "full+mamba": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
    # Hits land on the scheduler's 32-token blocks.
    "full32+sliding16": ([0, 128, 64, 0, 128, 160, 128], [0, 128, 64, 0, 128, 160, 128]),
    # vLLM hits into the 64-token block that holds the prompt's end; the
    # store serves whole blocks ("red-longer-again" resumes at 176, inside
    # the third block, so it gets two).
    "finer-hashes": ([0, 144, 64, 0, 144, 176, 144], [0, 128, 64, 0, 128, 128, 128]),
    "full+ring+sliding": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
}


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_hits_and_block_tables_equal_vllms_own(config: Config) -> None:
    plain = run_scenario_plain(config)
    wrapped = run_scenario_wrapped(config)
    assert [(rid, hit, ids) for rid, _, hit, ids in plain] == wrapped
    first_hits, hits = EXPECTED_HITS[config.name]
    assert [first for _, first, _, _ in plain] == first_hits
    assert [hit for _, hit, _ in wrapped] == hits


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_other_images_and_salts_share_no_block_past_the_text(config: Config) -> None:
    h = new_harness(config._replace(num_blocks=96))
    tables: dict[str, tuple[list[int], ...]] = {}
    for rid, image, salt, extra in SCENARIO[:4]:
        request = scenario_request(rid, image, salt, extra)
        admit_and_compute(h, request)
        tables[rid] = h.wrapper.get_block_ids(rid)
    # All four are held at once: a block in two tables is shared by both.
    size = config.store_block_size
    red, red_again, blue, salted = (tables[rid] for rid, _, _, _ in SCENARIO[:4])
    hits = EXPECTED_HITS[config.name][1]
    for group_id in range(len(config.groups)):
        # Blocks of every group the hit reuses, from the first new block on: none shared.
        assert (set(salted[group_id]) - {NULL}).isdisjoint(red[group_id] + blue[group_id])
    text = len(TEXT) // size
    assert blue[0][:text] == red[0][:text] and set(blue[0][text:]).isdisjoint(red[0])
    assert red_again[0][: hits[1] // size] == red[0][: hits[1] // size]
    assert set(red_again[0][hits[1] // size :]).isdisjoint(red[0])


# -- a partial hit's tail copied on write; refusals --------------------------------------


def holds_key(manager: Any, block: Any, key: BlockHash, group_id: int) -> bool:
    """Whether vLLM's table maps ``key`` in group ``group_id`` to ``block``."""
    pool = manager.block_pool
    return bool(
        pool.cached_block_hash_to_block.contain(
            make_block_hash_with_group_id(key, group_id), block.block_id
        )
    )


def test_a_copied_tail_block_is_never_stamped_and_never_serves_a_hit() -> None:
    config = CONFIGS[-1]  # full attention in 64-token blocks, hashes of 16, aligned Mamba
    assert config.name == "finer-hashes"
    h = new_harness(config)
    red = scenario_request("red", RED_HEX, None, 0)
    admit_and_compute(h, red)
    red_table = h.wrapper.request_block_ids("red")
    h.finish(red)
    again = scenario_request("red-again", RED_HEX, None, 40)
    keys = group_keys(again, 64)
    h.wrapper.new_step_starts()
    # vLLM's own lookup, past the wrapper's cap: it hits a partial block.
    blocks, num_hit, _ = h.wrapper.manager.get_computed_blocks(again)
    assert num_hit == 144  # two whole blocks and 16 tokens of red's third (its prompt's end)
    # As vLLM's scheduler splits it for Mamba: up to the prompt's checkpoint, then the rest.
    assert prefill_chunks(again, 144) == [176, 192]
    assert h.wrapper.allocate_slots(again, 32, num_hit, blocks)
    again.num_computed_tokens = num_hit
    table = h.wrapper.request_block_ids("red-again")
    copies, retained = h.wrapper.take_kv_cache_block_copies()
    # vLLM copies red's shared tail block into a block of the request's own.
    assert table[:2] == red_table[:2] and table[2] not in red_table
    assert (red_table[2], table[2]) in {(c.src_block_id, c.dst_block_id) for c in copies}
    h.wrapper.manager.block_pool.free_blocks(retained)
    # The hit the wrapper records is whole blocks; the copy starts without rows.
    assert h.wrapper.hit_blocks("red-again") == (tuple(red_table[:2]), tuple(keys[:2]))
    h.step([(again, 32)])
    h.wrapper.new_step_starts()
    assert h.wrapper.allocate_slots(again, 16)
    h.step([(again, 16)])
    # Tokens 128..143 live only in vLLM's KV copy: the worker has no rows for
    # them, so the prompt's result is the hit's rows, then a gap, and none is kept.
    assert h.live.stats.num_prompt_results == 1  # red's only
    # The copy is now full (192 tokens): vLLM keys it, neither the table nor the
    # worker stamps it (its rows began at offset 16), so a capped lookup would
    # not hit it.
    h.wrapper.cache_blocks(again, again.num_tokens)
    assert holds_key(h.wrapper.manager, h.wrapper.manager.block_pool.blocks[table[2]], keys[2], 0)
    assert h.mirror.table.stamps[table[2]] is None
    assert h.store.stamp_of("hidden_states", table[2]) is None
    assert h.store.probe(table, keys[:3]) == 2
    # Red's own tail block kept no stamp either: its rows never filled it.
    assert h.store.stamp_of("hidden_states", red_table[2]) is None


def test_configurations_the_store_cannot_follow_are_refused() -> None:
    common = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    sliding = SlidingWindowSpec(block_size=16, sliding_window=32, **common)
    chunked = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=32, **common)
    full = FullAttentionSpec(block_size=16, **common)
    for specs, found in (
        ([sliding], "['sliding window']"),
        ([sliding, chunked], "['sliding window', 'chunked local attention']"),
    ):
        manager = new_hybrid_kv_cache_manager(16, specs, max_model_len=512)
        with pytest.raises(ValueError) as info:
            OmniKVCacheManager(manager)
        assert str(info.value) == (
            "manager: expected a full-attention KV cache group (the only kind whose blocks "
            "hold every token of a prefix, which the store's rows follow), found groups " + found
        )
        # Refused before anything changed: vLLM's collector is its own.
        assert manager.block_pool.metrics_collector is None
    hybrid = new_hybrid_kv_cache_manager(16, [full, sliding], max_model_len=512)
    with pytest.raises(ValueError) as info:
        OmniKVCacheManager(hybrid, kv_cache_group_id=1)
    assert str(info.value) == (
        "kv_cache_group_id: expected a full-attention group [0], found group 1 (sliding window)"
    )
    coarse = new_hybrid_kv_cache_manager(
        16, [FullAttentionSpec(block_size=32, **common), sliding], max_model_len=512
    )
    wrapper = OmniKVCacheManager(coarse)
    assert (wrapper.manager, wrapper.group.block_size, wrapper.group.scale) == (coarse, 32, 2)


KINDS = "full attention, sliding window, chunked local attention, Mamba, circular buffer"
HISPARSE = (
    "vLLM does not prefix-cache HiSparse hot or resident groups (their spec is not "
    "prefix_cacheable); a HiSparse model's prefix cache is its source group's host pages"
)


def refused(manager: Any) -> str:
    with pytest.raises(ValueError) as info:
        OmniKVCacheManager(manager)
    # Refused before anything changed: vLLM's collector is its own.
    assert manager.block_pool.metrics_collector is None
    return str(info.value)


def test_kinds_of_group_vllm_does_not_prefix_cache_are_refused_with_the_reason() -> None:
    common = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    full = FullAttentionSpec(block_size=16, **common)

    def build(*groups: Any) -> Any:
        config = KVCacheConfig(
            num_blocks=16,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer.{i}"], spec, role=role)
                for i, (spec, role) in enumerate(groups)
            ],
        )
        return KVCacheManager(
            config,
            max_model_len=512,
            scheduler_block_size=16,
            hash_block_size=16,
            enable_caching=True,
        )

    default, source = KVCacheGroupRole.DEFAULT, KVCacheGroupRole.HISPARSE_SOURCE
    cases = [
        (
            [(full, default), (CrossAttentionSpec(block_size=16, **common), default)],
            "CrossAttentionManager for group 1 (CrossAttentionSpec): vLLM does not "
            "prefix-cache cross-attention: encoder-decoder models do not support prefix "
            "caching, and this manager's lookup raises",
        ),
        (
            [(full, default), (RSWASpec(block_size=16, rswa_window=32, **common), default)],
            "RSWAManager for group 1 (RSWASpec): vLLM does not prefix-cache reference sliding "
            "windows: the model that makes them (Unlimited-OCR) turns prefix caching off, its "
            "decode KV not being a function of its prefix",
        ),
        (
            [
                (full, source),
                (HiSparseHotSpec(block_size=16, page_size=64, blocks_per_request=2), default),
            ],
            "HiSparseSourceManager for group 0 (FullAttentionSpec): vLLM prefix-caches a "
            "HiSparse model in this group's host pages, a block pool of their own, which the "
            "store (indexed by the manager's pool) cannot follow",
        ),
        (
            [
                (full, default),
                (HiSparseHotSpec(block_size=16, page_size=64, blocks_per_request=2), default),
            ],
            "HiSparseHotManager for group 1 (HiSparseHotSpec): " + HISPARSE,
        ),
        (
            [(full, default), (HiSparseResidentSpec(block_size=16, page_size=64), default)],
            "HiSparseResidentManager for group 1 (HiSparseResidentSpec): " + HISPARSE,
        ),
    ]
    for groups, found in cases:
        message = refused(build(*groups))
        assert message == f"manager: expected KV cache groups of {KINDS}, found {found}"
    # Static sinks: vLLM's coordinator cannot build their manager at all ...
    sink = SinkFullAttentionSpec(block_size=16, sink_len=16, **common)
    with pytest.raises(TypeError) as info:
        build((full, default), (sink, default))
    assert str(info.value) == (
        "SinkFullAttentionManager.__init__() got an unexpected keyword argument "
        "'needs_kv_cache_zeroing'"
    )
    # ... so one built by hand, over a real manager's pool, is refused too.
    manager = build((full, default), (full, default))
    by_hand = SinkFullAttentionManager(
        sink,
        block_pool=manager.block_pool,
        enable_caching=True,
        kv_cache_group_id=1,
        scheduler_block_size=16,
    )
    coordinator = manager.coordinator
    coordinator.single_type_managers = (coordinator.single_type_managers[0], by_hand)
    assert refused(manager) == (
        f"manager: expected KV cache groups of {KINDS}, found SinkFullAttentionManager for "
        "group 1 (SinkFullAttentionSpec): vLLM does not prefix-cache static-sink attention: "
        "its KV cache coordinator cannot build this manager (its constructor takes no "
        "needs_kv_cache_zeroing)"
    )
    # Mamba outside "align": vLLM 0.33 refuses to build it with caching; 0.32 builds it.
    unaligned = MambaSpec(
        block_size=16, shapes=((2, 2),), dtypes=(torch.float32,), mamba_cache_mode="none"
    )
    if vllm.__version__.startswith("0.33."):
        with pytest.raises(AssertionError) as failed:
            build((full, default), (unaligned, default))
        assert str(failed.value) == "Mamba prefix caching requires mamba_cache_mode='align'"
    else:
        assert refused(build((full, default), (unaligned, default))) == (
            "manager: expected Mamba groups in mamba_cache_mode 'align' (the only mode vLLM "
            "prefix-caches), found 'none' for group 1 (MambaSpec)"
        )


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_the_mirror_and_a_workers_store_follow_the_store_group(config: Config) -> None:
    """In hybrid models too, the mirror's plans stamp the worker's store as its table says."""
    h = new_harness(config)
    hits = []
    for rid, image, salt, extra in SCENARIO:
        request = scenario_request(rid, image, salt, extra)
        hits.append(admit_and_compute(h, request))
        h.finish(request)
    h.step([])  # the worker hears of the last request's end
    # The table's stamps are the worker's, block for block.
    for block_id in range(1, config.num_blocks):
        assert h.mirror.table.stamps[block_id] == h.store.stamp_of("hidden_states", block_id)
    assert hits == EXPECTED_HITS[config.name][1]
    assert h.live.stats.num_stale_hit_blocks == 0


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_the_connectors_lookup_is_vllms_and_capped_alike(config: Config) -> None:
    h = new_harness(config)
    wrapper = h.wrapper
    plain = new_manager(config)
    red = scenario_request("red", RED_HEX, None, 0)
    admit_and_compute(h, red)
    h.finish(red)
    twin = scenario_request("red", RED_HEX, None, 0)
    plain.new_step_starts()
    blocks, _, _ = plain.get_computed_blocks(twin)
    for _ in allocated_chunks(plain, twin, 0, blocks):
        pass
    twin.status = RequestStatus.FINISHED_STOPPED
    plain.free(twin)
    for manager in (wrapper, plain):
        manager.new_step_starts()
    again = scenario_request("red-again", RED_HEX, None, 0)
    found = wrapper.get_computed_blocks_for_connector(again)
    vllm_found = plain.get_computed_blocks_for_connector(again)
    size = config.store_block_size
    if vllm_found[1] % size == 0:
        assert found[1:] == vllm_found[1:]
        assert found[0].get_block_ids() == vllm_found[0].get_block_ids()
    else:  # a partial hit: the reconciled lookup at the whole-block length, never diverged
        assert (found[1], found[3]) == (vllm_found[1] // size * size, False)
    assert found[1] == EXPECTED_HITS[config.name][1][1]
    # Rows never written: the connector's lookup is capped too, for every group.
    blank = new_harness(config)
    first = scenario_request("red", RED_HEX, None, 0)
    blank.wrapper.new_step_starts()
    blocks, _, _ = blank.wrapper.get_computed_blocks(first)
    assert blank.wrapper.allocate_slots(first, prefill_chunks(first, 0)[0], 0, blocks)
    blank.step([])  # vLLM took it back before its step: its allocation is undone
    blank.wrapper.new_step_starts()
    sibling = scenario_request("red-again", RED_HEX, None, 0)
    # vLLM has the first 64 tokens' keys (registered at allocation), the worker no rows.
    assert blank.wrapper.manager.get_computed_blocks_for_connector(sibling)[1] == 64
    assert blank.wrapper.get_computed_blocks_for_connector(sibling)[1:] == (0, 0, False)
