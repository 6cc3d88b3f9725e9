"""act_hf's own random stream for stochastic rounding.

Stochastic rounding must never draw from the global torch RNG: that would shift dropout masks and make a
patched model's training forward differ from the unpatched one. Each quantization call takes one 63-bit seed
from act_hf's private CPU generator (a host-side draw: no device synchronisation); the per-element uniforms
are then a counter-based hash of ``(seed, element index)`` (see ``reference.uniform_from_hash``), identical in
the PyTorch reference and the CUDA kernel.

Seeding: by default the private generator follows ``torch.initial_seed()`` (read, never consumed), so
``torch.manual_seed(s)`` / ``transformers.set_seed(s)`` make act_hf's draws reproducible too; the process
rank is mixed in under ``torch.distributed`` so data-parallel ranks draw independent rounding noise.
``act_hf.manual_seed(s)`` pins the stream explicitly and stops following torch.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["manual_seed", "next_seed", "resolve_seed"]

_MASK63 = (1 << 63) - 1
_lock = threading.Lock()
_generator = torch.Generator(device="cpu")
_followed_torch_seed: int | None = None
_pinned = False
#: seeds drawn ahead, next one last: one ``randint`` of 256 draws the same values as 256 draws of one (a tensor
#: op and ``.item()`` cost about 11 us; a patched training step takes hundreds of seeds)
_ahead: list[int] = []
_AHEAD = 256


def _rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def manual_seed(seed: int) -> None:
    """Pin act_hf's rounding stream to ``seed`` (independent of torch's global seed from now on)."""
    global _pinned
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    with _lock:
        _generator.manual_seed(seed & _MASK63)
        _ahead.clear()
        _pinned = True


def next_seed() -> int:
    """Draw the next 63-bit seed from act_hf's private stream."""
    global _followed_torch_seed
    with _lock:
        if not _pinned:
            torch_seed = torch.initial_seed()
            if torch_seed != _followed_torch_seed:
                _generator.manual_seed((torch_seed * 0x9E3779B1 + 0x5851F42D * (_rank() + 1)) & _MASK63)
                _ahead.clear()
                _followed_torch_seed = torch_seed
        if not _ahead:
            _ahead.extend(reversed(torch.randint(0, _MASK63, (_AHEAD,), generator=_generator).tolist()))
        return _ahead.pop()


def resolve_seed(seed: int | torch.Generator | None) -> int:
    """Turn the ``seed`` argument of :func:`act_hf.compress.quantize` into a 63-bit integer seed.

    Args:
        seed: ``None`` (next draw of act_hf's stream), an ``int`` (used as is: the same draws every time) or a
            CPU ``torch.Generator`` (one draw from it).
    """
    if seed is None:
        return next_seed()
    if isinstance(seed, torch.Generator):
        if seed.device.type != "cpu":
            raise ValueError(f"seed: a torch.Generator must be a CPU generator, got one on {seed.device}")
        return int(torch.randint(0, _MASK63, (1,), generator=seed).item())
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed & _MASK63
    raise TypeError(f"seed must be None, an int or a torch.Generator, got {type(seed).__name__}")
