"""What the vLLM modules share: vLLM's version gate and the way to install it.

NOTE: a function that needs vLLM calls `require_vllm` before its first
``from vllm... import``, and no module imports vLLM at import time: importing
the package needs no vLLM, and a missing or wrong vLLM always comes with the
way to install it.
"""

from __future__ import annotations

__all__ = ["INSTALL_HINT", "VLLM_SERIES", "require_vllm"]

INSTALL_HINT = (
    "install vLLM 0.33's scheduler-side code (CPU only, no CUDA stack) into a virtual "
    "environment with `scripts/install-vllm-cpu.sh [VENV]` from an omnicache checkout"
)

VLLM_SERIES = "0.33."
"""The vLLM release series the package is written for (a version's prefix)."""


def require_vllm() -> None:
    """Imports vLLM and checks its version.

    Raises:
        ImportError: vLLM is not importable, or not of `VLLM_SERIES`; the
            message says how to install it.
    """
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"omnicache.integrations.vllm needs vLLM 0.33, which is not importable ({exc}); "
            f"{INSTALL_HINT}"
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    if not version.startswith(VLLM_SERIES):
        raise ImportError(
            f"omnicache.integrations.vllm: expected vLLM {VLLM_SERIES}x, found {version}; "
            f"{INSTALL_HINT}"
        )
