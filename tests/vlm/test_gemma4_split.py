"""``split`` of a Gemma 4 checkpoint without a server: the LLM half is the checkpoint's text model
as a ``Gemma4ForCausalLM`` (its config as it is, ``final_logit_softcapping`` kept) that, given the
image rows and the per-layer inputs of the pad id at the image positions, computes HF
``Gemma4ForConditionalGeneration``'s logits; the vision half is ``write_vision_half``'s; a 26B /
31B split says its images are blocks on the sliding layers only."""

from __future__ import annotations

import json
import shutil
from functools import cache

import pytest
import torch
from safetensors.torch import load_file
from transformers.modeling_outputs import BaseModelOutputWithPooling

import helpers
from sgl_embeds.vlm import load_encoder
from sgl_embeds.vlm.checkpoint import load_split_llm, split
from sgl_embeds_protocol.family import FAMILY_FILE
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.gemma4 import tiny_gemma4_dir

QUESTION = "the <|image|> and <|image|> what is it"


@cache
def _split(tmp_root: str) -> tuple:
    return split(tiny_gemma4_dir("e2b"), f"{tmp_root}/e2b", log=lambda _: None)


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    return _split(str(tmp_path_factory.mktemp("gemma4-split")))


def test_the_llm_half_is_the_text_model_as_a_causal_lm(halves):
    llm, vision = halves
    src = tiny_gemma4_dir("e2b")
    theirs = json.loads((src / "config.json").read_text())["text_config"]
    ours = json.loads((llm / "config.json").read_text())
    assert ours.pop("architectures") == ["Gemma4ForCausalLM"] and ours["model_type"] == "gemma4_text"
    theirs.pop("architectures", None)
    assert {k: v for k, v in ours.items() if k != "transformers_version"} == {
        k: v for k, v in theirs.items() if k != "transformers_version"}
    weights = load_file(str(src / "model.safetensors"))
    half = ref.split_llm_weights(llm)
    expected = {"model." + k[len("model.language_model."):]: v for k, v in weights.items()
                if k.startswith("model.language_model.")}
    assert half.keys() == expected.keys()
    assert all(torch.equal(half[k], expected[k]) for k in half)
    family = json.loads((llm / FAMILY_FILE).read_text())
    assert (family["family"], family["image_token"]) == ("gemma4", "<|image|>")
    assert family["image_text"] == {"written": "<|image|>", "before": "<|image>", "after": "<image|>"}
    assert (vision / "sgl_embeds_vision.json").exists() and load_encoder(vision).span_width == 64


@torch.no_grad()
def test_the_llm_half_on_image_rows_gives_hfs_logits(halves):
    """HF's Gemma4ForCausalLM loaded from the LLM half, given the text rows, each image's rows
    from the vision half and the per-layer inputs of the pad id at the image positions (what the
    server computes), gives the VLM's logits on the pixels; the ids the server's placeholders are
    masked to (0) instead of the pad give others."""
    llm, vision = halves
    src = tiny_gemma4_dir("e2b")
    images = [helpers.random_image(40, 30, 1), helpers.random_image(32, 32, 2)]
    inputs = ref.gemma4_inputs(src, QUESTION, images)
    del inputs["pixel_values"], inputs["image_position_ids"]
    encoder = load_encoder(vision, device="cpu")
    image_rows = [encoder(image) for image in images]
    vlm, _ = ref.hf_gemma4(str(src))
    # HF's split path (its pixel path to the bit on equal rows: test_gemma4_encoder.py), given
    # each image's rows as the encoder computes them alone (a batch of two moves them by ~2e-7)
    theirs = vlm(**inputs, mm_encoder_outputs={"image": BaseModelOutputWithPooling(
        pooler_output=tuple(image_rows))}).logits[0]
    model = load_split_llm(llm, dtype=torch.float32, attn_implementation="eager").eval()
    ids = inputs["input_ids"][0]
    at_images = ids == vlm.config.image_token_id
    rows = model.model.embed_tokens(torch.where(at_images, 0, ids))
    rows[at_images] = torch.cat(image_rows)
    pad = model.config.pad_token_id

    def logits(image_id: int) -> torch.Tensor:
        per_layer = model.model.get_per_layer_inputs(torch.where(at_images, image_id, ids)[None], None)
        return model(inputs_embeds=rows[None], per_layer_inputs=per_layer).logits[0]

    ours = logits(pad)
    ref.assert_rows_close(ours, theirs, "the LLM half's logits")
    assert (logits(0) - theirs).abs().max() > 100 * ref.ROW_TOL * theirs.abs().max()


def test_final_logit_softcapping_is_kept(tmp_path):
    """transformers 5.19's Gemma 4 VLM caps its logits: the LLM half keeps the cap (the tiny
    checkpoints have none, so a copy is given one)."""
    src = tmp_path / "capped"
    shutil.copytree(tiny_gemma4_dir("e2b"), src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = 30.0
    (src / "config.json").write_text(json.dumps(config))
    llm, _ = split(src, tmp_path / "out", log=lambda _: None)
    assert json.loads((llm / "config.json").read_text())["final_logit_softcapping"] == 30.0


def test_the_31b_layout_says_its_images_are_blocks_on_the_sliding_layers(halves, tmp_path):
    """E2B's images are causal; 26B / 31B's split says its images are blocks (the vision half's
    settings, read by the client) on the sliding layers only (the family file, read by the
    server)."""
    llm, vision = halves
    assert "sliding_blocks" not in json.loads((llm / FAMILY_FILE).read_text())
    assert not load_encoder(vision).image_block
    llm31, vision31 = split(tiny_gemma4_dir("31b"), tmp_path / "out", log=lambda _: None)
    assert json.loads((llm31 / FAMILY_FILE).read_text())["sliding_blocks"] is True
    assert json.loads((llm31 / "config.json").read_text())["use_bidirectional_attention"] == "vision"
    assert load_encoder(vision31).image_block
