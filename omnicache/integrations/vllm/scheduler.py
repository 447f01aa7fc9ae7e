"""omnicache turned on inside a vLLM engine: `OmniScheduler`, a scheduler given by name.

vLLM builds its scheduler from the class named by ``scheduler_cls`` (``LLM(...,
scheduler_cls="omnicache.integrations.vllm.scheduler.OmniScheduler")``, or
``--scheduler-cls`` on the server), inside the engine core's process: in
process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, in the engine core's own
process by default. That one name is all it takes, and no vLLM module is
patched:

- every request the scheduler receives is keyed with a `RequestBlockHasher`:
  its ``block_hashes`` become omnicache keys, and vLLM extends them with the
  same hasher for every appended token (the engine core keys a new request
  with vLLM's own hasher first; `OmniScheduler.add_request` replaces those
  keys before the request is queued or looked up);
- the KV cache manager is wrapped in an `OmniKVCacheManager`. Alone, it
  caps no hit. With the `OmniStoreConnector` configured
  (``kv_transfer_config``) and omnicache's worker (``worker_cls``), the
  worker stores each step's hidden states, a `StoreMirror` keeps the table
  of what it holds and plans each step, bound to the connector as its
  scheduler side (with a tier, with the tier's reader): every hit is capped
  to blocks whose rows the worker holds.

Multimodal items enter the keys through ``mm_features[i].identifier``: pass
``multi_modal_uuids=omnicache.integrations.vllm.multi_modal_uuids(mm_data,
cache_salt=salt)`` in the prompt so that these are the items' identities
scoped to the tenant (computed in the caller's process, from the items
themselves, `omnicache.identity`), or set ``OMNICACHE_MM_UUIDS=1``
to have vLLM's front end fill them in (`omnicache.integrations.vllm.frontend`);
otherwise they are vLLM's own content hashes, which the hasher takes as
digests too.

Options, read from the environment of the engine core's process when the
scheduler is built (a spawned engine core inherits the caller's):

- ``OMNICACHE_BLOCK_ALGORITHM``: the block key algorithm (default "sha256");
- ``OMNICACHE_NAMESPACE``: the keys' namespace (default: the model's name).

Importing this module needs vLLM 0.32 or 0.33 (see `require_vllm`).
"""

from __future__ import annotations

import os
from typing import Any

from hashing import ALGORITHMS, Algorithm
from omnicache.block_hash import DEFAULT_BLOCK_ALGORITHM
from omnicache.integrations.vllm.block_hasher import RequestBlockHasher, scheduler_block_hasher
from omnicache.integrations.vllm.common import vllm_series
from omnicache.integrations.vllm.connector import OmniStoreConnector
from omnicache.integrations.vllm.kv_cache_manager import OmniKVCacheManager
from omnicache.integrations.vllm.kv_tier import tier_reader
from omnicache.integrations.vllm.mirror import StoreMirror

_SERIES = vllm_series()  # vLLM imports this module by name: fail here, with the install hint.

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

__all__ = [
    "ALGORITHM_ENV",
    "NAMESPACE_ENV",
    "OmniScheduler",
]

ALGORITHM_ENV = "OMNICACHE_BLOCK_ALGORITHM"
NAMESPACE_ENV = "OMNICACHE_NAMESPACE"


def algorithm_from_env() -> Algorithm:
    """The block key algorithm ``OMNICACHE_BLOCK_ALGORITHM`` names (default "sha256")."""
    value = os.environ.get(ALGORITHM_ENV)
    if value is None or value == "":
        return DEFAULT_BLOCK_ALGORITHM
    for algorithm in ALGORITHMS:
        if value == algorithm:
            return algorithm
    raise ValueError(f"{ALGORITHM_ENV}: expected one of {ALGORITHMS}, found {value!r}")


class OmniScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler, keying requests with omnicache keys through a wrapped manager.

    Attributes:
        omni_block_hasher: the `RequestBlockHasher` every request is keyed with.
        omni_manager: the `OmniKVCacheManager` standing as ``kv_cache_manager``.
        omni_mirror: the `StoreMirror` of the worker's stamps, when the
            `OmniStoreConnector` is configured (else None).
    """

    kv_cache_manager: Any  # vLLM's manager, then the wrapper

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        manager = self.kv_cache_manager
        if not manager.enable_caching:
            raise ValueError(
                "OmniScheduler: expected prefix caching enabled (enable_prefix_caching=True), "
                "found it off"
            )
        namespace = os.environ.get(NAMESPACE_ENV) or None
        self.omni_block_hasher: RequestBlockHasher = scheduler_block_hasher(
            self.vllm_config,
            self.hash_block_size,
            series=_SERIES,
            namespace=namespace,
            algorithm=algorithm_from_env(),
        )
        # NOTE: the rows follow one full-attention group, whose blocks may be
        # coarser than the hash blocks (see `manager.store_group`).
        self.omni_manager = OmniKVCacheManager(manager)
        self.kv_cache_manager = self.omni_manager
        self.omni_mirror: StoreMirror | None = None
        # NOTE: vLLM builds the connector (by name) inside its scheduler's
        # constructor, before the manager is wrapped.
        if isinstance(self.connector, OmniStoreConnector):
            reader = None
            if self.connector.tier is not None:
                reader = tier_reader(self.connector.tier, self.vllm_config, self.kv_cache_config)
            self.omni_mirror = self.omni_manager.attach_mirror(reader)
            self.connector.bind_scheduler_side(self.omni_mirror)

    def add_request(self, request: Any) -> None:
        """Keys a new request with omnicache keys, then queues it as vLLM does.

        With the store, a request that asks for prompt logprobs or per-token
        embeddings reads the prefix cache (`reads_prefix_from_store`).
        """
        if request.request_id not in self.requests:
            # NOTE: the request keeps its hasher and calls it on every
            # appended token; it was keyed with vLLM's hasher when created.
            request._block_hasher = self.omni_block_hasher
            request.block_hashes.clear()
            request.update_block_hashes()
            if self.omni_mirror is not None and reads_prefix_from_store(
                request, chunked_prefill=bool(self.scheduler_config.enable_chunked_prefill)
            ):
                request.skip_reading_prefix_cache = False
        super().add_request(request)


def reads_prefix_from_store(request: Any, *, chunked_prefill: bool) -> bool:
    """Whether a request vLLM keeps off the prefix cache for its per-position outputs can read it.

    vLLM sets ``skip_reading_prefix_cache`` on every request with
    ``prompt_logprobs`` and on pooling's ``token_embed``: its model runner
    computes those outputs only from the rows it computes. With omnicache's
    store every hit comes with its rows, and the worker gives vLLM the hit
    positions' outputs from them (`worker.PromptOutputs`): prompt logprobs
    by vLLM's own recipe; per-token embeddings as the hit's rows at the head
    of the rows vLLM's pooler gathers chunk by chunk, which it does only
    with chunked prefill on.

    Not for a request that set the flag for another reason: none with
    ``prompt_logprob_token_ids`` (vLLM serves them with its V2 model runner
    only, which omnicache's worker refuses), none with prompt embeddings
    (vLLM computes no prompt logprobs for them), no other pooling task.
    """
    if not request.skip_reading_prefix_cache or request.prompt_token_ids is None:
        return False
    pooling = request.pooling_params
    if pooling is not None:
        return chunked_prefill and pooling.task == "token_embed"
    params = request.sampling_params
    return (
        params is not None
        and params.prompt_logprobs is not None
        and getattr(params, "prompt_logprob_token_ids", None) is None
    )
