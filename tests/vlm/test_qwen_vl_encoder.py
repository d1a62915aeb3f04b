"""The client-side vision half of a Qwen2.5-VL checkpoint (``QwenVLEncoder``), without a server:
pixels and grids equal the checkpoint's own image processor bit for bit (both transformers
backends), rows equal HF ``get_image_features``, the settings and weights come from the directory
it is given, and the grid travels with the rows through the encoder cache and into a program's
spans."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import sglang as sgl
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor, AutoProcessor

import helpers
import sgl_embeds
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.qwen_vl import FACTOR, IMAGE_PLACEHOLDER, hf_qwen_vl, image_rows
from sgl_embeds.vision import EncoderCache, VisionRows, as_vision_rows, encode_region
from sgl_embeds.vlm import QwenVLEncoder, image_prompt, load_encoder, render_chat
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.segments import Grid

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

BACKENDS = ("torchvision", "pil")
# (width, height): the tiny checkpoint keeps 4 to 16 merged patches (3136 to 12544 pixels)
SIZES = {"wide": (300, 60), "tall": (50, 170), "below min_pixels": (9, 13),
         "above max_pixels": (800, 600), "square": (84, 84), "odd": (97, 61),
         "one patch high": (400, 25)}


@pytest.fixture(scope="module")
def encoders(qwen_vl_dir):
    return {backend: QwenVLEncoder(qwen_vl_dir, backend=backend, device="cpu")
            for backend in BACKENDS}


def hf_processor(checkpoint, backend: str):
    """The checkpoint's image processor as HF's ``AutoProcessor`` loads it (transformers 5 has no
    PIL video processor, so the PIL backend's comes from ``AutoImageProcessor``)."""
    if backend == "torchvision":
        return AutoProcessor.from_pretrained(checkpoint).image_processor
    return AutoImageProcessor.from_pretrained(checkpoint, backend=backend)


@torch.no_grad()
def hf_rows(model_dir, processor, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """HF's rows of ``image`` from ``model_dir``'s model on ``processor``'s pixels."""
    model, _ = hf_qwen_vl(str(model_dir))
    pixels = processor(images=[image], return_tensors="pt")
    grid_thw = pixels["image_grid_thw"]
    (rows,) = model.get_image_features(pixels["pixel_values"], grid_thw).pooler_output
    return rows.float(), tuple(grid_thw[0].tolist())


def pads_in_prompt(processor, image) -> int:
    """How many image pad tokens HF's processor expands one image's placeholder to."""
    ids = processor(text=[IMAGE_PLACEHOLDER], images=[image], return_tensors="pt")["input_ids"][0]
    return int((ids == processor.tokenizer.convert_tokens_to_ids(processor.image_token)).sum())


def assert_same_rows(ours: VisionRows, expected: tuple[torch.Tensor, tuple[int, int, int]]) -> None:
    """The grid and the rows are HF's to the bit: the encoder runs HF's own module on the same
    single image, in float32 (the same operations on the same shapes)."""
    rows, grid = expected
    assert ours.grid == Grid(grid)
    ref.assert_same_rows(ours.rows, rows, "rows")


@pytest.mark.parametrize("backend", BACKENDS)
def test_pixels_grid_and_rows_equal_hf(encoders, qwen_vl_dir, backend):
    encoder, processor = encoders[backend], hf_processor(qwen_vl_dir, backend)
    _, full_processor = hf_qwen_vl(str(qwen_vl_dir))
    grids = set()
    for i, (name, (w, h)) in enumerate(SIZES.items()):
        image = helpers.random_image(w, h, seed=i)
        pixel_values, grid = encoder.pixel_values(image)
        want = processor(images=[image], return_tensors="pt")
        assert grid == tuple(want["image_grid_thw"][0].tolist()), name
        assert torch.equal(pixel_values, want["pixel_values"]), name
        encoded = encoder(image)
        assert_same_rows(encoded, hf_rows(qwen_vl_dir, processor, image))
        assert encoder.rows_for(w, h) == len(encoded.rows), name
        assert len(encoded.rows) == pads_in_prompt(full_processor, image), name
        grids.add(grid)
    assert len(grids) == len(SIZES), f"every size must make another grid: {grids}"


def test_the_default_backend_is_the_processors_and_rows_equal_image_rows(qwen_vl_dir):
    encoder = load_encoder(qwen_vl_dir, device="cpu")
    assert isinstance(encoder, QwenVLEncoder)
    assert type(encoder.processor) is type(AutoImageProcessor.from_pretrained(qwen_vl_dir))
    image = helpers.random_image(120, 48)
    assert_same_rows(encoder(image), image_rows(qwen_vl_dir, image))
    assert (encoder.vision_start, encoder.vision_end, encoder.image_token) == (
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
    assert encoder.mean_color == (123, 117, 104) and encoder.merge_size == 2


def _copy(src, dst, edit_json=None, drop=()):
    """A copy of the checkpoint ``src`` with ``edit_json(name, dict)`` applied to its JSON files
    and the files in ``drop`` left out."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    if edit_json is not None:
        for path in dst.glob("*.json"):
            path.write_text(json.dumps(edit_json(path.name, json.loads(path.read_text()))))
    return dst


def _pixels(min_pixels: int, max_pixels: int):
    def edit(name: str, d: dict) -> dict:
        if name == "preprocessor_config.json":
            d["size"] = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        if name == "processor_config.json":
            d["image_processor"]["size"] = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        return d
    return edit


def _hub_style_pixels(min_pixels: int, max_pixels: int):
    """As Qwen's published checkpoints have it: min_pixels / max_pixels in preprocessor_config.json
    and no processor_config.json."""
    def edit(name: str, d: dict) -> dict:
        if name == "preprocessor_config.json":
            d.pop("size")
            d.update(min_pixels=min_pixels, max_pixels=max_pixels)
        return d
    return edit


@pytest.mark.parametrize("style", ["size", "hub"])
def test_the_checkpoints_min_and_max_pixels_are_honoured(qwen_vl_dir, tmp_path, encoders, style):
    low, high = 16 * FACTOR**2, 40 * FACTOR**2  # the copy keeps 16 to 40 merged patches
    edit = _pixels(low, high) if style == "size" else _hub_style_pixels(low, high)
    drop = () if style == "size" else ("processor_config.json",)
    copy = _copy(qwen_vl_dir, tmp_path / "copy", edit, drop)
    encoder, processor = load_encoder(copy, device="cpu"), AutoProcessor.from_pretrained(copy)
    assert dict(processor.image_processor.size) == {"shortest_edge": low, "longest_edge": high}
    for i, (w, h) in enumerate([(9, 13), (800, 600), (300, 60)]):
        image = helpers.random_image(w, h, seed=i)
        want = processor.image_processor(images=[image], return_tensors="pt")
        pixel_values, grid = encoder.pixel_values(image)
        assert grid == tuple(want["image_grid_thw"][0].tolist())
        assert grid != encoders["torchvision"](image).grid.thw, (w, h)
        assert torch.equal(pixel_values, want["pixel_values"])
        assert 16 <= encoder.rows_for(w, h) == pads_in_prompt(processor, image) <= 40
        assert_same_rows(encoder(image), hf_rows(qwen_vl_dir, processor.image_processor, image))
    assert encoder.identity != encoders["torchvision"].identity


def _rewrite_weights(src, dst, rewrite):
    """A copy of ``src`` whose weights are ``rewrite(weights)``."""
    _copy(src, dst, drop=("*.safetensors",))
    save_file(rewrite(load_file(src / "model.safetensors")), dst / "model.safetensors",
              metadata={"format": "pt"})
    return dst


def test_the_weights_come_from_the_directory_in_either_key_layout(qwen_vl_dir, tmp_path, encoders):
    """A copy with its vision weights scaled and renamed ``model.visual.*`` (the modules' names)
    gives other rows, equal to HF's loaded from the copy."""
    def perturb(weights: dict) -> dict:
        out = {k: v for k, v in weights.items() if not k.startswith("visual.")}
        out.update({f"model.{k}": v * 1.5 for k, v in weights.items() if k.startswith("visual.")})
        return out

    copy = _rewrite_weights(qwen_vl_dir, tmp_path / "perturbed", perturb)
    encoder, base = load_encoder(copy, device="cpu"), encoders["torchvision"]
    image = helpers.random_image(120, 48)
    assert not torch.allclose(encoder(image).rows, base(image).rows, atol=1e-3)
    assert_same_rows(encoder(image), image_rows(copy, image))
    assert encoder.identity != base.identity


def test_a_checkpoint_without_vision_weights_or_with_pickles_is_refused(qwen_vl_dir, tmp_path):
    no_vision = _rewrite_weights(qwen_vl_dir, tmp_path / "no-vision",
                                 lambda w: {k: v for k, v in w.items() if "visual" not in k})
    missing = r"vision weights: missing keys \[.*'patch_embed.proj.weight'"
    with pytest.raises(ValueError, match=missing):
        load_encoder(no_vision, device="cpu")
    pickled = _copy(qwen_vl_dir, tmp_path / "pickled", drop=("*.safetensors",))
    (pickled / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(ValueError, match=r"only \.bin \(pickle\) weights"):
        load_encoder(pickled, device="cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        QwenVLEncoder(qwen_vl_dir, backend="cv2")
    llava = _copy(qwen_vl_dir, tmp_path / "llava", lambda n, d: {**d, "model_type": "llava"})
    with pytest.raises(ValueError, match="'llava' checkpoint: load_encoder takes"):
        load_encoder(llava)


def test_the_cache_keeps_the_grid_and_regions_are_encoded_as_hf_would(qwen_vl_dir, encoders):
    encoder, cache = encoders["torchvision"], EncoderCache()
    image = helpers.random_image(160, 100, seed=3)
    first = cache.encode(encoder, image)
    again = cache.encode(encoder, image.copy())
    assert (cache.misses, cache.hits) == (1, 1) and again is first
    assert_same_rows(first, image_rows(qwen_vl_dir, image))

    box = (10, 20, 130, 70)
    assert_same_rows(cache.encode(encoder, image, box), image_rows(qwen_vl_dir, image.crop(box)))
    mask = np.zeros((100, 160), dtype=bool)
    mask[30:90, 40:100] = True
    mask[30:50, 40:60] = False  # not a box: the corner is filled
    # what the tower must see, built here: the mask's bounding box, the rest in the mean colour
    mean = AutoProcessor.from_pretrained(qwen_vl_dir).image_processor.image_mean
    seen = np.array(image)[30:90, 40:100]
    seen[~mask[30:90, 40:100]] = [round(m * 255) for m in mean]
    masked = cache.encode(encoder, image, mask)
    assert_same_rows(masked, image_rows(qwen_vl_dir, Image.fromarray(seen)))
    assert masked.grid != first.grid and cache.misses == 3


def test_a_program_puts_image_and_region_spans_with_their_grids(qwen_vl_dir, encoders):
    encoder = encoders["torchvision"]
    image, box = helpers.random_image(200, 80, seed=5), (0.0, 0.0, 0.5, 1.0)

    @sgl.function
    def ask(s, image):
        s += "Look: " + encoder.vision_start + sgl.image(image) + encoder.vision_end
        s += " and here: " + encoder.vision_start + sgl.region(box) + encoder.vision_end
        s += sgl.gen("answer", max_tokens=4)

    sent = sgl_embeds.compile_program(ask, vision_encoder=encoder, image=image)[0]
    assert [type(x) for x in sent] == [seg.Text, seg.Span, seg.Text, seg.Span, seg.Text]
    assert sent[0].text.endswith("<|vision_start|>") and sent[2].text.startswith("<|vision_end|>")
    for span, seen in ((sent[1], image), (sent[3], image.crop((0, 0, 100, 80)))):
        rows, grid = image_rows(qwen_vl_dir, seen)
        assert span.grid == Grid(grid) and torch.equal(span.rows, rows)

    # the checkpoint's chat template writes the pad between the vision tokens: image_prompt puts
    # the span there
    text = render_chat(qwen_vl_dir, [{"role": "user", "content": [{"type": "image"},
                                                                  {"type": "text", "text": "hi"}]}])
    before, after = text.split(IMAGE_PLACEHOLDER)

    @sgl.function
    def chat(s, image):
        s += image_prompt(text, [image], encoder.image_token)

    (final,) = sgl_embeds.compile_program(chat, vision_encoder=encoder, image=image)
    assert final[0] == seg.Text(before + "<|vision_start|>")
    assert final[2] == seg.Text("<|vision_end|>" + after)
    assert final[1].grid == Grid(image_rows(qwen_vl_dir, image)[1])


class _GridRows:
    """An encoder that returns fixed ``VisionRows`` and says its merge size."""

    merge_size = 2

    def __init__(self, rows, grid):
        self.out = VisionRows(rows, grid)

    def __call__(self, image):
        return self.out


def test_a_grid_is_checked_where_it_enters():
    image = helpers.random_image(32, 32)
    encoded = encode_region(image, None, _GridRows(torch.ones(8, 4), [1, 4, 8]))
    assert encoded.grid == Grid((1, 4, 8)) and isinstance(encoded.grid.thw, tuple)
    with pytest.raises(ValueError, match=r"gave 8 rows for the grid \[1, 4, 4\].* = 4 rows"):
        encode_region(image, None, _GridRows(torch.ones(8, 4), (1, 4, 4)))
    with pytest.raises(ValueError, match="must be \\[t, h, w\\] of positive ints"):
        encode_region(image, None, _GridRows(torch.ones(8, 4), (4, 8)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_region(image, None, _GridRows(torch.full((8, 4), float("nan")), (1, 4, 8)))
    bare = as_vision_rows(torch.ones(3, 4))  # a bare tensor: rows without a grid
    assert bare.grid is None and bare.rows.shape == (3, 4)
