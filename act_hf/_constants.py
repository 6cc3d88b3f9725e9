"""Small constant tensors (lookup tables, fixed statistics) made once per device and reused by later calls."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["reused", "zero_scalar", "zeros_and_ones"]


def reused(cached: Any, like: torch.Tensor, *args: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``cached(*args)``, ``cached`` being a ``functools.lru_cache``'d maker of constant tensors, when ``like`` (the
    tensor they will meet) is a plain tensor outside torch.compile's tracing; else ``cached.__wrapped__(*args)``,
    made anew: a fake or traced tensor must never be kept for later calls."""
    plain = type(like) is torch.Tensor and not torch.compiler.is_compiling()
    return (cached if plain else cached.__wrapped__)(*args)


@functools.lru_cache(maxsize=64)
def _make_zero_scalar(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device)


def zero_scalar(like: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero of ``like``'s dtype on its device, made once per device and dtype (on a GPU ``new_zeros(())``
    launches a fill kernel every time): the other operand of a ``where``, or expanded as a stand-in whose values are
    never read. Read-only."""
    return reused(_make_zero_scalar, like, like.device, like.dtype)


@functools.lru_cache(maxsize=64)
def _make_zeros_and_ones(shape: tuple[int, ...], device: torch.device,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(shape, device=device, dtype=dtype), torch.ones(shape, device=device, dtype=dtype)


def zeros_and_ones(shape: tuple[int, ...], like: torch.Tensor,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(zeros, ones)`` of ``shape`` in ``dtype`` (default: ``like``'s) on ``like``'s device, made once per shape,
    device and dtype for plain tensors (a fake or traced ``like`` gets new ones): the statistics of an input already
    normalized, the factors of a term that has none. Read-only."""
    return reused(_make_zeros_and_ones, like, tuple(shape), like.device, like.dtype if dtype is None else dtype)
