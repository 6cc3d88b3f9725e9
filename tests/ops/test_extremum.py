"""Max / min reductions that keep a 1-bit mask of the extremal elements, reductions over an index that keep the index
at a few bits, elementwise maximum / minimum that keep a 2-bit comparison code, clamps that keep a 1-bit mask:
results and gradients bit-identical to autograd's (ties, NaN, broadcasting and mixed dtypes included), their bits
per element saved, bad arguments named."""

from __future__ import annotations

import pytest
import torch

from act_hf.context import track_saved
from act_hf.errors import ActHFValueError
from act_hf.ops.extremum import (
    MAX_INDEXED_SIZE,
    act_clamp,
    act_elementwise_extremum,
    act_extremum,
    act_indexed_extremum,
    passes_at_bound,
)


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


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dim,keepdim", [(-1, False), (1, True), (0, False), (2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_max_min_over_a_dim_bit_identical_with_ties_and_nan(largest, dim, keepdim, dtype):
    """Values, indices and the gradient (all of it to the returned index, ties and NaN included) are torch's."""
    reduce = torch.max if largest else torch.min
    x = _input(dtype) * (1 if largest else -1)
    x[1, 2, 3, 4] = float("nan")
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = reduce(a, dim, keepdim), act_indexed_extremum(b, dim, keepdim, largest=largest)
    assert type(out) is type(ref) and torch.equal(out.indices, ref.indices)
    assert torch.equal(out.values.isnan(), ref.values.isnan())
    assert torch.equal(out.values.nan_to_num(), ref.values.nan_to_num())
    g = torch.randn(ref.values.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ref.values.backward(g)
    out.values.backward(g)
    assert torch.equal(b.grad, a.grad)


def test_max_over_a_dim_saves_its_indices_at_a_few_bits():
    x = _input().requires_grad_()  # the reduced dim has 6 positions: 3 bits an index
    with track_saved() as saved:
        act_indexed_extremum(x, 1, largest=True, slot="m:pool")
    indices = x.numel() // 6
    assert saved.by_slot == {"m:pool": -(-indices * 3 // 8)}
    assert saved.uncompressed_bytes == indices * 8  # autograd's int64 indices


def test_max_over_a_long_dim_or_without_grad_is_the_original_and_bad_dims_are_named():
    x = torch.randn(2, MAX_INDEXED_SIZE + 1, requires_grad=True)
    out = act_indexed_extremum(x, 1, largest=True)
    assert type(out.values.grad_fn).__name__ == "MaxBackward0"  # indices past a byte: torch's own
    y = _input()
    assert torch.equal(act_indexed_extremum(y, 2, largest=False).values, torch.min(y, 2).values)
    with pytest.raises(ActHFValueError, match="dim must be an int"):
        act_indexed_extremum(y.requires_grad_(), (1, 2), largest=True)
    with pytest.raises(ActHFValueError, match="dim must be an int"):
        act_indexed_extremum(y, 4, largest=True)


def _operands(dtype):
    """``a`` (4 x 5 x 6) and ``b`` (5 x 1, broadcast) on one coarse grid, so many elements tie; a NaN in each."""
    g = torch.Generator().manual_seed(2)
    a, b = ((torch.randn(*shape, generator=g) * 2).round().to(dtype) for shape in ((4, 5, 6), (5, 1)))
    a[0, 0, 0], b[1, 0] = float("nan"), float("nan")
    return a, b


def _step(fn, tensors, needs_grad):
    leaves = [t.clone().requires_grad_(r) for t, r in zip(tensors, needs_grad)]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype))
    return out, [t.grad for t in leaves]


def _assert_same(ref, got):
    (out_ref, grads_ref), (out, grads) = ref, got
    assert out.dtype == out_ref.dtype and torch.equal(out.isnan(), out_ref.isnan())
    assert torch.equal(out.nan_to_num(), out_ref.nan_to_num())
    for g_ref, g in zip(grads_ref, grads):
        assert (g is None) == (g_ref is None)
        if g is not None:
            assert g.dtype == g_ref.dtype and g.shape == g_ref.shape
            assert torch.equal(g.isnan(), g_ref.isnan()) and torch.equal(g.nan_to_num(), g_ref.nan_to_num())


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("needs_grad", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float64)])
def test_elementwise_maximum_minimum_bit_identical_with_ties_nan_and_broadcasting(largest, needs_grad, dtypes):
    a, b = _operands(dtypes[0])
    b = b.to(dtypes[1])
    ref = torch.maximum if largest else torch.minimum
    expected = _step(ref, (a, b), needs_grad)
    got = _step(lambda x, y: act_elementwise_extremum(x, y, largest=largest), (a, b), needs_grad)
    _assert_same(expected, got)
    grad_a = expected[1][0]
    if grad_a is not None:  # ties split the gradient and the other operand's wins zero it: not a trivial case
        assert (grad_a == 0).any() and ((grad_a != 0) & (grad_a.abs() < 10)).any()


def test_elementwise_extremum_with_a_zero_dim_constant_as_xielu_takes_it():
    x = _operands(torch.bfloat16)[0]
    eps = torch.tensor(-1.0, dtype=torch.bfloat16)
    _assert_same(_step(torch.min, (x, eps), (True, False)),
                 _step(lambda t, e: act_elementwise_extremum(t, e, largest=False), (x, eps), (True, False)))


@pytest.mark.parametrize("bounds", [(-1, 1), (-1.0, None), (None, 1), (0.0, 0.0), (2, -2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamp_with_numeric_bounds_bit_identical_at_the_bounds(bounds, dtype):
    x = _operands(dtype)[0]
    lo, hi = bounds

    def ref(t):
        if hi is None or lo is None:
            return torch.clamp_min(t, lo) if hi is None else torch.clamp_max(t, hi)
        return torch.clamp(t, lo, hi)

    _assert_same(_step(ref, (x,), (True,)), _step(lambda t: act_clamp(t, lo, hi), (x,), (True,)))
    if lo is not None and hi is not None:  # the two-sided clamp's own one-sided form as well
        _assert_same(_step(lambda t: torch.clamp(t, min=lo), (x,), (True,)),
                     _step(lambda t: act_clamp(t, lo), (x,), (True,)))


def test_passes_at_bound_is_what_autograd_does():
    for form, fn in (("clamp", lambda t: torch.clamp(t, 0.0, 1.0)), ("clamp_min", lambda t: torch.clamp_min(t, 0.0)),
                     ("clamp_max", lambda t: torch.clamp_max(t, 0.0))):
        x = torch.zeros(3, requires_grad=True)
        fn(x).sum().backward()
        assert passes_at_bound(form) == bool(x.grad[0] == 1), form


def test_elementwise_forms_save_two_bits_and_one_bit_per_element():
    a, b = (t.nan_to_num() for t in _operands(torch.float32))
    a.requires_grad_()
    with track_saved() as saved:
        act_elementwise_extremum(a, b, largest=True, slot="m:max")
        act_clamp(a, -1, 1, slot="m:clamp")
    assert saved.by_slot == {"m:max": a.numel() * 2 // 8, "m:clamp": a.numel() // 8}
    assert saved.uncompressed_bytes == (a.numel() + b.numel()) * 4 + a.numel() * 4  # both operands; the input


def test_clamp_bounds_are_named_and_without_grad_the_original_runs():
    x = _operands(torch.float32)[0].nan_to_num()
    assert torch.equal(act_clamp(x, -1, 1), torch.clamp(x, -1, 1)) and act_clamp(x, -1).grad_fn is None
    with pytest.raises(ActHFValueError, match="act_clamp's lo must be an int, a float or None, got Tensor"):
        act_clamp(x, torch.tensor(0.0))
    with pytest.raises(ActHFValueError, match="hi must be an int, a float or None, got bool"):
        act_clamp(x, None, True)
    with pytest.raises(ActHFValueError, match="at least one bound"):
        act_clamp(x)
