"""The id guards without a server: where the first id the embedding table cannot look up stands
(span rows skipped), the scheduler's last guard aborting only the request that holds one, and the
place an id error names (``server/test_fuzz_ids.py`` sends hostile ids to real servers)."""

from __future__ import annotations

from array import array

import pytest
import torch

from sgl_embeds_srt import scheduler, token_ids
from sgl_embeds_srt.placeholders import PLACEHOLDER_BASE
from sgl_embeds_srt.prompt_rows import SpanPromptRows


def test_first_bad_position_skips_span_rows_only():
    assert token_ids.first_bad_position([1, 2, 3], 10) is None
    assert token_ids.first_bad_position([1, -1, 3], 10) == 1
    assert token_ids.first_bad_position([1, PLACEHOLDER_BASE, 3], 10, span_positions=[1]) is None
    assert token_ids.first_bad_position([PLACEHOLDER_BASE, 10, PLACEHOLDER_BASE], 10, span_positions=[0]) == 1
    assert token_ids.first_bad_position([1, 2**64, 3], 10) == 1  # beyond int64


class _FakeReq:
    """Just what the guard reads and writes of SGLang's ``Req``; ``span_positions``: a span
    prompt whose rows stand there (as ``scheduler.req_init`` leaves it)."""

    def __init__(self, ids, span_positions=None):
        self.origin_input_ids, self.vocab_size, self.input_embeds = array("q", ids), 10, None
        self.positional_embed_overrides = (
            None if span_positions is None
            else SpanPromptRows(torch.zeros(len(span_positions), 4), span_positions))
        self.aborted = None

    def set_finish_with_abort(self, message):
        self.aborted = message


def test_the_scheduler_guard_aborts_only_the_bad_request():
    good = _FakeReq([1, PLACEHOLDER_BASE + 1, 3], span_positions=[1])
    assert not scheduler.abort_unlookupable(good) and good.aborted is None
    stray = _FakeReq([1, PLACEHOLDER_BASE + 1, PLACEHOLDER_BASE + 2], span_positions=[1])
    assert scheduler.abort_unlookupable(stray)
    assert "at position 2" in stray.aborted and "without its rows" in stray.aborted
    assert stray.positional_embed_overrides is None
    negative = _FakeReq([1, -4])
    assert scheduler.abort_unlookupable(negative) and "token id -4" in negative.aborted


@pytest.mark.parametrize("ids, where", [([1, 2**63], "input_ids[1]"), ([[1], [0.5]], "input_ids[1][0]"), ("1 2", "input_ids")])
def test_check_id_lists_names_the_place(ids, where):
    with pytest.raises(ValueError, match=where.replace("[", "\\[").replace("]", "\\]")):
        token_ids.check_id_lists(ids, 507, "input_ids")
