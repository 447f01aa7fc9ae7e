"""Multimodal request traces: a deterministic synthetic workload and a JSONL reader.

A trace is an ordered list of requests. Each request is a whole prompt: the
messages of a conversation so far (system, user and assistant turns whose
parts are text, images and audio clips), a tenant and an optional cache salt.
A later turn of a conversation repeats every message before it, so its prompt
extends the earlier prompt exactly, as a chat server sends it.

Synthetic traces (`synthetic_trace`) draw everything from one seeded
``numpy.random.Generator``: the same seed gives the same trace, pixel for
pixel and sample for sample, in every process. They hold:

- a shared system prompt at the start of every conversation;
- images of varied sizes and PIL modes (RGB, L, RGBA, P) drawn from a pool by
  Zipf popularity, so a few images recur across many requests;
- audio clips at varied sample rates, mono and stereo;
- multi-turn conversations, interleaved, each turn extending the last;
- several tenants, each with its own cache salt.

JSONL traces (`load_trace`), one request per line; blank lines are skipped::

    {"id": "r1",                   optional str, unique; default "line-N"
     "tenant": "acme",             optional str; default "default"
     "cache_salt": "k3y",          optional str or null: the tenant's secret salt
     "conversation": "c1",         optional str or null: a later line with the
                                   same id is the next turn of this conversation
     "system": "You are ...",      optional str; only on a conversation's first turn
     "text": "Compare <image> and <image>.",   required str
     "images": ["a.png", {"path": "b.jpg"}],   optional list of paths
     "audio": ["clip.wav", {"path": "x.flac"}], optional list of paths
     "reply": "The first ..."}     optional str: the assistant's answer, which the
                                   conversation's next turn extends

Paths are relative to the trace file's folder (or absolute). Files are opened
as vLLM's OpenAI server opens an upload (`omnicache.media`): an image is the
RGB picture the model sees, a clip float32 mono at the file's own rate, so a
trace's digests are the server's. ``<image>`` and
``<audio>`` in ``text`` mark where the items go, in list order; text without
markers gets its images, then its audio clips, before the text. Every turn of a
conversation must name the same tenant and cache salt. `load_trace` reads and
checks the whole trace, media included, before it returns: a bad line is a
`TraceError` that names the file and the line, and nothing is served.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image

from omnicache.checks import check_int, check_number
from omnicache.media import (
    DEFAULT_SERIES,
    VLLM_RULES,
    MediaError,
    MediaRules,
    load_audio,
    load_image,
)

__all__ = [
    "AudioItem",
    "ImageItem",
    "Message",
    "SyntheticConfig",
    "Trace",
    "TraceError",
    "TraceRequest",
    "load_trace",
    "synthetic_trace",
]

IMAGE_MARKER = "<image>"
AUDIO_MARKER = "<audio>"
_MARKER_RE = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(AUDIO_MARKER)})")

Role = Literal["system", "user", "assistant"]
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True, eq=False)
class ImageItem:
    """A decoded image, as the model's processor receives it."""

    image: Image.Image
    # Where it came from: a file path or a synthetic name (for messages only).
    name: str


@dataclass(frozen=True, slots=True, eq=False)
class AudioItem:
    """A decoded audio clip: float32 samples, ``(samples,)`` or ``(channels, samples)``."""

    waveform: FloatArray
    sample_rate: int
    name: str

    @property
    def num_samples(self) -> int:
        return int(self.waveform.shape[-1])


MediaItem = ImageItem | AudioItem
Part = str | ImageItem | AudioItem


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation: a role and its parts in order."""

    role: Role
    parts: tuple[Part, ...]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: the whole prompt, and who sends it."""

    request_id: str
    tenant: str
    # The tenant's secret salt (None: the tenant has none of its own).
    cache_salt: str | None
    # Conversation id, None for a standalone request.
    conversation: str | None
    # Every message of the prompt, first first; a generation prompt follows.
    messages: tuple[Message, ...]
    # Line of the JSONL trace it came from (None for synthetic requests).
    line_number: int | None = None

    def media(self) -> Iterator[MediaItem]:
        """The prompt's images and audio clips, in prompt order."""
        for message in self.messages:
            for part in message.parts:
                if not isinstance(part, str):
                    yield part


@dataclass(frozen=True, slots=True)
class Trace:
    """An ordered list of requests."""

    name: str
    requests: tuple[TraceRequest, ...]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def tenants(self) -> tuple[str, ...]:
        """Tenants in order of first appearance."""
        return tuple(dict.fromkeys(r.tenant for r in self.requests))

    def count_media(self) -> tuple[int, int, int, int]:
        """(image parts, distinct images, audio parts, distinct clips) over all prompts."""
        images: dict[int, None] = {}
        clips: dict[int, None] = {}
        num_images = num_clips = 0
        for request in self.requests:
            for item in request.media():
                if isinstance(item, ImageItem):
                    num_images += 1
                    images[id(item)] = None
                else:
                    num_clips += 1
                    clips[id(item)] = None
        return num_images, len(images), num_clips, len(clips)


class TraceError(ValueError):
    """A JSONL trace line is malformed or names a file that cannot be read.

    Attributes:
        path: The trace file.
        line_number: 1-based line of the offending request (0: the whole file).
    """

    def __init__(self, path: Path, line_number: int, message: str) -> None:
        where = f"{path}:{line_number}" if line_number else str(path)
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line_number = line_number


# -- synthetic traces -------------------------------------------------------------

SYSTEM_PROMPT = (
    "You are a careful assistant for a product support desk. You look at every image and "
    "listen to every audio clip the customer sends before you answer. Describe what you "
    "see and hear in plain words, say when you are unsure, never invent part numbers, and "
    "keep each answer short. If a photo is blurred or a recording is noisy, ask for a "
    "better one. Answer in the language of the question and end with one next step."
)

_LEXICON = (
    "the a this that my our red blue green small large broken new old left right top bottom "
    "screen cable plug light sound noise fan door panel button label box corner edge switch "
    "battery charger speaker camera photo picture clip recording again still after before "
    "when why how what which does is can should please check compare explain describe show "
    "tell see hear look listen fix replace works stopped starts blinks hums clicks rattles "
    "buzzes warm cold wet dry loud quiet bright dim near far inside outside"
)
_WORDS = tuple(_LEXICON.split())


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    """Shape of a synthetic trace (`synthetic_trace`)."""

    num_requests: int = 160
    num_tenants: int = 3
    num_images: int = 16
    num_audio_clips: int = 6
    # Zipf exponent of image and clip popularity (rank r drawn with weight r**-a).
    zipf_a: float = 1.1
    # Chance that a request continues an open conversation of its tenant.
    continue_probability: float = 0.55
    max_turns: int = 5
    # Chance that a conversation's first turn has an audio clip.
    audio_probability: float = 0.35
    # Image sizes (width, height) and modes the pool draws from.
    image_sizes: tuple[tuple[int, int], ...] = (
        (64, 64),
        (96, 64),
        (128, 96),
        (160, 128),
        (128, 192),
        (224, 160),
    )
    image_modes: tuple[str, ...] = ("RGB", "L", "RGBA", "P")
    sample_rates: tuple[int, ...] = (8_000, 16_000, 22_050, 44_100)

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_tenants", "num_images", "num_audio_clips", "max_turns"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("continue_probability", "audio_probability"):
            check_number(name, getattr(self, name), minimum=0.0, maximum=1.0)
        if check_number("zipf_a", self.zipf_a) <= 0.0:
            raise ValueError(f"zipf_a: expected a number > 0, found {self.zipf_a}")


_TENANT_NAMES = ("acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "tyrell")


def _synthetic_image(
    rng: np.random.Generator, index: int, size: tuple[int, int], mode: str
) -> ImageItem:
    width, height = size
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    c0 = rng.uniform(0, 255, 3).astype(np.float32)
    c1 = rng.uniform(0, 255, 3).astype(np.float32)
    t = (x / width + y / height)[..., None] / 2.0
    pixels = c0 * (1.0 - t) + c1 * t
    for _ in range(int(rng.integers(1, 4))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, 2))
        pixels[y0 : y1 + 1, x0 : x1 + 1] = rng.uniform(0, 255, 3)
    pixels += rng.normal(0.0, 6.0, pixels.shape)
    rgb = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGB":
        image = rgb
    elif mode == "P":
        image = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    elif mode == "RGBA":
        image = rgb.copy()
        alpha = (255 - 128 * t[..., 0]).astype(np.uint8)
        image.putalpha(Image.fromarray(alpha, "L"))
    else:
        image = rgb.convert(mode)
    return ImageItem(image, f"synthetic/image-{index:02d}-{width}x{height}-{mode}")


def _synthetic_clip(rng: np.random.Generator, index: int, sample_rate: int) -> AudioItem:
    duration = float(rng.uniform(0.25, 1.0))
    num_samples = max(1, round(duration * sample_rate))
    num_channels = int(rng.integers(1, 3))
    t = np.arange(num_samples, dtype=np.float64) / sample_rate
    channels = []
    for _ in range(num_channels):
        f0, f1 = rng.uniform(110.0, min(2_000.0, sample_rate / 4), 2)
        signal = 0.5 * np.sin(2 * np.pi * f0 * t) + 0.3 * np.sin(2 * np.pi * f1 * t)
        signal += rng.normal(0.0, 0.05, num_samples)
        channels.append(signal)
    data = np.asarray(channels[0] if num_channels == 1 else np.stack(channels), np.float32)
    name = f"synthetic/clip-{index:02d}-{sample_rate}hz-{num_channels}ch"
    return AudioItem(data, sample_rate, name)


def _zipf_weights(n: int, a: float) -> npt.NDArray[np.float64]:
    weights: npt.NDArray[np.float64] = np.arange(1, n + 1, dtype=np.float64) ** -a
    weights /= weights.sum()
    return weights


def _sentence(rng: np.random.Generator, lo: int, hi: int) -> str:
    num_words = int(rng.integers(lo, hi + 1))
    words = [_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), num_words)]
    return " ".join(words).capitalize() + "."


@dataclass(slots=True)
class _Conversation:
    conversation_id: str
    tenant: str
    cache_salt: str
    messages: list[Message]
    turns_left: int


def synthetic_trace(config: SyntheticConfig | None = None, *, seed: int = 0) -> Trace:
    """A deterministic multimodal trace; the same ``config`` and ``seed`` give the same trace.

    Args:
        config: Shape of the trace (default `SyntheticConfig()`).
        seed: Seed of the ``numpy.random.Generator`` everything is drawn from.

    Returns:
        ``config.num_requests`` requests from ``config.num_tenants`` tenants.
    """
    cfg = SyntheticConfig() if config is None else config
    check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    tenants = [
        (_TENANT_NAMES[i % len(_TENANT_NAMES)] + ("" if i < len(_TENANT_NAMES) else f"-{i}"),
         rng.bytes(8).hex())
        for i in range(cfg.num_tenants)
    ]  # fmt: skip
    images = [
        _synthetic_image(
            rng,
            i,
            cfg.image_sizes[int(rng.integers(len(cfg.image_sizes)))],
            cfg.image_modes[int(rng.integers(len(cfg.image_modes)))],
        )
        for i in range(cfg.num_images)
    ]
    clips = [
        _synthetic_clip(rng, i, cfg.sample_rates[int(rng.integers(len(cfg.sample_rates)))])
        for i in range(cfg.num_audio_clips)
    ]
    image_p = _zipf_weights(len(images), cfg.zipf_a)
    clip_p = _zipf_weights(len(clips), cfg.zipf_a)
    system = Message("system", (SYSTEM_PROMPT,))
    open_by_tenant: dict[str, list[_Conversation]] = {name: [] for name, _ in tenants}
    requests: list[TraceRequest] = []
    num_conversations = 0
    for index in range(cfg.num_requests):
        tenant, salt = tenants[int(rng.integers(len(tenants)))]
        open_convs = open_by_tenant[tenant]
        if open_convs and rng.random() < cfg.continue_probability:
            conv = open_convs[int(rng.integers(len(open_convs)))]
            parts: list[Part] = []
            if rng.random() < 0.3:
                parts.append(images[int(rng.choice(len(images), p=image_p))])
            parts.append(_sentence(rng, 4, 14))
            conv.messages.append(Message("user", tuple(parts)))
        else:
            conv = _Conversation(
                f"conv-{num_conversations:03d}",
                tenant,
                salt,
                [system],
                int(rng.integers(1, cfg.max_turns + 1)),
            )
            num_conversations += 1
            open_convs.append(conv)
            num_first = 1 + int(rng.random() < 0.3)
            picked = rng.choice(len(images), size=num_first, replace=False, p=image_p)
            parts = [images[int(i)] for i in picked]
            if rng.random() < cfg.audio_probability:
                parts.append(clips[int(rng.choice(len(clips), p=clip_p))])
            parts.append(_sentence(rng, 6, 16))
            conv.messages.append(Message("user", tuple(parts)))
        requests.append(
            TraceRequest(
                request_id=f"req-{index:04d}",
                tenant=tenant,
                cache_salt=salt,
                conversation=conv.conversation_id,
                messages=tuple(conv.messages),
            )
        )
        # The answer this turn gets; the next turn of the conversation repeats it.
        conv.messages.append(Message("assistant", (_sentence(rng, 8, 20),)))
        conv.turns_left -= 1
        if conv.turns_left == 0:
            open_convs.remove(conv)
    return Trace(f"synthetic(seed={seed}, requests={cfg.num_requests})", tuple(requests))


# -- JSONL traces -----------------------------------------------------------------

_FIELDS = ("id", "tenant", "cache_salt", "conversation", "system", "text", "images", "audio",
           "reply")  # fmt: skip


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


@dataclass(slots=True)
class _Reader:
    path: Path
    folder: Path
    rules: MediaRules
    # Decoded media by resolved path: a file used twice is read once and is one item.
    media: dict[tuple[str, Path], MediaItem] = field(default_factory=dict)

    def error(self, line_number: int, message: str) -> TraceError:
        return TraceError(self.path, line_number, message)

    def optional_str(self, obj: Mapping[str, Any], name: str, line_number: int) -> str | None:
        value = obj.get(name)
        if value is not None and not isinstance(value, str):
            raise self.error(
                line_number, f"field {name!r}: expected a string or null, found {_json_type(value)}"
            )
        return value

    def paths(self, obj: Mapping[str, Any], name: str, line_number: int) -> list[Path]:
        value = obj.get(name, [])
        if not isinstance(value, list):
            raise self.error(
                line_number, f"field {name!r}: expected an array, found {_json_type(value)}"
            )
        paths: list[Path] = []
        for i, entry in enumerate(value):
            raw = entry
            if isinstance(entry, dict):
                extra = sorted(set(entry) - {"path"})
                if extra:
                    raise self.error(
                        line_number, f"{name}[{i}]: expected only the key 'path', found {extra}"
                    )
                raw = entry.get("path")
            if not isinstance(raw, str) or not raw:
                raise self.error(
                    line_number,
                    f'{name}[{i}]: expected a path string or {{"path": string}}, '
                    f"found {_json_type(raw)}",
                )
            paths.append((self.folder / raw).resolve())
        return paths

    def load(self, kind: str, path: Path, where: str, line_number: int) -> MediaItem:
        cached = self.media.get((kind, path))
        if cached is not None:
            return cached
        item: MediaItem
        try:
            if kind == "images":
                item = ImageItem(load_image(path, rules=self.rules), str(path))
            else:
                waveform, sample_rate = load_audio(path, rules=self.rules)
                item = AudioItem(waveform, sample_rate, str(path))
        except MediaError as exc:
            noun = "image" if kind == "images" else "audio"
            raise self.error(
                line_number, f"{where}: cannot read {noun} {exc.path}: {exc.reason}"
            ) from None
        self.media[(kind, path)] = item
        return item


def _user_parts(
    text: str, images: Sequence[MediaItem], clips: Sequence[MediaItem]
) -> tuple[Part, ...] | str:
    """The user turn's parts, or an error message when markers and lists disagree."""
    pieces = _MARKER_RE.split(text)
    num_image_markers = pieces.count(IMAGE_MARKER)
    num_audio_markers = pieces.count(AUDIO_MARKER)
    if num_image_markers == 0 and num_audio_markers == 0:
        return (*images, *clips, *([text] if text else []))
    if num_image_markers != len(images) or num_audio_markers != len(clips):
        return (
            f"field 'text': expected {len(images)} {IMAGE_MARKER} and {len(clips)} "
            f"{AUDIO_MARKER} markers (one per entry of 'images' and 'audio'), found "
            f"{num_image_markers} and {num_audio_markers}"
        )
    parts: list[Part] = []
    next_image = iter(images)
    next_clip = iter(clips)
    for piece in pieces:
        if piece == IMAGE_MARKER:
            parts.append(next(next_image))
        elif piece == AUDIO_MARKER:
            parts.append(next(next_clip))
        elif piece:
            parts.append(piece)
    return tuple(parts)


def load_trace(path: str | Path, *, rules: MediaRules = VLLM_RULES[DEFAULT_SERIES]) -> Trace:
    """Reads and checks a JSONL trace (schema in the module docstring), media included.

    Args:
        path: The trace file; media paths are relative to its folder.
        rules: How media files are opened (`omnicache.media`): the server's.

    Returns:
        The trace, every image decoded and every clip read.

    Raises:
        TraceError: The file cannot be read, has no requests, or a line is
            malformed (bad JSON, an unknown field, a wrong type, a missing or
            unreadable media file, a conversation that changes tenant); the
            message names the line.
    """
    trace_path = Path(path)
    try:
        text = trace_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(trace_path, 0, f"cannot read the trace: {exc}") from None
    reader = _Reader(trace_path, trace_path.resolve().parent, rules)
    requests: list[TraceRequest] = []
    request_ids: set[str] = set()
    # conversation id -> (tenant, salt, messages so far including the last reply)
    conversations: dict[str, tuple[str, str | None, list[Message]]] = {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise reader.error(
                line_number, f"malformed JSON: {exc.msg} at column {exc.colno}"
            ) from None
        if not isinstance(obj, dict):
            raise reader.error(line_number, f"expected a JSON object, found {_json_type(obj)}")
        unknown = [key for key in obj if key not in _FIELDS]
        if unknown:
            raise reader.error(
                line_number, f"unknown field {unknown[0]!r} (expected one of {', '.join(_FIELDS)})"
            )
        if "text" not in obj:
            raise reader.error(line_number, "field 'text': required, found none")
        user_text = obj["text"]
        if not isinstance(user_text, str):
            raise reader.error(
                line_number, f"field 'text': expected a string, found {_json_type(user_text)}"
            )
        request_id = reader.optional_str(obj, "id", line_number) or f"line-{line_number}"
        if request_id in request_ids:
            raise reader.error(
                line_number, f"field 'id': expected a new id, found {request_id!r} again"
            )
        tenant = reader.optional_str(obj, "tenant", line_number) or "default"
        salt = reader.optional_str(obj, "cache_salt", line_number)
        conversation = reader.optional_str(obj, "conversation", line_number)
        system = reader.optional_str(obj, "system", line_number)
        reply = reader.optional_str(obj, "reply", line_number)
        images = [
            reader.load("images", p, f"images[{i}]", line_number)
            for i, p in enumerate(reader.paths(obj, "images", line_number))
        ]
        clips = [
            reader.load("audio", p, f"audio[{i}]", line_number)
            for i, p in enumerate(reader.paths(obj, "audio", line_number))
        ]
        parts = _user_parts(user_text, images, clips)
        if isinstance(parts, str):
            raise reader.error(line_number, parts)
        previous = conversations.get(conversation) if conversation is not None else None
        if previous is not None:
            prev_tenant, prev_salt, history = previous
            if (prev_tenant, prev_salt) != (tenant, salt):
                raise reader.error(
                    line_number,
                    f"conversation {conversation!r}: expected tenant {prev_tenant!r} and the "
                    f"cache salt of its earlier turns, found tenant {tenant!r}"
                    + (" and another salt" if prev_salt != salt else ""),
                )
            if system is not None:
                raise reader.error(
                    line_number,
                    f"field 'system': expected only on the first turn of conversation "
                    f"{conversation!r}, found it on a later turn",
                )
            messages = [*history]
        else:
            messages = [] if system is None else [Message("system", (system,))]
        messages.append(Message("user", parts))
        requests.append(
            TraceRequest(
                request_id=request_id,
                tenant=tenant,
                cache_salt=salt,
                conversation=conversation,
                messages=tuple(messages),
                line_number=line_number,
            )
        )
        request_ids.add(request_id)
        if reply is not None and conversation is None:
            raise reader.error(
                line_number, "field 'reply': expected only with a 'conversation' it continues"
            )
        if conversation is not None:
            if reply is not None:
                messages.append(Message("assistant", (reply,)))
            conversations[conversation] = (tenant, salt, messages)
    if not requests:
        raise TraceError(trace_path, 0, "expected at least one request, found none")
    return Trace(str(trace_path), tuple(requests))
