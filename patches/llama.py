"""LLaMA-style decoders: LLaMA, Mistral, Qwen2 (RMSNorm, SwiGLU MLP, grouped-query attention).

RMSNorm keeps its output (shared with the q/k/v and gate/up projections); ``act_fn`` (SiLU) of the SwiGLU
MLP is few-bit; the element-wise product ``act(gate) * up`` is a plain op whose operands autograd keeps
uncompressed (``down_proj`` compresses the product itself). Attention: act_hf's SDPA function, GQA included.
"""

from act_hf.patcher import register_patch

from ._hf import patch_hf


@register_patch("llama", "mistral", "qwen2")
def patch_llama(model, config) -> list[str]:
    return patch_hf(model, config)
