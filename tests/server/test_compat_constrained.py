"""Spans together with constrained decoding (SGLang's grammar backend, xgrammar by default):
regex, JSON schema and EBNF on ``/generate``, ``sgl.gen(regex=...)`` in programs, and OpenAI
``response_format``. The output satisfies the constraint, and equals the same prompt with the
span replaced by the model's own token ids for the same rows (constraint included): a span is
constrained exactly as text is."""

from __future__ import annotations

import json
import re

import openai
import pytest
import sglang as sgl

from helpers import generate, span, text
from sgl_embeds import EmbedsEndpoint
from sgl_embeds_testing import reference as ref

pytestmark = pytest.mark.server
WORDS = " the red fox near the blue house"
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue", "green"]}, "size": {"enum": ["small", "large"]}},
          "required": ["color", "size"], "additionalProperties": False}
CONSTRAINTS = {
    "regex": ("(yes|no), the [a-z]+ [a-z]+", lambda out: re.fullmatch("(yes|no), the [a-z]+ [a-z]+", out)),
    "json_schema": (json.dumps(SCHEMA), lambda out: set(json.loads(out)) == {"color", "size"}),
    "ebnf": ('root ::= "the answer is " ("red" | "blue" | "green") "."', lambda out: out in {f"the answer is {c}." for c in ("red", "blue", "green")}),
}


OTHER_WORDS = " a green tree under the white sky"


def _as_span_and_as_ids(llama_dir, words: str = WORDS):
    ids = ref.hf_tokenizer(str(llama_dir)).encode(words, add_special_tokens=False)
    as_span = [text("look:"), span(ref.embed_ids(llama_dir, ids)), text(" answer")]
    as_ids = [text("look:"), {"type": "input_ids", "input_ids": ids}, text(" answer")]
    return as_span, as_ids


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_generate_with_a_span_satisfies_the_constraint_like_the_same_ids(llama_server, llama_dir, kind):
    """Equal to the same rows as ids by tokens and by numbers (the constrained output space may be
    a handful of strings, so another span is shown to change the numbers, not only the text)."""
    constraint, satisfied = CONSTRAINTS[kind]
    as_span, as_ids = _as_span_and_as_ids(llama_dir)
    sp = {"temperature": 0, "max_new_tokens": 96, kind: constraint}
    with_span = generate(llama_server, {"input_segments": as_span, "sampling_params": sp, "return_logprob": True})
    with_ids = generate(llama_server, {"input_segments": as_ids, "sampling_params": sp, "return_logprob": True})
    assert satisfied(with_span["text"]), with_span["text"]
    assert with_span["output_ids"] == with_ids["output_ids"]
    assert max(abs(a - b) for a, b in zip(_logprobs(with_span), _logprobs(with_ids))) <= ref.LOGPROB_TOL
    other = generate(llama_server, {"input_segments": _as_span_and_as_ids(llama_dir, OTHER_WORDS)[0],
                                    "sampling_params": sp, "return_logprob": True})
    assert satisfied(other["text"]), other["text"]
    assert max(abs(a - b) for a, b in zip(_logprobs(other), _logprobs(with_span))) > 100 * ref.LOGPROB_TOL or \
        other["output_ids"] != with_span["output_ids"], "another span must change the constrained answer's numbers"
    unconstrained = generate(llama_server, {"input_segments": as_span, "sampling_params": {"temperature": 0, "max_new_tokens": 96}})
    assert unconstrained["text"] != with_span["text"]  # the constraint did something


def test_program_gen_with_regex_and_a_span(llama_server, llama_dir):
    """The span is the words' own embedding rows, so the program answers as the same prompt with
    the words' ids does, by tokens and by numbers; a program with another span gets other numbers."""
    backend = EmbedsEndpoint(llama_server.url)
    regex = CONSTRAINTS["regex"][0]
    tok = ref.hf_tokenizer(str(llama_dir))

    @sgl.function
    def answer(s, rows):
        s += "look:" + sgl.embeds(rows) + " answer"
        s += sgl.gen("out", max_tokens=20, temperature=0, regex=regex, return_logprob=True)

    def program_logprobs(state) -> list[float]:
        return [lp for lp, _, _ in state.get_meta_info("out")["output_token_logprobs"]]

    state = answer.run(rows=ref.embed_ids(llama_dir, tok.encode(WORDS, add_special_tokens=False)), backend=backend)
    assert CONSTRAINTS["regex"][1](state["out"]), state["out"]
    with_ids = generate(llama_server, {"input_segments": _as_span_and_as_ids(llama_dir)[1], "return_logprob": True,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 20, "regex": regex}})
    assert state["out"] == with_ids["text"]
    ours = program_logprobs(state)
    assert len(ours) == len(_logprobs(with_ids))
    assert max(abs(a - b) for a, b in zip(ours, _logprobs(with_ids))) <= ref.LOGPROB_TOL
    other = answer.run(rows=ref.embed_ids(llama_dir, tok.encode(OTHER_WORDS, add_special_tokens=False)), backend=backend)
    assert CONSTRAINTS["regex"][1](other["out"]), other["out"]
    assert max(abs(a - b) for a, b in zip(ours, program_logprobs(other))) > ref.LOGPROB_TOL, \
        "another span must change the program's numbers"


def test_openai_response_format_with_span_parts(llama_server, llama_dir):
    from sgl_embeds_protocol import wire

    client = openai.OpenAI(base_url=llama_server.url + "/v1", api_key="none", max_retries=0)
    rows = ref.embed_ids(llama_dir, ref.hf_tokenizer(str(llama_dir)).encode(WORDS, add_special_tokens=False))
    def ask(second_part: dict):
        return client.chat.completions.create(
            model="default", max_tokens=96, temperature=0, logprobs=True, extra_body={"return_token_ids": True},
            messages=[{"role": "user", "content": [{"type": "text", "text": "look:"}, second_part]}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})

    tok = ref.hf_tokenizer(str(llama_dir))
    out = ask({"type": "input_embeds", "input_embeds": wire.encode_tensor(rows)})
    other = ask({"type": "input_embeds", "input_embeds": wire.encode_tensor(
        ref.embed_ids(llama_dir, tok.encode(OTHER_WORDS, add_special_tokens=False)))})
    assert set(json.loads(out.choices[0].message.content)) == {"color", "size"}, out.choices[0].message.content
    # the same rendered prompt with the words' ids where the span stands, constrained alike
    before, after = tok.apply_chat_template([{"role": "user", "content": "look:\ue000"}], tokenize=False,
                                            add_generation_prompt=True).split("\ue000")
    ids = lambda t: {"type": "input_ids", "input_ids": tok.encode(t, add_special_tokens=False)}
    as_ids = generate(llama_server, {"input_segments": [ids(before), ids(WORDS), ids(after)], "return_logprob": True,
                                     "sampling_params": {"temperature": 0, "max_new_tokens": 96,
                                                         "json_schema": json.dumps(SCHEMA)}})
    assert out.choices[0].response_token_ids == as_ids["output_ids"]
    numbers = [[e.logprob for e in r.choices[0].logprobs.content] for r in (out, other)]
    assert max(abs(a - b) for a, b in zip(numbers[0], _logprobs(as_ids))) <= ref.LOGPROB_TOL
    assert max(abs(a - b) for a, b in zip(numbers[1], numbers[0])) > 100 * ref.LOGPROB_TOL or \
        other.choices[0].response_token_ids != out.choices[0].response_token_ids, "the span must matter"
