"""Adaptive bits: per-slot sensitivity, the greedy allocation under an average budget, and the variance alarm.

With ``act_hf.patch(model, bits=2.5)`` the 2.5 is an average budget over every quantized slot, weighted by
the number of elements it stores. The :class:`BitAllocator` attached to the model distributes it:

1. **Sensitivity** (GACT, Sec. 4.2). Compressing slot group ``l`` at ``b`` bits adds gradient variance
   ``c_l * S(b)`` with ``S(b) = (2^b - 1)^-2``, and the groups' contributions add up. GACT measures ``c_l`` as
   ``0.5 * ||g0 - g1||^2 / S(b_l)`` from two gradients that differ only in group ``l``'s random rounding, at
   the price of two forward/backward passes per tensor. act_hf runs **one** forward on a few samples of a
   captured batch, in which every quantized tensor is drawn twice (:meth:`ContextStore.probing`), and one
   backward for ``g0``. For group ``l`` only the ops that saved its tensors read them, so ``g1 - g0`` is
   those ops' backward re-run on the gradients they received, with the second draw swapped in
   (:meth:`ContextStore.resolve`), minus the same with the first, carried down to the parameters by a
   backward from those ops only: the same minibatch, dropout masks and other draws, so it is exactly group
   ``l``'s compression noise (to first order, GACT's own linearisation). A group read only by Linears (their
   input gradient never reads the saved input) costs one weight-gradient product; a group that a saved-tensor
   hook of the generic fallback reads takes a whole backward pass. Cost: one forward, one backward and about
   half a backward per group, on ``adapt_samples`` samples, instead of two full forward/backward passes per
   group on the whole batch.
2. **Allocation** (:func:`allocate_bits`): greedy from 1 bit, always adding the bit with the largest variance
   reduction per stored element, until the next bit would overshoot the budget (met from below);
   deterministic given the sensitivities.
3. **Alarm**: the compression variance ``sum_l c_l S(b_l)`` against the minibatch gradient variance,
   measured on the same samples from the difference of the gradients of their two halves at 8 bits. When the
   ratio exceeds ``ActConfig.variance_alarm`` the allocator warns (GACT's a-posteriori failure predictor):
   raise the budget.

Groups: slots that quantize the same tensor share it in the context store (a LayerNorm output read by Q, K
and V), so they form one group and always get the same bits.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from .config import ActConfig
from .context import store
from .errors import ActHFValueError, ActHFWarning

__all__ = ["BitAllocator", "SlotGroup", "allocate_bits", "variance_factor"]

logger = logging.getLogger(__name__)

MIN_BITS, MAX_BITS = 1, 8


def variance_factor(bits: int) -> float:
    """``S(b) = (2^b - 1)^-2``: how the variance of stochastic rounding scales with the bit width."""
    return (2.0**bits - 1.0) ** -2


def allocate_bits(sensitivity: Mapping[str, float], numel: Mapping[str, int], budget: float, *,
                  min_bits: int = MIN_BITS, max_bits: int = MAX_BITS) -> dict[str, int]:
    """Bits per group minimising ``sum c_l S(b_l)`` subject to ``sum b_l n_l <= budget * sum n_l``.

    Greedy (ActNN's and GACT's solver): every group starts at ``min_bits``; the next bit goes to the group with
    the largest variance reduction per element, ``c_l (S(b_l) - S(b_l + 1)) / n_l``, ties broken by name, as
    long as it fits in the budget. The budget is met from below, and the result depends only on the inputs.

    Args:
        sensitivity: ``c_l`` per group (>= 0).
        numel: elements stored per group (> 0); the budget is weighted by them.
        budget: the average bits per element, ``min_bits <= budget <= max_bits``.
    """
    if set(sensitivity) != set(numel):
        raise ActHFValueError("sensitivity and numel must have the same groups")
    if not min_bits <= budget <= max_bits:
        raise ActHFValueError(f"budget must be between {min_bits} and {max_bits} bits, got {budget}")
    bits = {name: min_bits for name in numel}
    capacity = budget * sum(numel.values())
    used = float(min_bits * sum(numel.values()))

    def gain(name: str) -> float:
        b = bits[name]
        return sensitivity[name] * (variance_factor(b) - variance_factor(b + 1)) / numel[name]

    heap = [(-gain(name), name) for name in sorted(numel) if numel[name] > 0]
    heapq.heapify(heap)
    while heap:
        _, name = heapq.heappop(heap)
        if used + numel[name] > capacity * (1 + 1e-12):
            continue  # does not fit now, nor later (used only grows); smaller groups may
        bits[name] += 1
        used += numel[name]
        if bits[name] < max_bits:
            heapq.heappush(heap, (-gain(name), name))
    return bits


@dataclass
class SlotGroup:
    """Slots quantizing the same tensors, allocated together.

    Attributes:
        slots: slot names (``<module path>:<role>``).
        numel: elements the group quantized in the probe.
        sensitivity: ``c_l``, the gradient variance per unit ``S(b)`` (GACT's ``c_l``).
        bits: the allocated width.
    """

    slots: list[str]
    numel: int
    sensitivity: float
    bits: int


def _batch_size(obj: Any) -> int | None:
    t = _first_tensor(obj, lambda t: t.dim() > 0)
    return None if t is None else t.shape[0]


def _take(obj: Any, sl: slice, batch: int) -> Any:
    """``obj`` with every tensor whose first dimension is the batch sliced along it."""
    if isinstance(obj, torch.Tensor):
        return obj[sl] if obj.dim() > 0 and obj.shape[0] == batch else obj
    if isinstance(obj, Mapping):
        return {k: _take(v, sl, batch) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_take(v, sl, batch) for v in obj)
    if isinstance(obj, list):
        return [_take(v, sl, batch) for v in obj]
    return obj


def _first_tensor(obj: Any, accept: Callable[[torch.Tensor], bool] = lambda t: True) -> torch.Tensor | None:
    """The first tensor (depth first through tuples, lists and mappings) that ``accept`` takes."""
    if isinstance(obj, torch.Tensor):
        return obj if accept(obj) else None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = _first_tensor(item, accept)
            if t is not None:
                return t
    return None


def _loss_of(output: Any) -> torch.Tensor | None:
    """The training loss in a model output: ``output.loss`` (HF with labels), ``output["loss"]``, or a
    scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    return loss


def _squared_distance(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> torch.Tensor:
    """``sum ||x - y||^2`` over paired tensors (a missing one counts as zero), in float64 on the tensors' device:
    no host sync here, callers read all distances at once."""
    terms = [(x.double() if y is None else x.double() - y.double()) if x is not None else y.double()
             for x, y in zip(a, b) if x is not None or y is not None]
    if not terms:
        return torch.zeros((), dtype=torch.float64)
    device = terms[0].device
    return torch.stack([t.pow(2).sum().to(device) for t in terms]).sum()


class BitAllocator:
    """The adaptive-bits state of one patched model: groups, sensitivities, allocation, alarm and cost.

    ``act_hf.patch(model, bits=2.5)`` creates one as ``model.act_hf_allocator`` and hooks it to the model's
    forward: the first training forward, and then every ``config.adapt_interval``-th after the last update (an
    explicit :meth:`update_batch` counts), first runs the probe on
    ``config.adapt_samples`` samples of its own batch (the loss is the output's ``loss``, so HF models need
    labels in the batch; for other models call :meth:`update_batch` with a loss function). Inside
    ``transformers.Trainer``, :class:`act_hf.ActCompressCallback` schedules the updates by optimizer step
    instead (``automatic = False``) and saves this state with the checkpoints.

    Attributes:
        budget: the average bits per stored element.
        groups: name -> :class:`SlotGroup` from the last update.
        variance_ratio: compression gradient variance / minibatch gradient variance at the last update (None
            before one, or when the probe had a single sample).
        updates: how many allocations were made.
        probe_seconds: wall time spent in probes (sensitivity, allocation, alarm).
        automatic: update from the forward hook every ``adapt_interval`` training forwards.
        whole_backward: measure every group with a whole backward pass (GACT's Algorithm 1 on one shared
            forward) instead of the local difference; slower, the reference the local difference is tested
            against.
    """

    whole_backward: bool = False

    def __init__(self, model: nn.Module, config: ActConfig) -> None:
        if not config.adaptive:
            raise ActHFValueError(f"a BitAllocator needs a float bits budget (e.g. 2.5 or 2.0), got {config.bits!r}")
        self.model = model
        self.config = config
        self.slot_bits: dict[str, int] = model.act_hf_slot_bits  # the model's table, which its modules read
        self.budget = float(config.bits)
        self.groups: dict[str, SlotGroup] = {}
        self.variance_ratio: float | None = None
        self.updates = 0
        self.probe_seconds = 0.0
        self.automatic = True
        self.loss_fn: Callable[[Any], torch.Tensor] | None = None
        self._forwards = 0
        self._updated_at: int | None = None  # self._forwards at the last update
        self._due = True
        self._busy = False
        self._started: float | None = None
        self._warned_no_loss = False
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    # -- scheduling ----------------------------------------------------------------------------------------
    @property
    def probing(self) -> bool:
        """True while the probe runs its own forwards (other forward hooks should ignore them)."""
        return self._busy

    def request_update(self) -> None:
        """Re-allocate before the next training forward."""
        self._due = True

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy or not module.training or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        if self._started is None:
            self._started = time.perf_counter()
        if self.automatic and (self._updated_at is None
                               or self._forwards - self._updated_at >= self.config.adapt_interval):
            self._due = True
        if self._due:
            self._due = False
            self.update(self._closure(module, args, kwargs))
        self._forwards += 1

    def _closure(self, module: nn.Module, args: tuple, kwargs: dict) -> Callable[..., torch.Tensor]:
        def compute_loss(batch: tuple[tuple, dict]) -> torch.Tensor:
            output = module(*batch[0], **batch[1])
            if self.loss_fn is not None:
                return self.loss_fn(output)
            loss = _loss_of(output)
            if loss is None:
                if not self._warned_no_loss:
                    warnings.warn(
                        f"act_hf adaptive bits: {type(module).__name__}'s output has no loss (pass labels to HF "
                        "models, set model.act_hf_allocator.loss_fn, or call model.act_hf_allocator.update_batch "
                        "yourself); the probe uses the mean squared output as a stand-in loss",
                        ActHFWarning, stacklevel=2,
                    )
                    self._warned_no_loss = True
                loss = _first_tensor(output).float().pow(2).mean()
            return loss

        return self._batch_closure((args, kwargs), compute_loss)

    def _batch_closure(self, batch: Any, compute_loss: Callable[[Any], torch.Tensor]) -> Callable[..., torch.Tensor]:
        size = _batch_size(batch)
        n = min(self.config.adapt_samples, size) if size else None
        sub = batch if n is None else _take(batch, slice(0, n), size)

        def run(part: slice | None = None) -> torch.Tensor:
            return compute_loss(sub if part is None else _take(sub, part, n))

        run.samples = n  # type: ignore[attr-defined]
        return run

    def update_batch(self, batch: Any, compute_loss: Callable[[Any], torch.Tensor]) -> dict[str, SlotGroup]:
        """Re-allocate from a training batch: ``compute_loss(part)`` runs the training forward on ``part``, the
        batch cut to ``config.adapt_samples`` samples (every tensor in the tuple/dict/list ``batch`` whose first
        dimension is the batch size is sliced), and returns the loss.

        Example (a timm model)::

            allocator.update_batch((images, targets), lambda b: criterion(model(b[0]), b[1]))
        """
        return self.update(self._batch_closure(batch, compute_loss))

    # -- the probe -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _isolated(self) -> Iterator[None]:
        """Run the probe without touching training: RNG streams, buffers (BatchNorm statistics) restored."""
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        devices = sorted({b.device.index or 0 for b, _ in buffers if b.is_cuda})
        if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = [torch.cuda.current_device()]
        self._busy = store.uncheckpointed = True
        try:
            with torch.random.fork_rng(devices=devices):
                yield
        finally:
            self._busy = store.uncheckpointed = False
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    def update(self, loss_closure: Callable[..., torch.Tensor]) -> dict[str, SlotGroup]:
        """Measure sensitivities with ``loss_closure`` (a training forward returning the loss, e.g.
        ``lambda: criterion(model(x[:8]), y[:8])``), allocate the budget and apply it.

        The alarm needs the probe's samples split in halves: it runs only for closures made by
        :meth:`update_batch` (or any closure with a ``samples`` attribute that takes a ``slice`` argument).
        """
        sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
        sync()
        start = time.perf_counter()
        if self._started is None:  # training time is counted from the first probe or training forward
            self._started = start
        self._due = False  # an explicit update satisfies a pending request (the first forward's included)
        self._updated_at = self._forwards
        params = [p for p in self.model.parameters() if p.requires_grad]
        with self._isolated():
            sensitivity, numel, slots = self._sensitivity(loss_closure, params)
            bits = allocate_bits(sensitivity, numel, self.budget) if numel else {}
            self.groups = {name: SlotGroup(slots[name], numel[name], sensitivity[name], bits[name]) for name in numel}
            self.apply()
            self.variance_ratio = self._variance_ratio(loss_closure, params)
        self.updates += 1
        sync()
        self.probe_seconds += time.perf_counter() - start
        alarm = self.config.variance_alarm
        if alarm and self.variance_ratio is not None and self.variance_ratio > alarm:
            warnings.warn(
                f"act_hf: at an average of {self.average_bits():.2f} bits, activation compression adds "
                f"{self.variance_ratio:.2f}x the minibatch gradient variance (alarm above {alarm:g}); training "
                f"may converge worse than uncompressed. Raise the bits budget (now {self.budget:g}).",
                ActHFWarning, stacklevel=2,
            )
        logger.info("act_hf adaptive bits: %d groups, average %.3f bits (budget %g), variance ratio %s",
                    len(self.groups), self.average_bits(), self.budget, self.variance_ratio)
        return self.groups

    def _sensitivity(self, loss_closure, params) -> tuple[dict[str, float], dict[str, int], dict[str, list[str]]]:
        with store.probing() as probe:
            loss = loss_closure()
            found = probe.groups()
            names = sorted(found)
            nodes = {id(n): n for g in found.values() if g["consumers"] for n in g["consumers"]}
            upstream: dict[int, tuple] = {}  # node -> the gradients it received in the g0 pass

            def capture(node):
                def hook(grad_inputs, grad_outputs):
                    upstream[id(node)] = grad_outputs

                return hook

            handles = []
            for node in nodes.values():
                try:
                    handles.append(node.register_hook(capture(node)))
                except RuntimeError:  # a node that takes no hooks ("'register_hook' is invalid for this instance
                    pass  # of _C._FunctionBase"): the groups it consumes are measured by a whole backward
            try:
                g0 = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            finally:
                for handle in handles:
                    handle.remove()
            squared = []
            for name in names:
                consumers = found[name]["consumers"]
                if not self.whole_backward and consumers and all(id(n) in upstream for n in consumers):
                    squared.append(self._local_difference(name, consumers, upstream, params, probe))
                else:  # a whole backward with this group's twins swapped in
                    probe.redraw = name
                    g1 = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
                    probe.redraw = None
                    squared.append(_squared_distance(g0, g1))
            del loss
        squared = torch.stack([d.to(squared[0].device) for d in squared]).tolist() if squared else []  # one read
        sensitivity = {}
        for name, d in zip(names, squared):
            # every slot of a group was quantized at the same width (allocations give groups one width; before
            # the first one, every slot has its module's width)
            b = self._bits_in_probe(found[name]["slots"])
            sensitivity[name] = 0.5 * d / variance_factor(b)
        return sensitivity, {n: found[n]["numel"] for n in names}, {n: found[n]["slots"] for n in names}

    @staticmethod
    def _local_difference(name: str, consumers: list, upstream: dict, params: list, probe) -> torch.Tensor:
        """``||g1 - g0||^2`` for one group, without a whole backward pass.

        Only the backward of the ops that saved the group's tensors reads them, so ``g1 - g0`` is: each such op
        run again on the gradients it received in the g0 pass, with the twin draw minus with the original,
        and that difference carried down to the parameters by one backward from those ops (to first order,
        as in GACT's Theorem 2). A Linear's input gradient does not read its saved input, so a group read only
        by Linears costs one weight-gradient product per Linear and no propagation.
        """
        index = {id(p): i for i, p in enumerate(params)}
        direct: list[torch.Tensor | None] = [None] * len(params)
        edges, deltas = [], []
        for node in consumers:
            grads = upstream[id(node)]
            roots = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            targets = [GradientEdge(n, nr) for n, nr in node.next_functions if n is not None]
            if not roots or not targets:
                continue
            local = []
            for redraw in (None, name):
                probe.redraw = redraw
                local.append(torch.autograd.grad([r for r, _ in roots], targets, [g for _, g in roots],
                                                 retain_graph=True, allow_unused=True))
            probe.redraw = None
            for edge, d0, d1 in zip(targets, *local):
                if d0 is None or d1 is None:
                    continue
                delta = d1 - d0
                if not bool(delta.any()):  # e.g. a Linear's input gradient: it never reads the saved input
                    continue
                variable = getattr(edge.node, "variable", None)  # AccumulateGrad: a leaf
                if variable is not None:
                    i = index.get(id(variable))
                    if i is not None:
                        direct[i] = delta if direct[i] is None else direct[i] + delta
                else:
                    edges.append(edge)
                    deltas.append(delta)
        carried = torch.autograd.grad(edges, params, deltas, retain_graph=True, allow_unused=True) if edges \
            else [None] * len(params)
        total = [a if b is None else (b if a is None else a + b) for a, b in zip(direct, carried)]
        return _squared_distance(total, [None] * len(params))

    def _bits_in_probe(self, slots: list[str]) -> int:
        for slot in slots:
            if slot in self.slot_bits:
                return self.slot_bits[slot]
        return self.config.default_bits

    def _variance_ratio(self, loss_closure, params) -> float | None:
        """``sum_l c_l S(b_l)`` over the minibatch gradient variance of the probe's samples."""
        n = getattr(loss_closure, "samples", None)
        if n is None or n < 2 or not self.groups:
            return None
        half = n // 2
        store.force_bits = MAX_BITS
        try:
            grads = []
            for part in (slice(0, half), slice(half, 2 * half)):
                loss = loss_closure(part)
                grads.append(torch.autograd.grad(loss, params, allow_unused=True))
        finally:
            store.force_bits = None
        # each half's mean gradient has twice the sampling variance of the n-sample mean:
        # E||g_a - g_b||^2 = 2 * 2 * Var(g_n)
        sgd = float(_squared_distance(*grads)) / 4
        compression = sum(g.sensitivity * variance_factor(g.bits) for g in self.groups.values())
        return compression / sgd if sgd > 0 else math.inf

    # -- state ---------------------------------------------------------------------------------------------
    def apply(self) -> None:
        """Write the groups' bits into the model's slot-bits table (every slot of a group gets its group's bits)."""
        for group in self.groups.values():
            for slot in group.slots:
                self.slot_bits[slot] = group.bits

    def average_bits(self) -> float:
        """The allocated bits averaged over stored elements (the budget's measure); the starting width before
        the first allocation."""
        total = sum(g.numel for g in self.groups.values())
        if not total:
            return float(self.config.default_bits)
        return sum(g.bits * g.numel for g in self.groups.values()) / total

    @property
    def overhead(self) -> float:
        """Probe time as a fraction of the training time (the wall time since the first probe or training forward,
        less the probe time); 0 before either."""
        if self._started is None:
            return 0.0
        elapsed = time.perf_counter() - self._started - self.probe_seconds
        return self.probe_seconds / elapsed if elapsed > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: groups with sensitivities and bits, the alarm ratio, update and forward counts."""
        return {
            "budget": self.budget,
            "groups": {name: asdict(g) for name, g in self.groups.items()},
            "variance_ratio": self.variance_ratio,
            "updates": self.updates,
            "forwards": self._forwards,
            "updated_at": self._updated_at,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` and apply its allocation (no probe is due until the next interval)."""
        self.groups = {name: SlotGroup(**g) for name, g in state.get("groups", {}).items()}
        self.variance_ratio = state.get("variance_ratio")
        self.updates = int(state.get("updates", 0))
        self._forwards = int(state.get("forwards", 0))
        updated_at = state.get("updated_at")
        if updated_at is None and self.groups:  # a state saved before "updated_at": the interval's last start
            updated_at = self._forwards - self._forwards % self.config.adapt_interval
        self._updated_at = None if updated_at is None else int(updated_at)
        self._due = not self.groups
        self.apply()

    def remove(self) -> None:
        """Detach from the model and forget its allocation (the model's modules read fixed bits again)."""
        self._hook.remove()
        self.slot_bits.clear()
        self.groups = {}
