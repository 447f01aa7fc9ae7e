"""A live engine attacked as a hostile client would: tenants stay apart, nothing wrong is served.

A fresh interpreter (vLLM loads its front-end plugin once per process) runs
an in-process engine of the tiny Qwen2-VL with omnicache's scheduler, worker
and connector and ``OMNICACHE_MM_UUIDS=1``, every request asking for its
prompt's hidden states:

- tenant A sends picture X under the client uuid "shared-name", then tenant
  B sends another picture Y under the same uuid: B's prompt hidden states
  must be Y's (an engine with caching off is the oracle), and B's blocks
  keyed by Y's digest; B's reference to "shared-name" without data is refused;
- an RGBA picture handed to ``LLM`` as a PIL object is keyed and computed as
  the server opens its PNG (the server's side: ``test_vllm_server``);
- bad values of omnicache's request fields, and ``n=2`` with hidden states,
  are refused before anything is scheduled.

Tensor-parallel engines with the Redis tier, which once served another
rank's KV shard, are checked in ``test_vllm_live_parallel``.

Same conventions as ``test_vllm_live``: skipped without the live CPU engine
of vLLM 0.32, failed instead under ``CI=true`` or
``OMNICACHE_REQUIRE_VLLM_LIVE=1``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_vllm_live as live
from PIL import Image

from hashing import ContentHash, hash_identifier, hash_image
from omnicache.annotations import TokenRangeAnnotation
from omnicache.identity import item_identity, tenant_identifier
from omnicache.integrations.vllm import UUID_NAMESPACE
from omnicache.media import load_image

pytestmark = live.pytestmark

X_SEED, Y_SEED = 11, 12
SHARED = "shared-name"

ATTACK_CHILD = """
import json, sys
from pathlib import Path
import torch
from PIL import Image
import test_vllm_live as t
from vllm import LLM, SamplingParams
from omnicache.integrations.vllm.results import take_prompt_hidden_states
from omnicache.integrations.vllm import UUID_NAMESPACE
from omnicache.media import load_image

model, rgba_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
STORE = dict(
    worker_cls="omnicache.integrations.vllm.worker.OmniCPUWorker",
    kv_transfer_config={
        "kv_connector": "OmniStoreConnector",
        "kv_connector_module_path": "omnicache.integrations.vllm.connector",
        "kv_role": "kv_both",
    },
    max_model_len=512,
    limit_mm_per_prompt={"image": 1},
)
ASK = {"omnicache_prompt_hidden_states": True}

def params(n=1, **extra):
    # NOTE: vLLM allows n > 1 only when sampling.
    return SamplingParams(
        n=n, max_tokens=t.MAX_TOKENS, temperature=0 if n == 1 else 1.0, extra_args=extra or None
    )

def prompt(image, salt=None, uuid=None):
    built = t.image_prompt(image, salt, with_uuids=False)
    if uuid is not None:
        built["multi_modal_uuids"] = {"image": [uuid]}
    return built

def refusal(prompt, sampling):
    try:
        llm.generate(prompt, sampling, use_tqdm=False)
    except ValueError as error:
        return [type(error).__name__, str(error)]
    return None

with Image.open(rgba_path) as opened:
    opened.load()
    rgba = opened
x, y = t.picture(int(sys.argv[4])), t.picture(int(sys.argv[5]))
found = {"hits": {}, "computed": {}, "refused": {}}
states = {}
llm = LLM(**t.engine_args(model, scheduler_cls=t.SCHEDULER, **STORE))
for name, request in {
    "a: x as shared-name": prompt(x, "a", "shared-name"),
    "b: y as shared-name": prompt(y, "b", "shared-name"),
    "rgba": prompt(rgba),
}.items():
    (output,) = llm.generate(request, params(**ASK), use_tqdm=False)
    found["hits"][name] = output.num_cached_tokens
    found["computed"][name] = t.computed_tokens(output)
    (states[name],) = take_prompt_hidden_states(llm, [output])
found["span"] = t.placeholder_span(llm, output, t.IMAGE_PAD)
found["keys"] = sorted(key.hex() for key in t.cached_keys(llm))
before = t.prefix_counters(llm)
data_less = prompt(x, "b", "shared-name")
data_less["multi_modal_data"] = {"image": None}
found["refused"]["b: shared-name without data"] = refusal(data_less, params(**ASK))
for value in ("yes", 2, -1):
    found["refused"][repr(value)] = refusal(
        prompt(x), params(omnicache_prompt_hidden_states=value)
    )
found["refused"]["n=2"] = refusal(prompt(x), params(n=2, **ASK))
found["refused"]["unknown"] = refusal(prompt(x), params(omnicache_hidden_states=1))
found["counters"] = [before, t.prefix_counters(llm)]
found["keys_after_refusals"] = sorted(key.hex() for key in t.cached_keys(llm))
t.shut(llm)
off = LLM(**t.engine_args(model, enable_prefix_caching=False, **STORE))
for name, image in {"x": x, "y": y, "rgba as the server opens it": load_image(rgba_path)}.items():
    (output,) = off.generate(prompt(image), params(**ASK), use_tqdm=False)
    (states["off: " + name],) = take_prompt_hidden_states(off, [output])
t.shut(off)
torch.save(states, out)
print(json.dumps(found))
"""


def rgba_png(path: Path) -> Path:
    """An RGBA picture of the model's size with every level of transparency."""
    rng = np.random.default_rng(5)
    alpha = rng.integers(0, 256, (live.IMAGE_SIDE, live.IMAGE_SIDE), dtype=np.uint8)
    rgba = live.picture(13).copy()
    rgba.putalpha(Image.fromarray(alpha, "L"))
    rgba.save(path)
    return path


@pytest.fixture(scope="module")
def attack(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch

    from omnicache.demo.tiny_models import build_vl_model

    root = tmp_path_factory.mktemp("tenants")
    model = build_vl_model(root / "qwen2-vl-tiny")
    png = rgba_png(root / "cut-out.png")
    out = root / "states.pt"
    found: dict[str, Any] = json.loads(
        live.run_child(
            ATTACK_CHILD,
            str(model),
            str(png),
            str(out),
            str(X_SEED),
            str(Y_SEED),
            OMNICACHE_MM_UUIDS="1",
        )
    )
    found["states"] = torch.load(out)
    found["model"], found["png"] = model, png
    return found


def keys_over(found: dict[str, Any], name: str, digest: ContentHash, salt: str | None) -> set[str]:
    """omnicache's keys of the blocks request ``name`` computed, its picture keyed by ``digest``."""
    offset, length = found["span"]
    annotation = TokenRangeAnnotation(offset, length, digest, 0, length)
    keys = live.full_block_keys(found["model"], found["computed"][name], [annotation], salt)
    return {key.hex() for key in keys}


def close(a: Any, b: Any) -> bool:
    import torch

    assert a.shape == b.shape
    return bool(torch.allclose(a, b, atol=1e-5, rtol=1e-5))


def test_a_tenant_reusing_another_tenants_uuid_gets_its_own_picture(attack: dict[str, Any]) -> None:
    states = attack["states"]
    # A's rows are X's; B's, under the uuid A used, are Y's and not X's.
    assert close(states["a: x as shared-name"], states["off: x"])
    assert close(states["b: y as shared-name"], states["off: y"])
    assert not close(states["b: y as shared-name"], states["off: x"])
    # Neither tenant hit the other's blocks.
    assert attack["hits"] == {"a: x as shared-name": 0, "b: y as shared-name": 0, "rgba": 0}


def identifier(image: Image.Image, salt: str | None) -> ContentHash:
    """The identifier the front end gives a picture of a request salted ``salt``."""
    identity = item_identity(image, modality="image").hex()
    return ContentHash(bytes.fromhex(tenant_identifier(identity, cache_salt=salt)))


def test_every_block_is_keyed_by_the_content_of_its_picture(attack: dict[str, Any]) -> None:
    x, y = live.picture(X_SEED), live.picture(Y_SEED)
    a = keys_over(attack, "a: x as shared-name", identifier(x, "a"), "a")
    b = keys_over(attack, "b: y as shared-name", identifier(y, "b"), "b")
    rgba = keys_over(attack, "rgba", identifier(load_image(attack["png"]), None), None)
    # Exactly these blocks are cached: the uuid was no identifier, and the
    # refused requests below stored nothing.
    assert set(attack["keys"]) == set(attack["keys_after_refusals"]) == a | b | rgba
    uuid = hash_identifier(SHARED, namespace=f"{UUID_NAMESPACE}/image")
    by_uuid = keys_over(attack, "b: y as shared-name", uuid, "b") - b
    assert by_uuid
    assert not by_uuid & set(attack["keys"])


def test_an_rgba_picture_is_what_the_server_makes_of_its_png(attack: dict[str, Any]) -> None:
    states = attack["states"]
    assert close(states["rgba"], states["off: rgba as the server opens it"])
    composite = keys_over(attack, "rgba", identifier(load_image(attack["png"]), None), None)
    with Image.open(attack["png"]) as opened:
        assert opened.mode == "RGBA"
        as_given = keys_over(attack, "rgba", hash_image(opened), None)
    # Keyed by the composite over white (test above), never by the RGBA pixels.
    assert as_given - composite
    assert not (as_given - composite) & set(attack["keys"])


def test_a_reference_without_data_and_bad_fields_are_refused_before_anything_runs(
    attack: dict[str, Any],
) -> None:
    field = "extra_args['omnicache_prompt_hidden_states']"
    # A ValueError to LLM's caller (the child caught it as one), of vLLM's validation kind.
    error = "RequestFieldError"
    assert attack["refused"] == {
        "b: shared-name without data": [
            "DataLessItemError",
            "multi_modal_data['image'][0]: expected the item's data, found None (uuid "
            "'shared-name'); an item referred to by its uuid alone is refused, since vLLM's "
            "processor and encoder caches would answer it with whatever any tenant sent under "
            "that uuid",
        ],
        "'yes'": [error, f"{field}: expected True or False (or 1 or 0), found 'yes'"],
        "2": [error, f"{field}: expected True or False (or 1 or 0), found 2"],
        "-1": [error, f"{field}: expected True or False (or 1 or 0), found -1"],
        "n=2": [
            error,
            f"{field}: expected n=1 (one prompt, one result: ask the other choices in a second "
            "request, which hits the prefix cache), found n=2",
        ],
        "unknown": [
            error,
            "extra_args: expected omnicache fields among ('omnicache_prompt_hidden_states', "
            "'omnicache_all_hidden_states'), found 'omnicache_hidden_states'",
        ],
    }
    # Nothing was looked up for them.
    before, after = attack["counters"]
    assert before == after
