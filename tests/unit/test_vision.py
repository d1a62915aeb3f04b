"""Boxes, crops, the encoder cache's keys and the open_clip encoder's weight loading (no server)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from sgl_embeds.vision import EncoderCache, OpenClipEncoder, check_box_form, crop, load_image, to_pixel_box


def test_box_forms():
    assert check_box_form((0, 0, 10, 10)) == "pixels" and check_box_form((0.0, 0.1, 0.5, 1.0)) == "normalized"
    assert to_pixel_box((0.25, 0.5, 0.75, 1.0), 64, 48) == (16, 24, 48, 48)
    assert crop(Image.new("RGB", (64, 48)), (8, 8, 24, 16)).size == (16, 8)
    for bad in [(True, 0, 1, 1), ("a", 0, 1, 1), (0, 0, float("nan"), 1.0)]:
        with pytest.raises(ValueError):
            check_box_form(bad)


def test_load_image_rejects_what_is_not_an_image():
    with pytest.raises(ValueError, match="cannot load an image"):
        load_image("not-a-file-nor-base64!")
    with pytest.raises(ValueError, match="cannot load an image"):
        load_image(3.5)


def test_open_clip_encoder_needs_weights_unless_random_is_asked_for():
    with pytest.raises(ValueError, match="tower_weights and projector_weights"):
        OpenClipEncoder(hidden_size=64, model_name="ViT-B-32")


def test_open_clip_encoder_loads_the_checkpoint_it_is_given(tmp_path):
    from safetensors.torch import save_file

    with pytest.warns(UserWarning, match="random weights"):
        source = OpenClipEncoder(hidden_size=64, model_name="ViT-B-32", tokens="pooled", allow_random=True, device="cpu")
    save_file({f"visual.{k}": v.contiguous() for k, v in source.tower.state_dict().items()}, tmp_path / "tower.safetensors")
    save_file({k: v.contiguous() for k, v in source.projector.state_dict().items()}, tmp_path / "proj.safetensors")
    loaded = OpenClipEncoder(hidden_size=64, model_name="ViT-B-32", tokens="pooled", device="cpu",
                             tower_weights=tmp_path / "tower.safetensors", projector_weights=tmp_path / "proj.safetensors")
    image = Image.new("RGB", (40, 30), (200, 30, 30))
    a, b = source(image), loaded(image)
    assert a.shape == (1, 64) and torch.allclose(a, b, atol=1e-5)
    save_file({"weight": torch.zeros(3, 3)}, tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match="size mismatch|missing keys|unexpected keys"):
        OpenClipEncoder(hidden_size=64, model_name="ViT-B-32", tokens="pooled", device="cpu",
                        tower_weights=tmp_path / "tower.safetensors", projector_weights=tmp_path / "wrong.safetensors")


@pytest.mark.parametrize("box, message", [((0, 0, 100, 10), "outside"), ((10, 10, 10, 20), "zero area"),
                                          ((0, 0, 0.5, 1), "mixes ints"), ((0.0, 0.0, 1.5, 1.0), "fractions in"),
                                          ((1, 2, 3), "got 3 values")])
def test_bad_boxes_raise(box, message):
    from sgl_embeds.vision import to_pixel_box

    with pytest.raises(ValueError, match=message):
        to_pixel_box(box, 64, 48)


def test_the_same_pixel_bytes_in_two_shapes_are_two_cache_entries():
    """4x8 and 8x4 images of one pixel buffer: equal bytes, other images, other rows."""
    buffer = bytes(range(4 * 8 * 3))
    wide, tall = Image.frombytes("RGB", (8, 4), buffer), Image.frombytes("RGB", (4, 8), buffer)
    assert wide.tobytes() == tall.tobytes()
    cache = EncoderCache()

    def by_size(image: Image.Image) -> torch.Tensor:
        return torch.tensor([[float(image.width), float(image.height)]])

    assert cache.encode(by_size, wide).rows.tolist() == [[8.0, 4.0]]
    assert cache.encode(by_size, tall).rows.tolist() == [[4.0, 8.0]]
    assert (cache.hits, cache.misses) == (0, 2)
