"""The client side of PaliGemma 1 and 2 without a server: split, the encoder's rows, the prompt's
ids, refusals, and what the served LLM must compute (its rows and the prompt as one bidirectional
block give HF PaliGemma's logits and tokens), each against HF transformers' own classes on tiny
random checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from functools import cache

import pytest
import sglang as sgl
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

import helpers
import sgl_embeds
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.paligemma import ROWS_PER_IMAGE, tiny_paligemma_dir
from sgl_embeds.vlm import image_prompt, load_encoder, load_split_llm, split
from sgl_embeds.vlm.files import WEIGHTS_NAME
from sgl_embeds.vlm.paligemma import PaliGemmaEncoder, prompt_segments, prompt_text
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.family import FAMILY_FILE, family_of

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

GENERATIONS = {1: "GemmaForCausalLM", 2: "Gemma2ForCausalLM"}
PROMPT = "what is the color of the object"
SIZES = [(40, 30), (32, 32), (7, 90), (300, 200)]  # (width, height)
# the LLM's layers on our rows vs HF PaliGemma on the pixels: the same eager ops on the same
# shapes, but HF merges the rows into its embeddings with masked_scatter and builds its mask
# from token_type_ids; seen <= 1.5e-6 of the logits' largest magnitude (about 6)
LOGIT_TOL = 1e-5


@cache
def _split(generation: int, layout: str = "saved"):
    """(checkpoint, llm dir, vision dir) of a tiny checkpoint, split once per session."""
    src = tiny_paligemma_dir(generation, layout)
    dst = src.with_name(src.name + "-split")
    if not (dst / "vision" / "sgl_embeds_vision.json").exists():
        shutil.rmtree(dst, ignore_errors=True)
        split(src, dst, log=lambda message: None)
    return src, dst / "llm", dst / "vision"


@cache
def _encoder(generation: int) -> PaliGemmaEncoder:
    return load_encoder(_split(generation)[2], device="cpu")


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_split_writes_a_plain_gemma_llm_with_the_processors_tokenizer(generation):
    src, llm, vision = _split(generation)
    model, _ = ref.hf_paligemma(str(src))
    theirs = {k[len("model.language_model."):]: v for k, v in model.state_dict().items()
              if k.startswith("model.language_model.")}
    ours = ref.split_llm_weights(llm)
    assert sorted(ours) == sorted("model." + k for k in theirs)  # no lm_head: tied
    for key, value in theirs.items():
        assert torch.equal(ours["model." + key], value), key

    config = AutoConfig.from_pretrained(llm)
    assert config.architectures == [GENERATIONS[generation]]
    assert not getattr(config, "use_bidirectional_attention", None)
    assert not hasattr(config, "num_image_tokens")
    assert config.tie_word_embeddings
    if generation == 2:
        # HF's PaliGemma applies lm_head alone: the served LLM must not cap its logits
        assert model.config.text_config.final_logit_softcapping is not None
        assert config.final_logit_softcapping is None
        assert config.attn_logit_softcapping == model.config.text_config.attn_logit_softcapping
    lm = load_split_llm(llm)
    assert type(lm).__name__ == GENERATIONS[generation]
    assert torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight)

    tok = AutoTokenizer.from_pretrained(llm)
    for token in ("<image>", "<loc0000>", "<loc1023>", "<seg000>", "<seg127>"):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    assert json.loads((llm / FAMILY_FILE).read_text()) == {
        "family": "paligemma", "vision_dir": "../vision", "image_token": "<image>"}
    assert family_of("paligemma").prefix_lm


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_both_key_layouts_split_alike(generation):
    _, llm, vision = _split(generation, "saved")
    _, llm_model, vision_model = _split(generation, "model")
    for x, y in ((ref.split_llm_weights(llm), ref.split_llm_weights(llm_model)),
                 (load_file(str(vision / WEIGHTS_NAME)), load_file(str(vision_model / WEIGHTS_NAME)))):
        assert sorted(x) == sorted(y)
        assert all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_the_encoders_rows_are_hfs_image_features(generation):
    """Bit-equal to ``get_image_features(...).pooler_output``: the same processor, tower (default
    attention) and projector on the same shapes."""
    from transformers import AutoProcessor, PaliGemmaForConditionalGeneration

    src, _, _ = _split(generation)
    model = PaliGemmaForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(src)
    encoder = _encoder(generation)
    assert isinstance(encoder, PaliGemmaEncoder)
    assert (encoder.family, encoder.span_width, encoder.rows_per_image) == ("paligemma", 64, ROWS_PER_IMAGE)
    for seed, (w, h) in enumerate(SIZES):
        image = helpers.random_image(w, h, seed)
        pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            theirs = model.get_image_features(pixels).pooler_output[0]
        ours = encoder(image)
        assert encoder.rows_for(w, h) == ours.shape[0] == ROWS_PER_IMAGE
        ref.assert_same_rows(ours, theirs, f"paligemma {generation} {w}x{h}")


def test_the_prompt_text_is_the_processors():
    assert prompt_text(PROMPT, "<bos>") == f"<image><bos>{PROMPT}\n"
    assert prompt_text(PROMPT, "<bos>", images=2) == f"<image><image><bos>{PROMPT}\n"
    assert prompt_text("<image><image>caption en", "<bos>", 2) == "<image><image><bos>caption en\n"
    with pytest.raises(ValueError, match="the prompt has 1 '<image>' tokens but 2 images"):
        prompt_text("<image>caption", "<bos>", 2)
    with pytest.raises(ValueError, match="at least one image"):
        prompt_segments([], PROMPT, "<bos>")


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_the_segments_give_the_processors_ids(generation):
    """The span first, then ``bos + prompt + newline`` tokenized without special tokens (the server
    adds them only to a prompt's first segment): HF's processor's ids, the span at its image
    tokens."""
    src, llm, _ = _split(generation)
    encoder = _encoder(generation)
    image = helpers.random_image(40, 30, 0)
    inputs = ref.paligemma_inputs(src, PROMPT, [image])
    segments = prompt_segments([encoder(image)], PROMPT, encoder.bos_token).segments
    assert [type(s) for s in segments] == [seg.Span, seg.Text]
    tok = AutoTokenizer.from_pretrained(llm)
    image_id = tok.convert_tokens_to_ids(encoder.image_token)
    ids = [image_id] * len(segments[0]) + tok.encode(segments[1].text, add_special_tokens=False)
    assert ids == inputs["input_ids"][0].tolist()
    assert ids[ROWS_PER_IMAGE] == tok.bos_token_id
    assert inputs["token_type_ids"].eq(0).all()
    assert encoder.prompt_text(PROMPT) == prompt_text(PROMPT, tok.bos_token)


def test_a_program_sends_the_span_first_then_the_bos_and_text():
    """``image_prompt(encoder.prompt_text(...))`` in a program sends what ``prompt_segments``
    builds: the image's rows, then ``bos + prompt + newline``."""
    encoder = _encoder(1)
    image = helpers.random_image(40, 30, 0)

    @sgl.function
    def ask(s, image):
        s += image_prompt(encoder.prompt_text(PROMPT), [image])
        s += sgl.gen("answer", max_tokens=4)

    (sent, *_) = sgl_embeds.compile_program(ask, vision_encoder=encoder, image=image)
    want = prompt_segments([encoder(image)], PROMPT, encoder.bos_token).segments
    assert [type(s) for s in sent] == [seg.Span, seg.Text]
    assert torch.equal(sent[0].rows, want[0].rows) and sent[1].text == want[1].text


def _prompt_rows(generation: int, image) -> torch.Tensor:
    """What the served LLM's layers take for the prompt: our rows as they are, the text rows
    through its embedding layer (Gemma's scales them by sqrt(hidden))."""
    _, llm, _ = _split(generation)
    encoder = _encoder(generation)
    text = prompt_segments([encoder(image)], PROMPT, encoder.bos_token).segments[1].text
    ids = ref.hf_tokenizer(str(llm)).encode(text, add_special_tokens=False)
    embed = ref.hf_eager_model(str(llm)).get_input_embeddings()
    with torch.no_grad():
        return torch.cat([encoder(image), embed(torch.tensor(ids)).float()])


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_the_llm_on_our_rows_as_one_block_is_hf_paligemma(generation):
    """The split LLM, given our rows and the text's embedding rows with the prompt as one block
    and positions from 1, computes HF PaliGemma's logits; its greedy tokens and logprobs are HF's."""
    src, llm, _ = _split(generation)
    image = helpers.random_image(40, 30, 0)
    rows = _prompt_rows(generation, image)
    model, _ = ref.hf_paligemma(str(src))
    inputs = ref.paligemma_inputs(src, PROMPT, [image])
    inputs.pop("labels")
    with torch.no_grad():
        theirs = model(**inputs).logits[0]
    ours = ref.prefix_lm_logits(llm, rows, block=rows.shape[0])
    ref.assert_rows_close(ours, theirs, f"paligemma {generation} logits", tol=LOGIT_TOL)

    reference = ref.paligemma_greedy(src, PROMPT, [image], 8)
    ref.assert_not_degenerate(reference.tokens, f"paligemma {generation}: ")
    greedy = ref.prefix_lm_greedy(llm, rows, 8)
    ref.check_greedy(greedy.tokens, lambda prefix: ref.paligemma_greedy(src, PROMPT, [image], 8, prefix),
                     f"paligemma {generation}: ", eos_ids=ref.eos_ids(model))
    ref.assert_logprobs_match(greedy.tokens, greedy.logprobs, reference, f"paligemma {generation}: ")


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_attending_the_prompt_causally_changes_the_answer(generation):
    """The tiny models tell the prompt's mask apart: HF PaliGemma's answer with the prompt as one
    block differs from its answer with the prompt attended causally, and ``prefix_lm_greedy``
    gives HF's tokens either way."""
    src, llm, _ = _split(generation)
    for seed in range(3):
        image = helpers.random_image(40, 30, seed)
        block = ref.paligemma_greedy(src, PROMPT, [image], 8)
        causal = ref.paligemma_greedy(src, PROMPT, [image], 8, causal=True)
        assert block.tokens != causal.tokens, f"paligemma {generation}, image {seed}: the mask changes nothing"
        rows = _prompt_rows(generation, image)
        assert ref.prefix_lm_greedy(llm, rows, 8, causal=True).tokens == causal.tokens
        assert ref.prefix_lm_greedy(llm, rows, 8).tokens == block.tokens


def _copy(generation: int, tmp_path, config=None, weights=None):
    """A copy of the tiny checkpoint with ``config(dict)`` / ``weights(dict)`` edits applied."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_paligemma_dir(generation), copy)
    if config is not None:
        d = json.loads((copy / "config.json").read_text())
        config(d)
        (copy / "config.json").write_text(json.dumps(d))
    if weights is not None:
        state = load_file(str(copy / "model.safetensors"))
        weights(state)
        save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def _pickled(copy):
    (copy / "model.safetensors").unlink()
    (copy / "pytorch_model.bin").write_bytes(b"never unpickled")


# what -> (edits of a copy of the tiny checkpoint, what the error must say)
REFUSALS = {
    "tower": (dict(config=lambda d: d["vision_config"].update(model_type="clip_vision_model")),
              "vision_config.model_type is 'clip_vision_model'"),
    "missing projector": (dict(weights=lambda s: [s.pop(k) for k in list(s) if "projector" in k]),
                          "missing projector"),
    "projector": (dict(weights=lambda s: s.update({"multi_modal_projector.linear_2.weight": torch.zeros(2)})),
                  "unknown projector.*linear_2.weight"),
    "unknown key": (dict(weights=lambda s: s.update({"something_else.weight": torch.zeros(2)})),
                    "checkpoint key 'something_else.weight'"),
    "untied lm_head": (dict(weights=lambda s: s.update(
        {"language_model.lm_head.weight": torch.zeros_like(s["language_model.model.embed_tokens.weight"])})),
        "checkpoint key 'language_model.lm_head.weight' differs"),
    "untied config": (dict(config=lambda d: d["text_config"].update(tie_word_embeddings=False)),
                      "text_config.tie_word_embeddings is False"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_split_refuses_what_it_cannot_reproduce_by_name(tmp_path, what):
    edits, message = REFUSALS[what]
    copy = _copy(1, tmp_path, **edits)
    with pytest.raises(ValueError) as raised:
        split(copy, tmp_path / "out", log=lambda message: None)
    assert re.search(message, str(raised.value)), raised.value


def test_split_refuses_pickled_weights(tmp_path):
    copy = _copy(2, tmp_path)
    _pickled(copy)
    with pytest.raises(ValueError, match=r"\.bin \(pickle\)"):
        split(copy, tmp_path / "out", log=lambda message: None)


def test_the_encoder_refuses_other_formats_and_backends(tmp_path):
    _, _, vision = _split(1)
    with pytest.raises(ValueError, match="backend must be one of"):
        PaliGemmaEncoder(vision, backend="cv2")
    shutil.copytree(vision, tmp_path / "v")
    settings = json.loads((tmp_path / "v" / "sgl_embeds_vision.json").read_text())
    settings["format"] = "sgl_embeds.paligemma_vision/0"
    (tmp_path / "v" / "sgl_embeds_vision.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="not an sgl_embeds"):
        load_encoder(tmp_path / "v")
    with pytest.raises(ValueError, match="not an sgl_embeds PaliGemma vision config"):
        PaliGemmaEncoder(tmp_path / "v")
