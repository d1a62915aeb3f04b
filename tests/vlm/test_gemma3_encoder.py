"""The client side of Gemma 3 without a server: split, the encoder's rows, the prompt's ids and
segments (each image one bidirectional span), refusals, and what the served LLM must compute
(our rows, each image one block on every layer type, give HF Gemma 3's logits and tokens), each
against HF transformers' own classes on a tiny random checkpoint."""

from __future__ import annotations

import json
import re
import shutil
from functools import cache

import pytest
import sglang as sgl
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, Gemma3ForConditionalGeneration

import helpers
import sgl_embeds
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.gemma3 import LAYER_TYPES, ROWS_PER_IMAGE, SLIDING_WINDOW, tiny_gemma3_dir
from sgl_embeds.vlm import image_prompt, load_encoder, load_split_llm, render_chat, split
from sgl_embeds.vlm.files import WEIGHTS_NAME
from sgl_embeds.vlm.gemma3 import Gemma3Encoder, prompt_segments, prompt_text
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.family import FAMILY_FILE, family_of

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

QUESTION = "what is the color of the object"
TWO_IMAGES = "the <start_of_image> and <start_of_image> what is it"  # no chat: the processor adds bos
SIZES = [(40, 30), (32, 32), (7, 90), (300, 200)]  # (width, height)
# the LLM's layers on our rows vs HF Gemma 3 on the pixels: the same eager ops on the same shapes,
# but HF merges the rows with masked_scatter and builds its masks from token_type_ids
LOGIT_TOL = 1e-5
NEW_TOKENS = 10


@cache
def _split(layout: str = "saved"):
    """(checkpoint, llm dir, vision dir) of the tiny checkpoint, split once per session."""
    src = tiny_gemma3_dir(layout)
    dst = src.with_name(src.name + "-split")
    if not (dst / "vision" / "sgl_embeds_vision.json").exists():
        shutil.rmtree(dst, ignore_errors=True)
        split(src, dst, log=lambda message: None)
    return src, dst / "llm", dst / "vision"


@cache
def _encoder() -> Gemma3Encoder:
    return load_encoder(_split()[2], device="cpu")


def _chat(images: int = 1) -> str:
    """The tiny checkpoint's chat template, rendered: ``<s><start_of_turn>user\\n`` ..."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": QUESTION}]
    return render_chat(_split()[2], [{"role": "user", "content": content}])


def _images(n: int, seed: int = 0) -> list:
    return [helpers.random_image(*SIZES[i % len(SIZES)], seed + i) for i in range(n)]


def _ids_and_rows(segments: list[seg.Segment]) -> tuple[list[int], torch.Tensor, list[tuple[int, int]]]:
    """What the server builds of ``segments``: the ids (the first text with the tokenizer's
    special tokens, the image token at span rows), the LLM layers' input rows (text rows through
    its embedding, which scales them; span rows as they are) and the blocks."""
    _, llm, _ = _split()
    tok, embed = ref.hf_tokenizer(str(llm)), ref.hf_eager_model(str(llm)).get_input_embeddings()
    ids, rows, blocks = [], [], []
    for i, s in enumerate(segments):
        if isinstance(s, seg.Text):
            new = tok.encode(s.text, add_special_tokens=(i == 0))
            with torch.no_grad():
                rows.append(embed(torch.tensor(new)).float())
        else:
            new = [_encoder().config.image_token_id] * len(s)
            rows.append(s.rows.float())
            if s.bidirectional:
                blocks.append((len(ids), len(ids) + len(new)))
        ids += new
    return ids, torch.cat(rows), blocks


def test_split_writes_a_gemma3_causal_lm_with_the_processors_tokenizer():
    src, llm, vision = _split()
    model, _ = ref.hf_gemma3(str(src))
    theirs = {k[len("model.language_model."):]: v for k, v in model.state_dict().items()
              if k.startswith("model.language_model.")}
    ours = ref.split_llm_weights(llm)
    assert sorted(ours) == sorted("model." + k for k in theirs)  # no lm_head: tied
    for key, value in theirs.items():
        assert torch.equal(ours["model." + key], value), key

    config = AutoConfig.from_pretrained(llm)
    assert (config.model_type, config.architectures) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert config.tie_word_embeddings and not config.use_bidirectional_attention
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    assert (config.sliding_window, tuple(config.layer_types)) == (SLIDING_WINDOW, LAYER_TYPES)
    assert config.hidden_activation == model.config.text_config.hidden_activation
    assert config.rope_parameters == model.config.text_config.rope_parameters
    lm = load_split_llm(llm)
    assert type(lm).__name__ == "Gemma3ForCausalLM"
    assert torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight)
    assert float(lm.model.embed_tokens.embed_scale) == config.hidden_size ** 0.5  # text rows only

    tok = AutoTokenizer.from_pretrained(llm)
    for token in ("<start_of_image>", "<image_soft_token>", "<end_of_image>", "<start_of_turn>"):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    assert json.loads((llm / FAMILY_FILE).read_text()) == {
        "family": "gemma3", "vision_dir": "../vision", "image_token": "<image_soft_token>",
        "image_text": {"written": "<start_of_image>", "before": "\n\n<start_of_image>",
                       "after": "<end_of_image>\n\n"}}
    assert family_of("gemma3").image_block and not family_of("gemma3").prefix_lm
    assert (vision / "preprocessor_config.json").exists() and (vision / "chat_template.jinja").exists()


def test_both_key_layouts_split_alike():
    _, llm, vision = _split("saved")
    _, llm_model, vision_model = _split("model")
    for x, y in ((ref.split_llm_weights(llm), ref.split_llm_weights(llm_model)),
                 (load_file(str(vision / WEIGHTS_NAME)), load_file(str(vision_model / WEIGHTS_NAME)))):
        assert sorted(x) == sorted(y)
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_the_encoders_rows_are_hfs_image_features():
    """Bit-equal to ``get_image_features(...).pooler_output``: the same processor, tower (default
    attention) and projector module on the same shapes."""
    src, _, _ = _split()
    model = Gemma3ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    _, processor = ref.hf_gemma3(str(src))
    encoder = _encoder()
    assert isinstance(encoder, Gemma3Encoder)
    assert (encoder.family, encoder.span_width, encoder.rows_per_image) == ("gemma3", 64, ROWS_PER_IMAGE)
    for seed, (w, h) in enumerate(SIZES):
        image = helpers.random_image(w, h, seed)
        pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            theirs = model.get_image_features(pixels).pooler_output[0]
        ours = encoder(image)
        assert encoder.rows_for(w, h) == ours.shape[0] == ROWS_PER_IMAGE
        ref.assert_same_rows(ours, theirs, f"gemma3 {w}x{h}")


def test_the_prompt_text_is_the_processors():
    vision = _encoder().config
    image = "\n\n<start_of_image><image_soft_token><end_of_image>\n\n"
    assert prompt_text("<s>a <start_of_image> b", vision) == f"a {image} b"  # the server adds bos
    assert prompt_text(TWO_IMAGES, vision, 2) == TWO_IMAGES.replace("<start_of_image>", image)
    with pytest.raises(ValueError, match="the prompt has 1 '<start_of_image>' tokens but 2 images"):
        prompt_text("a <start_of_image>", vision, 2)
    with pytest.raises(ValueError, match="already holds '<image_soft_token>'"):
        prompt_text("a <start_of_image><image_soft_token>", vision)
    rows = _encoder()(_images(1)[0])
    with pytest.raises(ValueError, match=r"image 0: rows of shape \[3, 64\], a Gemma 3 image is \[4, 64\]"):
        prompt_segments([rows[:3]], "a <start_of_image>", vision)


@pytest.mark.parametrize("images", [1, 2])
def test_the_segments_give_the_processors_ids(images):
    """Each image a bidirectional span between ``...<start_of_image>`` and ``<end_of_image>...``:
    the ids the server builds are HF's processor's, the spans at its soft tokens
    (``token_type_ids`` 1) and nowhere else."""
    src, _, _ = _split()
    for text in (_chat(images), TWO_IMAGES if images == 2 else "describe <start_of_image>"):
        pictures = _images(images)
        segments = _encoder().prompt_segments([_encoder()(p) for p in pictures], text).segments
        assert [type(s) for s in segments] == [seg.Text, seg.Span] * images + [seg.Text]
        assert all(s.bidirectional for s in segments if isinstance(s, seg.Span))
        assert all(s.text.endswith("\n\n<start_of_image>") for s in segments[:-1:2])
        assert all(s.text.startswith("<end_of_image>\n\n") for s in segments[2::2])
        ids, _, blocks = _ids_and_rows(segments)
        inputs = ref.gemma3_inputs(src, text, pictures)
        assert ids == inputs["input_ids"][0].tolist(), text
        soft = inputs["token_type_ids"][0].nonzero().flatten().tolist()
        assert soft == [i for start, end in blocks for i in range(start, end)]
        assert len(blocks) == images


def test_a_program_sends_each_image_as_a_bidirectional_span():
    """``image_prompt(encoder.prompt_text(...), images, encoder.image_token)`` in a program sends
    what ``prompt_segments`` builds; ``sgl.region`` spans are blocks too, another family's not."""
    encoder = _encoder()
    pictures = _images(2)

    @sgl.function
    def ask(s, a, b):
        s += image_prompt(encoder.prompt_text(TWO_IMAGES, 2), [a, b], encoder.image_token)
        s += sgl.gen("answer", max_tokens=4)

    (sent, *_) = sgl_embeds.compile_program(ask, vision_encoder=encoder, a=pictures[0], b=pictures[1])
    want = encoder.prompt_segments([encoder(p) for p in pictures], TWO_IMAGES).segments
    assert [type(s) for s in sent] == [type(s) for s in want]
    for ours, theirs in zip(sent, want):
        if isinstance(theirs, seg.Span):
            assert ours.bidirectional and torch.equal(ours.rows, theirs.rows)
        else:
            assert ours.text == theirs.text

    @sgl.function
    def region(s, image):
        s += "look " + sgl.region((0, 0, 20, 20), image) + " here"

    (sent, *_) = sgl_embeds.compile_program(region, vision_encoder=encoder, image=pictures[0])
    assert [s.bidirectional for s in sent if isinstance(s, seg.Span)] == [True]
    (sent, *_) = sgl_embeds.compile_program(region, vision_encoder=lambda image: torch.zeros(2, 64),
                                            image=pictures[0])
    assert [s.bidirectional for s in sent if isinstance(s, seg.Span)] == [False]


def _split_greedy(rows: torch.Tensor, blocks: list[tuple[int, int]], prefix: list[int] = (),
                  sliding_window: int | None = None) -> ref.Greedy:
    """The split LLM's greedy continuation of ``rows`` with ``blocks`` (a full forward per step,
    to its end token)."""
    _, llm, _ = _split()
    model = ref.hf_eager_model(str(llm))
    embed, eos = model.get_input_embeddings(), ref.eos_ids(model)
    tokens, scores = list(prefix), []
    with torch.no_grad():
        rows = torch.cat([rows, embed(torch.tensor(tokens, dtype=torch.long)).float()])
        for _ in range(NEW_TOKENS - len(prefix)):
            logits = ref.sliding_block_logits(llm, rows, blocks, sliding_window)[-1]
            scores.append(logits[None])
            tokens.append(int(logits.argmax()))
            if tokens[-1] in eos:
                break
            rows = torch.cat([rows, embed(torch.tensor(tokens[-1:])).float()])
    return ref._greedy_from_scores(torch.tensor([tokens]), tuple(scores))


@pytest.mark.parametrize("images", [1, 2])
def test_the_llm_on_our_rows_with_image_blocks_is_hf_gemma3(images):
    """The split LLM on the text's embedding rows and our image rows, each image one block on its
    full and (within the window) sliding layers, computes HF Gemma 3's logits; its greedy tokens
    and logprobs are HF's."""
    src, _, _ = _split()
    text, pictures = (_chat(1), _images(1)) if images == 1 else (TWO_IMAGES, _images(2))
    segments = _encoder().prompt_segments([_encoder()(p) for p in pictures], text).segments
    _, rows, blocks = _ids_and_rows(segments)
    assert rows.shape[0] > SLIDING_WINDOW  # the sliding layers drop the prompt's start
    model, _ = ref.hf_gemma3(str(src))
    with torch.no_grad():
        theirs = model(**ref.gemma3_inputs(src, text, pictures)).logits[0]
    ours = ref.sliding_block_logits(_split()[1], rows, blocks)
    ref.assert_rows_close(ours, theirs, f"gemma3 {images} image(s) logits", tol=LOGIT_TOL)

    reference = ref.gemma3_greedy(src, text, pictures, NEW_TOKENS)
    ref.assert_not_degenerate(reference.tokens, "gemma3: ")
    greedy = _split_greedy(rows, blocks)
    ref.check_greedy(greedy.tokens, lambda prefix: ref.gemma3_greedy(src, text, pictures, NEW_TOKENS, prefix),
                     "gemma3: ", eos_ids=ref.eos_ids(model))
    ref.assert_logprobs_match(greedy.tokens, greedy.logprobs, reference, "gemma3: ")


def test_the_image_blocks_and_the_sliding_window_change_the_answer():
    """The tiny model tells the masks apart: on some of these prompts HF Gemma 3 with the images
    attended causally answers otherwise (and the split LLM gives HF's answer with blocks and, without
    them, the causal one), and so does the split LLM with a sliding window longer than the prompt."""
    src, _, _ = _split()
    changed_by_blocks, changed_by_window = [], []
    for seed in range(3):
        for text, pictures in ((_chat(1), _images(1, seed)), (TWO_IMAGES, _images(2, seed))):
            segments = _encoder().prompt_segments([_encoder()(p) for p in pictures], text).segments
            _, rows, blocks = _ids_and_rows(segments)
            block = ref.gemma3_greedy(src, text, pictures, NEW_TOKENS)
            causal = ref.gemma3_greedy(src, text, pictures, NEW_TOKENS, causal_images=True)
            assert _split_greedy(rows, blocks).tokens == block.tokens, (seed, text)
            assert _split_greedy(rows, []).tokens == causal.tokens, (seed, text)
            changed_by_blocks.append(block.tokens != causal.tokens)
            unwindowed = _split_greedy(rows, blocks, sliding_window=10_000)
            changed_by_window.append(unwindowed.tokens != block.tokens)
    assert sum(changed_by_blocks) >= 2, f"the image blocks change too little: {changed_by_blocks}"
    assert sum(changed_by_window) >= 2, f"the sliding window changes too little: {changed_by_window}"


def _copy(tmp_path, config=None, weights=None, processor=None):
    """A copy of the tiny checkpoint with ``config(dict)`` / ``weights(dict)`` /
    ``processor(dict)`` (preprocessor_config.json) edits applied."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_gemma3_dir(), copy)
    for name, edit in (("config.json", config), ("preprocessor_config.json", processor)):
        if edit is not None:
            d = json.loads((copy / name).read_text())
            edit(d)
            (copy / name).write_text(json.dumps(d))
    if weights is not None:
        state = load_file(str(copy / "model.safetensors"))
        weights(state)
        save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def _image_processor(d: dict) -> dict:
    return d.get("image_processor", d)  # processor_config.json nests it; preprocessor_config not


# what -> (edits of a copy of the tiny checkpoint, what the error must say)
REFUSALS = {
    "tower": (dict(config=lambda d: d["vision_config"].update(model_type="clip_vision_model")),
              "vision_config.model_type is 'clip_vision_model'"),
    "missing projector": (dict(weights=lambda s: [s.pop(k) for k in list(s) if "projector" in k]),
                          "missing projector"),
    "projector": (dict(weights=lambda s: s.update({"multi_modal_projector.linear.weight": torch.zeros(2)})),
                  r"unknown projector.*unexpected \['linear.weight'\]"),
    "unknown key": (dict(weights=lambda s: s.update({"something_else.weight": torch.zeros(2)})),
                    "checkpoint key 'something_else.weight'"),
    "untied config": (dict(config=lambda d: d["text_config"].update(tie_word_embeddings=False)),
                      "text_config.tie_word_embeddings is False"),
    "attention soft cap": (dict(config=lambda d: d["text_config"].update(attn_logit_softcapping=50.0)),
                           "text_config.attn_logit_softcapping is 50.0"),
    "bidirectional LLM": (dict(config=lambda d: d["text_config"].update(use_bidirectional_attention=True)),
                          "text_config.use_bidirectional_attention is True"),
    "tokens per image": (dict(config=lambda d: d.update(mm_tokens_per_image=1)),
                         "image_seq_length 4 differs from the model config's 1"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_split_refuses_what_it_cannot_reproduce_by_name(tmp_path, what):
    edits, message = REFUSALS[what]
    copy = _copy(tmp_path, **edits)
    with pytest.raises(ValueError) as raised:
        split(copy, tmp_path / "out", log=lambda message: None)
    assert re.search(message, str(raised.value)), raised.value


def test_split_refuses_pan_and_scan(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_gemma3_dir(), copy)
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (copy / name).exists():
            d = json.loads((copy / name).read_text())
            _image_processor(d)["do_pan_and_scan"] = True
            (copy / name).write_text(json.dumps(d))
    with pytest.raises(ValueError, match="do_pan_and_scan=True"):
        split(copy, tmp_path / "out", log=lambda message: None)


def test_split_refuses_pickled_weights(tmp_path):
    copy = _copy(tmp_path)
    (copy / "model.safetensors").unlink()
    (copy / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(ValueError, match=r"\.bin \(pickle\)"):
        split(copy, tmp_path / "out", log=lambda message: None)


def test_the_encoder_refuses_other_formats_and_backends(tmp_path):
    _, _, vision = _split()
    with pytest.raises(ValueError, match="backend must be one of"):
        Gemma3Encoder(vision, backend="cv2")
    shutil.copytree(vision, tmp_path / "v")
    settings = json.loads((tmp_path / "v" / "sgl_embeds_vision.json").read_text())
    settings["format"] = "sgl_embeds.gemma3_vision/0"
    (tmp_path / "v" / "sgl_embeds_vision.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="not an sgl_embeds Gemma 3 vision config"):
        Gemma3Encoder(tmp_path / "v")
