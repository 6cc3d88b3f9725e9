"""Generic fallback: compress whatever else a model saves for backward through saved-tensor hooks.

For models act_hf has no family for, the known leaf modules are converted as usual, and every *other*
floating tensor that autograd saves during the model's forward (matmuls in custom attention code,
element-wise products, unknown layers) is quantized through ``torch.autograd.graph.saved_tensors_hooks``.
Tensors saved inside act_hf's own modules are left to those modules (an inner pass-through hook shields
them), parameters and their casts are never touched, and tiny tensors (statistics, scalars, and broadcast
views of them) stay exact.
So do tensors without autograd history (``requires_grad`` false): attention masks (``-inf`` or the dtype's
minimum, which a quantizer's range turns into noise of that size on every element: a Falcon model got NaN
gradients from its quantized SDPA mask even at 8 bits), rotary tables, the input batch. They are constants of
the step, not activations, and mostly shared by every layer.

So do tensors computed from parameters, buffers and constants alone (:class:`_Statics`: standardized conv
weights, position-bias tables) where an op reads them beside an activation: they are weights, the same for every
sample, and their rounding did not average out (timm's BiT ResNetV2 at 3 bits: whole-gradient error 3.7x the
gradient's norm, 0.14 with them exact).

Only the innermost saved-tensor hooks apply, so these hooks report every tensor to active
:func:`act_hf.track_saved` trackers themselves. What they keep of a tensor has no history (see
:func:`act_hf.context._without_history`), so a forward never run backward is freed.

``F.scaled_dot_product_attention`` called where the hooks compress (custom attention code of any library) runs
as :func:`act_hf.ops.attention.act_sdpa`, through a ``TorchFunctionMode`` active during the root's forward:
the same call, with ``q``, ``k``, ``v`` packed and attention recomputed in backward. Through the hooks, SDPA's
own backward read the quantized q, k, v *and* output, the combination the table in
:mod:`act_hf.ops.attention` shows to be far less accurate, and a fifth tensor (on the CPU's math path, the whole
``L x S`` attention matrix). Slots: ``<root class>:sdpa:q``, ``:k``, ``:v`` for every such call. The same mode
runs ``amax`` / ``amin`` and the whole-tensor ``max()`` / ``min()`` as :func:`act_hf.ops.extremum.act_extremum`
(slot ``<root class>:extremum``): autograd finds their maxima again as ``input == result``, which quantized
copies no longer satisfy (NaN gradients). For the same reason elementwise ``maximum`` / ``minimum`` (``max(a, b)``)
and ``clamp`` with numeric bounds run as :func:`act_hf.ops.extremum.act_elementwise_extremum` and ``act_clamp``
(same slot): quantized operands compared the wrong way near each other or a bound; ``max(x, dim)`` / ``min(x, dim)``
run as :func:`act_hf.ops.extremum.act_indexed_extremum` (same slot), their indices at a few bits instead of int64;
``F.max_pool{1,2,3}d`` as :func:`act_hf.ops.pooling.act_max_pool` (slot ``<root class>:max_pool``) and
``F.avg_pool{1,2,3}d`` as :func:`act_hf.ops.pooling.act_avg_pool` (nothing saved), as the modules are converted.
And it runs ``F.dropout`` /
``torch.dropout`` in training as :func:`act_hf.ops.dropout.act_dropout` (slot ``<root class>:dropout``): the same
mask from the same draws, kept at 1 bit an element where the hooks saw PyTorch's ``bool`` mask (CUDA) or its noise
in the input's dtype (CPU), which needs no gradient and stayed exact. OPT, XGLM, Seed-OSS call dropout as a
function, not a module. Functional ReLUs and leaky ReLUs (``F.relu``, ``torch.relu``, ``x.relu()``, their in-place
forms, ``F.leaky_relu``: DETR-style models, RWKV, ...) run as :func:`act_hf.ops.activation.act_activation` (slot
``<root class>:relu``): their backward reads the saved result ``> 0``, and a quantized result rounded small
positive elements to 0, dropping their gradient (biased); the 1-bit code of ``x > 0`` is exact.
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.overrides import TorchFunctionMode

from .compress import PackedTensor, dequantize
from .context import _is_parameter_like, _without_history, store
from .nn._base import ActModule
from .nn.activation import keeps_no_tensor
from .ops._saving import OpSettings
from .ops.activation import ActivationSpec, act_activation
from .ops.attention import act_sdpa
from .ops.dropout import act_dropout
from .ops.extremum import _is_number, act_clamp, act_elementwise_extremum, act_extremum, act_indexed_extremum
from .ops.loss import HEAD_LOSS_FUNCS, ReplayedLogits, run_for_head_loss
from .ops.pooling import act_avg_pool, act_max_pool
from .regions import TOP_HOOKS_QUERY as _TOP_HOOKS_QUERY  # a module global: tests set it to None
from .regions import enter_own_hooks, leave_own_hooks

__all__ = ["MIN_NUMEL", "install_fallback_hooks"]

logger = logging.getLogger(__name__)

#: Saved tensors smaller than this stay exact (per-row statistics, scalars, small masks).
MIN_NUMEL = 4096


def _is_small(t: torch.Tensor) -> bool:
    """Fewer than :data:`MIN_NUMEL` elements, or a broadcast view of fewer in memory (``F.normalize`` saves its
    per-row norm expanded to the input's shape: packing the view would write every repeat, and round the
    divisor)."""
    return t.numel() < MIN_NUMEL or t.untyped_storage().nbytes() < MIN_NUMEL * t.element_size()


def _pins_more(t: torch.Tensor) -> bool:
    """A view of fewer than :data:`MIN_NUMEL` elements whose storage holds at least that many more: kept as it
    is, it would keep the whole storage alive (FocalNet's gates, one channel each sliced from its input
    projection's output: 3.2 of 14.4 MiB a sample at 3 bits)."""
    itemsize = t.element_size()
    return t.numel() < MIN_NUMEL and t.untyped_storage().nbytes() >= (t.numel() + MIN_NUMEL) * itemsize


def _report(t: torch.Tensor) -> None:
    for tracker in store._trackers:
        tracker._pack(t)


class _Compressing:
    def __init__(self, slot: str, bits: int, group_size: int, swap: bool,
                 slot_bits: dict[str, int] | None = None) -> None:
        self.slot, self.bits, self.group_size, self.swap = slot, bits, group_size, swap
        self.slot_bits = slot_bits

    def pack(self, t: torch.Tensor):
        if not t.is_floating_point() or not t.requires_grad or _is_small(t) or _is_parameter_like(t):
            if _pins_more(t) and not _is_parameter_like(t):  # an exact copy of the few elements it views
                t = _without_history(t).clone(memory_format=torch.contiguous_format)
            _report(t)
            return _without_history(t)
        packed = store.compress(t, slot=self.slot, bits=store.bits_for(self.slot, self.bits, self.slot_bits),
                                group_size=self.group_size, swap=self.swap)
        for p in packed.tensors:
            _report(p)
        return (packed.tensors, packed.spec)

    @staticmethod
    def unpack(obj):
        if isinstance(obj, tuple):
            return dequantize(store.resolve(PackedTensor.rebuild(*obj)))
        return obj


def _pass_through(t: torch.Tensor) -> torch.Tensor:
    _report(t)
    return _without_history(t)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _exact_pack(t: torch.Tensor):
    """After the task head: exact, except a soft cap's ``tanh`` of the LM head's output, which backward
    recomputes from what the head saved (:class:`act_hf.ops.loss.ReplayedLogits`)."""
    replayed = ReplayedLogits.of(t) if t.grad_fn is not None else None
    return replayed if replayed is not None else _pass_through(t)


def _exact_unpack(obj):
    return obj.unpack() if isinstance(obj, ReplayedLogits) else obj


_COMPRESSING, _SHIELDED, _EXACT = "compressing", "shielded", "exact"
_SDPA_SIGNATURE = inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                    scale=None, enable_gqa=False: None)


_EXTREMUM_SIGNATURE = inspect.signature(lambda input, dim=(), keepdim=False: None)
_INDEXED_EXTREMUM_SIGNATURE = inspect.signature(lambda input, dim, keepdim=False: None)
_RELU_SIGNATURE = inspect.signature(lambda input: None)
_LEAKY_SIGNATURE = inspect.signature(lambda input, negative_slope=0.01: None)
#: rectifiers -> (their signature, in place): torch's ``threshold_backward`` reads their saved result ``> 0``
_RECTIFIERS = {F.relu: (inspect.signature(lambda input, inplace=False: None), None),
               torch.relu: (_RELU_SIGNATURE, False), torch.Tensor.relu: (_RELU_SIGNATURE, False),
               torch.relu_: (_RELU_SIGNATURE, True), torch.Tensor.relu_: (_RELU_SIGNATURE, True),
               F.relu_: (_RELU_SIGNATURE, True),
               F.leaky_relu: (inspect.signature(lambda input, negative_slope=0.01, inplace=False: None), None),
               F.leaky_relu_: (_LEAKY_SIGNATURE, True)}
#: functional dropouts -> their signature (``torch.dropout`` is ATen's: no defaults, ``train`` for ``training``)
#: pooling functions -> (spatial dims, max pooling)
_POOLS = {F.max_pool1d: (1, True), F.max_pool2d: (2, True), F.max_pool3d: (3, True), F.avg_pool1d: (1, False),
          F.avg_pool2d: (2, False), F.avg_pool3d: (3, False)}
_MAX_POOL_SIGNATURE = inspect.signature(
    lambda input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False: None)
_AVG_POOL_SIGNATURE = inspect.signature(
    lambda input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
    divisor_override=None: None)
_DROPOUTS = {F.dropout: inspect.signature(lambda input, p=0.5, training=True, inplace=False: None),
             torch.dropout: inspect.signature(lambda input, p, train: None)}
#: reductions autograd differentiates by comparing its saved input and result -> (takes the maximum, whole tensor)
_EXTREMA = {torch.amax: (True, False), torch.Tensor.amax: (True, False), torch.amin: (False, False),
            torch.Tensor.amin: (False, False), torch.max: (True, True), torch.Tensor.max: (True, True),
            torch.min: (False, True), torch.Tensor.min: (False, True)}
#: elementwise extrema of two tensors -> takes the maximum (``max(a, b)`` / ``min(a, b)`` are in _EXTREMA)
_ELEMENTWISE_EXTREMA = {torch.maximum: True, torch.Tensor.maximum: True, torch.minimum: False,
                        torch.Tensor.minimum: False}
_ELEMENTWISE_SIGNATURE = inspect.signature(lambda input, other: None)
_CLAMP_SIGNATURE = inspect.signature(lambda input, min=None, max=None: None)
#: clamps -> the signature their arguments bind to
_CLAMPS = {torch.clamp: _CLAMP_SIGNATURE, torch.Tensor.clamp: _CLAMP_SIGNATURE, torch.clip: _CLAMP_SIGNATURE,
           torch.Tensor.clip: _CLAMP_SIGNATURE, torch.clamp_min: inspect.signature(lambda input, min: None),
           torch.Tensor.clamp_min: inspect.signature(lambda input, min: None),
           torch.clamp_max: inspect.signature(lambda input, max: None),
           torch.Tensor.clamp_max: inspect.signature(lambda input, max: None)}


_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
_FUNCTION_FILE = torch.autograd.function.__file__


def _saving_frame_is_checkpoint(frame) -> bool:
    """Whether the Python code that saves a tensor (``frame``, the hook's caller) is ``torch.utils.checkpoint``
    itself: the inputs it keeps to recompute a block from (timm's ``set_grad_checkpointing``; both the
    reentrant and the non-reentrant form save them there). Packed, the block's recomputation ran on rounded
    inputs, which is biased (see ``ActConfig.checkpoint_bits``): ``mobilevitv2_050`` at 8 bits had a
    whole-gradient error of 0.110 against 0.035 without checkpointing. Where torch runs the hooks from
    ``Function.apply`` (torch 2.11, not 2.14: checkpoint saves through autograd Functions), its caller counts."""
    if frame is not None and frame.f_code.co_filename == _FUNCTION_FILE:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename == _CHECKPOINT_FILE


def _checkpoint_frames() -> int:
    """How many frames of ``torch.utils.checkpoint`` the Python stack holds: where torch cannot say whose
    saved-tensor hooks are innermost, a frame of it above the root's forward means a checkpoint (a non-reentrant
    one's forward, or its recomputation) with hooks of its own."""
    count, frame = 0, sys._getframe(1)
    while frame is not None:
        count += frame.f_code.co_filename == _CHECKPOINT_FILE
        frame = frame.f_back
    return count


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and not t.is_nested


def _bound(signature: inspect.Signature, args: tuple, kwargs: dict, *,
           defaults: bool = False) -> inspect.BoundArguments | None:
    """``signature`` bound to a call's arguments (its defaults filled in with ``defaults``), or ``None`` for a call
    with arguments the signature does not name (``out=``, dimension names): such a call runs as it is."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    if defaults:
        bound.apply_defaults()
    return bound


_MUTATES: dict = {}  # func -> whether it writes into its first argument (in-place method, operator or setitem)


def _mutates(func) -> bool:
    hit = _MUTATES.get(func)
    if hit is None:
        name = getattr(func, "__name__", "")
        hit = _MUTATES[func] = name == "__setitem__" or name.startswith("__i") or (
            name.endswith("_") and not name.endswith("__"))
    return hit


#: calls that copy a tensor once per sample or head (DeBERTa repeats its relative-position keys for the batch):
#: each copy is rounded with draws of its own, so their results are activations, not weights
_REPLICATING = frozenset({torch.Tensor.repeat, torch.Tensor.repeat_interleave, torch.repeat_interleave,
                          torch.Tensor.expand, torch.Tensor.expand_as, torch.Tensor.tile, torch.tile,
                          torch.Tensor.broadcast_to, torch.broadcast_to})


class _Statics:
    """The tensors of one forward computed from parameters, the root's buffers and constants only ("static"):
    standardized weights (timm's ``StdConv2d``, NFNets' ``ScaledStdConv2d``), position-bias tables.

    An op that reads a static tensor beside an activation uses it as a weight: the same for every sample, so
    its rounding would not average out over the batch but go into every sample's gradient the same way, and on
    through every layer below (timm's ``resnetv2_50x1_bit`` at 3 bits: whole-gradient error 3.7x the gradient's
    norm with its standardized weights quantized, 0.14 with them exact). The hooks keep such a tensor exact, as
    they keep parameters. What an op on static tensors alone saves (a position-bias MLP's hidden states) only
    reaches those parameters' gradients, summed over many rows, and is compressed like any activation.

    A copy made per sample or head (:data:`_REPLICATING`) is rounded with draws of its own in every copy, and
    is compressed like an activation: its size grows with the batch.

    :class:`_FallbackOps` marks static tensors as calls run; the marks are weak (a temporary is freed when it
    would have been) and end with the root's forward. A tensor it has not seen made (an input, the output of a
    custom autograd function) is not static: a missed mark can only leave a tensor compressed, as without marks.
    """

    def __init__(self) -> None:
        self.tensors: dict[int, weakref.ref] = {}  # id -> the marked tensor
        # id of a marked tensor's grad_fn -> (the tensor, that grad_fn): held for the forward, so the id stays
        # its own (torch 2.11 makes a new Python object of a node on every access, freed when unreferenced)
        self.nodes: dict[int, tuple[weakref.ref, object]] = {}
        self.in_static_call = 0  # inside a call on static tensors alone: what it saves is compressed as usual

    def start(self, root: nn.Module) -> None:
        self.tensors, self.nodes = {}, {}
        self.add(tuple(root.buffers()))

    def holds(self, t: torch.Tensor) -> bool:
        """``t`` is a parameter or a marked tensor."""
        ref = self.tensors.get(id(t))
        return (ref is not None and ref() is t) or isinstance(t, nn.Parameter)

    def keeps_exact(self, t: torch.Tensor) -> bool:
        """``t``, saved by an op that also reads an activation, is static: :meth:`holds`, or autocast's cast of a
        marked tensor made inside the op."""
        if self.in_static_call:
            return False
        if self.holds(t):
            return True
        fn = t.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return False
        source = fn.next_functions[0][0]
        entry = self.nodes.get(id(source)) if source is not None else None  # held node: the id is its own
        marked = entry[0]() if entry is not None else None
        return marked is not None and marked.grad_fn is source  # and not written in place since

    def all_hold(self, args, kwargs) -> bool:
        """Every tensor among the arguments (and in list or tuple arguments) is static; true when there is none."""
        for group in (args, kwargs.values()):
            for a in group:
                if isinstance(a, torch.Tensor):
                    if not self.holds(a):
                        return False
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, torch.Tensor) and not self.holds(b):
                            return False
        return True

    def add(self, out) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                ref = self.tensors[id(t)] = weakref.ref(t)
                fn = t.grad_fn
                if fn is not None:
                    self.nodes[id(fn)] = (ref, fn)

    def discard(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self.tensors.pop(id(t), None)


class _FallbackOps(TorchFunctionMode):
    """While the innermost scope compresses (not inside act_hf's modules, not in the exact head), runs these kinds
    of call as act_hf ops instead of leaving their context to the hooks; any other call runs as it was, and so
    does one it cannot bind or whose tensors are not plain tensors.

    * ``F.scaled_dot_product_attention`` as :func:`act_sdpa` (when ``sdpa`` settings are given), unless q, k, v
      are all below :data:`MIN_NUMEL` (the hooks keep such a call's context exact);
    * ``amax`` / ``amin`` and the whole-tensor ``max()`` / ``min()`` as :func:`act_extremum` (a 1-bit mask of the
      extremal elements; through the hooks, the quantized input and result no longer compare equal and the
      gradient is NaN), from :data:`MIN_NUMEL` input elements on; elementwise ``maximum`` / ``minimum`` /
      ``max(a, b)`` / ``min(a, b)`` as :func:`act_elementwise_extremum` and ``clamp`` / ``clip`` / ``clamp_min``
      / ``clamp_max`` with numeric bounds as :func:`act_clamp` (the comparison's outcome, 1-2 bits an element);
      ``max(x, dim)`` / ``min(x, dim)`` as :func:`act_indexed_extremum` (the indices at a few bits, not int64);
    * ``F.dropout`` / ``torch.dropout`` in training as :func:`act_dropout` (the same mask, kept at 1 bit an
      element; when ``dropout`` settings are given), from :data:`MIN_NUMEL` input elements on;
    * functional ReLUs and leaky ReLUs (:data:`_RECTIFIERS`) as :func:`act_activation` (the exact 1-bit code of
      ``x > 0``), from :data:`MIN_NUMEL` input elements on;
    * ``F.max_pool{1,2,3}d`` as :func:`act_max_pool` (the argmax in its window at a few bits, not the input and
      int64 indices) and ``F.avg_pool{1,2,3}d`` as :func:`act_avg_pool` (nothing, not the input), from
      :data:`MIN_NUMEL` input elements on.

    Throughout the root's forward it also marks the results of calls on static tensors alone as static
    (:class:`_Statics`), and unmarks a static tensor written in place with anything else.
    """

    def __init__(self, scopes: _HookScopes, sdpa: OpSettings | None, slot: str, dropout: OpSettings | None,
                 loss: bool = False) -> None:
        super().__init__()
        self.scopes, self.sdpa, self.slot, self.dropout, self.loss = scopes, sdpa, slot, dropout, loss
        self.rectifier = OpSettings(slot=scopes.routed_slot("relu"), bits=1)
        self.pool = OpSettings(slot=scopes.routed_slot("max_pool"), bits=1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        statics = self.scopes.statics
        if statics.all_hold(args, kwargs):
            statics.in_static_call += 1
            try:
                out = func(*args, **kwargs)
            finally:
                statics.in_static_call -= 1
            if func not in _REPLICATING:
                statics.add(out)
            return out
        if _mutates(func) and args:  # written with a tensor that is not static
            statics.discard(args[0])
        if func is F.scaled_dot_product_attention and self.sdpa is not None and self.scopes.compressing():
            bound = _bound(_SDPA_SIGNATURE, args, kwargs)
            if bound is None:
                return func(*args, **kwargs)
            a = bound.arguments
            qkv = (a["query"], a["key"], a["value"])
            if all(_plain(t) for t in qkv) and max(t.numel() for t in qkv) >= MIN_NUMEL:
                return act_sdpa(*qkv, a.get("attn_mask"), a.get("dropout_p", 0.0), a.get("is_causal", False),
                                a.get("scale"), a.get("enable_gqa", False), settings=self.sdpa)
        elif func in _EXTREMA:
            largest, whole = _EXTREMA[func]
            x = args[0] if args else None
            if whole and len(args) == 2 and not kwargs and isinstance(args[1], torch.Tensor):  # max(a, b)
                return self._elementwise(func, *args, largest)
            if not self._routable(x):
                return func(*args, **kwargs)
            if whole and len(args) == 1 and not kwargs:  # x.max()
                return act_extremum(x, largest=largest, slot=self.slot)
            if whole:  # max(x, dim, keepdim): values and indices
                bound = _bound(_INDEXED_EXTREMUM_SIGNATURE, args, kwargs)
                dim = None if bound is None else bound.arguments["dim"]
                if isinstance(dim, bool) or not isinstance(dim, int):
                    return func(*args, **kwargs)
                return act_indexed_extremum(x, dim, bound.arguments.get("keepdim", False), largest=largest,
                                            slot=self.slot)
            bound = _bound(_EXTREMUM_SIGNATURE, args, kwargs)
            if bound is None:
                return func(*args, **kwargs)
            a = bound.arguments
            return act_extremum(x, largest=largest, dim=a.get("dim", ()), keepdim=a.get("keepdim", False),
                                slot=self.slot)
        elif func in _ELEMENTWISE_EXTREMA:
            bound = _bound(_ELEMENTWISE_SIGNATURE, args, kwargs)
            if bound is None:
                return func(*args, **kwargs)
            return self._elementwise(func, bound.arguments["input"], bound.arguments["other"],
                                     _ELEMENTWISE_EXTREMA[func])
        elif func in _CLAMPS:
            x = args[0] if args else kwargs.get("input")
            if not self._routable(x):
                return func(*args, **kwargs)
            bound = _bound(_CLAMPS[func], args, kwargs)
            if bound is None:
                return func(*args, **kwargs)
            lo, hi = bound.arguments.get("min"), bound.arguments.get("max")
            if not all(v is None or _is_number(v) for v in (lo, hi)) or (lo is None and hi is None):
                return func(*args, **kwargs)  # tensor bounds: autograd splits their ties its own way
            return act_clamp(x, lo, hi, slot=self.slot)
        elif func in _RECTIFIERS:
            x = args[0] if args else kwargs.get("input")
            if not self._routable(x):
                return func(*args, **kwargs)
            signature, inplace = _RECTIFIERS[func]
            a = _bound(signature, args, kwargs, defaults=True)
            if a is None:
                return func(*args, **kwargs)
            inplace = a.arguments.get("inplace", False) if inplace is None else inplace
            slope = a.arguments.get("negative_slope")
            if slope is not None and not _is_number(slope):
                return func(*args, **kwargs)
            spec = ActivationSpec("relu") if slope is None else ActivationSpec("leaky_relu", negative_slope=slope)
            return act_activation(x, spec, self.rectifier, fn=lambda t: func(t, *a.args[1:], **a.kwargs),
                                  inplace=inplace)
        elif func in _POOLS:
            x = args[0] if args else kwargs.get("input")
            if not self._routable(x):
                return func(*args, **kwargs)
            nd, largest = _POOLS[func]
            bound = _bound(_MAX_POOL_SIGNATURE if largest else _AVG_POOL_SIGNATURE, args, kwargs, defaults=True)
            if bound is None:
                return func(*args, **kwargs)
            a = bound.arguments
            if largest and not a["return_indices"]:
                return act_max_pool(x, nd, a["kernel_size"], a["stride"], a["padding"], a["dilation"],
                                    a["ceil_mode"], settings=self.pool)
            if not largest and (nd > 1 or a["divisor_override"] is None):
                return act_avg_pool(x, nd, a["kernel_size"], a["stride"], a["padding"], a["ceil_mode"],
                                    a["count_include_pad"], a["divisor_override"])
            return func(*args, **kwargs)
        elif func in _DROPOUTS and self.dropout is not None:
            x = args[0] if args else kwargs.get("input")
            if not self._routable(x):
                return func(*args, **kwargs)
            a = _bound(_DROPOUTS[func], args, kwargs, defaults=True)
            if a is None:
                return func(*args, **kwargs)
            p, training = a.arguments["p"], a.arguments.get("training", a.arguments.get("train"))
            if not (training and isinstance(p, float) and 0.0 < p < 1.0):
                return func(*args, **kwargs)
            return act_dropout(x, p, True, a.arguments.get("inplace", False), settings=self.dropout)
        elif func in HEAD_LOSS_FUNCS and self.loss:
            return run_for_head_loss(func, args, kwargs)
        return func(*args, **kwargs)

    def _routable(self, x) -> bool:
        """``x``, the input of a call the mode may route, is a plain float tensor that needs a gradient, has
        :data:`MIN_NUMEL` elements or more, and the hooks would compress what the call saves."""
        return _plain(x) and x.requires_grad and x.is_floating_point() and x.numel() >= MIN_NUMEL \
            and self.scopes.compressing()

    def _elementwise(self, func, a, b, largest: bool):
        """``func(a, b)``, an elementwise maximum or minimum, as :func:`act_elementwise_extremum` where the hooks
        would keep its operands; as it is for small, non-float or non-plain ones."""
        if _plain(a) and _plain(b) and (a.requires_grad or b.requires_grad) and a.is_floating_point() \
                and b.is_floating_point() and max(a.numel(), b.numel()) >= MIN_NUMEL and self.scopes.compressing():
            return act_elementwise_extremum(a, b, largest=largest, slot=self.slot)
        return func(a, b)


class _Paused:
    """A :class:`_FallbackOps` mode taken off the top of the function-mode stack while an act_hf module runs (an
    entry of :class:`_HookScopes`' stack); leaving the module puts it back."""

    def __init__(self, mode: _FallbackOps) -> None:
        self.mode = mode

    @classmethod
    def of_top_mode(cls) -> _Paused | None:
        """The top function mode taken off, when it is act_hf's; ``None``, and the stack as it was, otherwise."""
        if not torch._C._len_torch_function_stack():
            return None
        top = torch._C._pop_torch_function_stack()
        if isinstance(top, _FallbackOps):
            return cls(top)
        torch._C._push_on_torch_function_stack(top)
        return None

    def __exit__(self, *exc) -> None:
        torch._C._push_on_torch_function_stack(self.mode)


class _HookScopes:
    """The forward hooks that open and close saved-tensor hook scopes around the root and act_hf's modules.

    Bound methods of this object, not closures, so that a patched model pickles whole and a deep copy gets
    scopes of its own. The stack of open scopes lives only during a forward; it is neither pickled nor copied.
    """

    def __init__(self, compressing: _Compressing, sdpa: OpSettings | None = None, route_dropout: bool = True,
                 route_loss: bool = False) -> None:
        self.compressing_hooks, self.sdpa = compressing, sdpa  # sdpa: the routed SDPA's settings, or None
        self.route_dropout, self.route_loss = route_dropout, route_loss
        self.stack: list = []
        self.statics = _Statics()
        self.checkpoint_frames = 0  # torch without the hooks query: checkpoint frames around the root's forward

    def pack(self, t: torch.Tensor):
        """The compressing hooks' pack, except for static tensors read beside activations (:class:`_Statics`)
        and the inputs torch's checkpoint keeps to recompute a block from, which stay exact."""
        if self.statics.keeps_exact(t) or _saving_frame_is_checkpoint(sys._getframe(1)):
            return _pass_through(t)
        return self.compressing_hooks.pack(t)

    def routed_slot(self, kind: str) -> str:
        """The slot of a routed op's context, beside the hooks' own: ``<root class>:<kind>``."""
        return self.compressing_hooks.slot.rsplit(":", 1)[0] + ":" + kind

    def compressing(self) -> bool:
        """Whether the innermost open scope compresses (the root's own code, outside act_hf modules and head)
        and its hooks are the ones autograd applies."""
        return bool(self.stack) and self.stack[-1][2] == _COMPRESSING and not self._foreign_hooks_inside()

    def _foreign_hooks_inside(self) -> bool:
        """Whether the innermost saved-tensor hooks are another party's, e.g. those of torch's non-reentrant
        checkpoint inside a block (timm's ``set_grad_checkpointing``). Its recomputation in backward runs
        outside the root's forward, without the function mode, so inside such hooks nothing is routed and act_hf
        modules open no pass-through scope: both passes then save the same tensors, which the checkpoint checks,
        and it keeps (and frees) act_hf modules' packed contexts like any other (timm MaxViT-nano, 256 x 256,
        batch 2, 8 bits: 116.6 MiB saved, 101.8 with the modules' scopes, 17.0 without)."""
        if _TOP_HOOKS_QUERY is None:
            return _checkpoint_frames() > self.checkpoint_frames
        top = _TOP_HOOKS_QUERY(False)  # the innermost (pack, unpack), or None
        return top is not None and not (top[0] == self.pack or top[0] is _pass_through or top[0] is _exact_pack)

    def _open(self, module: nn.Module, hooks: tuple, kind: str) -> None:
        if module.training and torch.is_grad_enabled():
            scope = torch.autograd.graph.saved_tensors_hooks(*hooks)
            enter_own_hooks(hooks[0])
            scope.__enter__()
            self.stack.append((module, scope, kind))

    def enter_compressing(self, module: nn.Module, args) -> None:
        if not self.stack and _TOP_HOOKS_QUERY is None:
            self.checkpoint_frames = _checkpoint_frames()
        self._open(module, (self.pack, self.compressing_hooks.unpack), _COMPRESSING)
        if self.stack and self.stack[-1][0] is module:
            self.statics.start(module)
            dropout = OpSettings(slot=self.routed_slot("dropout"), bits=1) if self.route_dropout else None
            mode = _FallbackOps(self, self.sdpa, self.routed_slot("extremum"), dropout, self.route_loss)
            mode.__enter__()
            self.stack.append((module, mode, _COMPRESSING))

    @keeps_no_tensor
    def enter_shielded(self, module: nn.Module, args) -> None:
        """Before an act_hf module: its own tensors pass through the hooks exact (it keeps its context itself).
        Fed a tensor that is not static, the module also runs without the function mode (:class:`_Paused`): the
        mode routes nothing inside act_hf's modules and marks as static only what is made from static tensors
        alone, which the module's output, made from its input, is not; and every call the module's ops make
        paid for a pass through it (host work of a tiny BART's patched step, codec stubbed, 4 interleaved runs each
        of ``benchmarks/benchmark_host_overhead.py --stub-codec --hf-fallback bart``: 30.11-40.35 -> 27.30-34.19 ms,
        10.10-10.49 unpatched)."""
        if not self._foreign_hooks_inside():  # those hooks, not the compressing ones, see the module's tensors
            self._open(module, (_pass_through, _identity), _SHIELDED)
            if self.stack and self.stack[-1][0] is module and not torch.compiler.is_compiling() \
                    and not self.statics.all_hold(args, {}):
                paused = _Paused.of_top_mode()
                if paused is not None:
                    self.stack.append((module, paused, _SHIELDED))

    def enter_exact_rest(self, module: nn.Module, args) -> None:
        """Before a task-head module: the rest of the root's forward (the head, the loss after it) saves exact
        tensors. The scope belongs to the root, so the root's :meth:`leave` closes it."""
        if self.compressing() and all(entry[0] is self.stack[0][0] for entry in self.stack) \
                and module.training and torch.is_grad_enabled():  # directly under the root
            self._open(self.stack[0][0], (_exact_pack, _exact_unpack), _EXACT)

    @keeps_no_tensor
    def leave(self, module: nn.Module, args, output) -> None:
        while self.stack and self.stack[-1][0] is module:
            scope = self.stack.pop()[1]
            scope.__exit__(None, None, None)
            if isinstance(scope, torch.autograd.graph.saved_tensors_hooks):
                leave_own_hooks()
        if not self.stack:
            self.statics = _Statics()

    def __getstate__(self) -> dict:
        return {"compressing": self.compressing_hooks, "sdpa": self.sdpa, "route_dropout": self.route_dropout,
                "route_loss": self.route_loss}

    def __setstate__(self, state: dict) -> None:
        self.compressing_hooks, self.sdpa, self.stack = state["compressing"], state.get("sdpa"), []
        self.route_dropout, self.route_loss = state.get("route_dropout", False), state.get("route_loss", False)
        self.statics = _Statics()
        self.checkpoint_frames = 0


def install_fallback_hooks(model: nn.Module, *, bits: int, group_size: int, swap: bool = False,
                           heads: list[nn.Module] | tuple[nn.Module, ...] = (), route_sdpa: bool = True,
                           route_dropout: bool = True, route_loss: bool = False,
                           slot_bits: dict[str, int] | None = None) -> list:
    """Install the hooks on ``model``; returns the hook handles (remove them to uninstall). ``slot_bits``: the
    adaptive model's slot-bits table (``ContextStore.bits_for``; None for fixed bits).

    The compressing hooks are active during the root module's forward in training with grad enabled; every
    act_hf module pushes a pass-through hook around its own forward. From the first call of a module in
    ``heads`` (the task head, ``ActConfig.exclude_head``) to the end of the root's forward, saved tensors stay
    exact: the head and the loss computed on its output, as the families keep them. With ``route_sdpa``,
    ``F.scaled_dot_product_attention`` runs as :func:`act_sdpa` where the hooks would compress its context, with
    ``route_dropout`` functional dropout as :func:`act_dropout`; max and min reductions run as
    :func:`act_extremum` there in any case. With ``route_loss``, ``F.cross_entropy`` on the rows of an LM head's
    output (its forward noted by :func:`act_hf.ops.loss.note_head_output`) recomputes the logits in backward
    (:func:`act_hf.ops.loss.run_for_head_loss`), after the head too.
    """
    name = type(model).__name__
    sdpa = OpSettings(slot=f"{name}:sdpa", bits=bits, group_size=group_size, swap=swap,
                      slot_bits=slot_bits) if route_sdpa else None
    scopes = _HookScopes(_Compressing(f"{name}:saved", bits, group_size, swap, slot_bits), sdpa, route_dropout,
                         route_loss)
    handles = [
        model.register_forward_pre_hook(scopes.enter_compressing),
        model.register_forward_hook(scopes.leave, always_call=True),
    ]
    handles += [head.register_forward_pre_hook(scopes.enter_exact_rest) for head in heads]
    for module in model.modules():
        if isinstance(module, ActModule):
            handles.append(module.register_forward_pre_hook(scopes.enter_shielded))
            handles.append(module.register_forward_hook(scopes.leave, always_call=True))
    return handles
