"""The architecture matrix: omnicache on tiny models of real architectures, each against its oracle.

Each architecture's tiny random-weight model (a real config and a real
processor, built here: `omnicache.demo.tiny_models`, `tiny_architectures`)
runs in a fresh interpreter, in three in-process engines in turn:

1. the oracle: prefix caching off, omnicache's worker computing every prompt
   position's hidden states;
2. omnicache with the front end off: scheduler, worker and connector, the
   client sending ``multi_modal_uuids(mm_data, cache_salt=...)``;
3. omnicache with the front end on (``install_mm_uuids``, what
   ``OMNICACHE_MM_UUIDS=1`` installs): the client sends a name of its own.

Both omnicache engines run the same requests (`PLAN`) through a KV cache of
`NUM_BLOCKS` blocks: an item, again, another item of the same size behind
the same text (for Qwen2.5-VL: the same frames at another fps), the item
with other text after it (a hit that ends inside the item's placeholder
range), the item under another salt, twice, then text that evicts every
block, and the item once more on reused blocks. Each request's hits must be
those `expected_hits` derives from its tokens, its prompt hidden states and
greedy tokens the oracle's. docs/architectures.md has the table of what each
architecture shows and what the CPU engine cannot.

Same conventions as ``test_vllm_live``: skipped without the live CPU engine
of vLLM 0.32, failed instead under ``CI=true`` or
``OMNICACHE_REQUIRE_VLLM_LIVE=1``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_vllm_live as live
from PIL import Image

from omnicache.integrations.vllm.common import WORKER_CLS, store_kv_transfer_config

pytestmark = live.pytestmark

BLOCK = live.BLOCK_SIZE
# 40 blocks of KV (2 layers x K and V x 2 heads x 32 values x 4 bytes a token, in
# every model here) and the store's rows for as many (128 float32 values a token).
NUM_BLOCKS = 40
BLOCK_BYTES = 2 * 2 * 2 * 32 * BLOCK * 4
STORE_BYTES = 128 * BLOCK * 4
STAGED_BYTES = 256 * 2**10
# Text-only prompts of 8 blocks each, 48 blocks in all: more than the pool,
# so that every block cached before them is handed out again.
NUM_FILLERS, FILLER_TOKENS = 6, 8 * BLOCK
SALT = "tenant-b"
BEFORE = "Describe what you are given in one sentence, please, and name every colour in it. "
AFTER = ("Which colour is it?", "Name every shape you find there.")


def picture(seed: int, side: int = 224) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB")


def clip(seed: int, seconds: int = 4) -> tuple[Any, int]:
    rng = np.random.default_rng(seed)
    samples = rng.uniform(-0.5, 0.5, seconds * 16_000).astype(np.float32)
    return samples, 16_000


VIDEO_METADATA = {
    "total_num_frames": 8,
    "fps": 2.0,
    "duration": 4.0,
    "video_backend": "opencv",
    "frames_indices": list(range(8)),
    "do_sample_frames": False,
}


def video(fps: float) -> tuple[Any, dict[str, Any]]:
    """Eight frames of 112x112 pixels, the same for every fps; the metadata says the fps."""
    frames = np.random.default_rng(7).integers(0, 256, (8, 112, 112, 3), dtype=np.uint8)
    return frames, {**VIDEO_METADATA, "fps": fps, "duration": 8 / fps}


def chatml(placeholder: str) -> Callable[[str, str], str]:
    return lambda before, after: (
        f"<|im_start|>user\n{before}{placeholder}{after}<|im_end|>\n<|im_start|>assistant\n"
    )


@dataclass(frozen=True)
class Arch:
    """One architecture of the matrix: its model, its items and its prompt format."""

    builder: str  # "module:function" building the model in a directory
    modality: str
    embed_token: str  # the token the processor's embeddings replace
    prompt: Callable[[str, str], str]  # (text before the item, text after) -> prompt
    items: tuple[Callable[[], object], Callable[[], object]]  # item A, item B of A's size
    engine: dict[str, Any] = field(default_factory=dict)
    # A token inside the placeholder range that receives no embedding, where a
    # hit of the plan ends on one.
    boundary_token: str | None = None
    # The text before the item: it places the item so that a block ends inside it.
    before: str = BEFORE


TINY = "omnicache.demo.tiny_models"
ARCHES: dict[str, Arch] = {
    "qwen2-vl": Arch(
        f"{TINY}:build_vl_model", "image", "<|image_pad|>",
        chatml("<|vision_start|><|image_pad|><|vision_end|>"),
        (lambda: picture(1), lambda: picture(2)),
    ),
    "qwen2.5-vl-video": Arch(
        "tiny_architectures:build_qwen25vl_model", "video", "<|video_pad|>",
        chatml("<|vision_start|><|video_pad|><|vision_end|>"),
        (lambda: video(2.0), lambda: video(1.0)),  # the same frames, another fps
    ),
    "qwen2-audio": Arch(
        f"{TINY}:build_audio_model", "audio", "<|AUDIO|>",
        chatml("<|audio_bos|><|AUDIO|><|audio_eos|>"),
        (lambda: clip(1), lambda: clip(2)),
    ),
    "qwen2.5-omni-thinker": Arch(
        f"{TINY}:build_omni_model", "image", "<|IMAGE|>",
        chatml("<|vision_start|><|IMAGE|><|vision_end|>"),
        (lambda: picture(1), lambda: picture(2)),
    ),
    "llava-1.5": Arch(
        "tiny_architectures:build_llava_model", "image", "<image>",
        lambda before, after: f"{before} USER: <image>\n{after} ASSISTANT:",
        (lambda: picture(1, 112), lambda: picture(2, 112)),
    ),
    "gemma-3": Arch(
        "tiny_architectures:build_gemma3_model", "image", "<image_soft_token>",
        lambda before, after: (
            f"<bos><start_of_turn>user\n{before}<start_of_image>{after}<end_of_turn>\n"
            "<start_of_turn>model\n"
        ),
        (lambda: picture(1), lambda: picture(2)),
    ),
    "idefics3": Arch(
        "tiny_architectures:build_idefics3_model", "image", "<image>",
        lambda before, after: f"User:{before}<image>{after}<end_of_utterance>\nAssistant:",
        (lambda: picture(1), lambda: picture(2)),
        before="Look: " + BEFORE,
    ),
    "mistral-3-pixtral": Arch(
        "tiny_architectures:build_mistral3_model", "image", "[IMG]",
        lambda before, after: f"<s>[INST]{before}[IMG]{after}[/INST]",
        (lambda: picture(1), lambda: picture(2)),
        boundary_token="[IMG_BREAK]",
    ),
    "ultravox": Arch(
        "tiny_architectures:build_ultravox_model", "audio", "<|audio|>",
        lambda before, after: (
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
            f"{before}<|audio|>{after}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        (lambda: clip(1), lambda: clip(2)),
        engine={"trust_remote_code": True},
        before="Listen: " + BEFORE,
    ),
}  # fmt: skip

# The requests of both omnicache engines, in order: (item, text after, salt); "fill"
# stands for the text-only prompts that evict every cached block.
PLAN: list[tuple[str, int, str | None]] = [
    ("a", 0, None),
    ("a", 0, None),  # again: every full block but the last token's
    ("b", 0, None),  # another item of A's size: the blocks before it
    ("a", 1, None),  # other text after A: a hit that ends inside A's placeholder range
    ("a", 0, SALT),  # another tenant: nothing
    ("a", 0, SALT),  # again: its own blocks
    ("fill", 0, None),
    ("a", 0, None),  # on blocks handed out again: nothing, and A's rows
]
# The prompts the oracle computes: every (item, text after) of the plan.
ORACLE = [("a", 0), ("b", 0), ("a", 1)]


def engine_args(model: Path, arch: Arch, **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "worker_cls": WORKER_CLS,
        "kv_transfer_config": store_kv_transfer_config(max_staged_bytes=STAGED_BYTES),
        "kv_cache_memory_bytes": NUM_BLOCKS * (BLOCK_BYTES + STORE_BYTES) + STAGED_BYTES,
        "max_model_len": 1024,
        "limit_mm_per_prompt": {arch.modality: 1},
        **arch.engine,
    }
    args.update(overrides)
    return live.engine_args(model, **args)


def fillers() -> list[dict[str, Any]]:
    rng = np.random.default_rng(99)
    return [
        {"prompt_token_ids": rng.integers(1, 300, FILLER_TOKENS).tolist()}
        for _ in range(NUM_FILLERS)
    ]


MATRIX_CHILD = """
import json, sys
from pathlib import Path
import torch
import test_vllm_architectures as m
from vllm import LLM, SamplingParams
from omnicache.integrations.vllm import multi_modal_uuids
from omnicache.integrations.vllm.frontend import install_mm_uuids
from omnicache.integrations.vllm.results import take_prompt_hidden_states

name, model, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
arch = m.ARCHES[name]
items = {"a": arch.items[0], "b": arch.items[1]}
ask = SamplingParams(
    max_tokens=m.live.MAX_TOKENS, temperature=0,
    extra_args={"omnicache_prompt_hidden_states": True},
)

def prompt(item, after, salt, uuids):
    data = {arch.modality: items[item]()}
    built = {"prompt": arch.prompt(arch.before, m.AFTER[after]), "multi_modal_data": data}
    if uuids == "client":
        built["multi_modal_uuids"] = multi_modal_uuids(data, cache_salt=salt)
    elif uuids == "named":
        built["multi_modal_uuids"] = {arch.modality: ["a client's own name"]}
    if salt is not None:
        built["cache_salt"] = salt
    return built

def serve(llm, requests):
    found = {"hits": [], "tokens": [], "prompt_ids": []}
    states = []
    for request in requests:
        (output,) = llm.generate(request, ask, use_tqdm=False)
        found["hits"].append(output.num_cached_tokens)
        found["tokens"].append(list(output.outputs[0].token_ids))
        found["prompt_ids"].append(list(output.prompt_token_ids))
        (rows,) = take_prompt_hidden_states(llm, [output])
        states.append(rows)
    return found, states

def plan(uuids):
    requests = []
    for item, after, salt in m.PLAN:
        if item == "fill":
            requests += m.fillers()
        else:
            requests.append(prompt(item, after, salt, uuids))
    return requests

report, states = {}, {}
llm = LLM(**m.engine_args(model, arch, enable_prefix_caching=False))
tokens = filter(None, (arch.embed_token, arch.boundary_token))
report["token_ids"] = {t: int(llm.get_tokenizer().convert_tokens_to_ids(t)) for t in tokens}
report["oracle"], states["oracle"] = serve(
    llm, [prompt(item, after, None, None) for item, after in m.ORACLE]
)
m.live.shut(llm)
for mode, uuids in (("client uuids", "client"), ("front end", "named")):
    if mode == "front end":
        install_mm_uuids()  # what OMNICACHE_MM_UUIDS=1 installs at the engine's start
    llm = LLM(**m.engine_args(model, arch, scheduler_cls=m.live.SCHEDULER))
    report[mode], states[mode] = serve(llm, plan(uuids))
    m.live.shut(llm)
torch.save(states, out)
print(json.dumps(report))
"""


def first_difference(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def expected_hits(oracle: dict[str, Any], embed_id: int, fillers_ids: list[list[int]]) -> list[int]:
    """Each plan request's hit, from its tokens: what exact prefix caching gives."""
    a, b, a_other = oracle["prompt_ids"]
    full = (len(a) - 1) // BLOCK * BLOCK  # never the last token
    before_item = a.index(embed_id) // BLOCK * BLOCK
    assert b.index(embed_id) == a.index(embed_id) and len(b) == len(a)
    inside = first_difference(a, a_other) // BLOCK * BLOCK
    return [0, full, before_item, inside, 0, full] + [0] * len(fillers_ids) + [0]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("architectures")


def build(root: Path, name: str) -> Path:
    import importlib

    module, function = ARCHES[name].builder.split(":")
    path = root / name
    if not (path / "config.json").exists():
        getattr(importlib.import_module(module), function)(path)
    return path


def close(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5, rtol=1e-5))


@pytest.mark.parametrize("name", list(ARCHES))
def test_each_architecture_hits_as_exact_prefix_caching_and_serves_the_oracles_rows(
    name: str, models: Path
) -> None:
    import torch

    arch = ARCHES[name]
    model = build(models, name)
    out = models / f"{name}.pt"
    report = json.loads(live.run_child(MATRIX_CHILD, name, str(model), str(out), timeout_s=600))
    states = torch.load(out)
    oracle = report["oracle"]
    embed_id = report["token_ids"][arch.embed_token]
    filler_ids = [request["prompt_token_ids"] for request in fillers()]
    hits = expected_hits(oracle, embed_id, filler_ids)
    a = oracle["prompt_ids"][0]
    first_embed = a.index(embed_id)
    last_embed = len(a) - 1 - a[::-1].index(embed_id)
    # The plan's fourth hit ends inside the item's placeholder range, after its
    # first embedding: the rest of the item is computed on top of cached KV.
    assert first_embed < hits[3] <= last_embed, (first_embed, hits[3], last_embed)
    if arch.boundary_token is not None:
        assert a[hits[3]] == report["token_ids"][arch.boundary_token]
    # Which oracle prompt each plan request is, fillers aside.
    which = [0, 0, 1, 2, 0, 0] + [None] * NUM_FILLERS + [0]
    for mode in ("client uuids", "front end"):
        served = report[mode]
        assert served["hits"] == hits, mode
        for index, oracle_index in enumerate(which):
            if oracle_index is None:
                assert served["prompt_ids"][index] == filler_ids[index - 6]
                continue
            assert served["prompt_ids"][index] == oracle["prompt_ids"][oracle_index], (mode, index)
            assert served["tokens"][index] == oracle["tokens"][oracle_index], (mode, index)
            got, want = states[mode][index], states["oracle"][oracle_index]
            assert close(got, want), (mode, index, float((got - want).abs().max()))
    # The item that differs has other rows from its first embedding on.
    a_rows, b_rows = states["oracle"][0], states["oracle"][1]
    assert torch.equal(a_rows[:first_embed], b_rows[:first_embed])
    assert not close(a_rows[first_embed:], b_rows[first_embed:])
