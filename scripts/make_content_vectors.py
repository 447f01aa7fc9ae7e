"""Write tests/vectors/content_v1.json: one golden digest per kind per algorithm.

Run once when the content encoding version changes (never to "fix" a failing
test: a changed digest under v1 is a bug or a new version):

    python scripts/make_content_vectors.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from vector_inputs import digest_of  # noqa: E402

from hashing import ALGORITHMS, SCHEME  # noqa: E402


def ramp(n: int, mul: int = 37, add: int = 11) -> str:
    """n deterministic bytes as hex: (i * mul + add) mod 256."""
    return bytes((i * mul + add) % 256 for i in range(n)).hex()


INPUTS: list[tuple[str, str, dict[str, Any]]] = [
    ("pil_rgb_3x2", "image_pil", {"mode": "RGB", "size": [3, 2], "data": ramp(18)}),
    ("pil_rgba_2x2", "image_pil", {"mode": "RGBA", "size": [2, 2], "data": ramp(16)}),
    ("pil_l_4x1", "image_pil", {"mode": "L", "size": [4, 1], "data": ramp(4)}),
    ("pil_la_2x1", "image_pil", {"mode": "LA", "size": [2, 1], "data": ramp(4)}),
    (
        "pil_p_2x2_rgb_palette", "image_pil",
        {"mode": "P", "size": [2, 2], "data": "00010203", "palette": ["RGB", ramp(12, 5, 1)]},
    ),
    ("pil_1_9x1", "image_pil", {"mode": "1", "size": [9, 1], "data": "a580"}),
    ("pil_i16_2x1", "image_pil", {"mode": "I;16", "size": [2, 1], "data": "01020304"}),
    ("pil_f_1x1", "image_pil", {"mode": "F", "size": [1, 1], "data": "0000803f"}),
    (
        "pil_rgb_context", "image_pil",
        {
            "mode": "RGB", "size": [1, 1], "data": "102030",
            "context": {"model": "org/model-7b", "resize": [336, 336], "resample": "bicubic",
                        "do_normalize": True, "scale": 0.5},
        },
    ),
    ("array_rgb_2x2", "image_array", {"dtype": "uint8", "shape": [2, 2, 3], "data": ramp(12)}),
    ("array_gray_2x3", "image_array", {"dtype": "uint8", "shape": [2, 3], "data": ramp(6)}),
    (
        "audio_mono_f32", "audio",
        {"dtype": "float32", "shape": [4], "data": ramp(16), "sample_rate": 16000},
    ),
    (
        "audio_stereo_i16", "audio",
        {"dtype": "int16", "shape": [2, 3], "data": ramp(12), "sample_rate": 44100},
    ),
    (
        "video_2_frames", "video",
        {"dtype": "uint8", "shape": [2, 1, 2, 3], "data": ramp(12), "fps": 24.0},
    ),
    ("video_no_fps", "video", {"dtype": "uint8", "shape": [1, 1, 1], "data": "7f", "fps": None}),
    ("array_f64_2x2", "array", {"dtype": "float64", "shape": [2, 2], "data": ramp(32)}),
    ("array_bf16_3", "array", {"dtype": "bfloat16", "shape": [3], "data": ramp(6)}),
    ("array_i8_scalar", "array", {"dtype": "int8", "shape": [], "data": "ff"}),
    ("bytes_jpeg", "bytes", {"modality": "image", "data": "ffd8ffe000104a464946"}),
    ("bytes_wav", "bytes", {"modality": "audio", "data": "52494646" + ramp(8)}),
    ("identifier", "identifier", {"namespace": "tenant-a", "identifier": "img-0001"}),
]  # fmt: skip


def main() -> None:
    cases = []
    for name, kind, spec in INPUTS:
        for algorithm in ALGORITHMS:
            case = {"name": name, "kind": kind, "algorithm": algorithm, "input": spec}
            case["digest"] = digest_of(case).hex()
            cases.append(case)
    out = ROOT / "tests" / "vectors" / "content_v1.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"scheme": SCHEME, "cases": cases}
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
