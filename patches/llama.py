"""LLaMA-style decoders: LLaMA, Mistral, Qwen2, Qwen3, Gemma, Gemma 3 (RMSNorm, gated MLP, grouped-query
attention). Qwen3 and Gemma 3 add RMSNorms on q and k; Gemma's RMSNorms scale by ``1 + weight`` (the RMSNorm
rule finds each class's formula).

RMSNorm keeps its output (shared with the q/k/v and gate/up projections); ``act_fn`` (SiLU) of the SwiGLU
MLP is few-bit; the product ``act(gate) * up``, whose operands autograd's ``mul`` would keep at full width,
keeps both packed (:func:`act_hf.ops.product.act_product`), and ``down_proj`` compresses the product itself.
Attention: act_hf's SDPA function, GQA included.
"""

from __future__ import annotations

from torch import Tensor, nn

from act_hf.nn._base import ActModule
from act_hf.nn.activation import activation_of_owned, output_is_owned
from act_hf.ops.product import act_product
from act_hf.patcher import Rule, code_fingerprint, register_patch

from ._hf import patch_hf

__all__ = ["ActGatedMLPMixin", "GATED_MLP_FORWARD", "patch_llama"]


class ActGatedMLPMixin(ActModule):
    """A gated MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` whose product keeps both operands packed
    (slots ``<path>:gate_act`` and ``<path>:up``). The activation writes into ``gate_proj``'s output and the product
    into the activation's (:func:`activation_of_owned`, ``act_product(into_a=True)``) where nothing else can hold
    them: of the four intermediate-width tensors, at most two are alive at once. The rule converts an MLP only
    when its ``forward`` is that code (:data:`GATED_MLP_FORWARD`); the submodules are converted by their own
    rules."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_owns_intermediates(x):
            return super().forward(x)
        owned = output_is_owned(self.act_fn)
        gate = activation_of_owned(self.act_fn, self.gate_proj(x), self.gate_proj)
        return self.down_proj(act_product(gate, self.up_proj(x), self.act_settings("gate_act"),
                                          self.act_settings("up"), into_a=owned))


#: :func:`code_fingerprint` of ``LlamaMLP.forward`` (the same code in Mistral, Qwen2/3, Gemma 1/3, transformers 5.x).
GATED_MLP_FORWARD = "5b8abf7af12a4b42"


def _is_gated_mlp(m: nn.Module) -> bool:
    cls = type(m)
    return cls.__name__.endswith("MLP") and cls.__module__.startswith("transformers.") \
        and code_fingerprint(cls.forward) == GATED_MLP_FORWARD


@register_patch("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text")
def patch_llama(model, config) -> list[str]:
    return patch_hf(model, config, rules=[Rule("linear", _is_gated_mlp, lambda m: ActGatedMLPMixin)])
