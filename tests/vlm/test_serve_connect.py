"""The user's path end to end: ``python -m sgl_embeds serve CHECKPOINT`` (the pool's LLaVA-1.5 and
Qwen2.5-VL servers are launched by it: conftest.py), ``sgl_embeds.connect(url)`` with the vision
half the server names, and a program with ``image_prompt`` answering as HF does on the pixels; a
vision half that does not fit the server refused at connect, the error naming what fits."""

from __future__ import annotations

import pytest
import torch

import helpers
import sgl_embeds
from llava_harness import LlavaHarness, question, run_program
from qwen_vl_harness import assert_matches_hf, chat_text
from sgl_embeds.vision import VisionRows
from sgl_embeds.vlm import AnyresEncoder, LlavaEncoder, QwenVLEncoder, load_encoder, render_chat

IMAGE = helpers.random_image(96, 80, seed=3)


def test_a_llava_served_by_serve_answers_like_hf_through_connect(llava_llama_server, llava_llama):
    checkpoint, split_dir = llava_llama
    backend = sgl_embeds.connect(llava_llama_server.url, device="cpu")
    served = backend.server_info.model
    assert (served.family, served.served_as, served.grid) == ("llava", "split", False)
    assert "serve-cache" in served.vision_dir  # serve's own split, not the tests'
    assert isinstance(backend.vision_encoder, LlavaEncoder)
    assert backend.vision_encoder.identity == load_encoder(split_dir / "vision").identity
    half = sgl_embeds.connect(llava_llama_server.url, device="cpu", dtype="bfloat16")
    assert half.vision_encoder.dtype == torch.bfloat16 and half.vision_encoder.identity != backend.vision_encoder.identity
    with pytest.raises(ValueError, match="the encoder given computes in its own"):
        sgl_embeds.connect(llava_llama_server.url, vision=backend.vision_encoder, dtype="bfloat16")
    harness = LlavaHarness("llava_llama", checkpoint, split_dir, llava_llama_server, backend)
    text = render_chat(served.vision_dir, question("what is in the picture"))
    harness.check(harness.run(text, [IMAGE]), text, [IMAGE], "serve + connect")


def test_a_qwen_vl_served_by_serve_answers_like_hf_through_connect(qwen_vl_server, qwen_vl_dir):
    backend = sgl_embeds.connect(qwen_vl_server.url, device="cpu")
    served = backend.server_info.model
    assert (served.family, served.served_as, served.grid) == ("qwen2_5_vl", "native", True)
    assert served.vision_dir == str(qwen_vl_dir)
    assert served.vision_tokens == {"image": "<|image_pad|>", "start": "<|vision_start|>",
                                       "end": "<|vision_end|>"}
    assert isinstance(backend.vision_encoder, QwenVLEncoder)
    text = render_chat(served.vision_dir, question("describe the image"))
    assert text == chat_text(qwen_vl_dir, "describe the image", 1)  # the processor's own
    assert_matches_hf(run_program(backend, text, [IMAGE]), qwen_vl_dir, text, [IMAGE], "serve + connect")


def test_a_vision_half_that_does_not_fit_is_refused_at_connect(llava_llama_server, qwen_vl_server,
                                                              llava_llama, qwen_vl_dir):
    llava_vision = llava_llama[1] / "vision"
    with pytest.raises(ValueError, match=r"vision half of a llava model, the server serves a "
                       r"qwen2_5_vl model \(native\).*what fits: connect\(url\).*vision='"
                       + str(qwen_vl_dir)):
        sgl_embeds.connect(qwen_vl_server.url, vision=llava_vision, device="cpu")
    with pytest.raises(ValueError, match="vision half of a qwen2_5_vl model, the server serves a "
                       r"llava model \(split\)"):
        sgl_embeds.connect(llava_llama_server.url, vision=qwen_vl_dir, device="cpu")
    hidden = sgl_embeds.connect(llava_llama_server.url, vision=llava_vision).span_width
    with pytest.raises(ValueError, match=rf"rows are \[n, {hidden + 1}\], the server's spans are "
                       rf"\[n, {hidden}\]"):
        sgl_embeds.connect(llava_llama_server.url, vision=lambda image: torch.ones(4, hidden + 1))
    with pytest.raises(ValueError, match=r"carry an image grid \(image_grid_thw\), the server takes none"):
        sgl_embeds.connect(llava_llama_server.url,
                           vision=lambda image: VisionRows(torch.ones(1, hidden), (1, 2, 2)))
    with pytest.raises(ValueError, match="carry no image grid, the server needs one"):
        sgl_embeds.connect(qwen_vl_server.url, vision=lambda image: torch.ones(4, 64))


def test_an_encoder_of_each_family_states_its_fit(llava_dirs, qwen_vl_dir):
    """What connect compares without running the encoder: its family, span width, grid."""
    for name, kind in (("llama", LlavaEncoder), ("llava_next", AnyresEncoder)):
        encoder = load_encoder(llava_dirs(name)[1] / "vision", device="cpu")
        assert isinstance(encoder, kind) and encoder.family == ("llava" if name == "llama" else name)
        assert encoder.span_width == encoder(IMAGE).shape[1]
        assert getattr(encoder, "merge_size", None) is None
    qwen = load_encoder(qwen_vl_dir, device="cpu")
    assert qwen.family == "qwen2_5_vl" and qwen.span_width == qwen(IMAGE).rows.shape[1]


def _vision_folders(llava_dirs, qwen_vl_dir) -> dict:
    """A vision half of each encoder class: split by the tests (LLaVA) or by ``serve``'s cache
    (the Gemmas, PaliGemma), a Qwen-VL's checkpoint as it is."""
    from sgl_embeds.serve import split_dir
    from sgl_embeds_testing.gemma3 import tiny_gemma3_dir
    from sgl_embeds_testing.gemma4 import tiny_gemma4_dir
    from sgl_embeds_testing.paligemma import tiny_paligemma_dir

    return {"llava": lambda: llava_dirs("llama")[1] / "vision",
            "llava_next": lambda: llava_dirs("llava_next")[1] / "vision",
            "qwen2_5_vl": lambda: qwen_vl_dir,
            "paligemma": lambda: split_dir(tiny_paligemma_dir(2), progress=False) / "vision",
            "gemma3": lambda: split_dir(tiny_gemma3_dir(), progress=False) / "vision",
            "gemma4": lambda: split_dir(tiny_gemma4_dir("e2b"), progress=False) / "vision"}


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_5_vl", "paligemma", "gemma3", "gemma4"])
def test_a_vision_half_in_bfloat16_gives_float32_rows_near_its_float32_ones(family, llava_dirs, qwen_vl_dir):
    """``load_encoder(dtype="bfloat16")`` (``connect``'s ``dtype``) computes in bfloat16: its own
    cache identity, rows back in float32 of the same shape, within bfloat16's rounding of the
    float32 half's rows and not equal to them."""
    folder = _vision_folders(llava_dirs, qwen_vl_dir)[family]()
    full, half = load_encoder(folder, device="cpu"), load_encoder(folder, device="cpu", dtype="bfloat16")
    assert next(half.tower.parameters()).dtype == torch.bfloat16
    assert next(full.tower.parameters()).dtype == torch.float32
    assert half.identity != full.identity
    want, got = ((out.rows if isinstance(out, VisionRows) else out) for out in (full(IMAGE), half(IMAGE)))
    assert got.dtype == torch.float32 and got.shape == want.shape
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < error < 0.05, f"{family}: bfloat16 rows off by {error:.3g} of the largest"
    with pytest.raises(ValueError, match="computes in one of"):
        load_encoder(folder, device="cpu", dtype="int8")
