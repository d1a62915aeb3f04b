"""Every program in programs/ against a real server (tiny Llama, chatml template)."""

from __future__ import annotations

import pytest
import torch

import sgl_embeds
from helpers import seeded_rows
from programs import caption_regions, classify, compare_images, extract_attributes, grounded_chat, visual_qa
from sgl_embeds import EmbedsEndpoint
from sgl_embeds import segments as seg
from sgl_embeds.testing.encoders import GridEncoder, synthetic_scene
from sgl_embeds.vision import crop



@pytest.fixture(scope="module")
def backend(llama_server):
    return EmbedsEndpoint(llama_server.url, chat_template_name="chatml", vision_encoder=GridEncoder())


def _direct(backend, segments, n):
    return backend.run(input_segments=segments, sampling_params={"temperature": 0, "max_new_tokens": n})


def test_visual_qa_answers_from_the_span_and_caches_it(backend):
    img = seeded_rows(1, 24)
    first = visual_qa.run(image=img, question="what is the color", max_tokens=8, backend=backend)
    sent = sgl_embeds.compile_program(visual_qa, backend, image=img, question="what is the color", max_tokens=8)[0]
    assert first["answer"] == _direct(backend, sent, 8)["text"]
    second = visual_qa.run(image=img, question="is there a dog", max_tokens=8, backend=backend)
    assert second.get_meta_info("answer")["cached_tokens"] >= 24


def test_compare_images_sends_one_span_per_image(backend):
    imgs = [seeded_rows(2, 8), seeded_rows(3, 12), seeded_rows(4, 5)]
    sent = sgl_embeds.compile_program(compare_images, backend, images=imgs, max_tokens=6)[0]
    spans = [s.tensor for s in sent if isinstance(s, seg.Embeds)]
    assert len(spans) == 3 and all(torch.equal(a, b) for a, b in zip(spans, imgs))
    state = compare_images.run(images=imgs, max_tokens=6, backend=backend)
    assert state["comparison"] == _direct(backend, sent, 6)["text"]


def test_caption_regions_encodes_each_crop(backend):
    scene, boxes = synthetic_scene(), [(8, 8, 32, 32), (0.5, 0.5, 1.0, 1.0)]
    state = caption_regions.run(image=scene, boxes=boxes, max_tokens=6, backend=backend)
    assert len(state["captions"]) == 2 and all(isinstance(c, str) for c in state["captions"])
    enc = GridEncoder()
    sent = sgl_embeds.compile_program(caption_regions, backend, image=scene, boxes=boxes, max_tokens=6)
    regions = [[s.tensor for s in call if isinstance(s, seg.Embeds)][-1] for call in sent[:2]]  # branches run in any order
    for box in boxes:
        assert sum(torch.equal(r, enc(crop(scene, box))) for r in regions) == 1, box


def test_grounded_chat_reuses_the_cache_across_turns(backend):
    state = grounded_chat.run(image=seeded_rows(5, 30), turns=["what is it", "what color", "is it big"], max_tokens=6, backend=backend)
    assert len(state["replies"]) == 3
    assert state["cached"][1] >= 30 and state["cached"][2] > state["cached"][1]


def test_extract_attributes_forks_share_the_span(backend):
    state = extract_attributes.run(image=seeded_rows(6, 40), attributes=["color", "size", "material"], max_tokens=4, backend=backend)
    assert set(state["attributes"]) == {"color", "size", "material"}


def test_classify_picks_a_label_consistently(backend):
    labels = ["red", "blue", "green"]
    a = classify.run(image=seeded_rows(7, 10), labels=labels, backend=backend)["label"]
    b = classify.run(image=seeded_rows(7, 10), labels=labels, backend=backend)["label"]
    assert a in labels and a == b
