"""Every program in programs/ against a real server (tiny Llama, chatml template)."""

from __future__ import annotations

import pytest
import torch

import sgl_embeds
from helpers import assert_select_scores, hf_select_scores, seeded_rows
from programs import caption_regions, classify, compare_images, extract_attributes, grounded_chat, visual_qa
from sgl_embeds import EmbedsEndpoint
from sgl_embeds_protocol import segments as seg
from sgl_embeds_testing.encoders import GridEncoder, synthetic_scene
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
    spans = [s.rows for s in sent if isinstance(s, seg.Span)]
    assert len(spans) == 3 and all(torch.equal(a, b) for a, b in zip(spans, imgs))
    state = compare_images.run(images=imgs, max_tokens=6, backend=backend)
    assert state["comparison"] == _direct(backend, sent, 6)["text"]


def test_caption_regions_encodes_each_crop(backend):
    scene, boxes = synthetic_scene(), [(8, 8, 32, 32), (0.5, 0.5, 1.0, 1.0)]
    state = caption_regions.run(image=scene, boxes=boxes, max_tokens=6, backend=backend)
    enc = GridEncoder()
    sent = sgl_embeds.compile_program(caption_regions, backend, image=scene, boxes=boxes, max_tokens=6)
    regions = [[s.rows for s in call if isinstance(s, seg.Span)][-1] for call in sent[:2]]  # branches run in any order
    for box, caption in zip(boxes, state["captions"]):
        calls = [call for call, r in zip(sent[:2], regions) if torch.equal(r, enc(crop(scene, box)))]
        assert len(calls) == 1, box  # each crop encoded once, in its own branch
        assert caption == _direct(backend, calls[0], 6)["text"]  # and captioned from that branch's prompt
    assert state["captions"][0] != state["captions"][1]


def test_grounded_chat_reuses_the_cache_across_turns(backend):
    state = grounded_chat.run(image=seeded_rows(5, 30), turns=["what is it", "what color", "is it big"], max_tokens=6, backend=backend)
    assert len(state["replies"]) == 3
    assert state["cached"][1] >= 30 and state["cached"][2] > state["cached"][1]


def test_extract_attributes_forks_share_the_span(backend):
    names = ["color", "size", "material"]
    state = extract_attributes.run(image=seeded_rows(6, 40), attributes=names, max_tokens=4, backend=backend)
    sent = sgl_embeds.compile_program(extract_attributes, backend, image=seeded_rows(6, 40), attributes=names, max_tokens=4)
    for name in names:  # each value is what its own branch's prompt gives
        calls = [call for call in sent[:3] if f"What is its {name}?" in call[-1].text]
        assert len(calls) == 1 and state["attributes"][name] == _direct(backend, calls[0], 4)["text"], name


def test_classify_picks_the_label_hf_scores_highest(backend, llama_dir):
    labels = ["red", "blue", "green"]
    image = seeded_rows(7, 10)
    state = classify.run(image=image, labels=labels, backend=backend)
    prompt = sgl_embeds.compile_program(classify, backend, image=image, labels=labels)[0]  # what select scores after
    text0, span_, rest = prompt
    scores = hf_select_scores(llama_dir, [text0.text, span_.rows], rest.text, labels)
    assert_select_scores(state, "label", scores)
    assert state["label"] == labels[max(range(3), key=lambda i: scores[i])], (state["label"], scores)
    assert len({round(s, 3) for s in scores}) == 3  # the scores tell the labels apart
