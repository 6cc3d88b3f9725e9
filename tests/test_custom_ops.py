"""torch.library registration: schema, fake kernels and torch.compile tracing of the act_hf ops."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import act_hf.ops._library  # noqa: F401
from act_hf.compress import dequantize, quantize
from tests.utils import dispatched

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_quantize_and_dequantize(dtype):
    x = torch.randn(1000).to(dtype)
    torch.library.opcheck(torch.ops.act_hf.quantize_pack.default, (x, 3, 256, 7), test_utils=OPCHECK_TESTS)
    payload, lo, scale = torch.ops.act_hf.quantize_pack(x, 3, 256, 7)
    torch.library.opcheck(
        torch.ops.act_hf.unpack_dequantize.default, (payload, lo, scale, 3, 256, 1000, dtype), test_utils=OPCHECK_TESTS
    )
    for divisor in (None, torch.rand(25) + 0.5):  # 25 rows of 40 channels
        torch.library.opcheck(torch.ops.act_hf.unpack_dequantize_affine.default,
                              (payload, lo, scale, 3, 256, 1000, torch.rand(40) + 0.5, torch.randn(40), divisor),
                              test_utils=OPCHECK_TESTS)
    mask = torch.randint(0, 256, (63,), dtype=torch.uint8)
    for start, out, accumulate, m in [(0, torch.empty(1000, dtype=dtype), False, None),
                                      (200, torch.randn(500).to(dtype), True, mask)]:  # 5 items of 4 x 25 from 200
        torch.library.opcheck(torch.ops.act_hf.unpack_dequantize_chain.default,
                              (out, [payload], [lo], [scale], [torch.rand(4) + 0.5], [torch.randn(4)], [m], 3, 256,
                               1000, start, 25, accumulate), test_utils=OPCHECK_TESTS)
    second = torch.ops.act_hf.quantize_pack(x * 2, 3, 256, 8)
    for start, out, accumulate, masks in [(0, torch.empty(1000, dtype=dtype), False, [None, None]),
                                          (200, torch.randn(500).to(dtype), True, [mask, None])]:
        torch.library.opcheck(torch.ops.act_hf.unpack_dequantize_chain.default,
                              (out, [payload, second[0]], [lo, second[1]], [scale, second[2]],
                               [torch.rand(4) + 0.5, torch.rand(4)], [torch.randn(4), torch.randn(4)], masks, 3, 256,
                               1000, start, 25, accumulate), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_quantize_normalized(dtype):
    x = torch.randn(1000).to(dtype)  # (10, 4, 25)
    torch.library.opcheck(torch.ops.act_hf.quantize_pack_normalized.default,
                          (x, torch.randn(4), torch.rand(4) + 0.5, 25, 3, 64, 7), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_quantize_scaled(dtype):
    x = torch.randn(1000).to(dtype)
    shifts = torch.tensor([0, 3, 24, 1, 0, 7, 2], dtype=torch.int32)  # 7 channels: rows straddle the groups
    torch.library.opcheck(torch.ops.act_hf.quantize_pack_scaled.default, (x, shifts, 3, 64, 7),
                          test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_channel_shifts(dtype):
    x = (torch.randn(70, 9) * torch.logspace(0, 4, 9)).to(dtype)
    torch.library.opcheck(torch.ops.act_hf.channel_shifts.default, (x.reshape(-1), 9, 15), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_opcheck_pack_bits(bits):
    codes = torch.randint(0, 2**bits, (77,), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.act_hf.pack_bits.default, (codes, bits), test_utils=OPCHECK_TESTS)
    payload = torch.ops.act_hf.pack_bits(codes, bits)
    torch.library.opcheck(torch.ops.act_hf.unpack_bits.default, (payload, bits, 77), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_fewbit_encode_pack_and_grad(dtype):
    from act_hf import fewbit

    table = fewbit.get_table("gelu", 3)
    x = (torch.randn(77) * 3).to(dtype)
    bounds = fewbit.encode_bounds(table, x)
    torch.library.opcheck(torch.ops.act_hf.fewbit_encode_pack.default, (x, bounds, 3), test_utils=OPCHECK_TESTS)
    payload = torch.ops.act_hf.fewbit_encode_pack(x, bounds, 3)
    values = fewbit.decode_values(table, dtype, x)
    torch.library.opcheck(torch.ops.act_hf.fewbit_grad.default, (torch.randn(77).to(dtype), payload, values, 3),
                          test_utils=OPCHECK_TESTS)


def test_opcheck_zero_unmasked():
    values, mask = torch.randn(77), torch.randint(0, 256, (10,), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.act_hf.zero_unmasked.default, (values, mask), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(torch.ops.act_hf.zero_unmasked_inplace.default, (values, mask),
                          test_utils=OPCHECK_TESTS)


def test_opcheck_masked_scale():
    grad, mask = torch.randn(77), torch.randint(0, 256, (10,), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.act_hf.masked_scale.default, (grad, mask, 1.25), test_utils=OPCHECK_TESTS)


def test_compile_fullgraph_sees_the_ops():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counter = CompileCounterWithBackend(backend)

    def round_trip(x):
        return dequantize(quantize(x, 4, 64, seed=3)) * 2

    compiled = torch.compile(round_trip, backend=counter, fullgraph=True)
    x = torch.randn(8, 100)
    torch.testing.assert_close(compiled(x), round_trip(x))
    assert counter.frame_count == 1
    code = "\n".join(g.code for g in graphs)
    assert "act_hf.quantize_pack" in code and "act_hf.unpack_dequantize" in code

    graphs.clear()
    scaled = torch.compile(lambda t: dequantize(quantize(t, 4, 64, seed=3, channel_scale=True)), backend=counter,
                           fullgraph=True)
    x = torch.randn(100, 8) * torch.logspace(0, 3, 8)
    torch.testing.assert_close(scaled(x), dequantize(quantize(x, 4, 64, seed=3, channel_scale=True)))
    assert "act_hf.quantize_pack_scaled" in "\n".join(g.code for g in graphs)  # no scaled copy in the graph


def test_eager_calls_skip_the_dispatcher_and_modes_still_see_the_ops(monkeypatch):
    """Plain eager: the implementation runs directly (no torch.ops round trip), with the same bits; under a
    dispatch mode (a tracer, a memory tracker) the op itself is called, so the mode sees it."""
    from act_hf.ops import _library

    x = torch.randn(3, 100)
    direct = quantize(x, 3, 64, seed=5)
    through_op = torch.ops.act_hf.quantize_pack(x.reshape(-1), 3, 64, 5)
    assert all(torch.equal(a, b) for a, b in zip((direct.payload, direct.lo, direct.scale), through_op))

    seen = [str(func) for func, _ in dispatched(lambda: dequantize(quantize(x, 3, 64, seed=5)))]
    assert "act_hf.quantize_pack.default" in seen and "act_hf.unpack_dequantize.default" in seen
    hidden = torch.randn(64, 100)
    packed = quantize(hidden, 3, 64, seed=5, channel_scale=True)  # the table of powers of two made once
    seen = [str(func) for func, _ in dispatched(lambda: quantize(hidden, 3, 64, seed=5, channel_scale=True))]
    ops = [name for name in seen if not name.startswith(("aten.detach", "aten.view"))]
    # the shifts taken as made, and their factors 2^-k looked up once, here
    assert ops == ["act_hf.channel_shifts.default", "act_hf.quantize_pack_scaled.default", "aten.index_select.default"]
    seen = [str(func) for func, _ in dispatched(lambda: dequantize(packed))]
    ops = [name for name in seen if not name.startswith(("aten.detach", "aten.view"))]
    assert ops == ["act_hf.unpack_dequantize.default", "aten.mul_.Tensor"]  # the factors as kept: no lookup, no cast

    calls = []
    implementation = _library._IMPLEMENTATIONS[_library.quantize_pack]["cpu"]
    monkeypatch.setitem(_library._IMPLEMENTATIONS[_library.quantize_pack], "cpu",
                        lambda *a: calls.append(a) or implementation(*a))
    quantize(x, 3, 64, seed=5)
    assert len(calls) == 1  # eager: the table's implementation, directly
    dispatched(lambda: quantize(x, 3, 64, seed=5))
    assert len(calls) == 1  # under a mode: through torch.ops (whose kernel is registered apart from the table)
    assert _library._plain_eager(x) and not _library._plain_eager(torch.empty(2, device="meta"))


def test_import_is_lean():
    """import act_hf neither initialises CUDA nor builds/imports the extension."""
    code = (
        "import sys, torch, act_hf, act_hf.compress;"
        "assert not torch.cuda.is_initialized();"
        "assert not any(m.startswith('act_hf_C') for m in sys.modules), 'extension imported';"
        "assert 'transformers' not in sys.modules and 'timm' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_disable_ext_switch_forces_reference(monkeypatch):
    from act_hf import _ext

    monkeypatch.setenv("ACT_HF_DISABLE_EXT", "1")
    monkeypatch.setattr(_ext, "_tried", False)
    monkeypatch.setattr(_ext, "_module", None)
    assert _ext.load() is None
    with pytest.raises(RuntimeError, match="ACT_HF_DISABLE_EXT=1.*act-hf build-ext"):
        _ext.require()


def test_constant_tables_are_cached_only_in_plain_eager_execution():
    """The channel-scale power table, the norms' unit statistics and the zero operand of a where are made once for
    plain tensors; made for fake ones (torch.compile's tracing) they are not kept, so eager calls after it get real
    tensors."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from act_hf import _constants
    from act_hf.compress import quantizer

    quantizer._cached_power_table.cache_clear()
    _constants._make_zeros_and_ones.cache_clear()
    _constants._make_zero_scalar.cache_clear()
    shifts = torch.tensor([0, 3, 24], dtype=torch.int8)
    with FakeTensorMode() as mode:
        fake_powers = quantizer._powers_of_two(mode.from_tensor(shifts), torch.float32, negate=True)
        fake_zeros, _ = _constants.zeros_and_ones((6, 1), mode.from_tensor(shifts))
        fake_zero = _constants.zero_scalar(mode.from_tensor(shifts))
    assert isinstance(fake_powers, FakeTensor) and isinstance(fake_zeros, FakeTensor)
    assert isinstance(fake_zero, FakeTensor) and _constants._make_zero_scalar.cache_info().currsize == 0
    grad = torch.ones(3, dtype=torch.bfloat16)
    zero = _constants.zero_scalar(grad)
    assert zero.shape == () and zero.dtype == torch.bfloat16 and zero.item() == 0
    assert _constants.zero_scalar(grad) is zero and _constants.zero_scalar(shifts) is not zero  # per dtype
    invstd = torch.ones(4)
    channel_zeros, channel_ones = _constants.zeros_and_ones((4,), invstd)  # BatchNorm's, one per channel
    assert channel_zeros.shape == channel_ones.shape == (4,) and channel_ones.dtype == torch.float32
    assert _constants.zeros_and_ones((4,), invstd)[1] is channel_ones
    assert _constants.zeros_and_ones((4,), invstd.double())[1].dtype == torch.float64  # per dtype
    powers = quantizer._powers_of_two(shifts, torch.float32, negate=True)
    assert type(powers) is torch.Tensor and powers.tolist() == [1.0, 2.0**-3, 2.0**-24]
    zeros, ones = _constants.zeros_and_ones((6, 1), invstd)
    assert type(zeros) is torch.Tensor and zeros.shape == (6, 1) and not zeros.any() and bool((ones == 1).all())
    assert _constants.zeros_and_ones((6, 1), invstd)[0] is zeros  # made once
    assert quantizer._cached_power_table.cache_info().currsize == 1
    assert _constants._make_zeros_and_ones.cache_info().currsize == 3  # (6, 1), (4,) and (4,) in fp64


def test_few_bit_tables_are_cached_only_for_plain_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from act_hf import fewbit

    fewbit._rounded_up.cache_clear()
    fewbit._cached_tensor.cache_clear()
    table, x = fewbit.get_table("gelu", 3), torch.randn(64, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fewbit.decode(fewbit.encode(mode.from_tensor(x), table), table, torch.bfloat16)
    assert fewbit._rounded_up.cache_info().currsize == fewbit._cached_tensor.cache_info().currsize == 0
    assert torch.equal(fewbit.decode(fewbit.encode(x, table), table, torch.bfloat16), table(x))
    assert fewbit._rounded_up.cache_info().currsize == fewbit._cached_tensor.cache_info().currsize == 1
