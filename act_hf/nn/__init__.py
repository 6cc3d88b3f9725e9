"""Drop-in modules: each an act_hf mixin in front of the original class (same parameters and state dict).

Importing this package registers the concrete classes (``ActLinear``, ``ActLayerNorm``, ``ActGELU``...) with
the class converter. Nothing here imports transformers or timm.
"""

from . import activation, dropout, linear, norm, pooling
from ._base import ActModule, act_class_for, convert, revert

__all__ = ["ActModule", "act_class_for", "activation", "convert", "dropout", "linear", "norm", "pooling", "revert"]
