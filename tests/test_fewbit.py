"""Tests for act_hf.fewbit: optimal piecewise-constant derivative tables, their JSON, and the encode/decode codec."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from act_hf import fewbit
from act_hf.fewbit import (
    SUPPORTED_ACTIVATIONS,
    DerivativeTable,
    decode,
    derivative,
    encode,
    get_table,
    optimal_table,
    write_tables,
)

BITS = (1, 2, 3, 4)
EXACT = {"hardsigmoid"}  # f' is piecewise constant with 3 pieces: exact from 2 bits on


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("fewbit") / "tables.json"
    write_tables(path)
    text = path.read_text(encoding="utf-8")
    return {"text": text, "doc": json.loads(text)}


def _shipped() -> dict:
    return json.loads(fewbit._default_path().read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------------------------------
# Shipped JSON and regeneration.
# ---------------------------------------------------------------------------------------------------------------------


def test_regeneration_reproduces_shipped_json(regenerated):
    shipped, fresh = _shipped(), regenerated["doc"]
    assert fresh["format_version"] == shipped["format_version"] == 1
    assert fresh["generator"] == shipped["generator"]
    assert fresh["generator"]["weight"] == "normal" and fresh["generator"]["range"] == [-8.0, 8.0]
    assert set(fresh["tables"]) == set(shipped["tables"]) == set(SUPPORTED_ACTIVATIONS)
    for name in SUPPORTED_ACTIVATIONS:
        assert set(shipped["tables"][name]) == {"1", "2", "3", "4"}
        for bits in map(str, BITS):
            a, b = fresh["tables"][name][bits], shipped["tables"][name][bits]
            np.testing.assert_allclose(a["boundaries"], b["boundaries"], rtol=0, atol=1e-9, err_msg=f"{name}/{bits}")
            np.testing.assert_allclose(a["values"], b["values"], rtol=0, atol=1e-9, err_msg=f"{name}/{bits}")
            assert a["rms_error"] == pytest.approx(b["rms_error"], abs=1e-9)


def test_json_format_sorted_and_round_trips(regenerated):
    text = regenerated["text"]
    doc = regenerated["doc"]
    assert text == json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n"
    assert "NaN" not in text and "Infinity" not in text
    # Floats are written with repr, so loading gives back exactly the generated tables.
    for name in ("gelu", "silu"):
        for bits in BITS:
            t = optimal_table(name, bits)
            entry = doc["tables"][name][str(bits)]
            assert tuple(entry["boundaries"]) == t.boundaries
            assert tuple(entry["values"]) == t.values
            assert entry["rms_error"] == t.rms_error


def test_get_table_matches_json_and_is_cached():
    shipped = _shipped()["tables"]
    for name in SUPPORTED_ACTIVATIONS:
        for bits in BITS:
            t = get_table(name, bits)
            assert isinstance(t, DerivativeTable)
            assert (t.name, t.bits) == (name, bits)
            assert len(t.boundaries) == 2**bits - 1 and len(t.values) == 2**bits
            assert all(a < b for a, b in zip(t.boundaries, t.boundaries[1:]))
            assert all(math.isfinite(v) for v in t.values + t.boundaries)
            assert list(t.boundaries) == shipped[name][str(bits)]["boundaries"]
            assert get_table(name, bits) is t


# ---------------------------------------------------------------------------------------------------------------------
# Accuracy and optimality.
# ---------------------------------------------------------------------------------------------------------------------


def test_gelu_rms_targets():
    # Targets measured for the normal-weight optimum: 0.090 (2 bits) and 0.044 (3 bits).
    assert 0.0890 <= get_table("gelu", 2).rms_error <= 0.0899
    assert 0.0434 <= get_table("gelu", 3).rms_error <= 0.0440
    assert get_table("gelu", 2).rms_error == pytest.approx(0.0894491, abs=1e-6)
    assert get_table("gelu", 3).rms_error == pytest.approx(0.0436744, abs=1e-6)


@pytest.mark.parametrize("name", SUPPORTED_ACTIVATIONS)
def test_error_decreases_with_bits(name):
    errs = [get_table(name, bits).rms_error for bits in BITS]
    for lo_bits, hi_bits in zip(errs, errs[1:]):
        if name in EXACT and lo_bits < 1e-12:
            assert hi_bits < 1e-12
        else:
            assert hi_bits < lo_bits
    if name in EXACT:
        assert errs[1] < 1e-12  # 2 bits represent hardsigmoid' exactly
    else:
        # Roughly halves per extra bit (the paper reports factors 2-4 for the uniform weight).
        assert errs[3] < 0.7 * errs[2] < 0.7**2 * errs[1]


def test_exact_table_for_piecewise_constant_derivative():
    t = get_table("hardsigmoid", 2)
    assert {-3.0, 3.0} <= set(t.boundaries)
    x = torch.linspace(-6, 6, 1201, dtype=torch.float64)
    x = x[(x != -3.0) & (x != 3.0)]  # torch's backward is 0 exactly at ±3; the table's convention differs there
    torch.testing.assert_close(t(x), derivative("hardsigmoid", x), rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["gelu", "silu", "mish", "tanh", "hardswish", "selu"])
@pytest.mark.parametrize("bits", [2, 3])
def test_local_optimality(name, bits):
    """Moving any boundary (with optimal values re-fitted) cannot lower the error; values are weighted means."""
    t = get_table(name, bits)
    b = np.array(t.boundaries)
    ints = fewbit._Integrals(name, "normal", -8.0, 8.0, 0.01)
    vals = fewbit._piece_values(ints, np.concatenate([[-8.0], b, [8.0]]))
    np.testing.assert_allclose(vals, t.values, rtol=0, atol=1e-12)
    base = fewbit._total_loss(ints, b)
    assert math.sqrt(base) == pytest.approx(t.rms_error, rel=1e-9)
    for i in range(b.size):
        for delta in (-1e-3, 1e-3, -2e-2, 2e-2):
            moved = b.copy()
            moved[i] += delta
            if np.all(np.diff(np.concatenate([[-8.0], moved, [8.0]])) > 0):
                assert fewbit._total_loss(ints, moved) >= base * (1 - 1e-12)


def test_uniform_weight_reproduces_paper_table1():
    """With the paper's weight 1[x in [-10, 10]] the DP reproduces Table 1 (values of the L2 error (3))."""
    paper = {
        "gelu": (0.1410, 0.0406, 0.0119, 0.0031),
        "silu": (0.2150, 0.0479, 0.0170, 0.0045),
        "softplus": (0.2902, 0.0541, 0.0121, 0.0029),
    }
    for name, expected in paper.items():
        ints = fewbit._Integrals(name, "uniform", -10.0, 10.0, 0.01)
        for bits, ref in zip(BITS, expected):
            t = optimal_table(name, bits, weight="uniform")
            assert fewbit._total_loss(ints, np.array(t.boundaries)) == pytest.approx(ref, abs=1e-4), (name, bits)


def test_normal_weight_beats_uniform_weight_tables():
    """Under the normal weight our tables beat the paper-style uniform-weight ones (0.092 / 0.058 for GELU)."""
    uniform = [optimal_table("gelu", bits, weight="uniform").rms_error for bits in BITS]
    assert uniform[1] == pytest.approx(0.092, abs=1e-3)
    assert uniform[2] == pytest.approx(0.058, abs=1e-3)
    for name in ("gelu", "silu"):
        for bits in BITS:
            ours = get_table(name, bits).rms_error
            theirs = optimal_table(name, bits, weight="uniform").rms_error
            assert ours < theirs, (name, bits)
    assert get_table("gelu", 3).rms_error < 0.8 * uniform[2]


def test_refinement_never_hurts():
    for name in ("gelu", "silu"):
        for bits in BITS:
            raw = optimal_table(name, bits, refine=False)
            assert get_table(name, bits).rms_error <= raw.rms_error + 1e-15


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "selu", "hardswish", "softplus", "hardsigmoid"])
def test_rms_error_matches_independent_quadrature(name):
    integrate = pytest.importorskip("scipy.integrate")

    def fprime(x: float) -> float:
        return float(derivative(name, torch.tensor([x], dtype=torch.float64))[0])

    def pdf(x: float) -> float:
        return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)

    for bits in BITS:
        t = get_table(name, bits)
        edges = [-math.inf, *t.boundaries, math.inf]
        total = 0.0
        for i, y in enumerate(t.values):
            lo, hi = max(edges[i], -12.0), min(edges[i + 1], 12.0)
            if lo >= hi:
                continue
            kinks = [p for p in (-3.0, 0.0, 3.0) if lo < p < hi]
            val, _ = integrate.quad(
                lambda x, y=y: (fprime(x) - y) ** 2 * pdf(x), lo, hi, points=kinks or None, epsabs=1e-14, limit=200
            )
            total += val
        assert math.sqrt(total) == pytest.approx(t.rms_error, rel=1e-6, abs=1e-10), (name, bits)


# ---------------------------------------------------------------------------------------------------------------------
# Derivatives.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SUPPORTED_ACTIVATIONS)
def test_derivative_matches_autograd(name):
    x = torch.linspace(-7, 7, 2801, dtype=torch.float64)
    x = x[(x.abs() - 3.0).abs() > 1e-9]
    x = x[x.abs() > 1e-9]  # jumps of f' (hardswish/hardsigmoid at ±3, selu at 0)
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(fewbit.ACTIVATIONS[name](x).sum(), x)
    # torch's float64 hardsigmoid backward uses a float32-rounded 1/6; ours is exact.
    tol = 1e-7 if name == "hardsigmoid" else 1e-12
    torch.testing.assert_close(derivative(name, x.detach()), grad, rtol=tol, atol=tol)


def test_derivative_keeps_dtype_and_shape():
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    d = derivative("gelu", x)
    assert d.dtype == torch.bfloat16 and d.shape == x.shape


# ---------------------------------------------------------------------------------------------------------------------
# Codec.
# ---------------------------------------------------------------------------------------------------------------------


def _reference_codes(x: torch.Tensor, table: DerivativeTable) -> torch.Tensor:
    """#{j : boundaries[j] <= x}, compared in x's dtype promoted to >= float32 (the documented contract)."""
    cdtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(cdtype).reshape(-1, 1)
    b = torch.tensor(table.boundaries, dtype=cdtype).reshape(1, -1)
    codes = (b <= xf).sum(dim=1)
    codes[torch.isnan(xf[:, 0])] = 2**table.bits - 1
    return codes.reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(), (0,), (0, 4), (1,), (7,), (3, 5, 7), (2, 1, 9, 3)])
@pytest.mark.parametrize("bits", BITS)
def test_encode_decode_equals_direct_piecewise_constant(dtype, shape, bits):
    table = get_table("gelu", bits)
    gen = torch.Generator().manual_seed(1234 + bits)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2.0).to(dtype)
    codes = encode(x, table)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    ref = _reference_codes(x, table)
    assert torch.equal(codes.long(), ref)
    out = decode(codes, table, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    direct = torch.tensor(table.values, dtype=torch.float64)[ref].to(dtype)  # g(x) evaluated directly
    assert torch.equal(out, direct)
    if x.numel():
        assert int(codes.max()) < 2**bits
        # And the approximation is close to the true derivative on typical inputs.
        err = (out.double() - derivative("gelu", x.double())).pow(2).mean().sqrt()
        assert float(err) < 2.5 * table.rms_error + 0.02


def test_encode_noncontiguous_and_all_activations():
    x = torch.randn(64, 33).t()  # non-contiguous
    for name in SUPPORTED_ACTIVATIONS:
        table = get_table(name, 3)
        codes = encode(x, table)
        assert codes.shape == x.shape
        assert torch.equal(codes.long(), _reference_codes(x, table))
        assert torch.equal(table(x), decode(codes, table, x.dtype))


@pytest.mark.parametrize("bits", BITS)
def test_boundary_ties_go_to_the_right_piece(bits):
    table = get_table("silu", bits)
    b32 = table.boundaries_tensor()  # float32-rounded boundaries, as encode compares them
    on = encode(b32, table)
    below = encode(torch.nextafter(b32, torch.full_like(b32, -math.inf)), table)
    expected = torch.arange(1, 2**bits, dtype=torch.uint8)
    assert torch.equal(on, expected)  # x == boundaries[i] -> piece i + 1 (right)
    assert torch.equal(below, expected - 1)
    # bf16 inputs get the float32 comparison's codes: an exactly representable boundary still goes right.
    xb = torch.tensor([0.0], dtype=torch.bfloat16)
    assert int(encode(xb, get_table("gelu", 1))) == 1  # the 1-bit GELU boundary is exactly 0 (f' - 1/2 is odd)
    assert torch.equal(
        encode(b32.double(), table).long(),
        torch.bucketize(b32.double(), table.boundaries_tensor(dtype=torch.float64), right=True),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compare_in_their_own_dtype_with_the_float32_codes(dtype):
    """Every one of the 65536 fp16 / bf16 values (infinities and NaNs included) gets the code of comparing it in
    float32 against the float32 boundaries, for every activation and width, and no float32 copy is made."""
    from tests.utils import dispatched

    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    for name in SUPPORTED_ACTIVATIONS:
        for bits in BITS:
            table = get_table(name, bits)
            expected = torch.bucketize(x.float(), table.boundaries_tensor(), right=True)
            assert torch.equal(encode(x, table).long(), expected), (name, bits)
    ops = dispatched(lambda: encode(x, table))
    assert not any(isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() == x.numel()
                   for _, (out, *_) in ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_special_values(dtype):
    table = get_table("gelu", 3)
    x = torch.tensor([math.nan, -math.inf, math.inf, -math.nan, 0.0, -0.0], dtype=dtype)
    codes = encode(x, table).tolist()
    last = 2**table.bits - 1
    assert codes[0] == last and codes[3] == last  # NaN -> last code (documented)
    assert codes[1] == 0 and codes[2] == last
    assert codes[4] == codes[5]


def test_tensor_helpers():
    t = get_table("tanh", 2)
    b = t.boundaries_tensor(dtype=torch.float64)
    v = t.values_tensor(dtype=torch.bfloat16)
    assert b.shape == (3,) and b.dtype == torch.float64 and b.tolist() == list(t.boundaries)
    assert v.shape == (4,) and v.dtype == torch.bfloat16
    b.zero_()  # a fresh tensor: mutating it does not affect the table or the codec
    assert t.boundaries_tensor(dtype=torch.float64).tolist() == list(t.boundaries)


def _coded_input(table: DerivativeTable, dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` values of ``dtype`` around ``table``'s bounds: random ones, the bounds themselves, NaN and +-inf."""
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)).mul_(3).to(dtype)
    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, *table.boundaries], dtype=torch.float64)
    x[:specials.numel()] = specials.to(dtype)
    return x


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fused_encode_pack_and_grad_equal_the_codec_and_torch_mul(dtype, bits):
    """``act_hf::fewbit_encode_pack`` (x against :func:`fewbit.encode_bounds`) is ``pack_bits(encode(x))``, and
    ``act_hf::fewbit_grad`` (with :func:`fewbit.decode_values`) is ``grad * decode(codes)``, whole and chunk by
    chunk (3 bits end a chunk of 1000 elements inside a byte), through the registered ops too."""
    from act_hf.compress import pack_bits
    from act_hf.compress import reference as R

    table = get_table("gelu", bits)
    n = 4099
    x = _coded_input(table, dtype, n)
    grad = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
    bounds, values = fewbit.encode_bounds(table, x), fewbit.decode_values(table, dtype, x)
    assert bounds.dtype == dtype and values.dtype == dtype
    codes = encode(x, table)
    stream = pack_bits(codes, bits)
    assert torch.equal(R.fewbit_encode_pack(x, bounds, bits), stream)
    assert torch.equal(R.fewbit_encode_pack_chunked(x, bounds, bits, chunk=1000), stream)
    assert torch.equal(torch.ops.act_hf.fewbit_encode_pack(x, bounds, bits), stream)
    want = grad * decode(codes, table, dtype)
    for got in (R.fewbit_grad(grad, stream, values, bits),
                R.fewbit_grad_chunked(grad, stream, values, bits, chunk=1000),
                torch.ops.act_hf.fewbit_grad(grad, stream, values, bits)):
        assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    table = get_table("gelu", 4)
    x = torch.randn(1000, 37, dtype=torch.float64).mul_(2).to(dtype)
    x[0, :4] = torch.tensor([math.nan, math.inf, -math.inf, 0.0], dtype=dtype)
    x[1, :15] = table.boundaries_tensor().to(dtype)
    codes = encode(x.cuda(), table)
    assert codes.device.type == "cuda" and codes.dtype == torch.uint8
    assert torch.equal(codes.cpu(), encode(x, table))
    assert torch.equal(decode(codes, table, dtype).cpu(), decode(encode(x, table), table, dtype))


# ---------------------------------------------------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------------------------------------------------


def test_get_table_unknown_name():
    with pytest.raises(ValueError, match="name") as info:
        get_table("swishy", 2)
    for name in SUPPORTED_ACTIVATIONS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="name"):
        derivative("relu", torch.zeros(1))


@pytest.mark.parametrize("bits", [0, 5, -1, 8, 2.0, True])
def test_get_table_bad_bits(bits):
    with pytest.raises(ValueError, match="bits") as info:
        get_table("gelu", bits)
    assert "1, 2, 3, 4" in str(info.value)


def test_optimal_table_bad_arguments():
    with pytest.raises(ValueError, match="weight"):
        optimal_table("gelu", 2, weight="laplace")
    with pytest.raises(ValueError, match="bits"):
        optimal_table("gelu", 0)


def test_table_validation():
    with pytest.raises(ValueError):
        DerivativeTable("gelu", 1, (0.0, 1.0), (0.0, 1.0), 0.1)
    with pytest.raises(ValueError):
        DerivativeTable("gelu", 2, (0.0, 0.0, 1.0), (0.0, 0.5, 0.7, 1.0), 0.1)
