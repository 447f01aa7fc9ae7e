"""Identify synthetic images, audio, video and ids, and the sample trace's files; print them.

    python examples/hash_media.py

Each line is an item's identity (`omnicache.identity`: what the model's
processor receives for it), the same on every machine and in every process.
Files are opened with `omnicache.media`, as vLLM's OpenAI server opens an
upload, so their identities are the ones omnicache's front end computes in
the server for the same files (and ``omnicache hash FILE`` prints). Lines
that name one item in two forms print one identity; the last lines scope a
picture's identity to two tenants, as vLLM receives it for each.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from hashing import ALGORITHMS, hash_identifier
from omnicache.identity import item_identity, tenant_identifier
from omnicache.media import image_extensions

MEDIA = Path(__file__).resolve().parent / "traces" / "media"


def main() -> None:
    rng = np.random.default_rng(7)
    pixels = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    png = io.BytesIO()
    image.save(png, "PNG")
    t = np.arange(16_000, dtype=np.float32) / 16_000
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    stereo = np.stack([tone, -tone])
    frames = rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    metadata = {"total_num_frames": 8, "fps": 24.0, "duration": 8 / 24,
                "frames_indices": list(range(8)), "do_sample_frames": False}  # fmt: skip
    context = {"model": "org/vl-model", "resize": [336, 336], "resample": "bicubic"}

    def identity(item: object, modality: str, **kwargs: object) -> object:
        return lambda a: item_identity(item, modality=modality, algorithm=a, **kwargs).hex()

    items = [
        ("PIL image 224x224 RGB", identity(image, "image")),
        ("same picture as PNG bytes", identity(png.getvalue(), "image")),
        ("same pixels as an array", identity(pixels, "image")),
        ("same picture, resized for a model", identity(image, "image", context=context)),
        ("1 s 440 Hz tone, 16 kHz mono", identity((tone, 16_000), "audio")),
        ("same tone, stereo", identity((stereo, 16_000), "audio")),
        ("same tone, 8 kHz rate", identity((tone, 8_000), "audio")),
        ("8 frames at 24 fps", identity((frames, metadata), "video")),
        ("same frames at 12 fps", identity((frames, {**metadata, "fps": 12.0}), "video")),
        ("caller id 'img-42' (tenant-a)", lambda a: hash_identifier(
            "img-42", namespace="tenant-a", algorithm=a).hex()),
        ("caller id 'img-42' (tenant-b)", lambda a: hash_identifier(
            "img-42", namespace="tenant-b", algorithm=a).hex()),
    ]  # fmt: skip
    for path in sorted(MEDIA.iterdir()):
        modality = "image" if path.suffix in image_extensions() else "audio"
        items.append((f"file {path.name}", identity(path, modality)))
    items.extend(
        (f"the PIL image, as vLLM gets it for {salt}", lambda a, s=salt: tenant_identifier(
            item_identity(image, modality="image", algorithm=a).hex(), cache_salt=s, algorithm=a))
        for salt in ("tenant-a", "tenant-b")
    )  # fmt: skip
    width = max(len(name) for name, _ in items)
    for algorithm in ALGORITHMS:
        print(f"== {algorithm}")
        for name, digest in items:
            print(f"{name:<{width}}  {digest(algorithm)}")


if __name__ == "__main__":
    main()
