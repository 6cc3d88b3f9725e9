"""Scaled dot-product attention (SDPA) and eager attention with a quantized saved context.

Forward is the original computation, bit for bit: :func:`act_sdpa` calls ``F.scaled_dot_product_attention``
itself, by the backend the unpatched call picks in grad mode (so the same fused kernel runs);
:func:`act_eager_attention` runs the eager formula exactly as transformers / timm write it. The context kept
for backward is only

* ``q``, ``k``, ``v`` quantized through the context store, one slot each: ``<base>:q``, ``<base>:k``,
  ``<base>:v`` (``<base>`` is ``settings.slot``, e.g. ``bert.encoder.layer.0.attention.self``), each at the
  bits the model's allocator gave that slot (``store.bits_for``, default ``settings.bits``);
* the attention mask / bias as given (not compressed: HF passes one mask tensor shared by every layer, so it is
  stored once; timm's Swin passes a small ``(1, heads, N, N)`` bias);
* for SDPA with dropout, no mask at all: the state of the generators the forward drew it from (a few KiB of
  host memory) and the backend that drew it;

and backward *recomputes* attention from the dequantized ``q``, ``k``, ``v`` and applies the exact
softmax/matmul backward: for SDPA through autograd on the recomputation, ``F.scaled_dot_product_attention``
itself, so CUDA backward uses the fused kernels; for eager attention written out
(:func:`math_attention_grads`, the ops autograd would run on :func:`math_attention` without its graph or its
output's product; its GEMMs in the forward's dtype, the softmax in fp32), with dropout's keep mask, which eager
attention saves at 1 bit per attention-matrix element.

Why recompute and not the fused SDPA backward ops
-------------------------------------------------
The fused backward ops (``aten._scaled_dot_product_*_backward``) need the forward output and the log-sum-exp.
Feeding them dequantized ``q, k`` with the *exact* output/log-sum-exp is inconsistent (``exp(s_hat - lse)`` is
no longer normalised) and blows up at low bits; saving the output also costs a fourth tensor. Measured on CPU
(``B, H, S, D = 4, 8, 128, 64``, fp32, group size 256, random normal q/k/v, mean of 3 draws), gradient SQNR in
dB vs the exact gradient, dq / dk / dv::

    bits  recompute (chosen)     fused bwd, exact out+lse   fused bwd, quantized out
    2     -7.2 / -7.1 / -3.3      -20.1 / -20.0 / -14.9       -20.1 / -20.0 / -14.9
    3      3.0 /  3.0 /  6.3        0.6 /   0.7 /   4.3         0.5 /   0.7 /   4.3
    4     10.2 / 10.2 / 13.4        9.3 /   9.4 /  12.6         9.2 /   9.4 /  12.6
    8     35.0 / 35.0 / 38.1       34.4 /  34.5 /  37.7        34.3 /  34.5 /  37.7
    (q, k scaled x3, peaky attention)
    4      0.7 /  0.7 /  5.2      -33.7 / -33.6 / -34.7       -34.8 / -34.7 / -34.7
    8     22.4 / 22.3 / 28.5       17.5 /  17.9 /  18.2        17.4 /  17.7 /  18.2

Saved bytes for that shape (q, k, v are 1 MiB each in fp32): recompute 208,896 / 307,200 / 405,504 /
798,720 at 2 / 3 / 4 / 8 bits; fused backward with the exact fp32 output and log-sum-exp 1,273,856 /
1,372,160 / 1,470,464 / 1,863,680; with the output quantized too 294,912 / 425,984 / 557,056 / 1,081,344.
Recompute is both smaller and more accurate at every width, so it is the only backward here. Its cost is one
extra attention forward in backward, by the kernel the forward ran (on the CPU with dropout, SDPA's math path,
which materialises the ``S x S`` scores of one layer at a time, as it does in the unpatched forward). Once a
layer's attention matrix passes ``RECOMPUTE_CHUNK_ELEMENTS``, the recomputation runs over chunks of the batch
(eager attention always; SDPA when a mask gets a gradient or Swin's window mask is summed, without dropout),
so the eager path's fp32 scores and probabilities, a mask's gradient and their like stay bounded as the batch
grows, unless the device has room for the whole batch's (``ACT_HF_SLICING``,
:func:`~act_hf._chunks.sliced_unless_room`). SDPA's fused kernels build no such tensor otherwise, and more calls would
only add host time.

Dropout and the RNG
-------------------
SDPA with ``dropout_p > 0`` runs exactly as the unpatched call runs in training: SDPA itself, on stand-ins of
``q``, ``k``, ``v`` and the mask that require grad as they do, in grad mode (grad mode takes part in SDPA's
backend choice, and an autograd ``forward`` runs without it), with autocast's cast applied by hand. So the backend
(math on CPU; flash / memory-efficient / cuDNN on CUDA), the output and the draw from the global generator are
the unpatched ones. Backward restores the generators to their state before that draw (``torch.random.fork_rng``,
as ``torch.utils.checkpoint`` does), forces the same backend (``torch.nn.attention.sdpa_kernel``) and recomputes
SDPA with dropout on the dequantized inputs: every kernel draws its mask from the generator state, the shapes
and the dropout probability alone, so the recomputation drops exactly what the forward dropped, and the caller's
random stream is left where it was. On CUDA no ``S x S`` matrix exists in either pass.

Fully masked rows follow PyTorch, since the recomputation is SDPA itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._chunks import by_items, even_spans, sliced_unless_room
from ..compress import PackedTensor, dequantize_items, pack_bits, unpack_mask
from ..context import store
from ..errors import ActHFTypeError, ActHFValueError
from ._saving import (
    OpSettings,
    RngState,
    autocast_cast,
    autocast_casts,
    autocast_dtype,
    load_context,
    replayed_rng,
    rng_state,
    save_context,
)

__all__ = [
    "ActEagerAttentionFunction",
    "ActSDPAFunction",
    "act_eager_attention",
    "act_sdpa",
    "add_window_mask",
    "add_windows_mask",
    "compress_role",
    "grads_of",
    "math_attention",
    "math_attention_grads",
    "pack_keep_mask",
    "repeat_kv",
    "role_settings",
]


def role_settings(settings: OpSettings, role: str) -> OpSettings:
    """Settings of the slot ``<settings.slot>:<role>`` with the bits the allocator gave it."""
    slot = f"{settings.slot}:{role}"
    return replace(settings, slot=slot, bits=store.bits_for(slot, settings.bits, settings.slot_bits))


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``(B, Hkv, S, D) -> (B, Hkv * n_rep, S, D)`` exactly as transformers' ``repeat_kv`` (expand + reshape)."""
    if n_rep == 1:
        return x
    batch, heads, slen, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, n_rep, slen, dim).reshape(batch, heads * n_rep, slen, dim)


def compress_role(t: Tensor, settings: OpSettings, role: str):
    """``t`` packed through the context store in the slot ``<settings.slot>:<role>`` (:func:`role_settings`)."""
    return store.compress_as(t, role_settings(settings, role))


def pack_keep_mask(attn_after_dropout: Tensor, settings: OpSettings) -> Tensor:
    """Dropout's keep mask (the nonzero entries of the probabilities after dropout) at 1 bit per element,
    registered with the store in the slot ``<settings.slot>:dropout_mask``."""
    payload = pack_bits(attn_after_dropout != 0, 1)
    store.register((payload,), slot=f"{settings.slot}:dropout_mask", original_nbytes=attn_after_dropout.numel())
    return payload


def add_window_mask(scores: Tensor, window_mask: Tensor) -> Tensor:
    """Swin's shifted-window mask: scores viewed ``(-1, num_windows, H, L, S)`` plus ``mask[None, :, None]``."""
    heads, L, S = scores.shape[-3:]
    scores = scores.view(-1, window_mask.shape[0], heads, L, S) + window_mask.unsqueeze(1).unsqueeze(0)
    return scores.view(-1, heads, L, S)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`math_attention` computes in for inputs of ``dtype``: fp32 for half ones."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def math_attention(q: Tensor, k: Tensor, v: Tensor, masks: tuple[Tensor | None, ...], keep: Tensor | None,
                   dropout_p: float, scale: float | Tensor, window_mask: Tensor | None = None,
                   window_mask_adds: int = 1) -> Tensor:
    """Differentiable eager attention used by backward recomputations (k, v already repeated):
    ``softmax(q k^T * scale + masks + window_mask (added window_mask_adds times)) * keep / (1 - p) @ v``. The two
    GEMMs run in the inputs' dtype, half ones as autocast runs them (accumulating in fp32); the scores from the
    scaling on and the softmax in fp32 for half inputs (:func:`_math_dtype`), the probabilities cast back for the
    second GEMM, as autocast casts them. ``scale`` may be a tensor (cosine attention's learned per-head logit
    scale): an fp32 one multiplies a half product into fp32 in one op, as the models' code does."""
    dtype = _math_dtype(q.dtype)
    product = torch.matmul(q, k.transpose(-2, -1))
    scores = product * scale if isinstance(scale, Tensor) and scale.dtype == dtype else product.to(dtype) * scale
    for mask in masks:
        if mask is None:
            continue
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(mask.logical_not(), float("-inf"))
        else:
            scores = scores + mask.to(dtype)
    if window_mask is not None:
        window_mask = window_mask.to(dtype)
        for _ in range(window_mask_adds):
            scores = add_window_mask(scores, window_mask)
    probs = torch.softmax(scores, -1)
    if keep is not None:
        probs = probs * keep * (1.0 / (1.0 - dropout_p))
    return torch.matmul(probs.to(v.dtype), v)


#: the most attention-matrix elements (batch x heads x L x S) an eager backward recomputes at once; beyond it the
#: recomputation runs over chunks of the batch, so that its scores, probabilities and their gradients (several
#: fp32 copies of the matrix) stay bounded instead of growing with the batch. Each chunk costs the host launches
#: (eager attention: about 8 forward, 17 backward): at 2^22, swin-tiny's 3-bit step at batch 256 ran 144 chunks a
#: way (9 images a chunk in stage 1) and was bound by host work on the H200 (measurement log, "Ninth GPU run");
#: 2^25 makes 20 (at most 72 images; 64 at stage 1 of a batch of 256, the chunks of one size), whose matrices,
#: at most 3 fp32 copies of 33.6 M elements alive at once in eager attention's written-out backward
#: (:func:`math_attention_grads`), stay near 400 MB. Where the device has room for the whole batch's matrices, the
#: batch runs at once (:func:`~act_hf._chunks.sliced_unless_room`).
RECOMPUTE_CHUNK_ELEMENTS = 1 << 25


def _batch_chunks(batch: int, per_item: int, period: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``range(batch)``, each of at most ``RECOMPUTE_CHUNK_ELEMENTS //
    per_item`` items but at least ``period`` (Swin's windows of one image stay together), a multiple of it: as
    few as that allows, of one size as near as whole images allow (:func:`~act_hf._chunks.even_spans`)."""
    return list(even_spans(batch, RECOMPUTE_CHUNK_ELEMENTS // max(per_item, 1), period))


def _whole_matrices_bytes(batch: int, per_item: int) -> int:
    """The temporaries of an attention over the whole batch, ``per_item`` elements of attention matrix a batch item,
    as :func:`~act_hf._chunks.sliced_unless_room` weighs them: four fp32 copies of the matrices (the scores, the
    probabilities and their gradients)."""
    return 16 * batch * per_item


class _SavedQKV:
    """An attention backward's q, k and v, decoded from their packed contexts in ``dtype`` a chunk of the batch at
    a time (:func:`~act_hf.compress.dequantize_items`): a backward over chunks holds one chunk's values, never the
    whole batch's. Without a packed v (only dv is wanted, which v's values do not enter) v is zeros of its
    shape. Their gradients are laid out in ``dtype`` too."""

    def __init__(self, pq: PackedTensor, pk: PackedTensor, pv: PackedTensor | None, v_shape: torch.Size,
                 dtype: torch.dtype) -> None:
        self.packed, self.v_shape, self.dtype = (pq, pk, pv), v_shape, dtype
        self.device = pq.device
        self.batch = pq.shape[0]

    def items(self, start: int, end: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k and v of batch items ``[start, end)``: ``dequantize(p, dtype)[start:end]``, bit for bit."""
        pq, pk, pv = self.packed
        if pv is None:
            v = torch.zeros((end - start, *self.v_shape[1:]), dtype=self.dtype, device=self.device)
        else:
            v = dequantize_items(pv, start, end, self.dtype)
        return dequantize_items(pq, start, end, self.dtype), dequantize_items(pk, start, end, self.dtype), v

    def empty_like(self, i: int) -> Tensor:
        """An uninitialised tensor of ``dtype`` laid out as q, k or v (``i``) decodes, for its gradient."""
        packed = self.packed[i]
        if packed is None:
            return torch.empty(self.v_shape, dtype=self.dtype, device=self.device)
        return packed.spec.laid_out(torch.empty(packed.spec.numel, dtype=self.dtype, device=self.device))


def grads_of(out: Tensor, leaves: list[Tensor | None], grad_out: Tensor) -> list[Tensor | None]:
    """``d out / d leaf`` for the leaves that require grad (``None`` for the others), with upstream ``grad_out``."""
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, grad_out.to(out.dtype), allow_unused=True)) if wanted else iter(())
    return [next(got) if t is not None and t.requires_grad else None for t in leaves]


def _scaled_matmul(a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``torch.matmul(a, b) * scale``, the scale applied by the GEMM itself (``baddbmm``'s alpha) rather than by a
    pass over the product, for ``a`` and ``b`` with the same leading dims (else the two ops)."""
    lead = a.shape[:-2]
    if a.dim() < 3 or b.shape[:-2] != lead:
        return torch.matmul(a, b).mul_(scale)
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    product = torch.empty((a3.shape[0], a3.shape[1], b3.shape[2]), dtype=a.dtype, device=a.device)
    return product.baddbmm_(a3, b3, beta=0, alpha=scale).view(*lead, a3.shape[1], b3.shape[2])


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _reduced_repeat(grad: Tensor, n_rep: int) -> Tensor:
    """The gradient of :func:`repeat_kv`'s input from its output's: each group of ``n_rep`` heads summed."""
    if n_rep == 1:
        return grad
    batch, heads, slen, dim = grad.shape
    return grad.view(batch, heads // n_rep, n_rep, slen, dim).sum(2)


def math_attention_grads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, keep: Tensor | None,
                         dropout_p: float, scale: float, window_mask: Tensor | None, n_rep: int, grad_out: Tensor,
                         need: tuple[bool, ...]) -> list[Tensor | None]:
    """The gradients of ``math_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), (mask,), keep, dropout_p,
    scale, window_mask)`` for upstream ``grad_out``, by the ops autograd runs on it, written out: no graph is
    built, the output's product ``P @ v``, which no gradient reads, is not computed, and ``scale`` is applied by the
    GEMMs of the scores and of dq and dk (their alpha), not by passes over the scores.

    The GEMMs run in ``q``'s dtype, the softmax and its gradient in :func:`_math_dtype`'s, as in
    ``math_attention``: for half inputs (the autocast dtype an eager attention's GEMMs ran in forward) the five
    GEMMs run in half, accumulating in fp32, as the unpatched step's forward and autograd's backward run them (on
    a GPU, tensor cores on half the bytes of fp32): the scores and ``dP = dO v^T`` are rounded to half once, ``P``
    and ``dS`` for the GEMMs that read them; the scale, applied by a GEMM here, multiplies its product there (the
    same up to that rounding). ``grad_out`` is cast to ``q``'s dtype; the gradients of
    q, k and v come in it, a mask's and the window mask's in their own dtypes. ``need``: whether q, k, v, the
    mask and the window mask want a gradient (``None`` for those that do not)."""
    dtype, soft = q.dtype, _math_dtype(q.dtype)
    k_full, v_full = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = _scaled_matmul(q, k_full.transpose(-2, -1), scale)
    heads, length, slen = scores.shape[-3:]
    windowed = (-1, window_mask.shape[0], heads, length, slen) if window_mask is not None else None
    if mask is not None and mask.dtype != torch.bool:
        added = mask.to(soft)
        combined = windowed is not None and mask.dim() == 4 and mask.shape[0] == 1
        if combined:  # Swin's bias, one for every window, and its window mask: their (windows, heads, L, S) sum,
            # small, added to the scores in one pass instead of two
            added, windowed = added + window_mask.to(soft).unsqueeze(1), None
            scores = scores.view(-1, *added.shape)
        # in place unless the mask broadcasts the scores to a larger shape or widens a half product (one pass)
        scores = scores.add_(added) if scores.dtype == soft and torch.broadcast_shapes(
            scores.shape, added.shape) == scores.shape else torch.add(scores, added)
        if combined:
            scores = scores.view(-1, heads, length, slen)
    else:
        scores = scores.to(soft)
        if mask is not None:
            scores.masked_fill_(mask.logical_not(), float("-inf"))
    if windowed is not None:
        scores.view(windowed).add_(window_mask.to(soft).unsqueeze(1))
    probs = torch.softmax(scores, -1)
    del scores
    g = grad_out.to(dtype, memory_format=torch.contiguous_format)  # a transposed output's: one copy, not two
    kept = probs if keep is None else probs * keep * (1.0 / (1.0 - dropout_p))
    dv = _reduced_repeat(torch.matmul(kept.to(dtype).transpose(-2, -1), g), n_rep) if need[2] else None
    del kept
    grads: list[Tensor | None] = [None, None, dv, None, None]
    if not (need[0] or need[1] or need[3] or need[4]):
        return grads
    d_probs = torch.matmul(g, v_full.transpose(-2, -1)).to(soft)
    if keep is not None:
        d_probs = d_probs.mul_(1.0 / (1.0 - dropout_p)).mul_(keep)
    d_scores = torch._softmax_backward_data(d_probs, probs, -1, soft)
    del d_probs, probs
    if need[3] and mask is not None:
        grads[3] = d_scores.sum_to_size(mask.shape).to(mask.dtype)
    if need[4] and window_mask is not None:
        windows = d_scores.view(-1, window_mask.shape[0], heads, length, slen)
        grads[4] = windows.sum_to_size(1, window_mask.shape[0], 1, length, slen).view(window_mask.shape)
        grads[4] = grads[4].to(window_mask.dtype)
        if grads[3] is not None and _same_storage(grads[4], grads[3]):  # both d_scores: one is summed into later
            grads[4] = grads[4].clone()
    if need[0] or need[1]:
        d_scores = d_scores.to(dtype)
    if need[0]:
        grads[0] = _scaled_matmul(d_scores, k_full, scale)
    if need[1]:
        grads[1] = _reduced_repeat(_scaled_matmul(d_scores.transpose(-2, -1), q, scale), n_rep)
    return grads


def _check_dropout(dropout_p: float) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ActHFValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


class ActSDPAFunction(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` with a quantized saved context.

    Saves: ``quantize(q)`` and ``quantize(k)`` (when any input needs a gradient), ``quantize(v)`` (only when ``q``,
    ``k`` or the mask need a gradient: ``dv = P^T dO`` does not read ``v``, with dropout either) and ``attn_mask``
    as given (with ``window_mask``, both, and the sum they make is made again in backward). ``k`` and ``v`` are
    saved before the ``n_rep`` head repetition. With dropout, ``ctx`` also keeps the RNG state the forward drew its
    mask from and the SDPA backend it ran (:class:`_DropoutReplay`). Backward's recomputation casts its inputs as
    autocast cast them in forward.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
                scale: float | None, enable_gqa: bool, n_rep: int, settings: OpSettings,
                window_mask: Tensor | None = None) -> Tensor:
        k_full, v_full = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        ctx.replay, ctx.cast = None, autocast_dtype(q.device.type)
        if dropout_p > 0.0:
            mask = attn_mask
            if window_mask is not None:  # the sum the unpatched call gets, requiring grad as it does (backend choice)
                mask = add_windows_mask(attn_mask, window_mask, q.shape[0]).requires_grad_(attn_mask.requires_grad)
            out, ctx.replay = _sdpa_with_replayable_dropout(q, k_full, v_full, mask, dropout_p, is_causal, scale,
                                                            enable_gqa)
        else:
            out = _windowed_sdpa(q, k_full, v_full, attn_mask, window_mask, is_causal, scale, enable_gqa)
        need_q, need_k, need_v, need_m = ctx.needs_input_grad[:4]
        any_grad = need_q or need_k or need_v or need_m
        pq = compress_role(q, settings, "q") if any_grad else None
        pk = compress_role(k, settings, "k") if any_grad else None
        pv = compress_role(v, settings, "v") if need_q or need_k or need_m else None
        save_context(ctx, pq, pk, pv, attn_mask if any_grad else None, window_mask if any_grad else None)
        ctx.v_shape = v.shape
        ctx.args = (dropout_p, is_causal, scale, enable_gqa, n_rep)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        pq, pk, pv, mask, window_mask = load_context(ctx)
        dropout_p, is_causal, scale, enable_gqa, n_rep = ctx.args
        need = ctx.needs_input_grad
        replay: _DropoutReplay | None = ctx.replay
        qkv = _SavedQKV(pq, pk, pv, ctx.v_shape, grad_out.dtype)

        def recompute(qc, kc, vc, m, e, start, end):  # SDPA on items [start, end) (all of them: the inputs given)
            full = m if e is None else add_windows_mask(m, e, qc.shape[0])
            # cast as autocast did in forward (an fp32 mask beside bf16 q, k stops fused kernels)
            inputs = [autocast_cast(t, ctx.cast) for t in (qc, repeat_kv(kc, n_rep), repeat_kv(vc, n_rep), full)]
            with torch.autocast(qc.device.type, enabled=False):
                if replay is None:
                    return F.scaled_dot_product_attention(*inputs, dropout_p=0.0, is_causal=is_causal, scale=scale,
                                                          enable_gqa=enable_gqa)
                with replayed_rng(replay.rng), sdpa_kernel(replay.backend):
                    return F.scaled_dot_product_attention(*inputs, dropout_p=dropout_p, is_causal=is_causal,
                                                          scale=scale, enable_gqa=enable_gqa)

        # over chunks of the batch past RECOMPUTE_CHUNK_ELEMENTS when backward builds a full (B, H, L, S) tensor
        # (a mask's gradient, Swin's summed window mask); not with dropout, whose mask is drawn for the whole shape
        chunked = replay is None and (need[3] or window_mask is not None)
        per_item = pq.shape[1] * pq.shape[-2] * pk.shape[-2]
        chunks = _batch_chunks(qkv.batch, per_item, 1 if window_mask is None else window_mask.shape[0]) \
            if chunked else [(0, qkv.batch)]
        wanted = (*need[:4], False)  # q, k, v, the mask; never the window mask here
        grads = sliced_unless_room(chunks, qkv.batch, qkv.device, _whole_matrices_bytes(qkv.batch, per_item),
                                   lambda spans: _attention_grads(spans, qkv, mask, window_mask, grad_out, wanted,
                                                                  autograd_grads(recompute, wanted)))
        return (*grads[:4], None, None, None, None, None, None, None)


def _windowed_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, window_mask: Tensor | None,
                   is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    """:func:`_sdpa_as_unpatched` on ``attn_mask``, or with Swin's ``window_mask`` on the sum the unpatched call
    gets (:func:`add_windows_mask`, requiring grad as the bias does: that takes part in the backend choice). That
    sum is as large as a batch of attention matrices (fp32 beside an fp32 bias), and SDPA's math path, which a
    mask requiring grad may take, makes several more: past ``RECOMPUTE_CHUNK_ELEMENTS`` the call runs over chunks
    of whole images' windows, each with its own part of the sum, the output filled chunk by chunk (each item by
    the same kernels on its own matrices)."""
    if window_mask is None:
        return _sdpa_as_unpatched(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    batch = q.shape[0]
    chunks = [(0, batch)]
    matrix_per_item = math.prod(q.shape[1:-1]) * k.shape[-2]
    if k.shape[0] == v.shape[0] == batch:  # k, v broadcast over the batch are not sliced: one call
        chunks = _batch_chunks(batch, matrix_per_item, window_mask.shape[0])
    whole_bytes = _whole_matrices_bytes(batch, matrix_per_item)
    per_item = _per_item_mask(attn_mask, batch, q.dim())

    def attend(start: int, end: int) -> Tensor:
        bias = _items(attn_mask, start, end, batch) if per_item else attn_mask
        mask = add_windows_mask(bias, window_mask, end - start).requires_grad_(attn_mask.requires_grad)
        return _sdpa_as_unpatched(*(_items(t, start, end, batch) for t in (q, k, v)), mask, is_causal, scale,
                                  enable_gqa)

    return sliced_unless_room(chunks, batch, q.device, whole_bytes, lambda spans: by_items(spans, batch, attend))


def _items(t: Tensor, start: int, end: int, batch: int) -> Tensor:
    """Items ``[start, end)`` of ``t``'s batch of ``batch`` (``t`` itself for all of them), requiring grad as ``t``
    does: in an autograd ``forward`` a slice would not, and SDPA's backend choice reads the flag."""
    if (start, end) == (0, batch):
        return t
    return t[start:end].detach().requires_grad_(t.requires_grad)


@dataclass(frozen=True)
class _DropoutReplay:
    """What redraws an SDPA call's dropout mask: the generators' state before the call and the backend that ran
    (its kernel decides how the mask is drawn)."""

    rng: RngState
    backend: SDPBackend


def _keep_nothing(t: Tensor) -> None:
    """Pack hook of a graph that is never differentiated (the stand-ins' of
    :func:`_sdpa_with_replayable_dropout`): nothing is kept. Kept as it is, an output the kernel saves (SDPA's
    ``out`` and log-sum-exp, the math path's probabilities) would hold its own ``grad_fn``, which holds it: a cycle
    through C++ that Python's gc cannot break, and every call would leak the attention's intermediates."""


def _never_unpacked(_: None) -> Tensor:
    raise RuntimeError("act_hf: the stand-ins' SDPA graph keeps nothing and is never differentiated")


def _stand_ins(tensors: tuple[Tensor | None, ...], dtype: torch.dtype | None) -> list[Tensor | None]:
    """Detached copies of SDPA's inputs as the unpatched call sees them: cast as autocast casts them to ``dtype``
    (:func:`autocast_cast`) and requiring grad as the inputs do."""
    stand_ins = []
    for t in tensors:
        if t is not None:
            requires_grad = t.requires_grad
            t = t.detach()
            t = autocast_cast(t, dtype).requires_grad_(requires_grad and t.is_floating_point())
        stand_ins.append(t)
    return stand_ins


def _sdpa_as_unpatched(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                       scale: float | None, enable_gqa: bool) -> Tensor:
    """SDPA without dropout by the backend the unpatched call runs, bit for bit its output.

    An autograd ``forward`` runs without grad mode, so autocast's casts there make inputs that do not require
    grad, and whether an input requires grad takes part in the backend choice: under CPU autocast, T5's fp32
    position bias (a learned additive mask) sends the unpatched call to the math path, while its cast without
    grad mode lets flash attention run, whose bf16 output differs. When autocast casts an input that requires
    grad, SDPA runs on stand-ins cast by hand, and when the two choices differ, the unpatched one is forced
    (``torch.nn.attention.sdpa_kernel``). Else (no autocast; bf16 q, k, v and a mask without grad) SDPA runs as
    it is."""
    tensors = (q, k, v, attn_mask)
    dtype = autocast_dtype(q.device.type)
    cast = [t is not None and t.requires_grad and autocast_casts(t, dtype) for t in tensors]
    if not any(cast):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    stand_ins = _stand_ins(tensors, dtype)
    as_called = [t.detach() if c else t for t, c in zip(stand_ins, cast)]
    unpatched = torch.ops.aten._fused_sdp_choice(*stand_ins, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    here = torch.ops.aten._fused_sdp_choice(*as_called, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    with torch.autocast(q.device.type, enabled=False), \
            sdpa_kernel(SDPBackend(unpatched)) if unpatched != here else contextlib.nullcontext():
        return F.scaled_dot_product_attention(*as_called, dropout_p=0.0, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


def _sdpa_with_replayable_dropout(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                                  is_causal: bool, scale: float | None,
                                  enable_gqa: bool) -> tuple[Tensor, _DropoutReplay]:
    """SDPA with dropout, run exactly as the unpatched call runs in training, and what replays its mask.

    The call is SDPA itself on stand-ins of the inputs that require grad as the inputs do, in grad mode (an
    autograd ``forward`` runs without it, and grad mode takes part in the backend choice) and with autocast's
    cast applied by hand, so the backend, the kernel and the draw from the global generator are the unpatched
    ones. Backward redraws the same mask by restoring the generators and forcing the same backend
    (``F.scaled_dot_product_attention`` on dequantized inputs), so no mask is stored and fused kernels with
    their own dropout (CUDA flash / memory-efficient / cuDNN) run in both passes.
    """
    device_type = q.device.type
    dtype = autocast_dtype(device_type)
    stand_ins = _stand_ins((q, k, v, attn_mask), dtype)
    # the stand-ins' graph is dropped on return; its hooks keep nothing, and keep its saves from the caller's
    # saved-tensor hooks (act_hf.track_saved, torch.utils.checkpoint)
    with torch.enable_grad(), torch.autocast(device_type, enabled=False), \
            torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _never_unpacked):
        backend = SDPBackend(torch.ops.aten._fused_sdp_choice(*stand_ins, dropout_p, is_causal, scale=scale,
                                                               enable_gqa=enable_gqa))
        rng = rng_state(q)
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*stand_ins, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                                 enable_gqa=enable_gqa)
    return out.detach(), _DropoutReplay(rng, backend)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, n_rep: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ActHFTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ActHFValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if isinstance(n_rep, bool) or not isinstance(n_rep, int) or n_rep < 1:
        raise ActHFValueError(f"repeat_kv must be a positive integer, got {n_rep!r}")
    if n_rep > 1 and (k.dim() != 4 or v.dim() != 4):
        raise ActHFValueError(f"repeat_kv > 1 needs 4-d k and v (B, Hkv, S, D), got {k.dim()}-d and {v.dim()}-d")


def add_windows_mask(attn_mask: Tensor, window_mask: Tensor, batch_windows: int) -> Tensor:
    """transformers' Swin attention mask: ``attn_mask`` (the relative position bias, ``(1, heads, N, N)``) plus the
    shifted-window mask ``(num_windows, N, N)`` of every image, ``(batch_windows, 1, N, N)`` (batch index = image *
    num_windows + window), written as transformers writes the sum."""
    num_windows, n = window_mask.shape[0], window_mask.shape[-1]
    per_image = window_mask.unsqueeze(1).unsqueeze(0).expand(batch_windows // num_windows, -1, -1, -1, -1)
    return attn_mask + per_image.reshape(-1, 1, n, n)


def act_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
             settings: OpSettings, repeat_kv: int = 1, window_mask: Tensor | None = None) -> Tensor:
    """``F.scaled_dot_product_attention`` whose saved context is ``q``, ``k``, ``v`` quantized.

    Same arguments and output as ``F.scaled_dot_product_attention`` (bit-identical where the same kernel runs,
    see the module docstring for dropout on CUDA). When grad is disabled or nothing requires grad, this is
    plain SDPA.

    Args:
        q, k, v: query ``(..., L, E)``, key ``(..., S, E)``, value ``(..., S, Ev)``.
        attn_mask: boolean (True = attend) or additive float mask broadcastable to ``(..., L, S)``; it may
            require grad (a learned bias), and then gets a gradient.
        dropout_p: attention dropout probability.
        is_causal: top-left causal mask.
        scale: softmax scale; ``None`` is ``1/sqrt(E)``.
        enable_gqa: SDPA's grouped-query attention (k/v with fewer heads).
        settings: base slot (``settings.slot``; the roles ``:q``, ``:k``, ``:v`` are appended), default bits
            and group size.
        repeat_kv: repeat k and v ``n`` times along the head dim with transformers' ``repeat_kv`` before
            attention (exactly that forward); k and v are then saved *un*-repeated, ``n`` times smaller.
        window_mask: transformers' Swin shifted-window mask ``(num_windows, L, S)``: the mask SDPA gets is then
            :func:`add_windows_mask` of ``attn_mask`` (the position bias) and it, as Swin adds them, and only the
            two parts are saved, not their sum, which is as large as a batch of attention matrices.

    Returns:
        The attention output, as SDPA returns it.

    Raises:
        ValueError: bad ``dropout_p``, ``repeat_kv`` or ``window_mask``, non-floating inputs.
    """
    _check_dropout(dropout_p)
    _check_qkv(q, k, v, repeat_kv)
    if window_mask is not None and (attn_mask is None or not attn_mask.is_floating_point() or window_mask.dim() != 3
                                    or q.shape[0] % window_mask.shape[0] != 0):
        raise ActHFValueError(
            f"window_mask: expected (num_windows, L, S) beside a float attn_mask, num_windows dividing q's batch "
            f"{q.shape[0]}, got {None if window_mask is None else tuple(window_mask.shape)} and attn_mask "
            f"{None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype)}")
    tensors = (q, k, v) if attn_mask is None else (q, k, v, attn_mask)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        mask = attn_mask if window_mask is None else add_windows_mask(attn_mask, window_mask, q.shape[0])
        return F.scaled_dot_product_attention(q, _repeat(k, repeat_kv), _repeat(v, repeat_kv), attn_mask=mask,
                                              dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    return ActSDPAFunction.apply(q, k, v, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa),
                                 repeat_kv, settings, window_mask)


_repeat = repeat_kv  # act_sdpa's keyword shadows the module-level name


def _eager_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, window_mask: Tensor | None,
                     scaling: float, dropout_p: float, training: bool, softmax_dtype: torch.dtype | None,
                     scale_query: bool) -> tuple[Tensor, Tensor]:
    """``(output, weights after dropout)`` of eager attention (k, v already repeated), as
    :class:`ActEagerAttentionFunction` describes it."""
    if scale_query:
        w = (q * scaling) @ k.transpose(-2, -1)
    else:
        w = torch.matmul(q, k.transpose(-2, -1)) * scaling
    if attn_mask is not None:
        w = w + attn_mask
    if window_mask is not None:
        w = add_window_mask(w, window_mask)
    if softmax_dtype is None:
        w = F.softmax(w, dim=-1)
    else:
        w = F.softmax(w, dim=-1, dtype=softmax_dtype).to(q.dtype)
    w = F.dropout(w, p=dropout_p, training=training)
    return torch.matmul(w, v), w


class ActEagerAttentionFunction(torch.autograd.Function):
    """Eager attention ``softmax(q k^T * scale + masks) -> dropout -> @ v`` with a quantized saved context.

    Forward, exactly as transformers' ``eager_attention_forward`` (``scale_query=False``: ``matmul(q, k^T) *
    scaling``) or timm's unfused path (``scale_query=True``: ``(q * scale) @ k^T``); then ``+ attn_mask``, then
    Swin's per-window ``window_mask`` (two separate additions, as Swin adds bias and shift mask); softmax over
    the last dim (in ``softmax_dtype``, then cast back to ``q``'s dtype, when given); ``F.dropout``. Returns
    the output and the (non-differentiable) attention weights after dropout, or ``None`` for them when
    ``need_weights`` is false: then, without dropout, a batch whose attention matrices pass
    ``RECOMPUTE_CHUNK_ELEMENTS`` runs in chunks of it (whole images of Swin's windows), so that the scores, the
    mask sums and the probabilities, several copies of a batch of attention matrices (in fp32 beside an fp32
    position bias), are never made for the whole batch (on the H100 at 6ae3a1f this forward's softmax, scores and
    sums were the largest sites alive at swin-tiny's peak). Each item's output is computed as in one call, by the
    same ops on the item's own matrices.

    Saves the same context as :class:`ActSDPAFunction`: ``quantize(q)``, ``quantize(k)``, ``quantize(v)``
    (following ``needs_input_grad``), both masks as given, and the 1-bit keep mask with dropout. Backward
    recomputes the probabilities (not saved: an ``S x S`` tensor per head) from the dequantized q, k.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, window_mask: Tensor | None,
                scaling: float, dropout_p: float, training: bool, softmax_dtype: torch.dtype | None,
                scale_query: bool, n_rep: int, settings: OpSettings,
                need_weights: bool = True) -> tuple[Tensor, Tensor | None]:
        k_full, v_full = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        options = (scaling, dropout_p, training, softmax_dtype, scale_query)
        dropped = training and dropout_p > 0.0
        batch = q.shape[0]
        ctx.keep_shape = torch.Size((*torch.broadcast_shapes(q.shape[:-2], k_full.shape[:-2]), q.shape[-2],
                                     k_full.shape[-2]))
        chunks = [(0, batch)]
        # dropout draws its mask for the whole shape, and k, v broadcast over the batch are not sliced: one call
        if not need_weights and not dropped and k.shape[0] == v.shape[0] == batch:
            chunks = _batch_chunks(batch, math.prod(ctx.keep_shape[1:]),
                                   1 if window_mask is None else window_mask.shape[0])

        def attend(spans: list[tuple[int, int]]) -> tuple[Tensor, Tensor | None]:
            if len(spans) == 1:
                return _eager_attention(q, k_full, v_full, attn_mask, window_mask, *options)
            sliced_mask = _per_item_mask(attn_mask, batch, q.dim())
            return by_items(spans, batch, lambda start, end: _eager_attention(
                q[start:end], k_full[start:end], v_full[start:end], attn_mask[start:end] if sliced_mask else attn_mask,
                window_mask, *options)[0]), None

        out, w = sliced_unless_room(chunks, batch, q.device,
                                    _whole_matrices_bytes(batch, math.prod(ctx.keep_shape[1:])), attend)
        if w is not None:
            ctx.keep_shape = w.shape
        keep_payload = pack_keep_mask(w, settings) if dropped else None
        need_q, need_k, need_v, need_m, need_e = ctx.needs_input_grad[:5]
        any_grad = need_q or need_k or need_v or need_m or need_e
        pq = compress_role(q, settings, "q") if any_grad else None
        pk = compress_role(k, settings, "k") if any_grad else None
        pv = compress_role(v, settings, "v") if need_q or need_k or need_m or need_e else None
        save_context(ctx, pq, pk, pv, attn_mask if any_grad else None, window_mask if any_grad else None,
                     keep_payload)
        ctx.v_shape = v.shape
        ctx.args = (scaling, dropout_p if dropped else 0.0, n_rep)
        if not need_weights:
            w = None
        else:
            ctx.mark_non_differentiable(w)
        # no zeros for the weights' gradient: autograd would fill an (B, H, L, S) tensor for every backward
        ctx.set_materialize_grads(False)
        return out, w

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor | None, _grad_weights: Tensor | None):
        if grad_out is None:  # the output took no part in the loss
            return (None,) * 13
        pq, pk, pv, mask, extra, keep_payload = load_context(ctx)
        scaling, dropout_p, n_rep = ctx.args
        need = ctx.needs_input_grad
        # q, k, v decoded straight into the gradient's dtype, the GEMMs' (math_attention_grads)
        qkv = _SavedQKV(pq, pk, pv, ctx.v_shape, grad_out.dtype)
        keep = unpack_mask(keep_payload, ctx.keep_shape) if keep_payload is not None else None

        def chunk_grads(qc, kc, vc, m, e, g, start, end):  # items [start, end), keep mask sliced to them
            return math_attention_grads(qc, kc, vc, m, None if keep is None else keep[start:end], dropout_p, scaling,
                                        e, n_rep, g, need[:5])

        per_item = math.prod(ctx.keep_shape[1:])
        chunks = _batch_chunks(qkv.batch, per_item, 1 if extra is None else extra.shape[0])
        grads = sliced_unless_room(chunks, qkv.batch, qkv.device, _whole_matrices_bytes(qkv.batch, per_item),
                                   lambda spans: _attention_grads(spans, qkv, mask, extra, grad_out, need[:5],
                                                                  chunk_grads))
        return (*grads, None, None, None, None, None, None, None, None)


def _per_item_mask(mask: Tensor | None, batch: int, ndim: int) -> bool:
    """Whether ``mask`` has one entry per batch item of q (``batch`` items, ``ndim`` dims), sliced with the batch;
    otherwise it broadcasts over it."""
    return mask is not None and mask.dim() == ndim and mask.shape[0] == batch and batch > 1


#: a chunk's gradients: ``(q, k, v, mask, window_mask, grad_out, start, end) -> [dq, dk, dv, dmask, dwindow_mask]``
#: for batch items ``[start, end)``, given their q, k, v, grad_out and (sliced when per item) mask
ChunkGrads = Callable[[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor, int, int], list[Tensor | None]]


def autograd_grads(recompute: Callable[..., Tensor], need: tuple[bool, ...]) -> ChunkGrads:
    """:data:`ChunkGrads` by autograd on a recomputation: ``recompute(q, k, v, mask, window_mask, start, end)``
    runs the attention of items ``[start, end)`` on leaves made of the given tensors, requiring grad as ``need``
    says (q, k, v, the mask, the window mask)."""

    def grads(q, k, v, m, e, g, start, end):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(want) for t, want in zip((q, k, v), need[:3])]
            if m is not None:
                m = m.detach().requires_grad_(need[3])
            if e is not None and need[4]:
                e = e.detach().requires_grad_(True)
            return grads_of(recompute(*leaves, m, e, start, end), [*leaves, m, e], g)

    return grads


def _recomputed_grads(start: int, end: int, qkv: tuple[Tensor, Tensor, Tensor], batch: int, mask: Tensor | None,
                      window_mask: Tensor | None, grad_out: Tensor, chunk_grads: ChunkGrads) -> list[Tensor | None]:
    """The gradients of batch items ``[start, end)`` of ``batch``, whose q, k and v are ``qkv`` (batch items are
    independent): ``chunk_grads`` on them, the mask sliced to them when it has one entry per item."""
    m = mask[start:end] if _per_item_mask(mask, batch, qkv[0].dim()) else mask
    return chunk_grads(*qkv, m, window_mask, grad_out[start:end], start, end)


def _attention_grads(chunks: list[tuple[int, int]], qkv: _SavedQKV, mask: Tensor | None,
                     window_mask: Tensor | None, grad_out: Tensor, need: tuple[bool, ...],
                     chunk_grads: ChunkGrads) -> list[Tensor | None]:
    """An attention backward by recomputation: in one pass for a single chunk (dq, dk, dv in ``qkv.dtype``),
    else :func:`_grads_by_chunks`."""
    if len(chunks) > 1:
        return _grads_by_chunks(chunks, qkv, mask, window_mask, grad_out, need, chunk_grads)
    start, end = chunks[0]
    grads = _recomputed_grads(start, end, qkv.items(start, end), qkv.batch, mask, window_mask, grad_out,
                              chunk_grads)
    return [None if g is None else g.to(qkv.dtype) for g in grads[:3]] + grads[3:]


def _grads_by_chunks(chunks: list[tuple[int, int]], qkv: _SavedQKV, mask: Tensor | None,
                     window_mask: Tensor | None, grad_out: Tensor, need: tuple[bool, ...],
                     chunk_grads: ChunkGrads) -> list[Tensor | None]:
    """An attention backward over ``chunks`` of the batch (:func:`_recomputed_grads` each, on that chunk's q, k
    and v alone). ``dq``, ``dk``, ``dv`` (in ``qkv.dtype``) and a per-item mask's gradient are filled chunk
    by chunk; the gradients of a mask broadcast over the batch (Swin's relative position bias) and of the window
    mask are summed over the chunks."""
    per_item_mask = _per_item_mask(mask, qkv.batch, len(qkv.packed[0].shape))
    grads: list[Tensor | None] = [qkv.empty_like(i) if want else None for i, want in enumerate(need[:3])]
    grads += [torch.empty_like(mask) if need[3] and per_item_mask else None, None]
    for start, end in chunks:
        got = _recomputed_grads(start, end, qkv.items(start, end), qkv.batch, mask, window_mask, grad_out,
                                chunk_grads)
        for i, g in enumerate(got):
            if g is None:
                continue
            if i < 3 or (i == 3 and per_item_mask):
                grads[i][start:end] = g
            elif grads[i] is None:
                grads[i] = g
            else:
                grads[i] += g
    return grads


def act_eager_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, *, scaling: float,
                        settings: OpSettings, dropout_p: float = 0.0, training: bool = True,
                        softmax_dtype: torch.dtype | None = None, scale_query: bool = False,
                        window_mask: Tensor | None = None, repeat_kv: int = 1,
                        need_weights: bool = True) -> tuple[Tensor, Tensor | None]:
    """Eager attention as transformers / timm write it, saving ``q``, ``k``, ``v`` quantized.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, Hkv, S, D)``, ``(B, Hkv, S, Dv)``.
        attn_mask: additive float mask broadcastable to ``(B, H, L, S)`` (may require grad), or ``None``.
        scaling: the softmax scale.
        settings: base slot, default bits and group size (roles ``:q``, ``:k``, ``:v``).
        dropout_p: dropout on the probabilities (applied with ``F.dropout(p, training)``).
        training: passed to ``F.dropout``.
        softmax_dtype: ``torch.float32`` for ``softmax(..., dtype=torch.float32).to(q.dtype)`` (Llama);
            ``None`` for ``softmax(...)`` in the input dtype (BERT, GPT-2, timm).
        scale_query: ``(q * scaling) @ k^T`` (timm) instead of ``matmul(q, k^T) * scaling`` (transformers).
        window_mask: Swin's shifted-window mask ``(num_windows, L, S)``, added after ``attn_mask`` with the
            scores viewed ``(-1, num_windows, H, L, S)`` exactly as Swin does (batch index = image * num_windows
            + window), or ``None``.
        repeat_kv: transformers' ``repeat_kv`` factor applied to k and v in forward (saved un-repeated).
        need_weights: return the probabilities; ``False`` returns ``None`` for them and lets a large batch run
            in chunks (see :class:`ActEagerAttentionFunction`), as the caller drops them anyway.

    Returns:
        ``(attn_output, attn_weights)``: output ``(B, H, L, Dv)`` (not transposed) and the probabilities after
        dropout, which are not differentiable (use the model's own eager path for losses on attention maps), or
        ``None`` without ``need_weights``.

    Raises:
        ValueError: bad ``dropout_p`` or ``repeat_kv``, non-floating inputs.
    """
    _check_dropout(dropout_p)
    _check_qkv(q, k, v, repeat_kv)
    tensors = [t for t in (q, k, v, attn_mask, window_mask) if t is not None]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        with torch.no_grad():
            return ActEagerAttentionFunction.forward(_NoCtx(), q, k, v, attn_mask, window_mask, float(scaling),
                                                     float(dropout_p), bool(training), softmax_dtype,
                                                     bool(scale_query), repeat_kv, settings, bool(need_weights))
    return ActEagerAttentionFunction.apply(q, k, v, attn_mask, window_mask, float(scaling), float(dropout_p),
                                           bool(training), softmax_dtype, bool(scale_query), repeat_kv, settings,
                                           bool(need_weights))


class _NoCtx:
    """Stand-in ``ctx`` to run a forward without autograd: nothing needs a gradient, nothing is saved."""

    needs_input_grad = (False,) * 12

    def save_for_backward(self, *tensors: Tensor) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        pass
