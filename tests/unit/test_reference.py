"""The HF comparison rule itself (no model): what ``check_greedy`` forgives and what it does not."""

from __future__ import annotations

import pytest

from sgl_embeds.testing.reference import FORGIVEN, NEAR_TIE, Greedy, check_greedy

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
