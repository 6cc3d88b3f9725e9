"""HF RMSNorm classes are found by name but converted only with the formula that reproduces their forward.

The name alone misleads: Qwen3-Next's RMSNorm scales by ``1 + weight`` like Gemma's, OLMo-2's is ``F.rms_norm``,
and a wrong formula changed the forward silently (a Gemma model, then under the generic fallback, trained with
every upstream gradient zero: its zero-initialised weights read as ``weight``, not ``1 + weight``).
"""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import act_hf
from act_hf.nn._base import ActModule
from act_hf.nn.norm import matching_rms_style
from tests.utils import assert_grads_match

# (transformers module, class, the formula of its forward)
CLASSES = [
    ("llama", "LlamaRMSNorm", "llama"),
    ("gemma", "GemmaRMSNorm", "gemma"),
    ("t5", "T5LayerNorm", "t5"),
    ("qwen3_next", "Qwen3NextRMSNorm", "gemma"),  # named like LLaMA's, computes like Gemma's
    ("olmo2", "Olmo2RMSNorm", "torch"),  # weight applied before the cast back: F.rms_norm's rounding
]


def _hf_class(module: str, name: str) -> type:
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


class CenteredRMSNorm(nn.Module):
    """A mean-subtracting "RMSNorm" (as Cohere's LayerNorm is): none of act_hf's formulas is this one."""

    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x - x.mean(-1, keepdim=True)
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def _patched_twin(norm: nn.Module, bits: int = 8):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), norm, nn.Linear(32, 4))
    model = copy.deepcopy(ref)
    with pytest.warns(act_hf.ActHFWarning, match="has no family"):
        act_hf.patch(model, bits=bits)
    return ref, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("module", "name", "style"), CLASSES, ids=[c[1] for c in CLASSES])
def test_each_class_gets_the_formula_of_its_forward(module, name, style, dtype):
    norm = _hf_class(module, name)(32).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        probes = [torch.randn(64, 32, dtype=d) * 3 for d in (torch.float32, torch.bfloat16)]  # as the rule's
        if style == "torch" and not all(torch.equal(F.rms_norm(x, (32,), norm.weight, norm.variance_epsilon),
                                                    norm(x)) for x in probes):
            # F.rms_norm's rounding is torch's to choose (torch 2.6's differs from 2.14's): then no formula
            # matches, and the class stays uncompressed (test_a_norm_no_formula_reproduces_keeps_its_forward...)
            style = None
    assert matching_rms_style(norm) == style
    if style is None:
        return
    ref, model = _patched_twin(norm)
    assert isinstance(model[1], ActModule) and model[1].act_rms_style == style
    x = torch.randn(64, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out, expected = model(x), ref(x)
    assert torch.equal(out, expected)
    out.float().pow(2).sum().backward()
    expected.float().pow(2).sum().backward()
    assert_grads_match(ref, model, cos=0.99 if dtype == torch.bfloat16 else 0.999, name=name)


def test_a_norm_no_formula_reproduces_keeps_its_forward_and_warns():
    norm = CenteredRMSNorm(32)
    assert matching_rms_style(norm) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, model = _patched_twin(norm)
    assert any("CenteredRMSNorm uncompressed" in str(w.message) for w in caught)
    assert type(model[1]) is CenteredRMSNorm
    x = torch.randn(64, 16)
    assert torch.equal(model(x), ref(x))


def test_a_gemma_model_trains_like_the_original():
    """The end-to-end case: a Gemma model keeps its loss and gradients at 8 bits (it was patched by the generic
    fallback then; the LLaMA patch covers it now, with the same RMSNorm rule)."""
    import transformers as tf

    cfg = tf.GemmaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0)
    torch.manual_seed(0)
    ref = tf.GemmaForCausalLM(cfg).train()
    model = copy.deepcopy(ref)
    act_hf.patch(model, bits=8)
    norms = [m for m in model.modules() if isinstance(m, _hf_class("gemma", "GemmaRMSNorm"))]
    assert norms and all(isinstance(m, ActModule) and m.act_rms_style == "gemma" for m in norms)
    ids = torch.randint(1, 99, (2, 40), generator=torch.Generator().manual_seed(0))
    loss, expected = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    assert_grads_match(ref, model, name="gemma")


def test_a_norm_on_the_meta_device_is_left_alone_and_the_warning_says_why():
    with torch.device("meta"):
        norm = _hf_class("llama", "LlamaRMSNorm")(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, model = _patched_twin(norm)
    assert any("meta device" in str(w.message) for w in caught)
    assert not isinstance(model[1], ActModule)
