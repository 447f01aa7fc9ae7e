"""Isolation: tenants, adapters and namespaces never share a chain, a block or a row.

Every tenant has its own `BlockHasher` (its salt, adapter and namespace enter
the root) and its own `PrefixCache`; all tenants share one `BlockPool` and one
`TensorStore`, as a serving process would. Identical prompts from two tenants
must never hit each other's blocks, and the store must never hand one tenant
the rows another tenant wrote. Each scenario also runs its control: the same
tenant twice does hit, so a pass is not an empty cache.

The threat model behind these tests is in SECURITY.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from omnicache.annotations import AnnotatedTokens
from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.preprocess import annotate_prompt
from omnicache.reference.block_pool import BlockPool, BlockStored
from omnicache.reference.prefix_cache import PrefixCache
from omnicache.store import ReadMiss, ScheduledRequest, StaleBlockError, TensorStore

BLOCK_SIZE = 4
HIDDEN = 3
IMAGE_TOKEN = 32_000
TEXT = [11, 12, 13, 14, 15, 16, 17]

# Pairs of tenant configurations that must be isolated from each other:
# (hasher options, identifier namespace) per tenant.
TenantConfig = tuple[dict[str, Any], str]
SEPARATIONS: dict[str, tuple[TenantConfig, TenantConfig]] = {
    "salt": (({"cache_salt": "tenant-a"}, "default"), ({"cache_salt": "tenant-b"}, "default")),
    "salt-vs-none": (({"cache_salt": "tenant-a"}, "default"), ({}, "default")),
    "empty-salt-vs-none": (({"cache_salt": ""}, "default"), ({}, "default")),
    "adapter": (({"adapter": "lora-1"}, "default"), ({"adapter": "lora-2"}, "default")),
    "adapter-vs-salt": (({"adapter": "x"}, "default"), ({"cache_salt": "x"}, "default")),
    "namespace": (({"namespace": "model-a"}, "default"), ({"namespace": "model-b"}, "default")),
}


@pytest.fixture(params=sorted(SEPARATIONS))
def separation(request: pytest.FixtureRequest) -> tuple[TenantConfig, TenantConfig]:
    return SEPARATIONS[request.param]


class TenantCache(NamedTuple):
    cache: PrefixCache
    identifier_namespace: str

    def prompt(self, extra: list[int] | None = None) -> AnnotatedTokens:
        """Text, an image given by a caller id, more text: 27 tokens, 6 full blocks."""
        tokens = TEXT + [IMAGE_TOKEN] * 10 + TEXT + [21, 22, 23] + (extra or [])
        return annotate_prompt(
            tokens,
            ["photo-1"],
            placeholder_token_id=IMAGE_TOKEN,
            identifier_namespace=self.identifier_namespace,
        )


def tenant(pool: BlockPool, config: TenantConfig) -> TenantCache:
    options, identifier_namespace = config
    return TenantCache(PrefixCache(pool, BlockHasher(BLOCK_SIZE, **options)), identifier_namespace)


def serve(t: TenantCache, request_id: str, prompt: AnnotatedTokens) -> tuple[tuple[int, ...], int]:
    admitted = t.cache.add_request(request_id, prompt)
    assert admitted is not None
    t.cache.mark_computed(request_id, len(prompt))
    t.cache.free(request_id)
    return admitted.block_ids, admitted.num_cached_tokens


def stored_keys(pool: BlockPool) -> list[BlockHash]:
    return [k for e in pool.take_events() if isinstance(e, BlockStored) for k in e.block_hashes]


# -- prefix cache over a shared pool ------------------------------------------------


def test_identical_prompts_of_two_tenants_never_hit_each_other(
    separation: tuple[TenantConfig, TenantConfig],
) -> None:
    pool = BlockPool(32, BLOCK_SIZE)
    a, b = (tenant(pool, config) for config in separation)
    prompt_a, prompt_b = a.prompt(), b.prompt()
    assert prompt_a.tolist() == prompt_b.tolist()

    blocks_a, hit = serve(a, "a-1", prompt_a)
    assert hit == 0
    keys_a = stored_keys(pool)
    assert len(keys_a) == 6
    blocks_b, hit = serve(b, "b-1", prompt_b)
    assert hit == 0
    keys_b = stored_keys(pool)
    assert len(keys_b) == 6
    assert not set(keys_a) & set(keys_b)
    # b reuses only a's partial last block, which holds no key.
    assert not set(blocks_a[:6]) & set(blocks_b)
    assert pool.num_cached_blocks == 12

    # Control: each tenant hits its own blocks, and only its own.
    again_a, hit_a = serve(a, "a-2", prompt_a)
    again_b, hit_b = serve(b, "b-2", prompt_b)
    assert (hit_a, hit_b) == (24, 24)
    assert again_a[:6] == blocks_a[:6]
    assert again_b[:6] == blocks_b[:6]
    assert [pool.get_block_hash(i) for i in again_a[:6]] == keys_a
    assert [pool.get_block_hash(i) for i in again_b[:6]] == keys_b


def test_a_tenant_that_evicts_another_never_inherits_its_hits(
    separation: tuple[TenantConfig, TenantConfig],
) -> None:
    # 7 blocks: one prompt (7 blocks with its partial block) fills the pool, so
    # tenant b's request reuses every block tenant a cached.
    pool = BlockPool(7, BLOCK_SIZE)
    a, b = (tenant(pool, config) for config in separation)
    blocks_a, _ = serve(a, "a-1", a.prompt())
    keys_a = stored_keys(pool)
    blocks_b, hit = serve(b, "b-1", b.prompt())
    assert hit == 0
    assert sorted(blocks_b) == sorted(blocks_a)
    assert pool.num_evictions == 6
    keys_b = stored_keys(pool)
    assert not set(keys_a) & set(keys_b)
    assert set(pool.hash_to_block) == set(keys_b)
    # Tenant a comes back: a miss, never tenant b's blocks.
    _, hit = serve(a, "a-2", a.prompt())
    assert hit == 0


def test_identifier_namespaces_separate_items_not_text() -> None:
    """An identifier namespace keeps two tenants' equal caller ids apart; it is not a
    tenant boundary: text before the first item is shared. Isolate tenants by salt."""
    pool = BlockPool(32, BLOCK_SIZE)
    a, b = (tenant(pool, ({}, namespace)) for namespace in ("tenant-a", "tenant-b"))
    blocks_a, _ = serve(a, "a-1", a.prompt())
    keys_a = stored_keys(pool)
    blocks_b, hit = serve(b, "b-1", b.prompt())
    # Block 0 is text; block 1 holds the image's first 5 tokens.
    assert hit == BLOCK_SIZE
    chain_b = b.cache.block_hasher.hash_blocks(b.prompt())
    assert chain_b[0] == keys_a[0]
    assert stored_keys(pool) == chain_b[1:]
    assert not set(chain_b[1:]) & set(keys_a)
    assert blocks_b[0] == blocks_a[0]


def test_keys_of_different_tenants_never_meet_at_any_block() -> None:
    """Chains from different roots share no key, whatever the prompts."""
    rng = np.random.default_rng(3)
    hashers = [
        BlockHasher(BLOCK_SIZE, cache_salt=salt, adapter=adapter)
        for salt in (None, "a", "b")
        for adapter in (None, "lora")
    ]
    prompts = [rng.integers(0, 50, int(n)).tolist() for n in rng.integers(4, 40, 40)]
    prompts += [p[: len(p) // 2] for p in prompts]
    owner: dict[bytes, int] = {}
    for index, hasher in enumerate(hashers):
        for prompt in prompts:
            for key in hasher.hash_blocks(prompt):
                assert owner.setdefault(key, index) == index
    assert len(set(owner.values())) == len(hashers)


def test_a_parent_key_carries_its_chain_so_never_take_one_from_a_client() -> None:
    """Salts enter the root only: continuing from a parent continues that parent's
    chain, whoever's hasher computes it. Callers (PrefixCache does) always start from
    their own root; an API must never accept a parent key from a client."""
    tokens = list(range(16))
    a = BlockHasher(BLOCK_SIZE, cache_salt="tenant-a")
    b = BlockHasher(BLOCK_SIZE, cache_salt="tenant-b")
    keys_a = a.hash_blocks(tokens)
    assert b.hash_blocks(tokens, parent=keys_a[0], start_block=1) == keys_a[1:]
    assert not set(b.hash_blocks(tokens)) & set(keys_a)


# -- tensor store over the shared pool -----------------------------------------------


def tenant_rows(tenant_index: int, num_rows: int) -> torch.Tensor:
    """Rows only this tenant writes: 1000 * (tenant + 1) + token index, per column."""
    values = torch.arange(num_rows, dtype=torch.float32) + 1000 * (tenant_index + 1)
    return values[:, None].repeat(1, HIDDEN)


def serve_and_store(
    t: TenantCache, index: int, store: TensorStore, request_id: str, prompt: AnnotatedTokens
) -> tuple[tuple[int, ...], list[BlockHash], int]:
    """Admit, write the computed rows with the request's keys, register, free."""
    admitted = t.cache.add_request(request_id, prompt)
    assert admitted is not None
    keys = t.cache.block_hashes(request_id)
    block_ids = admitted.block_ids
    first = admitted.num_cached_tokens
    slots = [block_ids[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(len(prompt))]
    store.write(
        "h",
        tenant_rows(index, len(prompt))[first:],
        slots[first:],
        block_keys=dict(zip(block_ids, keys, strict=False)),
    )
    t.cache.mark_computed(request_id, len(prompt))
    t.cache.free(request_id)
    return block_ids, keys, first


def test_store_never_serves_one_tenants_rows_to_another(
    separation: tuple[TenantConfig, TenantConfig],
) -> None:
    pool = BlockPool(32, BLOCK_SIZE)
    store = TensorStore(32, BLOCK_SIZE)
    store.register("h", HIDDEN, torch.float32)
    store.attach(pool)
    a, b = (tenant(pool, config) for config in separation)
    blocks_a, keys_a, _ = serve_and_store(a, 0, store, "a-1", a.prompt())
    assert store.probe(blocks_a[:6], keys_a) == 6

    # Tenant b, same prompt: no pool hit, and its keys match none of a's blocks.
    blocks_b, keys_b, hit = serve_and_store(b, 1, store, "b-1", b.prompt())
    assert hit == 0
    assert store.probe(blocks_a[:6], keys_b) == 0
    with pytest.raises(StaleBlockError, match=rf"block {blocks_a[0]} \(block 0\) expected key"):
        store.read_blocks("h", blocks_a[:6], keys_b)
    merged = store.read_merged(
        [ScheduledRequest("b-2", 1, 24, blocks_a[:6], keys_b)],
        multimodal_outputs={"h": tenant_rows(1, 1)},
    )
    assert merged.tensors == {"h": {}}
    assert merged.misses == (ReadMiss("b-2", 6, 0, "h"),)

    # Control: each tenant reads back exactly its own rows.
    expected_a = tenant_rows(0, 24)
    expected_b = tenant_rows(1, 24)
    assert torch.equal(store.read_blocks("h", blocks_a[:6], keys_a), expected_a)
    assert torch.equal(store.read_blocks("h", blocks_b[:6], keys_b), expected_b)
    _, _, hit = serve_and_store(a, 0, store, "a-2", a.prompt())
    assert hit == 24


def test_store_rows_of_an_evicted_tenant_are_never_read_under_its_old_keys(
    separation: tuple[TenantConfig, TenantConfig],
) -> None:
    pool = BlockPool(7, BLOCK_SIZE)
    store = TensorStore(7, BLOCK_SIZE)
    store.register("h", HIDDEN, torch.float32)
    store.attach(pool)
    a, b = (tenant(pool, config) for config in separation)
    blocks_a, keys_a, _ = serve_and_store(a, 0, store, "a-1", a.prompt())
    blocks_b, keys_b, _ = serve_and_store(b, 1, store, "b-1", b.prompt())
    assert sorted(blocks_b) == sorted(blocks_a)
    # Tenant a's keys now name blocks that hold tenant b's rows: a miss, never b's rows.
    assert store.probe(blocks_a[:6], keys_a) == 0
    with pytest.raises(StaleBlockError):
        store.read_blocks("h", blocks_a[:6], keys_a)
    assert torch.equal(store.read_blocks("h", blocks_b[:6], keys_b), tenant_rows(1, 24))
    assert store.stats.num_evicted_stamps == 6
