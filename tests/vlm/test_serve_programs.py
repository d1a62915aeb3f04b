"""Every program in programs/ on a server of each vision family: the tiny LLaVA-1.5, Qwen2.5-VL,
Gemma 3 and Gemma 4 (E2B layout) launched by ``python -m sgl_embeds serve`` and the split
LLaVA-NeXT's LLM (pool servers ``llava_llama``, ``qwen_vl``, ``gemma3_vlm``, ``gemma4_vlm``,
``llava_next``), through ``sgl_embeds.connect(url)``; ``visual_qa`` on every other family served
(Qwen2-VL, Qwen3-VL, Qwen3.5, Qwen3.5-MoE, LLaVA-OneVision, Gemma 4 26B / 31B; PaliGemma, which
has no chat, in test_paligemma_programs.py). The checkpoints are laid out as the families publish
them (``sgl_embeds_testing.hub_layout``: the chat template in chat_template.json or the tokenizer's
config, the image processor's settings in preprocessor_config.json), and ``connect`` warns of nothing.
For each, one of its calls is sent again with logprobs and its answer is the program's; the call's
prompt is the one HF's processor renders for the same conversation (the model's own chat template
and image text, written by ``connect``'s template and ``image_part``; the Gemmas' images expanded
as their processors expand them, Gemma 3's each one block); and its tokens and logprobs equal
HF's own VLM class on the pixels (greedy, float32), or for ``classify``'s ``select`` each label's
score does, HF's reference changing with the image."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import helpers
import sgl_embeds
from programs import caption_regions, classify, compare_images, extract_attributes, grounded_chat, visual_qa
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.gemma3 import tiny_gemma3_dir
from sgl_embeds_testing.gemma4 import tiny_gemma4_dir
from sgl_embeds_testing.hub_layout import HUB_LAYOUTS, layout_of
from sgl_embeds_testing.llava_next import tiny_llava_next_dir, tiny_llava_onevision_dir
from sgl_embeds_testing.models import tiny_llava_dir
from sgl_embeds_testing.paligemma import tiny_paligemma_dir
from sgl_embeds_testing.qwen_vl import (hf_qwen_vl, qwen_vl_greedy, qwen_vl_inputs, tiny_qwen2_5_vl_dir,
                                         tiny_qwen2_vl_dir, tiny_qwen3_5_dir, tiny_qwen3_5_moe_dir, tiny_qwen3_vl_dir)
from sgl_embeds.vision import crop, encode_region
from sgl_embeds.vlm import render_chat
from sgl_embeds_protocol import segments as seg

pytestmark = pytest.mark.per_server  # each family's cases where its server runs anyway
MAX_TOKENS = 8
MIN_COMPARED = 6
IMAGE, OTHER_IMAGE, THIRD_IMAGE = (helpers.random_image(96, 80, seed=3), helpers.random_image(80, 96, seed=4),
                                   helpers.random_image(64, 64, seed=5))
BOX = (0.0, 0.25, 0.75, 1.0)
LABELS = ["red", "blue", "green"]


@dataclass(frozen=True)
class Family:
    """A served family: its pool server, its HF checkpoint and HF's greedy, inputs and model."""

    server: str
    checkpoint: Callable
    greedy: Callable  # (checkpoint, text, images, max_new_tokens, prefix=()) -> ref.Greedy
    inputs: Callable  # (checkpoint, text, images) -> the processor's tensors
    model: Callable  # checkpoint (str) -> HF's model
    programs: tuple[str, ...] | None = None  # the cases run on it (None: all)
    own_vision: bool = False  # connect given the checkpoint's vision half (the server's tower is NaN)


LLAVA = dict(greedy=ref.llava_greedy, inputs=ref.llava_inputs, model=lambda c: ref.hf_llava(c)[0])
QWEN_VL = dict(greedy=qwen_vl_greedy, inputs=qwen_vl_inputs, model=lambda c: hf_qwen_vl(c)[0])
GEMMA4 = dict(greedy=ref.gemma4_greedy, inputs=ref.gemma4_inputs, model=lambda c: ref.hf_gemma4(c)[0])
VQA_ONLY = dict(programs=("vqa",))
FAMILIES = {
    "llava": Family("llava_llama", lambda: tiny_llava_dir("llama"), **LLAVA),
    "llava_next": Family("llava_next", tiny_llava_next_dir, **LLAVA),
    "qwen2_5_vl": Family("qwen_vl", tiny_qwen2_5_vl_dir, **QWEN_VL),
    "gemma3": Family("gemma3_vlm", tiny_gemma3_dir, ref.gemma3_greedy, ref.gemma3_inputs,
                     lambda c: ref.hf_gemma3(c)[0]),
    "gemma4": Family("gemma4_vlm", lambda: tiny_gemma4_dir("e2b"), **GEMMA4),
    "llava_onevision": Family("llava_onevision", tiny_llava_onevision_dir, **LLAVA, **VQA_ONLY),
    "qwen2_vl": Family("qwen2_vl_spans", tiny_qwen2_vl_dir, **QWEN_VL, **VQA_ONLY, own_vision=True),
    "qwen3_vl": Family("qwen3_vl", tiny_qwen3_vl_dir, **QWEN_VL, **VQA_ONLY),
    "qwen3_5": Family("qwen3_5", tiny_qwen3_5_dir, **QWEN_VL, **VQA_ONLY, own_vision=True),
    "qwen3_5_moe": Family("qwen3_5_moe", tiny_qwen3_5_moe_dir, **QWEN_VL, **VQA_ONLY, own_vision=True),
    "gemma4_31b": Family("gemma4_31b_vlm", lambda: tiny_gemma4_dir("31b"), **GEMMA4, **VQA_ONLY),
}


def user(*parts) -> dict:
    """A user turn of HF's form: ``"<image>"`` for an image part, other strings for text."""
    return {"role": "user", "content": [{"type": "image"} if p == "<image>" else {"type": "text", "text": p}
                                        for p in parts]}


@dataclass(frozen=True)
class Case:
    """A program's run, the call compared with HF (``pick``: the index of its segment list in
    ``compile_program``'s, from the lists), where its answer is in the state, the conversation
    HF renders for that call, and the images HF sees for it (and for another image)."""

    program: object
    arguments: dict
    pick: Callable  # (calls, encoder) -> index
    answer: Callable  # state -> the text of the picked call
    messages: list
    images: Callable  # image -> the images HF sees, in the prompt's order
    after: str = ""  # text after the generation prompt (select's prefix)


def _first(calls, encoder) -> int:
    return 0


def _asking(words: str) -> Callable:
    return lambda calls, encoder: next(i for i, call in enumerate(calls[:-1]) if words in call[-1].text)


def _region_branch(calls, encoder) -> int:
    rows = encode_region(IMAGE, BOX, encoder).rows
    return next(i for i, call in enumerate(calls[:-1])
                if len(spans := [s for s in call if isinstance(s, seg.Span)]) == 2 and spans[1].rows.equal(rows))


QUESTION = "what is in the picture"
CASES = {
    "vqa": Case(visual_qa, dict(image=IMAGE, question=QUESTION, max_tokens=MAX_TOKENS), _first,
                lambda s: s["answer"], [user("<image>", QUESTION)], lambda image: [image]),
    "compare": Case(compare_images, dict(images=[IMAGE, THIRD_IMAGE], question="which is brighter",
                                         max_tokens=MAX_TOKENS), _first, lambda s: s["comparison"],
                    [user("Image 1: ", "<image>", "Image 2: ", "<image>", "which is brighter")],
                    lambda image: [image, THIRD_IMAGE]),
    "grounded_chat": Case(grounded_chat, dict(image=IMAGE, turns=[QUESTION, "and its color"],
                                              max_tokens=MAX_TOKENS), _first, lambda s: s["replies"][0],
                          [user("<image>", QUESTION)], lambda image: [image]),
    "attributes": Case(extract_attributes, dict(image=IMAGE, attributes=["color", "size"], max_tokens=MAX_TOKENS),
                       _asking("What is its color?"), lambda s: s["attributes"]["color"],
                       [user("<image>", "Look at the object."), user("What is its color? Answer in a few words.")],
                       lambda image: [image]),
    "region_caption": Case(caption_regions, dict(image=IMAGE, boxes=[BOX, (0.5, 0.0, 1.0, 0.5)],
                                                 max_tokens=MAX_TOKENS), _region_branch,
                           lambda s: s["captions"][0],
                           [user("<image>", "The image."), user("<image>", "Describe this region.")],
                           lambda image: [image, crop(image, BOX)]),
    "classify": Case(classify, dict(image=IMAGE, labels=LABELS), _first, lambda s: s["label"],
                     [user("<image>", "Which category fits the image best?")], lambda image: [image],
                     after="The category is "),
}


@pytest.fixture(scope="module")
def connected(servers):
    """``connected(family)``: ``sgl_embeds.connect`` to the family's pool server (made once),
    which must warn of nothing (a template or processor setting not found warns)."""
    made = {}

    def backend(family: str):
        if family not in made:
            fam = FAMILIES[family]
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                made[family] = sgl_embeds.connect(servers.get(fam.server)[0].url, device="cpu",
                                                  vision=fam.checkpoint() if fam.own_vision else None)
            assert not seen, [f"{w.category.__name__}: {w.message}" for w in seen]
        return made[family]

    return backend


def _text(call: list, image_token: str) -> str:
    """The prompt text of a call's segments with the family's image token for each span."""
    return "".join(s.text if isinstance(s, seg.Text) else image_token for s in call)


def hf_select_scores(family: Family, text: str, images: list, choices: list[str]) -> list[float]:
    """HF's ``select`` score of each choice after ``text`` on the images, as
    ``helpers.hf_select_scores`` computes it for a text LLM (the text's trailing space belongs to
    the choice's first token)."""
    checkpoint = str(family.checkpoint())
    model = family.model(checkpoint)
    n_prompt = family.inputs(checkpoint, text.rstrip(" "), images)["input_ids"].shape[1]
    scores = []
    for choice in choices:
        inputs = family.inputs(checkpoint, text + choice, images)
        ids = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            logp = model(**inputs).logits[0].double().log_softmax(-1)
        lps = [float(logp[p - 1, ids[p]]) for p in range(n_prompt, len(ids))]
        scores.append(sum(lps) / len(lps))
    return scores


# (family by family: its server stays up for its cases)
RUNS = [pytest.param(family, name, marks=pytest.mark.pooled(fam.server), id=f"{family}-{name}")
        for family, fam in FAMILIES.items() for name in CASES if fam.programs is None or name in fam.programs]


@pytest.mark.parametrize("family,name", RUNS)
def test_each_program_on_each_family_writes_the_models_prompt_and_answers_like_hf(name, family, connected):
    case, fam = CASES[name], FAMILIES[family]
    backend = connected(family)
    encoder = backend.vision_encoder
    state = case.program.run(**case.arguments, backend=backend)
    calls = sgl_embeds.compile_program(case.program, like=backend, **case.arguments)
    call = calls[case.pick(calls, encoder)]
    ours = _text(call, encoder.image_token)
    vision_dir = backend.server_info.model.vision_dir
    if backend.server_info.model.served_as == "split":
        assert "serve-cache" in vision_dir  # split by `sgl_embeds serve` (conftest.py), not by the tests
    # what HF's processor is given, and the prompt it expands it into (Gemma 3: each image its
    # rows between its tokens, the bos written by the server)
    text = render_chat(vision_dir, case.messages) + case.after
    expanded = encoder.prompt_text(text) if hasattr(encoder, "prompt_text") else text
    assert ours == expanded, f"{name} on {family}: {ours!r}"
    checkpoint = fam.checkpoint()
    label = f"{name} on {family}: "
    if case.program is classify:
        hf = hf_select_scores(fam, text, case.images(IMAGE), LABELS)
        ours = helpers.assert_select_scores(state, "label", hf, label)
        assert state["label"] == LABELS[hf.index(max(hf))]
        other = hf_select_scores(fam, text, case.images(OTHER_IMAGE), LABELS)
        assert max(abs(a - b) for a, b in zip(hf, other)) > 100 * ref.LOGPROB_TOL, (hf, other)
        print(f"{label}scores {ours} equal HF's {hf}")
        return
    out = backend.run(input_segments=call, return_logprob=True, top_logprobs_num=ref.TOP_K,
                      sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    assert case.answer(state) == out["text"], label
    model = fam.model(str(checkpoint))
    greedy = functools.partial(fam.greedy, checkpoint, text, case.images(IMAGE), MAX_TOKENS)
    reference = ref.assert_vlm_matches_hf(out, greedy, ref.eos_ids(model), label, MIN_COMPARED, min_distinct=2)
    other = fam.greedy(checkpoint, text, case.images(OTHER_IMAGE), MAX_TOKENS)
    assert other.tokens != reference.tokens, f"{label}HF's answer does not change with the image"
    if case.program is grounded_chat:  # the second turn reuses the image and the first turn
        rows = sum(s.rows.shape[0] for s in call if isinstance(s, seg.Span))
        assert state["cached"][1] >= rows, (state["cached"], rows)


# the checkpoint of each family a hub layout is written for (PaliGemma's: test_paligemma_programs.py's)
PUBLISHED = {"paligemma": lambda: tiny_paligemma_dir(1),
             **{family: FAMILIES[family].checkpoint for family in HUB_LAYOUTS if family != "paligemma"}}


@pytest.mark.parametrize("family", sorted(HUB_LAYOUTS))
def test_the_served_checkpoints_are_laid_out_as_published(family):
    """The tiny checkpoints the servers above run hold their processor files where the family's
    published repositories do (``hub_layout.HUB_LAYOUTS``), not where transformers 5 saves them."""
    published = HUB_LAYOUTS[family]
    assert layout_of(PUBLISHED[family]()) == dict(templates=published.templates, processor_config=published.processor_config,
                                                  nested=False, image_config=True, video_config=published.video_config)
