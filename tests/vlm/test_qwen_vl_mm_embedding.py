"""Image spans in SGLang's multimodal embedding step, without a server (issue #22).

A batch that mixes our precomputed items with raw images is built as the model runner builds
it and embedded by SGLang's own ``embed_mm_inputs``, with Qwen2.5-VL's own ``get_image_feature``
on a stand-in tower (four 1176-wide patches -> one row). Stock SGLang fails on such a batch; with
our hook each image gets its own rows, also when a prefill chunk starts inside our image.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
from sglang.srt.managers import mm_schedule, mm_utils  # noqa: E402  (after the CPU switch)
from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs  # noqa: E402
from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration  # noqa: E402

from sgl_embeds_srt import image_spans, model_runner  # noqa: E402
from sgl_embeds_protocol.segments import Grid  # noqa: E402

HIDDEN, VOCAB, IMAGE_TOKEN = 64, 100, 11
PATCH_WIDTH = 1176  # Qwen2.5-VL's raw patch width: its get_image_feature runs the tower on these


class StandInTower:
    dtype = torch.float32

    def __call__(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return pixels.reshape(-1, 4 * PATCH_WIDTH)[:, :HIDDEN].clone()


def model():
    fake = types.SimpleNamespace(visual=StandInTower(), use_data_parallel=False,
                                 config=types.SimpleNamespace(vision_config=types.SimpleNamespace(hidden_size=32)))
    fake.get_image_feature = types.MethodType(Qwen2_5_VLForConditionalGeneration.get_image_feature, fake)
    return fake


def span_item(rows: torch.Tensor, start: int, key: str) -> MultimodalDataItem:
    spec = image_spans.VisionSpec("qwen2_5_vl", IMAGE_TOKEN, IMAGE_TOKEN + 1, IMAGE_TOKEN - 1, IMAGE_TOKEN + 2, 2, 2)
    ids = [1] * start + [IMAGE_TOKEN] * rows.shape[0] + [1]
    ids[start - 1] = spec.vision_start_token_id
    (item,) = image_spans.image_inputs(ids, [image_spans.GridSpan(key, Grid((1, 2, 2 * rows.shape[0])), ((start, start + rows.shape[0] - 1),),
                                                              start + rows.shape[0])],
                                       spec).mm_items
    item.feature = rows
    return item


def raw_item(pixels: torch.Tensor, start: int, key: str) -> MultimodalDataItem:
    rows = pixels.shape[0] // 4
    item = MultimodalDataItem(modality=Modality.IMAGE, offsets=[(start, start + rows - 1)], feature=pixels,
                              model_specific_data={"image_grid_thw": torch.tensor([[1, 2, 2 * rows]])})
    item.set_identity(image_spans.identity(key, Grid((1, 2, 2 * rows))))
    return item


def embed(requests: list[tuple[list[MultimodalDataItem], int, int]]) -> torch.Tensor:
    """Embed a prefill batch: per request (items, prompt length, cached prefix length)."""
    mm_schedule.init_mm_embedding_cache(100 << 20)
    ids = []
    for items, length, prefix in requests:
        prompt = [1] * length
        for item in items:
            start, end = item.offsets[0]
            prompt[start:end + 1] = item.padding_sequence(end - start + 1)
        ids += prompt[prefix:]
    table = torch.nn.Embedding(VOCAB, HIDDEN)
    out, _ = mm_utils.embed_mm_inputs(
        [MultimodalInputs(mm_items=items, im_token_id=IMAGE_TOKEN) for items, _, _ in requests],
        [prefix for _, _, prefix in requests], [length - prefix for _, length, prefix in requests],
        torch.tensor(ids), table, multimodal_model=model())
    return out


@pytest.fixture
def with_our_hook(monkeypatch):
    stock = mm_schedule.get_embedding_and_mask
    monkeypatch.setattr(mm_utils, "get_embedding_and_mask",
                        lambda *a, **k: model_runner.get_embedding_and_mask(stock, *a, **k))


def test_stock_sglang_fails_on_a_mixed_batch():
    rows, pixels = torch.randn(4, HIDDEN), torch.randn(16, PATCH_WIDTH)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        embed([([span_item(rows, 2, "a")], 8, 0), ([raw_item(pixels, 1, "b")], 7, 0)])


def test_a_mixed_batch_gives_each_image_its_own_rows(with_our_hook):
    rows, other, pixels = torch.randn(4, HIDDEN), torch.randn(3, HIDDEN), torch.randn(16, PATCH_WIDTH)
    out = embed([([span_item(rows, 2, "a"), span_item(other, 8, "c")], 12, 0),
                 ([raw_item(pixels, 1, "b"), raw_item(pixels * 2, 6, "d")], 12, 0)])
    assert torch.equal(out[2:6], rows) and torch.equal(out[8:11], other)
    tower = StandInTower()
    assert torch.equal(out[13:17], tower(pixels, None)) and torch.equal(out[18:22], tower(pixels * 2, None))


def test_a_chunk_that_starts_inside_our_image(with_our_hook):
    rows, pixels = torch.randn(4, HIDDEN), torch.randn(16, PATCH_WIDTH)
    out = embed([([span_item(rows, 2, "e")], 8, 4), ([raw_item(pixels, 1, "f")], 7, 0)])
    assert torch.equal(out[0:2], rows[2:4])  # positions 4 and 5: the image's last two rows
