"""Few-Bit Backward: optimal piecewise-constant approximations of activation derivatives.

For an elementwise activation ``f`` the backward pass only needs ``f'(x)``. Instead of saving ``x`` (16/32 bits an
element) we save a ``b``-bit *code*: the index of the interval of ``x`` in a piecewise-constant approximation ``g``
of ``f'`` with ``2**b`` pieces, and the backward pass multiplies the incoming gradient by ``values[code]``
(Novikov et al., 2022, "Few-Bit Backward: Quantized Gradients of Activation Functions for Memory Footprint
Reduction", section 3).

Approximation. A table has interior boundaries ``s_1 < ... < s_{K-1}`` (``K = 2**bits``) and values
``y_0 .. y_{K-1}``; piece ``i`` covers ``[s_i, s_{i+1})`` with ``s_0 = -inf`` and ``s_K = +inf``. The tables minimise
the weighted L2 error ``L = ∫ (f'(x) - g(x))**2 w(x) dx`` with ``w`` the standard normal pdf ``φ`` (the paper used a
uniform weight on ``[-10, 10]``; ``optimal_table(..., weight="uniform")`` reproduces that). For fixed boundaries the
optimal value of a piece is the ``w``-weighted mean of ``f'`` on it. Boundaries come from the paper's dynamic
programme on a fine grid (``DP(t, k) = min_{t'<t} DP(t', k-1) + cost(t', t)``, ``cost`` in ``O(1)`` from prefix sums
of ``w``, ``w f'``, ``w f'**2``; grid step 0.01 on ``[-8, 8]`` plus the kinks of ``f'``), followed by a deterministic
local refinement of the continuous boundaries (a few red-black golden-section coordinate-descent sweeps on the exact
objective, then damped Newton with the analytic gradient of the paper's eq. 5; boundaries rounded to 1e-12).
``rms_error`` of a table is always ``sqrt(∫ (f' - g)**2 φ)`` under the *normal* weight, whatever weight it was
optimised for. With the paper's uniform weight on ``[-10, 10]`` this reproduces the paper's Table 1 (GELU, Swish,
Softplus, SELU).

Boundary convention. ``x`` exactly equal to a boundary ``s_i`` belongs to the piece on its *right* (piece ``i``);
i.e. ``code = #{j : boundaries[j] <= x}`` = ``torch.bucketize(x, boundaries, right=True)``. ``-inf`` gets code 0,
``+inf`` and NaN get the last code ``2**bits - 1``.

Tables for every activation in :data:`SUPPORTED_ACTIVATIONS` and ``bits`` in 1..4 ship in
``act_hf/data/fewbit_tables.json``; regenerate them with ``python -m act_hf.fewbit --write``. Piecewise-linear
activations of the ReLU family (relu, leaky_relu, relu6, hardtanh) have exact 1-2 bit derivatives and are handled
elsewhere.
"""

from __future__ import annotations

import argparse
import functools
import importlib.resources
import json
import logging
import math
import sys
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ._constants import reused
from .errors import ActHFValueError

logger = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "SUPPORTED_ACTIVATIONS",
    "DerivativeTable",
    "decode",
    "decode_values",
    "derivative",
    "encode",
    "encode_bounds",
    "get_table",
    "optimal_table",
    "write_tables",
]

# ---------------------------------------------------------------------------------------------------------------------
# Activations and their exact derivatives (closed forms, evaluated in float64).
# ---------------------------------------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_COEF = 0.044715
_QUICK_GELU_COEF = 1.702
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _softplus_exact(x: torch.Tensor) -> torch.Tensor:
    # log(1 + exp(x)) without torch's linear threshold (the brief: "threshold ignored").
    return torch.logaddexp(x, torch.zeros_like(x))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(_QUICK_GELU_COEF * x)


def _elu(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x, alpha=1.0)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "softplus": _softplus_exact,
    "mish": F.mish,
    "elu": _elu,
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "selu": F.selu,
}

#: Read-only registry ``name -> f`` of the activations that have few-bit derivative tables.
ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = types.MappingProxyType(_ACTIVATIONS)

#: Names accepted by :func:`derivative`, :func:`optimal_table` and :func:`get_table`.
SUPPORTED_ACTIVATIONS: tuple[str, ...] = tuple(_ACTIVATIONS)

SUPPORTED_BITS: tuple[int, ...] = (1, 2, 3, 4)


def _d_gelu(x: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1.0 + torch.special.erf(x * _INV_SQRT_2))
    pdf = torch.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return cdf + x * pdf


def _d_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_COEF * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_COEF * x * x)


def _d_quick_gelu(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(_QUICK_GELU_COEF * x)
    return s + _QUICK_GELU_COEF * x * s * (1.0 - s)


def _d_silu(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s + x * s * (1.0 - s)


def _d_tanh(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(x)
    return 1.0 - t * t


def _d_sigmoid(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 - s)


def _d_mish(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_softplus_exact(x))
    return t + x * (1.0 - t * t) * torch.sigmoid(x)


def _d_elu(x: torch.Tensor) -> torch.Tensor:
    # torch's elu backward uses the exp branch for x <= 0 (equal to 1 at 0 for alpha = 1).
    return torch.where(x > 0, torch.ones_like(x), torch.exp(torch.clamp(x, max=0.0)))


def _d_hardswish(x: torch.Tensor) -> torch.Tensor:
    # torch's hardswish_backward up to 2.11 (CPU and CUDA): 0 for x < -3, x/3 + 1/2 for -3 <= x <= 3, 1 for x > 3.
    # Later CPU kernels give -3 and 3 to the outer branches (0 and 1): the other one-sided derivative there.
    mid = x / 3.0 + 0.5
    return torch.where(x < -3.0, torch.zeros_like(x), torch.where(x <= 3.0, mid, torch.ones_like(x)))


def _d_hardsigmoid(x: torch.Tensor) -> torch.Tensor:
    # Same branches as torch's hardsigmoid_backward: 1/6 on the open interval (-3, 3), else 0.
    inside = (x > -3.0) & (x < 3.0)
    return torch.where(inside, torch.full_like(x, 1.0 / 6.0), torch.zeros_like(x))


def _d_selu(x: torch.Tensor) -> torch.Tensor:
    neg = _SELU_SCALE * _SELU_ALPHA * torch.exp(torch.clamp(x, max=0.0))
    return torch.where(x > 0, torch.full_like(x, _SELU_SCALE), neg)


_DERIVATIVES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _d_gelu,
    "gelu_tanh": _d_gelu_tanh,
    "quick_gelu": _d_quick_gelu,
    "silu": _d_silu,
    "tanh": _d_tanh,
    "sigmoid": _d_sigmoid,
    "softplus": torch.sigmoid,
    "mish": _d_mish,
    "elu": _d_elu,
    "hardswish": _d_hardswish,
    "hardsigmoid": _d_hardsigmoid,
    "selu": _d_selu,
}

# Points where f' is discontinuous or not smooth: they are always grid points, so no quadrature cell straddles one.
_BREAKPOINTS: dict[str, tuple[float, ...]] = {
    "elu": (0.0,),
    "selu": (0.0,),
    "hardswish": (-3.0, 3.0),
    "hardsigmoid": (-3.0, 3.0),
}


def _check_name(name: str) -> str:
    if not isinstance(name, str) or name not in _DERIVATIVES:
        raise ActHFValueError(
            f"name={name!r} is not a supported few-bit activation; supported names: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    return name


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ActHFValueError(f"bits={bits!r} is not supported; allowed values: {', '.join(map(str, SUPPORTED_BITS))}")
    return bits


def derivative(name: str, x: torch.Tensor) -> torch.Tensor:
    """Exact derivative ``f'(x)`` of the activation ``name``.

    Closed forms evaluated in float64 (on ``x``'s device) and returned in ``x``'s dtype. At points where ``f'`` jumps
    the value matches PyTorch's own backward (e.g. hardsigmoid gives 0 at ``x = ±3``, elu/selu use the exponential
    branch at ``x = 0``).

    Args:
        name: One of :data:`SUPPORTED_ACTIVATIONS`.
        x: Floating-point input tensor of any shape.

    Returns:
        Tensor of ``f'(x)``, same shape, dtype and device as ``x``.

    Raises:
        ActHFValueError: ``name`` is not supported (a ``ValueError``).
    """
    fn = _DERIVATIVES[_check_name(name)]
    return fn(x.to(torch.float64)).to(x.dtype)


def _derivative_np(name: str, x: np.ndarray) -> np.ndarray:
    return _DERIVATIVES[name](torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))).numpy()


# ---------------------------------------------------------------------------------------------------------------------
# Tables.
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DerivativeTable:
    """A ``bits``-bit piecewise-constant approximation ``g`` of an activation derivative.

    Piece ``i`` covers ``[boundaries[i-1], boundaries[i])`` (with ``boundaries[-1] = -inf`` and
    ``boundaries[2**bits - 1] = +inf``); a point exactly on a boundary belongs to the piece on its right
    (``torch.bucketize(..., right=True)``), and NaN to the last piece.

    Attributes:
        name: Activation name (one of :data:`SUPPORTED_ACTIVATIONS`).
        bits: Code width, 1..4.
        boundaries: ``2**bits - 1`` strictly increasing interior boundaries (float64 values).
        values: ``2**bits`` derivative values, one per piece.
        rms_error: ``sqrt(∫ (f'(x) - g(x))**2 φ(x) dx)`` with ``φ`` the standard normal pdf.
    """

    name: str
    bits: int
    boundaries: tuple[float, ...]
    values: tuple[float, ...]
    rms_error: float

    def __post_init__(self) -> None:
        n = 1 << self.bits
        if len(self.boundaries) != n - 1 or len(self.values) != n:
            raise ActHFValueError(
                f"DerivativeTable({self.name!r}, bits={self.bits}) needs {n - 1} boundaries and {n} values, "
                f"got {len(self.boundaries)} and {len(self.values)}"
            )
        if any(not a < b for a, b in zip(self.boundaries, self.boundaries[1:])):
            raise ActHFValueError(f"DerivativeTable({self.name!r}, bits={self.bits}): boundaries must be increasing")

    @property
    def num_pieces(self) -> int:
        """Number of pieces, ``2**bits``."""
        return 1 << self.bits

    def boundaries_tensor(
        self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Interior boundaries as a new 1-D tensor (``2**bits - 1`` elements) of ``dtype`` on ``device``."""
        return torch.tensor(self.boundaries, dtype=dtype, device=device)

    def values_tensor(
        self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Piece values as a new 1-D tensor (``2**bits`` elements) of ``dtype`` on ``device``."""
        return torch.tensor(self.values, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Evaluate ``g(x)`` in ``x``'s dtype (``decode(encode(x, self), self, x.dtype)``)."""
        return decode(encode(x, self), self, x.dtype)


@functools.lru_cache(maxsize=256)
def _cached_tensor(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # One host->device copy per (table, device, dtype); later encode/decode calls reuse it (no transfer, no sync).
    return torch.tensor(values, dtype=dtype, device=device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float32, torch.float64):
        return dtype
    if not dtype.is_floating_point:
        raise ActHFValueError(f"x.dtype={dtype} is not a floating-point dtype")
    return torch.promote_types(dtype, torch.float32)


def encode(x: torch.Tensor, table: DerivativeTable) -> torch.Tensor:
    """Interval index of every element of ``x`` in ``table``: the few-bit code saved for backward.

    ``code = torch.bucketize(x, boundaries, right=True)``, i.e. the number of boundaries ``<= x``: a value exactly
    on a boundary goes to the piece on its right. The codes are those of comparing ``x`` in float32 against the
    float32-rounded boundaries (float64 inputs: in float64); fp16 and bf16 inputs are compared in their own dtype,
    against each boundary rounded *up* to it, which gives the same codes without a float32 copy of ``x`` (for
    ``x`` in the dtype, ``b <= x`` exactly when the dtype's smallest value ``>= b`` is ``<= x``). ``-inf`` maps to
    code 0; ``+inf`` and NaN map to the last code ``2**bits - 1``. No host synchronisation (after the first call
    per device the boundaries tensor is cached).

    Args:
        x: Floating-point tensor on any device, any shape (empty allowed).
        table: The approximation to encode against.

    Returns:
        ``torch.uint8`` tensor of codes in ``[0, 2**bits)``, same shape and device as ``x``.
    """
    bounds = encode_bounds(table, x)
    codes = torch.bucketize(x.to(bounds.dtype).contiguous(), bounds, right=True, out_int32=True)
    return codes.to(torch.uint8)


def encode_bounds(table: DerivativeTable, x: torch.Tensor) -> torch.Tensor:
    """The bounds :func:`encode` compares ``x`` against, in the dtype it compares in (``x``'s for fp16, bf16 and
    fp64; float32 otherwise): ``table.boundaries`` rounded to it, upwards for fp16 and bf16. Made once per table,
    device and dtype (read-only)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return reused(_rounded_up, x, table.boundaries, x.device, x.dtype)
    return reused(_cached_tensor, x, table.boundaries, x.device, _compute_dtype(x.dtype))


@functools.lru_cache(maxsize=256)
def _rounded_up(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Each float32-rounded value's smallest upper bound in ``dtype`` (fp16 or bf16), cached like
    :func:`_cached_tensor`. Round to nearest lands at most one step below; that step is taken on the bit
    pattern (a larger pattern is a larger positive number and a smaller negative one; from -0 or +0, the
    smallest positive subnormal)."""
    exact = torch.tensor(values, dtype=torch.float32)
    rounded = exact.to(dtype)
    below = rounded.float() < exact
    bits = rounded.view(torch.int16)
    up = torch.where(rounded.float() == 0, torch.ones_like(bits),
                     torch.where(rounded.float() > 0, bits + 1, bits - 1))
    return torch.where(below, up, bits).view(dtype).to(device)


def decode(codes: torch.Tensor, table: DerivativeTable, dtype: torch.dtype) -> torch.Tensor:
    """Piece values ``table.values[codes]`` as a tensor of ``dtype`` (values rounded to ``dtype``).

    Args:
        codes: Integer tensor (normally the ``uint8`` output of :func:`encode`) with entries in ``[0, 2**bits)``.
        table: The approximation the codes were computed against.
        dtype: Floating-point dtype of the result.

    Returns:
        Tensor of the same shape and device as ``codes``.
    """
    flat = codes.reshape(-1).to(torch.int32)
    return decode_values(table, dtype, codes).index_select(0, flat).reshape(codes.shape)


def decode_values(table: DerivativeTable, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """``table.values`` as a tensor of ``dtype`` on ``like``'s device, the one :func:`decode` looks codes up in;
    made once per table, device and dtype (read-only)."""
    return reused(_cached_tensor, like, table.values, like.device, dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Quadrature: exact-as-float64 integrals of w, w f', w f'^2 over arbitrary intervals of the grid range.
# ---------------------------------------------------------------------------------------------------------------------

_GL_ORDER = 8
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(_GL_ORDER)

DEFAULT_GRID_STEP = 0.01
DEFAULT_RANGES: dict[str, tuple[float, float]] = {"normal": (-8.0, 8.0), "uniform": (-10.0, 10.0)}
_CD_SWEEPS = 4  # golden-section coordinate-descent sweeps (robust, handles kinks of f')
_GOLDEN_ITERS = 40
_NEWTON_ITERS = 25  # then Newton on the smooth boundaries (fast convergence along ill-conditioned directions)
_NEWTON_FD_STEP = 1e-6
_BOUNDARY_DECIMALS = 12  # refined boundaries are accurate to ~1e-13
# Error evaluation uses a finer grid than the DP (it costs O(n), not O(n^2)).
_EVAL_GRID_STEP = 0.0025


def _weight_np(weight: str, x: np.ndarray) -> np.ndarray:
    if weight == "normal":
        return np.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return np.ones_like(x)


class _Integrals:
    """Moments ``∫ w``, ``∫ w f'``, ``∫ w f'^2`` on a fine grid (Gauss-Legendre per cell), and on sub-intervals.

    Differences of prefix sums lose absolute precision ~eps * total, which matters in the tails of the normal weight
    (tiny masses near W ≈ 1): every interval integral is taken from the left prefix or the right suffix, whichever is
    smaller, so the error is ~eps * (mass on that side).
    """

    def __init__(self, name: str, weight: str, lo: float, hi: float, step: float) -> None:
        self.name = name
        self.weight = weight
        n = int(round((hi - lo) / step))
        grid = np.linspace(lo, hi, n + 1)
        extra = [b for b in _BREAKPOINTS.get(name, ()) if lo < b < hi]
        self.grid = np.unique(np.concatenate([grid, np.asarray(extra, dtype=np.float64)]))
        cells = self._segment(self.grid[:-1], self.grid[1:])  # (3, ncells)
        zero = np.zeros((3, 1))
        self.left = np.concatenate([zero, np.cumsum(cells, axis=1)], axis=1)  # ∫_{lo}^{t_i}
        self.right = np.concatenate([np.cumsum(cells[:, ::-1], axis=1)[:, ::-1], zero], axis=1)  # ∫_{t_i}^{hi}

    def _segment(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Gauss-Legendre integrals over ``[a, b]`` (elementwise, no breakpoint inside): shape (3, len(a))."""
        half = 0.5 * (b - a)
        mid = 0.5 * (b + a)
        x = mid[:, None] + half[:, None] * _GL_NODES[None, :]
        w = _weight_np(self.weight, x) * (half[:, None] * _GL_WEIGHTS[None, :])
        d = _derivative_np(self.name, x.reshape(-1)).reshape(x.shape)
        wd = w * d
        return np.stack([w.sum(axis=1), wd.sum(axis=1), (wd * d).sum(axis=1)])

    def _cell(self, x: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(self.grid, x, side="right") - 1, 0, len(self.grid) - 2)

    def interval(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Moments over ``[a, b]`` for arrays ``a <= b`` inside the grid range: shape (3, len(a))."""
        a = np.clip(np.asarray(a, dtype=np.float64), self.grid[0], self.grid[-1])
        b = np.clip(np.asarray(b, dtype=np.float64), self.grid[0], self.grid[-1])
        ja, jb = self._cell(a), self._cell(b)
        g = self.grid
        # One quadrature call for the four partial cells: [t_ja, a], [t_jb, b], [a, t_ja+1], [b, t_jb+1].
        part = self._segment(np.concatenate([g[ja], g[jb], a, b]), np.concatenate([a, b, g[ja + 1], g[jb + 1]]))
        pa, pb, qa, qb = np.split(part, 4, axis=1)
        # From the left: ∫_lo^b - ∫_lo^a, each as prefix + partial cell.
        left_b = self.left[:, jb] + pb
        left_a = self.left[:, ja] + pa
        # From the right: ∫_a^hi - ∫_b^hi, each as partial cell + suffix.
        right_a = self.right[:, ja + 1] + qa
        right_b = self.right[:, jb + 1] + qb
        use_left = left_b[0] <= right_a[0]
        out = np.where(use_left[None, :], left_b - left_a, right_a - right_b)
        return _clip_moments(out)


def _clip_moments(m: np.ndarray) -> np.ndarray:
    """Clamp the round-off negatives of the non-negative moments ``∫ w`` and ``∫ w f'^2`` (not ``∫ w f'``)."""
    m[0] = np.maximum(m[0], 0.0)
    m[2] = np.maximum(m[2], 0.0)
    return m


def _piece_cost(m: np.ndarray) -> np.ndarray:
    """Weighted squared error of the best constant on intervals with moments ``m`` (3, ...)."""
    w, wd, wd2 = m[0], m[1], m[2]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = wd2 - np.where(w > 0, wd * wd / w, 0.0)
    return np.maximum(cost, 0.0)


def _piece_values(ints: _Integrals, edges: np.ndarray) -> np.ndarray:
    m = ints.interval(edges[:-1], edges[1:])
    with np.errstate(divide="ignore", invalid="ignore"):
        vals = np.where(m[0] > 0, m[1] / m[0], np.nan)
    if np.isnan(vals).any():  # Zero-weight piece (only possible outside a uniform weight's support): use f' there.
        mid = 0.5 * (edges[:-1] + edges[1:])
        vals = np.where(np.isnan(vals), _derivative_np(ints.name, mid), vals)
    return vals


def _dp(ints: _Integrals, max_pieces: int) -> list[np.ndarray]:
    """The paper's dynamic programme on the grid, for every piece count up to ``max_pieces`` at once.

    ``DP(i, k) = min_{j<i} DP(j, k-1) + cost(j, i)`` where ``cost(j, i)`` is the error of the best constant on
    ``[t_j, t_i]``. Returns ``argmins`` with ``argmins[k-2][i]`` the optimal ``j`` for ``DP(i, k)``;
    see :func:`_backtrack`.
    """
    left, right = ints.left, ints.right
    n = left.shape[1]
    scale = float(left[2, -1]) if left[2, -1] > 0 else 1.0
    cost = np.empty((n, n))
    chunk = 256
    for j0 in range(0, n, chunk):
        rows = slice(j0, min(j0 + chunk, n))
        # Moments of [t_j, t_i], from whichever side has the smaller mass (see _Integrals).
        use_left = left[0][None, :] <= right[0][rows, None]  # [j, i]
        moments = np.where(
            use_left[None], left[:, None, :] - left[:, rows, None], right[:, rows, None] - right[:, None, :]
        )
        cost[rows] = _piece_cost(_clip_moments(moments))
    # Costs this small are round-off: make them exact zeros so ties are broken by index, not by noise.
    cost[cost < 1e-15 * scale] = 0.0
    cost[np.tril_indices(n)] = np.inf  # a piece [t_j, t_i] needs j < i
    dp = cost[0].copy()  # DP(i, 1): one piece on [t_0, t_i]
    cols = np.arange(n)
    argmins = []
    for _ in range(2, max_pieces + 1):
        total = dp[:, None] + cost
        arg = np.argmin(total, axis=0)
        dp = total[arg, cols]
        argmins.append(arg)
    return argmins


def _backtrack(argmins: list[np.ndarray], pieces: int) -> np.ndarray:
    """Grid indices of the ``pieces - 1`` interior boundaries of the optimal ``pieces``-piece approximation."""
    i = len(argmins[0]) - 1
    idx = []
    for arg in reversed(argmins[: pieces - 1]):
        i = int(arg[i])
        idx.append(i)
    return np.asarray(idx[::-1], dtype=np.int64)


def _local_loss(ints: _Integrals, lo_edge: np.ndarray, x: np.ndarray, hi_edge: np.ndarray) -> np.ndarray:
    """``cost(lo_edge, x) + cost(x, hi_edge)`` elementwise (one quadrature call)."""
    cost = _piece_cost(ints.interval(np.concatenate([lo_edge, x]), np.concatenate([x, hi_edge])))
    left, right = np.split(cost, 2)
    return left + right


def _coordinate_descent(ints: _Integrals, s: np.ndarray, sweeps: int) -> np.ndarray:
    """Red-black coordinate descent on the continuous boundaries, each moved within ±(grid step) per sweep.

    Each boundary minimises the exact objective ``cost(s_{i-1}, s_i) + cost(s_i, s_{i+1})`` (optimal values on both
    neighbouring pieces) by golden-section search; a move is kept only if it lowers the loss.
    """
    lo, hi = ints.grid[0], ints.grid[-1]
    h = float(np.max(np.diff(ints.grid)))
    invphi = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(sweeps):
        moved = 0.0
        for parity in (0, 1):
            idx = np.arange(parity, s.size, 2)
            if idx.size == 0:
                continue
            edges = np.concatenate([[lo], s, [hi]])
            prev, cur, nxt = edges[idx], edges[idx + 1], edges[idx + 2]
            a = np.maximum(cur - h, 0.5 * (prev + cur))
            b = np.minimum(cur + h, 0.5 * (cur + nxt))
            c = b - invphi * (b - a)
            d = a + invphi * (b - a)
            fc = _local_loss(ints, prev, c, nxt)
            fd = _local_loss(ints, prev, d, nxt)
            for _ in range(_GOLDEN_ITERS):
                go_left = fc < fd
                b = np.where(go_left, d, b)
                a = np.where(go_left, a, c)
                # Reuse the surviving interior point; evaluate only the new one.
                c_next = np.where(go_left, b - invphi * (b - a), d)
                d_next = np.where(go_left, c, a + invphi * (b - a))
                fp = _local_loss(ints, prev, np.where(go_left, c_next, d_next), nxt)
                fc, fd = np.where(go_left, fp, fd), np.where(go_left, fc, fp)
                c, d = c_next, d_next
            cand = 0.5 * (a + b)
            f_old = _local_loss(ints, prev, cur, nxt)
            f_new = _local_loss(ints, prev, cand, nxt)
            new = np.where(f_new < f_old, cand, cur)
            moved = max(moved, float(np.max(np.abs(new - cur))))
            s[idx] = new
        if moved < 1e-12:
            break
    return s


def _edges(ints: _Integrals, s: np.ndarray) -> np.ndarray:
    return np.concatenate([[ints.grid[0]], s, [ints.grid[-1]]])


def _total_loss(ints: _Integrals, s: np.ndarray) -> float:
    e = _edges(ints, s)
    return float(_piece_cost(ints.interval(e[:-1], e[1:])).sum())


def _gradient(ints: _Integrals, s: np.ndarray) -> np.ndarray:
    """``dL/ds_k = w(s_k) [(f'(s_k) - y_{k-1})^2 - (f'(s_k) - y_k)^2]`` with optimal values ``y`` (paper eq. 5)."""
    e = _edges(ints, s)
    m = ints.interval(e[:-1], e[1:])
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(m[0] > 0, m[1] / np.where(m[0] > 0, m[0], 1.0), 0.0)
    d = _derivative_np(ints.name, s)
    return _weight_np(ints.weight, s) * ((d - y[:-1]) ** 2 - (d - y[1:]) ** 2)


def _newton(ints: _Integrals, s: np.ndarray) -> np.ndarray:
    """Damped Newton on the boundaries away from kinks of ``f'``, analytic gradient, finite-difference Hessian.

    The Hessian of ``L(s, y(s))`` is tridiagonal, so three gradient differences (boundaries perturbed in classes
    ``k mod 3``) give all of it. Stops when the Hessian is not positive definite, the line search cannot lower the
    loss (round-off level), or the step is below 1e-13.
    """
    free = np.ones(s.size, dtype=bool)
    for bp in _BREAKPOINTS.get(ints.name, ()):
        free &= np.abs(s - bp) > 1e-9  # a boundary sitting on a jump of f': the objective is not smooth there
    fidx = np.flatnonzero(free)
    m = fidx.size
    if m == 0:
        return s
    eps = _NEWTON_FD_STEP
    loss = _total_loss(ints, s)
    for _ in range(_NEWTON_ITERS):
        g = _gradient(ints, s)[fidx]
        hess = np.zeros((m, m))
        for c in range(3):
            cols = np.arange(c, m, 3)
            if cols.size == 0:
                continue
            sp, sm = s.copy(), s.copy()
            sp[fidx[cols]] += eps
            sm[fidx[cols]] -= eps
            dg = (_gradient(ints, sp) - _gradient(ints, sm))[fidx] / (2.0 * eps)
            for k in cols:
                for j in (k - 1, k, k + 1):
                    # Only neighbours in s are coupled: frozen boundaries in between break the chain.
                    if 0 <= j < m and abs(fidx[j] - fidx[k]) <= 1:
                        hess[j, k] = dg[j]
        hess = 0.5 * (hess + hess.T)
        try:
            np.linalg.cholesky(hess)
        except np.linalg.LinAlgError:
            break
        step = np.zeros_like(s)
        step[fidx] = -np.linalg.solve(hess, g)
        gnorm = float(np.abs(g).max())
        alpha, accepted = 1.0, False
        while alpha >= 1.0 / 64:
            cand = s + alpha * step
            if np.all(np.diff(_edges(ints, cand)) > 0):
                cand_loss = _total_loss(ints, cand)
                # Near the optimum L is flat below round-off: then a smaller gradient decides.
                if cand_loss < loss or (
                    cand_loss <= loss + 1e-13 * abs(loss) and float(np.abs(_gradient(ints, cand)[fidx]).max()) < gnorm
                ):
                    accepted = True
                    break
            alpha *= 0.5
        if not accepted:
            break
        s, loss = cand, min(loss, cand_loss)
        if float(np.max(np.abs(alpha * step))) < 1e-13:
            break
    return s


def _refine(ints: _Integrals, s: np.ndarray) -> np.ndarray:
    """Continuous refinement of grid-optimal boundaries: a few coordinate-descent sweeps, then damped Newton.

    Deterministic; never increases the loss.
    """
    s = s.astype(np.float64).copy()
    if s.size == 0:
        return s
    s = _coordinate_descent(ints, s, _CD_SWEEPS)
    return _newton(ints, s)


def _rms_error(name: str, boundaries: np.ndarray, values: np.ndarray) -> float:
    """``sqrt(∫ (f' - g)^2 φ)`` for a piecewise-constant ``g``, integrated on [-8, 8] (the rest is below 1e-15).

    Direct Gauss-Legendre quadrature of ``(f' - y_i)^2 φ`` on a fine grid refined with the boundaries (no
    moment cancellation, so an exact table gives 0 up to ~1e-16).
    """
    lo, hi = DEFAULT_RANGES["normal"]
    b = np.asarray(boundaries, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    grid = np.linspace(lo, hi, int(round((hi - lo) / _EVAL_GRID_STEP)) + 1)
    kinks = [p for p in _BREAKPOINTS.get(name, ()) if lo < p < hi]
    pts = np.unique(np.concatenate([grid, b[(b > lo) & (b < hi)], np.asarray(kinks, dtype=np.float64)]))
    a, c = pts[:-1], pts[1:]
    piece = np.searchsorted(b, 0.5 * (a + c), side="right")  # cells never straddle a boundary
    half, mid = 0.5 * (c - a), 0.5 * (c + a)
    x = mid[:, None] + half[:, None] * _GL_NODES[None, :]
    w = _weight_np("normal", x) * (half[:, None] * _GL_WEIGHTS[None, :])
    diff = _derivative_np(name, x.reshape(-1)).reshape(x.shape) - v[piece][:, None]
    return math.sqrt(float((w * diff * diff).sum()))


@functools.lru_cache(maxsize=64)
def _optimal_tables(
    name: str, weight: str, lo: float, hi: float, grid_step: float, refine: bool
) -> tuple[DerivativeTable, ...]:
    """Tables for every bit width in :data:`SUPPORTED_BITS` (one DP serves them all)."""
    ints = _Integrals(name, weight, lo, hi, grid_step)
    argmins = _dp(ints, 1 << max(SUPPORTED_BITS))
    tables = []
    for bits in SUPPORTED_BITS:
        s = ints.grid[_backtrack(argmins, 1 << bits)]
        if refine:
            s = _refine(ints, s)
        # Snap round-off (e.g. 4e-16 for a boundary that is 0 by symmetry) so ties at x == boundary are stable.
        s = np.round(s, _BOUNDARY_DECIMALS) + 0.0
        vals = _piece_values(ints, np.concatenate([[lo], s, [hi]]))
        tables.append(
            DerivativeTable(
                name=name,
                bits=bits,
                boundaries=tuple(float(v) for v in s),
                values=tuple(float(v) for v in vals),
                rms_error=_rms_error(name, s, vals),
            )
        )
    return tuple(tables)


def optimal_table(
    name: str,
    bits: int,
    *,
    weight: str = "normal",
    x_range: tuple[float, float] | None = None,
    grid_step: float = DEFAULT_GRID_STEP,
    refine: bool = True,
) -> DerivativeTable:
    """Compute the optimal ``bits``-bit table for ``name`` (dynamic programme + local refinement; deterministic).

    Args:
        name: One of :data:`SUPPORTED_ACTIVATIONS`.
        bits: Code width, 1..4 (``2**bits`` pieces).
        weight: ``"normal"`` (standard normal pdf, the shipped tables) or ``"uniform"`` (indicator of ``x_range``,
            the paper's choice).
        x_range: Grid range ``(lo, hi)``; defaults to ``(-8, 8)`` for ``"normal"`` and ``(-10, 10)`` for
            ``"uniform"``. The weight is treated as zero outside it; the outermost pieces still extend to ±inf.
        grid_step: DP grid spacing (discontinuities of ``f'`` are always added as grid points).
        refine: Run the continuous boundary refinement after the DP.

    Returns:
        The table; its ``rms_error`` is measured under the standard normal weight regardless of ``weight``.

    Raises:
        ActHFValueError: Unknown ``name``/``weight`` or unsupported ``bits`` (a ``ValueError``).
    """
    _check_name(name)
    _check_bits(bits)
    if weight not in DEFAULT_RANGES:
        raise ActHFValueError(f"weight={weight!r} is not supported; allowed values: {', '.join(DEFAULT_RANGES)}")
    lo, hi = x_range if x_range is not None else DEFAULT_RANGES[weight]
    if not (lo < hi) or not (0 < grid_step < hi - lo):
        raise ActHFValueError(f"x_range={x_range!r} / grid_step={grid_step!r} do not describe a valid grid")
    return _optimal_tables(name, weight, float(lo), float(hi), float(grid_step), bool(refine))[bits - 1]


# ---------------------------------------------------------------------------------------------------------------------
# Shipped tables (JSON).
# ---------------------------------------------------------------------------------------------------------------------

_FORMAT_VERSION = 1
_TABLES_FILE = "fewbit_tables.json"


def _default_path() -> Path:
    return Path(__file__).resolve().parent / "data" / _TABLES_FILE


def _generator_settings() -> dict:
    lo, hi = DEFAULT_RANGES["normal"]
    return {
        "weight": "normal",
        "range": [lo, hi],
        "grid_step": DEFAULT_GRID_STEP,
        "grid_points": int(round((hi - lo) / DEFAULT_GRID_STEP)) + 1,
        "breakpoints": {k: list(v) for k, v in _BREAKPOINTS.items()},
        "quadrature": f"gauss-legendre-{_GL_ORDER} per grid cell",
        "refine": f"{_CD_SWEEPS} golden-section coordinate-descent sweeps, then damped Newton",
        "rms_eval_grid_step": _EVAL_GRID_STEP,
        "boundary_decimals": _BOUNDARY_DECIMALS,
        "rms_error": "sqrt(integral (f' - g)^2 * normal_pdf)",
        "boundary_convention": "piece i covers [boundaries[i-1], boundaries[i]); torch.bucketize(right=True)",
    }


def build_tables() -> dict:
    """All shipped tables as the JSON-ready document written by :func:`write_tables`."""
    tables: dict[str, dict[str, dict]] = {}
    for name in SUPPORTED_ACTIVATIONS:
        tables[name] = {}
        for bits in SUPPORTED_BITS:
            t = optimal_table(name, bits)
            tables[name][str(bits)] = {
                "boundaries": list(t.boundaries),
                "values": list(t.values),
                "rms_error": t.rms_error,
            }
    return {"format_version": _FORMAT_VERSION, "generator": _generator_settings(), "tables": tables}


def write_tables(path: str | Path | None = None) -> None:
    """Regenerate every table and write the JSON (sorted keys, floats as shortest round-trip ``repr``).

    Args:
        path: Output file; defaults to ``act_hf/data/fewbit_tables.json`` next to this module.
    """
    path = Path(path) if path is not None else _default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = build_tables()
    text = json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n"
    path.write_text(text, encoding="utf-8")
    logger.info("wrote %d few-bit tables to %s", sum(len(v) for v in doc["tables"].values()), path)


@functools.lru_cache(maxsize=1)
def _load_tables() -> dict:
    resource = importlib.resources.files("act_hf").joinpath("data", _TABLES_FILE)
    doc = json.loads(resource.read_text(encoding="utf-8"))
    if doc.get("format_version") != _FORMAT_VERSION:
        raise ActHFValueError(f"{_TABLES_FILE}: unsupported format_version {doc.get('format_version')!r}")
    return doc["tables"]


def get_table(name: str, bits: int) -> DerivativeTable:
    """The shipped ``bits``-bit table for ``name`` (loaded once from ``act_hf/data/fewbit_tables.json``).

    Args:
        name: One of :data:`SUPPORTED_ACTIVATIONS`.
        bits: 1, 2, 3 or 4.

    Returns:
        The cached :class:`DerivativeTable`.

    Raises:
        ActHFValueError: Unknown ``name`` (the message lists the supported names) or ``bits`` outside 1..4 (a
            ``ValueError``).
    """
    return _get_table_cached(_check_name(name), _check_bits(bits))


@functools.cache
def _get_table_cached(name: str, bits: int) -> DerivativeTable:
    entry = _load_tables()[name][str(bits)]
    return DerivativeTable(
        name=name,
        bits=bits,
        boundaries=tuple(float(v) for v in entry["boundaries"]),
        values=tuple(float(v) for v in entry["values"]),
        rms_error=float(entry["rms_error"]),
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m act_hf.fewbit [--write] [--path P]``; prints the RMS error of every table."""
    parser = argparse.ArgumentParser(prog="python -m act_hf.fewbit", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate the tables JSON (else print shipped errors)")
    parser.add_argument("--path", default=None, help="output path (default: act_hf/data/fewbit_tables.json)")
    args = parser.parse_args(argv)
    if args.write:
        start = time.perf_counter()
        write_tables(args.path)
        print(f"wrote {args.path or _default_path()} in {time.perf_counter() - start:.1f} s")
        errors = {n: [optimal_table(n, b).rms_error for b in SUPPORTED_BITS] for n in SUPPORTED_ACTIVATIONS}
    else:
        errors = {n: [get_table(n, b).rms_error for b in SUPPORTED_BITS] for n in SUPPORTED_ACTIVATIONS}
    print("rms error     " + "".join(f"{b:>9d}-bit" for b in SUPPORTED_BITS))
    for name, errs in errors.items():
        print(f"{name:<14}" + "".join(f"{e:>13.5f}" for e in errs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
