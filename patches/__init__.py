"""One module per model family (installed as ``act_hf.patches``). Importing this package registers them all.

Hugging Face families need ``transformers``; timm families need ``timm``. A family whose library is missing
is simply not registered.
"""

import importlib
import logging

logger = logging.getLogger(__name__)

_HF_FAMILIES = ("bert", "gpt2", "llama", "t5", "vision_hf")
_TIMM_FAMILIES = ("timm_models",)

for _name in _HF_FAMILIES + _TIMM_FAMILIES:
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ImportError as exc:  # the optional library (transformers or timm) is not installed
        logger.info("act_hf family module %s not loaded: %s", _name, exc)
