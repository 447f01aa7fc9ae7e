"""omnicache in vLLM's OpenAI server: chat completions with base64 images, keys and metrics.

One server (``python -m vllm.entrypoints.openai.api_server``, vLLM 0.32's
live CPU engine) serves the tiny Qwen2.5-Omni thinker of
`omnicache.demo.tiny_models` (images and audio) on a loopback port with
omnicache on as a user turns it on: ``--scheduler-cls`` naming
`OmniScheduler` and ``OMNICACHE_MM_UUIDS=1``, so the front end fills in each
item's omnicache digest and checks the uuids clients send. A scripted
sequence of requests runs once against it; the tests read what it recorded:
the HTTP outcome, the ``/metrics`` prefix-cache counters around each
request, the completion's tokens, and the keys of the blocks the engine
stored (its KV cache events).

Same conditions as ``test_vllm_live``: skipped without the live engine,
failed instead under ``CI=true`` or ``OMNICACHE_REQUIRE_VLLM_LIVE=1``.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from PIL import Image
from ports import free_port
from test_vllm_live import (
    BLOCK_SIZE,
    IMAGE_SIDE,
    PREAMBLE,
    SCHEDULER,
    EventListener,
    full_block_keys,
    item_digest,
    picture,
    token_span,
)

from hashing import ContentHash, hash_identifier
from omnicache.annotations import TokenRangeAnnotation
from omnicache.block_hash import block_hash_low64
from omnicache.demo.tiny_models import OMNI_AUDIO_PAD, OMNI_IMAGE_PAD
from omnicache.identity import item_identity
from omnicache.integrations.vllm import UUID_NAMESPACE

pytestmark = pytest.mark.vllm_live

MAX_TOKENS = 8
IMAGE_TOKENS = 64  # 224 x 224 pixels: 16 x 16 patches of 14, merged 2 x 2
QUESTION = "Which colour is it?"
SERVER_READY_S = 240.0


def data_url(seed: int) -> str:
    """``picture(seed)`` as a base64 PNG data URL (lossless: the server decodes the same pixels)."""
    buffer = io.BytesIO()
    picture(seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def chat_body(url: str | None, uuid: str | None = None) -> dict[str, Any]:
    """A chat request with one image (``url`` None: a reference to ``uuid`` without data)."""
    image: dict[str, Any] = {
        "type": "image_url",
        "image_url": None if url is None else {"url": url},
    }
    if uuid is not None:
        image["uuid"] = uuid
    return {
        "model": "tiny-vl",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": PREAMBLE},
                    image,
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }


class Server:
    """A running OpenAI server and the KV cache events it publishes.

    ``options`` replace the scheduler-only configuration after the common ones
    (``--scheduler-cls``); ``env`` adds to the server's environment.
    """

    def __init__(
        self,
        model: Path,
        log: Path,
        options: Sequence[str] = ("--scheduler-cls", SCHEDULER),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        # A socket file beside the log, not a TCP port: a port found free here
        # can be taken by another socket before the engine core binds it.
        events_endpoint = f"ipc://{log.parent / 'events.ipc'}"
        self.events = EventListener(events_endpoint)
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint}
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny-vl",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", str(64 * 2**20),
            "--max-model-len", "1024", "--max-num-seqs", "4", "--dtype", "float32",
            "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--limit-mm-per-prompt", json.dumps({"image": 1, "audio": 1}),
            "--kv-events-config", json.dumps(events),
            *options,
        ]  # fmt: skip
        environment = {
            **os.environ,
            "OMNICACHE_MM_UUIDS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            **(env or {}),
        }
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            command, env=environment, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.log = log

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_READY_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"the server exited ({self.process.returncode}): {self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server was not ready in {SERVER_READY_S:.0f} s: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            self.url("/v1/chat/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def counters(self) -> tuple[int, int]:
        """vLLM's prefix-cache (queries, hits) in tokens, from ``/metrics``."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as response:
            text = response.read().decode()
        values = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
        return int(values["vllm:prefix_cache_queries_total"]), int(
            values["vllm:prefix_cache_hits_total"]
        )

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        self.events.close()


class Step(NamedTuple):
    """One request of the scripted sequence."""

    name: str
    # A picture's seed, a bad URL, or None: a reference by uuid without data.
    image: int | str | None
    uuid: str | None = None
    cache_salt: str | None = None
    xargs: dict[str, Any] | None = None
    n: int = 1


A, B, X, Y = 1, 2, 21, 22
GARBAGE_URL = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
ASK = "omnicache_prompt_hidden_states"
SEQUENCE: list[Step] = [
    Step("a", A),
    Step("a again", A),
    Step("b", B),
    Step("b again", B),
    Step("malformed", GARBAGE_URL),
    Step("b named as a", B, item_digest(picture(A), "image").hex()),
    Step("a after", A),
    Step("b after", B),
    # A client's own name for a picture is not the engine's identifier.
    Step("b as client-b", B, "client-b"),
    Step("b as client-b again", B, "client-b"),
    # Tenant B reuses the name tenant A gave its picture, for another picture.
    Step("x as shared-name, tenant a", X, "shared-name", "a"),
    Step("y as shared-name, tenant b", Y, "shared-name", "b"),
    Step("shared-name without data, tenant b", None, "shared-name", "b"),
    Step("y, tenant b", Y, None, "b"),
    Step("x, tenant b", X, None, "b"),
    # omnicache's request fields with values it cannot serve; the server
    # keeps no hidden states (no worker and connector).
    Step("hidden states 'yes'", A, xargs={ASK: "yes"}),
    Step("hidden states 2", A, xargs={ASK: 2}),
    Step("hidden states -1", A, xargs={ASK: -1}),
    Step("hidden states, n=2", A, xargs={ASK: 1}, n=2),
    Step("hidden states of a server without the store", A, xargs={ASK: 1}),
    Step("an unknown omnicache field", A, xargs={"omnicache_prompt_hidden_state": 1}),
]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's model: a tiny Qwen2.5-Omni thinker, which takes images and audio."""
    from omnicache.demo.tiny_models import build_omni_model

    return build_omni_model(tmp_path_factory.mktemp("server-model") / "qwen2.5-omni-tiny")


@pytest.fixture(scope="module")
def server(vl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One OpenAI server for the module's tests, ready on ``/health``."""
    running = Server(vl_model, tmp_path_factory.mktemp("server") / "server.log")
    try:
        running.wait_ready()
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def served(server: Server, vl_model: Path) -> dict[str, Any]:
    """SEQUENCE through the server, once: each request's outcome and counter moves."""
    results: dict[str, Any] = {"model": vl_model}
    first_event = len(server.events.stored)  # events of this sequence only
    for step in SEQUENCE:
        url = data_url(step.image) if isinstance(step.image, int) else step.image
        body = chat_body(url, step.uuid)
        if step.cache_salt is not None:
            body["cache_salt"] = step.cache_salt
        if step.xargs is not None:
            body["vllm_xargs"] = step.xargs
        if step.n != 1:
            body.update(n=step.n, temperature=1.0)
        before = server.counters()
        status, answer = server.chat(body)
        after = server.counters()
        results[step.name] = {
            "status": status,
            "body": answer,
            "queries": after[0] - before[0],
            "hits": after[1] - before[1],
        }
    stored = {
        block_hash_low64(key)
        for step in SEQUENCE
        if results[step.name]["status"] == 200
        for key in prompt_keys(vl_model, results[step.name]["body"], step)
    }
    server.events.wait_for(stored, timeout=10.0)
    results["events"] = set(server.events.stored[first_event:])
    return results


@functools.cache
def tokenizer_of(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def item_span(ids: list[int], model: Path, pad: str) -> tuple[int, int]:
    """Offset and length of one item's ``pad`` tokens in a prompt of ``model``."""
    return token_span(ids, tokenizer_of(model).convert_tokens_to_ids(pad))


def prompt_token_ids(model: Path) -> list[int]:
    """The prompt the server builds: the chat template, the image pad expanded to its tokens."""
    tokenizer = tokenizer_of(model)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": PREAMBLE},
                {"type": "image"},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pad = OMNI_IMAGE_PAD
    assert text.count(pad) == 1
    ids: list[int] = tokenizer.encode(
        text.replace(pad, pad * IMAGE_TOKENS), add_special_tokens=False
    )
    return ids


def image_offset(ids: list[int], model: Path) -> int:
    offset, length = item_span(ids, model, OMNI_IMAGE_PAD)
    assert length == IMAGE_TOKENS
    return offset


def prompt_keys(model: Path, body: dict[str, Any], step: Step) -> list[Any]:
    """omnicache's keys of the full blocks a completed request computed: over its picture's
    content, whatever uuid came with it."""
    assert isinstance(step.image, int)
    digest = item_digest(picture(step.image), "image", step.cache_salt)
    return digest_keys(model, body, digest, step.cache_salt)


def digest_keys(
    model: Path, body: dict[str, Any], digest: ContentHash, cache_salt: str | None = None
) -> list[Any]:
    """omnicache's keys of a completed request's full blocks, its image identified by ``digest``."""
    ids = list(body["prompt_token_ids"])
    computed = ids + list(body["choices"][0]["token_ids"][:-1])
    offset = image_offset(ids, model)
    annotation = TokenRangeAnnotation(offset, IMAGE_TOKENS, digest, 0, IMAGE_TOKENS)
    return full_block_keys(model, computed, [annotation], cache_salt)


def test_server_prompt_is_the_expected_tokens(served: dict[str, Any]) -> None:
    ids = prompt_token_ids(served["model"])
    assert served["a"]["body"]["prompt_token_ids"] == ids
    assert served["b"]["body"]["prompt_token_ids"] == ids
    assert served["a"]["body"]["usage"]["prompt_tokens"] == len(ids)


def test_base64_images_move_the_prefix_cache_counters_exactly(served: dict[str, Any]) -> None:
    ids = prompt_token_ids(served["model"])
    full = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE  # vLLM never hits the last token
    before_image = image_offset(ids, served["model"]) // BLOCK_SIZE * BLOCK_SIZE
    assert 0 < before_image < full
    expected = {
        "a": 0,
        "a again": full,
        "b": before_image,
        "b again": full,
        "a after": full,
        "b after": full,
        # Named by the client, identified by its content: B's blocks.
        "b as client-b": full,
        "b as client-b again": full,
    }
    found = {name: served[name]["hits"] for name in expected}
    assert found == expected
    assert {name: served[name]["status"] for name in expected} == dict.fromkeys(expected, 200)
    assert {name: served[name]["queries"] for name in expected} == dict.fromkeys(expected, len(ids))
    # The usage vLLM reports per request agrees with its counters.
    for name, hits in expected.items():
        details = served[name]["body"]["usage"].get("prompt_tokens_details") or {}
        assert details.get("cached_tokens", 0) == hits, name


def test_cached_images_give_the_outputs_computed_without_cache(served: dict[str, Any]) -> None:
    def tokens(name: str) -> list[int]:
        return list(served[name]["body"]["choices"][0]["token_ids"])

    assert len(tokens("a")) == MAX_TOKENS
    assert tokens("a again") == tokens("a") == tokens("a after")
    assert tokens("b again") == tokens("b") == tokens("b after")
    assert tokens("b as client-b") == tokens("b as client-b again") == tokens("b")


def test_malformed_image_is_refused_and_changes_nothing(served: dict[str, Any]) -> None:
    result = served["malformed"]
    assert result["status"] == 400
    assert (result["queries"], result["hits"]) == (0, 0)
    assert "image" in result["body"]["error"]["message"].lower()


def test_uuid_naming_another_images_digest_is_refused(served: dict[str, Any]) -> None:
    result = served["b named as a"]
    assert result["status"] == 400
    assert (result["queries"], result["hits"]) == (0, 0)
    digest_a = item_digest(picture(A), "image").hex()
    digest_b = item_digest(picture(B), "image").hex()
    message = result["body"]["error"]["message"]
    assert (
        f"multi_modal_uuids['image'][0]: expected the item's identity {digest_b} or a uuid "
        f"that is not shaped as a digest, found {digest_a}"
    ) in message


def test_server_blocks_are_keyed_by_omnicache_digests(served: dict[str, Any]) -> None:
    expected = {
        block_hash_low64(key)
        for step in SEQUENCE
        if served[step.name]["status"] == 200
        for key in prompt_keys(served["model"], served[step.name]["body"], step)
    }
    # Keyed over the image's digest (computed by the server's front end from
    # the decoded PNG), whatever uuid the client sent, under its tenant's salt.
    assert served["events"] == expected
    # No block was keyed by a client's uuid.
    body = served["b as client-b"]["body"]
    by_uuid = digest_keys(
        served["model"], body, hash_identifier("client-b", namespace=f"{UUID_NAMESPACE}/image")
    )
    assert (
        not {block_hash_low64(key) for key in by_uuid}
        - {
            block_hash_low64(key)
            for key in digest_keys(served["model"], body, item_digest(picture(B), "image"))
        }
        & served["events"]
    )


def test_a_tenant_reusing_another_tenants_uuid_is_answered_from_its_own_picture(
    served: dict[str, Any],
) -> None:
    ids = prompt_token_ids(served["model"])
    full = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    before_image = image_offset(ids, served["model"]) // BLOCK_SIZE * BLOCK_SIZE
    names = [
        "x as shared-name, tenant a",
        "y as shared-name, tenant b",
        "y, tenant b",
        "x, tenant b",
    ]
    assert {name: served[name]["status"] for name in names} == dict.fromkeys(names, 200)
    # B's picture under A's name computed B's own blocks (keyed by its content,
    # test above): the same picture from B without a name hits all of them,
    # and A's picture from B only the text before it.
    assert [served[name]["hits"] for name in names] == [0, 0, full, before_image]

    def tokens(name: str) -> list[int]:
        return list(served[name]["body"]["choices"][0]["token_ids"])

    assert tokens("y as shared-name, tenant b") == tokens("y, tenant b")
    assert tokens("x as shared-name, tenant a") == tokens("x, tenant b")


def test_a_reference_to_a_uuid_without_data_is_refused(served: dict[str, Any]) -> None:
    result = served["shared-name without data, tenant b"]
    assert result["status"] == 400
    assert (result["queries"], result["hits"]) == (0, 0)
    assert (
        "multi_modal_data['image'][0]: expected the item's data, found None (uuid "
        "'shared-name'); an item referred to by its uuid alone is refused"
    ) in result["body"]["error"]["message"]


def test_bad_omnicache_fields_get_a_400_naming_the_field_and_the_values(
    served: dict[str, Any],
) -> None:
    field = "extra_args['omnicache_prompt_hidden_states']"
    expected = {
        "hidden states 'yes'": f"{field}: expected True or False (or 1 or 0), found 'yes'",
        "hidden states 2": f"{field}: expected True or False (or 1 or 0), found 2",
        "hidden states -1": f"{field}: expected True or False (or 1 or 0), found -1",
        "hidden states, n=2": (
            f"{field}: expected n=1 (one prompt, one result: ask the other choices in a second "
            "request, which hits the prefix cache), found n=2"
        ),
        "hidden states of a server without the store": (
            f"{field}: expected an engine that keeps hidden states (kv_transfer_config naming "
            "'OmniStoreConnector'), found kv_connector None"
        ),
        "an unknown omnicache field": (
            "extra_args: expected omnicache fields among ('omnicache_prompt_hidden_states', "
            "'omnicache_all_hidden_states'), found 'omnicache_prompt_hidden_state'"
        ),
    }
    for name, message in expected.items():
        result = served[name]
        assert (result["status"], result["queries"], result["hits"]) == (400, 0, 0), name
        assert message in result["body"]["error"]["message"], name


# -- files: the digest `omnicache hash FILE` prints is the server's ----------------------


def cli_digest(path: Path) -> ContentHash:
    """The digest the ``omnicache hash`` command prints for ``path`` (a real subprocess)."""
    result = subprocess.run(
        [sys.executable, "-m", "omnicache", "hash", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    digest, _kind, name = result.stdout.split()
    assert name == str(path)
    return ContentHash(bytes.fromhex(digest))


def file_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def upload_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """Pictures of the server's size, each new to it, in the forms the loader treats apart."""
    import numpy as np
    from media_files import jpeg_with_orientation

    files: dict[str, tuple[Path, str]] = {}
    files["png"] = (folder / "plain.png", "image/png")
    picture(3).save(files["png"][0])
    # EXIF orientation 6: stored on its side, shown (and modelled) turned 90 degrees clockwise.
    files["jpeg-exif-6"] = (folder / "turned.jpg", "image/jpeg")
    jpeg_with_orientation(files["jpeg-exif-6"][0], picture(4), 6)
    files["rgba-png"] = (folder / "cut-out.png", "image/png")
    alpha = np.random.default_rng(5).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE), dtype=np.uint8)
    rgba = picture(5).copy()
    rgba.putalpha(Image.fromarray(alpha, "L"))
    rgba.save(files["rgba-png"][0])
    files["palette-png"] = (folder / "indexed.png", "image/png")
    picture(6).quantize(colors=64).save(files["palette-png"][0])
    return files


def test_omnicache_hash_prints_the_digest_the_server_keys_an_upload_by(
    server: Server, vl_model: Path, tmp_path: Path
) -> None:
    files = upload_files(tmp_path)
    digests = {name: cli_digest(path) for name, (path, _mime) in files.items()}
    assert len(set(digests.values())) == len(files)
    before = set(server.events.stored)
    first_event = len(server.events.stored)
    bodies: dict[str, dict[str, Any]] = {}
    for name, (path, mime) in files.items():
        status, body = server.chat(chat_body(file_url(path, mime)))
        assert status == 200, (name, body)
        bodies[name] = body
    expected = {
        block_hash_low64(key)
        for name in files
        for key in digest_keys(vl_model, bodies[name], digests[name])
    }
    server.events.wait_for(expected, timeout=10.0)
    # Every block the engine stored for these uploads is keyed by the digest
    # the command printed, and no other block was stored.
    assert set(server.events.stored[first_event:]) == expected - before

    # The JPEG as stored (its EXIF orientation ignored) is another picture:
    # none of the keys over its image was stored.
    path = files["jpeg-exif-6"][0]
    with Image.open(path) as stored:
        sideways = item_digest(Image.fromarray(np.asarray(stored.convert("RGB"))), "image")
    assert sideways != digests["jpeg-exif-6"]
    body = bodies["jpeg-exif-6"]
    upright_keys = set(digest_keys(vl_model, body, digests["jpeg-exif-6"]))
    sideways_keys = {
        block_hash_low64(key)
        for key in digest_keys(vl_model, body, sideways)
        if key not in upright_keys
    }
    assert sideways_keys
    assert not sideways_keys & set(server.events.stored)


def test_omnicache_hash_prints_the_digest_the_server_keys_a_wav_upload_by(
    server: Server, vl_model: Path, tmp_path: Path
) -> None:
    """A WAV sent to the server is keyed by the digest ``omnicache hash`` prints for it.

    The clip is at 16 kHz, the model's rate: the live environment has none of
    the resamplers vLLM would use for another rate.
    """
    from media_files import tone, write_audio

    path = write_audio(tmp_path / "stereo.wav", tone(8_000, 2, seed=7), 16_000, "PCM_16")
    digest = cli_digest(path)
    first_event = len(server.events.stored)
    body = {
        **chat_body(data_url(A)),
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": PREAMBLE},
                    {
                        "type": "input_audio",
                        "input_audio": {
                            "data": base64.b64encode(path.read_bytes()).decode("ascii"),
                            "format": "wav",
                        },
                    },
                    {"type": "text", "text": "What is the sound?"},
                ],
            }
        ],
    }
    status, answer = server.chat(body)
    assert status == 200, answer
    ids = list(answer["prompt_token_ids"])
    computed = ids + list(answer["choices"][0]["token_ids"][:-1])
    offset, length = item_span(ids, vl_model, OMNI_AUDIO_PAD)
    annotation = TokenRangeAnnotation(offset, length, digest, 0, length)
    keys = [block_hash_low64(key) for key in full_block_keys(vl_model, computed, [annotation])]
    server.events.wait_for(set(keys), timeout=10.0)
    # The text before the clip was stored by earlier requests; from the block
    # that holds the clip's first token on, every block is new and keyed by the
    # command's digest.
    assert set(keys) <= set(server.events.stored)
    assert set(keys[offset // BLOCK_SIZE :]) <= set(server.events.stored[first_event:])


def test_omnicache_hash_prints_the_digest_of_what_vllms_audio_loader_returns(
    tmp_path: Path,
) -> None:
    """WAVs the server cannot take here (other rates) against vLLM's own decode.

    The server runs ``AudioMediaIO().load_bytes(data)`` on an audio upload
    before it resamples; called here in the live environment, its output's
    identity is what omnicache's front end would key by.
    """
    from media_files import tone, write_audio
    from vllm.multimodal.media.audio import AudioMediaIO

    clips = [
        write_audio(tmp_path / "pcm16-stereo.wav", tone(4_000, 2, seed=1), 16_000, "PCM_16"),
        write_audio(tmp_path / "float-mono.wav", tone(3_000, 1, seed=2), 22_050, "FLOAT"),
        write_audio(tmp_path / "pcm24-3ch.wav", tone(2_000, 3, seed=3), 48_000, "PCM_24"),
    ]
    for path in clips:
        waveform, sample_rate = AudioMediaIO().load_bytes(path.read_bytes())
        assert cli_digest(path) == item_identity((waveform, sample_rate), modality="audio")
