"""Causal-LM cross-entropy that keeps no logits: backward recomputes them from the LM head's input.

HF's ``ForCausalLMLoss`` upcasts the logits to fp32, and ``log_softmax`` saves its fp32 output for backward:
``4 * V`` bytes a token (GPT-2: 25.7 of its 31 MiB a sample at 3 bits; a 32k-vocabulary LLaMA: 15.6 MiB), more
than everything act_hf packs. :class:`HeadCrossEntropyFunction` computes the same loss (the same calls, so the
same value) but saves only what the LM head saved anyway: its input, weight and bias. Backward recomputes the
logits chunk by chunk under the autocast state of the forward and forms ``softmax - onehot`` per chunk, so no
``V``-wide fp32 tensor lives beyond one chunk. Nothing is quantized: the gradient is exact (the recomputed
logits are the forward's, the same kernel on the same inputs). The price is one more LM-head matmul in
backward.

The head's forward hook (:func:`note_head_output`) records how the logits were made; :func:`causal_lm_loss`
mirrors ``ForCausalLMLoss`` and takes this path only for logits so noted and unmodified since, or made from them
by elementwise steps it can replay (:func:`scaled_head_output`): Granite divides the head's output by
``logits_scaling``, Cohere multiplies it by ``logit_scale``, Gemma 2 soft-caps it (``tanh(x / c) * c``). Else it
calls the original loss. Scalar steps keep nothing. A soft cap's ``tanh`` keeps its own output (``V`` wide, in
the logits' dtype), except under the generic fallback's hooks, which keep a replay of it instead
(:class:`ReplayedLogits`); families never soft-cap by default (Gemma 3's ``final_logit_softcapping`` is None).

Seq2seq LMs (T5; BART, Marian, Pegasus, M2M100 on the generic fallback) and masked LMs (BERT, RoBERTa...)
compute their own loss, ``CrossEntropyLoss`` on ``logits.view(-1, V)``; a ``TorchFunctionMode`` (the fallback's,
or :class:`HeadLossMode` from the head's output on) hands that call to :func:`head_cross_entropy`, which walks
from the rows through reshapes and a last fp32 cast to the head's output (:func:`flat_head_output`), and notes a
bias added to the logits (BART's ``final_logits_bias``: :func:`note_head_steps`), which autograd's graph does not
keep.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..derived import drop_dead_notes, note_made_by, recall, remember
from ._saving import autocast_casts, autocast_dtype, autocast_state

__all__ = ["HEAD_LOSS_FUNCS", "HeadCrossEntropyFunction", "HeadLossMode", "HeadLossScope", "ReplayedLogits",
           "cast_head_input", "causal_lm_loss", "flat_head_output", "head_cross_entropy", "note_head_output",
           "note_head_steps", "output_embeddings", "run_for_head_loss", "scaled_head_output"]

#: Bytes of fp32 logits one chunk of rows of the loss (its forward or its backward) may hold.
CHUNK_BYTES = 128 * 2**20


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's HF output embedding (``get_output_embeddings()``, its LM head), or ``None`` where the method is
    missing, returns no module, or raises (``PreTrainedModel``'s can for a head-less subclass)."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
    return head if isinstance(head, nn.Module) else None


def note_head_output(module: nn.Module, args: tuple, output: Tensor) -> None:
    """Forward hook of an LM head (``nn.Linear``): remember that ``output = linear(args[0], weight, bias)``
    (while ``output`` lives) when training with autograd on."""
    if module.training and torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad:
        remember(output, "lm_head", (args[0], module.weight, module.bias))


def cast_head_input(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of an LM head (``nn.Linear``): under autocast, in training with autograd on, hand the head
    its input already cast to autocast's dtype, the cast autocast's ``F.linear`` makes of it (same output, same
    gradient). The head's own backward then saves that tensor, and the recomputing loss (or a soft cap's
    :class:`ReplayedLogits`), which keeps the head's input, keeps the same storage: an fp32 input (a final
    norm's output in the fp32 residual stream) was kept whole beside the head's bf16 cast, ``4 * H`` bytes a
    token more."""
    x = args[0] if args else None
    if not (module.training and torch.is_grad_enabled() and isinstance(x, Tensor)):
        return None
    dtype = autocast_dtype(x.device.type)
    return (x.to(dtype), *args[1:]) if autocast_casts(x, dtype) else None


#: the autograd nodes of the elementwise steps :func:`scaled_head_output` replays, by name
_STEP_NODES = {"MulBackward0": "mul", "DivBackward0": "div", "TanhBackward0": "tanh"}
#: nodes of reshapes, which keep the values and their row-major order (a cross-entropy reads ``(N, V)`` rows)
_RESHAPE_NODES = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")
#: the most steps between the head's output and the logits
_MAX_STEPS = 4
#: the most autograd nodes a walk from the logits to the head's output passes
_MAX_NODES = 8


def note_head_steps(out: Tensor, logits: Tensor, step: tuple) -> None:
    """Remember that ``out = logits + c`` (``step``: ``("add", c)``, ``c`` a tensor without grad, one value per
    vocabulary entry or one in all) where ``logits`` are a noted LM head's output or a tensor noted here: autograd's
    ``AddBackward0`` keeps no ``c``, so the fallback's function mode, which sees the call (BART's
    ``lm_logits + final_logits_bias``), notes it. Two dictionary reads when ``logits`` are neither."""
    c = step[1]
    if not (torch.is_tensor(c) and not c.requires_grad and c.dim() <= logits.dim()
            and all(n == 1 for n in c.shape[:-1]) and c.shape[-1:] in ((), (1,), logits.shape[-1:])):
        return  # a bias along the vocabulary, the same for every row: the recomputation adds it chunk by chunk
    head = recall(logits, "lm_head")
    found = (head, ()) if head is not None else recall(logits, "lm_logits")
    if found is not None:
        head, steps = found
        remember(out, "lm_logits", (head, (*steps, step)))


def scaled_head_output(logits: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor | None], tuple] | None:
    """``(head, steps)`` when ``logits`` were made from an LM head's output noted by :func:`note_head_output`
    (``head``: its input, weight and bias) by out-of-place elementwise ``steps`` read from autograd's graph, each
    ``("mul", c)``, ``("div", c)`` with ``c`` a number or a 0-d tensor without grad, or ``("tanh", None)``, in the
    order they ran, or noted by :func:`note_head_steps` (``("add", c)``); else ``None``. ``logits`` itself must be
    unmodified; the steps before it are what autograd recorded, and the head's output was unmodified when it died
    (or still is). The loss's read: it drops the notes that outlive their tensors."""
    return _head_and_steps(logits, drop=True, reshapes=False)


def flat_head_output(logits: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor | None], tuple] | None:
    """:func:`scaled_head_output` for ``(N, V)`` rows a cross-entropy reads: reshapes of the logits are passed
    through, and so is a last cast when ``logits`` are fp32 (``logits.float()``, which the loss's recomputation
    does itself)."""
    return _head_and_steps(logits, drop=True, reshapes=True, cast_to=logits.dtype)


def _head_and_steps(t: Tensor, *, drop: bool, reshapes: bool, cast_to: torch.dtype | None = None):
    if t.grad_fn is None or t._version != 0:  # no grad_fn: no_grad, inference mode (no version either)
        return None
    try:
        return _walk(t.grad_fn, t.output_nr, reshapes, cast_to == torch.float32, consume=drop)
    finally:
        if drop:
            drop_dead_notes()


def _walk(node, output_nr: int, reshapes: bool, casts: bool, *, consume: bool):
    steps = []
    for _ in range(_MAX_NODES):
        found = note_made_by(node, output_nr, "lm_head", drop=False, consume=consume)
        if found is not None:
            head, before = found, ()
            break
        found = note_made_by(node, output_nr, "lm_logits", drop=False, consume=consume)
        if found is not None:
            head, before = found
            break
        name = type(node).__name__
        if name in _STEP_NODES and len(steps) < _MAX_STEPS:
            step = _STEP_NODES[name]
            if step == "tanh":
                steps.append(("tanh", None))
            else:
                other = node._saved_other
                if node._saved_self is not None or not torch.is_tensor(other) or other.dim() != 0 \
                        or other.requires_grad or node.next_functions[1][0] is not None:
                    return None
                steps.append((step, other.item()))
        elif not (reshapes and (name in _RESHAPE_NODES or (casts and name == "ToCopyBackward0" and not steps))):
            return None  # a cast is passed only as the last op: the steps replay in the head's dtype
        node, output_nr = node.next_functions[0]
        if node is None:
            return None
    else:
        return None
    return head, (*before, *reversed(steps))


class ReplayedLogits:
    """What a soft cap's ``tanh`` saves of its output ``t``, when ``t`` is made from a noted LM head's output by
    replayable steps: the head's input, weight and bias (which the head saved already) and the steps; backward
    gets ``t`` back by recomputing it (:meth:`unpack`), under the autocast state of the forward. The fallback's
    hooks use it after the task head (:mod:`act_hf.fallback`), where tensors are otherwise kept exact: Gemma 2's
    ``tanh`` kept ``2 * V`` bytes a token under bf16 autocast, once the loss's log-softmax was gone."""

    __slots__ = ("autocast", "device_type", "head", "steps")

    def __init__(self, head: tuple, steps: tuple, device_type: str) -> None:
        self.head, self.steps, self.device_type = head, steps, device_type
        self.autocast = autocast_state(device_type)

    @classmethod
    def of(cls, t: Tensor) -> ReplayedLogits | None:
        """The replay of ``t`` if ``t`` is a ``tanh`` output made from a noted head's output (the notes are kept
        for the loss), with the head's shape and dtype; else ``None``."""
        if type(t.grad_fn).__name__ != "TanhBackward0":
            return None
        found = _head_and_steps(t, drop=False, reshapes=False)
        if found is None:
            return None
        (hidden, weight, bias), steps = found
        device_type = t.device.type
        dtype = autocast_dtype(device_type) or torch.result_type(hidden, weight)
        if tuple(t.shape) != (*hidden.shape[:-1], weight.shape[0]) or t.dtype != dtype:
            return None
        return cls((hidden, weight, bias), steps, device_type)

    def unpack(self) -> Tensor:
        hidden, weight, bias = self.head
        with torch.no_grad(), torch.autocast(self.device_type, **self.autocast):
            return _replay(F.linear(hidden, weight, bias), self.steps)


def _replay(logits: Tensor, steps: tuple) -> Tensor:
    for op, c in steps:
        if op == "tanh":
            logits = torch.tanh(logits)
        else:
            logits = logits * c if op == "mul" else logits / c if op == "div" else logits + c
    return logits


def _chunk_rows(vocab: int) -> int:
    """Rows of fp32 logits of a ``vocab``-wide vocabulary that one chunk holds (:data:`CHUNK_BYTES`; at least 1)."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def _cross_entropy_by_rows(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=..., reduction=...)``, bit for bit, with the fp32
    log-probabilities made :data:`CHUNK_BYTES` at a time: each row's ``log_softmax`` is its own (the kernels
    normalise row by row), and ``nll_loss`` reduces the picked values of an ``(N, 1)`` input as it reduces those
    of the ``(N, V)`` one (its sum runs over the rows alone). The whole call held an fp32 copy of the logits and
    their log-probabilities at once: at a 32000-word vocabulary, 31 MiB a sequence of 128 tokens, the highest point
    of a LLaMA-style step on the CPU."""
    rows, vocab = logits.shape
    step = _chunk_rows(vocab)
    if rows <= step:
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction=reduction)
    ignored = targets == ignore_index
    index = torch.where(ignored, 0, targets).unsqueeze(1)  # an invalid target still fails in gather
    column = 1 if ignore_index == 0 else 0  # the picked values' class, never the ignored one
    picked = torch.zeros(rows, column + 1, dtype=torch.float32, device=logits.device)
    for start in range(0, rows, step):
        end = min(start + step, rows)
        log_probs = F.log_softmax(logits[start:end].float(), dim=1)
        picked[start:end, column] = log_probs.gather(1, index[start:end]).squeeze(1)
        del log_probs
    return F.nll_loss(picked, torch.where(ignored, targets, column), ignore_index=ignore_index, reduction=reduction)


class HeadCrossEntropyFunction(torch.autograd.Function):
    """``F.cross_entropy(logits.float().view(-1, V), targets, ignore_index=..., reduction=...)`` where
    ``logits = steps(F.linear(hidden, weight, bias))`` (``steps``: from :func:`scaled_head_output`, ``()`` for the
    head's output itself); saves ``hidden``, ``weight``, ``bias`` and ``targets``.

    Returns the gradient of ``logits`` only (in ``logits``' dtype): ``hidden``, ``weight`` and ``bias`` are
    passed for the recomputation, and their gradients flow through the steps' and the LM head's own backward.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                ignore_index: int, reduction: str, steps: tuple = ()) -> Tensor:
        loss = _cross_entropy_by_rows(logits.view(-1, logits.shape[-1]), targets, ignore_index, reduction)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.meta = (logits.shape, logits.dtype, ignore_index, reduction, autocast_state(logits.device.type), steps)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, bias, targets = ctx.saved_tensors
        shape, dtype, ignore_index, reduction, autocast, steps = ctx.meta
        vocab = shape[-1]
        rows = hidden.reshape(-1, hidden.shape[-1])
        keep = targets != ignore_index
        scale = grad_loss.float()
        if reduction == "mean":
            scale = scale / keep.sum()
        grad = torch.empty(rows.shape[0], vocab, dtype=dtype, device=grad_loss.device)
        step = _chunk_rows(vocab)
        with torch.no_grad(), torch.autocast(grad_loss.device.type, **autocast):
            for start in range(0, rows.shape[0], step):
                end = min(start + step, rows.shape[0])
                probs = torch.softmax(_replay(F.linear(rows[start:end], weight, bias), steps).float(), dim=-1)
                chunk_targets, chunk_keep = targets[start:end], keep[start:end]
                probs[torch.arange(end - start, device=probs.device), chunk_targets.clamp_min(0)] -= 1
                probs *= torch.where(chunk_keep, scale, scale.new_zeros(())).unsqueeze(-1)
                grad[start:end] = probs.to(dtype)
                del probs  # else the next chunk's softmax is made while this one's is alive
        return grad.view(shape), None, None, None, None, None, None, None


def head_cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100,
                       reduction: str = "mean") -> Tensor | None:
    """``F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)`` (same value) through
    :class:`HeadCrossEntropyFunction` when the ``(N, V)`` rows ``logits`` were made from a noted LM head's output
    (:func:`flat_head_output`) and the loss is computed in fp32 (``logits`` fp32, or autocast on, which runs
    ``log_softmax`` in fp32); else ``None``, and the caller runs the original. BART, Marian, Pegasus... compute
    their loss so, with ``CrossEntropyLoss`` on ``lm_logits.view(-1, V)``."""
    device_type = logits.device.type
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0] or target.dtype != torch.long \
            or reduction not in ("mean", "sum") \
            or not (logits.dtype == torch.float32 or torch.is_autocast_enabled(device_type)):
        return None
    found = flat_head_output(logits)
    if found is None:
        return None
    (hidden, weight, bias), steps = found
    if weight.shape[0] != logits.shape[1] or hidden.numel() != logits.shape[0] * hidden.shape[-1]:
        return None
    return HeadCrossEntropyFunction.apply(logits, hidden, weight, bias, target, ignore_index, reduction, steps)


#: the calls :func:`run_for_head_loss` takes: the cross-entropy it routes, the additions it notes
HEAD_LOSS_FUNCS = frozenset({F.cross_entropy, torch.add, torch.Tensor.add, torch.Tensor.__add__})
_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)


def run_for_head_loss(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` for ``func`` in :data:`HEAD_LOSS_FUNCS`, called by the model's own code during a
    training forward (a ``TorchFunctionMode``'s handler): ``F.cross_entropy`` on the rows of an LM head's output
    (no class weights, no label smoothing, mean or sum) as :func:`head_cross_entropy`; ``logits + c`` noted by
    :func:`note_head_steps`; anything else as it is."""
    if func is not F.cross_entropy:
        out = func(*args, **kwargs)
        if len(args) == 2 and not kwargs and torch.is_tensor(args[0]) and torch.is_tensor(args[1]):
            note_head_steps(out, args[0], ("add", args[1]))
        return out
    try:
        bound = _CROSS_ENTROPY_SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return func(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    logits, target = a["input"], a["target"]
    if a["weight"] is None and a["size_average"] is None and a["reduce"] is None and a["label_smoothing"] == 0.0 \
            and type(logits) is Tensor and logits.requires_grad and torch.is_grad_enabled() \
            and type(target) is Tensor and isinstance(a["ignore_index"], int):
        loss = head_cross_entropy(logits, target, a["ignore_index"], a["reduction"])
        if loss is not None:
            return loss
    return func(*args, **kwargs)


class HeadLossMode(TorchFunctionMode):
    """Runs :data:`HEAD_LOSS_FUNCS` through :func:`run_for_head_loss` while active: from an LM head's forward to the
    end of its model's (:class:`HeadLossScope`), so the model's other calls pay no Python dispatch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HEAD_LOSS_FUNCS:
            return run_for_head_loss(func, args, kwargs)
        return func(*args, **kwargs)


class HeadLossScope:
    """The hooks that keep a :class:`HeadLossMode` active from an LM head's output to the end of the root's forward
    (training, autograd on): a seq2seq LM (T5) computes ``CrossEntropyLoss`` on ``lm_logits.view(-1, V)`` in its
    own forward. Bound methods of this object: a patched model pickles, and a copy gets a scope of its own."""

    def __init__(self) -> None:
        self.mode: HeadLossMode | None = None

    def enter(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        """Forward hook of the head: notes its output (:func:`note_head_output`) and opens the mode."""
        note_head_output(module, args, output)
        if self.mode is None and module.training and torch.is_grad_enabled():
            self.mode = HeadLossMode()
            self.mode.__enter__()

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook of the root (``always_call``): closes the mode."""
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.mode = None


def causal_lm_loss(original: Callable[..., Tensor], logits: Tensor, labels: Tensor, vocab_size: int,
                   num_items_in_batch: Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
    """transformers' ``ForCausalLMLoss`` (same arguments after ``original``, same value) through
    :class:`HeadCrossEntropyFunction` when ``logits`` were noted by :func:`note_head_output` or made from such
    a head's output by steps :func:`scaled_head_output` reads; otherwise
    ``original(logits, labels, vocab_size, ...)``."""
    head, steps = recall(logits, "lm_head", consume=True), ()
    if head is None:
        head, steps = scaled_head_output(logits) or (None, ())
    if head is None:
        return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    targets = shift_labels.view(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = HeadCrossEntropyFunction.apply(logits.view(-1, vocab_size), *head, targets, ignore_index, reduction,
                                          steps)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
