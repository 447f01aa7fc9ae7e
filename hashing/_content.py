"""Content digests of images, audio, video, arrays, encoded bytes and ids.

Every function validates its whole input (and the context) before it hashes a
byte, so a rejected call costs nothing and raises ValueError or TypeError
naming what was expected and what was found. The fields each kind hashes are
listed in its docstring; their framing is in ``hashing._encoding``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from hashing._algorithms import DEFAULT_ALGORITHM, Algorithm, check_algorithm, digest_size
from hashing._arrays import as_canonical_array, is_array_like, iter_c_order_bytes
from hashing._encoding import Encoder, canonical_context
from hashing._pil import SUPPORTED_MODES, pixel_payload

Context = Mapping[str, object] | None

_ARRAY_IMAGE_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}


class ContentHash(bytes):
    """The digest of one item: 32 bytes (blake3, sha256) or 16 bytes (xxh3_128).

    A real ``bytes`` subclass, so a precomputed digest can be told apart from
    encoded file bytes; everywhere else it is plain bytes.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"ContentHash('{self.hex()}')"


def _check_nonempty_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what}: expected a str, found {type(value).__name__}")
    if not value:
        raise ValueError(f"{what}: expected a non-empty str, found ''")
    return value


# --- images ------------------------------------------------------------------


class _ImageFields:
    """A validated image, ready to be written into an encoder."""

    __slots__ = ("chunks", "fields", "size")

    def __init__(self, fields: list[tuple[str, object]], size: int, chunks: Iterator[Any]):
        self.fields, self.size, self.chunks = fields, size, chunks

    def write(self, encoder: Encoder) -> None:
        for name, value in self.fields:
            encoder.field(name, value)
        encoder.blob("pixels", self.size, self.chunks)


def _pil_fields(image: Image.Image, what: str) -> _ImageFields:
    if image.mode not in SUPPORTED_MODES:
        raise ValueError(
            f"{what}: expected a PIL mode in {sorted(SUPPORTED_MODES)}, found {image.mode!r}"
        )
    width, height = image.size
    if width == 0 or height == 0:
        raise ValueError(f"{what}: expected a non-empty image, found size {width}x{height}")
    image.load()
    palette: tuple[str, bytes] | None = None
    if image.palette is not None and image.mode in ("P", "PA"):
        palette_mode = image.palette.mode
        palette = (palette_mode, bytes(image.getpalette(palette_mode) or ()))
    transparency = image.info.get("transparency")
    size, chunks = pixel_payload(image)
    fields: list[tuple[str, object]] = [
        ("layout", "pil"),
        ("mode", image.mode),
        ("height", height),
        ("width", width),
        ("palette", palette),
        ("transparency", transparency),
    ]
    return _ImageFields(fields, size, chunks)


def _array_image_fields(image: object, what: str) -> _ImageFields:
    array, dtype_name = as_canonical_array(image, what)
    if dtype_name != "uint8":
        raise TypeError(
            f"{what}: expected uint8 pixel values, found {dtype_name} "
            "(hash_array hashes arrays of any dtype)"
        )
    shape = array.shape
    channels = 1 if array.ndim == 2 else (shape[2] if array.ndim == 3 else 0)
    if channels not in _ARRAY_IMAGE_MODES:
        raise ValueError(
            f"{what}: expected shape (height, width) or (height, width, channels) with "
            f"1 to 4 channels last, found shape {tuple(shape)}"
        )
    if array.size == 0:
        raise ValueError(f"{what}: expected a non-empty image, found shape {tuple(shape)}")
    fields: list[tuple[str, object]] = [
        ("layout", "hwc"),
        ("mode", _ARRAY_IMAGE_MODES[channels]),
        ("height", shape[0]),
        ("width", shape[1]),
    ]
    return _ImageFields(fields, array.nbytes, iter_c_order_bytes(array))


def _image_fields(image: object, what: str) -> _ImageFields:
    if isinstance(image, Image.Image):
        return _pil_fields(image, what)
    if is_array_like(image):
        return _array_image_fields(image, what)
    raise TypeError(
        f"{what}: expected a PIL.Image.Image, a uint8 numpy.ndarray or a uint8 torch.Tensor, "
        f"found {type(image).__name__}"
    )


def hash_image(
    image: Image.Image | np.ndarray[Any, Any] | Any,
    /,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Context = None,
) -> ContentHash:
    """Digest an image as the model will see it.

    Args:
        image: a PIL image of any mode (palette included), or a uint8 array or
            tensor (any device) shaped (height, width) or (height, width, C)
            with C in 1..4. A PIL image and an array of the same pixels have
            different digests (their canonical layouts differ): hash one form
            consistently.
        algorithm: "blake3" (default), "sha256" or "xxh3_128".
        context: processing parameters (model id, resize and resample
            settings) that change what the model sees.

    Returns:
        The digest over (layout, mode, height, width, palette, transparency,
        pixels, context); arrays hash (layout, mode, height, width, pixels,
        context).
    """
    encoded_context = canonical_context(context)
    fields = _image_fields(image, "image")
    encoder = Encoder(check_algorithm(algorithm), "image")
    fields.write(encoder)
    encoder.context(encoded_context)
    return ContentHash(encoder.digest())


# --- audio, video, arrays ----------------------------------------------------


def _check_sample_rate(sample_rate: object) -> int:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Integral):
        raise ValueError(
            f"sample_rate: expected a positive int, found {type(sample_rate).__name__} "
            f"{sample_rate!r}"
        )
    if sample_rate <= 0:
        raise ValueError(f"sample_rate: expected a positive int, found {sample_rate}")
    return int(sample_rate)


def hash_audio(
    waveform: np.ndarray[Any, Any] | Any,
    /,
    sample_rate: int,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Context = None,
) -> ContentHash:
    """Digest an audio clip.

    Args:
        waveform: numpy array or torch tensor of any numeric dtype, shaped
            (samples,) for mono or (channels, samples) for multi-channel.
        sample_rate: samples per second, a positive int.

    Returns:
        The digest over (sample_rate, dtype, shape, samples, context).
    """
    rate = _check_sample_rate(sample_rate)
    encoded_context = canonical_context(context)
    array, dtype_name = as_canonical_array(waveform, "waveform")
    if array.ndim not in (1, 2):
        raise ValueError(
            "waveform: expected shape (samples,) or (channels, samples), "
            f"found shape {tuple(array.shape)}"
        )
    if array.size == 0:
        raise ValueError(f"waveform: expected a non-empty clip, found shape {tuple(array.shape)}")
    encoder = Encoder(check_algorithm(algorithm), "audio")
    encoder.field("sample_rate", rate)
    encoder.field("dtype", dtype_name)
    encoder.field("shape", list(array.shape))
    encoder.blob("samples", array.nbytes, iter_c_order_bytes(array))
    encoder.context(encoded_context)
    return ContentHash(encoder.digest())


def hash_array(
    array: np.ndarray[Any, Any] | Any,
    /,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Context = None,
) -> ContentHash:
    """Digest a numeric array or tensor (bfloat16 included) by dtype, shape and values.

    A strided view and its contiguous copy, or a tensor (on any device) and a
    numpy array of the same values, have the same digest.
    """
    encoded_context = canonical_context(context)
    canonical, dtype_name = as_canonical_array(array, "array")
    return _array_digest(canonical, dtype_name, check_algorithm(algorithm), encoded_context)


def _array_digest(
    canonical: np.ndarray[Any, Any], dtype_name: str, algorithm: Algorithm, encoded_context: bytes
) -> ContentHash:
    encoder = Encoder(algorithm, "array")
    encoder.field("dtype", dtype_name)
    encoder.field("shape", list(canonical.shape))
    encoder.blob("data", canonical.nbytes, iter_c_order_bytes(canonical))
    encoder.context(encoded_context)
    return ContentHash(encoder.digest())


def hash_array_rows(
    array: np.ndarray[Any, Any] | Any,
    bounds: Sequence[tuple[int, int]],
    /,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Context = None,
) -> list[ContentHash]:
    """Digests of row ranges of one array: ``hash_array(array[lo:hi])`` per ``(lo, hi)``.

    The same digests as `hash_array` of each slice, with the array converted
    (and a device tensor copied to the host) once rather than once a range.

    Raises:
        ValueError: the array has no rows (0-d), or a range is not ``0 <= lo
            <= hi <= len(array)``.
    """
    encoded_context = canonical_context(context)
    canonical, dtype_name = as_canonical_array(array, "array")
    checked = check_algorithm(algorithm)
    if canonical.ndim == 0:
        raise ValueError("array: expected an array with rows (ndim >= 1), found a 0-d array")
    num_rows = canonical.shape[0]
    for index, (lo, hi) in enumerate(bounds):
        if not 0 <= lo <= hi <= num_rows:
            raise ValueError(
                f"bounds[{index}]: expected 0 <= lo <= hi <= {num_rows}, found ({lo}, {hi})"
            )
    return [
        _array_digest(canonical[lo:hi], dtype_name, checked, encoded_context) for lo, hi in bounds
    ]


def hash_video(
    frames: Sequence[Any] | np.ndarray[Any, Any] | Any,
    /,
    *,
    fps: float | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Context = None,
) -> ContentHash:
    """Digest a video: its frame rate and each frame as :func:`hash_image` sees it.

    Args:
        frames: a sequence of images (PIL or arrays), or one uint8 array or
            tensor shaped (frames, height, width[, channels]); the array and
            the list of its frames have the same digest.
        fps: frames per second (a finite positive number) or None if unknown.

    Returns:
        The digest over (fps, number of frames, each frame's image fields,
        context).
    """
    if fps is not None:
        if isinstance(fps, bool) or not isinstance(fps, numbers.Real):
            raise ValueError(f"fps: expected a finite positive number or None, found {fps!r}")
        if not math.isfinite(fps) or fps <= 0:
            raise ValueError(f"fps: expected a finite positive number or None, found {fps}")
    encoded_context = canonical_context(context)
    if is_array_like(frames):
        array, _ = as_canonical_array(frames, "frames")
        if array.ndim not in (3, 4):
            raise ValueError(
                "frames: expected shape (frames, height, width[, channels]), "
                f"found shape {tuple(array.shape)}"
            )
        items: Sequence[Any] = list(array)
    elif isinstance(frames, Sequence) and not isinstance(frames, (str, bytes)):
        items = frames
    else:
        raise TypeError(
            "frames: expected a sequence of images or an array shaped "
            f"(frames, height, width[, channels]), found {type(frames).__name__}"
        )
    if len(items) == 0:
        raise ValueError("frames: expected at least one frame, found 0")
    per_frame = [_image_fields(frame, f"frames[{i}]") for i, frame in enumerate(items)]
    encoder = Encoder(check_algorithm(algorithm), "video")
    encoder.field("fps", None if fps is None else float(fps))
    encoder.field("num_frames", len(per_frame))
    for fields in per_frame:
        fields.write(encoder)
    encoder.context(encoded_context)
    return ContentHash(encoder.digest())


# --- encoded bytes and caller ids -----------------------------------------------


def hash_bytes(
    data: bytes | bytearray | memoryview,
    /,
    *,
    modality: str,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Context = None,
) -> ContentHash:
    """Digest an encoded file (JPEG, PNG, WAV, ...) as opaque bytes.

    Args:
        data: the file's bytes, non-empty.
        modality: what the bytes hold ("image", "audio", "video", ...): the
            same bytes under two modalities have different digests.
    """
    _check_nonempty_str(modality, "modality")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"data: expected bytes, bytearray or memoryview, found {type(data).__name__}"
        )
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("data: expected a C-contiguous buffer, found a strided memoryview")
    if view.nbytes == 0:
        raise ValueError("data: expected non-empty bytes, found 0 bytes")
    encoded_context = canonical_context(context)
    encoder = Encoder(check_algorithm(algorithm), "bytes")
    encoder.field("modality", modality)
    encoder.blob("data", view.nbytes, iter((view.cast("B"),)))
    encoder.context(encoded_context)
    return ContentHash(encoder.digest())


def hash_identifier(
    identifier: str,
    /,
    *,
    namespace: str,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
) -> ContentHash:
    """Digest a caller-supplied id (a uuid, a URL) within a namespace.

    The raw id is never used as a key: two tenants that send the same id in
    different namespaces get different digests, and an id never collides
    with the digest of content.
    """
    _check_nonempty_str(identifier, "identifier")
    if not isinstance(namespace, str):
        raise TypeError(f"namespace: expected a str, found {type(namespace).__name__}")
    encoder = Encoder(check_algorithm(algorithm), "identifier")
    encoder.field("namespace", namespace)
    encoder.field("identifier", identifier)
    return ContentHash(encoder.digest())


# --- dispatch -------------------------------------------------------------------


def hash_content(
    item: object,
    /,
    *,
    modality: str | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Context = None,
    namespace: str | None = None,
) -> ContentHash:
    """Digest any supported item, choosing the function by type and modality.

    ================================  =====================================
    item                              hashed by
    ================================  =====================================
    ContentHash                       returned as is (a precomputed digest)
    PIL.Image.Image                   hash_image
    (waveform, sample_rate) tuple     hash_audio
    array/tensor, modality "image"    hash_image
    array/tensor, modality "video"    hash_video
    array/tensor, modality None       hash_array
    list of images, modality "video"  hash_video
    bytes, bytearray, memoryview      hash_bytes (modality required)
    str                               hash_identifier (namespace required)
    ================================  =====================================

    Raises:
        TypeError: the item is of none of these types.
    """
    check_algorithm(algorithm)
    if isinstance(item, ContentHash):
        if len(item) != digest_size(algorithm):
            raise ValueError(
                f"item: expected a {digest_size(algorithm)}-byte {algorithm} ContentHash, "
                f"found {len(item)} bytes"
            )
        return item
    if isinstance(item, Image.Image):
        return hash_image(item, algorithm=algorithm, context=context)
    if isinstance(item, tuple) and len(item) == 2 and is_array_like(item[0]):
        return hash_audio(item[0], item[1], algorithm=algorithm, context=context)
    if is_array_like(item) or (modality == "video" and isinstance(item, (list, tuple))):
        if modality == "image":
            return hash_image(item, algorithm=algorithm, context=context)
        if modality == "video":
            return hash_video(item, algorithm=algorithm, context=context)
        if modality in (None, "array"):
            return hash_array(item, algorithm=algorithm, context=context)
        raise ValueError(
            f"modality: expected 'image', 'video' or None for an array, found {modality!r}"
        )
    if isinstance(item, (bytes, bytearray, memoryview)):
        if modality is None:
            raise ValueError("modality: expected a modality for encoded bytes, found None")
        return hash_bytes(item, modality=modality, algorithm=algorithm, context=context)
    if isinstance(item, str):
        if namespace is None:
            raise ValueError("namespace: expected a namespace for a str identifier, found None")
        return hash_identifier(item, namespace=namespace, algorithm=algorithm)
    raise TypeError(
        "item: expected a ContentHash, PIL.Image.Image, (waveform, sample_rate) tuple, "
        "numpy.ndarray, torch.Tensor, list of frames, bytes, bytearray, memoryview or str, "
        f"found {type(item).__name__}"
    )
