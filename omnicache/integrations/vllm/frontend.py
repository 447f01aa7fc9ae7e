"""omnicache's content digests as vLLM's multimodal identifiers, filled in by the front end.

Each prompt's identifiers are replaced by `checked_multi_modal_uuids`: every
item without a uuid gets the `hashing` digest of its decoded content,
computed in the front-end process (where the items are still whole: the
engine core may receive an item's data as None when vLLM's processor cache
holds it), just before vLLM's multimodal processing. The digests reach the
engine core as ``mm_features[i].identifier``, so a `RequestBlockHasher`
there keys each item by its omnicache digest. The same image sent as a PIL
object to ``LLM`` or as base64 to the OpenAI server gets the same digest.

A uuid a client sends (``multi_modal_uuids``, or ``"uuid"`` in a chat
content part) is kept unless it is shaped as a digest: the engine core takes
such an identifier as content, so it must be the item's own digest, and any
other is refused with `IdentifierMismatchError` (a ``ValueError``: the
server answers 400 and nothing is scheduled or cached). A client cannot make
its image stand in for another one's blocks, nor for vLLM's processor cache
entry of another image. An item `hashing` cannot digest (precomputed
embeddings) and that has no uuid is left to vLLM's own hash.

This is the one module that patches vLLM: vLLM has no extension point where
the front end fills in identifiers, so ``BaseRenderer._process_multimodal``
(``vllm/renderers/base.py``) is wrapped. The wrapper was written against vLLM
`PATCHED_VERSION` and refuses any other version.

Turned on by ``OMNICACHE_MM_UUIDS=1`` in the front end's environment: vLLM
calls `register` (the ``vllm.general_plugins`` entry point ``omnicache``) in
each of its processes, and it does nothing without that variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from omnicache.integrations.vllm.common import vllm_series
from omnicache.integrations.vllm.identifiers import checked_multi_modal_uuids

__all__ = ["ENABLE_ENV", "PATCHED_VERSION", "install_mm_uuids", "register"]

ENABLE_ENV = "OMNICACHE_MM_UUIDS"
PATCHED_VERSION = "0.32.0"

_MARK = "__omnicache_mm_uuids__"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: `install_mm_uuids` if ``OMNICACHE_MM_UUIDS=1``."""
    value = os.environ.get(ENABLE_ENV, "")
    if value in ("", "0"):
        return
    if value != "1":
        raise ValueError(f"{ENABLE_ENV}: expected '1' or '0', found {value!r}")
    install_mm_uuids()


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


def _identifiers(
    mm_data: Mapping[str, object], mm_uuids: Mapping[str, object] | None
) -> dict[str, list[str | None]]:
    return checked_multi_modal_uuids(mm_data, mm_uuids, unwrap=_decoded)


def install_mm_uuids() -> None:
    """Makes vLLM's renderers fill in missing ``multi_modal_uuids`` (idempotent).

    Raises:
        RuntimeError: vLLM is not version `PATCHED_VERSION`.
    """
    vllm_series()
    import vllm
    from vllm.renderers.base import BaseRenderer

    version = str(vllm.__version__)
    if version != PATCHED_VERSION:
        raise RuntimeError(
            f"{ENABLE_ENV}=1: the front-end patch expects vLLM {PATCHED_VERSION} "
            f"(BaseRenderer._process_multimodal), found {version}; unset {ENABLE_ENV} and "
            "pass multi_modal_uuids=omnicache.integrations.vllm.multi_modal_uuids(mm_data) "
            "in each prompt instead"
        )
    original = BaseRenderer._process_multimodal
    if getattr(original, _MARK, False):
        return

    # NOTE: vLLM 0.32.0's signature, exactly: callers pass mm_uuids by keyword.
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
        mm_uuids = _identifiers(mm_data, mm_uuids)
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
