"""Keys are the same in every process, under every PYTHONHASHSEED, on CPU and GPU.

`compute` builds a multimodal prompt (a PIL image, a palette image, a uint8
array, an audio clip, an encoded file, a caller id, a video) and returns its
content digests and its block keys under every algorithm, salt and adapter as
hex. Fresh interpreters run it under several hash seeds; their answers must
equal each other and this process's, byte for byte.

The processing context is built by iterating a set of strings, whose order
changes with PYTHONHASHSEED, so a digest that depended on insertion order
would differ between the processes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from hashing import (
    ALGORITHMS,
    hash_array,
    hash_audio,
    hash_bytes,
    hash_identifier,
    hash_image,
    hash_video,
)
from omnicache.block_hash import BlockHasher
from omnicache.identity import item_identity, tenant_identifier
from omnicache.preprocess import annotate_prompt

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
IMAGE_TOKEN = 9_000
BLOCK_SIZE = 4
SEEDS = ("0", "1", "4242", "random")


def _inputs() -> dict[str, Any]:
    rng = np.random.default_rng(2024)
    palette = Image.frombytes("P", (5, 3), bytes(rng.integers(0, 4, 15, dtype=np.uint8)))
    palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    palette.info["transparency"] = 2
    return {
        "rgb": Image.fromarray(rng.integers(0, 256, (7, 9, 3), dtype=np.uint8)),
        "palette": palette,
        "array": rng.integers(0, 256, (6, 4, 4), dtype=np.uint8),
        "audio": (rng.standard_normal((2, 300)).astype(np.float32), 22_050),
        "encoded": _png(rng.integers(0, 256, (5, 6, 4), dtype=np.uint8)),
        "video": rng.integers(0, 256, (3, 4, 5, 3), dtype=np.uint8),
        "floats": rng.standard_normal((3, 5)).astype(np.float64),
    }


def _png(pixels: np.ndarray[Any, Any]) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(buffer, "PNG")
    return buffer.getvalue()


def _context() -> dict[str, object]:
    # NOTE: set order of str depends on PYTHONHASHSEED, so insertion order does too.
    names = {"model", "max_pixels", "resample", "crop", "patch_size", "min_pixels"}
    return {name: {"v": len(name), "tag": name[::-1]} for name in names}


def compute() -> dict[str, Any]:
    """Digests and keys of one multimodal prompt, as hex; no torch involved."""
    items = _inputs()
    context = _context()
    out: dict[str, Any] = {"context_order": list(context)}
    for algorithm in ALGORITHMS:
        out[f"digests/{algorithm}"] = [
            hash_image(items["rgb"], algorithm=algorithm, context=context).hex(),
            hash_image(items["palette"], algorithm=algorithm).hex(),
            hash_image(items["array"], algorithm=algorithm).hex(),
            hash_audio(*items["audio"], algorithm=algorithm, context=context).hex(),
            hash_bytes(items["encoded"], modality="image", algorithm=algorithm).hex(),
            hash_identifier("photo-1", namespace="tenant-a", algorithm=algorithm).hex(),
            hash_video(items["video"], fps=2.5, algorithm=algorithm).hex(),
            hash_array(items["floats"], algorithm=algorithm, context=context).hex(),
            item_identity(items["encoded"], modality="image", algorithm=algorithm).hex(),
            item_identity(
                (items["video"], {"fps": 2.5, "frames_indices": [0, 4, 8], "video_backend": "x"}),
                modality="video",
                algorithm=algorithm,
                context=context,
            ).hex(),
            tenant_identifier("ab" * 32, cache_salt="tenant-a", algorithm=algorithm),
        ]
        tokens = [1, 2, 3]
        media = ["rgb", "palette", "array", "audio", "encoded"]
        for run in (5, 3, 6, 7, 2):
            tokens += [IMAGE_TOKEN] * run + [4, 5]
        tokens += [IMAGE_TOKEN] * 3 + [6]
        prompt = annotate_prompt(
            tokens,
            [items[name] for name in media] + ["photo-1"],
            placeholder_token_id=IMAGE_TOKEN,
            algorithm=algorithm,
            context=context,
            identifier_namespace="tenant-a",
        )
        for salt in (None, "s"):
            for adapter in (None, "lora"):
                hasher = BlockHasher(
                    BLOCK_SIZE,
                    algorithm=algorithm,
                    namespace="model-x",
                    cache_salt=salt,
                    adapter=adapter,
                )
                keys = hasher.hash_blocks(prompt)
                decoded = prompt.extend([7, 8, 9, 10, 11])
                keys_new = hasher.hash_new_blocks(decoded, keys)
                out[f"keys/{algorithm}/{salt}/{adapter}"] = [
                    hasher.root.hex(),
                    *(k.hex() for k in keys + keys_new),
                ]
    out["torch_imported"] = "torch" in sys.modules
    return out


def _run_in_subprocesses(seeds: tuple[str, ...]) -> list[dict[str, Any]]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "import test_determinism as t; print(json.dumps(t.compute()))"
    )
    procs = []
    for seed in seeds:
        env = dict(os.environ, PYTHONHASHSEED=seed)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, str(TESTS)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        results.append(json.loads(stdout))
    return results


def test_keys_equal_across_processes_and_hash_seeds() -> None:
    here = compute()
    others = _run_in_subprocesses(SEEDS)
    # The context really was built in different orders (else the test proves nothing).
    assert len({tuple(o.pop("context_order")) for o in others}) > 1
    here.pop("context_order")
    for other in others:
        assert other["torch_imported"] is False
        other["torch_imported"] = here["torch_imported"]
        assert other == here
    num_blocks = (3 + 5 + 3 + 6 + 7 + 2 + 5 * 2 + 4 + 5) // BLOCK_SIZE
    assert all(
        len(keys) == 1 + num_blocks for name, keys in here.items() if name.startswith("keys/")
    )
    roots = [keys[0] for name, keys in here.items() if name.startswith("keys/")]
    assert len(set(roots)) == len(roots) == 4 * len(ALGORITHMS)


def test_keys_do_not_depend_on_object_identity_or_order_of_creation() -> None:
    """Equal items made anew (other ids, other memory) give equal keys."""
    first = compute()
    second = compute()
    assert first == second


# -- CPU and GPU ------------------------------------------------------------------

_no_cuda = "needs a CUDA device: CPU and GPU tensors of one item must hash alike"


def test_cpu_and_gpu_tensors_give_the_same_digests_and_keys() -> None:
    # NOTE: torch is imported here, not at module level: `compute` runs in
    # subprocesses that check keys are computed without torch.
    import torch

    if not torch.cuda.is_available():
        pytest.skip(_no_cuda)
    items = _inputs()
    image = torch.from_numpy(items["array"])
    wave = torch.from_numpy(items["audio"][0])
    video = torch.from_numpy(items["video"])
    floats = torch.from_numpy(items["floats"])
    bf16 = floats.to(torch.bfloat16)
    strided = torch.from_numpy(np.ascontiguousarray(items["array"].transpose(1, 0, 2))).transpose(
        0, 1
    )
    for algorithm in ALGORITHMS:
        for cpu, cuda in (
            (hash_image(image, algorithm=algorithm), hash_image(image.cuda(), algorithm=algorithm)),
            (
                hash_image(image, algorithm=algorithm),
                hash_image(strided.cuda(), algorithm=algorithm),
            ),
            (
                hash_audio(wave, 22_050, algorithm=algorithm),
                hash_audio(wave.cuda(), 22_050, algorithm=algorithm),
            ),
            (hash_video(video, algorithm=algorithm), hash_video(video.cuda(), algorithm=algorithm)),
            (
                hash_array(floats, algorithm=algorithm),
                hash_array(floats.cuda(), algorithm=algorithm),
            ),
            (hash_array(bf16, algorithm=algorithm), hash_array(bf16.cuda(), algorithm=algorithm)),
        ):
            assert cpu == cuda
        assert hash_image(image, algorithm=algorithm) == hash_image(
            items["array"], algorithm=algorithm
        )
        tokens = [1] + [IMAGE_TOKEN] * 9 + [2] + [IMAGE_TOKEN] * 6 + [3]
        prompts = [
            annotate_prompt(
                tokens,
                [image.to(device), (wave.to(device), 22_050)],
                placeholder_token_id=IMAGE_TOKEN,
                algorithm=algorithm,
            )
            for device in ("cpu", "cuda")
        ]
        hasher = BlockHasher(BLOCK_SIZE, algorithm=algorithm)
        assert prompts[0] == prompts[1]
        assert hasher.hash_blocks(prompts[0]) == hasher.hash_blocks(prompts[1])
