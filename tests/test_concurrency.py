"""Concurrent use from threads, as docs/concurrency.md describes it.

- The content hashing functions, `annotate_prompt` and a shared `BlockHasher`
  are reentrant: many threads hashing the same items get exactly the digests
  and keys of a serial run.
- `AnnotatedTokens` is the one class that claims safety under concurrent
  mutation-like use: appends share a buffer, and a lock makes "is this view
  the whole buffer? then append in place" one step. Threads appending to the
  same view at once each get their own sequence, and no view changes.
- `BlockPool`, `PrefixCache` and `TensorStore` are not thread-safe; the
  documented recipe (one lock around every call on a pool and everything
  attached to it) keeps them consistent under concurrent requests.

The thread switch interval is lowered while these tests run so that threads
interleave every few bytecodes, not every 5 ms.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sized
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from PIL import Image

import omnicache.annotations as annotations_module
from hashing import (
    ALGORITHMS,
    hash_array,
    hash_audio,
    hash_bytes,
    hash_identifier,
    hash_image,
    hash_video,
)
from omnicache.annotations import AnnotatedTokens
from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.preprocess import annotate_prompt
from omnicache.reference.block_pool import BlockPool
from omnicache.reference.prefix_cache import PrefixCache
from omnicache.store import TensorStore

NUM_THREADS = 8
IMAGE_TOKEN = 9_000
T = TypeVar("T")

RNG = np.random.default_rng(99)
# 1.5 MiB of pixels: large enough for blake3 to hash on its own threads too.
LARGE = Image.fromarray(RNG.integers(0, 256, (512, 1024, 3), dtype=np.uint8))
SMALL = Image.fromarray(RNG.integers(0, 256, (9, 7, 3), dtype=np.uint8))
PALETTE = Image.fromarray(RNG.integers(0, 4, (5, 6), dtype=np.uint8), mode="L").convert("P")
WAVE = RNG.standard_normal((2, 4000)).astype(np.float32)
FRAMES = RNG.integers(0, 256, (4, 6, 5, 3), dtype=np.uint8)
FLOATS = torch.from_numpy(RNG.standard_normal((33, 17))).to(torch.bfloat16)


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def in_threads(work: Callable[[int], T], num_threads: int = NUM_THREADS) -> list[T]:
    """``work(i)`` on ``num_threads`` threads that start together."""
    barrier = threading.Barrier(num_threads)

    def run(index: int) -> T:
        barrier.wait()
        return work(index)

    with ThreadPoolExecutor(num_threads) as pool:
        return list(pool.map(run, range(num_threads)))


def content_jobs(algorithm: Any) -> list[Callable[[], bytes]]:
    return [
        lambda: hash_image(LARGE, algorithm=algorithm),
        lambda: hash_image(SMALL, algorithm=algorithm, context={"model": "m", "px": [1, 2]}),
        lambda: hash_image(PALETTE, algorithm=algorithm),
        lambda: hash_audio(WAVE, 16_000, algorithm=algorithm),
        lambda: hash_video(FRAMES, fps=4.0, algorithm=algorithm),
        lambda: hash_array(FLOATS, algorithm=algorithm),
        lambda: hash_array(WAVE[:, ::3], algorithm=algorithm),
        lambda: hash_bytes(WAVE.tobytes(), modality="audio", algorithm=algorithm),
        lambda: hash_identifier("photo-1", namespace="tenant-a", algorithm=algorithm),
    ]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_content_digests_are_reentrant(algorithm: Any) -> None:
    jobs = content_jobs(algorithm)
    serial = [job() for job in jobs]

    def work(index: int) -> list[tuple[int, bytes]]:
        order = list(range(len(jobs))) * 3
        random.Random(index).shuffle(order)
        return [(k, jobs[k]()) for k in order]

    for results in in_threads(work):
        assert len(results) == 3 * len(jobs)
        for k, digest in results:
            assert digest == serial[k]


def test_annotate_prompt_and_a_shared_block_hasher_are_reentrant() -> None:
    tokens = [1, 2] + [IMAGE_TOKEN] * 20 + [3] + [IMAGE_TOKEN] * 9 + [4] * 30
    tokens += [IMAGE_TOKEN] * 7 + [5]
    items: list[object] = [SMALL, (WAVE, 16_000), "photo-1"]
    hashers = [
        BlockHasher(4, algorithm=algorithm, cache_salt="s", adapter="a") for algorithm in ALGORITHMS
    ]

    def keys_of(prompt: AnnotatedTokens) -> list[list[BlockHash]]:
        out = [hasher.hash_blocks(prompt) for hasher in hashers]
        # Decode-style keying from the same shared hashers.
        for hasher, full in zip(hashers, out, strict=True):
            done = hasher.hash_blocks(prompt[:8])
            for stop in range(11, len(prompt) + 1, 3):
                done = done + hasher.hash_new_blocks(prompt[:stop], done)
            assert done == full[: len(done)]
        return out

    serial_prompt = annotate_prompt(tokens, items, placeholder_token_id=IMAGE_TOKEN)
    serial = keys_of(serial_prompt)

    def work(index: int) -> tuple[AnnotatedTokens, list[list[BlockHash]]]:
        prompt = annotate_prompt(tokens, items, placeholder_token_id=IMAGE_TOKEN)
        return prompt, keys_of(prompt)

    for prompt, keys in in_threads(work):
        assert prompt == serial_prompt
        assert keys == serial


def test_a_request_block_hasher_shared_by_threads_keeps_its_roots_consistent() -> None:
    """vLLM 0.33 keys requests on its input thread and new tokens on the scheduler's."""
    from omnicache.integrations.vllm import RequestBlockHasher

    shared = RequestBlockHasher(4, namespace="m", max_roots=8)
    salts = [f"tenant-{i}" for i in range(24)]  # three times the roots kept
    tokens = AnnotatedTokens(list(range(1, 33)), [])
    serial = {
        salt: BlockHasher(4, namespace="m", cache_salt=salt).hash_blocks(tokens) for salt in salts
    }

    def work(index: int) -> list[tuple[str, list[BlockHash]]]:
        order = salts * 4
        random.Random(index).shuffle(order)
        return [(salt, shared.hasher_for(salt, None).hash_blocks(tokens)) for salt in order]

    for results in in_threads(work):
        assert len(results) == 4 * len(salts)
        for salt, keys in results:
            assert keys == serial[salt]


def test_threads_appending_to_one_view_each_get_their_own_sequence() -> None:
    """The claim of annotations.py: concurrent appends never share a buffer slot."""
    base = annotate_prompt(
        [7] * 5 + [IMAGE_TOKEN] * 6 + [8] * 5, ["x"], placeholder_token_id=IMAGE_TOKEN
    )
    base_ids = base.tolist()
    hasher = BlockHasher(4)
    rounds = 300

    def work(index: int) -> tuple[list[AnnotatedTokens], list[list[int]], list[BlockHash]]:
        views: list[AnnotatedTokens] = []
        expected: list[list[int]] = []
        tokens = base
        ids = list(base_ids)
        keys = hasher.hash_blocks(tokens)
        for step in range(rounds):
            # Every thread appends to ``base`` itself now and then, to the
            # newest view of its own otherwise, and to an older one sometimes.
            choice = step % 10
            if choice == 0:
                tokens, ids, keys = base, list(base_ids), hasher.hash_blocks(base)
            elif choice == 7 and views:
                tokens, ids = views[len(views) // 2], list(expected[len(expected) // 2])
                keys = hasher.hash_blocks(tokens)
            new = [index * 10_000 + step, index]
            tokens = tokens + new if step % 2 else tokens.extend(new)
            ids = ids + new
            keys = keys + hasher.hash_new_blocks(tokens, keys)
            views.append(tokens)
            expected.append(ids)
        return views, expected, keys

    results = in_threads(work)
    assert base.tolist() == base_ids
    for views, expected, keys in results:
        for view, ids in zip(views, expected, strict=True):
            assert view.tolist() == ids
            assert view.annotations == base.annotations
        assert keys == hasher.hash_blocks(AnnotatedTokens(views[-1], views[-1].annotations))


def test_threads_racing_to_extend_the_longest_view_never_share_an_append(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every round all threads append to the same view, the one whose buffer the
    previous round extended in place: exactly the race the append lock closes.

    The module's ``len`` yields the interpreter to other threads, so that a thread
    is preempted between "is this view the whole buffer?" and the append whenever
    it can be: without the lock, two threads would append to one buffer.
    """

    def yielding_len(obj: Sized) -> int:
        size = len(obj)
        time.sleep(0)
        return size

    monkeypatch.setattr(annotations_module, "len", yielding_len, raising=False)
    rounds = 200
    current = [AnnotatedTokens(list(range(6)), ())]
    expected_ids = [list(range(6))]
    results: list[AnnotatedTokens | None] = [None] * NUM_THREADS

    def next_round() -> None:
        # The first thread's result becomes the shared view of the next round.
        first = results[0]
        assert first is not None
        current[0] = first
        expected_ids[0] = expected_ids[0] + [0, len(expected_ids[0])]

    barrier = threading.Barrier(NUM_THREADS, action=next_round)

    def work(index: int) -> list[str]:
        errors: list[str] = []
        for _ in range(rounds):
            view, ids = current[0], expected_ids[0]
            new = [index, len(ids)]
            result = view.extend(new)
            results[index] = result
            if result.tolist() != ids + new:
                errors.append(f"thread {index}: {result.tolist()[-4:]} != {(ids + new)[-4:]}")
            if view.tolist() != ids:
                errors.append(f"thread {index}: the shared view changed")
            barrier.wait()
        return errors

    assert in_threads(work) == [[]] * NUM_THREADS
    assert len(current[0]) == 6 + 2 * rounds


def test_pool_cache_and_store_under_one_lock_stay_consistent() -> None:
    """The documented recipe: one lock around every call on a pool and what hangs on it."""
    block_size = 4
    pool = BlockPool(64, block_size)
    store = TensorStore(64, block_size)
    store.register("h", 2, torch.float32)
    store.attach(pool)
    tenants = [PrefixCache(pool, BlockHasher(block_size, cache_salt=f"t{i % 2}")) for i in range(2)]
    lock = threading.Lock()
    prompts = [list(range(n, n + 9 + n % 7)) for n in range(6)]

    def work(index: int) -> int:
        cache = tenants[index % 2]
        rng = random.Random(index)
        hits = 0
        for step in range(60):
            request_id = f"{index}-{step}"
            prompt = AnnotatedTokens(rng.choice(prompts))
            with lock:
                admitted = cache.add_request(request_id, prompt)
            if admitted is None:
                continue
            hits += admitted.num_cached_tokens
            rows = torch.full((len(prompt), 2), float(index))
            slots = [
                admitted.block_ids[i // block_size] * block_size + i % block_size
                for i in range(len(prompt))
            ]
            with lock:
                keys = cache.block_hashes(request_id)
                store.write(
                    "h",
                    rows[admitted.num_cached_tokens :],
                    slots[admitted.num_cached_tokens :],
                    block_keys=dict(zip(admitted.block_ids, keys, strict=False)),
                )
                cache.mark_computed(request_id, len(prompt))
                cache.free(request_id)
        return hits

    hits = in_threads(work)
    assert sum(hits) > 0
    assert pool.num_free_blocks == 64
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert {k: b.block_id for k, b in pool.hash_to_block.items()} == {
        b.block_hash: b.block_id for b in pool.blocks if b.block_hash is not None
    }
    assert sorted(b.block_id for b in pool.free_block_queue) == list(range(64))
    for key, block in pool.hash_to_block.items():
        stamp = store.stamp_of("h", block.block_id)
        assert stamp in (None, key)
