"""omnicache's front end in vLLM: identifiers that name content only, checked request fields.

The rules are checked here on their own, against the installed vLLM (0.33's
scheduler-side code under ``./dev test``, the live 0.32 engine under ``./dev
live``); ``test_vllm_tenants`` and ``test_vllm_server`` attack them through a
live engine and the OpenAI server.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from media_files import jpeg_with_orientation, noise, rgb_with_trns
from PIL import Image
from test_vllm_integration import BLUE, BLUE_HEX, RED, RED_HEX, VLLM_MISSING

from omnicache.identity import item_identity, tenant_identifier
from omnicache.integrations.vllm.common import (
    ALL_HIDDEN_STATES,
    CONNECTOR_NAME,
    PROMPT_HIDDEN_STATES,
    check_request_fields,
    wants_hidden_states,
)
from omnicache.integrations.vllm.identifiers import (
    DataLessItemError,
    IdentifierMismatchError,
    checked_multi_modal_uuids,
    content_identifier,
    installed_rules,
)
from omnicache.media import VLLM_RULES

pytestmark = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")

SHARED = "shared-name"  # a client's own name for an item: not shaped as a digest


# -- identifiers ------------------------------------------------------------------------


def test_every_item_with_data_is_identified_by_its_content_whatever_uuid_it_came_with() -> None:
    from vllm.multimodal.media.base import MediaWithBytes

    wave = np.ones(400, dtype=np.float32)
    clip = item_identity((wave, 8_000), modality="audio").hex()
    found = checked_multi_modal_uuids(
        {"image": [RED, BLUE, RED], "audio": (wave, 8_000)},
        {"image": [None, SHARED, RED_HEX], "audio": [SHARED]},
    )
    assert found == {"image": [RED_HEX, BLUE_HEX, RED_HEX], "audio": [clip]}
    # Two tenants naming different pictures alike give the engine two identifiers.
    assert checked_multi_modal_uuids({"image": RED}, {"image": SHARED}) == {"image": [RED_HEX]}
    assert checked_multi_modal_uuids({"image": BLUE}, {"image": SHARED}) == {"image": [BLUE_HEX]}
    # What the server's loader decoded is identified as the picture it holds.
    boxed = checked_multi_modal_uuids({"image": [MediaWithBytes(RED, b"upload")]}, None)
    assert boxed == {"image": [RED_HEX]}
    # A uuid a client computed for its tenant is the item's own too.
    salted = tenant_identifier(RED_HEX, cache_salt="a")
    assert checked_multi_modal_uuids({"image": RED}, {"image": salted}, cache_salt="a") == {
        "image": [RED_HEX]
    }
    # Embeddings are identified by their values.
    embeds = torch.zeros(1, 4, 8)
    assert checked_multi_modal_uuids({"image": embeds}, {"image": SHARED}) == {
        "image": [item_identity(embeds[0], modality="image", form="embeddings").hex()]
    }
    # An item that cannot be identified exactly is left to vLLM's own content
    # hash, with or without a client's name for it; so is a modality vLLM
    # cuts into items by the model's rules.
    odd = (np.zeros((2, 4, 4, 3), dtype=np.uint8), {"fps": np.float32(2.0)})
    assert checked_multi_modal_uuids({"video": [odd]}, {"video": SHARED}) == {"video": [None]}
    fields = {"image_embeds": embeds, "image_grid_thw": torch.ones(1, 3, dtype=torch.int64)}
    assert checked_multi_modal_uuids({"image": fields, "audio": wave}, {"image": SHARED}) == {
        "audio": [item_identity(wave, modality="audio").hex()]
    }
    chunks = [{"type": "image", "image": RED}]  # a model's own modality (Kimi's vision chunks)
    assert checked_multi_modal_uuids({"vision_chunk": chunks}, {"vision_chunk": SHARED}) == {}


def test_an_item_without_data_is_refused_whatever_its_uuid() -> None:
    for uuid in (SHARED, RED_HEX, None):
        with pytest.raises(DataLessItemError) as info:
            checked_multi_modal_uuids({"image": [RED, None]}, {"image": [None, uuid]})
        assert str(info.value) == (
            f"multi_modal_data['image'][1]: expected the item's data, found None (uuid {uuid!r}); "
            "an item referred to by its uuid alone is refused, since vLLM's processor and "
            "encoder caches would answer it with whatever any tenant sent under that uuid"
        )
    # Refused before any item is digested: the first item's mismatch is not reached.
    with pytest.raises(DataLessItemError, match=r"^multi_modal_data\['audio'\]\[0\]"):
        checked_multi_modal_uuids({"image": RED, "audio": None}, {"image": BLUE_HEX})
    assert issubclass(DataLessItemError, ValueError)


def test_a_uuid_naming_another_items_digest_is_refused() -> None:
    with pytest.raises(
        IdentifierMismatchError,
        match=rf"^multi_modal_uuids\['image'\]\[1\]: expected the item's identity "
        rf"{BLUE_HEX} or a uuid that is not shaped as a digest, found {RED_HEX}$",
    ):
        checked_multi_modal_uuids({"image": [RED, BLUE]}, {"image": [None, RED_HEX]})
    # Another tenant's scoped identifier of the same picture is not this tenant's.
    other = tenant_identifier(BLUE_HEX, cache_salt="b")
    with pytest.raises(
        IdentifierMismatchError,
        match=rf"expected the item's identity {BLUE_HEX} \(or, scoped to its cache_salt, "
        rf"{tenant_identifier(BLUE_HEX, cache_salt='a')}\) .*found {other}$",
    ):
        checked_multi_modal_uuids({"image": BLUE}, {"image": other}, cache_salt="a")
    odd = (np.zeros((2, 4, 4, 3), dtype=np.uint8), {"fps": np.float32(2.0)})
    with pytest.raises(
        IdentifierMismatchError,
        match=r"^multi_modal_uuids\['video'\]\[0\]: expected a uuid that is not shaped "
        rf"as a digest for an item whose identity cannot be checked \(.*float32.*\), found "
        rf"{RED_HEX}$",
    ):
        checked_multi_modal_uuids({"video": [odd]}, {"video": RED_HEX})
    with pytest.raises(
        IdentifierMismatchError,
        match=r"^multi_modal_uuids\['image'\]\[0\]: expected a uuid that is not shaped "
        r"as a digest for an item whose identity cannot be checked \(vLLM cuts image data "
        rf"given as a mapping by the model's rules\), found {RED_HEX}$",
    ):
        checked_multi_modal_uuids(
            {"image": {"image_embeds": torch.zeros(1, 4, 8)}}, {"image": RED_HEX}
        )
    assert issubclass(IdentifierMismatchError, ValueError)


def test_the_uuids_must_match_the_items() -> None:
    with pytest.raises(
        ValueError,
        match=r"^multi_modal_uuids\['image'\]: expected 2 uuids \(one per item\), found 1$",
    ):
        checked_multi_modal_uuids({"image": [RED, BLUE]}, {"image": ["a"]})
    with pytest.raises(
        ValueError,
        match=r"^multi_modal_uuids: expected modalities among those of multi_modal_data "
        r"\['image'\], found 'audio'$",
    ):
        checked_multi_modal_uuids({"image": RED}, {"audio": "a"})
    with pytest.raises(
        TypeError, match=r"^multi_modal_uuids\['image'\]\[0\]: expected str or None, found int$"
    ):
        checked_multi_modal_uuids({"image": RED}, {"image": 7})
    with pytest.raises(
        TypeError, match=r"^multi_modal_uuids: expected a mapping modality -> uuids, found list$"
    ):
        checked_multi_modal_uuids({"image": RED}, ["a"])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^multi_modal_data: expected a mapping modality -> items, found str$"
    ):
        checked_multi_modal_uuids("image", None)  # type: ignore[arg-type]


def test_items_are_cut_into_as_many_as_vllms_parser_cuts_them_into() -> None:
    """`omnicache.identity.split_items` against the installed vLLM's own parser."""
    from vllm.multimodal.parse import MultiModalDataParser

    from omnicache.identity import split_items

    picture, frames = RED, np.zeros((2, 4, 4, 3), dtype=np.uint8)
    metadata = {"fps": 2.0, "frames_indices": [0, 1]}
    wave = np.zeros(64, dtype=np.float32)
    forms = {
        "image": [
            picture, [picture, BLUE], np.zeros((4, 4, 3), np.uint8), np.zeros((3, 4, 4, 3)),
            torch.zeros(2, 5, 8), [torch.zeros(5, 8)] * 3, [np.zeros((4, 4, 3), np.uint8)] * 2,
        ],
        "video": [
            frames, [frames, frames], [picture, BLUE], list(frames), (frames, metadata),
            [(frames, metadata)] * 2, torch.zeros(2, 5, 8), np.zeros((2, 2, 4, 4, 3)),
        ],
        "audio": [
            wave, (wave, 16_000), [0.25, 0.5], np.zeros((3, 64)), [wave, wave],
            [(wave, 16_000)] * 2, torch.zeros(2, 5, 8), torch.zeros(3, 64),
        ],
    }  # fmt: skip
    parser = MultiModalDataParser(target_sr=16_000)  # the clips are at its rate
    for modality, datas in forms.items():
        for index, data in enumerate(datas):
            items = split_items(data, modality=modality)
            parsed = parser.parse_mm_data({modality: data})[modality]
            assert len(items) == parsed.get_count(), (modality, index)
            embeddings = type(parsed).__name__.endswith("EmbeddingItems")
            assert [item.form == "embeddings" for item in items] == [embeddings] * len(items), (
                modality,
                index,
            )


# -- one picture, one digest ------------------------------------------------------------


def pictures(folder: Path) -> dict[str, tuple[Image.Image, Path]]:
    """Each kind of picture vLLM makes RGB, as a PIL object and as the file a client uploads."""
    found: dict[str, tuple[Image.Image, Path]] = {}
    for mode, seed in (("RGBA", 1), ("LA", 2), ("L", 3), ("CMYK", 4)):
        image = noise(seed, mode=mode)
        path = folder / f"{mode}.{'jpg' if mode == 'CMYK' else 'png'}"
        image.save(path)
        with Image.open(path) as opened:
            opened.load()
            found[mode] = (opened, path)
    palette = noise(5).quantize(colors=16)
    palette.save(folder / "P-trns.png", transparency=3)
    turned = jpeg_with_orientation(folder / "exif-6.jpg", noise(6), 6)
    trns = rgb_with_trns(folder / "RGB-trns.png", 7)
    for name, path in (("P-trns", folder / "P-trns.png"), ("exif-6", turned), ("RGB-trns", trns)):
        with Image.open(path) as opened:
            opened.load()
            found[name] = (opened, path)
    return found


def test_a_picture_has_the_identity_of_what_the_model_sees_whichever_way_it_arrives(
    tmp_path: Path,
) -> None:
    """A PIL object of any mode (``LLM``), its file's bytes, and the file as vLLM's own
    loader decodes an upload: one identity."""
    from vllm.multimodal.media.base import MediaWithBytes
    from vllm.multimodal.media.image import ImageMediaIO

    rules = installed_rules()
    for name, (image, path) in pictures(tmp_path).items():
        upload = ImageMediaIO().load_file(path)  # what the server hands the front end
        server = content_identifier(upload, modality="image")
        assert content_identifier(image, modality="image") == server, name
        assert content_identifier(path.read_bytes(), modality="image") == server, name
        assert content_identifier(path, modality="image", rules=rules) == server, name
        found = checked_multi_modal_uuids({"image": image}, None)
        assert found == {"image": [server]}, name
        if name != "RGB-trns":  # the one picture the series make differently
            # Taken as it is, the unconverted picture would be another item.
            as_is = content_identifier(MediaWithBytes(image, b""), modality="image")
            assert as_is != server, name


def test_the_series_differ_on_an_rgb_picture_with_a_transparent_colour(tmp_path: Path) -> None:
    from vllm.multimodal.media.base import MediaWithBytes

    with Image.open(rgb_with_trns(tmp_path / "trns.png", 8)) as image:
        image.load()
        as_is = content_identifier(image, modality="image", rules=VLLM_RULES["0.32"])
        composited = content_identifier(image, modality="image", rules=VLLM_RULES["0.33"])
        assert as_is == content_identifier(MediaWithBytes(image, b""), modality="image")
        flat = Image.new("RGB", image.size, (255, 255, 255))
        flat.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
        assert composited == content_identifier(MediaWithBytes(flat, b""), modality="image")
        assert as_is != composited


def test_vllms_parser_makes_every_picture_what_model_image_makes_it(tmp_path: Path) -> None:
    """The rule omnicache writes down (`omnicache.media.model_image`) is the installed vLLM's."""
    from vllm.multimodal.image import convert_image_mode, normalize_image

    from omnicache.media import model_image

    for name, (image, _path) in pictures(tmp_path).items():
        expected = convert_image_mode(normalize_image(image), "RGB")
        found = model_image(image, rules=installed_rules())
        assert (found.mode, found.size) == (expected.mode, expected.size), name
        assert found.tobytes() == expected.tobytes(), name


# -- request fields ---------------------------------------------------------------------


def params(n: int = 1, **extra: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(n=n, max_tokens=4, extra_args=extra or None)


def test_request_fields_are_accepted_as_documented() -> None:
    for value in (True, False, 1, 0):
        check_request_fields(params(**{PROMPT_HIDDEN_STATES: value}), kv_connector=CONNECTOR_NAME)
    # Not asking needs no store, and any n.
    check_request_fields(params(n=3, **{PROMPT_HIDDEN_STATES: 0}), kv_connector=None)
    check_request_fields(params(n=3, other_plugin_field="x"), kv_connector=None)
    check_request_fields(SimpleNamespace(), kv_connector=None)  # pooling params: no extra_args


@pytest.mark.parametrize("value", ["yes", 2, -1, 1.0, None, "1"])
def test_a_bad_value_is_refused_naming_the_field_and_the_values_accepted(value: Any) -> None:
    with pytest.raises(ValueError) as info:
        check_request_fields(params(**{PROMPT_HIDDEN_STATES: value}), kv_connector=CONNECTOR_NAME)
    assert str(info.value) == (
        "extra_args['omnicache_prompt_hidden_states']: expected True or False (or 1 or 0), "
        f"found {value!r}"
    )


def test_a_request_that_cannot_be_served_as_it_asks_is_refused() -> None:
    ask = {PROMPT_HIDDEN_STATES: 1}
    with pytest.raises(ValueError) as info:
        check_request_fields(params(**{"omnicache_prompt_hidden_state": 1}), kv_connector=None)
    assert str(info.value) == (
        "extra_args: expected omnicache fields among ('omnicache_prompt_hidden_states', "
        "'omnicache_all_hidden_states'), found 'omnicache_prompt_hidden_state'"
    )
    with pytest.raises(ValueError) as info:
        check_request_fields(params(n=2, **ask), kv_connector=CONNECTOR_NAME)
    assert str(info.value) == (
        "extra_args['omnicache_prompt_hidden_states']: expected n=1 (one prompt, one result: ask "
        "the other choices in a second request, which hits the prefix cache), found n=2"
    )
    for connector in (None, "LMCacheConnectorV1"):
        with pytest.raises(ValueError) as info:
            check_request_fields(params(**ask), kv_connector=connector)
        assert str(info.value) == (
            "extra_args['omnicache_prompt_hidden_states']: expected an engine that keeps hidden "
            f"states (kv_transfer_config naming 'OmniStoreConnector'), found kv_connector "
            f"{connector!r}"
        )


def test_hidden_states_are_asked_without_stop_strings_and_every_position_wins() -> None:
    from vllm import SamplingParams

    every = {ALL_HIDDEN_STATES: True}
    assert wants_hidden_states(params(**every)) == "all"
    assert wants_hidden_states(params(**every, **{PROMPT_HIDDEN_STATES: 1})) == "all"
    assert wants_hidden_states(params(**{ALL_HIDDEN_STATES: 0, PROMPT_HIDDEN_STATES: 1})) == (
        "prompt"
    )
    assert wants_hidden_states(params()) is None
    # Stop token ids end a request in the engine: served.
    check_request_fields(
        SamplingParams(max_tokens=4, stop_token_ids=[7], extra_args=every),
        kv_connector=CONNECTOR_NAME,
    )
    # A stop string ends the request in the front end: the response would
    # carry no kv_transfer_params, so even the prompt's rows could not be taken.
    for field, asks in (
        (PROMPT_HIDDEN_STATES, {PROMPT_HIDDEN_STATES: True}),
        (ALL_HIDDEN_STATES, every),
    ):
        with pytest.raises(ValueError) as info:
            check_request_fields(
                SamplingParams(max_tokens=4, stop=["x"], extra_args=asks),
                kv_connector=CONNECTOR_NAME,
            )
        assert str(info.value) == (
            f"extra_args['{field}']: expected no stop strings (vLLM's front end ends such a "
            "request itself: its response carries no kv_transfer_params to take the result "
            "with, and the engine may have computed past the stop string; stop_token_ids end "
            "the request in the engine), found stop=['x']"
        )
    with pytest.raises(ValueError, match=r"extra_args\['omnicache_all_hidden_states'\]: expected"):
        check_request_fields(params(**{ALL_HIDDEN_STATES: "yes"}), kv_connector=CONNECTOR_NAME)


# -- the patches: capabilities, not versions --------------------------------------------


def test_the_functions_the_front_end_wraps_have_the_parameters_it_expects() -> None:
    from vllm.multimodal.processing.processor import BaseMultiModalProcessor
    from vllm.renderers.base import BaseRenderer
    from vllm.v1.engine.input_processor import InputProcessor

    from omnicache.integrations.vllm import frontend

    owners = {
        "BaseRenderer": BaseRenderer,
        "InputProcessor": InputProcessor,
        "BaseMultiModalProcessor": BaseMultiModalProcessor,
    }
    assert len(frontend.PATCHED) == 5
    for name in frontend.PATCHED:
        owner = owners[name.split(".")[0]]
        function = getattr(owner, name.split(".")[1])
        function = getattr(function, "__wrapped__", function)
        assert frontend._signature_mismatch(name, function) is None, name

    def other(self: Any, params: Any, *, supported_tasks: Any) -> None: ...

    assert frontend._signature_mismatch("InputProcessor._validate_params", other) == (
        "InputProcessor._validate_params: expected parameters ('self', 'params', "
        "'supported_tasks'), found ('self', 'params', '*', 'supported_tasks')"
    )


def test_request_checks_are_installed_once_and_stay_out_where_the_api_differs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    from omnicache.integrations.vllm import frontend

    unwrapped = getattr(InputProcessor._validate_params, "__wrapped__", None)
    original = InputProcessor._validate_params if unwrapped is None else unwrapped
    monkeypatch.setattr(InputProcessor, "_validate_params", original)
    frontend.install_request_checks()
    wrapped = InputProcessor._validate_params
    assert wrapped.__wrapped__ is original  # type: ignore[attr-defined]
    frontend.install_request_checks()
    assert InputProcessor._validate_params is wrapped

    def changed(self: Any, params: Any) -> None: ...

    monkeypatch.setattr(InputProcessor, "_validate_params", changed)
    with caplog.at_level("WARNING", logger=frontend.__name__):
        frontend.install_request_checks()
    assert InputProcessor._validate_params is changed
    assert caplog.messages == [
        "omnicache: request fields are not checked in this front end "
        "(InputProcessor._validate_params: expected parameters ('self', 'params', "
        "'supported_tasks'), found ('self', 'params')); the engine ignores a bad one with a "
        "warning"
    ]


# -- versions -----------------------------------------------------------------------------


def test_a_newer_vllm_runs_under_the_newest_series_rules_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    from omnicache.integrations.vllm import common

    common._warn_untested.cache_clear()
    monkeypatch.setattr(vllm, "__version__", "0.34.1rc2")
    with caplog.at_level("WARNING", logger=common.__name__):
        assert common.vllm_series() == "0.33."
        assert common.vllm_series() == "0.33."
    assert caplog.messages == [
        "omnicache: vLLM 0.34.1rc2 is newer than the series it was tested with; running under "
        "0.33.x's rules, and every hook refuses where the API it uses differs"
    ]
    for older in ("0.31.9", "0.9.2", "unknown"):
        monkeypatch.setattr(vllm, "__version__", older)
        with pytest.raises(ImportError) as info:
            common.vllm_series()
        assert str(info.value).startswith(
            f"omnicache.integrations.vllm: expected vLLM 0.32.x or 0.33.x or newer, found {older}; "
        )
    common._warn_untested.cache_clear()
