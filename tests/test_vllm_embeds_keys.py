"""Prompt embeddings, embeddings over items, and lookahead keys, against vLLM's own keys.

Each scenario runs the same request sequence through two real vLLM
``KVCacheManager`` s (scheduler side, CPU), one whose requests carry vLLM's
own block hasher (sha256) and one whose requests carry `RequestBlockHasher`:
the hits (tokens) and the block tables must be equal, and equal to the
numbers written down here. The keys themselves are checked against
`BlockHasher` over the annotations the documentation of
``omnicache.integrations.vllm.block_hasher`` spells out. Runs on vLLM 0.33
(``.venv``) and 0.32 (the live engine's environment), but for lookahead block
hashes, which only 0.33 has.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_vllm_integration import (
    BLOCK_SIZE,
    BLUE_HEX,
    NAMESPACE,
    RED_HEX,
    VLLM_MISSING,
    image_feature,
    needs_vllm,
    recompute,
)
from vllm_harness import EngineHarness
from vllm_managers import new_kv_cache_manager

from hashing import DEFAULT_ALGORITHM, hash_array
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHasher
from omnicache.integrations.vllm import RequestBlockHasher
from omnicache.integrations.vllm.block_hasher import EMBEDS_SCHEME, prompt_embeds_digest

if VLLM_MISSING is None:
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request, RequestStatus

    IS_033 = vllm.__version__.startswith("0.33.")
else:
    IS_033 = False

pytestmark = needs_vllm
needs_lookahead = pytest.mark.skipif(
    not IS_033, reason="lookahead block hashes (num_hash_lookahead_tokens) exist in vLLM 0.33 only"
)

HIDDEN = 8
Hasher = Callable[[Any], list[Any]]


def rows(num_rows: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct embedding rows: row i of seed s is never a row of another (i, s)."""
    base = torch.arange(num_rows * HIDDEN, dtype=torch.float32).reshape(num_rows, HIDDEN)
    return (base + 1000.0 * seed).to(dtype)


def vllm_hasher(lookahead: int = 0) -> Hasher:
    """vLLM's own request block hasher (sha256, its default)."""
    kv_cache_utils.init_none_hash(sha256)
    if lookahead:
        return kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, sha256, lookahead)
    return kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, sha256)


def manager(lookahead: int = 0, num_blocks: int = 24) -> Any:
    return new_kv_cache_manager(
        num_blocks, BLOCK_SIZE, max_model_len=1024, num_hash_lookahead_tokens=lookahead
    )


def request(
    hasher: Hasher | None,
    request_id: str,
    *,
    token_ids: list[int] | None = None,
    embeds: torch.Tensor | None = None,
    is_token_ids: list[bool] | None = None,
    features: list[Any] | None = None,
    cache_salt: str | None = None,
) -> Any:
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        prompt_embeds=embeds,
        prompt_is_token_ids=is_token_ids,
        mm_features=features,
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=hasher,
    )


class Side:
    """One KV cache manager and the block hasher its requests carry."""

    def __init__(self, hasher: Hasher, lookahead: int = 0) -> None:
        self.hasher = hasher
        self.manager = manager(lookahead)

    def run(self, request_id: str, **kwargs: Any) -> tuple[int, list[int]]:
        """Admit, compute the whole prompt, finish: the hit tokens and the block table."""
        req = request(self.hasher, request_id, **kwargs)
        blocks, num_hit, *_ = self.manager.get_computed_blocks(req)
        allocated = self.manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
        assert allocated is not None
        block_ids = list(self.manager.get_block_ids(request_id)[0])
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.FINISHED_STOPPED
        self.manager.free(req)
        return num_hit, block_ids


def omni_hasher(lookahead: int = 0) -> RequestBlockHasher:
    return RequestBlockHasher(BLOCK_SIZE, namespace=NAMESPACE, lookahead=lookahead)


def run_both(scenario: list[tuple[str, dict[str, Any]]], lookahead: int = 0) -> list[Any]:
    """Runs ``scenario`` on vLLM's keys and on omnicache's; returns the common results."""
    ours = Side(omni_hasher(lookahead), lookahead)
    theirs = Side(vllm_hasher(lookahead), lookahead)
    found = [ours.run(request_id, **kwargs) for request_id, kwargs in scenario]
    expected = [theirs.run(request_id, **kwargs) for request_id, kwargs in scenario]
    assert found == expected
    return found


def piece(lo: int, hi: int, embeds: torch.Tensor) -> TokenRangeAnnotation:
    """The annotation of embedding rows ``[lo, hi)`` over no item."""
    digest = prompt_embeds_digest(embeds[lo:hi], algorithm=DEFAULT_ALGORITHM)
    return TokenRangeAnnotation(lo, hi - lo, digest, 0, hi - lo)


def keys(token_ids: list[int], annotations: list[TokenRangeAnnotation], **kwargs: Any) -> list[Any]:
    hasher = BlockHasher(BLOCK_SIZE, namespace=NAMESPACE, **kwargs)
    return hasher.hash_blocks(AnnotatedTokens(token_ids, annotations))


# -- prompt embeddings, one digest per block of rows --------------------------------------


def test_embeddings_are_keyed_one_block_of_rows_at_a_time() -> None:
    embeds = rows(40, seed=1)
    req = request(omni_hasher(), "a", embeds=embeds)
    expected = [piece(0, 16, embeds), piece(16, 32, embeds), piece(32, 40, embeds)]
    assert omni_hasher().annotations(req) == tuple(expected)
    assert req.block_hashes == keys([0] * 40, expected)
    # The digest is hash_array under the embeddings' context, with dtype and shape.
    assert expected[0].content_hash == hash_array(
        embeds[:16], context={"scheme": EMBEDS_SCHEME, "item": None}
    )


def test_multi_turn_embeddings_share_blocks_as_in_vllm() -> None:
    first = rows(40, seed=1)
    scenario = [
        ("turn-1", {"embeds": first}),
        # The next turn: the same 40 rows, then 10 more.
        ("turn-2", {"embeds": torch.cat([first, rows(10, seed=2)])}),
        # The same prompt again: both full blocks (the last token is always computed).
        ("again", {"embeds": first.clone()}),
        ("other-salt", {"embeds": first.clone(), "cache_salt": "tenant-b"}),
        ("bf16", {"embeds": first.to(torch.bfloat16)}),
        ("other-rows", {"embeds": rows(40, seed=3)}),
    ]
    # Block tables as vLLM hands out blocks: a freed request's blocks return
    # to the free queue tail first, and a hit takes its blocks out of it.
    assert run_both(scenario) == [
        (0, [1, 2, 3]),
        (32, [1, 2, 3, 4]),
        (32, [1, 2, 4]),
        (0, [4, 5, 6]),
        (0, [6, 7, 8]),
        (0, [8, 9, 10]),
    ]


@pytest.mark.parametrize(
    ("changed_row", "num_hit"), [(0, 0), (15, 0), (16, 16), (31, 16), (32, 32), (39, 32)]
)
def test_a_changed_row_changes_its_block_and_later_ones(changed_row: int, num_hit: int) -> None:
    embeds = rows(48, seed=1)
    changed = embeds.clone()
    changed[changed_row, 3] += 0.5
    hasher = omni_hasher()
    base = request(hasher, "a", embeds=embeds).block_hashes
    other = request(hasher, "b", embeds=changed).block_hashes
    block = changed_row // BLOCK_SIZE
    assert other[:block] == base[:block]
    assert all(a != b for a, b in zip(base[block:], other[block:], strict=True))
    scenario = [("a", {"embeds": embeds}), ("b", {"embeds": changed})]
    num_blocks_hit = num_hit // BLOCK_SIZE
    table = [1, 2, 3][:num_blocks_hit] + [4, 5, 6][: 3 - num_blocks_hit]
    assert run_both(scenario) == [(0, [1, 2, 3]), (num_hit, table)]


def test_mixed_prompts_key_embedding_positions_by_rows_and_others_by_token_ids() -> None:
    # Text, then 12 positions filled from embeddings, then text: 48 tokens.
    text = list(range(1, 49))
    mask = [True] * 10 + [False] * 12 + [True] * 26
    embeds = torch.zeros(48, HIDDEN)  # as vLLM's renderer builds it: zeros at token ids
    embeds[10:22] = rows(12, seed=1)
    req = request(omni_hasher(), "a", token_ids=text, embeds=embeds, is_token_ids=mask)
    # vLLM zeroes the token ids of the positions filled from the embeddings.
    assert list(req.all_token_ids) == text[:10] + [0] * 12 + text[22:]
    expected = [piece(10, 16, embeds), piece(16, 22, embeds)]
    assert omni_hasher().annotations(req) == tuple(expected)
    assert req.block_hashes == keys(req.all_token_ids, expected)
    other_embeds = embeds.clone()
    other_embeds[20] += 1.0
    other_text = [*text[:40], 999, *text[41:]]
    scenario = [
        ("a", {"token_ids": text, "embeds": embeds, "is_token_ids": mask}),
        ("same", {"token_ids": text, "embeds": embeds.clone(), "is_token_ids": mask}),
        ("rows", {"token_ids": text, "embeds": other_embeds, "is_token_ids": mask}),
        ("text", {"token_ids": other_text, "embeds": embeds, "is_token_ids": mask}),
    ]
    assert run_both(scenario) == [
        (0, [1, 2, 3]),
        (32, [1, 2, 4]),
        (16, [1, 5, 6]),
        (32, [1, 2, 7]),
    ]


def test_rows_at_token_id_positions_are_not_keyed_unlike_vllm() -> None:
    """vLLM digests every row of a block; the model reads token ids where the mask says so."""
    text = list(range(1, 49))
    mask = [True] * 10 + [False] * 12 + [True] * 26
    embeds = torch.zeros(48, HIDDEN)
    embeds[10:22] = rows(12, seed=1)
    stray = embeds.clone()
    stray[3] = 7.0  # a token-id position: the model never reads this row
    scenario = [
        ("a", {"token_ids": text, "embeds": embeds, "is_token_ids": mask}),
        ("stray", {"token_ids": text, "embeds": stray, "is_token_ids": mask}),
    ]
    ours, theirs = Side(omni_hasher()), Side(vllm_hasher())
    assert [ours.run(name, **kwargs) for name, kwargs in scenario] == [
        (0, [1, 2, 3]),
        (32, [1, 2, 4]),
    ]
    assert [theirs.run(name, **kwargs) for name, kwargs in scenario] == [
        (0, [1, 2, 3]),
        (0, [4, 5, 6]),
    ]


def test_bad_embeddings_are_refused_with_what_was_expected() -> None:
    with pytest.raises(
        ValueError,
        match=r"^prompt_is_token_ids: expected 20 flags \(one per prompt token\), found 19$",
    ):
        request(
            omni_hasher(), "m", token_ids=[1] * 20, embeds=rows(20, 1), is_token_ids=[True] * 19
        )
    with pytest.raises(
        ValueError,
        match=r"^prompt_embeds: expected shape \(16, hidden_size\) \(one row per prompt token\), "
        r"found \(16,\)$",
    ):
        request(omni_hasher(), "s", embeds=torch.zeros(16))


# -- embeddings and an item over the same positions ----------------------------------------


def both(lo: int, hi: int, embeds: torch.Tensor, item_hex: str, item_lo: int, length: int) -> Any:
    """The annotation of rows ``[lo, hi)`` over an item at ``item_lo`` of ``length`` tokens."""
    item = bytes.fromhex(item_hex)
    digest = prompt_embeds_digest(embeds[lo:hi], item=item, algorithm=DEFAULT_ALGORITHM)
    return TokenRangeAnnotation(lo, hi - lo, digest, lo - item_lo, length)


def test_embeddings_over_an_item_name_both() -> None:
    embeds = rows(56, seed=1)
    req = request(omni_hasher(), "a", embeds=embeds, features=[image_feature(RED_HEX, 20, 20)])
    assert omni_hasher().annotations(req) == (
        piece(0, 16, embeds),
        piece(16, 20, embeds),
        both(20, 32, embeds, RED_HEX, 20, 20),
        both(32, 40, embeds, RED_HEX, 20, 20),
        piece(40, 48, embeds),
        piece(48, 56, embeds),
    )
    annotations = list(omni_hasher().annotations(req))
    assert req.block_hashes == keys([0] * 56, annotations)
    # An item's rows digest is bound to the item: not the rows' digest alone.
    assert annotations[2].content_hash != prompt_embeds_digest(
        embeds[20:32], algorithm=DEFAULT_ALGORITHM
    )


def test_embeddings_over_an_item_share_blocks_as_in_vllm() -> None:
    embeds = rows(56, seed=1)
    late = embeds.clone()
    late[44] += 1.0  # in block 2, after the image
    red = [image_feature(RED_HEX, 20, 20)]
    scenario = [
        ("a", {"embeds": embeds, "features": red}),
        ("same", {"embeds": embeds.clone(), "features": red}),
        ("image", {"embeds": embeds, "features": [image_feature(BLUE_HEX, 20, 20)]}),
        ("rows", {"embeds": late, "features": red}),
        ("no-image", {"embeds": embeds}),
    ]
    assert run_both(scenario) == [
        (0, [1, 2, 3, 4]),
        (48, [1, 2, 3, 4]),
        (16, [1, 4, 5, 6]),
        (32, [1, 2, 6, 7]),
        (16, [1, 7, 8, 9]),
    ]
    hasher = omni_hasher()
    keyed = {name: request(hasher, name, **kwargs).block_hashes for name, kwargs in scenario}
    assert keyed["same"] == keyed["a"]
    assert keyed["image"][0] == keyed["a"][0]
    assert set(keyed["image"][1:]).isdisjoint(keyed["a"])
    assert keyed["rows"][:2] == keyed["a"][:2] and keyed["rows"][2] != keyed["a"][2]


def test_item_placeholders_that_are_token_ids_keep_their_item_annotation() -> None:
    # Image placeholders are token ids; the embeddings fill positions 40..47 only.
    prompt = list(range(1, 17)) + [32_000] * 24 + [7] * 8
    mask = [True] * 40 + [False] * 8
    embeds = torch.zeros(48, HIDDEN)
    embeds[40:48] = rows(8, seed=1)
    req = request(
        omni_hasher(),
        "a",
        token_ids=prompt,
        embeds=embeds,
        is_token_ids=mask,
        features=[image_feature(RED_HEX, 16, 24)],
    )
    image = TokenRangeAnnotation(16, 24, bytes.fromhex(RED_HEX), 0, 24)
    assert omni_hasher().annotations(req) == (image, piece(40, 48, embeds))
    # vLLM zeroes the token ids of the positions filled from the embeddings.
    assert list(req.all_token_ids) == prompt[:40] + [0] * 8
    assert req.block_hashes == keys(req.all_token_ids, [image, piece(40, 48, embeds)])


# -- lookahead block hashes (vLLM 0.33) ------------------------------------------------------


def lookahead_key(parent: bytes, window: list[int]) -> bytes:
    """key(i) from the documented bytes: sha256(parent | window token ids as u32)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(window)}I", *window)).digest()


def test_lookahead_keys_follow_the_documented_bytes() -> None:
    def field(tag: int, kind: int, payload: bytes) -> bytes:
        return struct.pack("<BBI", tag, kind, len(payload)) + payload

    root = hashlib.sha256(
        field(1, 1, b"omnicache.block/v1")
        + field(2, 1, b"sha256")
        + field(3, 1, NAMESPACE.encode())
        + field(4, 0, b"")
        + field(5, 0, b"")
        + field(6, 2, struct.pack("<Q", BLOCK_SIZE))
        + field(7, 2, struct.pack("<Q", 3))
    ).digest()
    hasher = BlockHasher(BLOCK_SIZE, namespace=NAMESPACE, lookahead=3)
    assert hasher.root == root
    tokens = list(range(100, 150))  # 50 tokens: block 2 would need token 50
    key0 = lookahead_key(root, tokens[0:19])
    key1 = lookahead_key(key0, tokens[16:35])
    key2 = lookahead_key(key1, [*tokens[32:50], 1])
    assert hasher.hash_blocks(tokens) == [key0, key1]
    assert hasher.hash_blocks([*tokens, 1]) == [key0, key1, key2]
    # No lookahead: the root and the keys are those of scheme v1 as before.
    assert BlockHasher(BLOCK_SIZE, namespace=NAMESPACE).root != root


def test_a_lookahead_manager_exists_on_vllm_033_only() -> None:
    if IS_033:
        assert manager(lookahead=3).block_pool.num_hash_lookahead_tokens == 3
    else:
        with pytest.raises(ValueError) as raised:
            manager(lookahead=3)
        assert str(raised.value) == (
            "num_hash_lookahead_tokens: expected 0 (vLLM 0.32.x has no lookahead block "
            "hashes), found 3"
        )
    with pytest.raises(ValueError) as raised:
        manager(lookahead=-1)
    assert str(raised.value) == "num_hash_lookahead_tokens: expected int >= 0, found -1"


@needs_lookahead
@pytest.mark.parametrize("lookahead", [1, 3, 16])
def test_lookahead_keys_appear_when_vllms_do(lookahead: int) -> None:
    prompt = list(range(1, 31)) + [32_000] * 12 + list(range(300, 318))  # 60 tokens
    features = [image_feature(RED_HEX, 30, 12)]
    ours = request(omni_hasher(lookahead), "a", token_ids=prompt, features=features)
    theirs = request(vllm_hasher(lookahead), "a", token_ids=prompt, features=features)
    counts = [(len(ours.block_hashes), len(theirs.block_hashes))]
    for token in range(40):
        ours.append_output_token_ids(token)
        theirs.append_output_token_ids(token)
        counts.append((len(ours.block_hashes), len(theirs.block_hashes)))
    assert [a for a, _ in counts] == [b for _, b in counts]
    assert counts[0][0] == (60 - lookahead) // BLOCK_SIZE
    assert counts[-1][0] == (100 - lookahead) // BLOCK_SIZE
    # The keys are BlockHasher's with the same lookahead, over the annotated tokens.
    image = TokenRangeAnnotation(30, 12, bytes.fromhex(RED_HEX), 0, 12)
    hasher = BlockHasher(BLOCK_SIZE, namespace=NAMESPACE, lookahead=lookahead)
    assert ours.block_hashes == hasher.hash_blocks(AnnotatedTokens(ours.all_token_ids, [image]))


@needs_lookahead
@pytest.mark.parametrize("lookahead", [1, 3])
def test_lookahead_hits_equal_vllms(lookahead: int) -> None:
    text = list(range(1, 49))
    embeds = rows(64, seed=1)
    next_block_differs = [*text[:32], 999, *text[33:]]
    red_at_32 = [*text[:32], *([32_000] * 8), *text[40:]]
    scenario = [
        ("a", {"token_ids": text}),
        # Same first two blocks, but token 32 (in block 1's lookahead) differs.
        ("next", {"token_ids": next_block_differs}),
        ("again", {"token_ids": [*text, 5, 6, 7]}),
        # An image that starts at token 32: block 1's key covers it.
        ("red", {"token_ids": red_at_32, "features": [image_feature(RED_HEX, 32, 8)]}),
        ("blue", {"token_ids": red_at_32, "features": [image_feature(BLUE_HEX, 32, 8)]}),
        ("embeds", {"embeds": embeds}),
        # Row 40 differs: in block 2, past the windows of blocks 0 and 1.
        ("embeds-late", {"embeds": torch.cat([embeds[:40], rows(24, seed=2)])}),
    ]
    assert run_both(scenario, lookahead) == [
        (0, [1, 2, 3]),
        (16, [1, 3, 4]),
        (32, [1, 2, 4, 5]),
        (16, [1, 5, 6]),
        (16, [1, 6, 7]),
        (0, [7, 8, 9, 10]),
        (32, [7, 8, 10, 11]),
    ]


@needs_lookahead
def test_lookahead_hits_serve_stored_rows_exactly() -> None:
    """The worker stamps a block once its lookahead key exists, and hits read it back."""
    h = EngineHarness(manager(1), lambda r: recompute(r)["hidden_states"], HIDDEN)
    hasher = omni_hasher(1)

    def run(request_id: str, token_ids: list[int]) -> tuple[int, list[int]]:
        req = request(hasher, request_id, token_ids=token_ids)
        num_hit, _, rows = h.run(req)
        assert rows is not None
        assert torch.equal(rows, recompute(req)["hidden_states"])
        stamped = [b for b in range(1, 8) if h.store.stamp_of("hidden_states", b) is not None]
        assert stamped == [b for b in range(1, 8) if h.mirror.table.stamps[b] is not None]
        return num_hit, stamped

    text = list(range(1, 49))
    # 48 tokens: block 2 has no key yet (it needs token 48), so it is not stamped.
    assert run("a", text) == (0, [1, 2])
    assert run("b", [*text, 5, 6]) == (32, [1, 2, 3])
    assert run("c", [*text[:32], *([99] * 16)]) == (16, [1, 2, 3, 4])
