"""Per-request prefix caching on top of a `BlockPool` and a `BlockHasher`.

`PrefixCache` is what a scheduler talks to. It keeps, per request id, the
request's tokens (an `AnnotatedTokens`, so images and audio are part of the
keys), the keys of its full blocks and the blocks it holds, and drives the pool
through a request's life::

    add_request(id, prompt)     keys the prompt, takes the longest cached prefix
                                (touching those blocks) and allocates the rest
    mark_computed(id, n)        registers the full blocks among the first n
                                tokens once their data exists (prefill chunks,
                                then decode steps)
    append_tokens(id, tokens)   decode: keys only the blocks the new tokens
                                complete, allocates blocks for them
    free(id)                    finish or abort: blocks go back last block first

NOTE: a hit never covers the last prompt token, whose logits the model must
compute: at most ``len(prompt) - 1`` tokens, rounded down to whole blocks, so a
block-aligned prompt that is fully cached recomputes its last block.

Blocks are registered when computed, not when allocated, so a concurrent
request never hits a block whose data is still being written. Two requests
that compute the same block at the same time both hold a copy; the first one
registered keeps the key (see `BlockPool.cache_full_blocks`), so
``block_hashes(id)[i]`` is what block ``block_ids(id)[i]`` would be keyed by,
and ``BlockPool.get_block_hash`` says whether it actually is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from omnicache.annotations import AnnotatedTokens
from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.checks import check_int, type_name
from omnicache.reference.block_pool import BlockPool, CacheBlock, PoolEvent

__all__ = ["PrefixCache", "PrefixCacheStats", "RequestBlocks"]


class RequestBlocks(NamedTuple):
    """What `PrefixCache.add_request` found and allocated for a prompt."""

    # Every block of the request, first block first: the cached prefix, then
    # the blocks for the tokens to compute.
    block_ids: tuple[int, ...]
    # Prompt tokens whose data is cached (a multiple of the block size).
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters since the cache was created."""

    # Prompts admitted by ``add_request`` (a prompt refused for lack of room
    # is not counted: it is asked again later).
    num_queries: int
    # Their tokens, and the tokens served from cache.
    num_query_tokens: int
    num_hit_tokens: int
    # ``num_hit_tokens / num_query_tokens`` (0.0 before the first query).
    hit_rate: float
    # Keys lost because their blocks were reused.
    num_evictions: int
    # Fraction of the pool's blocks in use.
    usage: float


@dataclass(slots=True, eq=False)
class _Request:
    tokens: AnnotatedTokens
    blocks: list[CacheBlock]
    # Keys of the full blocks of ``tokens``, computed or not.
    block_hashes: list[BlockHash]
    # Leading blocks that are registered in the pool (or were hits).
    num_cached_blocks: int
    num_computed_tokens: int


class PrefixCache:
    """Request-level prefix caching: lookup, allocation, registration, free.

    Args:
        block_pool: The pool to allocate from; its block size must be the
            hasher's.
        block_hasher: Computes the chained keys of full blocks.
    """

    def __init__(self, block_pool: BlockPool, block_hasher: BlockHasher) -> None:
        if not isinstance(block_pool, BlockPool):
            raise TypeError(f"block_pool: expected BlockPool, found {type_name(block_pool)}")
        if not isinstance(block_hasher, BlockHasher):
            raise TypeError(f"block_hasher: expected BlockHasher, found {type_name(block_hasher)}")
        if block_pool.block_size != block_hasher.block_size:
            raise ValueError(
                f"block_hasher.block_size: expected {block_pool.block_size} "
                f"(block_pool.block_size), found {block_hasher.block_size}"
            )
        self.block_pool = block_pool
        self.block_hasher = block_hasher
        self.block_size = block_pool.block_size
        self._requests: dict[str, _Request] = {}
        self._num_queries = 0
        self._num_query_tokens = 0
        self._num_hit_tokens = 0

    @classmethod
    def create(
        cls, num_blocks: int, block_hasher: BlockHasher, *, enable_events: bool = True
    ) -> PrefixCache:
        """A cache over a new pool of ``num_blocks`` blocks of the hasher's size."""
        return cls(
            BlockPool(num_blocks, block_hasher.block_size, enable_events=enable_events),
            block_hasher,
        )

    # -- request life ---------------------------------------------------------

    def add_request(self, request_id: str, prompt: AnnotatedTokens) -> RequestBlocks | None:
        """Takes the longest cached prefix of ``prompt`` and allocates the rest.

        Args:
            request_id: A new request id.
            prompt: The prompt, at least one token.

        Returns:
            The request's blocks and how many prompt tokens they already hold;
            None when the pool cannot hold the uncached part now (nothing
            changes and the query is not counted: ask again after a free).
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: expected str, found {type_name(request_id)}")
        if request_id in self._requests:
            raise ValueError(f"request_id: expected a new request id, found {request_id!r} active")
        if not isinstance(prompt, AnnotatedTokens):
            raise TypeError(f"prompt: expected AnnotatedTokens, found {type_name(prompt)}")
        num_tokens = len(prompt)
        if num_tokens == 0:
            raise ValueError("prompt: expected at least 1 token, found 0")

        block_size = self.block_size
        pool = self.block_pool
        block_hashes = self.block_hasher.hash_blocks(prompt)
        hit = pool.find_longest_cache_hit(block_hashes, (num_tokens - 1) // block_size)
        num_new_blocks = -(-num_tokens // block_size) - len(hit)
        # NOTE: touching a free hit block takes it out of the free queue, so
        # the room left for new blocks shrinks by those blocks.
        num_hit_free = sum(1 for block in hit if block.ref_cnt == 0)
        if num_new_blocks > pool.num_free_blocks - num_hit_free:
            return None
        pool.touch(hit)
        new_blocks = pool.allocate(num_new_blocks)
        if new_blocks is None:
            raise RuntimeError(
                f"pool refused {num_new_blocks} blocks with "
                f"{pool.num_free_blocks} free after touching the hit"
            )
        num_cached_tokens = len(hit) * block_size
        blocks = hit + new_blocks
        self._requests[request_id] = _Request(
            tokens=prompt,
            blocks=blocks,
            block_hashes=block_hashes,
            num_cached_blocks=len(hit),
            num_computed_tokens=num_cached_tokens,
        )
        self._num_queries += 1
        self._num_query_tokens += num_tokens
        self._num_hit_tokens += num_cached_tokens
        return RequestBlocks(tuple(block.block_id for block in blocks), num_cached_tokens)

    def mark_computed(self, request_id: str, num_computed_tokens: int) -> int:
        """Registers the full blocks among the first ``num_computed_tokens`` tokens.

        Call it after each step that computed data for the request (a prefill
        chunk, a decode step); the data of those tokens must be in place,
        since another request may hit the blocks right away.

        Args:
            request_id: An active request.
            num_computed_tokens: Tokens whose data exists, from the previous
                value up to the request's length.

        Returns:
            The number of keys that entered the pool's table.
        """
        request = self._get(request_id)
        check_int("num_computed_tokens", num_computed_tokens)
        if not request.num_computed_tokens <= num_computed_tokens <= len(request.tokens):
            raise ValueError(
                f"num_computed_tokens: expected {request.num_computed_tokens}.."
                f"{len(request.tokens)} for request {request_id!r}, found {num_computed_tokens}"
            )
        num_full_blocks = num_computed_tokens // self.block_size
        num_stored = self.block_pool.cache_full_blocks(
            request.blocks, request.block_hashes, request.num_cached_blocks, num_full_blocks
        )
        request.num_cached_blocks = num_full_blocks
        request.num_computed_tokens = num_computed_tokens
        return num_stored

    def append_tokens(self, request_id: str, token_ids: Iterable[int]) -> list[int] | None:
        """Appends decoded tokens, keying only the blocks they complete.

        Args:
            request_id: An active request.
            token_ids: The new token ids (no annotations: model output).

        Returns:
            The ids of the blocks allocated to hold the new tokens (often
            none), or None when the pool has no room; the request is then
            unchanged.
        """
        request = self._get(request_id)
        tokens = request.tokens.extend(token_ids)
        new_hashes = self.block_hasher.hash_new_blocks(tokens, request.block_hashes)
        num_new_blocks = -(-len(tokens) // self.block_size) - len(request.blocks)
        new_blocks: list[CacheBlock] = []
        if num_new_blocks > 0:
            allocated = self.block_pool.allocate(num_new_blocks)
            if allocated is None:
                return None
            new_blocks = allocated
        request.tokens = tokens
        request.block_hashes.extend(new_hashes)
        request.blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free(self, request_id: str) -> None:
        """Releases a finished or aborted request's blocks, last block first.

        Its registered blocks stay cached until the pool reuses them, the
        tail of its chain first.

        Raises:
            ValueError: ``request_id`` is not active (also when freed twice).
            RuntimeError: The pool saw a block freed more often than taken;
                the pool and the request are unchanged.
        """
        request = self._get(request_id)
        self.block_pool.free(request.blocks[::-1])
        del self._requests[request_id]

    # -- views ----------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, first block first."""
        return [block.block_id for block in self._get(request_id).blocks]

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        """The keys of the request's full blocks, first block first."""
        return list(self._get(request_id).block_hashes)

    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens of the request whose data exists (cached or computed)."""
        return self._get(request_id).num_computed_tokens

    def num_tokens(self, request_id: str) -> int:
        """Tokens of the request: its prompt and the appended tokens."""
        return len(self._get(request_id).tokens)

    @property
    def num_requests(self) -> int:
        """Active requests."""
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def stats(self) -> PrefixCacheStats:
        """A snapshot of the counters."""
        num_query_tokens = self._num_query_tokens
        return PrefixCacheStats(
            num_queries=self._num_queries,
            num_query_tokens=num_query_tokens,
            num_hit_tokens=self._num_hit_tokens,
            hit_rate=self._num_hit_tokens / num_query_tokens if num_query_tokens else 0.0,
            num_evictions=self.block_pool.num_evictions,
            usage=self.block_pool.usage,
        )

    def take_events(self) -> list[PoolEvent]:
        """The pool's queued events, oldest first; the queue is emptied."""
        return self.block_pool.take_events()

    def reset(self) -> bool:
        """Drops every cached key; False, with nothing changed, while requests are active."""
        if self._requests:
            return False
        return self.block_pool.reset()

    def _get(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"request_id: expected an active request, found {request_id!r}")
        return request
