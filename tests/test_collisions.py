"""Collision catalogue: every key collision known from other prefix caches, and ours.

Each test reproduces one incident. Where the incident is a flaw in how a key
was built, the test first shows that a small model of the flawed key really
collides on the two prompts (so the test exercises the incident, not some
easier pair), then shows that omnicache's content digests and block keys
differ, starting exactly at the block where the prompts differ.

Prompts are built with `annotate_prompt` and keyed with `BlockHasher`, as a
serving front end would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from hashing import (
    ALGORITHMS,
    hash_audio,
    hash_bytes,
    hash_identifier,
    hash_image,
)
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.identity import item_identity
from omnicache.preprocess import annotate_prompt

BLOCK_SIZE = 8
IMAGE_TOKEN = 32_000
AUDIO_TOKEN = 32_001
TEXT = [101, 102, 103, 104, 105, 106, 107, 108]

RNG = np.random.default_rng(8)
RED = Image.new("RGB", (8, 8), (255, 0, 0))
BLUE = Image.new("RGB", (8, 8), (0, 0, 255))
VOICE_A = (RNG.standard_normal(1600).astype(np.float32), 16_000)
VOICE_B = (RNG.standard_normal(1600).astype(np.float32), 16_000)

# Two 1x1 RGB pixels (value r + 256 g + 65536 b) whose blake3 image digests
# share a 30-bit pad value and the first 16 bits; found by a birthday search
# over all pixels, deterministic because the digests are.
PAD30_PIXELS = (16_735, 17_624)
PREFIX16_PIXELS = (233, 395)


@pytest.fixture(params=ALGORITHMS)
def algorithm(request: pytest.FixtureRequest) -> Any:
    return request.param


def pixel(value: int) -> np.ndarray[Any, Any]:
    rgb = [value & 255, (value >> 8) & 255, (value >> 16) & 255]
    return np.array([[rgb]], dtype=np.uint8)


def keys(prompt: AnnotatedTokens, algorithm: Any = "sha256", **hasher: Any) -> list[BlockHash]:
    return BlockHasher(BLOCK_SIZE, algorithm=algorithm, **hasher).hash_blocks(prompt)


def assert_diverge_at(a: Sequence[bytes], b: Sequence[bytes], block: int) -> None:
    """Keys agree on blocks before ``block`` and share no key from ``block`` on."""
    assert len(a) == len(b)
    assert block < len(a)
    assert list(a[:block]) == list(b[:block])
    assert not set(a[block:]) & set(b)
    assert not set(b[block:]) & set(a)


def digests(prompt: AnnotatedTokens) -> list[bytes]:
    return [ann.content_hash for ann in prompt.annotations]


# -- models of flawed keys (only what each incident needs) --------------------


def _h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def flawed_chain(
    prompt: AnnotatedTokens, extra: Callable[[AnnotatedTokens, int], object]
) -> list[bytes]:
    """A chain over (parent, block tokens, extra(prompt, block)): the shape every peer uses."""
    parent = b"none"
    out = []
    for block in range(len(prompt) // BLOCK_SIZE):
        start = block * BLOCK_SIZE
        parent = _h(
            parent, tuple(prompt.tolist()[start : start + BLOCK_SIZE]), extra(prompt, block)
        )
        out.append(parent)
    return out


def no_mm(prompt: AnnotatedTokens, block: int) -> object:
    return ()


def mm_ids(prompt: AnnotatedTokens, block: int) -> tuple[bytes, ...]:
    """Identifier of every item overlapping the block; no offset, no length."""
    anns = prompt.clipped_annotations(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
    return tuple(a.content_hash for a in anns)


def mm_ids_offsets(prompt: AnnotatedTokens, block: int) -> object:
    """Identifier and item start relative to the block; no length (vLLM after PR #36708)."""
    start = block * BLOCK_SIZE
    return tuple(
        (ann.content_hash, ann.token_index - ann.content_offset - start)
        for ann in prompt.annotations
        if ann.token_index < start + BLOCK_SIZE and ann.token_end > start
    )


def mm_sorted(prompt: AnnotatedTokens, block: int) -> object:
    return tuple(sorted(mm_ids(prompt, block)))


# -- vLLM ------------------------------------------------------------------------


def test_vllm_same_placeholder_tokens_different_images(algorithm: Any) -> None:
    """vLLM before multimodal extra keys: the placeholder ids alone keyed an image."""
    tokens = TEXT + [IMAGE_TOKEN] * 16 + TEXT
    red = annotate_prompt(tokens, [RED], placeholder_token_id=IMAGE_TOKEN)
    blue = annotate_prompt(tokens, [BLUE], placeholder_token_id=IMAGE_TOKEN)
    assert flawed_chain(red, no_mm) == flawed_chain(blue, no_mm)
    assert red.tolist() == blue.tolist()
    assert digests(red) != digests(blue)
    assert_diverge_at(keys(red, algorithm), keys(blue, algorithm), 1)


def test_vllm_pr36708_identical_images_at_different_alignments(algorithm: Any) -> None:
    """vLLM PR #36708: without the item offset, one image placed at two alignments collided."""
    tokens = TEXT + [IMAGE_TOKEN] * 8
    early = annotate_prompt(tokens, [RED], placeholder_ranges=[(8, 4)])
    late = annotate_prompt(tokens, [RED], placeholder_ranges=[(12, 4)])
    assert flawed_chain(early, mm_ids) == flawed_chain(late, mm_ids)
    assert flawed_chain(early, mm_ids_offsets) != flawed_chain(late, mm_ids_offsets)
    assert_diverge_at(keys(early, algorithm), keys(late, algorithm), 1)


def test_vllm_item_length_missing_from_the_key(algorithm: Any) -> None:
    """vLLM keys ("mm", identifier, offset): the first 8 tokens of a 16-token item
    look like a whole 8-token item (same id, e.g. one image processed at two sizes)."""
    whole = annotate_prompt(TEXT + [IMAGE_TOKEN] * 8, ["photo-1"], placeholder_token_id=IMAGE_TOKEN)
    part = annotate_prompt(TEXT + [IMAGE_TOKEN] * 16, ["photo-1"], placeholder_token_id=IMAGE_TOKEN)
    assert digests(whole) == digests(part)
    assert flawed_chain(whole, mm_ids_offsets) == flawed_chain(part[:16], mm_ids_offsets)
    assert_diverge_at(keys(whole, algorithm), keys(part, algorithm)[:2], 1)
    assert part.annotations[0].content_length == 16
    assert whole.annotations[0].content_length == 8


def test_cve_2025_46570_cache_salt_separates_every_block(algorithm: Any) -> None:
    """CVE-2025-46570: tenants without a salt shared blocks, and hit latency told one
    tenant what another had sent. The salt is in the root, so every key differs."""
    prompt = annotate_prompt(TEXT * 3 + [IMAGE_TOKEN] * 8, [RED], placeholder_token_id=IMAGE_TOKEN)
    chains = [keys(prompt, algorithm, cache_salt=salt) for salt in (None, "", "tenant-a", "b")]
    assert [len(c) for c in chains] == [4, 4, 4, 4]
    assert len({key for chain in chains for key in chain}) == 16
    roots = {BlockHasher(BLOCK_SIZE, algorithm=algorithm, cache_salt=s).root for s in ("a", "b")}
    assert len(roots) == 2


def test_vllm_44701_lora_name_equal_to_a_salt(algorithm: Any) -> None:
    """vLLM #44701: a LoRA name equal to a cache salt gave the same extra key.
    Salt, adapter and namespace are tagged fields of the root."""
    prompt = annotate_prompt(TEXT * 2, [])
    configs: list[dict[str, Any]] = [
        {},
        {"cache_salt": "x"},
        {"adapter": "x"},
        {"namespace": "x"},
        {"cache_salt": ""},
        {"adapter": ""},
        {"cache_salt": "x", "adapter": "x"},
        {"cache_salt": "xx"},
        {"namespace": "x", "cache_salt": "x"},
    ]
    chains = [keys(prompt, algorithm, **config) for config in configs]
    assert len({chain[0] for chain in chains}) == len(configs)
    assert len({key for chain in chains for key in chain}) == 2 * len(configs)


def _reference_root(algorithm: str, namespace: str, salt: str | None, adapter: str | None) -> bytes:
    """The root from the bytes ``omnicache.block_hash`` documents, written out here."""
    import struct

    import blake3
    import xxhash

    def field(tag: int, value: str | int | None) -> bytes:
        if value is None:
            return struct.pack("<BBI", tag, 0, 0)
        if isinstance(value, str):
            data = value.encode()
            return struct.pack("<BBI", tag, 1, len(data)) + data
        return struct.pack("<BBI", tag, 2, 8) + struct.pack("<Q", value)

    preimage = b"".join(
        field(tag, value)
        for tag, value in enumerate(
            ("omnicache.block/v1", algorithm, namespace, salt, adapter, BLOCK_SIZE), start=1
        )
    )
    new: dict[str, Callable[[bytes], Any]] = {
        "sha256": hashlib.sha256,
        "blake3": blake3.blake3,
        "xxh3_128": xxhash.xxh3_128,
    }
    digest: bytes = new[algorithm](preimage).digest()
    return digest


def test_ghsa_rm76_4mrf_v9r8_root_is_derived_from_the_configuration_only(algorithm: Any) -> None:
    """GHSA-rm76-4mrf-v9r8: vLLM's chain started from hash(None), predictable and the same
    for every configuration. omnicache's root is a digest of the configuration alone:
    the same in every process (see test_determinism), different for every configuration."""
    grid = [
        (namespace, salt, adapter)
        for namespace in ("", "model-a", "model-b")
        for salt in (None, "", "s")
        for adapter in (None, "", "lora-1")
    ]
    roots = [
        BlockHasher(BLOCK_SIZE, algorithm=algorithm, namespace=n, cache_salt=s, adapter=a).root
        for n, s, a in grid
    ]
    assert len(set(roots)) == len(grid)
    assert roots == [_reference_root(algorithm, n, s, a) for n, s, a in grid]
    other_size = BlockHasher(BLOCK_SIZE * 2, algorithm=algorithm).root
    assert other_size not in roots
    assert len({BlockHasher(BLOCK_SIZE, algorithm=a).root for a in ALGORITHMS}) == len(ALGORITHMS)


def test_ghsa_c65p_x677_fgj6_pil_size_and_mode_are_hashed(algorithm: Any) -> None:
    """GHSA-c65p-x677-fgj6: vLLM hashed PIL pixel bytes without size or mode, so
    images with the same bytes in another shape or mode collided."""
    data = bytes(range(24))
    images = [
        Image.frombytes("L", (4, 6), data),
        Image.frombytes("L", (6, 4), data),
        Image.frombytes("L", (3, 8), data),
        Image.frombytes("L", (24, 1), data),
        Image.frombytes("RGB", (4, 2), data),
        Image.frombytes("RGB", (2, 4), data),
        Image.frombytes("LA", (4, 3), data),
        Image.frombytes("P", (4, 6), data),
    ]
    tokens = TEXT + [IMAGE_TOKEN] * 8
    prompts = [
        annotate_prompt(tokens, [image], placeholder_token_id=IMAGE_TOKEN, algorithm=algorithm)
        for image in images
    ]
    assert len({bytes(d) for p in prompts for d in digests(p)}) == len(images)
    block_keys = [keys(p, algorithm) for p in prompts]
    assert len({k[0] for k in block_keys}) == 1
    assert len({k[1] for k in block_keys}) == len(images)


def test_vllm_54283_nested_keys_do_not_collide(algorithm: Any) -> None:
    """vLLM #54283: nested mapping keys were flattened with a separator and collided.
    Contexts are encoded typed and framed at every level."""
    contexts: list[dict[str, Any]] = [
        {"a": {"b": 1}},
        {"a.b": 1},
        {"a": {"b": "1"}},
        {"a": {"b": True}},
        {"a": {"b": 1.0}},
        {"a": [["b", 1]]},
        {"a": ["b", 1]},
        {"a": {"b": 1, "c": None}},
        {"a": {"b": [1]}},
        {"a": {"b": b"\x01"}},
        {"ab": 1},
        {"a": {"": {"b": 1}}},
    ]
    tokens = TEXT + [IMAGE_TOKEN] * 8
    prompts = [
        annotate_prompt(
            tokens, [RED], placeholder_token_id=IMAGE_TOKEN, context=c, algorithm=algorithm
        )
        for c in contexts
    ]
    assert len({bytes(d) for p in prompts for d in digests(p)}) == len(contexts)
    assert len({keys(p, algorithm)[1] for p in prompts}) == len(contexts)


def test_vllm_raw_client_uuid_is_never_the_key(algorithm: Any) -> None:
    """vLLM may use a client's uuid verbatim as the item identifier: two tenants that
    reuse "photo-1" for different pictures collided, and a client could name its item
    after another item's digest. omnicache hashes ids in a namespace, apart from content."""
    tokens = TEXT + [IMAGE_TOKEN] * 8
    red = hash_image(RED, algorithm=algorithm)

    def prompt(item: object, namespace: str = "default") -> AnnotatedTokens:
        return annotate_prompt(
            tokens,
            [item],
            placeholder_token_id=IMAGE_TOKEN,
            algorithm=algorithm,
            identifier_namespace=namespace,
        )

    variants = [
        prompt("photo-1", "tenant-a"),
        prompt("photo-1", "tenant-b"),
        prompt("photo-1"),
        prompt(red.hex()),
        prompt(red),
    ]
    assert [digests(p) for p in variants[:1]] == [
        [hash_identifier("photo-1", namespace="tenant-a", algorithm=algorithm)]
    ]
    all_digests = [bytes(d) for p in variants for d in digests(p)]
    assert len(set(all_digests)) == len(variants)
    assert digests(variants[4]) == [red]
    assert len({keys(p, algorithm)[1] for p in variants}) == len(variants)
    # Bytes are a file's, named by the picture or clip they decode to: never taken raw.
    for raw in (bytes(red), b"photo-1"):
        with pytest.raises(ValueError, match=r"^items\[0\]: expected an encoded image or audio"):
            prompt(raw)


# -- SGLang, LMCache, TensorRT-LLM / Dynamo -------------------------------------


def test_sglang_30_bit_pad_value_collision() -> None:
    """SGLang replaces an image's tokens by a pad value, a 30-bit slice of its hash:
    two different images with the same slice get the same token ids."""
    a, b = (hash_image(pixel(v)) for v in PAD30_PIXELS)
    assert a != b
    pad_a, pad_b = (int.from_bytes(d[:8], "big") % (1 << 30) for d in (a, b))
    assert pad_a == pad_b
    padded = TEXT + [pad_a] * 8
    assert flawed_chain(AnnotatedTokens(padded), no_mm) == flawed_chain(
        AnnotatedTokens(TEXT + [pad_b] * 8), no_mm
    )
    tokens = TEXT + [IMAGE_TOKEN] * 8
    first, second = (
        annotate_prompt(tokens, [pixel(v)], placeholder_token_id=IMAGE_TOKEN) for v in PAD30_PIXELS
    )
    assert digests(first) == [item_identity(pixel(PAD30_PIXELS[0]), modality="image")]
    assert digests(second) == [item_identity(pixel(PAD30_PIXELS[1]), modality="image")]
    assert_diverge_at(keys(first), keys(second), 1)


def test_lmcache_16_bit_multimodal_hash_collision() -> None:
    """LMCache once wrote a 16-bit hash over an item's span: a birthday pair of
    images (a few hundred suffice) shared it. omnicache keys hold the whole digest."""
    a, b = (hash_image(pixel(v)) for v in PREFIX16_PIXELS)
    assert a[:2] == b[:2]
    assert a != b
    tokens = TEXT + [IMAGE_TOKEN] * 16
    first, second = (
        annotate_prompt(tokens, [pixel(v)], placeholder_token_id=IMAGE_TOKEN)
        for v in PREFIX16_PIXELS
    )
    assert_diverge_at(keys(first), keys(second), 1)


def _same_image_everywhere() -> list[tuple[str, object]]:
    image = RNG.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    strided = np.zeros((6, 10, 3), dtype=np.uint8)
    strided[:, ::2] = image
    variants: list[tuple[str, object]] = [
        ("numpy", image),
        ("numpy-strided", strided[:, ::2]),
        ("torch-cpu", torch.from_numpy(image.copy())),
        ("torch-cpu-strided", torch.from_numpy(strided)[:, ::2]),
    ]
    if torch.cuda.is_available():
        variants.append(("torch-cuda", torch.from_numpy(image.copy()).cuda()))
    return variants


def test_sglang_cpu_gpu_hash_split_is_one_digest() -> None:
    """SGLang hashed an item with SHA-256 on CPU but a kernel hash on CUDA, so the same
    image missed depending on where it lived. One canonical digest wherever it is
    (test_determinism checks CUDA tensors when a GPU is present)."""
    tokens = TEXT + [IMAGE_TOKEN] * 8
    variants = _same_image_everywhere()
    prompts = [
        annotate_prompt(tokens, [item], placeholder_token_id=IMAGE_TOKEN) for _, item in variants
    ]
    assert len({bytes(d) for p in prompts for d in digests(p)}) == 1
    assert len({tuple(keys(p)) for p in prompts}) == 1


def test_dynamo_sorted_mm_hashes_lose_the_order_of_items(algorithm: Any) -> None:
    """Dynamo's router keys a block by its tokens and its sorted multimodal hashes:
    images A then B and B then A in one block collided."""
    tokens = [IMAGE_TOKEN] * 3 + [7] + [IMAGE_TOKEN] * 3 + [7]
    ab = annotate_prompt(tokens, [RED, BLUE], placeholder_token_id=IMAGE_TOKEN)
    ba = annotate_prompt(tokens, [BLUE, RED], placeholder_token_id=IMAGE_TOKEN)
    assert flawed_chain(ab, mm_sorted) == flawed_chain(ba, mm_sorted)
    assert_diverge_at(keys(ab, algorithm), keys(ba, algorithm), 0)


def test_trtllm_start_offset_without_item_length(algorithm: Any) -> None:
    """TensorRT-LLM keys an item by its digest and the item position at the block's
    start, without the item's length: the middle of a 12-token item and of a 16-token
    item with the same id (one picture processed at two resolutions) collided."""
    short = annotate_prompt(TEXT[:4] + [IMAGE_TOKEN] * 12, ["x"], placeholder_token_id=IMAGE_TOKEN)
    long = annotate_prompt(TEXT[:4] + [IMAGE_TOKEN] * 20, ["x"], placeholder_token_id=IMAGE_TOKEN)
    assert digests(short) == digests(long)
    assert flawed_chain(short, mm_ids_offsets) == flawed_chain(long[:16], mm_ids_offsets)
    assert_diverge_at(keys(short, algorithm), keys(long, algorithm)[:2], 0)


def test_one_run_and_two_adjacent_runs_of_an_item_differ(algorithm: Any) -> None:
    """Two crops of one picture sent as one id are two items, not one twice as long."""
    tokens = TEXT + [IMAGE_TOKEN] * 8
    one = annotate_prompt(tokens, ["x"], placeholder_ranges=[(8, 8)])
    two = annotate_prompt(tokens, ["x", "x"], placeholder_ranges=[(8, 4), (12, 4)])
    assert digests(two) == digests(one) * 2
    assert_diverge_at(keys(one, algorithm), keys(two, algorithm), 1)


# -- vllm-omni -------------------------------------------------------------------


def test_vllm_omni_4008_7822_voice_clone_prompts_differ_without_salt(algorithm: Any) -> None:
    """vllm-omni #4008, #7822: voice-clone TTS prompts with the same text and different
    reference voices collided unless a cache_salt was set. The reference clip is an
    annotated item, so no salt is needed."""
    tokens = TEXT + [AUDIO_TOKEN] * 12 + TEXT
    a = annotate_prompt(tokens, [VOICE_A], placeholder_token_id=AUDIO_TOKEN)
    b = annotate_prompt(tokens, [VOICE_B], placeholder_token_id=AUDIO_TOKEN)
    assert flawed_chain(a, no_mm) == flawed_chain(b, no_mm)
    assert_diverge_at(keys(a, algorithm), keys(b, algorithm), 1)
    same = annotate_prompt(tokens, [(VOICE_A[0].copy(), 16_000)], placeholder_token_id=AUDIO_TOKEN)
    assert keys(same, algorithm) == keys(a, algorithm)


# -- our own cases -----------------------------------------------------------------


def test_content_offset_distinguishes_a_sliced_item(algorithm: Any) -> None:
    """The last 8 tokens of a 16-token item are not its first 8 tokens."""
    whole = annotate_prompt([IMAGE_TOKEN] * 16 + TEXT, [RED], placeholder_token_id=IMAGE_TOKEN)
    tail = whole[8:]
    head = whole[:8] + TEXT
    assert tail.tolist() == head.tolist()
    assert tail.annotations[0].content_offset == 8
    assert head.annotations[0].content_offset == 0
    assert_diverge_at(keys(tail, algorithm), keys(head, algorithm), 0)


def test_modality_same_bytes_as_image_audio_encoded_and_id(algorithm: Any) -> None:
    """The same bytes as an image array, an audio clip, an id, or hashed under two
    declared modalities are five items; as a file's bytes they are no picture and no
    clip, and are refused rather than named by their raw bytes."""
    raw = np.arange(64, dtype=np.uint8).reshape(8, 8)
    items: list[object] = [
        raw,
        (raw.reshape(-1), 16_000),
        raw.tobytes().decode("latin-1"),
        hash_bytes(raw.tobytes(), modality="image", algorithm=algorithm),
        hash_bytes(raw.tobytes(), modality="audio", algorithm=algorithm),
    ]
    tokens = TEXT + [IMAGE_TOKEN] * 8
    prompts = [
        annotate_prompt(tokens, [item], placeholder_token_id=IMAGE_TOKEN, algorithm=algorithm)
        for item in items
    ]
    assert len({bytes(d) for p in prompts for d in digests(p)}) == len(items)
    assert len({keys(p, algorithm)[1] for p in prompts}) == len(items)
    with pytest.raises(ValueError, match=r"^items\[0\]: expected an encoded image or audio"):
        annotate_prompt(tokens, [raw.tobytes()], placeholder_token_id=IMAGE_TOKEN)


def test_palette_and_transparency_are_part_of_the_digest(algorithm: Any) -> None:
    """A palette and a transparency key enter an image's content digest; its identity
    is the picture the model sees: a transparent index over white is white."""
    indices = bytes([0, 1] * 8)
    plain = Image.frombytes("P", (4, 4), indices)
    plain.putpalette([0, 0, 0, 255, 255, 255])
    repainted = Image.frombytes("P", (4, 4), indices)
    repainted.putpalette([0, 0, 0, 255, 0, 0])
    transparent = Image.frombytes("P", (4, 4), indices)
    transparent.putpalette([0, 0, 0, 255, 255, 255])
    transparent.info["transparency"] = 1
    images = (plain, repainted, transparent)
    assert len({hash_image(im, algorithm=algorithm) for im in images}) == 3
    tokens = TEXT + [IMAGE_TOKEN] * 8
    prompts = [annotate_prompt(tokens, [im], placeholder_token_id=IMAGE_TOKEN) for im in images]
    assert digests(prompts[0]) == digests(prompts[2]) != digests(prompts[1])
    see_through = transparent.copy()
    see_through.info["transparency"] = 0  # black becomes the white behind it
    assert digests(annotate_prompt(tokens, [see_through], placeholder_token_id=IMAGE_TOKEN)) != (
        digests(prompts[0])
    )


def test_dtype_same_bytes_differ(algorithm: Any) -> None:
    wave = RNG.standard_normal(64).astype(np.float32)
    clips: list[tuple[Any, int]] = [
        (wave, 16_000),
        (wave.view(np.int32), 16_000),
        (wave.view(np.uint8), 16_000),
        (wave.view(np.float16), 16_000),
        (torch.from_numpy(wave.view(np.int16).copy()).view(torch.bfloat16), 16_000),
    ]
    digests_ = {bytes(hash_audio(w, sr)) for w, sr in clips}
    assert len(digests_) == len(clips)
    tokens = TEXT + [AUDIO_TOKEN] * 8
    prompts = [annotate_prompt(tokens, [c], placeholder_token_id=AUDIO_TOKEN) for c in clips]
    assert len({keys(p, algorithm)[1] for p in prompts}) == len(clips)


def test_channel_layout_and_sample_rate_differ(algorithm: Any) -> None:
    samples = RNG.standard_normal(96).astype(np.float32)
    clips: list[tuple[Any, int]] = [
        (samples, 16_000),
        (samples.reshape(1, 96), 16_000),
        (samples.reshape(2, 48), 16_000),
        (samples.reshape(48, 2), 16_000),
        (samples.reshape(3, 32), 16_000),
        (samples, 8_000),
    ]
    pixels = np.arange(24, dtype=np.uint8)
    images = [pixels.reshape(2, 3, 4), pixels.reshape(2, 4, 3), pixels.reshape(4, 3, 2)]
    tokens = TEXT + [AUDIO_TOKEN] * 8
    prompts = [annotate_prompt(tokens, [c], placeholder_token_id=AUDIO_TOKEN) for c in clips]
    prompts += [annotate_prompt(tokens, [im], placeholder_token_id=AUDIO_TOKEN) for im in images]
    assert len({bytes(d) for p in prompts for d in digests(p)}) == len(clips) + len(images)
    assert len({keys(p, algorithm)[1] for p in prompts}) == len(clips) + len(images)


def test_processing_context_changes_the_key(algorithm: Any) -> None:
    tokens = TEXT + [IMAGE_TOKEN] * 8
    contexts: list[dict[str, Any] | None] = [
        None,
        {"model": "m-7b"},
        {"model": "m-13b"},
        {"model": "m-7b", "max_pixels": 1024},
        {"model": "m-7b", "max_pixels": 2048},
    ]
    prompts = [
        annotate_prompt(tokens, [RED], placeholder_token_id=IMAGE_TOKEN, context=c)
        for c in contexts
    ]
    assert len({keys(p, algorithm)[1] for p in prompts}) == len(contexts)
    none = annotate_prompt(tokens, [RED], placeholder_token_id=IMAGE_TOKEN, context=None)
    empty = annotate_prompt(tokens, [RED], placeholder_token_id=IMAGE_TOKEN, context={})
    assert keys(none, algorithm) == keys(empty, algorithm)


def test_identifier_namespaces_are_framed(algorithm: Any) -> None:
    pairs = [("a", "bc"), ("ab", "c"), ("", "abc"), ("abc", ""), ("default", "abc")]
    tokens = TEXT + [IMAGE_TOKEN] * 8
    prompts = [
        annotate_prompt(
            tokens,
            [ident or "-"],
            placeholder_token_id=IMAGE_TOKEN,
            identifier_namespace=namespace,
        )
        for namespace, ident in pairs
    ]
    assert len({bytes(d) for p in prompts for d in digests(p)}) == len(pairs)
    assert len({keys(p, algorithm)[1] for p in prompts}) == len(pairs)


def test_annotated_run_differs_from_the_same_ids_as_text(algorithm: Any) -> None:
    """Placeholder ids without an annotation (a text prompt that happens to contain
    them) never share a key with an annotated run."""
    tokens = TEXT + [IMAGE_TOKEN] * 8
    text = annotate_prompt(tokens, [])
    image = annotate_prompt(tokens, [RED], placeholder_token_id=IMAGE_TOKEN)
    assert_diverge_at(keys(text, algorithm), keys(image, algorithm), 1)


def test_truncated_digest_is_not_the_digest() -> None:
    """Records frame the digest's length: a 16-byte prefix of a 32-byte digest (an
    xxh3_128-sized value) is another item."""
    full = bytes(range(32))
    a = AnnotatedTokens([IMAGE_TOKEN] * 8, [TokenRangeAnnotation(0, 8, full, 0, 8)])
    b = AnnotatedTokens([IMAGE_TOKEN] * 8, [TokenRangeAnnotation(0, 8, full[:16], 0, 8)])
    assert keys(a) != keys(b)
