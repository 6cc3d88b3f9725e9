"""T5 (encoder-decoder): T5LayerNorm (RMS style, weight-dtype cast) keeps its output; ReLU / gated-GELU
feed-forward activations are few-bit (ReLU exact at 1 bit); attention through act_hf's function with T5's
relative position bias as the additive mask. The LM head stays exact."""

from act_hf.patcher import register_patch

from ._hf import patch_hf, rms_norm_rule


@register_patch("t5")
def patch_t5(model, config) -> list[str]:
    return patch_hf(model, config, rules=[rms_norm_rule(lambda m: "t5")])
