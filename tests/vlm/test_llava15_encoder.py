"""The vision half of a LLaVA checkpoint without a server: split, pixels, tower, prompt ids, masks,
and the encoder cache, each checked against HF transformers' own LLaVA classes."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import sglang as sgl
import torch
from PIL import Image

import helpers
import sgl_embeds
from sgl_embeds_protocol import segments as seg
from sgl_embeds_srt.placeholders import is_placeholder
from sgl_embeds_srt.prompts import ModelSpec, build_ids
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import GridEncoder, synthetic_scene
from sgl_embeds_testing.models import tiny_llava_dir
from sgl_embeds.vision import EncoderCache, check_mask, mask_image
from sgl_embeds.vlm import ImageProcessing, LlavaEncoder, image_prompt, load_encoder, load_split_llm, render_chat, split
from sgl_embeds.vlm.tower import WEIGHTS_NAME

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

SIZES = [(32, 32), (50, 37), (37, 50), (300, 100), (17, 20), (640, 480)]
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is the color of the object"}]}]


def _quiet_split(src, dst):
    return split(src, dst, log=lambda message: None)


@pytest.fixture(scope="module")
def llama_vlm(tmp_path_factory):
    src = tiny_llava_dir("llama")
    dst = tmp_path_factory.mktemp("vlm")
    _quiet_split(src, dst)
    return src, dst, load_encoder(dst / "vision", device="cpu")


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_pixel_values_equal_the_checkpoint_processor(backend):
    from transformers import AutoImageProcessor

    hf = AutoImageProcessor.from_pretrained(tiny_llava_dir("llama"), backend=backend)
    ours = ImageProcessing.from_hf(hf, backend)
    for i, (w, h) in enumerate(SIZES):
        image = helpers.random_image(w, h, seed=i)
        want = hf(images=image, return_tensors="pt")["pixel_values"][0]
        assert torch.equal(ours(image), want), (backend, w, h)


def test_both_key_layouts_split_to_the_same_model(tmp_path):
    outs = []
    for layout in ("saved", "model"):
        llm, vision = _quiet_split(tiny_llava_dir("llama", layout), tmp_path / layout)
        outs.append((llm, vision))
    from safetensors.torch import load_file

    for part, read in (("llm", ref.split_llm_weights), ("vision", lambda d: load_file(str(d / WEIGHTS_NAME)))):
        a, b = (read(tmp_path / layout / part) for layout in ("saved", "model"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    config = json.loads((outs[0][0] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 64


def test_split_llm_equals_the_vlm_language_model(llama_vlm):
    src, dst, _ = llama_vlm
    model, _ = ref.hf_llava(str(src))
    llm = load_split_llm(dst / "llm", dtype=torch.float32)
    ids = torch.tensor([[0, 40, 41, 100, 7, 300]])
    with torch.no_grad():
        assert torch.equal(llm(ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("layer,strategy", [(-2, "default"), (-1, "default"), (-2, "full"), (1, "full")])
def test_encoder_equals_hf_image_features(llama_vlm, layer, strategy):
    src, dst, encoder = llama_vlm
    model, processor = ref.hf_llava(str(src))
    config = dataclasses.replace(encoder.config, feature_layers=(layer,), select_strategy=strategy)
    from safetensors.torch import load_file

    variant = LlavaEncoder(config, load_file(str(dst / "vision" / WEIGHTS_NAME)), "test", device="cpu")
    for i, (w, h) in enumerate(SIZES[:4]):
        image = helpers.random_image(w, h, seed=10 + i)
        pixels = processor.image_processor(images=image, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            want = model.get_image_features(pixel_values=pixels, vision_feature_layer=layer,
                                            vision_feature_select_strategy=strategy).pooler_output[0]
        got = variant(image)
        assert got.shape == want.shape == (16 + (strategy == "full"), 64)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    other = variant(helpers.random_image(32, 32, seed=99))
    assert not torch.allclose(other, got, atol=1e-3), "the features must change with the image"


def test_prompt_ids_equal_the_processor_ids(llama_vlm):
    """Item 4: text around images tokenized as HF's processor does, image rows where it expands
    its image token."""
    from transformers import AutoTokenizer

    src, dst, encoder = llama_vlm
    text = render_chat(dst / "vision", QUESTION)
    assert text.count(encoder.image_token) == 1

    @sgl.function
    def ask(s, text, images):
        s += image_prompt(text, images, encoder.image_token)
        s += sgl.gen("answer", max_tokens=4)

    tok = AutoTokenizer.from_pretrained(dst / "llm")
    spec = ModelSpec(64, torch.float32, len(tok), 1024, tok)
    two = QUESTION[:1] + [{"role": "assistant", "content": "red"},
                          {"role": "user", "content": [{"type": "text", "text": "and here"}, {"type": "image"}]}]
    for messages, images in ((QUESTION, [synthetic_scene()]), (two, [synthetic_scene(), helpers.random_image(50, 37)])):
        text = render_chat(dst / "vision", messages)
        sent = sgl_embeds.compile_program(ask, vision_encoder=encoder, text=text, images=images)[0]
        ids, overrides = build_ids(sent, spec)
        want = ref.llava_inputs(src, text, images)["input_ids"][0].tolist()
        image_id = encoder.config.image_token_id
        assert len(ids) == len(want)
        assert [i for i, t in enumerate(want) if t == image_id] == overrides.positions
        assert [t for t in ids if not is_placeholder(t)] == [t for t in want if t != image_id]
        spans = [s.rows for s in sent if isinstance(s, seg.Span)]
        assert len(spans) == len(images) and all(torch.equal(s, encoder(im)) for s, im in zip(spans, images))


def test_image_prompt_counts_images():
    with pytest.raises(ValueError, match="2 '<image>' tokens but 1 images"):
        image_prompt("a <image> b <image>", [synthetic_scene()])


def _edit_config(src, dst, edit):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _edit_weights(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_split_names_what_it_cannot_handle(tmp_path):
    src = tiny_llava_dir("llama")
    no_projector = _edit_weights(src, tmp_path / "a", lambda s: [s.pop(k) for k in list(s) if "multi_modal_projector" in k])
    with pytest.raises(ValueError, match="missing projector: .*multi_modal_projector"):
        _quiet_split(no_projector, tmp_path / "out-a")
    three_layers = _edit_weights(src, tmp_path / "b", lambda s: s.update({"multi_modal_projector.linear_3.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match="unknown projector type.*multi_modal_projector.linear_3.weight"):
        _quiet_split(three_layers, tmp_path / "out-b")
    declared = _edit_config(src, tmp_path / "c", lambda c: c.update(projector_type="resampler"))
    with pytest.raises(ValueError, match="unknown projector type \\(projector_type='resampler'"):
        _quiet_split(declared, tmp_path / "out-c")
    siglip = _edit_config(src, tmp_path / "d", lambda c: c["vision_config"].update(model_type="siglip_vision_model"))
    with pytest.raises(ValueError, match="vision_config.model_type is 'siglip_vision_model'"):
        _quiet_split(siglip, tmp_path / "out-d")
    unservable = _edit_config(src, tmp_path / "e", lambda c: c["text_config"].update(architectures=["NoSuchForCausalLM"]))
    with pytest.raises(ValueError, match="text_config: SGLang has no model class 'NoSuchForCausalLM'"):
        _quiet_split(unservable, tmp_path / "out-e")
    pickled = tmp_path / "f"
    shutil.copytree(src, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only .bin \\(pickle\\) weights"):
        _quiet_split(pickled, tmp_path / "out-f")


def test_split_command_line(tmp_path, capsys):
    from sgl_embeds.vlm.__main__ import main

    assert main(["split", str(tiny_llava_dir("llama")), str(tmp_path / "ok")]) == 0
    assert "16 rows per image" in capsys.readouterr().out
    assert (tmp_path / "ok" / "llm" / "config.json").exists() and (tmp_path / "ok" / "vision" / WEIGHTS_NAME).exists()
    assert main(["split", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "config.json is missing" in capsys.readouterr().err


def test_masks_are_checked_and_painted_in_the_mean_colour():
    scene = synthetic_scene()  # 96 x 64
    mask = np.zeros((64, 96), dtype=bool)
    mask[36:60, 56:84] = True  # the blue disc's box ...
    mask[36, 56] = False  # ... minus one corner pixel
    out = mask_image(scene, mask, (10, 20, 30))
    assert out.size == (28, 24)
    pixels = np.asarray(out)
    assert tuple(pixels[0, 0]) == (10, 20, 30)
    assert (pixels[1:, 1:] == np.asarray(scene)[37:60, 57:84]).all()
    assert check_mask(Image.fromarray(mask.astype(np.uint8) * 255)).sum() == mask.sum()
    for bad, message in [(np.zeros((64, 96)), "empty"), (np.full((64, 96, 3), 1), "2-D"),
                         (np.full((64, 96), 0.5), "binary"), (Image.new("RGB", (96, 64)), "mode")]:
        with pytest.raises(ValueError, match=message):
            sgl.region(bad)
    with pytest.raises(ValueError, match="must have the image's size"):
        mask_image(scene, np.ones((10, 10), dtype=bool), (0, 0, 0))


class CountingEncoder:
    def __init__(self, inner, identity=None):
        self.inner, self.calls = inner, 0
        if identity:
            self.identity = identity

    def __call__(self, image):
        self.calls += 1
        return self.inner(image)


def test_encoder_cache_runs_the_tower_once_per_image_and_region():
    cache, enc = EncoderCache(), CountingEncoder(GridEncoder())
    scene = synthetic_scene()
    first = cache.encode(enc, scene).rows
    for _ in range(9):
        assert torch.equal(cache.encode(enc, scene.copy()).rows, first)  # same content, new object
    assert (enc.calls, cache.hits, cache.misses) == (1, 9, 1)
    mask = np.zeros((64, 96), dtype=bool)
    mask[8:32, 8:32] = True
    for region in [(8, 8, 32, 32), (0.0, 0.0, 0.5, 0.5), mask]:
        cache.encode(enc, scene, region)
        cache.encode(enc, scene, region)
    assert enc.calls == 4 and cache.misses == 4  # one per distinct region
    other = CountingEncoder(GridEncoder(scale=0.5))
    assert not torch.equal(cache.encode(other, scene).rows, first) and other.calls == 1
    small = EncoderCache(max_bytes=first.numel() * 4)
    small.encode(enc, scene)
    small.encode(enc, scene, (8, 8, 32, 32))
    assert small.stats()["entries"] == 1  # the budget holds one span; the oldest went
