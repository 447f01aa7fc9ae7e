"""The Redis tier of a live engine: each full block's KV (every layer) and hidden rows, by key.

A second engine has no KV for the blocks another engine computed, so vLLM
gives it no local hit and it recomputes them; hidden rows alone never serve
a row there. So the tier keeps, per block key, one value per entry:
``hidden_states`` (the block's final hidden rows) and ``kv.<layer name>`` (the
block's keys and values of that attention layer, token-major), each in the
tier's checked format (`omnicache.tiers.codec`: version, dtype, shape, key
stamp and checksum verified on every load).

- Scheduler side, `TierReader`: at the lookup, the further blocks of a
  request's key chain are read (one ``MGET``) and verified; the leading
  blocks held whole are the external hit, and their values travel to the
  worker in the step's plan (`LoadOrder`). Fetching at the lookup is what
  makes a load unable to miss: vLLM 0.32 strips from the worker's copy of a
  request the multimodal data of items inside its computed prefix (local and
  external), so a request whose load failed after the lookup could not be
  recomputed (its image's encoder has no input): the engine stops.
- Worker side, `WorkerTier`: `WorkerTier.load` decodes a request's values
  again against the worker's own KV caches (all of them, or none), copies
  their KV into vLLM's paged cache and their hidden rows into the store,
  stamped with their keys; `WorkerTier.save` writes behind (`RedisTier`) the
  KV and hidden rows of the blocks a step stamped.

Configuration, in ``kv_connector_extra_config`` (`tier_config`):
``tier_url`` (``redis://host:port/db``), ``tier_namespace`` (engines share
blocks only within one namespace: one model, dtype and KV layout), optionally
``tier_prefix`` (default ``omnicache``). Without ``tier_url`` there is no tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import type_name
from omnicache.integrations.vllm.plan import LoadOrder
from omnicache.store import HIDDEN_STATES, EntrySpec, TensorStore, TierBlock
from omnicache.tiers import codec
from omnicache.tiers.base import check_key_part, decode_run, value_key

__all__ = [
    "KV_ENTRY_PREFIX",
    "TIER_NAMESPACE",
    "TIER_PREFIX",
    "TIER_URL",
    "TierConfig",
    "TierReader",
    "TierStats",
    "WorkerTier",
    "decode_blocks",
    "entry_specs",
    "tier_config",
    "tier_reader",
]

TIER_URL = "tier_url"
TIER_NAMESPACE = "tier_namespace"
TIER_PREFIX = "tier_prefix"
KV_ENTRY_PREFIX = "kv."
"""Entry name of a layer's KV: ``kv.<layer name>``."""

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
    """The scheduler's side of the tier: fetches and verifies the blocks a request can load.

    A lookup reads every entry of the candidate blocks (``MGET``) and keeps
    the leading blocks whose values all verify against the layout the
    engine's KV cache and model give (`omnicache.tiers.codec`); their values
    travel to the worker in the step's plan. So the worker's load cannot
    miss: a block evicted from Redis after the lookup was fetched already.

    Args:
        config: the tier.
        entries: the entries of one block (`entry_specs`).
        block_size: tokens per block.
    """

    def __init__(self, config: TierConfig, entries: Sequence[EntrySpec], block_size: int) -> None:
        import redis

        self.config = config
        self.entries = tuple(entries)
        self.block_size = block_size
        # NOTE: a slow server costs one timeout and is then a miss (see RedisTier.from_url).
        self.client = redis.Redis.from_url(
            config.url, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        self._faults: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.num_lookups = 0
        self.num_errors = 0
        self.num_rejected_values = 0

    def fetch(self, keys: Sequence[BlockHash]) -> list[tuple[bytes, ...]]:
        """The values of the leading ``keys`` held whole and verified, one tuple per block."""
        if not keys:
            return []
        self.num_lookups += 1
        config, entries = self.config, self.entries
        names = [
            value_key(config.prefix, config.namespace, k, e.name) for k in keys for e in entries
        ]
        try:
            values: list[Any] = list(self.client.mget(names))
        except self._faults as exc:
            # NOTE: a tier that fails costs misses, never the engine.
            self.num_errors += 1
            _LOG.warning("tier lookup failed (%s: %s): no external hit", type(exc).__name__, exc)
            return []
        num = len(entries)
        blocks: list[tuple[bytes | None, ...]] = [
            tuple(values[i * num : (i + 1) * num]) for i in range(len(keys))
        ]
        run = decode_blocks(keys, entries, self.block_size, blocks, self._reject)
        # NOTE: every value of a block in the run was found and verified.
        return [tuple(bytes(value or b"") for value in blocks[i]) for i in range(len(run))]

    def _reject(self, index: int, spec: EntrySpec, why: codec.Rejection) -> None:
        self.num_rejected_values += 1
        _LOG.warning(
            "tier: block %d's %s rejected (%s): a miss from there on", index, spec.name, why.value
        )

    def close(self) -> None:
        self.client.close()


def tier_reader(config: TierConfig, vllm_config: Any, kv_cache_config: Any) -> TierReader:
    """The scheduler's reader of ``config``'s tier, for the engine's KV cache and model.

    Raises:
        ValueError: the KV cache has more than one group (the tier keeps one).
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"tier ({TIER_URL}): expected one KV cache group, found {len(groups)}")
    (group,) = groups
    spec = group.kv_cache_spec
    model_config = vllm_config.model_config
    entries = entry_specs(
        model_config.get_hidden_size(),
        model_config.dtype,
        dict.fromkeys(group.layer_names, (spec.num_kv_heads, 2 * spec.head_size)),
        spec.dtype,
    )
    return TierReader(config, entries, int(vllm_config.cache_config.block_size))


def decode_blocks(
    keys: Sequence[BlockHash],
    entries: Sequence[EntrySpec],
    block_size: int,
    blocks: Sequence[Sequence[bytes | None]],
    on_reject: Callable[[int, EntrySpec, codec.Rejection], None],
) -> list[Mapping[str, torch.Tensor]]:
    """The rows of the leading blocks whose every value verifies (values in ``entries``' order)."""

    def value_of(index: int, j: int) -> bytes | None:
        return blocks[index][j] if index < len(blocks) else None

    return decode_run(keys, entries, block_size, value_of, on_reject)


def entry_specs(
    hidden_size: int,
    hidden_dtype: torch.dtype,
    kv_shapes: Mapping[str, tuple[int, int]],
    kv_dtype: torch.dtype,
) -> list[EntrySpec]:
    """The tier entries of one block: hidden rows, then each layer's KV, layers sorted.

    ``kv_shapes``: per layer, ``(num_kv_heads, 2 * head_size)``: a token's
    keys and values in CPU attention's layout.
    """
    specs = [EntrySpec(HIDDEN_STATES, (hidden_size,), hidden_dtype, False, 0)]
    specs += [
        EntrySpec(KV_ENTRY_PREFIX + name, tuple(kv_shapes[name]), kv_dtype, False, 0)
        for name in sorted(kv_shapes)
    ]
    return specs


@dataclass(slots=True)
class TierStats:
    """Counters of a worker's tier since it was attached."""

    num_load_requests: int = 0
    num_loaded_blocks: int = 0
    # Load orders the tier could not serve whole: nothing of them was loaded.
    num_failed_loads: int = 0
    num_saved_blocks: int = 0
    load_s: float = 0.0
    save_s: float = 0.0


class WorkerTier:
    """Loads and saves blocks' KV and hidden rows between vLLM's paged cache, a store and Redis.

    Args:
        config: the tier.
        kv_caches: vLLM's KV cache per attention layer, CPU attention's layout
            ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``.
        store: the worker's store (its ``HIDDEN_STATES`` entry and block size).

    Raises:
        ValueError: KV caches of another layout, or that do not fit the store.
    """

    def __init__(
        self, config: TierConfig, kv_caches: Mapping[str, torch.Tensor], store: TensorStore
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
            expected = f"(>= {store.num_blocks} blocks, heads, {self.block_size}, 2 * head)"
            if (
                cache.dim() != 4
                or cache.shape[0] < store.num_blocks
                or cache.shape[2] != self.block_size
            ):
                raise ValueError(
                    f"kv_caches[{name!r}]: expected CPU attention's layout {expected}, "
                    f"found {tuple(cache.shape)}"
                )
            if cache.dtype != kv_dtype:
                raise ValueError(
                    f"kv_caches[{name!r}]: expected {kv_dtype} as every layer's, "
                    f"found {cache.dtype}"
                )
            kv_shapes[name] = (int(cache.shape[1]), int(cache.shape[3]))
            self._layers.append((KV_ENTRY_PREFIX + name, cache))
        self.entries = tuple(entry_specs(hidden.row_shape[0], hidden.dtype, kv_shapes, kv_dtype))
        self.tier = RedisTier.from_url(config.url, namespace=config.namespace, prefix=config.prefix)
        self.stats = TierStats()

    def load(self, store: TensorStore, order: LoadOrder) -> bool:
        """Fills ``order``'s blocks with the values it carries; all of them, or (False) none."""
        start = time.perf_counter()
        self.stats.num_load_requests += 1

        def reject(index: int, spec: EntrySpec, why: codec.Rejection) -> None:
            _LOG.warning(
                "tier: request %s, block %d's %s rejected (%s)",
                order.req_id,
                index,
                spec.name,
                why.value,
            )

        run = decode_blocks(order.block_keys, self.entries, self.block_size, order.values, reject)
        if len(run) != len(order.block_ids):
            self.stats.num_failed_loads += 1
            self.stats.load_s += time.perf_counter() - start
            return False
        for block_id, rows in zip(order.block_ids, run, strict=True):
            for name, cache in self._layers:
                # NOTE: token-major in the tier: (block_size, heads, 2 * head).
                cache[block_id].copy_(rows[name].permute(1, 0, 2))
        hidden = torch.cat([rows[HIDDEN_STATES] for rows in run])
        store.write_blocks(HIDDEN_STATES, hidden, order.block_ids, block_keys=order.block_keys)
        self.stats.num_loaded_blocks += len(order.block_ids)
        self.stats.load_s += time.perf_counter() - start
        return True

    def save(self, store: TensorStore, block_keys: Mapping[int, BlockHash]) -> None:
        """Writes behind the KV and hidden rows of stamped blocks (block id -> key)."""
        if not block_keys:
            return
        start = time.perf_counter()
        ids = list(block_keys)
        keys = [block_keys[block_id] for block_id in ids]
        hidden = store.read_blocks(HIDDEN_STATES, ids, keys)
        blocks: list[TierBlock] = []
        for index, (block_id, key) in enumerate(zip(ids, keys, strict=True)):
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
