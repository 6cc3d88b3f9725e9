"""Max / min reductions that keep a 1-bit mask of the extremal elements: result and gradient bit-identical to
autograd's (ties and NaN included), one bit per input element saved, bad dims named."""

from __future__ import annotations

import pytest
import torch

from act_hf.context import track_saved
from act_hf.errors import ActHFValueError
from act_hf.ops.extremum import act_extremum


def _input(dtype=torch.float32):
    """Values with ties: a ReLU zeroes about half of them, and the rest are rounded to a coarse grid."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 6, 8, 5, generator=g) * 2).round().clamp_min(0).to(dtype)


def _both(fn_ref, fn_op, x, grad_seed=1):
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = fn_ref(a), fn_op(b)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=x.dtype)
    ref.backward(g)
    out.backward(g)
    return ref, out, a.grad, b.grad


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dim,keepdim", [(-1, False), (1, True), ((0, 2), False), ((3, 1), True), ((), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_amax_amin_bit_identical_with_ties(largest, dim, keepdim, dtype):
    reduce = torch.amax if largest else torch.amin
    x = _input(dtype) * (1 if largest else -1)
    ref, out, g_ref, g_op = _both(lambda t: reduce(t, dim, keepdim),
                                  lambda t: act_extremum(t, largest=largest, dim=dim, keepdim=keepdim), x)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(g_op, g_ref)
    assert (g_ref != 0).sum() > g_ref.numel() // 100 or dim == ()  # ties split the gradient: it is not trivial


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("with_nan", [False, True])
def test_whole_tensor_max_min_bit_identical_with_ties_and_nan(largest, with_nan):
    x = _input()
    if with_nan:
        x[1, 2, 3, 4] = float("nan")
        x[0, 0, 0, 0] = float("nan")
    ref, out, g_ref, g_op = _both(lambda t: t.max() if largest else t.min(),
                                  lambda t: act_extremum(t, largest=largest), x)
    assert torch.equal(out, ref) or (with_nan and out.isnan() and ref.isnan())
    assert torch.equal(g_op, g_ref)


def test_a_slice_with_nan_has_autograds_nan_gradient():
    x = _input()
    x[0, 0, 0, 0] = float("nan")
    ref, out, g_ref, g_op = _both(lambda t: torch.amax(t, -1), lambda t: act_extremum(t, largest=True, dim=-1), x)
    assert torch.equal(out.nan_to_num(), ref.nan_to_num()) and torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(g_op.isnan(), g_ref.isnan()) and g_op[0, 0, 0].isnan().all()  # the slice's
    assert torch.equal(g_op.nan_to_num(), g_ref.nan_to_num())


def test_saves_one_bit_per_element():
    x = _input().requires_grad_()
    with track_saved() as saved:
        act_extremum(x, largest=True, dim=(1, 2), slot="m:pool")
    assert saved.by_slot == {"m:pool": x.numel() // 8}
    assert saved.uncompressed_bytes == 2 * x.numel() * 4  # autograd's input and (broadcast) result


def test_without_grad_it_is_the_original_and_bad_dims_are_named():
    x = _input()
    assert torch.equal(act_extremum(x, largest=False, dim=2), torch.amin(x, 2))
    assert act_extremum(x, largest=True).grad_fn is None
    x.requires_grad_()
    with pytest.raises(ActHFValueError, match="dim must be ints"):
        act_extremum(x, largest=True, dim=4)
    with pytest.raises(ActHFValueError, match="must not repeat"):
        act_extremum(x, largest=True, dim=(1, -3))
