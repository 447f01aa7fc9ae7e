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
  identified to the engine by the `hashing` digest of its decoded content
  (`checked_multi_modal_uuids`), computed here, where items are still whole
  (the engine core may receive an item's data as None when vLLM's processor
  cache holds it). A PIL image is digested as vLLM's processor receives it
  (upright, RGB), so the same picture sent as a PIL object of any mode to
  ``LLM`` or as base64 to the server gets the same digest, and so the same
  keys. A uuid a client sends is never the engine's identifier (vLLM's
  processor and encoder caches are not salted per tenant): one shaped as a
  digest must be the item's own, an item sent without data is refused.

This is the one module that patches vLLM, since vLLM has no extension point
at either place: ``InputProcessor._validate_params``
(``vllm/v1/engine/input_processor.py``) and
``BaseRenderer._process_multimodal`` (``vllm/renderers/base.py``) are
wrapped. Each wrapper checks the signature it was written for (`PATCHED`),
not a version: the identifier patch refuses to start on another signature;
the request check, on by default for every vLLM with omnicache installed,
logs a warning and stays out (the engine core then logs a bad value and
ignores it instead).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from omnicache.integrations.vllm.common import check_request_fields, vllm_series
from omnicache.integrations.vllm.identifiers import checked_multi_modal_uuids
from omnicache.media import VLLM_RULES

__all__ = ["ENABLE_ENV", "PATCHED", "install_mm_uuids", "install_request_checks", "register"]

ENABLE_ENV = "OMNICACHE_MM_UUIDS"

PATCHED: dict[str, tuple[str, ...]] = {
    "BaseRenderer._process_multimodal": (
        "self", "prompt", "mm_data", "mm_uuids", "mm_processor_kwargs", "media_io_kwargs",
        "*", "skip_mm_cache",
    ),
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


def _decoded(modality: str, item: object) -> object:
    """What vLLM's media loaders made of an item, unwrapped for `content_identifier`."""
    media = getattr(item, "media", None)
    if media is not None and type(item).__name__ == "MediaWithBytes":
        item = media  # the decoded image or video next to its encoded bytes
    if modality == "video" and isinstance(item, tuple) and len(item) == 2:
        frames, metadata = item
        if isinstance(metadata, dict):
            return frames  # vLLM's loaders give (frames, metadata)
    return item


def install_mm_uuids() -> None:
    """Makes vLLM's renderers identify every item by its content digest (idempotent).

    Raises:
        RuntimeError: ``BaseRenderer._process_multimodal`` is not the
            function this was written for (`PATCHED`).
    """
    series = vllm_series()
    from vllm.renderers.base import BaseRenderer

    original = BaseRenderer._process_multimodal
    if getattr(original, _MARK, False):
        return
    mismatch = _signature_mismatch("BaseRenderer._process_multimodal", original)
    if mismatch is not None:
        raise RuntimeError(
            f"{ENABLE_ENV}=1: the front-end patch does not fit this vLLM ({mismatch}); unset "
            f"{ENABLE_ENV} and pass multi_modal_uuids=omnicache.integrations.vllm."
            "multi_modal_uuids(mm_data) in each prompt instead"
        )
    rules = VLLM_RULES[series.rstrip(".")]

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
        mm_uuids = checked_multi_modal_uuids(mm_data, mm_uuids, unwrap=_decoded, rules=rules)
        return original(
            self,
            prompt,
            mm_data,
            mm_uuids,
            mm_processor_kwargs,
            media_io_kwargs,
            skip_mm_cache=skip_mm_cache,
        )

    setattr(_process_multimodal, _MARK, True)
    _process_multimodal.__wrapped__ = original  # type: ignore[attr-defined]
    BaseRenderer._process_multimodal = _process_multimodal
