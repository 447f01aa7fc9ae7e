"""BlockHasher: the documented bytes, golden vectors, known collisions, chaining, errors."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ids_and_annotations

from omnicache.annotations import MAX_TOKEN_ID, AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import (
    DEFAULT_BLOCK_ALGORITHM,
    SCHEME,
    BlockHash,
    BlockHasher,
    block_hash_hex,
    block_hash_low64,
)

T = TokenRangeAnnotation
ALGORITHMS = ("sha256", "blake3", "xxh3_128")
VECTORS = Path(__file__).parent / "vectors" / "block_v1.json"
IMAGE_A = hashlib.sha256(b"image a").digest()
IMAGE_B = hashlib.sha256(b"image b").digest()
AUDIO = hashlib.sha256(b"audio").digest()
P_IMG, P_AUD = 32000, 32001  # placeholder ids


# --- an independent statement of the documented layout ------------------------------------


def _digest(algorithm: str, data: bytes) -> bytes:
    if algorithm == "sha256":
        return hashlib.sha256(data).digest()
    if algorithm == "blake3":
        return bytes(blake3.blake3(data).digest())
    return bytes(xxhash.xxh3_128_digest(data))


def _field(tag: int, value: str | int | None) -> bytes:
    if value is None:
        return bytes([tag, 0, 0, 0, 0, 0])
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return bytes([tag, 1]) + len(raw).to_bytes(4, "little") + raw
    return bytes([tag, 2]) + (8).to_bytes(4, "little") + value.to_bytes(8, "little")


def reference_root(
    block_size: int, algorithm: str, namespace: str, salt: str | None, adapter: str | None
) -> bytes:
    fields = [SCHEME, algorithm, namespace, salt, adapter, block_size]
    return _digest(algorithm, b"".join(_field(tag, v) for tag, v in enumerate(fields, start=1)))


def reference_keys(hasher: BlockHasher, tokens: AnnotatedTokens) -> list[bytes]:
    parent = reference_root(
        hasher.block_size, hasher.algorithm, hasher.namespace, hasher.cache_salt, hasher.adapter
    )
    keys = []
    for block in tokens.blocks(hasher.block_size):
        data = parent + b"".join(t.to_bytes(4, "little") for t in block.token_ids)
        for a in block.annotations:
            data += struct.pack(
                "<5I",
                a.token_index,
                a.token_count,
                a.content_offset,
                a.content_length,
                len(a.content_hash),
            )
            data += a.content_hash
        parent = _digest(hasher.algorithm, data)
        keys.append(parent)
    return keys


@st.composite
def annotated(draw: st.DrawFn, max_tokens: int = 100) -> AnnotatedTokens:
    ids, anns = draw(
        ids_and_annotations(
            max_tokens=max_tokens,
            token_ids=st.one_of(st.integers(0, 9), st.just(MAX_TOKEN_ID)),
            digests=st.sampled_from([IMAGE_A, IMAGE_B, AUDIO[:16]]),
            max_pad=3,
        )
    )
    return AnnotatedTokens(ids, anns)


# --- exact bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=40, deadline=None)
@given(tokens=annotated(), block_size=st.integers(1, 9))
def test_keys_are_the_digests_of_the_documented_bytes(
    algorithm: str, tokens: AnnotatedTokens, block_size: int
) -> None:
    hasher = BlockHasher(block_size, algorithm=algorithm, namespace="m", cache_salt="s")  # type: ignore[arg-type]
    assert hasher.hash_blocks(tokens) == reference_keys(hasher, tokens)


def test_root_layout_exact() -> None:
    hasher = BlockHasher(16)
    expected_preimage = (
        b"\x01\x01\x12\x00\x00\x00omnicache.block/v1"
        b"\x02\x01\x06\x00\x00\x00sha256"
        b"\x03\x01\x00\x00\x00\x00"
        b"\x04\x00\x00\x00\x00\x00"
        b"\x05\x00\x00\x00\x00\x00"
        b"\x06\x02\x08\x00\x00\x00\x10\x00\x00\x00\x00\x00\x00\x00"
    )
    assert hasher.root == hashlib.sha256(expected_preimage).digest()


def test_block_layout_exact() -> None:
    hasher = BlockHasher(2)
    tokens = AnnotatedTokens([1, 258], [T(1, 1, b"\xaa\xbb", 3, 9)])
    expected = hashlib.sha256(
        hasher.root
        + b"\x01\x00\x00\x00\x02\x01\x00\x00"
        + b"\x01\x00\x00\x00\x01\x00\x00\x00\x03\x00\x00\x00\x09\x00\x00\x00\x02\x00\x00\x00"
        + b"\xaa\xbb"
    ).digest()
    assert hasher.hash_blocks(tokens) == [expected]


def _load_vectors() -> list[dict[str, Any]]:
    data = json.loads(VECTORS.read_text(encoding="utf-8"))
    assert data["scheme"] == SCHEME == "omnicache.block/v1"
    cases: list[dict[str, Any]] = data["cases"]
    return cases


@pytest.mark.parametrize("vector", _load_vectors(), ids=lambda v: v["name"])
def test_golden_vectors(vector: dict[str, Any]) -> None:
    config = vector["config"]
    hasher = BlockHasher(
        config["block_size"],
        algorithm=config["algorithm"],
        namespace=config["namespace"],
        cache_salt=config["cache_salt"],
        adapter=config["adapter"],
    )
    anns = [
        T(
            a["token_index"],
            a["token_count"],
            bytes.fromhex(a["content_hash"]),
            a["content_offset"],
            a["content_length"],
        )
        for a in vector["annotations"]
    ]
    tokens = AnnotatedTokens(vector["token_ids"], anns)
    algorithm = config["algorithm"]
    root_preimage = bytes.fromhex(vector["root_preimage"])
    assert root_preimage == b"".join(
        _field(tag, config[name]) if name != "scheme" else _field(tag, SCHEME)
        for tag, name in enumerate(
            ("scheme", "algorithm", "namespace", "cache_salt", "adapter", "block_size"), start=1
        )
    )
    assert _digest(algorithm, root_preimage).hex() == vector["root"] == hasher.root.hex()
    keys = hasher.hash_blocks(tokens)
    assert [block_hash_hex(k) for k in keys] == [b["key"] for b in vector["blocks"]]
    for block in vector["blocks"]:
        assert _digest(algorithm, bytes.fromhex(block["preimage"])).hex() == block["key"]
    assert reference_keys(hasher, tokens) == keys
    assert block_hash_low64(keys[-1]) == vector["last_key_low64"]


def test_golden_vector_file_is_current() -> None:
    script = Path(__file__).parent.parent / "scripts" / "make_block_vectors.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_keys_do_not_depend_on_the_process() -> None:
    code = (
        "from omnicache.block_hash import BlockHasher\n"
        "from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation as T\n"
        "import sys\n"
        "t = AnnotatedTokens(range(40), [T(3, 20, bytes(32), 1, 30)])\n"
        "k = BlockHasher(8, namespace='m', cache_salt='s').hash_blocks(t)\n"
        "print(k[-1].hex(), 'torch' in sys.modules)\n"
    )
    outputs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        outputs.add(out.stdout)
    tokens = AnnotatedTokens(range(40), [T(3, 20, bytes(32), 1, 30)])
    here = BlockHasher(8, namespace="m", cache_salt="s").hash_blocks(tokens)[-1].hex()
    assert outputs == {f"{here} False\n"}


# --- known collisions, shown not to collide -------------------------------------------------


def test_same_tokens_different_image() -> None:
    hasher = BlockHasher(4)
    ids = [1, P_IMG, P_IMG, P_IMG, P_IMG, 2, 3, 4]
    with_a = AnnotatedTokens(ids, [T(1, 4, IMAGE_A, 0, 4)])
    with_b = AnnotatedTokens(ids, [T(1, 4, IMAGE_B, 0, 4)])
    keys_a, keys_b = hasher.hash_blocks(with_a), hasher.hash_blocks(with_b)
    assert keys_a[0] != keys_b[0]
    assert keys_a[1] != keys_b[1]
    assert hasher.hash_blocks(AnnotatedTokens(ids))[0] not in (keys_a[0], keys_b[0])


def test_same_image_at_different_positions_in_all_placeholder_blocks() -> None:
    # Every block is all placeholders in both prompts; only the image's alignment
    # differs (vLLM once dropped the offset and collided here, PR #36708).
    hasher = BlockHasher(8)
    ids = [P_IMG] * 32
    at_2 = AnnotatedTokens(ids, [T(2, 12, IMAGE_A, 0, 12), T(18, 12, IMAGE_A, 0, 12)])
    at_4 = AnnotatedTokens(ids, [T(4, 12, IMAGE_A, 0, 12), T(16, 12, IMAGE_A, 0, 12)])
    keys_2, keys_4 = hasher.hash_blocks(at_2), hasher.hash_blocks(at_4)
    assert len(keys_2) == len(keys_4) == 4
    for k2, k4 in zip(keys_2, keys_4, strict=True):
        assert k2 != k4


def test_same_item_hash_with_different_item_lengths() -> None:
    # 8 text tokens + a whole 8-token item, versus 8 text tokens + the first 8
    # tokens of a 16-token item: identical block tokens and item hash.
    hasher = BlockHasher(16)
    ids = [7] * 8 + [P_IMG] * 8
    short_item = AnnotatedTokens(ids, [T(8, 8, IMAGE_A, 0, 8)])
    long_item = AnnotatedTokens([*ids, *[P_IMG] * 8], [T(8, 16, IMAGE_A, 0, 16)])
    assert short_item.tolist() == long_item.tolist()[:16]
    assert hasher.hash_blocks(short_item)[0] != hasher.hash_blocks(long_item)[0]


def test_image_then_audio_versus_audio_then_image() -> None:
    hasher = BlockHasher(8)
    ids = [P_IMG] * 8
    image_first = AnnotatedTokens(ids, [T(0, 4, IMAGE_A, 0, 4), T(4, 4, AUDIO, 0, 4)])
    audio_first = AnnotatedTokens(ids, [T(0, 4, AUDIO, 0, 4), T(4, 4, IMAGE_A, 0, 4)])
    assert hasher.hash_blocks(image_first) != hasher.hash_blocks(audio_first)


def test_salt_a_versus_salt_b() -> None:
    tokens = AnnotatedTokens(range(32))
    keys_a = BlockHasher(16, cache_salt="tenant-a").hash_blocks(tokens)
    keys_b = BlockHasher(16, cache_salt="tenant-b").hash_blocks(tokens)
    assert keys_a[0] != keys_b[0]
    assert keys_a[1] != keys_b[1]


def test_adapter_and_salt_with_the_same_string() -> None:
    tokens = AnnotatedTokens(range(16))
    as_salt = BlockHasher(16, cache_salt="x")
    as_adapter = BlockHasher(16, adapter="x")
    assert as_salt.root != as_adapter.root
    assert as_salt.hash_blocks(tokens) != as_adapter.hash_blocks(tokens)


def test_two_namespaces() -> None:
    tokens = AnnotatedTokens(range(16))
    model_a = BlockHasher(16, namespace="org/model-a")
    model_b = BlockHasher(16, namespace="org/model-b")
    assert model_a.hash_blocks(tokens) != model_b.hash_blocks(tokens)


def test_none_differs_from_empty_string() -> None:
    roots = {
        BlockHasher(16).root,
        BlockHasher(16, cache_salt="").root,
        BlockHasher(16, adapter="").root,
        BlockHasher(16, cache_salt="", adapter="").root,
    }
    assert len(roots) == 4


def test_block_size_and_algorithm_are_in_the_root() -> None:
    roots = {BlockHasher(bs, algorithm=alg).root for bs in (8, 16) for alg in ALGORITHMS}  # type: ignore[arg-type]
    assert len(roots) == 6


def test_framing_keeps_split_strings_apart() -> None:
    # Concatenated without framing, ("ab", "c") and ("a", "bc") would be one string.
    assert BlockHasher(16, namespace="ab", cache_salt="c").root != (
        BlockHasher(16, namespace="a", cache_salt="bc").root
    )


# --- the prefix property and incremental hashing ----------------------------------------------


def _prompt(num_tokens: int = 64) -> AnnotatedTokens:
    ids = [(i * 37) % 1000 for i in range(num_tokens)]
    return AnnotatedTokens(ids, [T(5, 20, IMAGE_A, 0, 20), T(30, 9, AUDIO, 2, 11)])


def test_equal_prefixes_give_equal_keys() -> None:
    hasher = BlockHasher(8)
    prompt = _prompt()
    keys = hasher.hash_blocks(prompt)
    assert len(keys) == 8
    for stop in range(0, 65):
        assert hasher.hash_blocks(prompt[:stop]) == keys[: stop // 8]
    other = prompt[:40] + [999] * 24
    assert hasher.hash_blocks(other)[:5] == keys[:5]


@pytest.mark.parametrize("block", range(8))
def test_a_change_in_block_i_changes_keys_from_i_on_and_no_earlier(block: int) -> None:
    hasher = BlockHasher(8)
    prompt = _prompt()
    keys = hasher.hash_blocks(prompt)
    ids = prompt.tolist()
    ids[block * 8 + 3] += 1
    changed = hasher.hash_blocks(AnnotatedTokens(ids, prompt.annotations))
    assert changed[:block] == keys[:block]
    for i in range(block, 8):
        assert changed[i] != keys[i]


def test_a_changed_annotation_changes_keys_from_its_first_block_on() -> None:
    hasher = BlockHasher(8)
    prompt = _prompt()
    keys = hasher.hash_blocks(prompt)
    anns = list(prompt.annotations)
    anns[1] = anns[1]._replace(content_offset=1)  # tokens 30..38: blocks 3 and 4
    changed = hasher.hash_blocks(AnnotatedTokens(prompt.tolist(), anns))
    assert changed[:3] == keys[:3]
    assert all(c != k for c, k in zip(changed[3:], keys[3:], strict=True))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_incremental_hashing_equals_batch_hashing(algorithm: str) -> None:
    hasher = BlockHasher(8, algorithm=algorithm, namespace="m")  # type: ignore[arg-type]
    prompt = _prompt()
    keys = hasher.hash_blocks(prompt)
    for k in range(1, 8):
        assert hasher.hash_blocks(prompt, parent=keys[k - 1], start_block=k) == keys[k:]
        assert hasher.hash_blocks(prompt[k * 8 :], parent=keys[k - 1]) == keys[k:]
    assert hasher.hash_blocks(prompt, parent=keys[-1], start_block=8) == []
    assert hasher.hash_blocks(prompt, parent=hasher.root) == keys


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_decode_appends_hash_only_new_blocks_and_equal_batch(algorithm: str) -> None:
    hasher = BlockHasher(8, algorithm=algorithm)  # type: ignore[arg-type]
    prompt = _prompt()[:21]
    tokens = prompt
    keys: list[BlockHash] = hasher.hash_new_blocks(tokens, [])
    assert keys == hasher.hash_blocks(prompt)
    new_per_step = []
    for step in range(43):
        tokens = tokens.extend([1000 + step])
        new = hasher.hash_new_blocks(tokens, keys)
        new_per_step.append(len(new))
        keys = keys + new
    assert len(tokens) == 64
    assert keys == hasher.hash_blocks(tokens)
    # Blocks fill at lengths 24, 32, ..., 64: steps 2, 10, 18, 26, 34, 42.
    assert [i for i, n in enumerate(new_per_step) if n] == [2, 10, 18, 26, 34, 42]
    assert set(new_per_step) == {0, 1}


def test_hash_new_blocks_after_a_long_append() -> None:
    hasher = BlockHasher(8)
    prompt = _prompt()
    keys = hasher.hash_blocks(prompt[:20])
    assert hasher.hash_new_blocks(prompt, keys) == hasher.hash_blocks(prompt)[2:]


@settings(max_examples=40, deadline=None)
@given(tokens=annotated(), block_size=st.integers(1, 9), cut=st.integers(0, 20))
def test_incremental_equals_batch_property(
    tokens: AnnotatedTokens, block_size: int, cut: int
) -> None:
    hasher = BlockHasher(block_size)
    keys = hasher.hash_blocks(tokens)
    k = min(cut, len(keys))
    parent = keys[k - 1] if k else None
    assert hasher.hash_blocks(tokens, parent=parent, start_block=k) == keys[k:]
    assert hasher.hash_new_blocks(tokens, keys[:k]) == keys[k:]


def test_plain_token_lists_are_accepted() -> None:
    hasher = BlockHasher(4)
    assert hasher.hash_blocks([1, 2, 3, 4, 5]) == hasher.hash_blocks(AnnotatedTokens(range(1, 6)))
    assert len(hasher.hash_blocks([1, 2, 3])) == 0


# --- configuration and errors -----------------------------------------------------------------


def test_default_configuration() -> None:
    hasher = BlockHasher()
    assert hasher.block_size == 16
    assert hasher.algorithm == DEFAULT_BLOCK_ALGORITHM == "sha256"
    assert hasher.digest_size == 32
    assert hasher.namespace == ""
    assert hasher.cache_salt is None
    assert hasher.adapter is None
    assert BlockHasher(algorithm="xxh3_128").digest_size == 16
    assert len(BlockHasher(algorithm="xxh3_128").root) == 16


def test_repr_hides_the_salt() -> None:
    assert repr(BlockHasher(8, namespace="m", cache_salt="secret", adapter="lora-1")) == (
        "BlockHasher(block_size=8, algorithm='sha256', namespace='m', cache_salt=<set>, "
        "adapter='lora-1')"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"block_size": 0}, ValueError, "block_size: expected int in [1, 4294967295], found 0"),
        ({"block_size": 4.0}, TypeError, "block_size: expected int, found float"),
        ({"block_size": True}, TypeError, "block_size: expected int, found bool"),
        (
            {"algorithm": "md5"},
            ValueError,
            "algorithm: expected one of blake3, sha256, xxh3_128, found 'md5'",
        ),
        ({"namespace": None}, TypeError, "namespace: expected str, found NoneType"),
        ({"cache_salt": b"x"}, TypeError, "cache_salt: expected str or None, found bytes"),
        ({"adapter": 3}, TypeError, "adapter: expected str or None, found int"),
        (
            {"namespace": "\ud800"},
            ValueError,
            "namespace: expected a str encodable as UTF-8, found '\\ud800'",
        ),
    ],
)
def test_bad_configuration(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        BlockHasher(**kwargs)


def test_bad_hash_blocks_arguments_change_nothing() -> None:
    hasher = BlockHasher(8)
    prompt = _prompt()
    keys = hasher.hash_blocks(prompt)
    with pytest.raises(
        ValueError,
        match=re.escape("parent: expected the key of block 2 for start_block=3, found None"),
    ):
        hasher.hash_blocks(prompt, start_block=3)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "start_block: expected an int in [0, 8] (full blocks of 8 in 64 tokens), found 9"
        ),
    ):
        hasher.hash_blocks(prompt, parent=keys[-1], start_block=9)
    with pytest.raises(
        ValueError, match=re.escape("parent: expected a 32-byte sha256 key, found 16 bytes")
    ):
        hasher.hash_blocks(prompt, parent=bytes(16), start_block=1)
    with pytest.raises(TypeError, match=re.escape("parent: expected bytes or None, found str")):
        hasher.hash_blocks(prompt, parent="00" * 32, start_block=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("start_block: expected int, found float")):
        hasher.hash_blocks(prompt, start_block=1.0)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "block_hashes: expected at most 8 keys (full blocks of 8 in 64 tokens), found 9"
        ),
    ):
        hasher.hash_new_blocks(prompt, [*keys, keys[0]])
    with pytest.raises(
        ValueError,
        match=re.escape("block_hashes[-1]: expected a 32-byte sha256 key, found 3 bytes"),
    ):
        hasher.hash_new_blocks(prompt, [b"abc"])  # type: ignore[list-item]
    assert hasher.hash_blocks(prompt) == keys


# --- hex and low 64 bits ----------------------------------------------------------------------


def test_block_hash_hex_and_low64() -> None:
    key = bytes(range(32))
    assert block_hash_hex(key) == "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    assert block_hash_low64(key) == 0x18191A1B1C1D1E1F
    assert block_hash_low64(key) == int.from_bytes(key, "big") & (2**64 - 1)
    assert block_hash_low64(b"\xff" * 16) == 2**64 - 1
    with pytest.raises(ValueError, match=re.escape("key: expected at least 8 bytes, found 7")):
        block_hash_low64(bytes(7))
    with pytest.raises(TypeError, match=re.escape("key: expected bytes, found str")):
        block_hash_hex("00")  # type: ignore[arg-type]
