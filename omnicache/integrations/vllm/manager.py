"""A vLLM ``KVCacheManager`` that keeps a `TensorStore` in step with its block ids.

`OmniKVCacheManager` wraps a ``KVCacheManager``: lookups are capped to the
blocks whose outputs are stored, a hit's hidden states and multimodal outputs
are merged with the step's new rows, each allocated block's key stamps the
rows written into it, every reuse of a block clears its stamps *before* the
block is handed out, and a finished request's deferred outputs are committed.

Why a wrapper around the manager and not a KV connector: a connector is
built by the engine from its configuration by class name, so it cannot be
handed a store, and its scheduler-side hooks are about tokens *it* supplies
(``get_num_new_matched_tokens`` adds external tokens to vLLM's local hit but
cannot shorten that hit). The wrapper can: its ``get_computed_blocks`` caps a
hit to the blocks whose outputs are stored, so a hit never comes without its
rows. The manager is also the one object that sees lookup, allocation and
free for every request; the reuse of blocks is taken from its ``BlockPool``
(below), which a connector would have to reach the same way. The wrapper
forwards every other attribute to the manager, so it can stand where the
scheduler keeps ``kv_cache_manager``.

Evictions are taken synchronously from ``BlockPool.metrics_collector``: vLLM
calls its ``on_block_evicted`` for every block it hands out (while the block
still holds its old key) and ``reset`` when the prefix cache is reset. The
wrapper installs a collector there that clears the block's stamps and then
forwards to the collector that was there before. ``BlockRemoved`` events would
arrive only at the next ``take_events()``, after the new owner may already
have written the block. Keys dropped through ``evict_blocks`` (a connector
reporting failed loads) pass through the same hook. vLLM's block 0 is its
null block: it is never handed out, so the store's block 0 stays unused.

Hybrid models. With several KV cache groups (full attention beside sliding
window, chunked local attention, Mamba or a circular buffer; kinds vLLM does
not prefix-cache are refused), the store's rows follow one
full-attention group's block ids (`groups.store_group` says why). Every group
draws its blocks from the manager's one ``BlockPool``, so the one hook there
sees every reuse, of every group; block ids are the pool's, so clearing a
block that another group reuses is a no-op for the store. A hit whose rows
the store lacks in part is shortened by looking it up again at the shorter
length, so that every group agrees on it: a sliding-window group needs the
blocks of the window that ends at the new length, not a truncated list of
the old window's blocks.

Hash blocks finer than KV blocks. vLLM 0.32 and 0.33 then key a group block
by the hash at its last hash boundary, and with an aligned Mamba group they
hit partial blocks: the shared tail block is copied on write into a block of
the request's own. The store serves whole blocks only: a partial tail is
dropped from the hit (looked up again at the whole-block length), so no
shared tail is ever copied for a request whose hit the wrapper caps. A copy
made anyway (no entries registered, or ``require_stored_outputs=False``)
moves KV, not rows: its block is handed out through the hook (stamps
cleared) and the request's writes start inside it, which never completes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_bool, check_int, check_str, type_name
from omnicache.integrations.vllm.common import require_vllm
from omnicache.integrations.vllm.groups import store_group
from omnicache.integrations.vllm.hits import cap_hit
from omnicache.integrations.vllm.request_state import RequestState, check_no_hit
from omnicache.integrations.vllm.reuse_hook import ReuseHook
from omnicache.store import MergedRead, ScheduledRequest, TensorStore, WriteResult

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

__all__ = ["OmniKVCacheManager", "OmniStats", "StepListener", "StepRequest"]

# vLLM keys its hash table by key + a 4-byte group id (BlockHashWithGroupId).
_GROUP_ID_BYTES = 4

_NULL_BLOCK_ID = 0


StepRequest = ScheduledRequest
"""The store's `ScheduledRequest`, under the name `OmniKVCacheManager` callers know.

`OmniKVCacheManager.write_outputs` and `OmniKVCacheManager.read_merged` take
one per request, in batch order, with ``hit_block_ids`` and ``hit_block_keys``
left empty: the wrapper fills them in from the hit it recorded at allocation.
"""


class StepListener(Protocol):
    """Hears, synchronously and in scheduling order, what changes a manager's blocks.

    ``on_allocated``: the request was given slots for its tokens ``start ..
    start + len(slots) - 1``, which the next forward pass computes; ``slots``
    are their KV cache slots and ``block_keys`` the keys of the full blocks
    they touch. ``on_cleared``: vLLM handed block ``block_id`` out again or
    dropped its key (None: every block, the prefix cache was reset).
    """

    def on_allocated(
        self,
        request_id: str,
        start: int,
        slots: npt.NDArray[np.int64],
        block_keys: dict[int, BlockHash],
    ) -> None: ...

    def on_cleared(self, block_id: int | None) -> None: ...


@dataclass(slots=True)
class OmniStats:
    """Counters of an `OmniKVCacheManager` since construction."""

    num_lookups: int = 0
    # Blocks of prefix hits adopted by allocations.
    num_hit_blocks: int = 0
    # Blocks vLLM had cached but whose outputs the store lacked: recomputed.
    num_capped_blocks: int = 0
    # Blocks vLLM handed out again or whose key it dropped: stamps cleared.
    num_cleared_blocks: int = 0
    num_commits: int = 0
    num_discards: int = 0


class OmniKVCacheManager:
    """A vLLM ``KVCacheManager`` whose blocks carry stored outputs in a `TensorStore`.

    Drive it as the scheduler drives the manager: ``get_computed_blocks``,
    ``allocate_slots``, ``free`` (every other attribute is the manager's).
    After each forward pass, `write_outputs` stores the step's hidden states
    and per-token multimodal outputs in the request's blocks and
    `read_merged` returns, per request, its hit's stored rows followed by the
    step's rows.

    Args:
        manager: the vLLM manager, with prefix caching enabled.
        store: a store with the manager's number of blocks and block size.
        kv_cache_group_id: the full-attention KV cache group whose block ids
            index the store (None: the first one).
        require_stored_outputs: cap each prefix hit to the leading blocks
            whose outputs the store holds for every registered entry, so that
            a hit always comes with its rows (the rest is recomputed). Free
            blocks found without their outputs lose their key in vLLM, so the
            copies computed instead are found next time. Register entries
            before serving: a new entry is missing from every stored block.

    Raises:
        TypeError, ValueError: a manager or store that does not fit.
    """

    __slots__ = (
        "_aborted_statuses",
        "_block_size",
        "_group",
        "_hook",
        "_listeners",
        "_manager",
        "_requests",
        "_require_stored",
        "_stats",
        "_store",
    )

    def __init__(
        self,
        manager: KVCacheManager,
        store: TensorStore,
        *,
        kv_cache_group_id: int | None = None,
        require_stored_outputs: bool = True,
    ) -> None:
        require_vllm()
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.request import RequestStatus

        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager: expected a KVCacheManager, found {type_name(manager)}")
        if not isinstance(store, TensorStore):
            raise TypeError(f"store: expected a TensorStore, found {type_name(store)}")
        if not manager.enable_caching:
            raise ValueError("manager: expected enable_caching=True, found False")
        group = store_group(manager, kv_cache_group_id)
        pool = manager.block_pool
        if group.block_size != store.block_size:
            raise ValueError(
                f"store: expected block_size {group.block_size} (vLLM's block size in KV cache "
                f"group {group.group_id}, hash block size {pool.hash_block_size}), found "
                f"{store.block_size}"
            )
        if pool.num_gpu_blocks != store.num_blocks:
            raise ValueError(
                f"store: expected {pool.num_gpu_blocks} blocks (vLLM's, null block 0 included), "
                f"found {store.num_blocks}"
            )
        if isinstance(pool.metrics_collector, ReuseHook):
            raise ValueError("manager: expected a manager not wrapped yet, found one wrapped")
        check_bool("require_stored_outputs", require_stored_outputs)
        self._manager = manager
        self._store = store
        self._group = group
        self._block_size = store.block_size
        self._require_stored = require_stored_outputs
        self._requests: dict[str, RequestState] = {}
        self._listeners: list[StepListener] = []
        self._stats = OmniStats()
        self._aborted_statuses = frozenset(
            (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        )
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
            f"OmniKVCacheManager(num_blocks={self._store.num_blocks}, "
            f"block_size={self._block_size}, num_requests={len(self._requests)})"
        )

    @property
    def manager(self) -> KVCacheManager:
        return self._manager

    @property
    def stats(self) -> OmniStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    @property
    def store(self) -> TensorStore:
        return self._store

    def detach(self) -> None:
        """Gives the manager its own metrics collector back and forgets the store's stamps.

        NOTE: once detached, reuses are no longer seen, so no stamp can be
        trusted: all are cleared.
        """
        pool = self._manager.block_pool
        if pool.metrics_collector is not self._hook:
            raise RuntimeError(
                "manager: expected this wrapper's collector installed, found another"
            )
        pool.metrics_collector = self._hook.inner
        self._store.invalidate_all()
        self._requests.clear()

    def add_listener(self, listener: StepListener) -> None:
        """Tells ``listener`` of every allocation and every cleared block from now on."""
        self._listeners.append(listener)

    # -- vLLM's hooks -------------------------------------------------------------

    def _on_block_reused(self, block: Any) -> None:
        key = block.block_hash
        self._store.on_block_evicted(
            block.block_id,
            BlockHash(b"" if key is None else bytes(key[:-_GROUP_ID_BYTES])),
        )
        self._stats.num_cleared_blocks += 1
        for listener in self._listeners:
            listener.on_cleared(block.block_id)

    def _on_reset(self) -> None:
        self._store.invalidate_all()
        for listener in self._listeners:
            listener.on_cleared(None)

    # -- the manager's interface -----------------------------------------------------

    # NOTE: the lookups take ``(request)`` in vLLM 0.32 and ``(request,
    # max_cache_hit_length=None)`` in 0.33: the wrapper passes on exactly what
    # the scheduler gives, so each version's manager checks its own signature.

    def get_computed_blocks(
        self, request: Request, *args: Any, **kwargs: Any
    ) -> tuple[KVCacheBlocks, int, int]:
        """vLLM's lookup, capped to the blocks whose outputs are stored (see the class)."""
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
        if num_hit == 0 or not self._require_stored or not self._store.entries:
            return None
        capped, num_capped = cap_hit(
            self._manager, self._store, self._group, request, blocks, num_hit
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

        The keys of the request's blocks in the store group (``request.block_hashes``
        at that group's block size) stamp the rows `write_outputs` writes.
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
        if (
            num_new_computed_tokens > 0
            and new_computed_blocks is not None
            and request.num_computed_tokens == 0
        ):
            num_blocks = num_new_computed_tokens // self._block_size
            hit = new_computed_blocks.blocks[self._group.group_id][:num_blocks]
            state.hit_block_ids = tuple(block.block_id for block in hit)
            state.hit_block_keys = tuple(state.keys()[:num_blocks])
            state.num_hit_tokens = num_blocks * self._block_size
            self._stats.num_hit_blocks += num_blocks
        if self._listeners and num_new_tokens > 0:
            # NOTE: a new request's computed tokens are set after allocation.
            start = request.num_computed_tokens + num_new_computed_tokens
            start += kwargs.get("num_external_computed_tokens", 0)
            keys: dict[int, BlockHash] = {}
            slots = state.slots(start, num_new_tokens, self._block_size, keys, "allocate_slots")
            for listener in self._listeners:
                listener.on_allocated(request_id, start, slots, keys)
        return new_blocks

    def free(self, request: Request) -> None:
        """Commits the request's deferred outputs (drops them if it was aborted), then frees.

        Raises:
            ValueError: the staged rows do not fit the request's blocks; then
                nothing is committed and nothing is freed.
        """
        self._finish(request)
        self._manager.free(request)

    def pop_blocks_for_free(self, request: Request) -> list[Any]:
        """As `free`, for a scheduler that returns the blocks to the pool later."""
        self._finish(request)
        blocks: list[Any] = self._manager.pop_blocks_for_free(request)
        return blocks

    def _finish(self, request: Request) -> None:
        request_id = request.request_id
        state = self._requests.get(request_id)
        if self._store.has_staged(request_id):
            if request.status in self._aborted_statuses:
                self._store.discard(request_id)
                self._stats.num_discards += 1
            else:
                if state is None:
                    raise RuntimeError(
                        f"request {request_id!r}: staged outputs but no blocks recorded"
                    )
                block_ids = [block.block_id for block in state.blocks]
                self._store.commit(request_id, block_ids, state.keys()[: len(block_ids)])
                self._stats.num_commits += 1
        self._requests.pop(request_id, None)

    # -- outputs ----------------------------------------------------------------------

    def num_hit_tokens(self, request_id: str) -> int:
        """Tokens of the prefix hit the request adopted (0: none)."""
        return self._state(request_id, "request_id").num_hit_tokens

    def request_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in vLLM's group, first block first."""
        return [block.block_id for block in self._state(request_id, "request_id").blocks]

    def hit_blocks(self, request_id: str) -> tuple[tuple[int, ...], tuple[BlockHash, ...]]:
        """The request's hit blocks and their keys, first block first (empty: no hit)."""
        state = self._state(request_id, "request_id")
        return state.hit_block_ids, state.hit_block_keys

    def request_block_keys(self, request_id: str) -> dict[int, BlockHash]:
        """Block id -> key of each of the request's full blocks: the stamps its rows get."""
        state = self._state(request_id, "request_id")
        return {block.block_id: key for block, key in zip(state.blocks, state.keys(), strict=False)}

    def hit_outputs(
        self, request_id: str, names: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """The stored rows of the request's hit blocks, by entry.

        Raises:
            StaleBlockError: a hit block no longer holds its key (an eviction
                through ``evict_blocks`` while the request held it).
        """
        state = self._state(request_id, "request_id")
        entries = self._store.entries if names is None else names
        return {
            name: self._store.read_blocks(name, state.hit_block_ids, state.hit_block_keys)
            for name in entries
        }

    def write_outputs(
        self,
        step: Sequence[ScheduledRequest],
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        num_tokens_padded: int | None = None,
    ) -> dict[str, WriteResult]:
        """Stores one step's outputs in the blocks of its requests.

        Each block a write completes is stamped with the request's key for it;
        rows of deferred entries are staged until the request is freed.

        Args:
            step: the step's requests in batch order, their hit fields empty.
            hidden_states: ``(>= total new tokens, hidden)`` rows.
            multimodal_outputs: per-token outputs by name (see
                `TensorStore.write_step` for what is cached).
            num_tokens_padded: rows the model produced, padding included.

        Returns:
            The result of each entry written directly, by name.

        Raises:
            ValueError, TypeError, IndexError: bad input (a request given with
                a hit is a ValueError); nothing is written or staged.
        """
        slot_mapping, block_keys, scheduled = self._plan(step, with_hits=False)
        return self._store.write_step(
            scheduled,
            slot_mapping,
            hidden_states=hidden_states,
            multimodal_outputs=multimodal_outputs,
            block_keys=block_keys,
            num_tokens_padded=num_tokens_padded,
        )

    def read_merged(
        self,
        step: Sequence[ScheduledRequest],
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
        strict: bool = False,
    ) -> MergedRead:
        """Per request, its hit's stored rows followed by the step's rows.

        The step's requests come as in `write_outputs`, their hit fields
        empty. A request's hit rows are included in the step that starts right
        after its hit (``num_computed_tokens == num_hit_tokens``); other steps
        get their own rows. See `TensorStore.read_merged` for ``out`` and
        ``strict``; a hit block that no longer holds its key makes the request
        a miss, never a stale read.
        """
        _, _, scheduled = self._plan(step, with_hits=True)
        return self._store.read_merged(
            scheduled,
            hidden_states=hidden_states,
            multimodal_outputs=multimodal_outputs,
            out=out,
            strict=strict,
        )

    def _state(self, request_id: str, what: str) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(
                f"{what}: expected a request with allocated blocks, found {request_id!r} "
                f"({len(self._requests)} requests allocated)"
            )
        return state

    def _plan(
        self, step: Sequence[ScheduledRequest], *, with_hits: bool
    ) -> tuple[npt.NDArray[np.int64], dict[int, BlockHash], list[ScheduledRequest]]:
        """Slots of the step's rows, the keys of the blocks they touch, and the store's view."""
        parts: list[npt.NDArray[np.int64]] = []
        block_keys: dict[int, BlockHash] = {}
        scheduled: list[ScheduledRequest] = []
        seen: set[str] = set()
        for index, item in enumerate(step):
            where = f"step[{index}]"
            if not isinstance(item, ScheduledRequest):
                raise TypeError(f"{where}: expected ScheduledRequest, found {type_name(item)}")
            check_str(f"{where}.req_id", item.req_id)
            state = self._state(item.req_id, f"{where}.req_id")
            if item.req_id in seen:
                raise ValueError(f"{where}: request {item.req_id!r} listed twice")
            seen.add(item.req_id)
            num_new = check_int(f"{where}.num_new_tokens", item.num_new_tokens, minimum=0)
            start = check_int(f"{where}.num_computed_tokens", item.num_computed_tokens, minimum=0)
            check_no_hit(item, where)
            if num_new:
                parts.append(state.slots(start, num_new, self._block_size, block_keys, where))
            if with_hits and state.num_hit_tokens and start == state.num_hit_tokens:
                scheduled.append(
                    item._replace(
                        hit_block_ids=state.hit_block_ids, hit_block_keys=state.hit_block_keys
                    )
                )
            else:
                scheduled.append(item)
        slots = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return slots, block_keys, scheduled
