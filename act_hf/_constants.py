"""Small constant tensors (lookup tables, fixed statistics) made once per device and reused by later calls."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["reused"]


def reused(cached: Any, like: torch.Tensor, *args: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``cached(*args)``, ``cached`` being a ``functools.lru_cache``'d maker of constant tensors, when ``like`` (the
    tensor they will meet) is a plain tensor outside torch.compile's tracing; else ``cached.__wrapped__(*args)``,
    made anew: a fake or traced tensor must never be kept for later calls."""
    plain = type(like) is torch.Tensor and not torch.compiler.is_compiling()
    return (cached if plain else cached.__wrapped__)(*args)
