"""The reference integration: how a serving engine drives omnicache.

`ServingEngine` is the worked example of wiring the library into an engine;
read it before wiring omnicache into another one. It serves requests one at
a time and shows every step an engine owes the cache:

- one `BlockPool` shared by every tenant, and per (tenant, salt) a
  `BlockHasher` and a `PrefixCache` over it (`ServingEngine.prefix_cache`),
  so tenants compete for room but never share a chain;
- one `TensorStore` attached to the pool's evictions, with an entry per
  layer's keys and values (``layer{i}.k``, ``layer{i}.v``) beside the final
  hidden states (``hidden_states``);
- admission (`PrefixCache.add_request`), then the hit blocks' K/V read back
  with a stamped read (`TensorStore.read_merged`): a block whose stamp no
  longer matches its key is a miss, counted and recomputed, never served;
- only the suffix computed, attending over the cached K/V, and its rows
  written with the keys of the new full blocks (`TensorStore.write_outputs`),
  then `PrefixCache.mark_computed` and `PrefixCache.free`;
- with a tier (a `BlockTier`, such as a `RedisTier` that other engine
  processes share), the blocks after a local hit looked up there first
  (`TensorStore.read_through`) and served as hits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from omnicache.annotations import AnnotatedTokens
from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.demo.config import CacheConfig
from omnicache.demo.model import TinyOmniModel
from omnicache.demo.processor import Processor, TokenizedPrompt
from omnicache.demo.workloads import TraceRequest
from omnicache.reference import BlockPool, PrefixCache
from omnicache.store import BlockTier, ScheduledRequest, TensorStore

__all__ = ["Served", "ServingEngine"]


def salt_of(cache_config: CacheConfig, request: TraceRequest) -> str:
    """The cache salt of the request's chain: deployment salt, tenant and request salt."""
    # NOTE: the tenant is part of the salt, so two tenants never share a
    # chain even when their own salts are equal or missing. JSON of a list
    # is injective over (deployment salt, tenant, request salt).
    return json.dumps([cache_config.salt, request.tenant, request.cache_salt])


class Served(NamedTuple):
    """One request served with the cache."""

    hidden_states: torch.Tensor
    logits: torch.Tensor
    num_tokens: int
    num_hit_tokens: int
    # Prompt tokens the model computed (the whole prompt after a stale read).
    num_computed_tokens: int
    num_items_encoded: int
    stale: bool
    # Hit tokens whose blocks came from the tier (a part of num_hit_tokens).
    num_tier_hit_tokens: int = 0


class ServingEngine:
    """Serves requests one at a time with per-block K/V and hidden states cached.

    One `BlockPool` and one `TensorStore` (attached to the pool's evictions)
    are shared by every tenant; each (tenant, salt) gets its own
    `BlockHasher` and `PrefixCache` over that pool, so tenants compete for
    room but never share a block.

    With a ``tier`` (a `BlockTier`, such as a `RedisTier` that other engine
    processes share), every block the store stamps is offered to it, and the
    blocks that follow a local hit are looked up there before they are
    computed: what the tier holds is filled in and served as a hit.
    """

    def __init__(
        self,
        model: TinyOmniModel,
        processor: Processor,
        cache_config: CacheConfig,
        *,
        tier: BlockTier | None = None,
    ) -> None:
        self.model = model
        self.processor = processor
        self.cache_config = cache_config
        cfg = model.config
        self.pool = BlockPool(cache_config.num_blocks, cache_config.block_size)
        self.store = TensorStore(
            cache_config.num_blocks,
            cache_config.block_size,
            hidden_size=cfg.hidden_size,
            hidden_dtype=torch.float32,
            tier=tier,
        )
        self.kv_names = [
            name for i in range(cfg.num_layers) for name in (f"layer{i}.k", f"layer{i}.v")
        ]
        for name in self.kv_names:
            self.store.register(name, cfg.hidden_size, torch.float32)
        self.store.attach(self.pool)
        self._no_rows = torch.empty(0, cfg.hidden_size)
        self._caches: dict[str, PrefixCache] = {}

    def prefix_cache(self, request: TraceRequest) -> PrefixCache:
        """The request's (tenant, salt) facade over the shared pool."""
        salt = salt_of(self.cache_config, request)
        cache = self._caches.get(salt)
        if cache is None:
            hasher = BlockHasher(
                self.cache_config.block_size,
                algorithm=self.cache_config.block_algorithm,
                namespace=self.model.config.namespace,
                cache_salt=salt,
            )
            cache = self._caches[salt] = PrefixCache(self.pool, hasher)
        return cache

    def block_hashes(self, request: TraceRequest, prompt: AnnotatedTokens) -> list[BlockHash]:
        """Keys of the prompt's full blocks in the request's chain."""
        return self.prefix_cache(request).block_hasher.hash_blocks(prompt)

    def serve(self, request: TraceRequest) -> Served:
        """Prefill one prompt: cached prefix from the store, the rest computed and stored."""
        tokenized = self.processor.tokenize(request.messages)
        prompt = self.processor.annotate(tokenized)
        cache = self.prefix_cache(request)
        rid = request.request_id
        admitted = cache.add_request(rid, prompt)
        if admitted is None:
            raise RuntimeError(
                f"request {rid!r}: {len(prompt)} tokens do not fit in "
                f"{self.pool.num_free_blocks} free blocks with no request running"
            )
        try:
            num_hit = admitted.num_cached_tokens
            num_tier = self._read_through(cache, rid, admitted.block_ids, num_hit, len(prompt))
            served = self._prefill(cache, rid, tokenized, admitted.block_ids, num_hit + num_tier)
            return served._replace(num_tier_hit_tokens=num_tier)
        finally:
            cache.free(rid)

    def _read_through(
        self,
        cache: PrefixCache,
        rid: str,
        block_ids: Sequence[int],
        num_hit: int,
        num_tokens: int,
    ) -> int:
        """Fills the blocks after the local hit from the tier; returns the tokens filled.

        The hit stays capped at ``num_tokens - 1`` tokens in whole blocks (the
        last prompt token is always computed), as for a local hit.
        """
        if self.store.tier is None:
            return 0
        bs = self.cache_config.block_size
        first = num_hit // bs
        last = (num_tokens - 1) // bs
        if last <= first:
            return 0
        keys = cache.block_hashes(rid)[first:last]
        num_found = self.store.read_through(block_ids[first:last], keys)
        if num_found:
            # NOTE: registered like computed blocks, so later requests hit
            # them locally and the pool's evictions clear their stamps.
            cache.mark_computed(rid, (first + num_found) * bs)
        return num_found * bs

    def _prefill(
        self,
        cache: PrefixCache,
        rid: str,
        tokenized: TokenizedPrompt,
        block_ids: Sequence[int],
        num_hit: int,
    ) -> Served:
        model, store = self.model, self.store
        bs = self.cache_config.block_size
        num_tokens = len(tokenized.token_ids)
        keys = cache.block_hashes(rid)
        num_hit_blocks = num_hit // bs
        hit_ids = list(block_ids[:num_hit_blocks])
        hit_keys = keys[:num_hit_blocks]
        start = num_hit
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        stale = False
        if num_hit_blocks:
            read = store.read_merged(
                [ScheduledRequest(rid, 0, num_hit, hit_ids, hit_keys)],
                multimodal_outputs={name: self._no_rows for name in self.kv_names},
            )
            if read.misses:
                # NOTE: never served: the prompt is recomputed from its start,
                # and the hit blocks (shared with others) are not written.
                stale = True
                start = 0
            else:
                rows = read.tensors
                past = [
                    (rows[f"layer{i}.k"][rid], rows[f"layer{i}.v"][rid])
                    for i in range(model.config.num_layers)
                ]
        embeds, num_encoded = model.embed(tokenized, start)
        out = model.forward(embeds, start, past)
        new = slice(num_hit - start, None)
        if stale:
            hidden = out.hidden_states
        else:
            merged = store.read_merged(
                [ScheduledRequest(rid, num_tokens - num_hit, num_hit, hit_ids, hit_keys)],
                hidden_states=out.hidden_states[new],
            )
            if merged.misses:
                raise RuntimeError(
                    f"request {rid!r}: hit blocks lost their stamps while the request held them"
                )
            hidden = merged.hidden_states[rid]
        positions = np.arange(num_hit, num_tokens)
        ids = np.asarray(block_ids, dtype=np.int64)
        slots = ids[positions // bs] * bs + positions % bs
        # Stamp the new full blocks, except one whose key another block already
        # holds (a fully cached, block-aligned prompt recomputes its last
        # block): the pool keeps that key on the other block.
        block_keys = {
            block_ids[b]: keys[b]
            for b in range(num_hit_blocks, num_tokens // bs)
            if self.pool.get_cached_block(keys[b]) is None
        }
        outputs: dict[str, object] = {}
        for i in range(model.config.num_layers):
            # NOTE: keys and values are column slices of the fused QKV product;
            # the store copies rows by viewing them, which needs them packed.
            outputs[f"layer{i}.k"] = out.keys[i][new].contiguous()
            outputs[f"layer{i}.v"] = out.values[i][new].contiguous()
        store.write_outputs(
            slots, hidden_states=out.hidden_states[new], multimodal_outputs=outputs,
            block_keys=block_keys,
        )  # fmt: skip
        cache.mark_computed(rid, num_tokens)
        return Served(
            hidden_states=hidden,
            logits=out.logits,
            num_tokens=num_tokens,
            num_hit_tokens=num_hit,
            num_computed_tokens=num_tokens - start,
            num_items_encoded=num_encoded,
            stale=stale,
        )
