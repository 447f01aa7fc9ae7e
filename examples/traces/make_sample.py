"""Write the sample trace: sample.jsonl and the media it names (media/*.png, media/*.wav).

    python examples/traces/make_sample.py [OUT_DIR]

The files are drawn deterministically (fixed shapes and tones), so running it
again rewrites the same bytes. Serve the trace with
``omnicache replay examples/traces/sample.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from omnicache.demo.wav import write_wav


def _image(
    path: Path, size: tuple[int, int], background: str, shapes: list[str], mode: str
) -> None:
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    width, height = size
    for i, color in enumerate(shapes):
        x0, y0 = (i * 17) % (width // 2), (i * 11) % (height // 2)
        draw.rectangle([x0, y0, x0 + width // 3, y0 + height // 3], fill=color)
        draw.ellipse([width // 2, height // 2, width - 1 - i, height - 1 - i], outline=color)
    (image if mode == "RGB" else image.convert(mode)).save(path, format="PNG", optimize=True)


def _tone(path: Path, sample_rate: int, seconds: float, freqs: list[float]) -> None:
    t = np.arange(round(sample_rate * seconds)) / sample_rate
    channels = [0.4 * np.sin(2 * np.pi * f * t) for f in freqs]
    write_wav(path, channels[0] if len(channels) == 1 else np.stack(channels), sample_rate)


REQUESTS = [
    {"id": "a1", "tenant": "acme", "cache_salt": "acme-secret", "conversation": "acme-1",
     "system": "You are a support assistant. Answer briefly.",
     "text": "<image> What is broken on this panel?", "images": ["media/panel.png"],
     "reply": "The left switch cover is cracked."},
    {"id": "a2", "tenant": "acme", "cache_salt": "acme-secret", "conversation": "acme-1",
     "text": "And what is this noise? <audio>", "audio": [{"path": "media/hum.wav"}],
     "reply": "A steady hum, likely the fan."},
    {"id": "a3", "tenant": "acme", "cache_salt": "acme-secret", "conversation": "acme-1",
     "text": "Compare <image> with the first photo.", "images": ["media/cable.png"]},
    {"id": "a4", "tenant": "acme", "cache_salt": "acme-secret", "conversation": "acme-2",
     "system": "You are a support assistant. Answer briefly.",
     "text": "<image> Is this the same panel as before?", "images": ["media/panel.png"]},
    {"id": "g1", "tenant": "globex", "conversation": "globex-1",
     "system": "You are a support assistant. Answer briefly.",
     "text": "<image> What is broken on this panel?", "images": ["media/panel.png"],
     "reply": "Nothing looks broken."},
    {"id": "g2", "tenant": "globex", "conversation": "globex-1",
     "text": "Listen to both: <audio> <audio>",
     "audio": ["media/hum.wav", "media/click.wav"]},
    {"id": "s1", "tenant": "globex", "text": "Describe the picture.",
     "images": ["media/cable.png"]},
]  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    media = out / "media"
    media.mkdir(parents=True, exist_ok=True)
    _image(media / "panel.png", (96, 64), "#d0d4d8", ["#c03030", "#3050c0"], "P")
    _image(media / "cable.png", (64, 64), "#202020", ["#e0c040"], "L")
    _tone(media / "hum.wav", 8_000, 0.25, [120.0])
    _tone(media / "click.wav", 16_000, 0.12, [900.0, 1_300.0])
    lines = [json.dumps(request) for request in REQUESTS]
    (out / "sample.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
