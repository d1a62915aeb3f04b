"""The OpenAI-compatible routes with embeddings, through the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest
import torch

from helpers import LOGPROBS, body, chat_as_generate, generate, reference_embeds, seeded_rows, span, to_segments, with_other_spans
from sgl_embeds_protocol import wire
from sgl_embeds_testing import reference as ref



@pytest.fixture(scope="module")
def client(llama_server):
    return openai.OpenAI(base_url=llama_server.url + "/v1", api_key="none", max_retries=0)


def test_completions_with_segments_equal_generate_and_hf(client, llama_server, llama_dir):
    parts = ["the red fox", seeded_rows(1, 6), " near the"]
    segs = to_segments(parts)
    want = generate(llama_server, body(segs, 8, **LOGPROBS))
    ref.assert_matches_hf(want, llama_dir, reference_embeds(llama_dir, parts), 8,
                          other_span_embeds=reference_embeds(llama_dir, with_other_spans(parts)))
    out = client.completions.create(model="default", prompt="", max_tokens=8, temperature=0, extra_body={"input_segments": segs})
    assert out.choices[0].text == want["text"]
    assert out.usage.prompt_tokens == want["meta_info"]["prompt_tokens"] and out.usage.completion_tokens == 8


def test_completions_full_prompt_embeds_equal_generate_and_hf(client, llama_server, llama_dir):
    x = seeded_rows(2, 10)
    enc = wire.encode_tensor(x, "base64", "float32")
    out = client.completions.create(model="default", prompt="", max_tokens=8, temperature=0, extra_body={"input_embeds": enc})
    want = generate(llama_server, {"input_embeds": enc, "sampling_params": {"temperature": 0, "max_new_tokens": 8}, **LOGPROBS})
    ref.assert_matches_hf(want, llama_dir, x, 8, other_span_embeds=seeded_rows(20, 10))
    assert out.choices[0].text == want["text"]


def test_chat_with_span_parts_equals_generate_on_the_rendered_prompt(client, llama_server, llama_dir):
    x = seeded_rows(3, 5)
    messages = [{"role": "system", "content": "you see images"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "input_embeds", "input_embeds": wire.encode_tensor(x)},
                                             {"type": "text", "text": " what is it"}]}]
    out = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,
                                         logprobs=True, extra_body={"return_token_ids": True})
    rendered = ref.hf_tokenizer(str(llama_dir)).apply_chat_template(
        [messages[0], {"role": "user", "content": "look\ue000 what is it"}], tokenize=False, add_generation_prompt=True)
    before, after = rendered.split("\ue000")
    ids = lambda t: {"type": "input_ids", "input_ids": ref.hf_tokenizer(str(llama_dir)).encode(t, add_special_tokens=False)}
    want = generate(llama_server, body([ids(before), span(x), ids(after)], 8))
    tok = ref.hf_tokenizer(str(llama_dir))
    rows = lambda t: ref.embed_ids(llama_dir, tok.encode(t, add_special_tokens=False))
    ref.assert_matches_hf(chat_as_generate(out.model_dump()), llama_dir, torch.cat([rows(before), x, rows(after)]), 8,
                          other_span_embeds=torch.cat([rows(before), seeded_rows(30, 5), rows(after)]))
    assert out.choices[0].response_token_ids == want["output_ids"]
    assert out.choices[0].message.content == want["text"]
    assert out.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]


def test_chat_streaming_n_stop_logprobs_and_cached_usage(client):
    x = seeded_rows(4, 30)
    messages = [{"role": "user", "content": [{"type": "input_embeds", "input_embeds": wire.encode_tensor(x, "base64", "bfloat16")},
                                             {"type": "text", "text": " describe"}]}]
    first = client.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    assert len(first.choices[0].logprobs.content) == 6
    again = client.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 30
    assert again.choices[0].message.content == first.choices[0].message.content
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == first.choices[0].message.content
    many = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=1.0, n=3)
    assert len(many.choices) == 3
    stop = first.choices[0].message.content[2:4]
    stopped = client.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].message.content


def test_chat_full_prompt_input_embeds(client, llama_server, llama_dir):
    x = seeded_rows(5, 8)
    out = client.chat.completions.create(model="default", messages=[], max_tokens=6, temperature=0, logprobs=True,
                                         extra_body={"input_embeds": wire.encode_tensor(x), "return_token_ids": True})
    want = generate(llama_server, {"input_embeds": wire.encode_tensor(x), "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    reference = ref.assert_matches_hf(chat_as_generate(out.model_dump()), llama_dir, x, 6, other_span_embeds=seeded_rows(21, 8))
    assert out.choices[0].message.content == want["text"]
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == len(reference.tokens)


@pytest.mark.parametrize("payload, message", [
    ({"input_embeds": {"data": "AAAA", "dtype": "float32", "shape": [2, 64]}}, "cannot hold shape"),
    ({"input_embeds": [[0.0] * 63]}, "hidden size 63"),
    ({"input_segments": [{"type": "embeds", "embeds": wire.encode_tensor(torch.full((2, 64), float("nan")))}]}, "NaN or Inf"),
])
def test_bad_tensors_raise_bad_request_with_the_message(client, llama_server, payload, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="default", prompt="", max_tokens=2, extra_body=payload)
    bad_part = {"role": "user", "content": [{"type": "input_embeds", "input_embeds": payload.get("input_embeds", {"data": "", "dtype": "int8", "shape": [1, 64]})}]}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=[bad_part], max_tokens=2)
    assert client.completions.create(model="default", prompt="the fox", max_tokens=2).choices[0].text is not None
