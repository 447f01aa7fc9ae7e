"""The thinker -> talker hand-off (`omnicache.pipeline.TalkerRecipe`), without an engine.

The live pipeline is in ``test_vllm_live_pipeline``; here the recipe itself:
its rows, exactly as the documentation writes them, that equal thinker
blocks give bit-equal talker rows whatever the prompt's length (what makes
talker prompts share keys), its file, and the errors of bad input.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnicache.pipeline import CHUNK_ROWS, RECIPE_FILE, TalkerRecipe

THINKER, TALKER, VOCAB = 12, 8, 10


def recipe() -> TalkerRecipe:
    generator = torch.Generator().manual_seed(3)
    return TalkerRecipe(
        weight=torch.randn(TALKER, THINKER, generator=generator),
        bias=torch.randn(TALKER, generator=generator),
        embeddings=torch.randn(VOCAB, TALKER, generator=generator),
        codec_mask_id=7,
        codec_pad_id=8,
        codec_bos_id=9,
    )


def test_prompt_embeds_are_the_documented_rows() -> None:
    r = recipe()
    rows = torch.randn(70, THINKER, generator=torch.Generator().manual_seed(4))
    out = r.prompt_embeds(rows, 50)
    assert out.shape == (71, TALKER) and out.dtype == torch.float32
    projected = rows.double() @ r.weight.double().T + r.bias.double()
    want = torch.cat(
        [
            projected[:50] + r.embeddings[7].double(),
            projected[50:] + r.embeddings[8].double(),
            r.embeddings[9].double()[None],
        ]
    )
    assert torch.allclose(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[70], r.embeddings[9])


def test_equal_thinker_blocks_give_bit_equal_talker_rows_whatever_the_length() -> None:
    r = recipe()
    generator = torch.Generator().manual_seed(5)
    shared = torch.randn(2 * CHUNK_ROWS, THINKER, generator=generator)
    short = torch.cat([shared, torch.randn(3, THINKER, generator=generator)])
    long = torch.cat([shared, torch.randn(CHUNK_ROWS + 11, THINKER, generator=generator)])
    a = r.prompt_embeds(short, len(short) - 1)
    b = r.prompt_embeds(long, len(long) - 1)
    assert torch.equal(a[: 2 * CHUNK_ROWS], b[: 2 * CHUNK_ROWS])


def test_the_recipe_round_trips_through_the_talkers_folder(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    r = recipe()
    save_file({"model.embed_tokens.weight": r.embeddings}, str(tmp_path / "model.safetensors"))
    assert r.save(tmp_path) == tmp_path / RECIPE_FILE
    loaded = TalkerRecipe.load(tmp_path)
    assert torch.equal(loaded.weight, r.weight) and torch.equal(loaded.bias, r.bias)
    assert torch.equal(loaded.embeddings, r.embeddings)
    assert (loaded.codec_mask_id, loaded.codec_pad_id, loaded.codec_bos_id) == (7, 8, 9)
    with pytest.raises(ValueError, match=r"expected omnicache_talker/projection.safetensors in"):
        TalkerRecipe.load(tmp_path / "elsewhere")


def test_bad_input_is_refused_with_what_was_expected() -> None:
    r = recipe()
    with pytest.raises(ValueError, match=r"rows: expected \(positions, 12\), found \(4, 5\)"):
        r.prompt_embeds(torch.zeros(4, 5), 2)
    with pytest.raises(ValueError, match=r"num_prompt_tokens: expected int in \[1, 4\], found 5"):
        r.prompt_embeds(torch.zeros(4, THINKER), 5)
    with pytest.raises(TypeError, match=r"rows: expected a torch.Tensor, found list"):
        r.prompt_embeds([[0.0] * THINKER], 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bias: expected \(8,\), found \(7,\)"):
        TalkerRecipe(r.weight, torch.zeros(7), r.embeddings, 7, 8, 9)
    with pytest.raises(ValueError, match=r"codec_bos_id: expected int in \[0, 9\], found 10"):
        TalkerRecipe(r.weight, r.bias, r.embeddings, 7, 8, 10)
    with pytest.raises(
        ValueError, match=r"embeddings: expected \(vocabulary, 8\), found \(10, 3\)"
    ):
        TalkerRecipe(r.weight, r.bias, torch.zeros(VOCAB, 3), 7, 8, 9)
