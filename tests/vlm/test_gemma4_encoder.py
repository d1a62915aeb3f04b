"""The client side of Gemma 4 without a server, on both tiny layouts (E2B/E4B-style and
26B/31B-style): the vision half's rows, the prompt's ids, HF's split path (ids plus precomputed
rows) against its pixel path, and that each tiny model tells apart what its LLM half must get
right (images attended causally or as blocks, the per-layer inputs of image positions, the
sliding window), each against HF transformers' own Gemma 4 classes."""

from __future__ import annotations

import json
import shutil
from functools import cache

import numpy as np
import pytest
import torch
from transformers import Gemma4ForConditionalGeneration

import helpers
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.gemma4 import LAYOUTS, MAX_SOFT_TOKENS, SLIDING_WINDOW, tiny_gemma4_dir
from sgl_embeds.vlm import load_encoder, render_chat
from sgl_embeds.vlm.gemma4 import Gemma4Encoder, prompt_segments, prompt_text, write_vision_half
from sgl_embeds_protocol import segments as seg

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

QUESTION = "what is the color of the object"
TWO_IMAGES = "the <|image|> and <|image|> what is it"  # no chat: the processor adds bos
SIZES = [(40, 30), (32, 32), (7, 90), (300, 200), (48, 48)]  # (width, height)
NEW_TOKENS = 10
SEEDS = range(3)


@cache
def _vision(layout: str):
    """(checkpoint, vision dir) of the tiny checkpoint, its vision half written once."""
    src = tiny_gemma4_dir(layout)
    vision = src.with_name(src.name + "-vision")
    if not (vision / "sgl_embeds_vision.json").exists():
        shutil.rmtree(vision, ignore_errors=True)
        write_vision_half(src, vision)
    return src, vision


@cache
def _encoder(layout: str) -> Gemma4Encoder:
    return load_encoder(_vision(layout)[1], device="cpu")


def _chat(layout: str, images: int = 1, bos: str = "") -> str:
    """The tiny checkpoint's chat template, rendered: ``{bos}<|turn>user\\n<|image|>...``."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": QUESTION}]
    return render_chat(_vision(layout)[1], [{"role": "user", "content": content}], bos_token=bos)


def _images(n: int, seed: int = 0) -> list:
    return [helpers.random_image(*SIZES[(seed + i) % len(SIZES)], seed + i) for i in range(n)]


def _prompts(layout: str, seed: int) -> list[tuple[str, list]]:
    """A one-image chat and a two-image plain prompt, the images of ``seed``."""
    return [(_chat(layout), _images(1, seed)), (TWO_IMAGES, _images(2, seed))]


def _ids_and_spans(layout: str, segments: list[seg.Segment]) -> tuple[list[int], list[int]]:
    """What a server builds of ``segments``: the ids (the first text with the tokenizer's special
    tokens, the image token at span rows) and the span rows' positions."""
    src, _ = _vision(layout)
    tok = ref.hf_gemma4(str(src))[1].tokenizer
    ids, spans = [], []
    for i, s in enumerate(segments):
        if isinstance(s, seg.Text):
            ids += tok.encode(s.text, add_special_tokens=(i == 0))
        else:
            spans += range(len(ids), len(ids) + len(s))
            ids += [_encoder(layout).config.image_token_id] * len(s)
    return ids, spans


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_encoders_rows_are_hfs_image_features(layout):
    """Bit-equal to ``get_image_features(...).pooler_output`` of each image alone: the same
    processor, tower (default attention) and projector module on the same shapes; as many rows
    as the processor gives the image tokens (``rows_for``)."""
    src, _ = _vision(layout)
    model = Gemma4ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    processor = ref.hf_gemma4(str(src))[1].image_processor
    encoder = _encoder(layout)
    assert isinstance(encoder, Gemma4Encoder)
    assert (encoder.family, encoder.span_width, encoder.image_token) == ("gemma4", 64, "<|image|>")
    counts = set()
    for seed, (w, h) in enumerate(SIZES):
        image = helpers.random_image(w, h, seed)
        inputs = processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            (theirs,) = model.get_image_features(
                inputs["pixel_values"], inputs["image_position_ids"]).pooler_output
        ours = encoder(image)
        assert encoder.rows_for(w, h) == ours.shape[0] == int(inputs["num_soft_tokens_per_image"][0])
        assert ours.shape[0] <= MAX_SOFT_TOKENS
        ref.assert_same_rows(ours, theirs, f"gemma4 {layout} {w}x{h}")
        counts.add(ours.shape[0])
    assert len(counts) >= 2, f"every test image gets the same row count: {counts}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("images", [1, 2])
def test_the_segments_give_the_processors_ids(layout, images):
    """Each image a span between ``...<|image>`` and ``<image|>...`` (nothing else around it):
    the ids a server builds are HF's processor's, the spans at its image tokens
    (``mm_token_type_ids`` 1) and nowhere else."""
    src, _ = _vision(layout)
    encoder = _encoder(layout)
    bos = ref.hf_gemma4(str(src))[1].tokenizer.bos_token  # HF then adds no special tokens
    for text in (_chat(layout, images), _chat(layout, images, bos),
                 TWO_IMAGES if images == 2 else "describe <|image|>"):
        pictures = _images(images)
        segments = encoder.prompt_segments([encoder(p) for p in pictures], text).segments
        assert [type(s) for s in segments] == [seg.Text, seg.Span] * images + [seg.Text]
        assert all(s.text.endswith("<|image>") for s in segments[:-1:2])
        assert all(s.text.startswith("<image|>") for s in segments[2::2])
        ids, spans = _ids_and_spans(layout, segments)
        inputs = ref.gemma4_inputs(src, text, pictures)
        assert ids == inputs["input_ids"][0].tolist(), text
        assert spans == inputs["mm_token_type_ids"][0].nonzero().flatten().tolist()


def test_the_prompt_text_and_bad_input_are_refused_by_name(tmp_path):
    encoder = _encoder("e2b")
    vision = encoder.config
    image = "<|image><|image|><image|>"
    assert prompt_text("<s>a <|image|> b", vision) == f"a {image} b"  # the server adds bos
    assert prompt_text(TWO_IMAGES, vision, 2) == TWO_IMAGES.replace("<|image|>", image)
    with pytest.raises(ValueError, match=r"the prompt has 1 '<\|image\|>' tokens but 2 images"):
        prompt_text("a <|image|>", vision, 2)
    with pytest.raises(ValueError, match=r"already holds '<\|image>'"):
        prompt_text("a <|image><|image|>", vision)
    with pytest.raises(ValueError, match=r"'<\|video\|>'.*videos .* not supported"):
        prompt_text("a <|video|>", vision)
    with pytest.raises(ValueError, match=r"'<\|audio\|>'.*audio .* not supported"):
        prompt_text("a <|audio|>", vision)
    rows = encoder(_images(1)[0])
    with pytest.raises(ValueError, match=r"image 0: rows of shape \[63, 32\], a Gemma 4 image is \[n, 64\]"):
        prompt_segments([rows[:, :32]], "a <|image|>", vision)

    frames = _images(2)
    bad = {"video": (frames, np.zeros((2, 8, 8, 3), np.uint8), "clip.mp4"),
           "audio": (np.zeros(16000, np.float32), "speech.wav")}
    for kind, values in bad.items():
        for value in values:
            with pytest.raises(ValueError, match=f"got {type(value).__name__}: Gemma 4 {kind}"):
                encoder(value)
    with pytest.raises(ValueError, match="got Tensor: give a PIL image"):
        encoder(torch.zeros(3, 8, 8, 8, 8))
    with pytest.raises(ValueError, match="backend must be one of"):
        Gemma4Encoder(_vision("e2b")[1], backend="cv2")

    shutil.copytree(_vision("e2b")[1], tmp_path / "v")
    settings = json.loads((tmp_path / "v" / "sgl_embeds_vision.json").read_text())
    settings["format"] = "sgl_embeds.gemma4_vision/0"
    (tmp_path / "v" / "sgl_embeds_vision.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="not an sgl_embeds Gemma 4 vision config"):
        Gemma4Encoder(tmp_path / "v")
    shutil.copytree(tiny_gemma4_dir("e2b"), tmp_path / "src")
    processor = json.loads((tmp_path / "src" / "processor_config.json").read_text())
    processor["image_processor"]["patch_size"] = 8
    (tmp_path / "src" / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ValueError, match="the image processor's patch_size 8 differs from the tower's 4"):
        write_vision_half(tmp_path / "src", tmp_path / "out")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hfs_split_path_is_its_pixel_path(layout):
    """HF ``generate`` on the ids with each image's rows given (``mm_encoder_outputs``) computes
    what it computes from the pixels, to the bit (every step's log-softmax); with our encoder's
    rows (a tower of default attention, HF's reference eager) it gives HF's tokens and logprobs."""
    src, _ = _vision(layout)
    model, _ = ref.hf_gemma4(str(src))
    for text, pictures in _prompts(layout, 0):
        inputs = ref.gemma4_inputs(src, text, pictures)
        with torch.no_grad():
            rows = model.get_image_features(
                inputs["pixel_values"], inputs["image_position_ids"]).pooler_output
        pixels = ref.gemma4_greedy(src, text, pictures, NEW_TOKENS)
        split = ref.gemma4_greedy(src, text, pictures, NEW_TOKENS, image_rows=list(rows))
        assert split.tokens == pixels.tokens, text
        for step, (a, b) in enumerate(zip(split.distributions, pixels.distributions)):
            assert torch.equal(a, b), f"{text}: step {step} differs by {(a - b).abs().max():.3g}"
        ours = ref.gemma4_greedy(src, text, pictures, NEW_TOKENS,
                                 image_rows=[_encoder(layout)(p) for p in pictures])
        ref.check_greedy(ours.tokens, lambda prefix: ref.gemma4_greedy(
            src, text, pictures, NEW_TOKENS, prefix), f"gemma4 {layout}: ", eos_ids=ref.eos_ids(model))
        ref.assert_logprobs_match(ours.tokens, ours.logprobs, pixels, f"gemma4 {layout}: ")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_references_are_varied_and_change_with_the_image(layout):
    src, _ = _vision(layout)
    answers = {}
    for seed in SEEDS:
        for text, pictures in _prompts(layout, seed):
            tokens = ref.gemma4_greedy(src, text, pictures, NEW_TOKENS).tokens
            ref.assert_not_degenerate(tokens, f"gemma4 {layout} seed {seed}: ", min_distinct=4)
            answers.setdefault(text, []).append(tokens)
    for text, by_seed in answers.items():
        assert len({tuple(t) for t in by_seed}) == len(SEEDS), f"{text}: {by_seed}"


def _changed(layout: str, **knob) -> list[bool]:
    """For each test prompt: whether HF's answer with ``knob`` (``gemma4_greedy``'s) differs."""
    src, _ = _vision(layout)
    changed = []
    for seed in SEEDS:
        for text, pictures in _prompts(layout, seed):
            base = ref.gemma4_greedy(src, text, pictures, NEW_TOKENS).tokens
            changed.append(ref.gemma4_greedy(src, text, pictures, NEW_TOKENS, **knob).tokens != base)
    return changed


def test_images_attended_causally_change_the_answer_of_the_31b_layout_only():
    """26B/31B attend each image as one block on their sliding layers: without it (no
    ``mm_token_type_ids``) the answers change. E2B/E4B attend images causally anyway."""
    changed = _changed("31b", causal_images=True)
    assert sum(changed) >= 4, f"the image blocks change too little: {changed}"
    assert not any(_changed("e2b", causal_images=True))


@pytest.mark.parametrize("wrong", ["image token", "random ids"])
def test_per_layer_inputs_of_image_positions_by_other_ids_change_the_e2b_answer(wrong):
    """E2B/E4B look the per-layer inputs of an image's positions up by the pad id: by the image
    token's id, or by random ids, the answers change."""
    src, _ = _vision("e2b")
    model, _ = ref.hf_gemma4(str(src))
    vocab = model.config.text_config.vocab_size_per_layer_input
    ids = (model.config.image_token_id if wrong == "image token"  # ids by position, past any prompt
           else torch.randint(vocab, (512,), generator=torch.Generator().manual_seed(0)))
    changed = _changed("e2b", image_layer_ids=ids)
    assert sum(changed) >= 4, f"the per-layer ids change too little: {changed}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_wrong_sliding_window_changes_the_answer(layout):
    """The prompts are longer than the window (and an image longer than it too): a window longer
    than every prompt, or half the window, changes the answers."""
    src, _ = _vision(layout)
    assert len(ref.gemma4_inputs(src, *_prompts(layout, 0)[0])["input_ids"][0]) > SLIDING_WINDOW
    for window in (10_000, SLIDING_WINDOW // 2):
        changed = _changed(layout, sliding_window=window)
        assert sum(changed) >= 4, f"a window of {window} changes too little: {changed}"
