"""Write tests/vectors/identity_v1.json: one golden identity per form per algorithm.

Run once when the identity's byte layout changes version (never to "fix" a
failing test: a changed identity under v1 is a bug or a new version):

    python scripts/make_identity_vectors.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from identity_inputs import CASES  # noqa: E402

from hashing import ALGORITHMS  # noqa: E402
from omnicache.identity import IDENTITY_SCHEME  # noqa: E402


def main() -> None:
    cases = [
        {"name": name, "algorithm": algorithm, "digest": make(algorithm)}
        for name, make in CASES.items()
        for algorithm in ALGORITHMS
    ]
    path = ROOT / "tests" / "vectors" / "identity_v1.json"
    path.write_text(json.dumps({"scheme": IDENTITY_SCHEME, "cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} vectors to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
