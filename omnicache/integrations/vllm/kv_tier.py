"""The Redis tier of a live engine: each full block's KV (every layer) and hidden rows, by key.

A second engine has no KV for the blocks another engine computed, so vLLM
gives it no local hit and it recomputes them; hidden rows alone never serve
a row there. So the tier keeps, per block key, one value per entry:
``hidden_states`` (the block's final hidden rows) and, per tensor-parallel rank,
``kv.tp<rank>of<size>.<layer name>`` (that rank's shard of the block's keys
and values of that attention layer, token-major: a rank's KV cache holds
only its heads), each in the tier's checked format (`omnicache.tiers.codec`:
version, dtype, shape, key stamp and checksum verified on every load). One
Redis client implementation serves both sides (`omnicache.tiers.redis.RedisTier`).

- Scheduler side, `TierReader`: at the lookup, asks Redis only which further
  blocks of a request's key chain exist (``EXISTS``: a few bytes a value),
  once per waiting request. Those blocks are vLLM's external tokens, loaded
  asynchronously: the request waits (vLLM's ``WAITING_FOR_REMOTE_KVS``) while
  the step's plan carries the load to the worker (`LoadOrder`: request id,
  block ids and keys, about 40 bytes a block; no value crosses the engine
  core).
- Worker side, `WorkerTier`: `WorkerTier.load` fetches the blocks (MGET),
  verifies them against the worker's own KV caches and store, copies the KV
  of the leading blocks that verify into vLLM's paged cache and their hidden
  rows into the store, stamped with their keys; a block gone or damaged since
  the lookup ends the load there, and its blocks go back to vLLM as load
  errors (``kv_load_failure_policy="recompute"``): vLLM recomputes the
  request from the first one. Because the load finishes before the request
  is first sent to the worker, the worker's copy of a multimodal request
  keeps the data of every item it must recompute. `WorkerTier.save` writes
  behind the KV and hidden rows of the blocks a step stamped.

Configuration, in ``kv_connector_extra_config`` (`tier_config`):
``tier_url`` (``redis://host:port/db``), ``tier_namespace`` (engines share
blocks only within one namespace: one model, dtype and KV layout), optionally
``tier_prefix`` (default ``omnicache``). Without ``tier_url`` there is no tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import type_name
from omnicache.integrations.vllm.plan import LoadOrder
from omnicache.store import HIDDEN_STATES, EntrySpec, TensorStore, TierBlock
from omnicache.tiers.base import check_key_part

__all__ = [
    "TIER_NAMESPACE",
    "TIER_URL",
    "TierReader",
    "WorkerTier",
    "WorkerTierStats",
]

TIER_URL = "tier_url"
TIER_NAMESPACE = "tier_namespace"
TIER_PREFIX = "tier_prefix"
KV_ENTRY_PREFIX = "kv."
"""Entry names of a layer's KV start so: ``kv.tp<rank>of<size>.<layer name>``."""

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Where the tier lives (see the module)."""

    url: str
    namespace: str
    prefix: str = "omnicache"


def tier_config(extra: Mapping[str, Any] | None) -> TierConfig | None:
    """The tier named in ``kv_connector_extra_config``, or None when it names none.

    Raises:
        ValueError: ``tier_namespace`` or ``tier_prefix`` without ``tier_url``,
            or a URL or namespace that is not a usable string.
    """
    extra = extra or {}
    url = extra.get(TIER_URL)
    if url is None:
        stray = sorted(k for k in (TIER_NAMESPACE, TIER_PREFIX) if k in extra)
        if stray:
            raise ValueError(
                f"kv_connector_extra_config: expected {TIER_URL!r} with {stray}, found none"
            )
        return None
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"kv_connector_extra_config[{TIER_URL!r}]: expected a redis:// URL, found {url!r}"
        )
    if TIER_NAMESPACE not in extra:
        raise ValueError(
            f"kv_connector_extra_config: expected {TIER_NAMESPACE!r} with {TIER_URL!r} (engines "
            "share blocks within one namespace: one model, dtype and KV layout), found none"
        )
    namespace = check_key_part(
        f"kv_connector_extra_config[{TIER_NAMESPACE!r}]", extra[TIER_NAMESPACE]
    )
    prefix = check_key_part(
        f"kv_connector_extra_config[{TIER_PREFIX!r}]", extra.get(TIER_PREFIX, "omnicache")
    )
    return TierConfig(url, namespace, prefix)


class TierReader:
    """The scheduler's side of the tier: which further blocks of a request's chain Redis holds.

    Asks only whether each block's every entry exists (`RedisTier.count_held`),
    once per waiting request (a request vLLM could not admit yet is answered
    from its lookup); the worker fetches and verifies the values when it
    loads them. A request whose load failed gets no external tokens again.

    Args:
        config: the tier.
        entry_names: the entries of one block (`entry_names`).
    """

    def __init__(self, config: TierConfig, entry_names: Sequence[str]) -> None:
        from omnicache.tiers.redis import RedisTier

        if not entry_names:
            raise ValueError("entry_names: expected the entries of a block, found none")
        self.config = config
        self.entry_names = tuple(entry_names)
        self.tier = RedisTier.from_url(config.url, namespace=config.namespace, prefix=config.prefix)
        # Per waiting request: (first block, keys held from there) of its
        # lookup, and the first block vLLM last asked after.
        self._lookups: dict[str, tuple[int, list[BlockHash], int]] = {}
        self._failed: set[str] = set()
        # The tokens each request's first admission took from the tier.
        self._external: dict[str, int] = {}

    def held(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` the tier holds every entry of (0 while it is down)."""
        return self.tier.count_held(keys, self.entry_names)

    def num_blocks(self, req_id: str, keys: Sequence[BlockHash], first: int) -> int:
        """Blocks of ``keys`` (a request's chain, but its last token's) held from ``first`` on."""
        if req_id in self._failed:
            return 0
        lookup = self._lookups.get(req_id)
        if lookup is None or not lookup[0] <= first <= lookup[0] + len(lookup[1]):
            chain = list(keys[first:])
            lookup = (first, chain[: self.held(chain)], first)
        start, held, _ = lookup
        self._lookups[req_id] = (start, held, first)
        return max(0, min(start + len(held), len(keys)) - first)

    def allocated(self, req_id: str, num_blocks: int) -> tuple[int, list[BlockHash]]:
        """vLLM gave ``num_blocks`` external blocks: the first one's index, and their keys.

        Raises:
            RuntimeError: more blocks than the request's last lookup found.
        """
        lookup = self._lookups.pop(req_id, None)
        self._external.setdefault(req_id, num_blocks)
        if num_blocks == 0:
            return 0, []
        if lookup is None or lookup[2] + num_blocks > lookup[0] + len(lookup[1]):
            found = None if lookup is None else (lookup[0], len(lookup[1]))
            raise RuntimeError(
                f"request {req_id}: expected external blocks the tier holds (its lookup: "
                f"{found}), found {num_blocks}"
            )
        start, held, first = lookup
        return first, held[first - start : first - start + num_blocks]

    def failed(self, req_id: str, num_loaded: int) -> None:
        """The request's load stopped after ``num_loaded`` blocks: no more lookups for it."""
        self._failed.add(req_id)
        self._external[req_id] = num_loaded

    def finished(self, req_id: str) -> int:
        """Forgets the request; the blocks its first admission took from the tier."""
        self._lookups.pop(req_id, None)
        self._failed.discard(req_id)
        return self._external.pop(req_id, 0)

    def close(self) -> None:
        self.tier.close()


def tier_reader(config: TierConfig, vllm_config: Any, kv_cache_config: Any) -> TierReader:
    """The scheduler's reader of ``config``'s tier, for the engine's KV cache and layout.

    Raises:
        ValueError: the KV cache has more than one group (the tier keeps one).
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"tier ({TIER_URL}): expected one KV cache group, found {len(groups)}")
    (group,) = groups
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    return TierReader(config, entry_names(group.layer_names, size))


def entry_specs(
    hidden_size: int,
    hidden_dtype: torch.dtype,
    kv_shapes: Mapping[str, tuple[int, int]],
    kv_dtype: torch.dtype,
    rank: int = 0,
    num_ranks: int = 1,
) -> list[EntrySpec]:
    """The tier entries one rank loads of a block: hidden rows, then its KV of each layer.

    ``kv_shapes``: per layer, ``(heads, content)``: a token's keys and values
    as the rank's per-layer view holds them (see `WorkerTier`).
    """
    layers = sorted(kv_shapes)
    specs = [EntrySpec(HIDDEN_STATES, (hidden_size,), hidden_dtype, False, 0)]
    specs += [
        EntrySpec(kv_entry_name(name, rank, num_ranks), tuple(kv_shapes[name]), kv_dtype, False, 0)
        for name in layers
    ]
    return specs


def kv_entry_name(layer_name: str, rank: int, num_ranks: int) -> str:
    """The entry of tensor-parallel ``rank``'s (of ``num_ranks``) KV shard of a layer."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank: expected 0 <= rank < {num_ranks}, found {rank}")
    return f"{KV_ENTRY_PREFIX}tp{rank}of{num_ranks}.{layer_name}"


def entry_names(layer_names: Iterable[str], num_ranks: int = 1) -> list[str]:
    """Every tier entry of one block: hidden rows, then each layer's KV shards, layers sorted."""
    return [
        HIDDEN_STATES,
        *(
            kv_entry_name(name, rank, num_ranks)
            for name in sorted(layer_names)
            for rank in range(num_ranks)
        ),
    ]


@dataclass(slots=True)
class WorkerTierStats:
    """Counters of a worker's tier since it was attached."""

    num_load_requests: int = 0
    num_loaded_blocks: int = 0
    # Load orders the tier could not serve whole (their leading blocks that
    # verified were loaded).
    num_failed_loads: int = 0
    num_saved_blocks: int = 0
    load_s: float = 0.0
    save_s: float = 0.0


class WorkerTier:
    """Loads and saves blocks' KV and hidden rows between vLLM's paged cache, a store and Redis.

    Args:
        config: the tier.
        kv_caches: vLLM's KV cache per attention layer, as vLLM's per-layer
            view ``(num_blocks, heads, block_size, content)`` (vLLM views every
            attention backend's cache so, its physical layout in the view's
            strides; the tier copies through the view whatever the strides).
        store: the worker's store (its ``HIDDEN_STATES`` entry and block size).
        rank: the worker's tensor-parallel rank; it saves and loads its own KV
            shard, and only rank 0 saves and loads the hidden rows (every rank's
            are the same, and only rank 0's store keeps them: another rank's
            store is a follower's, whose blocks a load only stamps).
        num_ranks: the tensor-parallel size.

    Raises:
        ValueError: KV caches of another layout, or that do not fit the store.
    """

    def __init__(
        self,
        config: TierConfig,
        kv_caches: Mapping[str, torch.Tensor],
        store: TensorStore,
        *,
        rank: int = 0,
        num_ranks: int = 1,
    ) -> None:
        from omnicache.tiers.redis import RedisTier

        if not kv_caches:
            raise ValueError("kv_caches: expected one tensor per attention layer, found none")
        hidden = store.entries[HIDDEN_STATES]
        self.block_size = store.block_size
        kv_shapes: dict[str, tuple[int, int]] = {}
        self._layers: list[tuple[str, torch.Tensor]] = []
        kv_dtype = kv_caches[min(kv_caches)].dtype
        for name in sorted(kv_caches):
            cache = kv_caches[name]
            if not isinstance(cache, torch.Tensor):
                raise ValueError(
                    f"kv_caches[{name!r}]: expected a tensor, found {type_name(cache)}"
                )
            expected = f"(>= {store.num_blocks} blocks, heads, {self.block_size}, content)"
            if (
                cache.dim() != 4
                or cache.shape[0] < store.num_blocks
                or cache.shape[2] != self.block_size
            ):
                raise ValueError(
                    f"kv_caches[{name!r}]: expected vLLM's per-layer view {expected}, "
                    f"found {tuple(cache.shape)}"
                )
            if cache.dtype != kv_dtype:
                raise ValueError(
                    f"kv_caches[{name!r}]: expected {kv_dtype} as every layer's, "
                    f"found {cache.dtype}"
                )
            kv_shapes[name] = (int(cache.shape[1]), int(cache.shape[3]))
            self._layers.append((kv_entry_name(name, rank, num_ranks), cache))
        self.keeps_rows = rank == 0
        specs = entry_specs(hidden.row_shape[0], hidden.dtype, kv_shapes, kv_dtype, rank, num_ranks)
        self.entries = tuple(specs if self.keeps_rows else specs[1:])
        self.tier = RedisTier.from_url(config.url, namespace=config.namespace, prefix=config.prefix)
        self.stats = WorkerTierStats()

    def load(self, store: TensorStore, order: LoadOrder) -> int:
        """Fetches ``order``'s blocks and fills the leading ones that verify; how many it filled.

        A block missing or damaged in Redis (or of another layout) ends the
        load there: the blocks from it on are not touched.
        """
        start = time.perf_counter()
        self.stats.num_load_requests += 1
        run = self.tier.get(order.block_keys, self.entries, self.block_size)
        num = min(len(run), len(order.block_ids))
        for block_id, rows in zip(order.block_ids[:num], run[:num], strict=True):
            for name, cache in self._layers:
                # NOTE: token-major in the tier: (block_size, heads, content).
                cache[block_id].copy_(rows[name].permute(1, 0, 2))
        if num:
            if self.keeps_rows:
                hidden = torch.cat([rows[HIDDEN_STATES] for rows in run[:num]])
            else:
                # NOTE: a follower's store keeps only stamps (and a byte a row).
                spec = store.entries[HIDDEN_STATES]
                hidden = torch.zeros((num * self.block_size, *spec.row_shape), dtype=spec.dtype)
            store.write_blocks(
                HIDDEN_STATES, hidden, order.block_ids[:num], block_keys=order.block_keys[:num]
            )
        if num < len(order.block_ids):
            self.stats.num_failed_loads += 1
            _LOG.warning(
                "tier: request %s: %d of %d blocks loaded (the rest gone or damaged since the "
                "lookup); vLLM recomputes from there",
                order.req_id,
                num,
                len(order.block_ids),
            )
        self.stats.num_loaded_blocks += num
        self.stats.load_s += time.perf_counter() - start
        return num

    def save(self, store: TensorStore, block_keys: Mapping[int, BlockHash]) -> None:
        """Writes behind the KV and hidden rows of stamped blocks (block id -> key)."""
        if not block_keys:
            return
        start = time.perf_counter()
        ids = list(block_keys)
        keys = [block_keys[block_id] for block_id in ids]
        hidden = store.read_blocks(HIDDEN_STATES, ids, keys) if self.keeps_rows else None
        blocks: list[TierBlock] = []
        for index, (block_id, key) in enumerate(zip(ids, keys, strict=True)):
            if hidden is not None:
                rows = hidden[index * self.block_size : (index + 1) * self.block_size]
                blocks.append(TierBlock(key, HIDDEN_STATES, rows))
            for name, cache in self._layers:
                blocks.append(TierBlock(key, name, cache[block_id].permute(1, 0, 2)))
        self.tier.put(blocks)
        self.stats.num_saved_blocks += len(ids)
        self.stats.save_s += time.perf_counter() - start

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Waits until every saved block is written (or lost); whether it drained in time."""
        return self.tier.flush(timeout_s)

    def close(self) -> None:
        self.tier.close()
