"""The guard of the output-form norm context: is every ``|gamma|`` large enough to divide by?

Its answer needs the device's values on the host: one device sync. Asked per norm module and per weight version
(the modules' ``cache=True``), a training step would sync once per norm after every optimizer step (bert-large:
49 times), and each sync drains the GPU's queue. So a cached question that misses answers every remembered
weight that changed since its last answer, together: one sync per device for all of a model's norms, the first
time any of them runs after an optimizer step.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict

import torch
from torch import Tensor

__all__ = ["output_context_safe"]

logger = logging.getLogger(__name__)

#: id(weight) -> (weakref, state, (offset, gamma_eps), answer); ``state`` tells whether the values may have changed
_ANSWERS: dict[int, tuple[weakref.ref, tuple[int, int], tuple[float, float], bool]] = {}


def output_context_safe(weight: Tensor | None, *, offset: float = 0.0, gamma_eps: float, cache: bool = False) -> bool:
    """Whether ``x_hat = (y - beta) / (weight + offset)`` is well conditioned for every feature.

    True when ``weight`` is ``None`` or every ``|weight + offset| >= gamma_eps * max|weight + offset|`` (and the
    maximum is non-zero and finite). One host-device sync. With ``cache=True`` the answer is kept per weight
    tensor until its version counter or storage changes (an optimizer step, a move), and a miss also re-answers
    every other cached weight that changed, in the same sync.
    """
    if weight is None:
        return True
    params = (float(offset), float(gamma_eps))
    if not cache:
        return _answers([(weight, params)])[0]
    entry = _ANSWERS.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1] == _state(weight) and entry[2] == params:
        return entry[3]
    due = [(weight, params)]
    for ref, state, old_params, _ in list(_ANSWERS.values()):
        other = ref()
        if other is not None and other is not weight and _state(other) != state:
            due.append((other, old_params))
    for (w, p), ok in zip(due, _answers(due)):
        wid = id(w)
        _ANSWERS[wid] = (weakref.ref(w, lambda _r, wid=wid: _ANSWERS.pop(wid, None)), _state(w), p, ok)
    return _ANSWERS[id(weight)][3]


def _state(weight: Tensor) -> tuple[int, int]:
    """The version counter, and for a plain tensor its data pointer (a tensor subclass may have no storage)."""
    return weight._version, weight.data_ptr() if type(weight) in (Tensor, torch.nn.Parameter) else 0


def _answers(items: list[tuple[Tensor, tuple[float, float]]]) -> list[bool]:
    """The guard's answer for each ``(weight, (offset, gamma_eps))``: weights of one device, size and parameters
    are stacked and reduced together; one host transfer per device."""
    groups: dict[torch.device, dict[tuple, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (w, params) in enumerate(items):
        groups[w.device][(w.numel(), params)].append(i)
    answers = [False] * len(items)
    with torch.no_grad():
        for by_kind in groups.values():
            order, flags = [], []
            for (_, (offset, gamma_eps)), indices in by_kind.items():
                g = torch.stack([items[i][0].detach().reshape(-1).float() for i in indices])
                g = (g + offset).abs() if offset else g.abs()
                top, low = g.amax(dim=1), g.amin(dim=1)
                flags.append(torch.isfinite(top) & (top > 0) & (low >= gamma_eps * top))
                order += indices
            for i, ok in zip(order, torch.cat(flags).tolist()):
                answers[i] = ok
                if not ok:
                    logger.debug("a norm weight has |gamma| below %g of its max: saving the input instead of the "
                                 "output", items[i][1][1])
    return answers
