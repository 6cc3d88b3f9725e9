"""act_hf: train Hugging Face transformers and timm models with compressed activation memory.

Forward outputs stay exactly what the unpatched model computes; only the context autograd keeps for the
backward pass is stored compressed. ``import act_hf`` is light: it neither builds the CUDA extension nor
initialises CUDA.
"""

from __future__ import annotations

from .compress import PackedTensor, dequantize, manual_seed, quantize
from .errors import ActHFError, ActHFWarning

__version__ = "0.1.0"

__all__ = [
    "ActHFError",
    "ActHFWarning",
    "PackedTensor",
    "__version__",
    "dequantize",
    "manual_seed",
    "quantize",
]
