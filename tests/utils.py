"""Test helpers shared by the suite."""

from __future__ import annotations

import math

import torch


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20*log10(|ref| / |ref - approx|)`` (inf when equal)."""
    ref = ref.double()
    err = (ref - approx.double()).norm().item()
    return math.inf if err == 0 else 20 * math.log10(ref.norm().item() / err)


def assert_verbose_allclose(actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 0, rtol: float = 0,
                            equal_nan: bool = False, name: str = "tensor") -> None:
    """``torch.allclose`` that reports the mismatch count, the first indices and NaN/Inf differences."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    close = torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=equal_nan)
    if bool(close.all()):
        return
    bad = (~close).nonzero()[:5].tolist()
    diff = (a - e).abs()
    finite = torch.isfinite(diff)
    msg = (
        f"{name}: {int((~close).sum())}/{close.numel()} mismatched; first at {bad}; "
        f"max abs diff {diff[finite].max().item() if finite.any() else 'n/a'}; "
        f"NaN actual/expected {int(a.isnan().sum())}/{int(e.isnan().sum())}, "
        f"Inf actual/expected {int(a.isinf().sum())}/{int(e.isinf().sum())}"
    )
    raise AssertionError(msg)
