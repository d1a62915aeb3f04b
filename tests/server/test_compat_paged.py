"""Spans with a paged radix cache (``--page-size 16`` and ``4``): span prompts hit the cache in
whole pages, a different span never hits past the shared text, and outputs equal the
page-size-1 server's."""

from __future__ import annotations

import pytest

from helpers import body, generate, seeded_rows, span, text
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.server import Server, start_all, stop_all

pytestmark = pytest.mark.server
A = "the red fox near the house and the small dog"
B = " describe it"


PAGE_SIZES = (16, 4)


@pytest.fixture(scope="module")
def paged_servers(llama_dir, servers):
    """A server per page size, started together."""
    servers.make_room(len(PAGE_SIZES))
    servers = start_all([Server(llama_dir, extra_args=["--page-size", str(page), "--enable-cache-report"]) for page in PAGE_SIZES])
    yield dict(zip(PAGE_SIZES, servers))
    stop_all(servers)


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_span_prompts_hit_in_whole_pages_and_equal_page_size_one(page, paged_servers, llama_server, llama_dir):
    paged_server = paged_servers[page]
    n_a = len(ref.hf_tokenizer(str(llama_dir)).encode(A))
    E, F = seeded_rows(600 + page, 40), seeded_rows(700 + page, 40)
    prompt = [text(A), span(E), text(B)]
    first = generate(paged_server, body(prompt, 10))
    again = generate(paged_server, body(prompt, 10))
    total = again["meta_info"]["prompt_tokens"]
    cached = again["meta_info"]["cached_tokens"]
    assert cached % page == 0 and cached == (total - 1) // page * page, (page, total, cached)
    assert again["output_ids"] == first["output_ids"] == generate(llama_server, body(prompt, 10))["output_ids"]
    other = generate(paged_server, body([text(A), span(F), text(B)], 10))
    assert other["meta_info"]["cached_tokens"] == n_a // page * page  # whole pages of A, nothing of the span
    assert other["output_ids"] == generate(llama_server, body([text(A), span(F), text(B)], 10))["output_ids"]
    assert other["output_ids"] != first["output_ids"]
