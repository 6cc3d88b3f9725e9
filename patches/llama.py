"""LLaMA-style decoders: LLaMA, Mistral, Qwen2, Qwen3, Gemma, Gemma 3 (RMSNorm, gated MLP, grouped-query
attention). Qwen3 and Gemma 3 add RMSNorms on q and k; Gemma's RMSNorms scale by ``1 + weight`` (the RMSNorm
rule finds each class's formula).

RMSNorm keeps its output (shared with the q/k/v and gate/up projections); ``act_fn`` (SiLU) of the SwiGLU
MLP is few-bit; the product ``act(gate) * up``, whose operands autograd's ``mul`` would keep at full width,
keeps both packed (:func:`act_hf.ops.product.act_product`), and ``down_proj`` compresses the product itself.
Attention: act_hf's SDPA function, GQA included.
"""

from __future__ import annotations

from act_hf.patcher import register_patch

from ._hf import GATED_MLP_FORWARD, ActGatedMLPMixin, patch_hf

__all__ = ["ActGatedMLPMixin", "GATED_MLP_FORWARD", "patch_llama"]  # the gated MLP's rule is every HF model's


@register_patch("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text")
def patch_llama(model, config) -> list[str]:
    return patch_hf(model, config)
