"""The draft's verify cost fitted to the verdicts' times (engine/spec/verify_costs.py): it finds a
target's real cost a row from the node counts the answers verify, whatever the profile said, holds the
profile's where the verifications cannot tell, follows a target that changes speed, and a preempted
verification moves it little."""

import itertools

import pytest

from swiftspec.engine.spec.verify_costs import VerifyCostFit

OPTIMISTIC = [1.0 + 0.02 * i for i in range(8)]  # rows nearly free
PESSIMISTIC = [1.0 + 0.3 * i for i in range(8)]


def truth(step: float, row: float) -> list[float]:
    return [step + row * i for i in range(8)]


@pytest.mark.parametrize("profile", [OPTIMISTIC, PESSIMISTIC])
def test_the_fit_finds_the_real_cost_from_small_trees(profile):
    """Verifications of 1-3 nodes only, on a target whose step is 5 ms and whose rows cost 0.6 ms each:
    the fit predicts 8 nodes at 9.2 ms, which the profile (and its 4 ms step) put at 4.6 or 12.4."""
    fit = VerifyCostFit(profile, 4.0)
    real = truth(5.0, 0.6)
    for n in itertools.islice(itertools.cycle([1, 2, 3, 2]), 200):
        fit.observe(n, real[n - 1])
    assert fit.ms(8) == pytest.approx(real[7], rel=0.02)
    assert fit.relative()[7] == pytest.approx(real[7] / real[0], rel=0.02)


def test_one_size_of_tree_keeps_the_profiles_cost_a_row():
    """Where every verification has one node, what a row adds cannot be seen: the profile's cost a row
    (0.3 of its 4 ms step) holds while the step follows the verifications."""
    fit = VerifyCostFit(PESSIMISTIC, 4.0)
    for _ in range(200):
        fit.observe(1, 6.0)
    assert fit.a == pytest.approx(6.0, rel=0.01)
    assert fit.b == pytest.approx(1.2, rel=0.01)


def test_the_fit_follows_a_target_that_changes_speed():
    """The recent verifications weigh most: rows that get twice as dear are seen within ~150 verdicts."""
    fit = VerifyCostFit(OPTIMISTIC, 5.0)
    sizes = itertools.cycle([1, 2, 4, 3])
    before, after = truth(5.0, 0.4), truth(5.0, 0.8)
    for n in itertools.islice(sizes, 300):
        fit.observe(n, before[n - 1])
    assert fit.ms(8) == pytest.approx(before[7], rel=0.02)
    for n in itertools.islice(sizes, 150):
        fit.observe(n, after[n - 1])
    assert fit.ms(8) == pytest.approx(after[7], rel=0.03)


def test_a_preempted_verification_moves_the_fit_little():
    fit = VerifyCostFit(PESSIMISTIC, 5.0)
    real = truth(5.0, 0.5)
    for n in itertools.islice(itertools.cycle([1, 2, 3]), 150):
        fit.observe(n, real[n - 1])
    settled = fit.ms(8)
    fit.observe(2, 500.0)  # a verification that waited 0.5 s for a core
    assert fit.ms(8) < 1.1 * settled
