"""The stack itself: stock text generation on CPU equals HF, caching works, SGLang's frontend runs."""

from __future__ import annotations

import sglang as sgl

from sgl_embeds import EmbedsEndpoint, demo
from helpers import LOGPROBS, assert_select_scores, hf_select_scores
from sgl_embeds_testing import reference as ref


def test_text_generate_equals_hf_greedy(llama_server, llama_dir):
    tok = ref.hf_tokenizer(str(llama_dir))
    prompt = "the quick red fox near the blue house"
    out = llama_server.generate({"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16},
                                 **LOGPROBS}).json()
    reference = ref.assert_matches_hf(out, llama_dir, ref.embed_ids(llama_dir, tok.encode(prompt)), 16)
    assert len(set(reference.tokens)) > 2


def test_repeated_prompt_reports_cached_tokens(llama_server):
    payload = {"text": "a large green tree under the sky", "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    llama_server.generate(payload)
    assert llama_server.generate(payload).json()["meta_info"]["cached_tokens"] > 0


def test_sgl_function_with_gen_and_select_through_runtime_endpoint(llama_server, llama_dir):
    @sgl.function
    def describe(s, thing):
        s += "the " + thing + " is"
        s += sgl.gen("words", max_tokens=6, temperature=0)
        s += " so it is " + sgl.select("answer", choices=["red", "blue", "green"])

    backend = sgl.RuntimeEndpoint(llama_server.url)
    state = describe.run(thing="fox", backend=backend)
    choices = ["red", "blue", "green"]
    scores = hf_select_scores(llama_dir, ["the fox is" + state["words"]], " so it is ", choices)
    assert_select_scores(state, "answer", scores)
    assert state["answer"] == choices[max(range(3), key=lambda i: scores[i])], (state["answer"], scores)
    direct = llama_server.generate({"text": "the fox is", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}).json()
    assert state["words"] == direct["text"]


def test_the_demo_program_answers_about_its_span_and_caches_it(demo_server):
    """What ``make demo`` shows (``sgl_embeds.demo``), on the pool's demo server: SmolLM2 answers
    from the description's embedding rows alone, and the second question reuses the span's KV."""
    rows = demo.embedding_rows(demo.demo_model_dir(), demo.DESCRIPTION)
    backend = EmbedsEndpoint(demo_server.url, chat_template_name="chatml")
    # run() returns at once and the program runs in a thread: read each answer before the next
    # question, as the demo does, or both are prefilled in one batch and nothing is cached yet
    first = demo.ask.run(rows=rows, question=demo.QUESTIONS[0], backend=backend)
    assert "red" in first["answer"].lower(), first["answer"]  # the span's colour, never sent as text
    second = demo.ask.run(rows=rows, question=demo.QUESTIONS[1], backend=backend)
    meta = second.get_meta_info("answer")
    assert meta["cached_tokens"] >= rows.shape[0], meta  # the system turn and the span, from cache
