"""The HF comparison rule itself (no model): what ``check_greedy`` forgives and what it does not,
how a response's logprobs are read (lengths, token ids, top-k sizes, every text position's input
logprob) and what counts as a degenerate reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.reference import FORGIVEN, NEAR_TIE, Greedy, check_greedy

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

TIE, CLEAR = NEAR_TIE / 10, 1.0


def _scripted(continuations: dict[tuple, Greedy]):
    """HF's continuation after each prefix, as a test writes it down."""
    return lambda prefix: continuations[tuple(prefix)]


def test_identical_sequences_forgive_nothing():
    hf = _scripted({(): Greedy([5, 6, 7], [1, 1, 1], [CLEAR] * 3)})
    assert check_greedy([5, 6, 7], hf) == 0


def test_a_runner_up_at_a_near_tie_is_forgiven_once_and_the_rest_is_still_compared():
    hf = _scripted({(): Greedy([5, 6, 7, 8], [1, 9, 1, 1], [CLEAR, TIE, CLEAR, CLEAR]),
                    (5, 9): Greedy([3, 4], [1, 1], [CLEAR, CLEAR])})
    assert check_greedy([5, 9, 3, 4], hf) == 1
    FORGIVEN.clear()  # a second, independent comparison in this test (the per-test limit is one)
    with pytest.raises(AssertionError, match="token 3 differs"):  # after the tie, a clear miss still fails
        check_greedy([5, 9, 3, 0], hf)


@pytest.mark.parametrize("ours, hf, why", [
    ([5, 2, 7], Greedy([5, 6, 7], [1, 9, 1], [CLEAR, TIE, CLEAR]), "not HF's runner-up"),
    ([5, 9, 7], Greedy([5, 6, 7], [1, 9, 1], [CLEAR, CLEAR, CLEAR]), "not a near-tie"),
    ([9, 6, 7], Greedy([5, 6, 7], [9, 1, 1], [TIE, CLEAR, CLEAR]), "the first token"),
])
def test_other_divergences_fail(ours, hf, why):
    with pytest.raises(AssertionError, match="differs"):
        check_greedy(ours, _scripted({(): hf}))


def test_a_second_forgiveness_fails():
    hf = _scripted({(): Greedy([5, 6, 7], [1, 9, 1], [CLEAR, TIE, CLEAR]),
                    (5, 9): Greedy([7, 8], [2, 1], [TIE, CLEAR])})
    with pytest.raises(AssertionError, match="forgiven so far 1"):
        check_greedy([5, 9, 2, 8], hf)


def test_different_lengths_fail():
    hf = _scripted({(): Greedy([5, 6], [1, 1], [CLEAR, CLEAR])})
    with pytest.raises(AssertionError, match="HF stopped"):
        check_greedy([5, 6, 7], hf)
    with pytest.raises(AssertionError, match="we stopped"):
        check_greedy([5], hf)


def test_the_per_test_count_sees_forgiveness_across_sequences():
    hf = _scripted({(): Greedy([5, 6], [1, 9], [CLEAR, TIE]), (5, 9): Greedy([], [], [])})
    check_greedy([5, 9], hf, "first: ")
    check_greedy([5, 9], hf, "second: ")
    assert FORGIVEN == ["first: token 1", "second: token 1"]  # the conftest fixture would fail this test ...
    FORGIVEN.clear()  # ... so it is reset here, after the check


EOS = 2


@pytest.mark.parametrize("ours", [[5], [5, EOS]], ids=["end token not listed", "end token listed"])
def test_our_run_ending_where_the_end_token_is_hfs_runner_up_is_one_near_tie(ours):
    hf = _scripted({(): Greedy([5, 6, 7], [1, EOS, 1], [CLEAR, TIE, CLEAR])})
    assert check_greedy(ours, hf, eos_ids={EOS}) == 1
    assert FORGIVEN == ["token 1"]
    FORGIVEN.clear()


@pytest.mark.parametrize("ours, hf, why", [
    ([5], Greedy([5, 6, 7], [1, EOS, 1], [CLEAR, CLEAR, CLEAR]), "not a near-tie"),
    ([5], Greedy([5, 6, 7], [1, 9, 1], [CLEAR, TIE, CLEAR]), "the runner-up is not an end token"),
    ([], Greedy([5, 6, 7], [EOS, 1, 1], [TIE, CLEAR, CLEAR]), "the first token"),
    ([5, EOS], Greedy([5, 6, 7], [1, 9, 1], [CLEAR, TIE, CLEAR]), "the listed end token is not the runner-up"),
])
def test_other_early_ends_fail(ours, hf, why):
    with pytest.raises(AssertionError, match="differs"):
        check_greedy(ours, _scripted({(): hf}), eos_ids={EOS})


# -- reading a response's logprobs --------------------------------------------------------------

VOCAB = 8


def _hf(tokens: list[int]) -> Greedy:
    """HF's reference over a vocabulary of ``VOCAB``: each step's token clearly first."""
    distributions = []
    for t in tokens:
        logits = torch.zeros(VOCAB, dtype=torch.float64)
        logits[t], logits[(t + 1) % VOCAB], logits[(t + 2) % VOCAB] = 3.0, 2.0, 1.0
        distributions.append(logits.log_softmax(-1))
    return Greedy(tokens, [(t + 1) % VOCAB for t in tokens], [CLEAR] * len(tokens),
                  [float(d[t]) for d, t in zip(distributions, tokens)], distributions)


def _response(reference: Greedy, top_k: int = ref.TOP_K) -> dict:
    """A ``/generate`` response that says what ``reference`` says, as SGLang writes it."""
    steps = list(zip(reference.tokens, reference.distributions))
    return {"output_ids": list(reference.tokens), "meta_info": {
        "output_token_logprobs": [(float(d[t]), t, None) for t, d in steps],
        "output_top_logprobs": [[(float(d[k]), int(k), None) for k in d.topk(top_k).indices] for _, d in steps]}}


def test_a_response_that_says_what_hf_says_passes():
    reference = _hf([5, 6, 7])
    assert ref.assert_response_logprobs(_response(reference), reference) == 3


def _shorter_list(out: dict) -> None:
    out["meta_info"]["output_token_logprobs"].pop()


def _another_token(out: dict) -> None:
    lp, _, text = out["meta_info"]["output_token_logprobs"][1]
    out["meta_info"]["output_token_logprobs"][1] = (lp, 0, text)


def _fewer_maps(out: dict) -> None:
    out["meta_info"]["output_top_logprobs"].pop()


@pytest.mark.parametrize("damage, message", [
    (_shorter_list, "2 logprobs for 3 tokens"),
    (_another_token, "name tokens"),
    (_fewer_maps, "2 top-k maps for 3 tokens"),
])
def test_a_response_missing_part_of_its_logprobs_fails(damage, message):
    reference = _hf([5, 6, 7])
    out = _response(reference)
    damage(out)
    with pytest.raises(AssertionError, match=message):
        ref.assert_response_logprobs(out, reference)


def test_top_1_maps_where_top_3_were_asked_fail():
    reference = _hf([5, 6, 7])
    with pytest.raises(AssertionError, match="3 asked"):
        ref.assert_response_logprobs(_response(reference, top_k=1), reference)
    assert ref.assert_response_logprobs(_response(reference, top_k=1), reference, top_k=1) == 3


class _TinyLM(torch.nn.Module):
    """Stands in for HF's model in ``assert_input_logprobs``: an embedding table, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB, 4), torch.nn.Linear(4, VOCAB)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def forward(self, inputs_embeds: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(inputs_embeds))


@pytest.fixture
def tiny_lm(monkeypatch) -> _TinyLM:
    model = _TinyLM().eval()
    monkeypatch.setattr(ref, "hf_model", lambda model_dir, dtype=torch.float32: model)
    return model


PROMPT = [1, 2, None, None, 3, 4]  # token ids, None: a span row


def _prompt_and_entries(model: _TinyLM) -> tuple[torch.Tensor, list]:
    """The prompt's rows (a two-row span between tokens) and its input logprob entries as the
    server writes them from position 0."""
    with torch.no_grad():
        span = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        rows = torch.cat([model.embed.weight[[1, 2]], span, model.embed.weight[[3, 4]]])
        distributions = model.head(rows).double().log_softmax(-1)
    entries = [[None, None, None] if t is None else [None if i == 0 else float(distributions[i - 1][t]), t, None]
               for i, t in enumerate(PROMPT)]
    return rows, entries


def _input_logprobs(entries: list) -> dict:
    return {"meta_info": {"input_token_logprobs": entries}}


def test_input_logprobs_are_compared_at_every_text_position(tiny_lm):
    rows, entries = _prompt_and_entries(tiny_lm)
    assert ref.assert_input_logprobs(_input_logprobs(entries), "tiny", rows) == 3
    assert ref.assert_input_logprobs(_input_logprobs(entries[3:]), "tiny", rows, logprob_start_len=3) == 2


def _nulled_text(entries: list) -> None:
    entries[4] = [None, None, None]


def _other_token(entries: list) -> None:
    entries[5][1] = 5


def _shorter(entries: list) -> None:
    entries.pop()


@pytest.mark.parametrize("damage, message", [
    (_nulled_text, "a null entry .* at a text position"),
    (_other_token, "entry of token 5, not this row's"),
    (_shorter, "5 input logprobs from position 0 of 6"),
])
def test_input_logprobs_missing_or_misplaced_fail(tiny_lm, damage, message):
    rows, entries = _prompt_and_entries(tiny_lm)
    damage(entries)
    with pytest.raises(AssertionError, match=message):
        ref.assert_input_logprobs(_input_logprobs(entries), "tiny", rows)


def test_input_logprobs_from_another_start_fail(tiny_lm):
    """Entries from position 0 read as from position 2 fail on their count; entries from position
    1 whose span rows were nulled as if they started at 0 (one place off: a span row's entry names
    the id placeholders are clamped to, 0, and a text position is null) fail on their places."""
    rows, entries = _prompt_and_entries(tiny_lm)
    with pytest.raises(AssertionError, match="6 input logprobs from position 2 of 6"):
        ref.assert_input_logprobs(_input_logprobs(entries), "tiny", rows, logprob_start_len=2)
    shifted = entries[1:]
    shifted[1], shifted[3] = [-1.0, 0, None], [None, None, None]
    with pytest.raises(AssertionError, match="input position 2: entry of token 0, not this row's"):
        ref.assert_input_logprobs(_input_logprobs(shifted), "tiny", rows, logprob_start_len=1)


@pytest.fixture
def scripted_hf(monkeypatch):
    """HF's greedy continuation by prompt: ``SPAN`` or ``OTHER`` rows as the whole prompt."""
    answers: dict[int, list[int]] = {}
    monkeypatch.setattr(ref, "greedy_after", lambda _dir, rows, _n, prefix=(), dtype=None, blocks=(): Greedy(
        answers[int(rows[0, 0])][len(prefix):], [0] * 8, [CLEAR] * 8))
    monkeypatch.setattr(ref, "hf_model", lambda *_: SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=None)))
    return answers


SPAN, OTHER = torch.zeros(2, 4), torch.ones(2, 4)


@pytest.mark.parametrize("tokens, other, passes", [
    ([5, 6, 7, 5], None, True),  # 3 distinct tokens
    ([5, 6, 5, 6], None, False),  # 2
    ([5, 6, 5, 6], [6, 5, 6, 5], True),  # 2, but the span changes them
    ([5, 5, 5, 5], [6, 6, 6, 6], True),
    ([5, 6, 7, 5], [5, 6, 7, 5], False),  # the span changes nothing
])
def test_a_reference_is_degenerate_unless_3_distinct_tokens_or_the_span_changes_it(
        scripted_hf, tokens, other, passes):
    scripted_hf[0] = tokens
    if other is not None:
        scripted_hf[1] = other
    other_span = None if other is None else OTHER
    if passes:
        ref.assert_matches_hf(tokens, "tiny", SPAN, 4, other_span_embeds=other_span)
    else:
        with pytest.raises(AssertionError, match="degenerate|does not change"):
            ref.assert_matches_hf(tokens, "tiny", SPAN, 4, other_span_embeds=other_span)
