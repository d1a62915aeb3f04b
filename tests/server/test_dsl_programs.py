"""Programs with spans against a real server: tokens equal HF, forks hit the cache, regions, select."""

from __future__ import annotations

import pytest
import sglang as sgl
import torch
from PIL import Image

import sgl_embeds
from helpers import LOGPROBS, assert_select_scores, hf_select_scores, reference_embeds, seeded_rows, with_other_spans
from sgl_embeds import EmbedsEndpoint
from sgl_embeds_protocol import segments as seg
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import GridEncoder



@pytest.fixture(scope="module")
def backend(llama_server):
    return EmbedsEndpoint(llama_server.url)


def test_program_with_two_spans_matches_hf(backend, llama_dir):
    a, b = seeded_rows(1, 5), seeded_rows(2, 9)

    @sgl.function
    def two_spans(s, a, b):
        s += "the red fox" + sgl.embeds(a) + " near the house" + sgl.embeds(b) + " is"
        s += sgl.gen("out", max_tokens=12, temperature=0)

    state = two_spans.run(a=a, b=b, backend=backend)
    meta = state.get_meta_info("out")
    parts = ["the red fox", a, " near the house", b, " is"]
    direct = backend.run(input_segments=[seg.Text("the red fox"), seg.Span(a), seg.Text(" near the house"), seg.Span(b), seg.Text(" is")],
                         sampling_params={"temperature": 0, "max_new_tokens": 12}, **LOGPROBS)
    want = ref.assert_matches_hf(direct, llama_dir, reference_embeds(llama_dir, parts), 12,
                                 other_span_embeds=reference_embeds(llama_dir, with_other_spans(parts)))
    assert meta["completion_tokens"] == len(want.tokens)
    assert state["out"] == direct["text"]


def test_forked_branches_hit_the_cache_over_the_span(backend):
    span = seeded_rows(3, 40)

    @sgl.function
    def fan_out(s, x):
        s += "look at this" + sgl.embeds(x) + " and tell"
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f" fact {i}:" + sgl.gen("fact", max_tokens=3, temperature=0)
        s["cached"] = [f.get_meta_info("fact")["cached_tokens"] for f in forks]

    state = fan_out.run(x=span, backend=backend)
    assert all(c >= 40 for c in state["cached"][1:]), state["cached"]


def test_run_batch_and_streaming(backend):
    @sgl.function
    def one(s, x):
        s += "the dog" + sgl.embeds(x) + sgl.gen("out", max_tokens=6, temperature=0)

    xs = [seeded_rows(10 + i, 4) for i in range(3)]
    states = one.run_batch([{"x": x} for x in xs], backend=backend)
    solo = [backend.run(input_segments=[seg.Text("the dog"), seg.Span(x)], sampling_params={"temperature": 0, "max_new_tokens": 6})["text"] for x in xs]
    assert [st["out"] for st in states] == solo
    streamed = one.run(x=xs[0], backend=backend, stream=True)
    pieces = list(streamed.text_iter("out"))
    assert "".join(pieces) == solo[0]


def test_select_with_spans_matches_hf_scoring(backend, llama_dir):
    x = seeded_rows(20, 6)
    choices = ["red", "blue house", "green tree"]

    @sgl.function
    def pick(s, x):
        s += "the image" + sgl.embeds(x) + " shows a " + sgl.select("c", choices=choices, temperature=0)

    scores = {}
    for name, rows in (("x", x), ("another span", seeded_rows(21, 6))):
        state = pick.run(x=rows, backend=backend)
        hf = hf_select_scores(llama_dir, ["the image", rows], " shows a ", choices)
        scores[name] = assert_select_scores(state, "c", hf, f"{name}: ")
        assert state["c"] == choices[hf.index(max(hf))], (state["c"], hf)
    change = max(abs(a - b) for a, b in zip(scores["x"], scores["another span"]))
    assert change > 100 * ref.LOGPROB_TOL, f"the span must change the scores: {scores}"


def _image() -> Image.Image:
    img = Image.new("RGB", (64, 48), (255, 0, 0))
    img.paste((0, 0, 255), (32, 0, 64, 48))
    return img


def test_region_sends_the_encoder_applied_to_the_crop(backend, llama_server, llama_dir):
    enc, img = GridEncoder(), _image()

    @sgl.function
    def describe(s, box):
        s += sgl.image(img) + " the region" + sgl.region(box) + " is" + sgl.gen("out", max_tokens=8, temperature=0)

    region_backend = EmbedsEndpoint(llama_server.url, vision_encoder=enc)
    for box in [(0, 0, 32, 48), (0.5, 0.0, 1.0, 1.0)]:
        sent = sgl_embeds.compile_program(describe, vision_encoder=enc, box=box)[0]
        from sgl_embeds.vision import crop

        assert torch.equal(sent[0].rows, enc(img)) and torch.equal(sent[2].rows, enc(crop(img, box)))
        state = describe.run(box=box, backend=region_backend)
        out = region_backend.run(input_segments=sent, sampling_params={"temperature": 0, "max_new_tokens": 8}, **LOGPROBS)
        ref.assert_matches_hf(out, llama_dir, reference_embeds(llama_dir, [enc(img), " the region", enc(crop(img, box)), " is"]), 8,
                              f"box {box}: ", other_span_embeds=reference_embeds(llama_dir, [enc(img), " the region", enc(_image().rotate(90)), " is"]))
        assert state["out"] == out["text"]



def test_backend_checks_hidden_size_before_sending(backend):
    with pytest.raises(ValueError, match="hidden size 10 but the model's hidden size is 64"):
        backend.run(input_embeds=torch.zeros(3, 10))
    out = backend.run(input_embeds=seeded_rows(30, 5), sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert out["meta_info"]["completion_tokens"] == 3
    json_backend = EmbedsEndpoint(backend.base_url, wire_format="json")
    again = json_backend.run(input_embeds=seeded_rows(30, 5), sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert again["output_ids"] == out["output_ids"]
