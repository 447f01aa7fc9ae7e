"""omnicache in vLLM's front end: request fields checked, items identified by their content.

vLLM calls `register` (the ``vllm.general_plugins`` entry point ``omnicache``)
in each of its processes. In the front end (``LLM``'s process, the OpenAI
server's), it puts two checks where vLLM admits a request, both before
anything is scheduled or cached; a refusal is a ``ValueError`` (HTTP 400 from
the server) that names what was expected and what was found:

- always: omnicache's request fields (``extra_args``, the server's
  ``vllm_xargs``) are checked by `check_request_fields`: an unknown
  ``omnicache_`` key, a value that is not one of those accepted, prompt
  hidden states asked of an engine without omnicache's store or with
  ``n`` > 1. Requests without such fields are not looked at.
- with ``OMNICACHE_MM_UUIDS=1``: every image, audio clip or video is
  identified to the engine by its `omnicache.identity` (what the model's
  processor receives for it: a video's frames and metadata, a clip's samples
  and rate), computed here, where items are still whole (the engine core may
  receive an item's data as None when vLLM's processor cache holds it),
  whatever the client called it (`checked_multi_modal_uuids`); and the
  identifier vLLM derives for an item of a request with a ``cache_salt``
  (from the identity, or its own content hash for an item omnicache does not
  identify, with the request's processor and media kwargs) is scoped to the
  salt (`omnicache.identity.tenant_identifier`), so that no cache vLLM keys
  by it (processor cache, encoder cache, encoder-cache connectors, prefix
  keys) is shared across tenants.

This is the one module that patches vLLM, since vLLM has no extension point
at these places: ``InputProcessor._validate_params``
(``vllm/v1/engine/input_processor.py``); ``BaseRenderer._process_tokens``
and ``_process_tokens_async`` (which hand a request's salt on: vLLM gives
none to what follows), ``BaseRenderer._process_multimodal`` (identities,
``vllm/renderers/base.py``) and ``BaseMultiModalProcessor._get_mm_hashes``
(every identifier vLLM derives, scoped; ``vllm/multimodal/processing/
processor.py``) are wrapped. Each wrapper checks the signature it was written for (`PATCHED`),
not a version: the identifier patch refuses to start on another signature;
the request check, on by default for every vLLM with omnicache installed,
logs a warning and stays out (the engine core then logs a bad value and
ignores it instead).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from omnicache.identity import tenant_identifier
from omnicache.integrations.vllm.common import check_request_fields, vllm_series
from omnicache.integrations.vllm.identifiers import checked_multi_modal_uuids
from omnicache.media import VLLM_RULES

__all__ = [
    "ENABLE_ENV",
    "register",
]

ENABLE_ENV = "OMNICACHE_MM_UUIDS"

PATCHED: dict[str, tuple[str, ...]] = {
    "BaseRenderer._process_tokens": ("self", "prompt", "*", "skip_mm_cache"),
    "BaseRenderer._process_tokens_async": ("self", "prompt", "*", "skip_mm_cache"),
    "BaseRenderer._process_multimodal": (
        "self", "prompt", "mm_data", "mm_uuids", "mm_processor_kwargs", "media_io_kwargs",
        "*", "skip_mm_cache",
    ),
    "BaseMultiModalProcessor._get_mm_hashes": ("self", "inputs"),
    "InputProcessor._validate_params": ("self", "params", "supported_tasks"),
}  # fmt: skip
"""The parameters of each function the module wraps, as vLLM 0.32 and 0.33 have them
(``"*"``: the rest are keyword-only)."""

_MARK = "__omnicache_wrapped__"
_LOG = logging.getLogger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: request checks; identifiers with the variable."""
    value = os.environ.get(ENABLE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENABLE_ENV}: expected '1' or '0', found {value!r}")
    install_request_checks()
    if value == "1":
        install_mm_uuids()


def _signature_mismatch(name: str, function: Callable[..., Any]) -> str | None:
    """How ``function`` differs from the parameters `PATCHED` expects of it, or None."""
    found: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in found:
            found.append("*")
        found.append(parameter.name)
    if tuple(found) == PATCHED[name]:
        return None
    return f"{name}: expected parameters {PATCHED[name]}, found {tuple(found)}"


def install_request_checks() -> None:
    """Makes vLLM's input processor refuse bad omnicache request fields (idempotent).

    Where vLLM has no ``InputProcessor._validate_params`` of the signature
    it was written for, logs a warning and installs nothing: this runs in
    every vLLM process where omnicache is installed, and must not stop one.
    """
    name = "InputProcessor._validate_params"
    try:
        from vllm.v1.engine.input_processor import InputProcessor

        original = InputProcessor._validate_params
    except (ImportError, AttributeError) as exc:
        mismatch: str | None = f"{name}: expected it, found none ({exc})"
    else:
        if getattr(original, _MARK, False):
            return
        mismatch = _signature_mismatch(name, original)
    if mismatch is not None:
        _LOG.warning(
            "omnicache: request fields are not checked in this front end (%s); the engine "
            "ignores a bad one with a warning",
            mismatch,
        )
        return

    error = _request_field_error()

    def _validate_params(self: Any, params: Any, supported_tasks: Any) -> Any:
        result = original(self, params, supported_tasks)
        transfer = self.vllm_config.kv_transfer_config
        connector = None if transfer is None else transfer.kv_connector
        try:
            check_request_fields(params, kv_connector=connector)
        except ValueError as exc:
            raise error(str(exc)) from None
        return result

    setattr(_validate_params, _MARK, True)
    _validate_params.__wrapped__ = original  # type: ignore[attr-defined]
    InputProcessor._validate_params = _validate_params


@functools.cache
def _request_field_error() -> type[ValueError]:
    """`RequestFieldError`, made once vLLM is imported (this module imports none at load)."""
    from vllm.exceptions import VLLMValidationError

    class RequestFieldError(VLLMValidationError, ValueError):  # type: ignore[misc]
        """A request field omnicache cannot serve: a ValueError to ``LLM``'s caller, and to
        the server one of vLLM's validation errors, which it answers with HTTP 400 (a plain
        ValueError raised where vLLM admits a request is answered with 500)."""

    return RequestFieldError


class _SaltedUuids(dict):  # type: ignore[type-arg]
    """A request's ``multi_modal_uuids`` with its ``cache_salt``, from `_process_tokens` on.

    vLLM hands ``_process_multimodal`` the uuids but not the salt, and runs it
    on another thread for the server: the salt travels with the uuids. A
    dict, so that vLLM reads it as the uuids should anything else get it.
    """

    def __init__(self, uuids: Mapping[str, object] | None, cache_salt: str | None) -> None:
        super().__init__(uuids or {})
        self.given = uuids
        self.cache_salt = cache_salt


# The salt of the request whose items the current thread processes: set around
# vLLM's processing (which runs on one thread), read where its identifiers are made.
_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar("omnicache_salt", default=None)


def _with_salt(prompt: Any) -> Any:
    """The prompt, its uuids carrying its salt (a copy; the caller's prompt is left as it is)."""
    if not isinstance(prompt, Mapping) or not prompt.get("multi_modal_data"):
        return prompt
    salted = _SaltedUuids(prompt.get("multi_modal_uuids"), prompt.get("cache_salt"))
    return {**prompt, "multi_modal_uuids": salted}


def install_mm_uuids() -> None:
    """Makes vLLM's front end identify every item by its identity, scoped to its tenant.

    Idempotent.

    Raises:
        RuntimeError: a function it wraps is not the one this was written
            for (`PATCHED`).
    """
    series = vllm_series()
    from vllm.multimodal.processing.processor import BaseMultiModalProcessor
    from vllm.renderers.base import BaseRenderer

    targets = {
        "BaseRenderer._process_tokens": (BaseRenderer, "_process_tokens"),
        "BaseRenderer._process_tokens_async": (BaseRenderer, "_process_tokens_async"),
        "BaseRenderer._process_multimodal": (BaseRenderer, "_process_multimodal"),
        "BaseMultiModalProcessor._get_mm_hashes": (BaseMultiModalProcessor, "_get_mm_hashes"),
    }
    originals = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}
    if any(getattr(original, _MARK, False) for original in originals.values()):
        return  # installed: every wrapper at once, below
    for name, original in originals.items():
        mismatch = _signature_mismatch(name, original)
        if mismatch is not None:
            raise RuntimeError(
                f"{ENABLE_ENV}=1: the front-end patch does not fit this vLLM ({mismatch}); "
                f"unset {ENABLE_ENV} and pass multi_modal_uuids=omnicache.integrations.vllm."
                "multi_modal_uuids(mm_data, cache_salt=...) in each prompt instead"
            )
    rules = VLLM_RULES[series.rstrip(".")]
    process_tokens = originals["BaseRenderer._process_tokens"]
    process_tokens_async = originals["BaseRenderer._process_tokens_async"]
    process_multimodal = originals["BaseRenderer._process_multimodal"]
    get_mm_hashes = originals["BaseMultiModalProcessor._get_mm_hashes"]

    def _process_tokens(self: Any, prompt: Any, *, skip_mm_cache: bool = False) -> Any:
        return process_tokens(self, _with_salt(prompt), skip_mm_cache=skip_mm_cache)

    async def _process_tokens_async(self: Any, prompt: Any, *, skip_mm_cache: bool = False) -> Any:
        return await process_tokens_async(self, _with_salt(prompt), skip_mm_cache=skip_mm_cache)

    def _process_multimodal(
        self: Any,
        prompt: list[int],
        mm_data: Mapping[str, object],
        mm_uuids: Mapping[str, object] | None,
        mm_processor_kwargs: Mapping[str, object] | None,
        media_io_kwargs: Mapping[str, Mapping[str, object]] | None = None,
        *,
        skip_mm_cache: bool = False,
    ) -> Any:
        salt = None
        if isinstance(mm_uuids, _SaltedUuids):
            salt = mm_uuids.cache_salt
            mm_uuids = mm_uuids.given
        identities = checked_multi_modal_uuids(mm_data, mm_uuids, cache_salt=salt, rules=rules)
        token = _SALT.set(salt)
        try:
            return process_multimodal(
                self,
                prompt,
                mm_data,
                identities,
                mm_processor_kwargs,
                media_io_kwargs,
                skip_mm_cache=skip_mm_cache,
            )
        finally:
            _SALT.reset(token)

    def _get_mm_hashes(self: Any, inputs: Any) -> Any:
        hashes = get_mm_hashes(self, inputs)
        salt = _SALT.get()
        if not salt:
            return hashes
        return {
            modality: [tenant_identifier(value, cache_salt=salt) for value in values]
            for modality, values in hashes.items()
        }

    wrappers = {
        "BaseRenderer._process_tokens": _process_tokens,
        "BaseRenderer._process_tokens_async": _process_tokens_async,
        "BaseRenderer._process_multimodal": _process_multimodal,
        "BaseMultiModalProcessor._get_mm_hashes": _get_mm_hashes,
    }
    for name, wrapper in wrappers.items():
        owner, attr = targets[name]
        setattr(wrapper, _MARK, True)
        wrapper.__wrapped__ = originals[name]  # type: ignore[attr-defined]
        setattr(owner, attr, wrapper)
