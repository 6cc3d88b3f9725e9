"""A training-memory planner: how much memory a batch takes, and the largest batch that fits, with and without act_hf.

:func:`estimate` builds the model (random weights: only its configuration is needed), measures the activations
saved for backward by a training-mode forward with :func:`act_hf.track_saved` at a few small batch sizes,
unpatched and patched at the requested bits (on a deep copy), fits ``saved = fixed + per_sample * batch`` to the
two largest calibration points, and projects for the requested batch::

    est = act_hf.estimate.estimate("path/to/bert-folder", batch=32, seq=128, bits=3, gpu_mem="16GiB")
    print(est.table())

or from the shell: ``act-hf estimate path/to/bert-folder --batch 32 --seq 128 --bits 3 --gpu-mem 16GiB``.

What the projection is, and is not:
    The projected peak is a *model* of training memory, calibrated against measured saved-activation bytes; it
    is not a measured peak. It adds up

    - parameters, their gradients (same dtype as the parameters) and the optimizer states (AdamW: two fp32
      states per trainable parameter; SGD with momentum: one);
    - the bf16 copies of linear/conv weights that autocast keeps alive for backward (bf16 only);
    - the saved activations at the requested batch (measured and fitted as above);
    - the transient working set of the op being computed. Unpatched: a margin of 5% of the saved activations
      (on an H100 those of bert-base/bert-large/swin-tiny/resnet50 were 96-99% of the per-sample peak). With
      act_hf, whose context is packed while the transients stay full precision: ``transient_factor`` (2.5) times
      the largest single activation the *unpatched* model saves, the working set of its largest layer (a
      decoded input, its gradient, the output's gradient). In the GPU runs (README, "Planning memory") the
      patched peak stood above the saved context by 2.8 MiB a sample for bert-large at 3 bits and 2.7 MiB with
      checkpointing and 4-bit layer inputs (H200), and by 4.8 MiB for swin-tiny at 3 bits (H100): 2.8, 2.7 and
      2.1 times their largest activations (1.00 and 2.30 MiB), where 5% of the unpatched activations is 6.7,
      6.7 and 3.0 MiB (it had projected swin-tiny's largest batch at 1.6x what fit). The H100 run at fffea77
      (expandable segments; measurement log, "Third GPU run") measured the largest batches 0-5% above the 3-bit
      projections and 1-8% below the 2-bit ones, but 17% below the projection with checkpointing and 4-bit layer
      inputs (1702 fit where 1987 was projected): there the recomputed layer's transients came to about 4.5
      times bert-large's largest activation (6.87 MiB a sample at the peak against 2.38 of AM2). With
      checkpointing the factor was set to 4.5 then. The fifth GPU run (H100, 7a3742d, expandable segments; README,
      "Planning memory"), after act_hf's transients had shrunk, implied factors of 0.35-1.04 (bert-large, 3 bits),
      up to 2.40 (bert-large, 2 bits, whose search was cut at 751), 1.2-1.7 (swin-tiny), 1.6-2.3 (resnet50, 3
      bits); the sixth (H200, 9c33c4f) 2.10-2.30 (resnet50, 2 bits) and 2.34-2.49 (bert-large with checkpointing
      and 4-bit layer inputs, 3.3-3.5 in the fifth). Both factors are now 2.5 (:data:`TRANSIENT_FACTOR`,
      :data:`CHECKPOINTED_TRANSIENT_FACTOR`), the largest of these rounded up, so that no measured model is
      projected past what fit; swin-tiny's projections stay 16-18% under it, the others 0-8%.
      A language model's largest saved tensor is its loss's fp32 log-probabilities (``4 * V`` bytes a token),
      which act_hf's loss never keeps (:mod:`act_hf.ops.loss`); its step holds the LM head's output, the logits in
      the compute dtype, once, and two fp32 chunks of rows of the loss (each at most
      :data:`~act_hf.ops.loss.CHUNK_BYTES`). So for a model with an LM head (``get_output_embeddings()``)
      ``largest`` stops at the head's output, and the logits and the two chunks come on top
      (:attr:`Estimate.logits`, :attr:`Estimate.loss_context`). The unpatched loss's backward holds two gradients
      the size of its log-probabilities (``nll_loss``'s and ``log_softmax``'s), which the unpatched column adds to
      its margin. On the CPU (``benchmarks/memory_at_peak.py``, bf16, batches 16 and 32 or 8 and 16) the step's
      peak grew 14.86 MiB a sample at 3 bits for the llama-style config of the benchmarks and 19.26 for GPT-2,
      100.70 and 150.96 unpatched; this projects 15.85 and 20.76, 104.70 and 156.26 (before: 45.38 and 67.96,
      73.45 and 107.17). On an H200 (measurement log, "Seventh GPU run") llama-style's largest batches under
      16 GiB were 136 unpatched and 941 at 3 bits against 131 and 852 projected.

    Not included: the CUDA context and cuBLAS/cuDNN handles (about 0.3-0.6 GiB outside PyTorch's allocator;
    give ``gpu_mem`` as the memory PyTorch may allocate, not the card's nominal size), the caching allocator's
    fragmentation (3.2 GB of swin-tiny's 16 GiB at 3 bits on the H100; ``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True`` is meant to remove it), data-loader or evaluation buffers, and the fact that HF
    Trainer frees gradients before the forward (so the sum is a slight overestimate).

Measurement details:
    Attention-probability dropout is set to 0 in the configs built here (HF ``attention_probs_dropout_prob``,
    ``attention_dropout``, ``attn_pdrop``): with it, CPU SDPA takes its math path and saves the S x S
    probabilities, which GPU fused kernels never store, so a CPU measurement would overstate attention memory.
    A model passed in as an ``nn.Module`` is measured as it is. CPU measurements of the unpatched bf16 models
    are a few percent above GPU ones (bert-base 50.4 vs 47.8 MiB per sample at seq 128).

    Saved bytes are linear in the batch for realistic shapes, but not at tiny ones (act_hf keeps the input of a
    BatchNorm exact when a channel has fewer than 32 values, e.g. a 2x2 feature map at batch 1-4). The
    calibration therefore checks that the fit through the first two points predicts the third; while it does
    not (beyond ``tol``), it doubles the batch and refits on the last two points, up to ``max_calib_batch``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import re
import textwrap
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .checkpoint import enable_hf_checkpointing
from .errors import ActHFRuntimeError, ActHFValueError
from .ops.loss import CHUNK_BYTES
from .ops.loss import output_embeddings as _lm_head

__all__ = ["CHECKPOINTED_TRANSIENT_FACTOR", "TASKS", "TRANSIENT_FACTOR", "Estimate", "SavedFit", "build_model",
           "checkpointed_layers", "estimate", "format_bytes", "parse_size", "saved_with_checkpointing"]

#: Tasks a model can be built for (``--task``), and the ``transformers`` auto class of each.
TASKS = {
    "sequence-classification": "AutoModelForSequenceClassification",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",  # never detected: BERT's hub configs name their MLM, most train classifiers
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}

# HF model types that are decoder-only language models (besides configs with ``is_decoder`` or an architecture
# named ``...ForCausalLM`` / ``...LMHeadModel``).
_DECODER_TYPES = frozenset({
    "bloom", "codegen", "cohere", "cohere2", "deepseek_v2", "deepseek_v3", "falcon", "gemma", "gemma2", "gemma3_text",
    "glm", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gptj", "granite", "llama", "mistral", "mixtral", "mpt",
    "olmo", "olmo2", "opt", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "stablelm", "starcoder2",
})
_VISION_TYPES = frozenset({
    "beit", "bit", "convnext", "convnextv2", "cvt", "deit", "dinov2", "efficientnet", "levit", "mobilenet_v1",
    "mobilenet_v2", "mobilevit", "poolformer", "pvt", "regnet", "resnet", "swin", "swinv2", "van", "vit",
})
# Attention-probability dropout knobs of HF configs, set to 0 before building (see the module docstring).
_ATTN_DROPOUT_ATTRS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop", "attn_dropout")

#: the act_hf column's transients in units of the largest unpatched activation (GPU peaks: module docstring)
TRANSIENT_FACTOR = 2.5
#: the same with HF gradient checkpointing, whose recomputed layer adds its own (bert-large CB1 on an H200)
CHECKPOINTED_TRANSIENT_FACTOR = 2.5
_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}  # fp32 states per trainable parameter
_DTYPES = {"bf16": torch.bfloat16, "fp32": None}

_UNITS = {
    "": None, "b": 1,
    "k": 2**10, "ki": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mi": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gi": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "ti": 2**40, "tib": 2**40, "tb": 10**12,
}


def parse_size(text: str | float, name: str = "--gpu-mem") -> int:
    """Parse a memory size such as ``16GiB``, ``80GB``, ``24000MiB`` or ``1.5TiB`` into bytes.

    ``KiB/MiB/GiB/TiB`` (and the bare ``K/M/G/T``) are binary, ``KB/MB/GB/TB`` decimal, ``B`` bytes. A plain
    number must carry a unit (``16`` is refused rather than read as 16 bytes); an ``int`` is taken as bytes.

    Args:
        text: the size.
        name: the argument the value came from, for the error message.

    Returns:
        The size in bytes.

    Raises:
        ValueError: the text is not a positive size with a known unit (the message names ``name``).
    """
    if isinstance(text, bool):
        raise ActHFValueError(f"{name}: expected a size like 16GiB, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise ActHFValueError(f"{name}: size must be positive, got {text}")
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match and _UNITS.get(match.group(2).lower(), False)
    if not match or unit is False:
        raise ActHFValueError(f"{name}: cannot read {text!r} as a memory size; write e.g. 16GiB, 80GB or 24000MiB")
    if unit is None:
        raise ActHFValueError(f"{name}: {text!r} has no unit; write e.g. {text}GiB or {text}GB")
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise ActHFValueError(f"{name}: size must be positive, got {text!r}")
    return size


def format_bytes(n: float | None) -> str:
    """``n`` bytes as ``"1.23 GiB"`` / ``"45.6 MiB"`` / ``"789 KiB"`` (``"-"`` for ``None``)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass
class SavedFit:
    """Saved-activation bytes measured at a few batch sizes and the line ``fixed + per_sample * batch``.

    Attributes:
        measured: batch size -> saved bytes measured with :func:`act_hf.track_saved`.
        fit_batches: the two batch sizes the line goes through (the two largest measured).
        per_sample: slope, bytes per sample (the direct difference of the two fit points over their batch gap).
        fixed: intercept, bytes that do not grow with the batch (may be slightly negative at tiny shapes).
        linearity_error: relative error with which the line through the two points *before* the last one
            predicted the last measurement (the calibration's own check; 0 when exactly linear).
    """

    measured: dict[int, int]
    fit_batches: tuple[int, int]
    per_sample: float
    fixed: float
    linearity_error: float

    def bytes_at(self, batch: int) -> float:
        """Projected saved bytes at ``batch`` (never below zero)."""
        return max(0.0, self.fixed + self.per_sample * batch)


@dataclass
class Estimate:
    """Projected training memory for one model, batch and bit width, with and without act_hf.

    The peaks are a model of memory (states + saved activations + transient working set), calibrated against
    measured saved-activation bytes; they are not measured peaks. See :mod:`act_hf.estimate`.

    Attributes:
        model: the model name or path given (or the class name of a module).
        model_class: the class that was measured.
        task: the task it was built for (``TASKS`` key, or ``"timm"`` / ``"module"``).
        batch, seq, img_size: the shape projected for (``seq`` for text, ``img_size`` for images, else None).
        bits: act_hf bits: an int width, or a float average budget (adaptive bits).
        checkpointing: whether the act_hf column has HF gradient checkpointing on (its saved activations are
            then AM2, see :func:`saved_with_checkpointing`; the unpatched column never has it).
        checkpoint_bits: the width of the checkpointed layer inputs (``ActConfig.checkpoint_bits``; None: exact).
        avg_bits: the element-weighted average width the adaptive allocator chose (None for an int ``bits``).
        dtype: ``"bf16"`` (autocast, fp32 weights) or ``"fp32"``.
        device: where saved bytes were measured.
        optimizer: ``"adamw"`` or ``"sgd"``.
        gpu_mem: the memory cap in bytes (None: no largest-batch projection).
        margin: the unpatched column's workspace margin, a fraction of its saved activations.
        num_params, trainable_params: parameter counts (unique tensors).
        param_bytes, grad_bytes, optimizer_bytes, weight_copy_bytes: the batch-independent terms.
        baseline, act_hf: the saved-activation fits, unpatched and patched.
        saved_baseline, saved_act_hf: projected saved activations at ``batch``.
        largest: the fit of the largest single activation the unpatched model saves up to its LM head's output,
            if it has one (the loss's fp32 log-probabilities, which act_hf's loss never keeps, left out; None: the
            act_hf column takes the unpatched margin too).
        transient_factor: the act_hf column's transient working set in units of ``largest``.
        logits: for a model with an LM head (``get_output_embeddings()``), the fit of the head's output, the
            logits in the compute dtype, which the act_hf column adds once to its transients (None without a head).
        loss_context: for a model with an LM head, the fit of the largest storage its loss saves, the fp32
            log-probabilities, of which the unpatched column adds two to its transients: the gradients of the
            loss's ``nll_loss`` and ``log_softmax``, which its backward holds together; the act_hf column adds two
            chunks of it, each at most :data:`~act_hf.ops.loss.CHUNK_BYTES` (None without a head).
        workspace, workspace_act_hf: the transient working set in bytes at ``batch``, unpatched and act_hf.
        peak_baseline, peak_act_hf: projected peak training memory at ``batch``.
        max_batch_baseline, max_batch_act_hf: the largest batch whose projected peak fits ``gpu_mem`` (0 when
            not even batch 1 fits; None without ``gpu_mem``).
        notes: what was assumed, in words.
    """

    model: str
    model_class: str
    task: str
    batch: int
    seq: int | None
    img_size: int | None
    bits: int | float
    dtype: str
    device: str
    optimizer: str
    gpu_mem: int | None
    margin: float
    num_params: int
    trainable_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    weight_copy_bytes: int
    baseline: SavedFit
    act_hf: SavedFit
    saved_baseline: float = 0.0
    saved_act_hf: float = 0.0
    workspace: float = 0.0
    peak_baseline: float = 0.0
    peak_act_hf: float = 0.0
    max_batch_baseline: int | None = None
    max_batch_act_hf: int | None = None
    avg_bits: float | None = None
    checkpointing: bool = False
    checkpoint_bits: int | None = None
    largest: SavedFit | None = None
    transient_factor: float = TRANSIENT_FACTOR
    logits: SavedFit | None = None
    loss_context: SavedFit | None = None
    workspace_act_hf: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.saved_baseline = self.baseline.bytes_at(self.batch)
        self.saved_act_hf = self.act_hf.bytes_at(self.batch)
        self.workspace = self.transients(self.batch, act_hf=False)
        self.workspace_act_hf = self.transients(self.batch, act_hf=True)
        self.peak_baseline = self.peak(self.batch, act_hf=False)
        self.peak_act_hf = self.peak(self.batch, act_hf=True)
        if self.gpu_mem is not None:
            self.max_batch_baseline = self.max_batch(self.gpu_mem, act_hf=False)
            self.max_batch_act_hf = self.max_batch(self.gpu_mem, act_hf=True)

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer states + autocast weight copies (independent of the batch)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.weight_copy_bytes

    @property
    def ratio(self) -> float:
        """Unpatched over act_hf saved bytes per sample."""
        return self.baseline.per_sample / self.act_hf.per_sample if self.act_hf.per_sample > 0 else math.inf

    def _transient_terms(self, act_hf: bool) -> list[tuple[float, SavedFit]]:
        """``(factor, fit)`` pairs whose ``factor * fit.bytes_at(batch)`` sum to the transient working set."""
        if act_hf and self.largest is not None:
            return [(self.transient_factor, self.largest)] + ([(1.0, self.logits)] if self.logits is not None else [])
        return [(self.margin, self.baseline)] + ([(2.0, self.loss_context)] if self.loss_context is not None else [])

    def _loss_chunks(self, batch: int | None, act_hf: bool) -> float:
        """act_hf's LM loss over chunks of rows: two fp32 chunks of its log-probabilities at a time, a chunk being
        at most :data:`~act_hf.ops.loss.CHUNK_BYTES` (their largest for ``batch`` None; 0 unpatched, or without an
        LM head)."""
        if not act_hf or self.loss_context is None:
            return 0.0
        return 2.0 * (CHUNK_BYTES if batch is None else min(self.loss_context.bytes_at(batch), CHUNK_BYTES))

    def transients(self, batch: int, *, act_hf: bool) -> float:
        """Projected transient working set in bytes at ``batch``: the unpatched margin plus two of an LM loss's
        fp32 log-probabilities, or with act_hf ``transient_factor`` times the largest unpatched activation plus an
        LM head's logits and two chunks of its loss."""
        linear = sum(factor * fit.bytes_at(batch) for factor, fit in self._transient_terms(act_hf))
        return linear + self._loss_chunks(batch, act_hf)

    def peak(self, batch: int, *, act_hf: bool) -> float:
        """Projected peak training memory in bytes at ``batch``."""
        fit = self.act_hf if act_hf else self.baseline
        return self.state_bytes + fit.bytes_at(batch) + self.transients(batch, act_hf=act_hf)

    def max_batch(self, gpu_mem: int, *, act_hf: bool) -> int:
        """The largest batch whose projected peak is at most ``gpu_mem`` bytes (0 if none)."""
        fit = self.act_hf if act_hf else self.baseline
        terms = self._transient_terms(act_hf)
        slope = fit.per_sample + sum(factor * t.per_sample for factor, t in terms)
        if slope <= 0:
            raise ActHFValueError("measured no saved activations per sample; cannot project a largest batch")
        fixed = fit.fixed + sum(factor * t.fixed for factor, t in terms) + self._loss_chunks(None, act_hf)
        b = max(0, int((gpu_mem - self.state_bytes - fixed) // slope))
        while b > 0 and self.peak(b, act_hf=act_hf) > gpu_mem:  # the clamp in bytes_at / rounding
            b -= 1
        while self.peak(b + 1, act_hf=act_hf) <= gpu_mem:
            b += 1
        return b

    def to_dict(self) -> dict[str, Any]:
        """Every field (fits included) plus ``state_bytes`` and ``ratio``, JSON-serialisable."""
        out = dataclasses.asdict(self)
        for key in ("baseline", "act_hf", "largest", "logits", "loss_context"):
            if out[key] is not None:
                out[key]["measured"] = {str(k): v for k, v in out[key]["measured"].items()}
        out["state_bytes"] = self.state_bytes
        out["ratio"] = self.ratio
        return out

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as JSON text (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.to_dict(), **({"indent": 2} | kwargs))

    def table(self) -> str:
        """A plain-text, aligned table: unpatched and act_hf columns and their ratio, with the notes."""
        shape = f"seq {self.seq}" if self.seq is not None else f"image {self.img_size}x{self.img_size}"
        cap = format_bytes(self.gpu_mem) if self.gpu_mem is not None else None
        head = (f"act-hf estimate: {self.model} ({self.model_class}, {self.num_params / 1e6:.1f}M params), "
                f"batch {self.batch}, {shape}, {self.dtype}, {self.optimizer}, measured on {self.device}")

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}x" if a is not None and b not in (None, 0) else "-"

        rows: list[tuple[str, str, str, str]] = [
            ("saved activations / sample", format_bytes(self.baseline.per_sample),
             format_bytes(self.act_hf.per_sample), ratio(self.baseline.per_sample, self.act_hf.per_sample)),
            (f"saved activations @ batch {self.batch}", format_bytes(self.saved_baseline),
             format_bytes(self.saved_act_hf), ratio(self.saved_baseline, self.saved_act_hf)),
            ("params + grads + optimizer", format_bytes(self.param_bytes + self.grad_bytes + self.optimizer_bytes),
             format_bytes(self.param_bytes + self.grad_bytes + self.optimizer_bytes), ""),
        ]
        if self.weight_copy_bytes:
            rows.append(("autocast bf16 weight copies", format_bytes(self.weight_copy_bytes),
                         format_bytes(self.weight_copy_bytes), ""))
        with_logits = self.largest is not None and self.logits is not None
        label = f"transients ({self.margin:.0%} of unpatched" + (
            " + 2x loss log-probs" if self.loss_context is not None else "") + (
            f"; act_hf {self.transient_factor:g}x largest activation" if self.largest is not None else "") + (
            " + logits)" if with_logits else ")")
        rows += [
            (label, format_bytes(self.workspace), format_bytes(self.workspace_act_hf), ""),
            (f"projected peak @ batch {self.batch}", format_bytes(self.peak_baseline), format_bytes(self.peak_act_hf),
             ratio(self.peak_baseline, self.peak_act_hf)),
        ]
        if self.gpu_mem is not None:
            rows += [
                (f"fits in {cap}", "yes" if self.peak_baseline <= self.gpu_mem else "no",
                 "yes" if self.peak_act_hf <= self.gpu_mem else "no", ""),
                (f"largest batch in {cap}", str(self.max_batch_baseline), str(self.max_batch_act_hf),
                 ratio(self.max_batch_act_hf, self.max_batch_baseline)),
            ]
        label = f"act_hf {self.bits}-bit" if isinstance(self.bits, int) else f"act_hf adaptive {self.bits:g}"
        if self.checkpointing:
            label += f" + ckpt ({self.checkpoint_bits}-bit inputs)" if self.checkpoint_bits else " + ckpt"
        header = ("", "unpatched", label, "ratio")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        lines = [head, ""]
        for r in [header, *rows]:
            lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip())
        lines.append("")
        for note in self.notes:
            lines += textwrap.wrap(note, width=110, initial_indent="note: ", subsequent_indent="      ")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- building models


@dataclass
class _Built:
    model: nn.Module
    name: str
    task: str  # TASKS key, "timm" or "module"
    kind: str  # "text", "seq2seq" or "image"
    img_size: int | None = None
    channels: int = 3
    vocab_size: int | None = None
    max_positions: int | None = None
    notes: list[str] = field(default_factory=list)


def _detect_task(config: Any) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    if any(a.endswith("ImageClassification") for a in archs) or model_type in _VISION_TYPES or (
            getattr(config, "num_channels", None) is not None and getattr(config, "vocab_size", None) is None):
        return "image-classification"
    if getattr(config, "is_decoder", False) or model_type in _DECODER_TYPES or any(
            a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal-lm"
    return "sequence-classification"


def _zero_attention_dropout(config: Any) -> list[str]:
    changed = []
    for attr in _ATTN_DROPOUT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and value:
            setattr(config, attr, 0.0)
            changed.append(f"{attr}={value}")
    return changed


def _build_hf(config: Any, name: str, task: str | None, img_size: int | None) -> _Built:
    import transformers

    task = task or _detect_task(config)
    if task not in TASKS:
        raise ActHFValueError(f"task: unknown task {task!r}; choose one of {sorted(TASKS)}")
    notes = []
    changed = _zero_attention_dropout(config)
    if changed:
        notes.append(f"attention-probability dropout set to 0 for the measurement ({', '.join(changed)}): CPU SDPA "
                     "with dropout takes the math path and saves S x S probabilities that GPU fused kernels never "
                     "store")
    kind = {"seq2seq-lm": "seq2seq", "image-classification": "image"}.get(task, "text")
    if kind == "image":
        if img_size is not None and hasattr(config, "image_size"):
            config.image_size = img_size
        img_size = img_size or getattr(config, "image_size", None) or 224
        if isinstance(img_size, (list, tuple)):
            img_size = int(img_size[0])
    elif task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # decoder models classify the last non-pad token and need one; inputs avoid id 0
    auto = getattr(transformers, TASKS[task])
    try:
        model = auto.from_config(config)
    except ValueError as e:
        raise ActHFValueError(f"task: cannot build {type(config).__name__} ({config.model_type}) as {task} "
                              f"({TASKS[task]}): {e}; pass another --task") from e
    max_pos = None
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(getattr(config, attr, None), int):
            max_pos = getattr(config, attr)
            break
    return _Built(model, name, task, kind, img_size=img_size if kind == "image" else None,
                  channels=int(getattr(config, "num_channels", 3) or 3), vocab_size=getattr(config, "vocab_size", None),
                  max_positions=max_pos, notes=notes)


def _build_timm(name: str, img_size: int | None) -> _Built:
    import timm

    model = timm.create_model(name, pretrained=False)
    default = tuple(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224)))
    if img_size is not None and img_size != default[-1]:
        try:  # ViT / Swin style models fix their input size at construction; CNNs take any size
            model = timm.create_model(name, pretrained=False, img_size=img_size)
        except TypeError:
            pass
    return _Built(model, name, "timm", "image", img_size=img_size or default[-1], channels=default[0])


#: The prefix of a torchvision model name for :func:`build_model` (``torchvision:resnet50``): no hub id or timm name
#: holds a colon.
TORCHVISION_PREFIX = "torchvision:"


def _build_torchvision(name: str, img_size: int | None) -> _Built:
    """``torchvision.models.get_model(name, weights=None)``, fed images of its weights' crop size (299 for
    Inception v3; 224 for most, and for a model without published weights)."""
    import torchvision

    models = torchvision.models
    if name not in models.list_models(module=models):
        known = ", ".join(sorted(models.list_models(module=models))[:12])
        raise ActHFValueError(f"model: torchvision has no classification model {name!r} (torchvision "
                              f"{torchvision.__version__}: {known}, ...; see torchvision.models.list_models())")
    model = models.get_model(name, weights=None)
    try:
        crop = int(models.get_model_weights(name).DEFAULT.transforms().crop_size[0])
    except (ValueError, AttributeError, IndexError):
        crop = 224
    return _Built(model, TORCHVISION_PREFIX + name, "module", "image", img_size=img_size or crop, channels=3)


def build_model(model_or_name: nn.Module | str | os.PathLike, *, task: str | None = None,
                img_size: int | None = None, local_files_only: bool = False) -> _Built:
    """Build a model with random weights from a local HF folder, a timm model name, a torchvision classification
    model (``torchvision:NAME``), or a hub id.

    Order: an ``nn.Module`` is used as is; a folder must hold a ``config.json``; ``torchvision:NAME`` is
    ``torchvision.models.get_model(NAME, weights=None)``; a name ``timm.is_model`` knows is built with
    ``timm.create_model(name, pretrained=False)``; anything else goes to ``AutoConfig.from_pretrained`` (the hub;
    fails offline with a clear error).

    Args:
        model_or_name: the model, folder, timm name, ``torchvision:NAME`` or hub id.
        task: a :data:`TASKS` key to override detection (HF models only).
        img_size: image side for vision models (default: the model's own, 224 for most).
        local_files_only: do not contact the hub.

    Returns:
        The built model and what is needed to feed it (an internal record).

    Raises:
        ValueError: the name is none of the above, or the task does not fit the model.
    """
    if task is not None and task not in TASKS:
        raise ActHFValueError(f"task: unknown task {task!r}; choose one of {sorted(TASKS)}")
    if isinstance(model_or_name, nn.Module):
        model = model_or_name
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "model_type"):
            t = task or _detect_task(config)
            kind = {"seq2seq-lm": "seq2seq", "image-classification": "image"}.get(t, "text")
            size = img_size or getattr(config, "image_size", None) or 224
            return _Built(model, type(model).__name__, t, kind, img_size=size if kind == "image" else None,
                          channels=int(getattr(config, "num_channels", 3) or 3),
                          vocab_size=getattr(config, "vocab_size", None),
                          max_positions=getattr(config, "max_position_embeddings", None))
        default = tuple(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224)))
        return _Built(model, type(model).__name__, "module", "image", img_size=img_size or default[-1],
                      channels=default[0])

    name = os.fspath(model_or_name)
    from transformers import AutoConfig

    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ActHFValueError(f"model: folder {name!r} has no config.json (expected a Hugging Face model folder)")
        return _build_hf(AutoConfig.from_pretrained(name), name, task, img_size)
    if os.path.exists(name):
        raise ActHFValueError(f"model: {name!r} is a file; give a Hugging Face model folder (with config.json), "
                              f"a timm model name, {TORCHVISION_PREFIX}NAME or a hub id")
    if name.startswith(TORCHVISION_PREFIX):
        if task is not None and task != "image-classification":
            raise ActHFValueError(f"task: {name!r} is a torchvision image model; --task {task} does not apply")
        return _build_torchvision(name.removeprefix(TORCHVISION_PREFIX), img_size)
    import timm

    if timm.is_model(name):
        if task is not None and task != "image-classification":
            raise ActHFValueError(f"task: {name!r} is a timm image model; --task {task} does not apply")
        return _build_timm(name, img_size)
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=local_files_only)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ActHFValueError(
            f"model: unknown model {name!r}: not a local folder with a config.json, not a timm model name (nor "
            f"{TORCHVISION_PREFIX}NAME), and its config could not be loaded from the Hugging Face hub "
            f"({type(e).__name__}: {first}). Offline? Pass a folder holding the model's config.json."
        ) from e
    return _build_hf(config, name, task, img_size)


# -------------------------------------------------------------------------------------------------- measuring


def _inputs(built: _Built, batch: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if built.kind == "image":
        x = torch.randn(batch, built.channels, built.img_size, built.img_size, generator=g).to(device)
        labels = torch.zeros(batch, dtype=torch.long, device=device)
        return {"x": x, "labels": labels} if built.task in ("timm", "module") else {"pixel_values": x, "labels": labels}
    vocab = built.vocab_size or 1000
    ids = torch.randint(1, max(2, vocab), (batch, seq), generator=g).to(device)
    if built.task == "sequence-classification":
        return {"input_ids": ids, "labels": torch.zeros(batch, dtype=torch.long, device=device)}
    return {"input_ids": ids, "labels": ids}


def _loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loss on ``inputs``: the HF model's own, or the cross-entropy a timm training step adds."""
    if "x" not in inputs:
        return model(**inputs).loss
    out = model(inputs["x"])
    out = out[0] if isinstance(out, (tuple, list)) else out
    return nn.functional.cross_entropy(out.float().flatten(1), inputs["labels"]) if out.dim() >= 2 else out.mean()


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers HF gradient checkpointing recomputes: members of a ``ModuleList`` switched to checkpointing."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst
            if getattr(m, "gradient_checkpointing", False)]


def saved_with_checkpointing(model: nn.Module, run: Callable[[], Any], autocast: Any) -> tuple[int, int]:
    """``(AM1, AM2)`` in bytes for one training-mode forward ``run()`` of a model with HF gradient checkpointing
    on (GACT's Table 7): AM1 is what the forward keeps for backward (the layer inputs checkpointing keeps, and
    the context of everything outside the checkpointed layers); AM2 adds the context one layer keeps while it
    is recomputed in backward (the first checkpointed layer, re-run on the input it had, uncheckpointed).
    Without checkpointed layers AM2 equals AM1."""
    am1, am2, _, _ = _saved_and_largest(model, run, autocast)
    return am1, am2


@dataclass
class _HeadOutput:
    """What one forward measured at and after its LM head: the bytes of the head's output (the logits) and of the
    largest storage saved after it (the loss's fp32 log-probabilities)."""

    logits: int
    loss_largest: int


def _saved_and_largest(model: nn.Module, run: Callable[[], Any], autocast: Any
                       ) -> tuple[int, int, int, _HeadOutput | None]:
    """:func:`saved_with_checkpointing`'s ``(AM1, AM2)``, the largest single storage saved in either pass up to
    the LM head's output (what the loss saves after it left out), and what was measured at and after that output
    (None without a head, or when it did not run)."""
    import act_hf

    calls: list[tuple[nn.Module, tuple, dict]] = []
    at_head: dict[str, int] = {}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not calls:
            calls.append((module, args, kwargs))

    def note_head(module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            at_head.update(largest=saved.largest, logits=output.untyped_storage().nbytes())
            saved.largest = 0  # from here on: the largest storage the loss saves

    layers = checkpointed_layers(model)
    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in layers]
    head = _lm_head(model)
    if head is not None:
        handles.append(head.register_forward_hook(note_head))
    try:
        with autocast, act_hf.track_saved(model) as saved:
            out = run()
    finally:
        for h in handles:
            h.remove()
    del out
    head_out = None
    if at_head:
        head_out = _HeadOutput(logits=at_head["logits"], loss_largest=saved.largest)
    largest = at_head.get("largest", saved.largest)
    if not calls:
        return saved.bytes, saved.bytes, largest, head_out
    module, args, kwargs = calls[0]
    args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
    module.gradient_checkpointing = False
    try:
        with autocast, act_hf.track_saved(model) as one:
            out = module(*args, **kwargs)
    finally:
        module.gradient_checkpointing = True
    del out
    return saved.bytes, saved.bytes + one.bytes, max(largest, one.largest), head_out


def _saved_bytes(built: _Built, model: nn.Module, batch: int, seq: int, device: torch.device,
                 dtype: torch.dtype | None) -> tuple[int, int, _HeadOutput | None]:
    """Saved bytes of one training-mode forward at ``batch`` (AM2, :func:`saved_with_checkpointing`, when the
    model has checkpointed layers), the largest single storage among them and what the LM head and the loss after
    it held (:func:`_saved_and_largest`)."""
    inputs = _inputs(built, batch, seq, device)
    model.train()
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    _, am2, largest, head = _saved_and_largest(model, lambda: _loss(model, inputs), autocast)
    return am2, largest, head


def _allocate(built: _Built, model: nn.Module, seq: int, device: torch.device, dtype: torch.dtype | None) -> float:
    """Run the adaptive allocator's probe once on an ``adapt_samples`` batch, then keep that allocation for the
    calibration forwards; returns the average bits chosen. The probe runs under ``dtype`` on a GPU and in fp32 on
    a CPU, where bf16 matmuls are far slower (it only ranks slots; the bytes are measured under ``dtype``)."""
    allocator = model.act_hf_allocator
    allocator.automatic = False
    inputs = _inputs(built, allocator.config.adapt_samples, seq, device)
    model.train()
    amp = dtype if device.type == "cuda" else None
    with torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
        allocator.update_batch(inputs, lambda b: _loss(model, b))
    return allocator.average_bits()


def _calibrate(built: _Built, model: nn.Module, *, batches: tuple[int, ...], max_batch: int, tol: float, seq: int,
               device: torch.device, dtype: torch.dtype | None
               ) -> tuple[SavedFit, SavedFit, tuple[SavedFit, SavedFit] | None]:
    """Fits of the saved bytes, of the largest saved storage and, for a model with an LM head, of its logits and
    of the largest storage its loss saves (None without a head), through the same two batches (the saved bytes'
    linearity check decides which)."""
    measured: dict[int, int] = {}
    largest: dict[int, int] = {}
    heads: dict[int, _HeadOutput | None] = {}
    points = sorted(set(batches))

    def line(a: int, b: int, values: dict[int, int] = measured) -> tuple[float, float]:
        slope = (values[b] - values[a]) / (b - a)
        return slope, values[a] - slope * a

    def measure(b: int) -> None:
        measured[b], largest[b], heads[b] = _saved_bytes(built, model, b, seq, device, dtype)

    for b in points:
        measure(b)
    error = 0.0
    while True:
        if len(points) >= 3:
            slope, fixed = line(points[-3], points[-2])
            last = measured[points[-1]]
            error = abs(fixed + slope * points[-1] - last) / max(last, 1)
            if error <= tol or points[-1] * 2 > max_batch:
                break
        elif points[-1] * 2 > max_batch:
            break
        points.append(points[-1] * 2)
        measure(points[-1])
    a, b = points[-2], points[-1]

    def fit(values: dict, error: float = 0.0) -> SavedFit:
        slope, fixed = line(a, b, values)
        return SavedFit(measured=values, fit_batches=(a, b), per_sample=slope, fixed=fixed, linearity_error=error)

    head = None
    if heads[a] is not None and heads[b] is not None:
        head = (fit({p: h.logits for p, h in heads.items() if h is not None}),
                fit({p: h.loss_largest for p, h in heads.items() if h is not None}))
    return fit(measured, error), fit(largest), head


def _count(model: nn.Module, dtype: torch.dtype | None) -> tuple[int, int, int, int, int]:
    params = {id(p): p for p in model.parameters()}.values()
    num = sum(p.numel() for p in params)
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    copies = 0
    if dtype is not None:
        seen: set[int] = set()
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) or type(module).__name__ == "Conv1D":
                for p in module.parameters(recurse=False):
                    if id(p) not in seen and p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                        seen.add(id(p))
                        copies += p.numel() * torch.empty((), dtype=dtype).element_size()
    return num, sum(p.numel() for p in trainable), param_bytes, grad_bytes, copies


def estimate(model_or_name: nn.Module | str | os.PathLike, *, batch: int, seq: int = 128, bits: int | float = 3,
             gpu_mem: int | str | None = None, dtype: str = "bf16", device: str | torch.device | None = None,
             optimizer: str = "adamw", task: str | None = None, img_size: int | None = None, margin: float = 0.05,
             calib_batches: tuple[int, ...] = (1, 2, 4), max_calib_batch: int = 64, tol: float = 0.01,
             local_files_only: bool = False, checkpointing: bool = False,
             checkpoint_bits: int | None = None, transient_factor: float | None = None) -> Estimate:
    """Project training memory at ``batch`` with and without act_hf, and the largest batch under ``gpu_mem``.

    Measures saved activations (unpatched, and patched at ``bits`` on a deep copy) at ``calib_batches``,
    fits ``fixed + per_sample * batch`` through the two largest (doubling further while the fit is not linear
    within ``tol``, see :mod:`act_hf.estimate`), and adds parameters, gradients, optimizer states, autocast
    weight copies and the transient working set (unpatched: ``margin`` of its saved activations; act_hf:
    ``transient_factor`` times the largest activation the unpatched model saves). The result is a model of
    memory calibrated against measured saved bytes, not a measured peak.

    Args:
        model_or_name: an ``nn.Module``, a folder with a ``config.json``, a timm model name,
            ``torchvision:NAME``, or a hub id (config only; random weights).
        batch: the batch size to project for.
        seq: sequence length (text models; ignored for images).
        bits: act_hf bits: an int 1..8, or a float average budget in [1, 8] (e.g. 2.5): the adaptive allocator
            probes the model once (random weights, ``adapt_samples`` samples) and its allocation is measured.
        gpu_mem: memory PyTorch may allocate, in bytes or as text (``"16GiB"``, ``"80GB"``); enables the
            largest-batch projection.
        dtype: ``"bf16"`` (bf16 autocast over fp32 weights, as in mixed-precision training) or ``"fp32"``.
        device: where to measure (default: CUDA when available, else CPU).
        optimizer: ``"adamw"`` (two fp32 states per trainable parameter) or ``"sgd"`` (momentum, one state).
        task: a :data:`TASKS` key overriding the detected one (HF models).
        img_size: image side for vision models (default: the model's own, 224 for most).
        margin: the unpatched column's transient working set, a fraction of its saved activations.
        calib_batches: batch sizes measured first (at least two).
        max_calib_batch: the largest batch the calibration may double up to.
        tol: relative error allowed in the calibration's linearity check.
        local_files_only: never contact the Hugging Face hub.
        checkpointing: project the act_hf column with HF gradient checkpointing on (GACT's CB1 when combined
            with ``checkpoint_bits``), against the unpatched model without it. Its saved activations are AM2:
            what the forward keeps plus the context of one layer while it is recomputed.
        checkpoint_bits: with ``checkpointing``, keep the checkpointed layer inputs packed at this width (1..8,
            ``ActConfig.checkpoint_bits``); None keeps them exact.
        transient_factor: the act_hf column's transient working set, in units of the largest activation the
            unpatched model saves; ``None``: :data:`TRANSIENT_FACTOR` (2.5), or with ``checkpointing``
            :data:`CHECKPOINTED_TRANSIENT_FACTOR` (2.5), about the measured GPU peaks (see :mod:`act_hf.estimate`).

    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: a bad argument (the message names it) or an unknown model.
        RuntimeError: ``device="cuda"`` without a visible GPU.
    """
    import act_hf

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ActHFValueError(f"batch: must be a positive int, got {batch!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ActHFValueError(f"seq: must be a positive int, got {seq!r}")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 1 <= bits <= 8:
        raise ActHFValueError(f"bits: must be an int from 1 to 8 or a float budget in [1, 8] (adaptive), got {bits!r}")
    if dtype not in _DTYPES:
        raise ActHFValueError(f"dtype: must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if optimizer not in _OPTIMIZER_STATES:
        raise ActHFValueError(f"optimizer: must be one of {sorted(_OPTIMIZER_STATES)}, got {optimizer!r}")
    if img_size is not None and (isinstance(img_size, bool) or not isinstance(img_size, int) or img_size < 1):
        raise ActHFValueError(f"img_size: must be a positive int, got {img_size!r}")
    if not 0 <= margin < 10:
        raise ActHFValueError(f"margin: must be a fraction >= 0 (0.05 = 5%), got {margin!r}")
    if transient_factor is not None and (isinstance(transient_factor, bool)
                                         or not isinstance(transient_factor, (int, float))
                                         or not 0 <= transient_factor < 100):
        raise ActHFValueError(f"transient_factor: must be a number >= 0 or None, got {transient_factor!r}")
    if len(set(calib_batches)) < 2 or min(calib_batches) < 1:
        raise ActHFValueError(f"calib_batches: need at least two distinct positive batch sizes, got {calib_batches!r}")
    if not isinstance(checkpointing, bool):
        raise ActHFValueError(f"checkpointing: must be True or False, got {checkpointing!r}")
    if checkpoint_bits is not None and (isinstance(checkpoint_bits, bool) or checkpoint_bits not in range(1, 9)):
        raise ActHFValueError(f"checkpoint_bits: must be an int from 1 to 8 or None, got {checkpoint_bits!r}")
    if checkpoint_bits is not None and not checkpointing:
        raise ActHFValueError("checkpoint_bits: packs the inputs gradient checkpointing keeps; pass checkpointing=True "
                              "(--checkpointing) with it")
    if transient_factor is None:
        transient_factor = CHECKPOINTED_TRANSIENT_FACTOR if checkpointing else TRANSIENT_FACTOR
    cap = parse_size(gpu_mem, "gpu_mem") if gpu_mem is not None else None
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ActHFRuntimeError("device: cuda was asked for but no CUDA GPU is visible")
    amp = _DTYPES[dtype]

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        built = build_model(model_or_name, task=task, img_size=img_size, local_files_only=local_files_only)
    if built.kind != "image" and built.max_positions is not None and seq > built.max_positions:
        raise ActHFValueError(f"seq: {seq} is longer than the model's {built.max_positions} positions")
    base = built.model
    if checkpointing and not getattr(base, "supports_gradient_checkpointing", False):
        raise ActHFValueError(f"checkpointing: {type(base).__name__} has no Hugging Face gradient checkpointing "
                              "(supports_gradient_checkpointing is missing or False)")
    was_training = base.training
    base_device = next(base.parameters()).device if any(True for _ in base.parameters()) else device
    base.to(device)
    kwargs = {"batches": tuple(calib_batches), "max_batch": max(max_calib_batch, *calib_batches), "tol": tol,
              "seq": seq, "device": device, "dtype": amp}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            baseline, largest, head = _calibrate(built, base, **kwargs)
            logits, loss_context = head if head is not None else (None, None)
            patched = copy.deepcopy(base)
            if checkpointing:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # transformers' notes about use_cache
                    enable_hf_checkpointing(patched)
            patched = act_hf.patch(patched, bits=bits, checkpoint_bits=checkpoint_bits)
            try:
                avg_bits = _allocate(built, patched, seq, device, amp) if isinstance(bits, float) else None
                fit, _, _ = _calibrate(built, patched, **kwargs)
            finally:
                del patched
                gc.collect()
        num, trainable, param_bytes, grad_bytes, copies = _count(base, amp)
    finally:
        if isinstance(model_or_name, nn.Module):
            base.to(base_device)
            base.train(was_training)

    notes = list(built.notes)
    if isinstance(model_or_name, nn.Module):
        notes.append("model measured as given (attention-probability dropout not changed)")
    fits = " and ".join(f"{f.fit_batches[0]}, {f.fit_batches[1]} ({label})"
                        for f, label in ((baseline, "unpatched"), (fit, "act_hf")))
    notes += [
        ("projected peak = a model of memory, not a measured peak: params + grads + optimizer states"
         + (" + autocast bf16 weight copies" if copies else "")
         + f" + saved activations + transients ({margin:.0%} of the unpatched saved activations"
         + (f" plus two of its loss's fp32 log-probabilities, {format_bytes(loss_context.per_sample)} a sample"
            if loss_context is not None else "") + "; with act_hf "
         + f"{transient_factor:g}x the largest activation the unpatched model saves, "
           f"{format_bytes(largest.per_sample)} a sample"
         + (f", up to its LM head's output, plus those logits, {format_bytes(logits.per_sample)} a sample, and "
            f"two chunks of its loss, up to {format_bytes(2 * CHUNK_BYTES)}" if logits is not None else "") + ")"),
        (f"saved activations measured with act_hf.track_saved on {device.type} "
         f"({'bf16 autocast' if amp is not None else 'fp32'}, training-mode forward and loss) and fitted as "
         f"fixed + per_sample * batch through batches {fits}"),
        (f"optimizer {optimizer}: {_OPTIMIZER_STATES[optimizer]} fp32 state(s) per trainable parameter; "
         "CUDA context (~0.5 GiB) not included: give --gpu-mem as memory PyTorch may allocate"),
    ]
    if gpu_mem is not None:
        notes.append("allocator fragmentation not included: run with "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as the GPU measurements this model was "
                     "calibrated on did (with the default allocator, resnet50 at 2 bits, batch 1336, held 14.89 GB "
                     "for 10.36 GB allocated on an H200)")
    if avg_bits is not None:
        notes.append(f"adaptive budget {bits:g}: one sensitivity probe on random weights chose an average of "
                     f"{avg_bits:.2f} bits; a trained model's allocation differs, its bytes stay within the budget")
    if checkpointing:
        inputs = f"packed at {checkpoint_bits} bits" if checkpoint_bits else "exact"
        notes.append(f"act_hf column with HF gradient checkpointing (layer inputs {inputs}): its saved activations "
                     "are what the forward keeps plus one layer's context while it is recomputed (GACT's AM2); the "
                     "unpatched column is without checkpointing")
    if device.type == "cpu":
        notes.append("measured on CPU: unpatched saved bytes run a few % above GPU ones (bert-base 50.4 vs 47.8 "
                     "MiB/sample)")
    return Estimate(
        model=built.name, model_class=type(base).__name__, task=built.task, batch=batch,
        seq=seq if built.kind != "image" else None, img_size=built.img_size, bits=bits, dtype=dtype,
        device=str(device), optimizer=optimizer, gpu_mem=cap, margin=margin, num_params=num,
        trainable_params=trainable, param_bytes=param_bytes, grad_bytes=grad_bytes,
        optimizer_bytes=_OPTIMIZER_STATES[optimizer] * 4 * trainable, weight_copy_bytes=copies,
        baseline=baseline, act_hf=fit, avg_bits=avg_bits, checkpointing=checkpointing,
        checkpoint_bits=checkpoint_bits, largest=largest, transient_factor=float(transient_factor), logits=logits,
        loss_context=loss_context, notes=notes,
    )
