"""GPT-2: ``Conv1D`` projections (weight stored (in, out)) become transposed linears; gelu_new is NewGELU
(few-bit with the tanh-GELU table); attention through act_hf's SDPA function with its causal mask."""

from act_hf.patcher import register_patch

from ._hf import patch_hf


@register_patch("gpt2")
def patch_gpt2(model, config) -> list[str]:
    return patch_hf(model, config)
