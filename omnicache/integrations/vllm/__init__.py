"""omnicache inside vLLM 0.32/0.33: its keys, and the hidden states of a live engine.

This package is the only code that imports vLLM, and it does so lazily:
importing it needs no vLLM; what builds vLLM objects raises an ImportError
that says how to install it. Its modules follow vLLM's processes
(docs/architecture.md draws the walk of one request through them):

- front end (``LLM``'s process, the API server): ``identifiers`` (each
  image's, clip's and video's `omnicache.identity` as vLLM's item identifier,
  scoped to its tenant: `multi_modal_uuids`) and ``frontend`` (vLLM's
  ``general_plugins`` entry point: request fields checked, items identified
  by their content and scoped to their tenant);
- engine core: ``keys`` (`RequestBlockHasher`: omnicache keys in
  ``request.block_hashes``), ``manager`` (`OmniKVCacheManager`: vLLM's KV
  cache manager with hits capped to the rows the worker holds), ``mirror``
  (`StoreMirror`: the table of what the worker holds; each step's plan)
  and ``scheduler`` (`OmniScheduler`, named as vLLM's ``scheduler_cls``);
- between them: ``plan`` (`StepPlan`, the one message) and ``connector``
  (`OmniStoreConnector`, the KV connector that carries it);
- worker: ``worker`` (`OmniCPUWorker`, `OmniGPUWorker`: the store of hidden
  states and prompt results) and ``tier`` (the Redis tier of KV and rows);
- ``common``: the version gate, the names that turn omnicache on, request fields.

Not imported here (they subclass vLLM's classes, so importing them imports
vLLM): ``scheduler``, ``connector``, ``worker``.
"""

from omnicache.integrations.vllm.block_hasher import (
    RequestBlockHasher,
    adapter_id,
    install_block_hasher,
    make_request,
)
from omnicache.integrations.vllm.common import INSTALL_HINT
from omnicache.integrations.vllm.identifiers import (
    UUID_NAMESPACE,
    content_identifier,
    make_mm_features,
    multi_modal_uuids,
)
from omnicache.integrations.vllm.kv_cache_manager import OmniKVCacheManager, OmniStats

__all__ = [
    "INSTALL_HINT",
    "UUID_NAMESPACE",
    "OmniKVCacheManager",
    "OmniStats",
    "RequestBlockHasher",
    "adapter_id",
    "content_identifier",
    "install_block_hasher",
    "make_mm_features",
    "make_request",
    "multi_modal_uuids",
]
