"""Each divergence on small distributions computed by hand."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive.distill.divergences import (
    DIVERGENCES,
    divergence,
    forward_kl,
    greedy_agreement,
    jsd,
    reverse_kl,
    sampling_acceptance,
    tvd,
)

P = torch.tensor([0.5, 0.5]).log()
Q = torch.tensor([0.25, 0.75]).log()


def test_forward_kl_by_hand():
    # 0.5 log(0.5/0.25) + 0.5 log(0.5/0.75)
    assert float(forward_kl(P, Q)) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)


def test_reverse_kl_by_hand():
    # 0.25 log(0.25/0.5) + 0.75 log(0.75/0.5)
    assert float(reverse_kl(P, Q)) == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-6)


def test_jsd_by_hand():
    # beta = 0.5: m = [0.375, 0.625]
    kl_pm = 0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)
    kl_qm = 0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625)
    assert float(jsd(P, Q, 0.5)) == pytest.approx(0.5 * kl_pm + 0.5 * kl_qm, abs=1e-6)
    # beta = 0.2: m = 0.2 p + 0.8 q = [0.3, 0.7]
    kl_pm = 0.5 * math.log(0.5 / 0.3) + 0.5 * math.log(0.5 / 0.7)
    kl_qm = 0.25 * math.log(0.25 / 0.3) + 0.75 * math.log(0.75 / 0.7)
    assert float(jsd(P, Q, 0.2)) == pytest.approx(0.2 * kl_pm + 0.8 * kl_qm, abs=1e-6)


def test_tvd_and_acceptance_by_hand():
    assert float(tvd(P, Q)) == pytest.approx(0.25)
    assert float(sampling_acceptance(P, Q)) == pytest.approx(0.75)  # min(.5,.25) + min(.5,.75)


def test_zero_probabilities():
    # p puts no mass on token 2: its term vanishes in KL(p||q); q = p on the rest
    p = torch.tensor([0.5, 0.5, 0.0]).log()
    q = torch.tensor([0.25, 0.25, 0.5]).log()
    assert float(forward_kl(p, q)) == pytest.approx(math.log(2), abs=1e-6)
    assert float(tvd(p, q)) == pytest.approx(0.5)
    assert math.isinf(float(reverse_kl(p, q)))  # q has mass where p has none


def test_greedy_agreement_rows():
    p = torch.tensor([[0.6, 0.4], [0.1, 0.9]]).log()
    q = torch.tensor([[0.7, 0.3], [0.8, 0.2]]).log()
    assert greedy_agreement(p, q).tolist() == [1.0, 0.0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=3, max_size=3), st.lists(st.floats(-5, 5), min_size=3, max_size=3))
def test_every_divergence_is_zero_at_p_equal_q_and_positive_otherwise(a, b):
    lp = torch.log_softmax(torch.tensor(a, dtype=torch.float64), -1)
    lq = torch.log_softmax(torch.tensor(b, dtype=torch.float64), -1)
    for name in DIVERGENCES:
        assert abs(float(divergence(name, lp, lp))) < 1e-9
        assert float(divergence(name, lp, lq)) >= -1e-9
    assert float(sampling_acceptance(lp, lq)) == pytest.approx(1 - float(tvd(lp, lq)), abs=1e-9)


def test_bad_names_and_betas():
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence("kl", P, Q)
    with pytest.raises(ValueError, match="beta"):
        jsd(P, Q, 1.0)
