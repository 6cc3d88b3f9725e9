"""act_hf: train Hugging Face transformers and timm models with compressed activation memory.

Forward outputs stay exactly what the unpatched model computes; only the context autograd keeps for the
backward pass is stored compressed::

    import act_hf
    act_hf.patch(model, bits=3)          # in place; returns the model

``import act_hf`` is light: it imports neither transformers nor timm, neither builds the CUDA extension nor
initialises CUDA. The patcher and the families load on first use.
"""

from __future__ import annotations

from typing import Any

from ._source_tree import install as _find_families_in_a_source_tree
from .compress import PackedTensor, dequantize, manual_seed, quantize
from .config import ActConfig, ActPreset
from .context import SavedTracker, track_saved
from .errors import ActHFError, ActHFWarning, NoMatchingModuleError
from .report import report

_find_families_in_a_source_tree()  # a checkout on PYTHONPATH: act_hf.patches is the patches/ folder beside it

__version__ = "0.1.0"

__all__ = [
    "ActCompressCallback",
    "ActConfig",
    "ActHFError",
    "ActHFWarning",
    "ActPreset",
    "NoMatchingModuleError",
    "PackedTensor",
    "SavedTracker",
    "__version__",
    "dequantize",
    "manual_seed",
    "patch",
    "quantize",
    "report",
    "track_saved",
    "unpatch",
]

_LAZY = {"patch": "patcher", "unpatch": "patcher", "ActCompressCallback": "trainer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'act_hf' has no attribute {name!r}")
