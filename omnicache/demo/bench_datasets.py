"""A trace written as the datasets of vLLM's benchmark client (``vllm bench serve``).

vLLM's client reads local multimodal datasets as JSONL:

- ``custom_image``: one object per request, ``{"content": [parts]}``, each
  part ``{"type": "text", "text": ...}`` or ``{"type": "image", "image":
  path}``; the client sends them, in order, as one user message of a chat
  completion (the image as a ``file://`` URL the server opens, given
  ``--allowed-local-media-path``);
- ``custom_audio``: ``{"prompt": text, "audio": path}``, one clip per request
  (vLLM's loader of it reads the file with pandas, which vLLM's CPU build
  does not install: ``pip install pandas`` before using it).

`export_bench_datasets` writes a `Trace` that way. A chat request of vLLM's
client is one user message, so each prompt's messages are laid end to end
in that one message, each after its role (``"System: "``, ``"User: "``,
``"Assistant: "``) and apart by a blank line: a later turn of a
conversation still extends the earlier turn's prompt exactly, so the
trace's shared prefixes stay shared. What a dataset cannot carry is left
out of it and counted: the audio clips of the image dataset, the images
(and every clip after the first) of the audio dataset. Every line also
names its request and tenant (``"request_id"``, ``"tenant"``), which the
client ignores. vLLM's client sends one body for every request, so a
trace's tenants reach the server under one salt (``--extra-body``).

Media go to ``media/`` under the output folder, once each, as PNG (the
image's own mode) and 16-bit WAV (the clip's own rate and channels): the
server decodes them to what the trace holds (16-bit WAV rounds samples).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnicache.demo.wav import write_wav
from omnicache.demo.workloads import AudioItem, ImageItem, Trace, TraceRequest

__all__ = ["BenchDatasets", "export_bench_datasets"]

IMAGE_DATASET = "custom_image.jsonl"
AUDIO_DATASET = "custom_audio.jsonl"
MEDIA_DIR = "media"
_ROLES = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}
_TURN_SEPARATOR = "\n\n"


@dataclass(frozen=True, slots=True)
class BenchDatasets:
    """What `export_bench_datasets` wrote.

    Attributes:
        images: the ``custom_image`` dataset (every request of the trace).
        audio: the ``custom_audio`` dataset (the requests with a clip; None: none has one).
        media: the folder of the media files both name.
        num_image_requests: lines of ``images``.
        num_audio_requests: lines of ``audio``.
        num_clips_left_out: audio parts the image dataset leaves out.
        num_items_left_out_of_audio: images, and clips after a request's first,
            the audio dataset leaves out.
    """

    images: Path
    audio: Path | None
    media: Path
    num_image_requests: int
    num_audio_requests: int
    num_clips_left_out: int
    num_items_left_out_of_audio: int


class _Media:
    """Writes each media item once, under a name by first appearance."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._paths: dict[int, Path] = {}

    def path(self, item: ImageItem | AudioItem) -> Path:
        known = self._paths.get(id(item))
        if known is not None:
            return known
        index = len(self._paths)
        if isinstance(item, ImageItem):
            path = self.folder / f"image-{index:04d}.png"
            item.image.save(path, format="PNG")
        else:
            path = self.folder / f"clip-{index:04d}.wav"
            write_wav(path, item.waveform, item.sample_rate)
        self._paths[id(item)] = path
        return path


def _image_line(request: TraceRequest, media: _Media) -> tuple[dict[str, Any], int]:
    """The request's ``custom_image`` line and the number of clips it leaves out."""
    content: list[dict[str, str]] = []
    text: list[str] = []
    left_out = 0

    def flush() -> None:
        if text:
            content.append({"type": "text", "text": "".join(text)})
            text.clear()

    for index, message in enumerate(request.messages):
        text.append((_TURN_SEPARATOR if index else "") + _ROLES[message.role])
        for part in message.parts:
            if isinstance(part, str):
                text.append(part)
            elif isinstance(part, ImageItem):
                flush()
                content.append({"type": "image", "image": str(media.path(part))})
            else:
                left_out += 1
    flush()
    line = {"request_id": request.request_id, "tenant": request.tenant, "content": content}
    return line, left_out


def _audio_line(request: TraceRequest, media: _Media) -> tuple[dict[str, Any] | None, int]:
    """The request's ``custom_audio`` line (None without a clip) and the items it leaves out."""
    clips = [item for item in request.media() if isinstance(item, AudioItem)]
    if not clips:
        return None, 0
    text = _TURN_SEPARATOR.join(
        _ROLES[message.role] + "".join(p for p in message.parts if isinstance(p, str))
        for message in request.messages
    )
    num_items = sum(1 for _ in request.media())
    line = {
        "request_id": request.request_id,
        "tenant": request.tenant,
        "prompt": text,
        "audio": str(media.path(clips[0])),
    }
    return line, num_items - 1


def export_bench_datasets(trace: Trace, out_dir: str | Path) -> BenchDatasets:
    """Writes ``trace`` as vLLM's ``custom_image`` and ``custom_audio`` datasets (see the module).

    Args:
        trace: The requests, in order (give the client ``--disable-shuffle`` to keep it).
        out_dir: Folder to write into; created if missing. Its files are absolute
            paths in the datasets, so the folder stays where it was written.

    Returns:
        The files written and what they leave out.
    """
    root = Path(out_dir).resolve()
    (root / MEDIA_DIR).mkdir(parents=True, exist_ok=True)
    media = _Media(root / MEDIA_DIR)
    image_lines: list[str] = []
    audio_lines: list[str] = []
    clips_left_out = items_left_out = 0
    for request in trace.requests:
        line, left_out = _image_line(request, media)
        image_lines.append(json.dumps(line, ensure_ascii=False))
        clips_left_out += left_out
        audio, left_out = _audio_line(request, media)
        if audio is not None:
            audio_lines.append(json.dumps(audio, ensure_ascii=False))
            items_left_out += left_out
    images = root / IMAGE_DATASET
    images.write_text("".join(f"{line}\n" for line in image_lines), encoding="utf-8")
    audio_path = None
    if audio_lines:
        audio_path = root / AUDIO_DATASET
        audio_path.write_text("".join(f"{line}\n" for line in audio_lines), encoding="utf-8")
    return BenchDatasets(
        images=images,
        audio=audio_path,
        media=root / MEDIA_DIR,
        num_image_requests=len(image_lines),
        num_audio_requests=len(audio_lines),
        num_clips_left_out=clips_left_out,
        num_items_left_out_of_audio=items_left_out,
    )
