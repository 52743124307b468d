"""tests/numerics.py's 2x rule itself: it must be able to fail (issue 51: a non-finite eager error made its bound
inf, and then anything passed, NaN included)."""

import pytest
import torch

from numerics import assert_no_worse_than_eager, assert_within_rule


def _case():
    torch.manual_seed(0)
    ref = torch.randn(64, dtype=torch.float64)
    eager = (ref + 1e-4 * torch.randn(64, dtype=torch.float64)).float()
    return ref, eager


def test_the_rule_passes_a_result_as_close_as_eager_and_fails_a_far_one():
    ref, eager = _case()
    assert_no_worse_than_eager(eager.clone(), eager, ref, "same as eager")
    with pytest.raises(AssertionError, match="fused error"):
        assert_no_worse_than_eager(eager + 1e-2, eager, ref, "far")


@pytest.mark.parametrize("where", ["eager inf", "eager NaN", "reference inf", "reference NaN"])
def test_a_non_finite_eager_or_reference_fails_instead_of_passing_anything(where):
    """A fused NaN against an eager that overflowed: the bound 2·inf + eps used to pass it. It must fail, saying why
    (special values are compared by the NaN rule, tests/special_values.py)."""
    ref, eager = _case()
    fused = torch.full_like(eager, float("nan"))
    what, value = where.split()
    if what == "eager":
        eager[3] = float(value)
    else:
        ref[3] = float(value)
    with pytest.raises(AssertionError, match="not finite"):
        assert_no_worse_than_eager(fused, eager, ref, where)
    with pytest.raises(AssertionError, match="not finite"):  # even a finite fused result: the rule cannot measure it
        assert_no_worse_than_eager(eager.nan_to_num(0.0, 0.0, 0.0), eager, ref, where)


def test_the_rule_on_measured_errors_refuses_an_infinite_eager_error():
    assert_within_rule(1e-3, 1e-3, 1e-6)
    with pytest.raises(AssertionError, match="fused error"):
        assert_within_rule(1e-2, 1e-3, 1e-6)
    for e_eager in (float("inf"), float("nan")):
        with pytest.raises(AssertionError, match="eager's error"):
            assert_within_rule(float("nan"), e_eager, 1e-6)
