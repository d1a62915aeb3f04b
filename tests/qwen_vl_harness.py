"""Image and clip spans on the natively served Qwen-VL families (``vlm/test_qwen_vl_spans.py``,
``vlm/test_qwen_vl_families.py``, ``vlm/test_qwen_vl_video.py``, ``vlm/test_multitokenizer.py``): a
chat prompt with image and video placeholders, its grid spans between the vision tokens, a request
with output logprobs, the comparison with HF's own class on the pixels and frames, and each
family's clip sizes."""

from __future__ import annotations

import functools
import re

import sglang as sgl

import helpers
from sgl_embeds import EmbedsEndpoint, vision
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.qwen_vl import (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, VISION_END, VISION_START, clip_rows,
                                       hf_qwen_vl, image_rows, qwen_vl_greedy, sample_images,
                                       tiny_qwen2_5_vl_dir, tiny_qwen2_vl_dir, tiny_qwen3_vl_dir)
from sgl_embeds.vlm import load_encoder

MAX_TOKENS = 10
IM_END = "<|im_end|>"  # the Qwen chat template's stop string
MIN_COMPARED = 8
BOX = (8, 16, 56, 80)  # a box on the disc image of sample_images (64x96) that holds the disc
# The pooled span server of each family (NaN vision weights, tests/conftest.py) -> (checkpoint,
# clip frame sizes (width, height), the seed of its clips): seeds whose clips give HF answers of
# several distinct tokens that differ from clip to clip (measured)
CLIP_FAMILIES = {"qwen_vl_spans": (tiny_qwen2_5_vl_dir, ((224, 56), (112, 56)), 1),
                 "qwen3_vl_spans": (tiny_qwen3_vl_dir, ((128, 64), (64, 128)), 1),
                 "qwen2_vl_spans": (tiny_qwen2_vl_dir, ((224, 56), (112, 56)), 7)}


def chat_text(checkpoint, question: str, n_images: int, media: tuple[str, ...] = ()) -> str:
    """The chat-template prompt of ``n_images`` images (or the parts ``media``, each "image" or
    "video", in order) then a question (unexpanded placeholders)."""
    _, processor = hf_qwen_vl(str(checkpoint))
    content = [{"type": kind} for kind in media or ["image"] * n_images] + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def span_segments(text: str, spans: list[dict]) -> list[dict]:
    """``text`` with each image or video placeholder replaced by the vision tokens around a grid
    span, in order."""
    parts = re.split("|".join(map(re.escape, (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER))), text)
    assert len(parts) == len(spans) + 1, text
    texts = [parts[0] + VISION_START] + [VISION_END + p + VISION_START for p in parts[1:-1]] + [VISION_END + parts[-1]]
    segments = [helpers.text(texts[0])]
    for span, after in zip(spans, texts[1:]):
        segments += [span, helpers.text(after)]
    return segments


def grid_span(checkpoint, image) -> dict:
    rows, grid = image_rows(checkpoint, image)
    return {**helpers.span(rows), "image_grid_thw": list(grid)}


def clip_span(checkpoint, frames, fps: float) -> dict:
    rows, fields = clip_rows(checkpoint, frames, fps)
    return {**helpers.span(rows), **fields}


def ask(server, segments: list[dict], **extra) -> dict:
    return helpers.generate(server, helpers.body(segments, MAX_TOKENS, return_logprob=True, **extra))


def assert_matches_hf(out: dict, checkpoint, text: str, hf_images: list, label: str,
                      add_special_tokens: bool = True, clips: list = (), max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """Our tokens equal HF's on the pixels and frames (``clips``: ``(frames, fps)``; near-tie
    rule), and their logprobs too, over ``max_new_tokens``."""
    greedy = functools.partial(qwen_vl_greedy, checkpoint, text, hf_images, max_new_tokens,
                               add_special_tokens=add_special_tokens, clips=clips)
    eos = ref.eos_ids(hf_qwen_vl(str(checkpoint))[0])
    return ref.assert_vlm_matches_hf(out, greedy, eos, f"{label}: ", MIN_COMPARED, min_distinct=2).tokens


def program_text(server, segments: list[dict], direct: dict) -> str:
    """What a program's ``sgl.gen`` answers for ``segments``, whose greedy answer sent directly is
    ``direct``: SGLang's interpreter stops at the chat template's stop string (``<|im_end|>``,
    which these random-weight models may well say first), a direct request does not. The stopped
    answer's ids begin the direct one's."""
    params = {**helpers.GREEDY, "max_new_tokens": MAX_TOKENS, "stop": [IM_END]}
    stopped = helpers.generate(server, {**helpers.body(segments), "sampling_params": params})
    assert direct["output_ids"][:len(stopped["output_ids"])] == stopped["output_ids"], (direct, stopped)
    return stopped["text"]


def image_program(before: str, after: str, encoder):
    """A program asking about ``sgl.image(image)``, or ``sgl.region(region, image)`` when a region
    is given, between the encoder's vision tokens, with the chat text ``before`` and ``after``."""

    @sgl.function
    def ask_about(s, image, region):
        s += before + encoder.vision_start
        s += sgl.image(image) if region is None else sgl.region(region, image)
        s += encoder.vision_end + after
        s += sgl.gen("answer", max_tokens=MAX_TOKENS, temperature=0)

    return ask_about


def assert_regions_match_hf(checkpoint, server, regions: dict) -> None:
    """A program with the family's client vision half (``load_encoder``): ``sgl.image`` and
    ``sgl.region`` of each of ``regions`` (name -> None for the whole image, a box or a mask) on
    the disc image answer as HF does on what the region shows, sent directly as a span too; each
    region changes HF's answer."""
    encoder = load_encoder(checkpoint, device="cpu")
    backend = EmbedsEndpoint(server.url, vision_encoder=encoder)
    assert backend.span_width == encoder(sample_images()["square"]).rows.shape[1]
    text = chat_text(checkpoint, "what is the color of the object", 1)
    before, after = text.split(IMAGE_PLACEHOLDER)
    image = sample_images()["disc"]
    ask_about = image_program(before, after, encoder)
    references = {}
    for name, region in regions.items():
        seen = vision.region_image(image, region, encoder)
        encoded = encoder(seen)
        segments = span_segments(text, [{**helpers.span(encoded.rows), **encoded.grid.fields()}])
        direct = ask(server, segments)
        references[name] = assert_matches_hf(direct, checkpoint, text, [seen], f"client encoder, {name}")
        answer = ask_about.run(image=image, region=region, backend=backend)["answer"]
        assert answer == program_text(server, segments, direct), name
    assert len({tuple(r) for r in references.values()}) == len(regions), f"each region must change HF: {references}"
