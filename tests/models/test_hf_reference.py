"""The rule the GPU server tests hold our greedy tokens to against HF's (`matches_greedy`)."""

from tests.models.hf_reference import NEAR_TIE, Greedy, matches_greedy

REF = Greedy([5, 6, 7, 8], runner_up=[1, 2, 3, 4], gap=[0.5, NEAR_TIE / 4, 0.5, 0.5])


def test_exact_means_token_for_token() -> None:
    assert matches_greedy([5, 6, 7, 8], REF, exact=True)
    assert not matches_greedy([5, 2, 9, 9], REF, exact=True)


def test_a_tie_broken_for_the_runner_up_ends_the_comparison() -> None:
    assert matches_greedy([5, 6, 7, 8], REF, exact=False)
    assert matches_greedy([5, 2, 9, 9], REF, exact=False)  # step 1 was a tie: what follows answers another prefix


def test_anything_else_differs() -> None:
    assert not matches_greedy([5, 6, 3, 8], REF, exact=False)  # step 2 was no tie
    assert not matches_greedy([5, 9, 7, 8], REF, exact=False)  # a tie, but not broken for the runner-up
    assert not matches_greedy([5, 6, 7], REF, exact=False)
