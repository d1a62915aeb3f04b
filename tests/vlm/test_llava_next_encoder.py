"""The vision half of LLaVA-NeXT and LLaVA-OneVision checkpoints without a server: split, pixels,
rows per image, the rows themselves, where the weights come from, refusals, regions and the
encoder cache, each checked against HF transformers' own classes on tiny random checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from functools import lru_cache

import numpy as np
import pytest
import sglang as sgl
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

import helpers
import sgl_embeds
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import scene_disc_mask, synthetic_scene
from sgl_embeds_testing.llava_next import tiny_llava_next_dir, tiny_llava_onevision_dir
from sgl_embeds.vision import EncoderCache, mask_image
from sgl_embeds.vlm import AnyresEncoder, image_prompt, load_encoder, load_split_llm, render_chat, split
from sgl_embeds.vlm.tiling import Tiling
from sgl_embeds.vlm.tower import WEIGHTS_NAME
from sgl_embeds_protocol.family import family_of
from sgl_embeds_protocol import segments as seg
from sgl_embeds_srt.placeholders import is_placeholder
from sgl_embeds_srt.prompts import ModelSpec, build_ids

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

FAMILIES = {"llava_next": tiny_llava_next_dir, "llava_onevision": tiny_llava_onevision_dir}
BACKENDS = ("torchvision", "pil")
# (width, height); the largest pinpoints are 96 px (NeXT) and 128 px (OneVision) a side. The
# rounding edges: transformers' unpadding rounds e.g. 47 * (12 / 188) = 2.9999999999999996 at 7
# digits (to 3) before taking the int, and at these two sizes that keeps a row (or column) of
# features that the int alone would cut.
SIZES = {"wide": (300, 100), "tall": (60, 170), "tiny": (9, 7), "above the largest pinpoint": (640, 480),
         "square": (64, 64), "odd": (97, 61), "one row of pixels high": (200, 5),
         "rounding edge of NeXT's unpadding": (188, 47), "rounding edge of OneVision's": (110, 88)}
# (height, width) of more rounding edges (of the float arithmetic; the padding may not change)
ROUNDING_EDGES = [(47, 188), (88, 110), (47, 94), (49, 49), (49, 98), (49, 147)]


def _chat(images: int, question: str = "what is the color of the object") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": question}]}]


def _quiet_split(src, dst):
    return split(src, dst, log=lambda message: None)


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request, tmp_path_factory):
    """(family, checkpoint, split dir, encoder) of one tiny checkpoint, split once."""
    src = FAMILIES[request.param]()
    dst = tmp_path_factory.mktemp(request.param)
    _quiet_split(src, dst)
    return request.param, src, dst, load_encoder(dst / "vision", device="cpu")


@lru_cache(maxsize=4)
def hf_processor(checkpoint: str, backend: str):
    """The checkpoint's processor as HF loads it, with the image processor of ``backend``
    (transformers 5 has no PIL video processor, which ``AutoProcessor(backend="pil")`` would
    load for OneVision)."""
    processor = AutoProcessor.from_pretrained(checkpoint)
    processor.image_processor = AutoImageProcessor.from_pretrained(checkpoint, backend=backend)
    return processor


@torch.no_grad()
def hf_image_rows(checkpoint, images: list, backend: str = "torchvision") -> list[torch.Tensor]:
    """The rows HF's model puts at each image's tokens: its ``inputs_embeds`` at the image token
    positions, captured where the language model receives them."""
    model, _ = ref.hf_llava(str(checkpoint))
    processor = hf_processor(str(checkpoint), backend)
    inputs = processor(images=images, text="a <image> b" * len(images), return_tensors="pt")
    captured = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True)
    try:
        model.model(**inputs)
    finally:
        hook.remove()
    positions = (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]
    runs = torch.tensor_split(positions, (positions.diff() != 1).nonzero()[:, 0] + 1)
    return [captured["embeds"][0][run] for run in runs]


def test_split_round_trips_both_key_layouts(vlm, tmp_path):
    family, src, dst, _ = vlm
    other = _quiet_split(FAMILIES[family]("model"), tmp_path / "model")
    for part, read in (("llm", ref.split_llm_weights), ("vision", lambda d: load_file(str(d / WEIGHTS_NAME)))):
        a, b = read(dst / part), read(tmp_path / "model" / part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert "image_newline" in a
    for name in ("sgl_embeds_vision.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (dst / "vision" / name).read_text() == (other[1] / name).read_text(), name
    config = json.loads((dst / "llm" / "config.json").read_text())
    arch = {"llava_next": "LlamaForCausalLM", "llava_onevision": "Qwen2ForCausalLM"}[family]
    assert config["architectures"] == [arch] and config["hidden_size"] == 64

    model, _ = ref.hf_llava(str(src))
    llm = load_split_llm(dst / "llm", dtype=torch.float32)
    ids = torch.tensor([[0, 40, 41, 100, 7, 300]])
    with torch.no_grad():
        assert torch.equal(llm(ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pixels_and_rows_per_image_equal_the_checkpoint_processor(vlm, backend):
    family, src, dst, _ = vlm
    encoder = AnyresEncoder(dst / "vision", backend=backend, device="cpu")
    hf = AutoImageProcessor.from_pretrained(src, backend=backend)
    assert encoder.backend == backend and type(encoder.processor) is type(hf)
    other = "pil" if backend == "torchvision" else "torchvision"
    assert encoder.identity != AnyresEncoder(dst / "vision", backend=other, device="cpu").identity
    _, processor = ref.hf_llava(str(src))
    image_token = processor.tokenizer.convert_tokens_to_ids(encoder.image_token)
    pinpoints = set()
    for i, (name, (w, h)) in enumerate(SIZES.items()):
        image = helpers.random_image(w, h, seed=i)
        want = hf(images=[image], return_tensors="pt")
        assert want["image_sizes"][0].tolist() == [h, w]
        pixels = encoder.pixel_values(image)
        assert torch.equal(pixels, want["pixel_values"][0]), name
        tiles_h, tiles_w = encoder.tiling.tiles(h, w)
        assert pixels.shape[0] == 1 + tiles_h * tiles_w, name
        ids = processor(images=[image], text=f"a {encoder.image_token} b", return_tensors="pt")["input_ids"]
        assert encoder.rows_for(w, h) == int((ids == image_token).sum()), name
        pinpoints.add(encoder.tiling.best_resolution(h, w))
    assert len(pinpoints) >= 4, f"the sizes must pick several pinpoints: {pinpoints}"


def test_rows_for_equals_the_processor_count_at_every_size(vlm):
    """The processor's own count (what it expands the image token to) over a sweep of sizes,
    among them sizes whose aspect ratio lands on an unpadding rounding edge."""
    family, src, _, encoder = vlm
    _, processor = ref.hf_llava(str(src))
    rng = np.random.default_rng(0)
    sizes = [tuple(int(v) for v in rng.integers(1, 400, 2)) for _ in range(300)]
    sizes += [*encoder.tiling.pinpoints, *ROUNDING_EDGES, (1, 1), (1, 999), (999, 1)]
    counts = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    ours = [encoder.rows_for(w, h) for h, w in sizes]
    assert ours == counts
    if family == "llava_onevision":  # anyres_max_9: 4x4 tiles' 16x16 features are down-scaled
        assert encoder.tiling.feature_map(128, 128) == (12, 12)
        assert encoder.rows_for(128, 128) == 16 + 12 * 13


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_equal_hf_inputs_embeds_at_the_image_tokens(vlm, backend):
    family, src, dst, encoder = vlm
    if backend != encoder.backend:
        encoder = AnyresEncoder(dst / "vision", backend=backend, device="cpu")
    for i, (name, (w, h)) in enumerate(SIZES.items()):
        image = helpers.random_image(w, h, seed=20 + i)
        (want,) = hf_image_rows(src, [image], backend)
        got = encoder(image)
        assert len(got) == encoder.rows_for(w, h), name
        ref.assert_same_rows(got, want, f"{family} {backend} {name}")
    # Two images in one prompt: HF tiles each on its own but runs both images' tiles through the
    # tower in one batch, the encoder one image at a time. Other GEMM shapes, other rounding on
    # some processors: the rows agree within the tolerance, not to the bit.
    a, b = helpers.random_image(50, 37, seed=1), helpers.random_image(37, 50, seed=2)
    two = hf_image_rows(src, [a, b], backend)
    ref.assert_rows_close(encoder(a), two[0], "first of two")
    ref.assert_rows_close(encoder(b), two[1], "second of two")


def _edited_copy(src, dst, config=None, processor=None, image=None, weights=None):
    """A copy of the checkpoint ``src`` with ``config(dict)``, ``processor(dict)`` (the processor's
    settings, ``processor_config.json``), ``image(dict)`` (the image processor's,
    ``preprocessor_config.json``) and ``weights(dict)`` applied in place."""
    shutil.copytree(src, dst)
    for name, edit in (("config.json", config), ("processor_config.json", processor),
                       ("preprocessor_config.json", image)):
        if edit is not None:
            d = json.loads((dst / name).read_text())
            edit(d)
            (dst / name).write_text(json.dumps(d))
    if weights is not None:
        state = load_file(str(dst / "model.safetensors"))
        weights(state)
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_weights_come_from_the_directory(vlm, tmp_path):
    """A copy (module key layout) with its tower scaled and its newline row negated gives other
    rows, equal to HF's on the copy."""
    family, _, _, base = vlm

    def perturb(state):
        for key in list(state):
            if "vision_tower" in key and key.endswith("weight"):
                state[key] = state[key] * 1.5
            elif key.endswith("image_newline"):
                state[key] = -state[key]

    copy = _edited_copy(FAMILIES[family]("model"), tmp_path / "copy", weights=perturb)
    _quiet_split(copy, tmp_path / "split")
    encoder = load_encoder(tmp_path / "split" / "vision", device="cpu")
    image = helpers.random_image(120, 48, seed=5)
    ours = encoder(image)
    assert not torch.allclose(ours, base(image), atol=1e-3)
    newlines = (ours == encoder.image_newline).all(-1)
    rows, cols = encoder.tiling.feature_map(48, 120)
    assert int(newlines.sum()) == rows and not (base(image) == encoder.image_newline).all(-1).any()
    (want,) = hf_image_rows(copy, [image])
    ref.assert_same_rows(ours, want, "perturbed copy")
    assert encoder.identity != base.identity


def test_regions_through_the_cache_equal_hf_on_the_region_image(vlm):
    family, src, _, encoder = vlm
    cache, scene = EncoderCache(), synthetic_scene()
    whole = cache.encode(encoder, scene)
    assert cache.encode(encoder, scene.copy()) is whole and (cache.misses, cache.hits) == (1, 1)
    box = (4, 4, 60, 36)
    boxed = cache.encode(encoder, scene, box).rows
    mask = scene_disc_mask()
    masked = cache.encode(encoder, scene, mask).rows
    # what the tower must see, built here: the crop; the mask's box, the rest in the mean colour
    mean = tuple(int(round(m * 255)) for m in ref.hf_llava(str(src))[1].image_processor.image_mean)
    assert encoder.mean_color == mean
    seen = mask_image(scene, mask, mean)
    assert seen.size == (29, 29) and tuple(np.asarray(seen)[0, 0]) == mean
    # each image alone through HF, as the encoder runs it: the same shapes, so equal to the bit
    for ours, image, name in zip((whole.rows, boxed, masked), (scene, scene.crop(box), seen), ("whole", "box", "mask")):
        (theirs,) = hf_image_rows(src, [image])
        ref.assert_same_rows(ours, theirs, name)
    assert (cache.misses, cache.hits) == (3, 1)
    assert len(boxed) == encoder.rows_for(56, 32) != len(whole.rows)


def test_the_split_halves_answer_as_the_vlm(vlm):
    """A program's segments (text tokenized as sgl_embeds sends it, the encoder's rows where the
    text had image tokens) are HF's processor ids with the rows at its expanded image tokens, and
    the split LLM on them generates HF's VLM answer, token for token and logprob for logprob:
    what a server must then reproduce (tests/vlm/test_llava_next_parity.py). One image; two of other
    sizes in one turn; one after a turn of chat."""
    family, src, dst, encoder = vlm
    tok = AutoTokenizer.from_pretrained(dst / "llm")
    spec = ModelSpec(64, torch.float32, len(tok), 1024, tok)
    image_id = encoder.config.image_token_id
    later = [{"role": "assistant", "content": "red"},
             {"role": "user", "content": [{"type": "text", "text": "and here"}, {"type": "image"}]}]
    cases = [(_chat(1), [helpers.random_image(60, 170, seed=3)]),
             (_chat(2), [synthetic_scene(), helpers.random_image(120, 48, seed=4)]),
             (_chat(1) + later, [synthetic_scene(), helpers.random_image(37, 90, seed=5)])]

    @sgl.function
    def ask(s, text, images):
        s += image_prompt(text, images, encoder.image_token)

    for messages, images in cases:
        text = render_chat(dst / "vision", messages)
        sent = sgl_embeds.compile_program(ask, vision_encoder=encoder, text=text, images=images)[0]
        ids, overrides = build_ids(sent, spec)
        theirs = ref.llava_inputs(src, text, images)["input_ids"][0].tolist()
        assert len(ids) == len(theirs) and overrides.positions == [i for i, t in enumerate(theirs) if t == image_id]
        assert [t for t in ids if not is_placeholder(t)] == [t for t in theirs if t != image_id]
        spans = [s.rows for s in sent if isinstance(s, seg.Span)]
        assert [len(rows) for rows in spans] == [encoder.rows_for(*image.size) for image in images]
        parts = [s.text if isinstance(s, seg.Text) else s.rows for s in sent]
        ours = ref.greedy_after(dst / "llm", helpers.reference_embeds(dst / "llm", parts), 10)
        # HF's VLM batches the images' tiles and runs its LLM on its own inputs_embeds: the
        # numbers agree within the tolerances, tokens under the near-tie rule
        context = f"{len(images)} image(s): "
        reference = ref.llava_greedy(src, text, images, 10)
        ref.check_greedy(ours.tokens, lambda prefix: ref.llava_greedy(src, text, images, 10, prefix), context,
                         eos_ids=ref.eos_ids(ref.hf_llava(str(src))[0]))
        assert ref.assert_logprobs_match(ours.tokens, ours.logprobs, reference, context) >= 5, context


def test_hf_greedy_answers_are_varied_and_changed_by_the_image(vlm):
    """What the server parity tests rely on: the tiny checkpoint's answers are not degenerate and
    another image gives another answer (HF ``generate(pixel_values=..., image_sizes=...)``)."""
    family, src, dst, _ = vlm
    text = render_chat(dst / "vision", _chat(1))
    answers = []
    for image in (synthetic_scene(), helpers.random_image(60, 170, seed=3), Image.new("RGB", (40, 40), (200, 30, 30))):
        tokens = ref.llava_greedy(src, text, [image], 10).tokens
        ref.assert_not_degenerate(tokens, f"{family}: ")
        answers.append(tuple(tokens))
    assert len(set(answers)) == len(answers), answers


def _set(*path_and_value):
    *path, key, value = path_and_value

    def edit(d):
        for p in path:
            d = d[p]
        d[key] = value
    return edit


# (family, what) -> (edits of a copy of the tiny checkpoint, what the error must say)
REFUSALS = {
    ("llava_next", "video"): (dict(config=_set("model_type", "llava_next_video")),
                              "'llava_next_video' \\(a video model"),
    ("llava_next", "tower"): (dict(config=_set("vision_config", "model_type", "siglip2_vision_model")),
                              "vision_config.model_type is 'siglip2_vision_model'"),
    ("llava_next", "strategy with the tower"): (
        dict(config=_set("vision_feature_select_strategy", "full")),
        "vision_feature_select_strategy='full' with a clip_vision_model tower"),
    ("llava_next", "strategy"): (dict(config=_set("vision_feature_select_strategy", "pad")),
                                 "config.json: .*'vision_feature_select_strategy'"),
    ("llava_next", "projector"): (
        dict(weights=lambda s: s.update({"multi_modal_projector.linear_3.weight": torch.zeros(2, 2)})),
        "unknown projector type.*multi_modal_projector.linear_3.weight"),
    ("llava_next", "newline"): (dict(weights=lambda s: s.pop("image_newline")), "missing image_newline"),
    ("llava_next", "image processor"): (
        dict(image=_set("image_processor_type", "CLIPImageProcessor")),
        "the image processor is a CLIPImageProcessor"),
    ("llava_next", "pinpoints"): (dict(image=_set("image_grid_pinpoints", [[32, 64]])),
                                  "image_grid_pinpoints \\[\\[32, 64\\]\\] differs"),
    ("llava_next", "pinpoint in tiles"): (
        dict(config=_set("image_grid_pinpoints", [[32, 48]]),
             image=_set("image_grid_pinpoints", [[32, 48]])),
        "image_grid_pinpoints entry \\[32, 48\\] is not a \\(height, width\\) in whole tiles"),
    ("llava_next", "tile size"): (dict(image=_set("crop_size", {"height": 28, "width": 28})),
                                  "the image processor makes .* pixel values"),
    ("llava_next", "patch size"): (dict(processor=_set("patch_size", 16)), "the processor expands '<image>' into"),
    ("llava_onevision", "strategy with the tower"): (
        dict(config=_set("vision_feature_select_strategy", "default"),
             processor=_set("vision_feature_select_strategy", "default")),
        "vision_feature_select_strategy='default' with a siglip_vision_model tower"),
    ("llava_onevision", "aspect ratio"): (
        dict(config=_set("vision_aspect_ratio", "anyres"), processor=_set("vision_aspect_ratio", "anyres")),
        "vision_aspect_ratio='anyres' is not supported"),
    ("llava_onevision", "aspect ratio of the processor"): (dict(processor=_set("vision_aspect_ratio", "anyres_max_4")),
                                                           "vision_aspect_ratio 'anyres_max_4' differs"),
    ("llava_onevision", "image token count"): (dict(processor=_set("num_image_tokens", 17)),
                                               "the processor expands '<image>' into"),
}


@pytest.mark.parametrize("family,what", list(REFUSALS))
def test_split_refuses_what_it_cannot_reproduce_by_name(tmp_path, family, what):
    edits, message = REFUSALS[family, what]
    copy = _edited_copy(FAMILIES[family](), tmp_path / "copy", **edits)
    with pytest.raises(ValueError) as raised:
        _quiet_split(copy, tmp_path / "out")
    assert re.search(message, str(raised.value)), raised.value


def test_the_encoder_refuses_other_formats_and_backends(vlm, tmp_path):
    _, _, dst, _ = vlm
    with pytest.raises(ValueError, match="backend must be one of"):
        AnyresEncoder(dst / "vision", backend="cv2")
    shutil.copytree(dst / "vision", tmp_path / "v")
    config = json.loads((tmp_path / "v" / "sgl_embeds_vision.json").read_text())
    config["format"] = "sgl_embeds.llava_anyres_vision/0"
    (tmp_path / "v" / "sgl_embeds_vision.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not an sgl_embeds LLaVA vision config"):
        load_encoder(tmp_path / "v")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tall_and_wide_images_get_as_many_rows_as_the_processor_writes_tokens(family):
    """``Tiling`` made straight from the checkpoint's config (no split and no encoder, whose own
    check of these counts would refuse first): a tall, a wide and an odd image get as many rows
    as HF's processor writes image tokens for them (a pinpoint chosen with height and width
    swapped gives other counts)."""
    checkpoint = FAMILIES[family]()
    config = AutoConfig.from_pretrained(checkpoint)
    max_tiles = None
    if family_of(family).tiling == "anyres_max":
        max_tiles = int(re.fullmatch(r"anyres_max_(\d+)", config.vision_aspect_ratio).group(1))
    tile = config.vision_config.image_size
    tiling = Tiling(tile, tile // config.vision_config.patch_size,
                    tuple(tuple(p) for p in config.image_grid_pinpoints), max_tiles)
    processor = hf_processor(str(checkpoint), "torchvision")
    for name in ("tall", "wide", "odd"):
        width, height = SIZES[name]
        ids = processor(images=[Image.new("RGB", (width, height))], text=processor.image_token,
                        return_tensors="pt")["input_ids"][0]
        assert tiling.rows_for(width, height) == int((ids == config.image_token_id).sum()), (family, name)
