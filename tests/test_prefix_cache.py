"""PrefixCache: hits and misses with images and audio, decode, eviction, errors."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from hashing import ContentHash, hash_audio, hash_image
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.reference.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from omnicache.reference.prefix_cache import PrefixCache, PrefixCacheStats, RequestBlocks

BLOCK_SIZE = 4
IMAGE_TOKEN = 32_000
AUDIO_TOKEN = 32_001

RED = hash_image(Image.new("RGB", (16, 16), (255, 0, 0)))
BLUE = hash_image(Image.new("RGB", (16, 16), (0, 0, 255)))
_WAVE = np.sin(np.linspace(0, 40, 1600)).astype(np.float32)
TONE_16K = hash_audio(_WAVE, 16_000)
TONE_8K = hash_audio(_WAVE, 8_000)

Item = tuple[ContentHash, int, int, int]  # digest, placeholder id, tokens, run length


def prompt(*parts: list[int] | Item) -> AnnotatedTokens:
    """Text runs (lists of ids) and items (digest, placeholder, count, length)."""
    token_ids: list[int] = []
    annotations: list[TokenRangeAnnotation] = []
    for part in parts:
        if isinstance(part, list):
            token_ids.extend(part)
            continue
        digest, placeholder, count, length = part
        annotations.append(TokenRangeAnnotation(len(token_ids), count, digest, 0, length))
        token_ids.extend([placeholder] * count)
    return AnnotatedTokens(token_ids, annotations)


def image(digest: ContentHash, count: int = 8, length: int | None = None) -> Item:
    return (digest, IMAGE_TOKEN, count, count if length is None else length)


def audio(digest: ContentHash, count: int = 6) -> Item:
    return (digest, AUDIO_TOKEN, count, count)


def new_cache(num_blocks: int = 16) -> PrefixCache:
    return PrefixCache(BlockPool(num_blocks, BLOCK_SIZE), BlockHasher(BLOCK_SIZE))


def run_prompt(cache: PrefixCache, request_id: str, tokens: AnnotatedTokens) -> RequestBlocks:
    """Admit, compute the whole prompt, finish; returns what admission found."""
    admitted = cache.add_request(request_id, tokens)
    assert admitted is not None
    cache.mark_computed(request_id, len(tokens))
    cache.free(request_id)
    return admitted


def pool_state(cache: PrefixCache) -> tuple[object, ...]:
    pool = cache.block_pool
    return (
        [b.block_id for b in pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.hash_to_block),
        pool.num_evictions,
        list(pool._events),
        cache.stats(),
        cache.num_requests,
    )


# -- text ---------------------------------------------------------------------


def test_text_prompt_misses_then_hits_its_full_blocks() -> None:
    cache = new_cache()
    tokens = prompt(list(range(1, 11)))  # 10 tokens: 2 full blocks and 2 tokens
    keys = BlockHasher(BLOCK_SIZE).hash_blocks(tokens)
    assert cache.add_request("a", tokens) == RequestBlocks((0, 1, 2), 0)
    assert cache.block_hashes("a") == keys
    assert cache.num_computed_tokens("a") == 0
    assert cache.mark_computed("a", 10) == 2
    assert cache.take_events() == [BlockStored(tuple(keys), None, 8, BLOCK_SIZE)]
    cache.free("a")
    # Block 2 held no key, so it is the first block reused.
    assert cache.add_request("b", tokens) == RequestBlocks((0, 1, 2), 8)
    assert cache.num_computed_tokens("b") == 8
    assert cache.stats() == PrefixCacheStats(
        num_queries=2,
        num_query_tokens=20,
        num_hit_tokens=8,
        hit_rate=0.4,
        num_evictions=0,
        usage=3 / 16,
    )


def test_block_aligned_cached_prompt_recomputes_its_last_block() -> None:
    cache = new_cache()
    tokens = prompt(list(range(1, 9)))  # exactly 2 blocks
    keys = BlockHasher(BLOCK_SIZE).hash_blocks(tokens)
    run_prompt(cache, "a", tokens)
    cache.take_events()
    # At most 7 tokens may hit: one block. The last block is recomputed in
    # block 2 (the front of the free queue), while block 1 keeps the key.
    assert cache.add_request("b", tokens) == RequestBlocks((0, 2), 4)
    assert cache.mark_computed("b", 8) == 0
    assert cache.take_events() == []
    assert cache.block_hashes("b") == keys
    assert cache.block_pool.get_block_hash(1) == keys[1]
    assert cache.block_pool.get_block_hash(2) is None


def test_single_token_prompt_never_hits() -> None:
    cache = new_cache()
    assert cache.add_request("a", prompt([7])) == RequestBlocks((0,), 0)
    assert cache.block_hashes("a") == []
    assert cache.mark_computed("a", 1) == 0


# -- images and audio -----------------------------------------------------------


def test_same_placeholders_with_another_image_miss_from_the_image_on() -> None:
    cache = new_cache()
    # Block 0 is text, blocks 1 and 2 the image, block 3 three text tokens.
    red = prompt([1, 2, 3, 4], image(RED), [5, 6, 7])
    blue = prompt([1, 2, 3, 4], image(BLUE), [5, 6, 7])
    assert red.tolist() == blue.tolist()
    assert run_prompt(cache, "red", red) == RequestBlocks((0, 1, 2, 3), 0)
    assert run_prompt(cache, "blue", blue).num_cached_tokens == 4
    assert run_prompt(cache, "red again", red).num_cached_tokens == 12
    stats = cache.stats()
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (3, 45, 16)
    assert stats.hit_rate == pytest.approx(16 / 45)


def test_part_of_a_longer_image_does_not_hit_a_whole_shorter_one() -> None:
    cache = new_cache()
    whole = prompt([1, 2, 3, 4], image(RED, 8), [5])
    # The same 8 placeholder tokens, annotated as the first 8 of a 12-token run.
    part = prompt([1, 2, 3, 4], image(RED, 8, length=12), [5])
    run_prompt(cache, "whole", whole)
    assert run_prompt(cache, "part", part).num_cached_tokens == 4
    assert run_prompt(cache, "whole again", whole).num_cached_tokens == 12


def test_audio_at_another_sample_rate_misses() -> None:
    cache = new_cache()
    at_16k = prompt([1, 2, 3, 4], audio(TONE_16K), [5, 6])  # 12 tokens, 3 blocks
    at_8k = prompt([1, 2, 3, 4], audio(TONE_8K), [5, 6])
    assert TONE_16K != TONE_8K
    run_prompt(cache, "16k", at_16k)
    assert run_prompt(cache, "8k", at_8k).num_cached_tokens == 4
    # Same clip, same rate: all but the block holding the last token.
    assert run_prompt(cache, "16k again", at_16k).num_cached_tokens == 8


def test_image_and_audio_in_one_prompt_hit_only_together() -> None:
    cache = new_cache()
    both = prompt([1, 2, 3, 4], image(RED), audio(TONE_16K), [9, 9])  # 20 tokens
    other_audio = prompt([1, 2, 3, 4], image(RED), audio(TONE_8K), [9, 9])
    run_prompt(cache, "both", both)
    # Blocks 0-2 (text, image) hit; block 3 holds audio tokens and misses.
    assert run_prompt(cache, "other audio", other_audio).num_cached_tokens == 12
    assert run_prompt(cache, "both again", both).num_cached_tokens == 16


# -- eviction ---------------------------------------------------------------------


def test_re_request_after_eviction_keeps_the_head_of_its_chain() -> None:
    cache = new_cache(num_blocks=4)
    a = prompt(list(range(1, 13)))  # 3 full blocks
    b = prompt(list(range(50, 58)))  # 2 full blocks
    a_keys = BlockHasher(BLOCK_SIZE).hash_blocks(a)
    b_keys = BlockHasher(BLOCK_SIZE).hash_blocks(b)
    run_prompt(cache, "a", a)
    # Free queue: [3 (never used), 2 (a's tail), 1, 0].
    cache.take_events()
    assert run_prompt(cache, "b", b) == RequestBlocks((3, 2), 0)
    assert cache.take_events() == [
        BlockRemoved((a_keys[2],)),
        BlockStored(tuple(b_keys), None, 8, BLOCK_SIZE),
    ]
    # Free queue: [1, 0, 2 (b's tail), 3]. "a" may hit 2 blocks: both cached.
    assert cache.add_request("a2", a) == RequestBlocks((0, 1, 2), 8)
    assert cache.take_events() == [BlockRemoved((b_keys[1],))]
    # Three blocks are in use: a 16-token prompt does not fit.
    before = pool_state(cache)
    assert cache.add_request("c", prompt(list(range(100, 116)))) is None
    assert pool_state(cache) == before
    cache.mark_computed("a2", 12)
    cache.free("a2")
    assert run_prompt(cache, "c", prompt(list(range(100, 116)))) == RequestBlocks((3, 2, 1, 0), 0)
    assert run_prompt(cache, "a3", a).num_cached_tokens == 0
    stats = cache.stats()
    # a's tail and b's tail; then c takes b's head and a's chain; then a3
    # takes three of c's blocks.
    assert stats.num_evictions == 2 + 4 + 3
    assert (stats.num_queries, stats.num_hit_tokens) == (5, 8)


def test_hit_blocks_that_are_free_count_against_the_room() -> None:
    cache = new_cache(num_blocks=3)
    head = list(range(1, 9))
    run_prompt(cache, "a", prompt(head))
    before = pool_state(cache)
    # Hits blocks 0 and 1 (both free) and needs 2 more: only 1 would be left.
    assert cache.add_request("b", prompt(head + list(range(20, 28)))) is None
    assert pool_state(cache) == before
    assert "b" not in cache
    assert cache.add_request("c", prompt([*head, 20, 21, 22])) == RequestBlocks((0, 1, 2), 8)


def test_concurrent_identical_prompts_keep_one_block_per_key() -> None:
    cache = new_cache()
    tokens = prompt(list(range(1, 10)))  # 2 full blocks
    keys = BlockHasher(BLOCK_SIZE).hash_blocks(tokens)
    assert cache.add_request("a", tokens) == RequestBlocks((0, 1, 2), 0)
    assert cache.add_request("b", tokens) == RequestBlocks((3, 4, 5), 0)
    assert cache.mark_computed("a", 9) == 2
    assert cache.mark_computed("b", 9) == 0
    assert cache.block_hashes("b") == keys
    pool = cache.block_pool
    assert [pool.get_block_hash(i) for i in range(6)] == [*keys, None, None, None, None]
    cache.free("a")
    cache.free("b")
    assert cache.add_request("c", tokens) == RequestBlocks((0, 1, 5), 8)


# -- decode -------------------------------------------------------------------------


def test_decode_keys_only_completed_blocks_and_caches_them() -> None:
    cache = new_cache()
    hasher = BlockHasher(BLOCK_SIZE)
    assert cache.add_request("a", prompt([1, 2, 3, 4, 5, 6])) == RequestBlocks((0, 1), 0)
    assert cache.mark_computed("a", 6) == 1
    assert cache.append_tokens("a", [7]) == []
    assert len(cache.block_hashes("a")) == 1
    assert cache.append_tokens("a", [8]) == []
    keys = hasher.hash_blocks(AnnotatedTokens(range(1, 9)))
    assert cache.block_hashes("a") == keys
    assert cache.append_tokens("a", [9]) == [2]
    assert cache.num_tokens("a") == 9
    cache.take_events()
    assert cache.mark_computed("a", 8) == 1
    assert cache.take_events() == [BlockStored((keys[1],), keys[0], 4, BLOCK_SIZE)]
    assert cache.append_tokens("a", range(10, 20)) == [3, 4]
    assert cache.block_ids("a") == [0, 1, 2, 3, 4]
    assert cache.block_hashes("a") == hasher.hash_blocks(AnnotatedTokens(range(1, 20)))
    # A new prompt that continues the generated text hits the decoded blocks.
    assert cache.mark_computed("a", 19) == 2
    assert cache.add_request("b", prompt(list(range(1, 17)))) == RequestBlocks((0, 1, 2, 5), 12)


def test_decode_keys_cover_an_image_in_the_prompts_partial_block() -> None:
    cache = new_cache()
    # Tokens 5 and 6, in the partial block 1, are a 2-token image.
    image_tail = prompt([1, 2, 3, 4, 5], image(RED, 2))
    assert cache.add_request("a", image_tail) == RequestBlocks((0, 1), 0)
    assert len(cache.block_hashes("a")) == 1
    assert cache.append_tokens("a", [9, 9, 9, 9, 9]) == [2]
    hasher = BlockHasher(BLOCK_SIZE)
    expected = hasher.hash_blocks(image_tail.extend([9, 9, 9, 9, 9]))
    assert len(expected) == 3
    assert cache.block_hashes("a") == expected
    plain = hasher.hash_blocks(AnnotatedTokens([*image_tail.tolist(), 9, 9, 9, 9, 9]))
    assert (expected[0], expected[1] != plain[1]) == (plain[0], True)


def test_append_without_room_changes_nothing() -> None:
    cache = new_cache(num_blocks=2)
    assert cache.add_request("a", prompt([1, 2, 3, 4, 5, 6, 7, 8])) is not None
    keys = cache.block_hashes("a")
    before = pool_state(cache)
    assert cache.append_tokens("a", [9]) is None
    assert pool_state(cache) == before
    assert cache.num_tokens("a") == 8
    assert cache.block_hashes("a") == keys
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        cache.append_tokens("a", [1, -1])
    assert cache.num_tokens("a") == 8


# -- errors, reset, events ------------------------------------------------------------


def test_unknown_requests_are_value_errors() -> None:
    cache = new_cache()
    assert cache.add_request("a", prompt([1, 2, 3])) is not None
    cache.free("a")
    for call in (
        lambda: cache.free("a"),
        lambda: cache.mark_computed("a", 1),
        lambda: cache.append_tokens("a", [1]),
        lambda: cache.block_ids("a"),
        lambda: cache.block_hashes("a"),
        lambda: cache.num_computed_tokens("a"),
        lambda: cache.num_tokens("a"),
    ):
        with pytest.raises(ValueError, match="request_id: expected an active request, found 'a'"):
            call()


def test_bad_admissions_are_rejected_without_changes() -> None:
    cache = new_cache()
    assert cache.add_request("a", prompt([1, 2, 3])) is not None
    before = pool_state(cache)
    with pytest.raises(ValueError, match="expected a new request id, found 'a' active"):
        cache.add_request("a", prompt([4]))
    with pytest.raises(ValueError, match="prompt: expected at least 1 token, found 0"):
        cache.add_request("b", prompt([]))
    with pytest.raises(TypeError, match="prompt: expected AnnotatedTokens, found list"):
        cache.add_request("b", [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_id: expected str, found int"):
        cache.add_request(7, prompt([1]))  # type: ignore[arg-type]
    assert pool_state(cache) == before


def test_mark_computed_rejects_out_of_range_counts() -> None:
    cache = new_cache()
    assert cache.add_request("a", prompt(list(range(1, 11)))) is not None
    assert cache.mark_computed("a", 5) == 1
    before = pool_state(cache)
    with pytest.raises(ValueError, match=r"num_computed_tokens: expected 5\.\.10 .* found 4"):
        cache.mark_computed("a", 4)
    with pytest.raises(ValueError, match=r"num_computed_tokens: expected 5\.\.10 .* found 11"):
        cache.mark_computed("a", 11)
    with pytest.raises(TypeError, match="num_computed_tokens: expected int, found float"):
        cache.mark_computed("a", 6.0)  # type: ignore[arg-type]
    assert pool_state(cache) == before
    assert cache.num_computed_tokens("a") == 5


def test_pool_double_free_surfaces_as_runtime_error_and_keeps_the_request() -> None:
    cache = new_cache()
    assert cache.add_request("a", prompt([1, 2, 3, 4, 5])) is not None
    pool = cache.block_pool
    pool.free([pool.blocks[1]])  # released behind the cache's back
    before = pool_state(cache)
    with pytest.raises(RuntimeError, match="block 1 freed more often"):
        cache.free("a")
    assert pool_state(cache) == before
    assert cache.block_ids("a") == [0, 1]


def test_block_sizes_must_agree() -> None:
    with pytest.raises(ValueError, match=r"block_hasher.block_size: expected 4 .* found 16"):
        PrefixCache(BlockPool(8, 4), BlockHasher(16))
    with pytest.raises(TypeError, match="block_pool: expected BlockPool, found int"):
        PrefixCache(8, BlockHasher(4))  # type: ignore[arg-type]
    cache = PrefixCache.create(8, BlockHasher(4), enable_events=False)
    assert (cache.block_pool.num_blocks, cache.block_size) == (8, 4)
    run_prompt(cache, "a", prompt(list(range(1, 10))))
    assert cache.take_events() == []


def test_reset_waits_for_requests_then_forgets_every_prefix() -> None:
    cache = new_cache()
    tokens = prompt(list(range(1, 10)))
    assert cache.add_request("a", tokens) is not None
    cache.mark_computed("a", 9)
    cache.take_events()
    assert cache.reset() is False
    cache.free("a")
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()]
    assert run_prompt(cache, "b", tokens).num_cached_tokens == 0


def test_stats_start_at_zero() -> None:
    assert new_cache().stats() == PrefixCacheStats(0, 0, 0, 0.0, 0, 0.0)


def test_keys_are_block_hashes_of_the_hashers_algorithm() -> None:
    cache = PrefixCache(BlockPool(8, 4), BlockHasher(4, algorithm="xxh3_128"))
    assert cache.add_request("a", prompt(list(range(1, 10)))) is not None
    keys: list[BlockHash] = cache.block_hashes("a")
    assert [len(k) for k in keys] == [16, 16]
