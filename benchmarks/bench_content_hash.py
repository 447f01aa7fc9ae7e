"""Content-digest throughput against the raw hash, the naive path and vLLM.

Run: python benchmarks/bench_content_hash.py [--reps N]
(with vLLM 0.33 importable, e.g. under .venv-vllm, the vLLM column is filled)

For every algorithm and input it prints GB/s of content (the image's packed
pixel bytes, the clip's or array's nbytes) for:
  omnicache   hash_image / hash_audio / hash_array
  ceiling     the bare algorithm over the same bytes, already in one buffer
              (blake3 with AUTO threads where omnicache uses them)
  naive       algorithm(img.tobytes()) for images, algorithm(arr.tobytes()) else
  vLLM        MultiModalHasher.hash_kwargs(algorithm, image=img) (images;
              blake3 and sha256 only)
and the ratios omnicache/ceiling, omnicache/naive and omnicache/vLLM.
Medians of --reps runs, all rows in one process: compare within one run.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import blake3
import numpy as np
import xxhash
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hashing import ALGORITHMS, hash_array, hash_audio, hash_image
from hashing._algorithms import BLAKE3_THREADS_MIN_BYTES

try:
    from vllm.multimodal.hasher import MultiModalHasher
except ImportError:  # vLLM is optional: its column then reads "n/a"
    MultiModalHasher = None


def raw_digest(algorithm: str, data: object) -> bytes:
    size = memoryview(data).nbytes  # type: ignore[arg-type]
    if algorithm == "blake3":
        threads = blake3.blake3.AUTO if size >= BLAKE3_THREADS_MIN_BYTES else 1
        return blake3.blake3(data, max_threads=threads).digest()  # type: ignore[no-any-return]
    if algorithm == "sha256":
        return hashlib.sha256(data).digest()  # type: ignore[arg-type]
    return xxhash.xxh3_128(data).digest()  # type: ignore[no-any-return]


def naive_digest(algorithm: str, data: bytes) -> bytes:
    if algorithm == "blake3":
        return blake3.blake3(data).digest()  # type: ignore[no-any-return]
    return raw_digest(algorithm, data)


def interleaved_medians(fns: list[Callable[[], object] | None], reps: int) -> list[float | None]:
    """Median seconds of each function, timed in turn within every round.

    Interleaving keeps every variant under the same conditions (another
    process's load, blake3's worker threads asleep or awake) instead of
    timing one variant's whole series, then the next's.
    """
    live = [fn for fn in fns if fn is not None]
    for fn in live:
        fn()  # warm caches and lazy imports
    times: list[list[float]] = [[] for _ in live]
    for _ in range(reps):
        for series, fn in zip(times, live, strict=True):
            start = time.perf_counter()
            fn()
            series.append(time.perf_counter() - start)
    medians = iter(statistics.median(series) for series in times)
    return [None if fn is None else next(medians) for fn in fns]


def gbps(nbytes: int, seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{nbytes / seconds / 1e9:.2f}"


def ratio(other: float | None, ours: float) -> str:
    return "n/a" if other is None else f"{other / ours:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    img_1k = Image.fromarray(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    img_2k = Image.fromarray(rng.integers(0, 256, (2048, 2048, 3), dtype=np.uint8))
    clip = rng.standard_normal(30 * 16_000, dtype=np.float32)
    array = rng.integers(0, 256, 64 << 20, dtype=np.uint8)

    cases: list[tuple[str, int, Callable[[str], object], bytes, Callable[[str], object] | None]]
    cases = [
        (
            "PIL RGB 1024²", 1024 * 1024 * 3,
            lambda a: hash_image(img_1k, algorithm=a),  # type: ignore[arg-type]
            img_1k.tobytes(),
            lambda a: naive_digest(a, img_1k.tobytes()),
        ),
        (
            "PIL RGB 2048²", 2048 * 2048 * 3,
            lambda a: hash_image(img_2k, algorithm=a),  # type: ignore[arg-type]
            img_2k.tobytes(),
            lambda a: naive_digest(a, img_2k.tobytes()),
        ),
        (
            "audio 30 s 16 kHz f32", clip.nbytes,
            lambda a: hash_audio(clip, 16_000, algorithm=a),  # type: ignore[arg-type]
            clip.tobytes(),
            lambda a: naive_digest(a, clip.tobytes()),
        ),
        (
            "array 64 MiB", array.nbytes,
            lambda a: hash_array(array, algorithm=a),  # type: ignore[arg-type]
            array.tobytes(),
            lambda a: naive_digest(a, array.tobytes()),
        ),
    ]  # fmt: skip
    images = {"PIL RGB 1024²": img_1k, "PIL RGB 2048²": img_2k}

    header = (
        f"{'input':<22} {'algorithm':<9} {'omnicache':>9} {'ceiling':>8} {'naive':>8} "
        f"{'vLLM':>8}  {'/ceiling':>8} {'/naive':>7} {'/vLLM':>7}"
    )
    print(f"GB/s of content, median of {args.reps} runs; ratios are omnicache's speedup")
    print(header)
    print("-" * len(header))
    for name, nbytes, ours, raw, naive in cases:
        for algorithm in ALGORITHMS:
            reps = max(3, args.reps // 3) if nbytes > 32 << 20 else args.reps
            image = images.get(name)
            vllm = None
            if MultiModalHasher is not None and image is not None and algorithm != "xxh3_128":
                vllm = partial(MultiModalHasher.hash_kwargs, algorithm, image=image)
            t_ours, t_raw, t_naive, t_vllm = interleaved_medians(
                [partial(ours, algorithm), partial(raw_digest, algorithm, raw),
                 partial(naive, algorithm), vllm],
                reps,
            )  # fmt: skip
            assert t_ours is not None and t_raw is not None and t_naive is not None
            print(
                f"{name:<22} {algorithm:<9} {gbps(nbytes, t_ours):>9} {gbps(nbytes, t_raw):>8} "
                f"{gbps(nbytes, t_naive):>8} {gbps(nbytes, t_vllm):>8}  "
                f"{t_raw / t_ours:>7.0%} {ratio(t_naive, t_ours):>7} {ratio(t_vllm, t_ours):>7}"
            )
    if MultiModalHasher is None:
        print("vLLM not importable: run under a venv with vLLM 0.33 for the vLLM column")


if __name__ == "__main__":
    main()
