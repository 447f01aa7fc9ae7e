"""The small transformer, its processor, and the exactness oracle of cached serving."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash
from omnicache.demo.config import AUDIO_TOKEN_ID, IMAGE_TOKEN_ID, CacheConfig, ModelConfig
from omnicache.demo.engine import ServingEngine
from omnicache.demo.model import TinyOmniModel
from omnicache.demo.oracle import ATOL, RTOL, Reference, best_hit_tokens, check_fits, run_cached
from omnicache.demo.processor import Processor
from omnicache.demo.workloads import (
    AudioItem,
    ImageItem,
    Message,
    SyntheticConfig,
    Trace,
    TraceRequest,
    synthetic_trace,
)
from omnicache.identity import item_identity

CONFIG = ModelConfig(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, mlp_size=64)
TRACE = synthetic_trace(SyntheticConfig(num_requests=20, num_images=6, num_audio_clips=2), seed=5)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model() -> TinyOmniModel:
    return TinyOmniModel(CONFIG)


def _image(color: tuple[int, int, int], size: tuple[int, int] = (70, 33)) -> ImageItem:
    pixels = np.zeros((size[1], size[0], 3), np.uint8)
    pixels[:] = color
    pixels[::3, ::5] = (255, 255, 255)
    return ImageItem(Image.fromarray(pixels, "RGB"), f"test-{color}")


def _request(
    request_id: str, *parts: str | ImageItem | AudioItem, tenant: str = "t", salt: str = "s"
) -> TraceRequest:
    messages = (
        Message("system", ("You answer questions about pictures and sounds, briefly.",)),
        Message("user", tuple(parts)),
    )
    return TraceRequest(request_id, tenant, salt, None, messages)


def _brute_force_best_hits(processor: Processor, trace: Trace, block_size: int) -> list[int]:
    """Per request: the longest run of leading full blocks equal (tokens and annotations)
    to those of an earlier prompt of the same tenant and salt, capped at len - 1 tokens."""
    prompts: list[tuple[tuple[str, str | None], AnnotatedTokens]] = []
    hits: list[int] = []
    for request in trace.requests:
        prompt = processor.annotate(processor.tokenize(request.messages))
        group = (request.tenant, request.cache_salt)
        cap = (len(prompt) - 1) // block_size
        best = 0
        for other_group, other in prompts:
            if other_group != group:
                continue
            num_equal = 0
            while num_equal < cap and (num_equal + 1) * block_size <= len(other):
                lo, hi = num_equal * block_size, (num_equal + 1) * block_size
                if prompt[lo:hi] != other[lo:hi]:
                    break
                num_equal += 1
            best = max(best, num_equal)
        hits.append(best * block_size)
        prompts.append((group, prompt))
    return hits


# -- processor --------------------------------------------------------------------


def test_placeholder_runs_follow_image_patches_and_audio_frames() -> None:
    processor = Processor(CONFIG)
    image = _image((10, 20, 30), size=(70, 33))  # 3 x 2 patches of 32 pixels
    clip = AudioItem(np.zeros((2, 1_000), np.float32), 16_000, "clip")  # 640 samples a frame
    prompt = processor.tokenize([Message("user", ("hi", image, clip, "bye"))])
    # BOS, USER, "hi", 6 image tokens, 2 audio tokens, "bye", END, ASSISTANT
    assert len(prompt.token_ids) == 1 + 1 + 1 + 6 + 2 + 1 + 1 + 1
    assert [(run.item, run.offset, run.length) for run in prompt.runs] == [
        (image, 3, 6),
        (clip, 9, 2),
    ]
    assert prompt.token_ids[3:9] == [IMAGE_TOKEN_ID] * 6
    assert prompt.token_ids[9:11] == [AUDIO_TOKEN_ID] * 2
    tokens = processor.annotate(prompt)
    assert tokens.tolist() == prompt.token_ids
    assert tokens.annotations == (
        TokenRangeAnnotation(3, 6, item_identity(image.image, modality="image"), 0, 6),
        TokenRangeAnnotation(9, 2, item_identity((clip.waveform, 16_000), modality="audio"), 0, 2),
    )
    processor.annotate(prompt)
    assert processor.num_items_hashed == 2


def test_word_ids_are_deterministic_and_in_range() -> None:
    ids = Processor(CONFIG).encode_text("panel, panel: fan")
    assert ids == Processor(CONFIG).encode_text("panel, panel: fan")
    assert len(ids) == 5
    assert ids[0] == ids[2] and ids[1] != ids[3]
    assert all(16 <= i < CONFIG.vocab_size for i in ids)


def test_next_turn_tokens_extend_the_previous_turn() -> None:
    processor = Processor(CONFIG)
    by_conversation: dict[str, AnnotatedTokens] = {}
    num_checked = 0
    for request in TRACE.requests:
        tokens = processor.annotate(processor.tokenize(request.messages))
        assert request.conversation is not None
        previous = by_conversation.get(request.conversation)
        if previous is not None:
            assert tokens[: len(previous)] == previous
            num_checked += 1
        by_conversation[request.conversation] = tokens
    assert num_checked >= 5


# -- model ------------------------------------------------------------------------


def test_weights_are_fixed_by_the_seed() -> None:
    prompt = Processor(CONFIG).tokenize(TRACE.requests[0].messages)
    a, b = TinyOmniModel(CONFIG), TinyOmniModel(CONFIG)
    out_a = a.forward(a.embed(prompt)[0])
    out_b = b.forward(b.embed(prompt)[0])
    assert torch.equal(out_a.hidden_states, out_b.hidden_states)
    assert torch.equal(out_a.logits, out_b.logits)
    other = TinyOmniModel(replace(CONFIG, seed=1))
    assert not torch.allclose(other.forward(other.embed(prompt)[0]).logits, out_a.logits)


def test_suffix_over_cached_kv_equals_the_full_forward(model: TinyOmniModel) -> None:
    prompt = Processor(CONFIG).tokenize(TRACE.requests[-1].messages)
    num_tokens = len(prompt.token_ids)
    full = model.forward(model.embed(prompt)[0])
    assert full.hidden_states.shape == (num_tokens, CONFIG.hidden_size)
    for start in (1, 16, 33, num_tokens - 1):
        past = [(k[:start], v[:start]) for k, v in zip(full.keys, full.values, strict=True)]
        embeds, _ = model.embed(prompt, start)
        suffix = model.forward(embeds, start, past)
        assert suffix.hidden_states.shape == (num_tokens - start, CONFIG.hidden_size)
        torch.testing.assert_close(
            suffix.hidden_states, full.hidden_states[start:], atol=ATOL, rtol=RTOL
        )
        torch.testing.assert_close(suffix.logits, full.logits, atol=ATOL, rtol=RTOL)
        for layer in range(CONFIG.num_layers):
            torch.testing.assert_close(
                suffix.keys[layer], full.keys[layer][start:], atol=ATOL, rtol=RTOL
            )


def test_another_image_changes_every_later_hidden_state(model: TinyOmniModel) -> None:
    processor = Processor(CONFIG)
    red = processor.tokenize(_request("r", _image((200, 0, 0)), "what is it").messages)
    blue = processor.tokenize(_request("b", _image((0, 0, 200)), "what is it").messages)
    assert red.token_ids == blue.token_ids
    offset = red.runs[0].offset
    out_red = model.forward(model.embed(red)[0]).hidden_states
    out_blue = model.forward(model.embed(blue)[0]).hidden_states
    assert torch.equal(out_red[:offset], out_blue[:offset])
    row_diff = (out_red[offset:] - out_blue[offset:]).abs().amax(dim=1)
    assert bool((row_diff > 1e-3).all())


def test_forward_rejects_missing_past_and_overlong_prompts(model: TinyOmniModel) -> None:
    rows = torch.zeros(3, CONFIG.hidden_size)
    with pytest.raises(ValueError, match=r"past: expected keys and values of 2 layers"):
        model.forward(rows, 5)
    with pytest.raises(ValueError, match=r"max_positions 4096"):
        model.forward(rows, CONFIG.max_positions - 2, [(rows, rows)] * 2)


# -- the oracle ---------------------------------------------------------------------


def test_best_hit_tokens_counts_leading_seen_blocks_up_to_the_last_token() -> None:
    a, b, c, d, e = (BlockHash(bytes([i]) * 32) for i in range(5))
    prompts = [[a, b, c], [a, b, d], [a, b, c], [a], [e, a]]
    lengths = [48, 49, 48, 16, 40]
    # 3rd: all 3 blocks seen, but the last token is computed: 2 blocks.
    # 4th: a 1-block prompt hits nothing. 5th: the walk stops at the unseen e.
    assert best_hit_tokens(prompts, lengths, 16) == [0, 32, 32, 0, 0]


def test_cached_serving_equals_recompute_under_evictions(model: TinyOmniModel) -> None:
    processor = Processor(CONFIG)
    longest = check_fits(model, processor, TRACE, CacheConfig(num_blocks=10_000))
    cache_config = CacheConfig(num_blocks=-(-longest // BLOCK_SIZE) + 2, block_size=BLOCK_SIZE)
    references: list[Reference] = []
    report = run_cached(model, processor, TRACE, cache_config, references)
    lengths = [len(processor.tokenize(r.messages).token_ids) for r in TRACE.requests]
    num_runs = sum(len(processor.tokenize(r.messages).runs) for r in TRACE.requests)
    assert len(references) == TRACE.num_requests
    assert report.num_requests == 20
    assert report.num_prompt_tokens == sum(lengths)
    assert report.num_items == num_runs
    assert report.num_evictions > 0
    assert 0 < report.num_hit_tokens < report.num_best_hit_tokens
    assert report.num_items_encoded < report.num_items
    assert report.flops_cached < report.flops_full
    assert report.num_stale_reads == 0
    assert report.num_mismatches == 0
    assert report.mismatched_requests == []
    assert report.max_abs_diff <= ATOL
    assert report.ok


def test_an_infinite_pool_reaches_exactly_the_best_possible_hits(model: TinyOmniModel) -> None:
    processor = Processor(CONFIG)
    report = run_cached(model, processor, TRACE, CacheConfig(num_blocks=4_096), [])
    expected = sum(_brute_force_best_hits(processor, TRACE, BLOCK_SIZE))
    assert expected > 0
    assert report.num_best_hit_tokens == expected
    assert report.num_hit_tokens == expected
    assert report.num_evictions == 0
    assert report.ok


def test_tenants_and_salts_never_share_blocks(model: TinyOmniModel) -> None:
    engine = ServingEngine(model, Processor(CONFIG), CacheConfig(num_blocks=256))
    image = _image((1, 2, 3))
    first = engine.serve(_request("a1", image, "same words", tenant="a"))
    assert first.num_hit_tokens == 0
    assert engine.serve(_request("b1", image, "same words", tenant="b")).num_hit_tokens == 0
    assert engine.serve(_request("a2", image, "same words", salt="t")).num_hit_tokens == 0
    again = engine.serve(_request("a3", image, "same words", tenant="a"))
    assert again.num_hit_tokens == (first.num_tokens - 1) // 16 * 16
    # The deployment salt separates whole deployments the same way.
    salted = ServingEngine(model, Processor(CONFIG), CacheConfig(num_blocks=256, salt="x"))
    assert salted.prefix_cache(_request("a", tenant="a")).block_hasher.root != (
        engine.prefix_cache(_request("a", tenant="a")).block_hasher.root
    )


def test_a_different_image_hits_only_the_blocks_before_it(model: TinyOmniModel) -> None:
    processor = Processor(CONFIG)
    red = _request("red", "look", _image((200, 0, 0)), "what is it")
    blue = _request("blue", "look", _image((0, 0, 200)), "what is it")
    trace = Trace("two images", (red, blue))
    report = run_cached(model, processor, trace, CacheConfig(num_blocks=64), [])
    offset = processor.tokenize(red.messages).runs[0].offset
    assert report.num_hit_tokens == offset // BLOCK_SIZE * BLOCK_SIZE
    assert report.num_mismatches == 0


def _serve_then_tamper(
    model: TinyOmniModel, tamper: str
) -> tuple[ServingEngine, TraceRequest, int]:
    """Serves a request, then corrupts or unstamps its first block; returns a follow-up."""
    processor = Processor(CONFIG)
    engine = ServingEngine(model, processor, CacheConfig(num_blocks=64))
    first = _request("first", _image((9, 9, 9)), "tell me")
    follow = _request("follow", _image((9, 9, 9)), "tell me more")
    engine.serve(first)
    key = engine.block_hashes(first, processor.annotate(processor.tokenize(first.messages)))[0]
    block = engine.pool.get_cached_block(key)
    assert block is not None
    if tamper == "rows":
        # Garbage K rows stamped with the right key: only the oracle can see it.
        garbage = torch.full((BLOCK_SIZE, CONFIG.hidden_size), 3.0)
        engine.store.write_blocks("layer0.k", garbage, [block.block_id], block_keys=[key])
    else:
        engine.store.invalidate([block.block_id])
    return engine, follow, block.block_id


def test_corrupted_cached_rows_are_a_counted_mismatch(model: TinyOmniModel) -> None:
    engine, follow, _ = _serve_then_tamper(model, "rows")
    report = run_cached(
        model, engine.processor, Trace("t", (follow,)), engine.cache_config, [], engine=engine
    )
    assert report.num_hit_tokens > 0
    assert report.num_mismatches == 1
    assert report.mismatched_requests == ["follow"]
    assert report.num_stale_reads == 0
    assert not report.ok


def test_a_stale_block_is_counted_and_never_served(model: TinyOmniModel) -> None:
    engine, follow, _ = _serve_then_tamper(model, "stamp")
    served = engine.serve(follow)
    assert served.stale
    assert served.num_hit_tokens > 0
    assert served.num_computed_tokens == served.num_tokens
    engine2, follow2, _ = _serve_then_tamper(model, "stamp")
    report = run_cached(
        model, engine2.processor, Trace("t", (follow2,)), engine2.cache_config, [], engine=engine2
    )
    assert report.num_stale_reads == 1
    assert engine2.store.stats.num_stale_reads == 1
    # Recomputed from scratch, so the outputs are still right.
    assert report.num_mismatches == 0
    assert not report.ok


def test_check_fits_names_the_prompt_that_cannot_fit(model: TinyOmniModel) -> None:
    processor = Processor(CONFIG)
    longest = check_fits(model, processor, TRACE, CacheConfig(num_blocks=4_096))
    assert longest == max(len(processor.tokenize(r.messages).token_ids) for r in TRACE.requests)
    needed = -(-longest // 16)
    with pytest.raises(ValueError, match=rf"num_blocks: expected at least {needed} .* found 3"):
        check_fits(model, processor, TRACE, CacheConfig(num_blocks=3))
    short = TinyOmniModel(replace(CONFIG, max_positions=32))
    with pytest.raises(ValueError, match=r"expected at most 32 tokens"):
        check_fits(short, processor, TRACE, CacheConfig())


def test_configs_reject_bad_values() -> None:
    with pytest.raises(ValueError, match=r"^num_blocks: expected int >= 1, found 0$"):
        CacheConfig(num_blocks=0)
    with pytest.raises(ValueError, match=r"^vocab_size: expected int >= 17, found 16$"):
        ModelConfig(vocab_size=16)
    with pytest.raises(ValueError, match=r"^seed: expected int >= 0, found -1$"):
        ModelConfig(seed=-1)
    with pytest.raises(ValueError, match=r"^name: expected a non-empty str, found ''$"):
        ModelConfig(name="")
    expected = "algorithm: expected one of blake3, sha256, xxh3_128 or None, found 'md5'"
    with pytest.raises(ValueError, match=rf"^{re.escape(expected)}$"):
        CacheConfig(algorithm="md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"hidden_size: expected a multiple of num_heads"):
        ModelConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match=r"image_patch_size: expected a multiple of 8"):
        ModelConfig(image_patch_size=12)


def test_a_fully_cached_block_aligned_prompt_recomputes_only_its_last_block(
    model: TinyOmniModel,
) -> None:
    processor = Processor(CONFIG)
    image = _image((4, 5, 6))
    words = "one"
    while len(processor.tokenize(_request("x", image, words).messages).token_ids) % BLOCK_SIZE:
        words += " more"
    request = _request("aligned", image, words)
    num_tokens = len(processor.tokenize(request.messages).token_ids)
    assert num_tokens % BLOCK_SIZE == 0
    engine = ServingEngine(model, processor, CacheConfig(num_blocks=64))
    prompt = processor.annotate(processor.tokenize(request.messages))
    last_key = engine.block_hashes(request, prompt)[-1]
    trace = Trace("aligned", (request, replace(request, request_id="again")))
    report = run_cached(model, processor, trace, engine.cache_config, [], engine=engine)
    assert report.num_hit_tokens == num_tokens - BLOCK_SIZE
    assert report.ok
    # The recomputed last block went to a second block; the key stays on the first,
    # and only the first is stamped with it.
    holder = engine.pool.get_cached_block(last_key)
    assert holder is not None
    stamped = [b for b in range(64) if engine.store.stamp_of("hidden_states", b) == last_key]
    assert stamped == [holder.block_id]
    third = run_cached(
        model, processor, Trace("t", (replace(request, request_id="third"),)),
        engine.cache_config, [], engine=engine,
    )  # fmt: skip
    assert third.num_hit_tokens == num_tokens - BLOCK_SIZE
    assert third.ok


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ModelConfig(num_layers=2.0), "num_layers: expected int, found float"),
        (lambda: ModelConfig(hidden_size="64"), "hidden_size: expected int, found str"),
        (lambda: ModelConfig(seed=None), "seed: expected int, found NoneType"),
        (lambda: ModelConfig(name=b"tiny"), "name: expected str, found bytes"),
        (lambda: CacheConfig(block_size=True), "block_size: expected int, found bool"),
        (lambda: CacheConfig(algorithm=3), "algorithm: expected str or None, found int"),
        (lambda: CacheConfig(salt=None), "salt: expected str, found NoneType"),
    ],
)
def test_configs_reject_bad_types(make: Callable[[], object], message: str) -> None:
    with pytest.raises(TypeError) as caught:
        make()
    assert (type(caught.value), str(caught.value)) == (TypeError, message)
