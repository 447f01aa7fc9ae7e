"""The value format of a tier (`omnicache.tiers.codec`) and its value keys.

The layout is rebuilt here by hand with `struct` from the table in the codec's
docstring, so a change to the bytes a tier keeps fails these tests before it
reaches a server that other engines share.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable

import blake3
import pytest
import torch
import xxhash
from helpers import DEVICES

from omnicache.tiers import base, codec
from omnicache.tiers.codec import Rejection
from omnicache.tiers.memory import MemoryTier

# NOTE: a decoded value views the read-only bytes it came from; torch warns
# about that once per process. The rows are only read here.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")


KEY = b"\x01" * 32
NAME = "hidden_states"
ORDER = 0 if sys.byteorder == "little" else 1

# The small example: (2, 3) float32 rows of known values.
VALUES = (0.5, 1.0, 2.0, -3.0, 4.25, 1024.0)
# xxh3_128 of the example's header (before the checksum) and rows, from the
# xxhash library: pins the hash function and its digest's byte order.
EXAMPLE_CHECKSUM = "9883f0a5b8af94f81bca4a3e274f3e0c"
# Offsets of the example: 20 fixed bytes + 7 ("float32") + 2 * 8 (shape)
# + 32 (stamp) + 13 ("hidden_states").
EXAMPLE_CHECKSUM_AT = 88
EXAMPLE_ROWS_AT = 104
EXAMPLE_SIZE = 128


def example_rows() -> torch.Tensor:
    return torch.tensor(VALUES, dtype=torch.float32).view(2, 3)


def hand_header(
    key: bytes, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, order: int = ORDER
) -> bytes:
    """Every byte above the checksum, field by field as the docstring's table lists them."""
    dname = dtype.encode("ascii")
    ename = name.encode("utf-8")
    return b"".join(
        (
            b"OCTB",
            struct.pack("<H", 1),
            struct.pack("<B", order),
            struct.pack("<B", len(dname)),
            struct.pack("<B", len(shape)),
            struct.pack("<B", len(key)),
            struct.pack("<H", len(ename)),
            struct.pack("<Q", nbytes),
            dname,
            struct.pack(f"<{len(shape)}Q", *shape),
            key,
            ename,
        )
    )


def hand_value(key: bytes, name: str, dtype: str, shape: tuple[int, ...], rows: bytes) -> bytes:
    header = hand_header(key, name, dtype, shape, len(rows))
    return header + xxhash.xxh3_128(header + rows).digest() + rows


def example_value() -> bytes:
    return codec.encode(KEY, NAME, example_rows())


def flip(value: bytes, at: int, mask: int = 0xFF) -> bytes:
    out = bytearray(value)
    out[at] ^= mask
    return bytes(out)


def patch(value: bytes, at: int, new: bytes) -> bytes:
    return value[:at] + new + value[at + len(new) :]


# -- the byte layout -----------------------------------------------------------


def test_example_value_is_the_documented_layout_byte_for_byte() -> None:
    rows = struct.pack("=6f", *VALUES)
    header = hand_header(KEY, NAME, "float32", (2, 3), 24)
    assert len(header) == EXAMPLE_CHECKSUM_AT
    checksum = xxhash.xxh3_128(header + rows).digest()
    assert checksum.hex() == EXAMPLE_CHECKSUM
    expected = header + checksum + rows

    value = codec.encode(KEY, NAME, example_rows())

    assert type(value) is bytes
    assert value == expected
    assert len(value) == EXAMPLE_SIZE
    # Field by field, at the documented offsets.
    assert value[0:4] == b"OCTB"
    assert struct.unpack_from("<H", value, 4) == (1,)
    assert value[6] == ORDER
    assert value[7:10] == bytes([7, 2, 32])
    assert struct.unpack_from("<H", value, 10) == (13,)
    assert struct.unpack_from("<Q", value, 12) == (24,)
    assert value[20:27] == b"float32"
    assert struct.unpack_from("<2Q", value, 27) == (2, 3)
    assert value[43:75] == KEY
    assert value[75:88] == b"hidden_states"
    assert value[EXAMPLE_CHECKSUM_AT:EXAMPLE_ROWS_AT] == bytes.fromhex(EXAMPLE_CHECKSUM)
    assert value[EXAMPLE_ROWS_AT:] == rows


def test_module_constants_match_the_layout() -> None:
    assert codec.MAGIC == b"OCTB"
    assert codec.FORMAT_VERSION == 1


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
        (torch.float32, "float32"),
        (torch.int32, "int32"),
        (torch.int64, "int64"),
        (torch.uint8, "uint8"),
        (torch.bool, "bool"),
    ],
)
def test_dtype_name_and_layout_of_each_dtype(dtype: torch.dtype, name: str) -> None:
    assert codec.dtype_name(dtype) == name
    shape = (4, 2, 3)
    rows = (torch.arange(24) % 5).to(dtype).view(shape)
    # NOTE: the row bytes come from numpy (bf16 has no numpy type: its bits
    # as int16), independent of the codec's own copy.
    bits = rows.view(torch.int16) if dtype == torch.bfloat16 else rows
    row_bytes = bits.numpy().tobytes(order="C")
    assert codec.encode(KEY, "codes", rows) == hand_value(KEY, "codes", name, shape, row_bytes)


def test_entry_name_length_is_its_utf8_length() -> None:
    name = "código"  # 6 characters, 7 UTF-8 bytes
    rows = example_rows()
    value = codec.encode(KEY, name, rows)
    assert struct.unpack_from("<H", value, 10) == (7,)
    assert value == hand_value(KEY, name, "float32", (2, 3), struct.pack("=6f", *VALUES))
    decoded = codec.decode(value, KEY, name, torch.float32, (2, 3))
    assert decoded.rejection is None
    assert decoded.rows is not None and torch.equal(decoded.rows, rows)


def test_encode_rejects_fields_too_long_for_the_header() -> None:
    rows = example_rows()
    with pytest.raises(ValueError, match=r"^key: expected at most 255 bytes, found 256$"):
        codec.encode(b"\x00" * 256, NAME, rows)
    with pytest.raises(
        ValueError, match=r"^entry name: expected at most 65535 UTF-8 bytes, found 65536$"
    ):
        codec.encode(KEY, "x" * 65536, rows)
    # The longest of each still encodes.
    assert len(codec.encode(b"\x00" * 255, NAME, rows)) == EXAMPLE_SIZE - 32 + 255
    assert len(codec.encode(KEY, "x" * 65535, rows)) == EXAMPLE_SIZE - 13 + 65535


# -- round trips ---------------------------------------------------------------

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def make_rows(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Distinct values (within the dtype's range) in every position."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=codec.dtype_name)
@pytest.mark.parametrize("shape", [(16, 8), (16, 2, 3), (4, 1), (1, 5, 1, 2)], ids=str)
def test_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    rows = make_rows(dtype, shape)
    value = codec.encode(KEY, NAME, rows)
    decoded = codec.decode(value, KEY, NAME, dtype, shape)
    assert decoded.rejection is None
    assert decoded.rows is not None
    assert decoded.rows.dtype == dtype
    assert tuple(decoded.rows.shape) == shape
    assert decoded.rows.device.type == "cpu"
    assert torch.equal(decoded.rows, rows)


@pytest.mark.parametrize(
    "container", [bytes, bytearray, memoryview], ids=["bytes", "bytearray", "memoryview"]
)
def test_decode_takes_any_buffer(container: Callable[[bytes], object]) -> None:
    value = container(example_value())
    decoded = codec.decode(value, KEY, NAME, torch.float32, (2, 3))  # type: ignore[arg-type]
    assert decoded.rejection is None
    assert decoded.rows is not None and torch.equal(decoded.rows, example_rows())


@pytest.mark.parametrize("shape", [(0, 3), (4, 0), (4, 2, 0)], ids=str)
def test_round_trip_of_empty_rows(shape: tuple[int, ...]) -> None:
    rows = torch.empty(shape, dtype=torch.float32)
    value = codec.encode(KEY, NAME, rows)
    header = hand_header(KEY, NAME, "float32", shape, 0)
    assert value == header + xxhash.xxh3_128(header).digest()
    decoded = codec.decode(value, KEY, NAME, torch.float32, shape)
    assert decoded.rejection is None
    assert decoded.rows is not None
    assert decoded.rows.dtype == torch.float32
    assert tuple(decoded.rows.shape) == shape
    # An empty value of one shape is not one of another.
    assert codec.decode(value, KEY, NAME, torch.float32, (0, 4)) == (None, Rejection.MISMATCH)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_encode_as_their_contiguous_copy(device: str) -> None:
    base_rows = make_rows(torch.float32, (16, 12)).to(device)
    expanded = base_rows[:1].expand(16, 12)
    for strided in (base_rows[:, ::2], base_rows.t(), base_rows[::2], base_rows[:, 3:9], expanded):
        assert not strided.is_contiguous()
        assert codec.encode(KEY, NAME, strided) == codec.encode(KEY, NAME, strided.contiguous())
        shape = tuple(strided.shape)
        decoded = codec.decode(codec.encode(KEY, NAME, strided), KEY, NAME, torch.float32, shape)
        assert decoded.rows is not None and torch.equal(decoded.rows, strided.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_encode_of_device_rows_and_rows_with_grad(device: str) -> None:
    rows = example_rows()
    assert codec.encode(KEY, NAME, rows.to(device)) == example_value()
    assert codec.encode(KEY, NAME, rows.clone().requires_grad_()) == example_value()


# -- rejections ----------------------------------------------------------------


def decode_example(
    value: bytes,
    key: bytes = KEY,
    name: str = NAME,
    dtype: torch.dtype = torch.float32,
    shape: tuple[int, ...] = (2, 3),
) -> codec.Decoded:
    return codec.decode(value, key, name, dtype, shape)


def test_the_example_decodes_as_asked() -> None:
    decoded = decode_example(example_value())
    assert decoded.rejection is None
    assert decoded.rows is not None and torch.equal(decoded.rows, example_rows())


REJECTIONS: list[tuple[str, Callable[[bytes], codec.Decoded], Rejection]] = [
    ("wrong magic", lambda v: decode_example(patch(v, 0, b"XCTB")), Rejection.FORMAT),
    ("magic of another case", lambda v: decode_example(patch(v, 0, b"octb")), Rejection.FORMAT),
    ("version 2", lambda v: decode_example(patch(v, 4, struct.pack("<H", 2))), Rejection.FORMAT),
    ("version 0", lambda v: decode_example(patch(v, 4, struct.pack("<H", 0))), Rejection.FORMAT),
    ("truncated by one byte", lambda v: decode_example(v[:-1]), Rejection.FORMAT),
    ("one extra byte", lambda v: decode_example(v + b"\x00"), Rejection.FORMAT),
    ("header only", lambda v: decode_example(v[:EXAMPLE_CHECKSUM_AT]), Rejection.FORMAT),
    ("shorter than the fixed fields", lambda v: decode_example(v[:19]), Rejection.FORMAT),
    ("empty", lambda v: decode_example(b""), Rejection.FORMAT),
    (
        "row length field off by one",
        lambda v: decode_example(patch(v, 12, struct.pack("<Q", 25))),
        Rejection.FORMAT,
    ),
    ("other key", lambda v: decode_example(v, key=b"\x02" * 32), Rejection.MISMATCH),
    ("key one byte off", lambda v: decode_example(v, key=KEY[:-1] + b"\x00"), Rejection.MISMATCH),
    ("shorter key", lambda v: decode_example(v, key=KEY[:16]), Rejection.MISMATCH),
    ("other entry name", lambda v: decode_example(v, name="codes"), Rejection.MISMATCH),
    ("entry name prefix", lambda v: decode_example(v, name="hidden"), Rejection.MISMATCH),
    ("other dtype (int32)", lambda v: decode_example(v, dtype=torch.int32), Rejection.MISMATCH),
    ("other dtype (float16)", lambda v: decode_example(v, dtype=torch.float16), Rejection.MISMATCH),
    (
        "other dtype (bfloat16)",
        lambda v: decode_example(v, dtype=torch.bfloat16),
        Rejection.MISMATCH,
    ),
    ("other shape (3, 2)", lambda v: decode_example(v, shape=(3, 2)), Rejection.MISMATCH),
    ("other shape (6,)", lambda v: decode_example(v, shape=(6,)), Rejection.MISMATCH),
    ("other shape (2, 3, 1)", lambda v: decode_example(v, shape=(2, 3, 1)), Rejection.MISMATCH),
    ("byte-order flag flipped", lambda v: decode_example(flip(v, 6, 0x01)), Rejection.MISMATCH),
    ("first payload byte flipped", lambda v: decode_example(flip(v, 104)), Rejection.CHECKSUM),
    ("last payload byte flipped", lambda v: decode_example(flip(v, 127)), Rejection.CHECKSUM),
    ("one payload bit flipped", lambda v: decode_example(flip(v, 110, 0x10)), Rejection.CHECKSUM),
    ("first checksum byte flipped", lambda v: decode_example(flip(v, 88)), Rejection.CHECKSUM),
    ("last checksum byte flipped", lambda v: decode_example(flip(v, 103)), Rejection.CHECKSUM),
    (
        "not sealed (checksum zero)",
        lambda v: decode_example(patch(v, 88, bytes(16))),
        Rejection.CHECKSUM,
    ),
]


@pytest.mark.parametrize(
    ("case", "expected"),
    [(decode, expected) for _, decode, expected in REJECTIONS],
    ids=[what for what, _, _ in REJECTIONS],
)
def test_rejection(case: Callable[[bytes], codec.Decoded], expected: Rejection) -> None:
    value = example_value()
    decoded = case(value)
    assert decoded.rows is None
    assert decoded.rejection is expected
    assert decoded == codec.Decoded(None, expected)


def test_a_sealed_value_whose_row_length_disagrees_with_its_shape_is_a_mismatch() -> None:
    # A consistent value (length and checksum hold) whose header claims 20
    # bytes of rows for a (2, 3) float32 block.
    rows = bytes(range(20))
    value = hand_value(KEY, NAME, "float32", (2, 3), rows)
    assert decode_example(value) == (None, Rejection.MISMATCH)


def test_a_value_sealed_under_another_key_is_that_key_only() -> None:
    other = b"\x02" * 32
    value = codec.encode(other, NAME, example_rows())
    assert decode_example(value) == (None, Rejection.MISMATCH)
    decoded = decode_example(value, key=other)
    assert decoded.rows is not None and torch.equal(decoded.rows, example_rows())


# -- encode copies once; decode against a prepared layout ----------------------


def test_encode_copies_the_rows() -> None:
    rows = example_rows()
    value = codec.encode(KEY, NAME, rows)
    assert type(value) is bytes
    # Changing the source after encode changes nothing encoded.
    rows.fill_(7.0)
    assert value == example_value()
    assert value[EXAMPLE_ROWS_AT:] == struct.pack("=6f", *VALUES)


def test_a_layout_serves_every_key() -> None:
    lay = codec.layout(NAME, torch.float32, (2, 3))
    assert lay.nbytes == 24
    for key in (KEY, b"\x02" * 32, b"\x03" * 16):
        value = codec.encode(key, NAME, example_rows())
        decoded = codec.decode_as(value, key, lay)
        assert decoded.rows is not None and torch.equal(decoded.rows, example_rows())
        assert codec.decode_as(value, b"\x09" * 32, lay) == (None, Rejection.MISMATCH)


def test_a_key_longer_than_the_format_allows() -> None:
    with pytest.raises(ValueError, match="key: expected at most 255 bytes, found 256"):
        codec.encode(b"k" * 256, NAME, example_rows())
    assert codec.decode(example_value(), b"k" * 256, NAME, torch.float32, (2, 3)) == (
        None,
        Rejection.MISMATCH,
    )


def test_decoded_rows_view_the_value() -> None:
    # NOTE: `decode` documents that its rows view the value: a caller that
    # keeps them copies first.
    value = bytearray(example_value())
    decoded = codec.decode(value, KEY, NAME, torch.float32, (2, 3))
    assert decoded.rows is not None
    kept = decoded.rows.clone()
    value[EXAMPLE_ROWS_AT : EXAMPLE_ROWS_AT + 4] = struct.pack("=f", 9.0)
    assert decoded.rows[0, 0].item() == 9.0
    assert torch.equal(kept, example_rows())


# -- value keys and their parts ------------------------------------------------


def test_value_key() -> None:
    key = bytes(range(32))
    assert base.value_key("omnicache", "ns", key, "hidden_states") == (
        "omnicache:ns:000102030405060708090a0b0c0d0e0f"
        "101112131415161718191a1b1c1d1e1f:hidden_states"
    )
    assert base.value_key("p", "n", b"\xab\xcd", "codes") == "p:n:abcd:codes"


@pytest.mark.parametrize("value", ["omnicache", "ns", "model-7b_v1.2", "a/b", "x" * 200, "~!@#"])
def test_check_key_part_accepts_printable_ascii(value: str) -> None:
    assert base.check_key_part("namespace", value) is value


@pytest.mark.parametrize(
    "value",
    ["", "a:b", "a{b}", "{", "}", "a b", "a\tb", "a\nb", "a\rb", "é", "日本", "a\x00b", "a\x7fb"],
    ids=repr,
)
def test_check_key_part_rejects(value: str) -> None:
    message = (
        "namespace: expected non-empty printable ASCII without ':', '{', '}' or whitespace, "
        f"found {value!r}"
    )
    with pytest.raises(ValueError) as info:
        base.check_key_part("namespace", value)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("value", "type_name"), [(None, "NoneType"), (7, "int"), (b"ns", "bytes"), (["ns"], "list")]
)
def test_check_key_part_rejects_non_str(value: object, type_name: str) -> None:
    with pytest.raises(TypeError) as info:
        base.check_key_part("prefix", value)
    assert str(info.value) == f"prefix: expected str, found {type_name}"


def test_memory_tier_checks_its_key_parts() -> None:
    with pytest.raises(ValueError, match=r"^namespace: expected non-empty printable ASCII"):
        MemoryTier(namespace="a:b")
    with pytest.raises(ValueError, match=r"^prefix: expected non-empty printable ASCII"):
        MemoryTier(prefix="")
    with pytest.raises(TypeError, match=r"^namespace: expected str, found int$"):
        MemoryTier(namespace=1)  # type: ignore[arg-type]


# -- encode_into: values built in reused buffers ----------------------------------


def test_encode_into_a_used_buffer_equals_encode() -> None:
    used = bytearray(b"\xff" * EXAMPLE_SIZE)
    asked: list[int] = []

    def buffer_for(size: int) -> bytearray:
        asked.append(size)
        return used

    value = codec.encode_into(KEY, NAME, example_rows(), buffer_for)
    assert value is used
    assert asked == [EXAMPLE_SIZE]
    assert bytes(value) == example_value()


def test_a_value_built_unsealed_is_rejected_until_sealed() -> None:
    value = codec.encode_into(KEY, NAME, example_rows(), bytearray, sealed=False)
    assert value[EXAMPLE_CHECKSUM_AT:EXAMPLE_ROWS_AT] == bytes(16)
    assert decode_example(bytes(value)) == (None, Rejection.CHECKSUM)
    codec.seal(value)
    assert bytes(value) == example_value()
    codec.seal(value)
    assert bytes(value) == example_value()


def test_encode_into_a_buffer_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match=f"buffer: expected {EXAMPLE_SIZE} bytes, found 3"):
        codec.encode_into(KEY, NAME, example_rows(), lambda size: bytearray(3))


# -- keyed values: a MAC in place of the checksum ------------------------------

AUTH_KEY = bytes(range(32))


def keyed_example() -> bytes:
    return codec.encode(KEY, NAME, example_rows(), auth_key=AUTH_KEY)


def test_a_keyed_value_is_the_layout_with_its_magic_and_a_keyed_blake3_mac() -> None:
    rows = struct.pack("=6f", *VALUES)
    header = b"OCTK" + hand_header(KEY, NAME, "float32", (2, 3), 24)[4:]
    mac = blake3.blake3(header + rows, key=AUTH_KEY).digest(length=16)
    assert keyed_example() == header + mac + rows
    out = codec.encode_into(KEY, NAME, example_rows(), bytearray, sealed=False, auth_key=AUTH_KEY)
    codec.seal(out, auth_key=AUTH_KEY)
    assert bytes(out) == keyed_example()


def test_a_keyed_value_is_served_only_under_its_key() -> None:
    decoded = codec.decode(keyed_example(), KEY, NAME, torch.float32, (2, 3), auth_key=AUTH_KEY)
    assert decoded.rows is not None and torch.equal(decoded.rows, example_rows())
    # Without a key, or with another one: not served.
    assert decode_example(keyed_example()) == (None, Rejection.MISMATCH)
    other = bytes(32)
    assert codec.decode(keyed_example(), KEY, NAME, torch.float32, (2, 3), auth_key=other) == (
        None,
        Rejection.CHECKSUM,
    )


def test_a_keyed_reader_takes_no_plain_or_forged_value() -> None:
    def keyed_read(value: bytes) -> codec.Decoded:
        return codec.decode(value, KEY, NAME, torch.float32, (2, 3), auth_key=AUTH_KEY)

    assert keyed_read(example_value()) == (None, Rejection.MISMATCH)
    # A writer without the key relabels a plain value, or signs with its own key.
    relabelled = b"OCTK" + example_value()[4:]
    assert keyed_read(relabelled) == (None, Rejection.CHECKSUM)
    forged = codec.encode(KEY, NAME, example_rows() * 2, auth_key=bytes(32))
    assert keyed_read(forged) == (None, Rejection.CHECKSUM)
    assert keyed_read(flip(keyed_example(), EXAMPLE_ROWS_AT)) == (None, Rejection.CHECKSUM)


def test_seal_refuses_a_key_that_does_not_fit_the_value() -> None:
    plain = codec.encode_into(KEY, NAME, example_rows(), bytearray, sealed=False)
    with pytest.raises(ValueError, match="auth_key: expected none for a value built with magic"):
        codec.seal(plain, auth_key=AUTH_KEY)
    keyed = codec.encode_into(KEY, NAME, example_rows(), bytearray, sealed=False, auth_key=AUTH_KEY)
    with pytest.raises(ValueError, match="auth_key: expected the key for a value built with"):
        codec.seal(keyed)


@pytest.mark.parametrize(
    ("auth_key", "error", "message"),
    [
        (b"k" * 31, ValueError, "auth_key: expected 32 bytes (e.g. hashlib.sha256(secret)"
         ".digest()), found 31"),
        ("k" * 32, TypeError, "auth_key: expected bytes or None, found str"),
    ],
)  # fmt: skip
def test_bad_auth_keys(auth_key: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        codec.check_auth_key(auth_key)
    assert str(info.value) == message
    with pytest.raises(error):
        MemoryTier(auth_key=auth_key)  # type: ignore[arg-type]
