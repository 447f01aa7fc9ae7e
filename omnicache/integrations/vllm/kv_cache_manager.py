"""The engine core's KV cache manager: vLLM's, with hits capped to the rows the worker holds.

Everything here runs in the engine core's process, inside vLLM's scheduler:

- `OmniKVCacheManager` stands where the scheduler keeps ``kv_cache_manager``
  and forwards every call to vLLM's manager. A lookup's hit is capped to the
  blocks whose rows the worker holds (the mirror's table:
  `mirror.StoreMirror`); an allocation records the request's block table
  and the hit it adopts, and tells the mirror; every reuse of a block clears
  what the worker holds of it *before* the block is handed out.

Why a wrapper around the manager and not a KV connector: a connector's
scheduler-side hooks add external tokens to vLLM's local hit but cannot
shorten it; the wrapper's ``get_computed_blocks`` caps a hit to the blocks
whose rows the worker holds, so a hit never comes without its rows. The
manager is also the one object that sees lookup, allocation and free.

Evictions are taken synchronously from ``BlockPool.metrics_collector``
(`ReuseHook`): vLLM calls its ``on_block_evicted`` for every block it hands
out or whose keys it drops (``evict_blocks``), while the block still holds
its old key, and ``reset`` when the prefix cache is reset; ``BlockRemoved``
events would arrive only at the next ``take_events()``, after the new owner
may already have written the block. vLLM's block 0, its null block, is
never handed out.

Hybrid models (docs/architecture.md, "Hybrid models and finer hash
blocks"): the rows follow one full-attention group's block ids
(`store_group`); every group draws its blocks from the manager's one
``BlockPool``, so the one hook sees every reuse; a hit whose rows the worker
lacks in part is looked up again at the shorter length, so that every group
agrees on it (`cap_hit`), and a partial tail block (hash blocks finer than
KV blocks) is dropped from the hit the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, type_name
from omnicache.integrations.vllm.block_tables import (
    RequestState,
    StoreGroup,
    WorkerTable,
    group_keys,
)
from omnicache.integrations.vllm.common import require_vllm
from omnicache.integrations.vllm.kv_tier import TierReader
from omnicache.integrations.vllm.mirror import StoreMirror

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

__all__ = ["OmniKVCacheManager", "OmniStats"]


def _supported_managers() -> dict[type[Any], str]:
    """The kinds of group vLLM prefix-caches (or skips in its lookups), by exact class."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        ChunkedLocalAttentionManager,
        CircularBufferManager,
        FullAttentionManager,
        MambaManager,
        SlidingWindowManager,
    )

    # NOTE: by exact class: vLLM's subclasses change which blocks a table
    # holds (see `_refused_managers`). A circular buffer is one scratch block
    # per request that vLLM leaves out of every lookup (its spec is not
    # ``prefix_cacheable``): it sits beside the groups that are cached.
    return {
        FullAttentionManager: "full attention",
        SlidingWindowManager: "sliding window",
        ChunkedLocalAttentionManager: "chunked local attention",
        MambaManager: "Mamba",
        CircularBufferManager: "circular buffer",
    }


def _refused_managers() -> dict[type[Any], str]:
    """Kinds of group vLLM itself does not prefix-cache, or caches where the store cannot follow."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        CrossAttentionManager,
        HiSparseHotManager,
        HiSparseResidentManager,
        HiSparseSourceManager,
        RSWAManager,
        SinkFullAttentionManager,
    )

    hisparse = (
        "vLLM does not prefix-cache HiSparse hot or resident groups (their spec is not "
        "prefix_cacheable); a HiSparse model's prefix cache is its source group's host pages"
    )
    return {
        RSWAManager: (
            "vLLM does not prefix-cache reference sliding windows: the model that makes them "
            "(Unlimited-OCR) turns prefix caching off, its decode KV not being a function of "
            "its prefix"
        ),
        CrossAttentionManager: (
            "vLLM does not prefix-cache cross-attention: encoder-decoder models do not support "
            "prefix caching, and this manager's lookup raises"
        ),
        SinkFullAttentionManager: (
            "vLLM does not prefix-cache static-sink attention: its KV cache coordinator cannot "
            "build this manager (its constructor takes no needs_kv_cache_zeroing)"
        ),
        HiSparseSourceManager: (
            "vLLM prefix-caches a HiSparse model in this group's host pages, a block pool of "
            "their own, which the store (indexed by the manager's pool) cannot follow"
        ),
        HiSparseHotManager: hisparse,
        HiSparseResidentManager: hisparse,
    }


def _check_group(index: int, group_manager: Any, supported: dict[type[Any], str]) -> str:
    """The kind of group ``index``, if the store can stand beside it or follow it."""
    kind = supported.get(type(group_manager))
    where = f"group {index} ({type_name(group_manager.kv_cache_spec)})"
    if kind is None:
        reason = _refused_managers().get(type(group_manager))
        raise ValueError(
            f"manager: expected KV cache groups of {', '.join(supported.values())}, "
            f"found {type_name(group_manager)} for {where}"
            + ("" if reason is None else f": {reason}")
        )
    mode = getattr(group_manager, "mamba_cache_mode", "align")
    if kind == "Mamba" and mode != "align":
        raise ValueError(
            f"manager: expected Mamba groups in mamba_cache_mode 'align' (the only mode vLLM "
            f"prefix-caches), found {mode!r} for {where}"
        )
    return kind


def store_group(manager: Any, kv_cache_group_id: int | None) -> StoreGroup:
    """The group the store follows: ``kv_cache_group_id``, or the first full-attention group.

    Raises:
        ValueError: a group of another kind than full attention, sliding
            window, chunked local attention, Mamba ("align") or circular
            buffer (the error says why vLLM does not prefix-cache a kind it
            names); groups on several block pools; no full-attention group,
            or ``kv_cache_group_id`` naming another kind of group.
    """
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    supported = _supported_managers()
    managers = manager.coordinator.single_type_managers
    kinds: list[str] = []
    for index, group_manager in enumerate(managers):
        kind = _check_group(index, group_manager, supported)
        if group_manager.block_pool is not manager.block_pool:
            # NOTE: every reuse must pass the one hook on the manager's pool.
            raise ValueError(
                f"manager: expected every KV cache group on the manager's block pool, "
                f"found group {index} ({kind}) on another pool"
            )
        kinds.append(kind)
    full = [index for index, m in enumerate(managers) if type(m) is FullAttentionManager]
    if kv_cache_group_id is None:
        if not full:
            raise ValueError(
                "manager: expected a full-attention KV cache group (the only kind whose "
                f"blocks hold every token of a prefix, which the store's rows follow), "
                f"found groups {kinds}"
            )
        group_id = full[0]
    else:
        group_id = check_int(
            "kv_cache_group_id", kv_cache_group_id, minimum=0, maximum=len(managers) - 1
        )
        if group_id not in full:
            raise ValueError(
                f"kv_cache_group_id: expected a full-attention group {full}, found group "
                f"{group_id} ({kinds[group_id]})"
            )
    block_size = int(managers[group_id].block_size)
    hash_block_size = int(manager.block_pool.hash_block_size)
    if block_size % hash_block_size:
        raise ValueError(
            f"manager: expected a block size that is a multiple of the hash block size "
            f"{hash_block_size}, found {block_size} (group {group_id})"
        )
    return StoreGroup(group_id, block_size, block_size // hash_block_size)


class ReuseHook:
    """Stands in for ``BlockPool.metrics_collector`` and forwards to the one it replaced.

    Args:
        inner: the collector that was there (None: none).
        on_reused: called with each block vLLM hands out again or whose keys
            it drops, before the collector it replaced hears of it.
        on_reset: called when the prefix cache is reset.
    """

    __slots__ = ("inner", "on_reset", "on_reused")

    def __init__(
        self, inner: Any, on_reused: Callable[[Any], None], on_reset: Callable[[], None]
    ) -> None:
        self.inner = inner
        self.on_reused = on_reused
        self.on_reset = on_reset

    def on_block_evicted(self, block: Any) -> None:
        self.on_reused(block)
        if self.inner is not None:
            self.inner.on_block_evicted(block)

    def reset(self) -> None:
        self.on_reset()
        if self.inner is not None:
            self.inner.reset()

    def on_block_allocated(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_allocated(block)

    def on_block_accessed(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_accessed(block)

    def should_sample_block(self) -> bool:
        return self.inner is not None and bool(self.inner.should_sample_block())

    def drain_events(self) -> list[Any]:
        return [] if self.inner is None else list(self.inner.drain_events())


# -- hits the worker can serve -------------------------------------------------------------
#
# A hit comes with its rows only if every block of it in the rows' group holds
# the request's key for that block (its stamps). A hit that ends inside a
# block, or on blocks without their rows, is shortened, and shortened the way
# vLLM would find it: by looking it up again, over every group, at the
# longest length the worker serves. Truncating each group's block list
# instead would be wrong for a sliding-window group, whose hit is the window
# of blocks that ends at the hit's end: at a shorter length it needs other
# blocks (which vLLM may not hold, so the hit may shrink further), and a
# chunked local group needs the blocks of the chunk that holds the new end.


def cap_hit(
    manager: Any, table: WorkerTable, group: StoreGroup, request: Any, blocks: Any, num_hit: int
) -> tuple[tuple[Any, int, int] | None, int]:
    """vLLM's hit of ``num_hit`` tokens (``blocks``), or one the worker serves.

    Every lookup is shorter than the one before, so this ends.

    Returns:
        None if vLLM's hit comes with its rows, else the hit the worker serves
        as vLLM's lookup returns it (blocks per group, tokens, shared-prefix
        boundary); and the rows' group's hit blocks found without their rows.
    """
    block_size = group.block_size
    keys = group_keys(request.block_hashes, group.scale)
    capped: tuple[Any, int, int] | None = None
    num_capped = 0
    while True:
        num_blocks = num_hit // block_size
        hit = blocks.blocks[group.group_id][:num_blocks]
        num_valid = table.num_valid([block.block_id for block in hit], keys[:num_blocks])
        if num_valid * block_size == num_hit:
            return capped, num_capped
        num_capped += num_blocks - num_valid
        # NOTE: a free block without its rows can never serve a hit (only an
        # owner writes rows), yet vLLM would keep finding it first among
        # blocks that share its key, such as the copy this request is about
        # to compute. Dropping its key lets the next lookup find the copy.
        useless = {
            block.block_id
            for block, key in zip(hit[num_valid:], keys[num_valid:num_blocks], strict=True)
            if block.ref_cnt == 0 and not table.num_valid([block.block_id], [key])
        }
        if useless:
            manager.evict_blocks(useless)
        capped = lookup(manager, request, num_valid * block_size)
        blocks, num_hit, _ = capped


def lookup(manager: Any, request: Any, max_length: int) -> tuple[Any, int, int]:
    """vLLM's lookup over every group for a hit of at most ``max_length`` tokens.

    NOTE: the coordinator's, not the manager's: 0.32's manager takes no
    length. The third value is the manager's shared-prefix boundary.
    """
    if max_length == 0:
        return manager.empty_kv_cache_blocks, 0, 0
    found, num_hit, num_uncached = manager.coordinator.find_longest_cache_hit(
        request.block_hashes, max_length
    )
    boundary = num_hit + num_uncached if num_uncached else 0
    return manager.create_kv_cache_blocks(found), num_hit, boundary


# -- the manager ------------------------------------------------------------------------


@dataclass(slots=True)
class OmniStats:
    """Counters of an `OmniKVCacheManager` since construction."""

    num_lookups: int = 0
    # Blocks of prefix hits adopted by allocations.
    num_hit_blocks: int = 0
    # Blocks vLLM had cached but whose rows the worker lacked: recomputed.
    num_capped_blocks: int = 0
    # Blocks vLLM handed out again or whose key it dropped: cleared.
    num_cleared_blocks: int = 0


class OmniKVCacheManager:
    """vLLM's ``KVCacheManager``, its hits capped to the rows the worker holds (see the module).

    The scheduler drives it as it drives the manager (``get_computed_blocks``,
    ``allocate_slots``, ``free``; every other attribute is the manager's).
    Until it has a mirror (`attach_mirror`), it caps nothing: it only records each
    request's blocks and sees every reuse.

    Args:
        manager: the vLLM manager, with prefix caching enabled.
        kv_cache_group_id: the full-attention KV cache group whose block ids
            the rows follow (None: the first one).

    Raises:
        TypeError, ValueError: a manager that does not fit.
    """

    __slots__ = ("_group", "_hook", "_manager", "_mirror", "_requests", "_stats")

    def __init__(self, manager: KVCacheManager, *, kv_cache_group_id: int | None = None) -> None:
        require_vllm()
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager: expected a KVCacheManager, found {type_name(manager)}")
        if not manager.enable_caching:
            raise ValueError("manager: expected enable_caching=True, found False")
        pool = manager.block_pool
        if isinstance(pool.metrics_collector, ReuseHook):
            raise ValueError("manager: expected a manager not wrapped yet, found one wrapped")
        self._manager = manager
        self._group = store_group(manager, kv_cache_group_id)
        self._requests: dict[str, RequestState] = {}
        self._mirror: StoreMirror | None = None
        self._stats = OmniStats()
        # NOTE: stamps can be trusted only while every reuse passes through
        # this hook; from here on vLLM cannot hand out a block unseen.
        self._hook = ReuseHook(pool.metrics_collector, self._on_block_reused, self._on_reset)
        pool.metrics_collector = self._hook

    def __getattr__(self, name: str) -> Any:
        if name == "_manager":
            raise AttributeError(name)
        return getattr(self._manager, name)

    def __repr__(self) -> str:
        return (
            f"OmniKVCacheManager(num_blocks={self._manager.block_pool.num_gpu_blocks}, "
            f"block_size={self._group.block_size}, num_requests={len(self._requests)})"
        )

    @property
    def manager(self) -> KVCacheManager:
        return self._manager

    @property
    def group(self) -> StoreGroup:
        """The KV cache group whose block ids the rows follow."""
        return self._group

    @property
    def stats(self) -> OmniStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    def detach(self) -> None:
        """Gives the manager its own metrics collector back and forgets what the worker holds.

        NOTE: once detached, reuses are no longer seen, so no stamp can be
        trusted: all are cleared.
        """
        pool = self._manager.block_pool
        if pool.metrics_collector is not self._hook:
            raise RuntimeError(
                "manager: expected this wrapper's collector installed, found another"
            )
        pool.metrics_collector = self._hook.inner
        self._on_reset()
        self._requests.clear()

    # -- vLLM's hooks -------------------------------------------------------------

    def _on_block_reused(self, block: Any) -> None:
        self._stats.num_cleared_blocks += 1
        if self._mirror is not None:
            self._mirror.on_cleared(block.block_id)

    def _on_reset(self) -> None:
        if self._mirror is not None:
            self._mirror.on_cleared(None)

    # -- the manager's interface -----------------------------------------------------

    # NOTE: the lookups take ``(request)`` in vLLM 0.32 and ``(request,
    # max_cache_hit_length=None)`` in 0.33: the wrapper passes on exactly what
    # the scheduler gives, so each version's manager checks its own signature.

    def get_computed_blocks(
        self, request: Request, *args: Any, **kwargs: Any
    ) -> tuple[KVCacheBlocks, int, int]:
        """vLLM's lookup, capped to the blocks whose rows the worker holds (see the module)."""
        blocks, num_hit, boundary = self._manager.get_computed_blocks(request, *args, **kwargs)
        capped = self._cap_hit(request, blocks, num_hit)
        return (blocks, num_hit, boundary) if capped is None else capped

    def get_computed_blocks_for_connector(
        self, request: Request, *args: Any, **kwargs: Any
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """As ``get_computed_blocks`` for a scheduler with a KV connector.

        A capped hit is vLLM's reconciled lookup at the shorter length: every
        group agrees on it, so it never diverges.
        """
        blocks, num_hit, boundary, diverged = self._manager.get_computed_blocks_for_connector(
            request, *args, **kwargs
        )
        capped = self._cap_hit(request, blocks, num_hit)
        return (blocks, num_hit, boundary, diverged) if capped is None else (*capped, False)

    def _cap_hit(
        self, request: Request, blocks: Any, num_hit: int
    ) -> tuple[KVCacheBlocks, int, int] | None:
        self._stats.num_lookups += 1
        if num_hit == 0 or self._mirror is None:
            return None
        capped, num_capped = cap_hit(
            self._manager, self._mirror.table, self._group, request, blocks, num_hit
        )
        self._stats.num_capped_blocks += num_capped
        return capped

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> KVCacheBlocks | None:
        """vLLM's allocation; records the request's blocks and the hit it adopts.

        The keys of the request's blocks in the rows' group (``request.block_hashes``
        at that group's block size) stamp the rows the step writes.
        """
        new_blocks = self._manager.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, *args, **kwargs
        )
        if new_blocks is None:
            return None
        request_id = request.request_id
        state = self._requests.get(request_id)
        if state is None or not state.blocks or request.num_computed_tokens == 0:
            # NOTE: vLLM extends a request's block list in place until the
            # request is freed, so the list fetched at admission stays its
            # table while it runs.
            table = self._manager.coordinator.get_blocks(request_id)[self._group.group_id]
            if state is None:
                state = RequestState(request, table, self._group.scale)
                self._requests[request_id] = state
            else:
                state.blocks = table
        block_size = self._group.block_size
        if (
            num_new_computed_tokens > 0
            and new_computed_blocks is not None
            and request.num_computed_tokens == 0
        ):
            num_blocks = num_new_computed_tokens // block_size
            hit = new_computed_blocks.blocks[self._group.group_id][:num_blocks]
            state.hit_block_ids = tuple(block.block_id for block in hit)
            state.hit_block_keys = tuple(state.keys()[:num_blocks])
            self._stats.num_hit_blocks += num_blocks
        mirror = self._mirror
        if mirror is not None and num_new_tokens > 0:
            # NOTE: a new request's computed tokens are set after allocation.
            start = request.num_computed_tokens + num_new_computed_tokens
            start += kwargs.get("num_external_computed_tokens", 0)
            if num_new_tokens == 1:
                # NOTE: a decode token, most allocations: queued, and recorded
                # in one loop when the mirror is next used (`StoreMirror.queued`);
                # a call each cost more than recording it.
                mirror.queued.append((request_id, state, start))
            else:
                mirror.on_allocated(request_id, state, start, num_new_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        """Forgets the request, then frees it as vLLM does."""
        self._requests.pop(request.request_id, None)
        self._manager.free(request)

    def pop_blocks_for_free(self, request: Request) -> list[Any]:
        """As `free`, for a scheduler that returns the blocks to the pool later."""
        self._requests.pop(request.request_id, None)
        blocks: list[Any] = self._manager.pop_blocks_for_free(request)
        return blocks

    # -- what the wrapper recorded ---------------------------------------------------

    def request_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in the rows' group, first block first."""
        return [block.block_id for block in self._state(request_id).blocks]

    def hit_blocks(self, request_id: str) -> tuple[tuple[int, ...], tuple[BlockHash, ...]]:
        """The request's hit blocks and their keys, first block first (empty: no hit)."""
        state = self._state(request_id)
        return state.hit_block_ids, state.hit_block_keys

    def attach_mirror(self, reader: TierReader | None = None) -> StoreMirror:
        """The mirror of what the worker holds, told every allocation and reuse from now on.

        Hits are capped to its table from then on. A one-token allocation goes
        into ``mirror.queued``, every other to ``mirror.on_allocated``; a reuse
        to ``mirror.on_cleared``. Once per manager.

        Args:
            reader: the tier's reader (None: no tier).
        """
        if self._mirror is not None:
            raise ValueError("manager: expected no mirror yet, found one following it")
        self._mirror = StoreMirror(
            self._manager.block_pool.num_gpu_blocks, self._group.block_size, reader
        )
        return self._mirror

    def _state(self, request_id: str) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(
                f"request_id: expected a request with allocated blocks, found {request_id!r} "
                f"({len(self._requests)} requests allocated)"
            )
        return state
