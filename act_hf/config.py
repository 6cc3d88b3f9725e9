"""``ActConfig``: every act_hf knob in one validated dataclass."""

from __future__ import annotations

import enum
import json
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ActHFTypeError, ActHFValueError, ActHFWarning

__all__ = ["ACT_KINDS", "ActConfig", "ActPreset"]

logger = logging.getLogger(__name__)

CONFIG_NAME = "act_hf_config.json"
#: The kinds of module act_hf can compress; ``ActConfig.kinds`` selects among them.
ACT_KINDS = ("linear", "conv", "attention", "norm", "activation", "dropout", "pool")


class ActPreset(str, enum.Enum):
    """Named settings for :meth:`ActConfig.from_preset`."""

    NONE = "none"  # the baseline: nothing compressed
    INT8 = "int8"
    INT4 = "int4"
    INT3 = "int3"
    INT2 = "int2"
    ADAPTIVE_2_5 = "adaptive2.5"


_PRESETS: dict[ActPreset, dict[str, Any]] = {
    ActPreset.NONE: {"bits": 8, "kinds": ()},
    ActPreset.INT8: {"bits": 8},
    ActPreset.INT4: {"bits": 4},
    ActPreset.INT3: {"bits": 3},
    ActPreset.INT2: {"bits": 2},
    ActPreset.ADAPTIVE_2_5: {"bits": 2.5},
}


@dataclass
class ActConfig:
    """Every option of :func:`act_hf.patch`, validated on construction.

    Args:
        bits: an ``int`` 1..8 quantizes every compressed slot at that width; a ``float`` in [1, 8] (e.g. 2.5,
            or 2.0) is an average budget over all quantized slots, weighted by their sizes, that the adaptive
            allocator (:mod:`act_hf.adapt`) distributes.
        group_size: elements per quantization group (a positive multiple of 8).
        kinds: which kinds of module to compress, a subset of ``ACT_KINDS``.
        activation_bits: bits of the activation contexts: 1..4 are few-bit derivative codes (5 uses the 4-bit
            code), 6..8 the quantized input; ``None`` takes ``round(bits)``.
        norm_context: what LayerNorm/RMSNorm keep: ``"output"`` (shared with the next Linear, In-Place ABN
            style) or ``"input"`` (ActNN style).
        target_modules: only patch these modules: a string is a full-match regex on the module path, a list
            matches exact paths or ``.``-suffixes. ``None``: every module the family rules find.
        exclude_modules: never patch these (same matching as ``target_modules``).
        module_filter_fn: ``fn(module, path) -> bool``; modules for which it returns False are skipped.
        exclude_head: keep the task head (classifier, LM head, pooler) and the loss's inputs uncompressed.
        strict: raise when the model family is unknown or nothing could be patched, instead of falling back.
        fallback_hooks: for unknown families, also compress the remaining saved tensors through saved-tensor
            hooks.
        adapt_interval: training steps between re-allocations of adaptive bits (used when ``bits`` is a
            fractional budget); the first training step always allocates.
        adapt_samples: samples of the captured batch that the sensitivity probe runs on (fewer is cheaper).
        variance_alarm: warn when the gradient variance that compression adds exceeds this multiple of the
            minibatch gradient variance (GACT's failure predictor); ``0`` turns the check off.
        swap: move each packed context to pinned host memory as soon as it is packed, and fetch it back (with
            prefetch) in backward (:mod:`act_hf.swap`); only contexts on CUDA devices are moved.
        share_bn_relu: a conv or linear fed by ``relu(batch_norm(x))`` (or ``batch_norm(x)`` itself) reads its
            input from BatchNorm's packed normalized input and the ReLU's 1-bit mask (unbiased, no bytes of its
            own; :mod:`act_hf.derived`) instead of packing it again.
        share_residual: the same for a conv fed by a residual block's output ``relu(bn(.) + shortcut)`` (a ResNet
            block's input; timm's and torchvision's ResNet and RegNet, timm's CSPNet): read from the last
            BatchNorm's packed input, the ReLU's mask and the shortcut's own derived context, so a stage's block
            inputs cost nothing of their own (unbiased; the shortcut chain's rounding adds up, see
            :mod:`act_hf.derived`), with timm's stochastic depth (``DropPath``) before the add too; and a conv fed
            by a squeeze-and-excitation's ``g * h`` reads ``g`` times what describes ``h`` (EfficientNet's
            ``conv_pwl``, RegNetY's ``conv3``), and one fed by a linear bottleneck's ``bn3(.) + shortcut``
            (MobileNetV2 / V3, EfficientNet) reads the sum. With an adaptive budget a stage's chain is one slot
            group.
        lm_loss_recompute: a language model's loss (transformers' ``ForCausalLMLoss`` after an ``lm_head``, or
            the cross-entropy a model computes itself on its output embedding's rows: T5, masked LMs, BART under
            the fallback) keeps the head's input instead of the fp32 logits and recomputes them in backward (exact;
            :mod:`act_hf.ops.loss`).
        channel_scale: before quantizing the hidden states (LayerNorm/RMSNorm output contexts, which the
            linears after them share, and packed checkpoint inputs), multiply each feature channel by a power
            of two that equalizes the channels' ranges, and divide it back out when decoding (exact, so
            unbiased; four bytes per channel; :func:`act_hf.compress.quantize`). Hidden states have a few outlier
            channels tens of times larger than the rest, which otherwise set the range of every group they
            fall in (README, "Channel scaling"). Other contexts (attention's q/k/v, the attention context,
            GELU outputs) measured worse scaled and stay plain. On by default, for fixed bits and adaptive
            budgets alike: with this placement an adaptive budget of 2 gained 0.73 points of SST-2 and cut the
            gradient-variance alarm's ratio 20-50x (README, "Channel scaling"). ``None`` means the default
            (configs saved when it meant "fixed bits only" still load). :attr:`scales_channels` is the
            resolved value.
        checkpoint_bits: with HF gradient checkpointing on, keep each checkpointed layer's input packed at this
            many bits (1..8) instead of at full width, and recompute the layer from it in backward (GACT's CB1;
            :mod:`act_hf.checkpoint`). Opt-in because the recomputation runs on the rounded input, so the
            gradient is not unbiased: 8 bits kept MiniLM's SST-2 accuracy where 4 (GACT's choice) lost 2.9
            points against ``bits=3`` alone with plain groups, 0.9 with channel scaling (README). ``None``
            (default) keeps the inputs exact.
        data_bits: the fewest bits a linear or conv packs an input without autograd history at (``requires_grad``
            false: the batch the model is fed, e.g. the image a stem conv reads, or a frozen prefix's output)
            when ``bits`` is lower. That input alone makes the first layer's weight gradient, often the largest
            in a CNN, and its rounding did not average out: at 3 bits, timm's resnet50's whole-gradient error
            was 0.19 with the image at 3 bits and 0.087 at 8, for 1.2% more saved bytes (README, "The model's
            input"). Fixed bits only: an adaptive budget's allocator weighs these slots like any other.
            ``None`` packs them at ``bits``.
    """

    bits: int | float = field(default=3, metadata={"help": "int 1..8, or a float average budget for adaptive bits"})
    group_size: int = field(default=256, metadata={"help": "quantization group size (multiple of 8)"})
    kinds: tuple[str, ...] = field(default=ACT_KINDS, metadata={"help": f"kinds to compress, among {ACT_KINDS}"})
    activation_bits: int | None = field(default=None, metadata={"help": "activation context bits 1..8"})
    norm_context: str = field(default="output", metadata={"help": "'output' or 'input'"})
    target_modules: str | list[str] | None = field(default=None, metadata={"help": "regex or list of paths"})
    exclude_modules: str | list[str] | None = field(default=None, metadata={"help": "regex or list of paths"})
    module_filter_fn: Callable[[Any, str], bool] | None = field(default=None, metadata={"help": "filter function"})
    exclude_head: bool = field(default=True, metadata={"help": "keep the task head uncompressed"})
    strict: bool = field(default=False, metadata={"help": "error instead of fallback for unknown models"})
    fallback_hooks: bool = field(default=True, metadata={"help": "saved-tensor hooks for unknown families"})
    adapt_interval: int = field(default=1000, metadata={"help": "steps between adaptive re-allocations"})
    adapt_samples: int = field(default=8, metadata={"help": "samples the sensitivity probe runs on"})
    variance_alarm: float = field(default=10.0, metadata={"help": "warn when compression variance / minibatch "
                                                                "gradient variance exceeds this (0: off)"})
    swap: bool = field(default=False, metadata={"help": "swap packed contexts to pinned host memory"})
    share_bn_relu: bool = field(default=True, metadata={"help": "a conv after BatchNorm + ReLU reads BatchNorm's "
                                                                   "packed input instead of packing its own"})
    share_residual: bool = field(default=True, metadata={"help": "a conv after a residual block's relu(bn + "
                                                                    "shortcut) reads the tensors the ops before "
                                                                    "it saved"})
    lm_loss_recompute: bool = field(default=True, metadata={"help": "a language model's loss recomputes its logits in "
                                                                       "backward instead of keeping them"})
    channel_scale: bool | None = field(default=True, metadata={"help": "equalize feature channels by powers of "
                                                                          "two before quantizing (None: the "
                                                                          "default, on)"})
    checkpoint_bits: int | None = field(default=None, metadata={"help": "bits of the layer inputs HF gradient "
                                                                          "checkpointing keeps (None: exact)"})
    data_bits: int | None = field(default=8, metadata={"help": "fewest bits of a linear's or conv's input without "
                                                                 "autograd history (None: bits)"})

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
            raise ActHFTypeError(f"bits must be an int 1..8 or a float in [1, 8], got {self.bits!r}")
        if not 1 <= self.bits <= 8:
            raise ActHFValueError(f"bits must be an int 1..8 or a float in [1, 8], got {self.bits}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0 \
                or self.group_size % 8:
            raise ActHFValueError(f"group_size must be a positive multiple of 8, got {self.group_size!r}")
        if isinstance(self.kinds, str):
            self.kinds = (self.kinds,)
        self.kinds = tuple(self.kinds)
        unknown = [k for k in self.kinds if k not in ACT_KINDS]
        if unknown:
            raise ActHFValueError(f"kinds: unknown kind(s) {unknown}; allowed: {list(ACT_KINDS)}")
        if self.activation_bits is not None and (
            isinstance(self.activation_bits, bool) or self.activation_bits not in range(1, 9)
        ):
            raise ActHFValueError(f"activation_bits must be an integer from 1 to 8 (or None), got {self.activation_bits!r}")
        if self.norm_context not in ("output", "input"):
            raise ActHFValueError(f"norm_context must be 'output' or 'input', got {self.norm_context!r}")
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    re.compile(value)
                except re.error as exc:
                    raise ActHFValueError(f"{name} is not a valid regex ({exc}): {value!r}") from None
            elif value is not None:
                if not isinstance(value, (list, tuple, set)) or not all(isinstance(v, str) for v in value):
                    raise ActHFTypeError(f"{name} must be a regex string or a list of module paths, got {value!r}")
                setattr(self, name, sorted(set(value)))
        if self.module_filter_fn is not None and not callable(self.module_filter_fn):
            raise ActHFTypeError("module_filter_fn must be callable: fn(module, path) -> bool")
        if isinstance(self.adapt_interval, bool) or not isinstance(self.adapt_interval, int) or self.adapt_interval < 1:
            raise ActHFValueError(f"adapt_interval must be a positive int, got {self.adapt_interval!r}")
        if isinstance(self.adapt_samples, bool) or not isinstance(self.adapt_samples, int) or self.adapt_samples < 1:
            raise ActHFValueError(f"adapt_samples must be a positive int, got {self.adapt_samples!r}")
        if isinstance(self.variance_alarm, bool) or not isinstance(self.variance_alarm, (int, float)) \
                or not self.variance_alarm >= 0:
            raise ActHFValueError(f"variance_alarm must be a number >= 0 (0 turns it off), got {self.variance_alarm!r}")
        if self.checkpoint_bits is not None and (
            isinstance(self.checkpoint_bits, bool) or self.checkpoint_bits not in range(1, 9)
        ):
            raise ActHFValueError(f"checkpoint_bits must be an integer from 1 to 8 (or None), got {self.checkpoint_bits!r}")
        if self.data_bits is not None and (isinstance(self.data_bits, bool) or self.data_bits not in range(1, 9)):
            raise ActHFValueError(f"data_bits must be an integer from 1 to 8 (or None), got {self.data_bits!r}")
        for name in ("swap", "share_bn_relu", "share_residual", "lm_loss_recompute"):
            if not isinstance(getattr(self, name), bool):
                raise ActHFTypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.channel_scale is not None and not isinstance(self.channel_scale, bool):
            raise ActHFTypeError(f"channel_scale must be True, False or None (the default, on), got "
                                 f"{self.channel_scale!r}")

    @property
    def scales_channels(self) -> bool:
        """Whether channel scaling is on: ``channel_scale``, with ``None`` meaning the default (on)."""
        return self.channel_scale is not False

    @property
    def adaptive(self) -> bool:
        """True when ``bits`` is a float budget (e.g. 2.5 or 2.0) rather than an int width."""
        return isinstance(self.bits, float)

    @property
    def default_bits(self) -> int:
        """The fixed width; for a fractional budget, the budget rounded down: every slot's width until the
        first allocation (so memory never exceeds the budget)."""
        return int(self.bits)

    @property
    def data_bits_floor(self) -> int:
        """The fewest bits of an input without autograd history that the modules apply: ``data_bits`` with fixed
        bits, 0 (no floor) with an adaptive budget or ``data_bits=None``."""
        return 0 if self.adaptive or self.data_bits is None else self.data_bits

    @property
    def derivative_bits(self) -> int:
        """Bits of the activation contexts (few-bit codes at 1..5, quantized input at 6..8)."""
        if self.activation_bits is not None:
            return self.activation_bits
        return max(1, min(8, round(self.bits)))

    def with_overrides(self, **overrides: Any) -> ActConfig:
        """A copy with some fields replaced; unknown names raise ``ValueError`` listing the valid ones."""
        valid = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ActHFValueError(f"unknown option(s) {unknown}; valid options: {sorted(valid)}")
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(overrides)
        return ActConfig(**data)

    @classmethod
    def from_preset(cls, name: str | ActPreset, **overrides: Any) -> ActConfig:
        """Config of a named preset (``none``, ``int8``, ``int4``, ``int3``, ``int2``, ``adaptive2.5``)."""
        try:
            preset = ActPreset(name)
        except ValueError:
            raise ActHFValueError(
                f"unknown preset {name!r}; valid presets: {[p.value for p in ActPreset]}"
            ) from None
        return cls(**{**_PRESETS[preset], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (``module_filter_fn`` cannot be serialised and is left out)."""
        data = asdict(self)
        data.pop("module_filter_fn")
        data["kinds"] = list(self.kinds)
        return data

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``act_hf_config.json`` (sorted keys, with the act_hf version) into ``directory``."""
        from . import __version__

        path = Path(directory) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**self.to_dict(), "act_hf_version": __version__}, sort_keys=True, indent=2))
        return path

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ActConfig:
        """Read ``act_hf_config.json``; keys from a newer act_hf are dropped with a warning to upgrade."""
        data = json.loads((Path(directory) / CONFIG_NAME).read_text())
        version = data.pop("act_hf_version", "unknown")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            warnings.warn(
                f"{CONFIG_NAME} was written by act_hf {version} and has options this version does not know: "
                f"{unknown}. They are ignored; upgrade act_hf to use them.",
                ActHFWarning,
                stacklevel=2,
            )
        return cls(**{k: (tuple(v) if k == "kinds" else v) for k, v in data.items() if k in valid})
