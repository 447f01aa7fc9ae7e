"""Hash synthetic images, audio, video and ids, and the sample trace's files; print the digests.

    python examples/hash_media.py

Every digest printed here is the same on every machine and in every process.
Files are opened with `omnicache.media`, as vLLM's OpenAI server opens an
upload, so their digests are the ones omnicache's front end computes in the
server for the same files (and ``omnicache hash FILE`` prints).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from hashing import ALGORITHMS, hash_audio, hash_identifier, hash_image, hash_video
from omnicache.media import image_extensions, load_audio, load_image

MEDIA = Path(__file__).resolve().parent / "traces" / "media"


def main() -> None:
    rng = np.random.default_rng(7)
    pixels = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    t = np.arange(16_000, dtype=np.float32) / 16_000
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    stereo = np.stack([tone, -tone])
    frames = rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    context = {"model": "org/vl-model", "resize": [336, 336], "resample": "bicubic"}

    items = [
        ("PIL image 224x224 RGB", lambda a: hash_image(image, algorithm=a)),
        ("same image as an array", lambda a: hash_image(pixels, algorithm=a)),
        ("same image, resized for a model", lambda a: hash_image(image, algorithm=a,
                                                                  context=context)),
        ("1 s 440 Hz tone, 16 kHz mono", lambda a: hash_audio(tone, 16_000, algorithm=a)),
        ("same tone, stereo", lambda a: hash_audio(stereo, 16_000, algorithm=a)),
        ("same tone, 8 kHz label", lambda a: hash_audio(tone, 8_000, algorithm=a)),
        ("8-frame video at 24 fps", lambda a: hash_video(frames, fps=24.0, algorithm=a)),
        ("caller id 'img-42' (tenant-a)", lambda a: hash_identifier(
            "img-42", namespace="tenant-a", algorithm=a)),
        ("caller id 'img-42' (tenant-b)", lambda a: hash_identifier(
            "img-42", namespace="tenant-b", algorithm=a)),
    ]  # fmt: skip
    for path in sorted(MEDIA.iterdir()):
        if path.suffix in image_extensions():
            upload = load_image(path)  # upright, RGB over white, as the server has it
            items.append((f"file {path.name}", lambda a, i=upload: hash_image(i, algorithm=a)))
        else:
            decoded = load_audio(path)  # float32 mono at the file's own rate
            items.append((f"file {path.name}", lambda a, c=decoded: hash_audio(*c, algorithm=a)))
    width = max(len(name) for name, _ in items)
    for algorithm in ALGORITHMS:
        print(f"== {algorithm}")
        for name, digest in items:
            print(f"{name:<{width}}  {digest(algorithm).hex()}")


if __name__ == "__main__":
    main()
