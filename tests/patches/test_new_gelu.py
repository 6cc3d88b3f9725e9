"""transformers' ``NewGELUActivation`` (GPT-2's ``gelu_new``) on act_hf's path: its formula computed with one
full-width temporary (``new_gelu_with_one_temporary``), bit for bit, and a lower highest point."""

from __future__ import annotations

import pytest
import torch
import transformers.activations as hf_act

import act_hf
from act_hf.patches._hf import ActHFNewGELUMixin, new_gelu_with_one_temporary
from tests.patches.models import ALL_CASES
from tests.utils import forward_peak, stub_codec

SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -7.5, 30.0]


def _inputs(dtype, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 37, generator=g, dtype=torch.float64) * 4
    x[0, :len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.float64)
    return x.to(dtype).to(device)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "bf16-autocast"])
def test_the_formula_with_one_temporary_is_new_gelu_bit_for_bit(dtype, autocast):
    x = _inputs(dtype)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        assert _same(new_gelu_with_one_temporary(x), hf_act.NewGELUActivation()(x))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16])
def test_on_the_gpu_the_formula_with_one_temporary_is_new_gelu_bit_for_bit(dtype, autocast):
    """CUDA autocast computes ``pow`` in fp32: the temporary and the result are fp32, as the formula's are."""
    x = _inputs(dtype, "cuda")
    with torch.autocast("cuda", autocast or torch.bfloat16, enabled=autocast is not None):
        assert _same(new_gelu_with_one_temporary(x), hf_act.NewGELUActivation()(x))


def test_gpt2_activations_use_it_and_hold_fewer_temporaries(monkeypatch):
    """In a patched GPT-2 the MLP activation is converted and computes its output with the one-temporary formula;
    its forward's highest point (codec stubbed: the GPU's kernels make no temporaries) is one input-sized tensor
    below the formula's."""
    case = next(c for c in ALL_CASES if c.name == "gpt2")
    torch.manual_seed(0)
    model, _ = case.factory()
    act_hf.patch(model, bits=3).train()
    acts = [m for m in model.modules() if isinstance(m, ActHFNewGELUMixin)]
    assert acts and all(a.act_output_fn(torch.zeros(1)) is new_gelu_with_one_temporary for a in acts)
    stub_codec(monkeypatch)
    act = acts[0]
    x = torch.randn(8, 64, 512, requires_grad=True)
    ours = forward_peak(act, x)
    monkeypatch.setattr(act, "act_output_fn", lambda t: super(ActHFNewGELUMixin, act).act_output_fn(t))
    formula = forward_peak(act, x)
    assert formula - ours >= 0.99 * x.numel() * 4, (ours, formula)  # one fp32 tensor, less a few small blocks
