"""Channel scaling in patched models: which contexts get it, what it buys, and turning it off."""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch

import act_hf
from act_hf.context import store
from act_hf.nn._base import ActModule
from tests.patches.models import bert, timm_model


def _spy(monkeypatch) -> collections.Counter:
    """Count every packed copy the store makes, by (role of its slot, whether it is channel scaled)."""
    made: collections.Counter = collections.Counter()
    compress, compress_by_rows, compress_normalized = store.compress, store.compress_by_rows, store.compress_normalized

    def note(slot, packed):
        shape = packed.spec.shape
        rows = math.prod(shape) // shape[-1] if len(shape) >= 2 else 0
        made[(slot.rsplit(":", 1)[-1], packed.spec.channel_scaled, rows >= 64)] += 1
        return packed

    def spy(x, **kwargs):
        return note(kwargs["slot"], compress(x, **kwargs))

    def spy_by_rows(make, shape, settings, **kwargs):  # a BatchNorm's normalized input, packed by slices
        with monkeypatch.context() as inner:
            inner.setattr(store, "compress", compress)  # when it packs whole, count it once
            return note(settings.slot, compress_by_rows(make, shape, settings, **kwargs))

    def spy_normalized(x, mean, invstd, settings, make):  # a BatchNorm's normalized input, packed as x is read
        with monkeypatch.context() as inner:
            inner.setattr(store, "compress", compress)  # when it packs by slices or whole, count it once
            inner.setattr(store, "compress_by_rows", compress_by_rows)
            return note(settings.slot, compress_normalized(x, mean, invstd, settings, make))

    monkeypatch.setattr(store, "compress", spy)
    monkeypatch.setattr(store, "compress_by_rows", spy_by_rows)
    monkeypatch.setattr(store, "compress_normalized", spy_normalized)
    return made


def _bert_step(model, batch=8, seq=16):
    """One training step of the test BERT on ``batch x seq`` tokens (>= 64 rows: channel scaling applies)."""
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(4, 99, (batch, seq), generator=g),
              "labels": torch.tensor([0, 1] * (batch // 2))}
    model.zero_grad()
    model(**inputs).loss.backward()
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters()
                      if p.grad is not None and "embeddings" not in n])


@pytest.mark.parametrize("channel_scale", [True, False])
def test_layernorm_outputs_are_scaled_unless_turned_off(monkeypatch, channel_scale):
    """The LayerNorm outputs are scaled (and the Q/K/V and FFN linears read that copy); attention's q/k/v, the
    attention context and the GELU output are not: scaled by their channel maxima they measured worse."""
    model, _ = bert()
    model.train()
    act_hf.patch(model, bits=3, channel_scale=channel_scale)
    made = _spy(monkeypatch)
    _bert_step(model)
    assert {"input", "output", "q", "k", "v"} <= {role for role, _, _ in made}
    assert made[("output", channel_scale, True)] > 0 and made[("output", not channel_scale, True)] == 0
    for role in ("q", "k", "v"):
        assert made[(role, True, True)] == 0 and made[(role, False, True)] > 0
    assert made[("input", False, True)] > 0  # the attention context and GELU output stay plain
    assert not any(scaled for _, scaled, big in made if not big)  # under 64 rows: plain


def test_convolutions_and_batchnorm_are_never_scaled(monkeypatch):
    model, inputs = timm_model("resnet18")()
    model.train()
    act_hf.patch(model, bits=3)
    made = _spy(monkeypatch)
    model(**inputs).sum().backward()
    assert sum(n for (_, _, big), n in made.items() if big) > 10  # NCHW tensors with many "rows"
    assert not any(scaled for _, scaled, _ in made)


def test_outlier_channels_add_less_gradient_variance_when_scaled():
    """A BERT whose LayerNorms have two outlier channels (30x, as pretrained ones have): at 2 bits, the
    gradient's squared error against the exact one is smaller with the LayerNorm outputs channel scaled
    (measured 0.00307 -> 0.00237; the rest is the unscaled q/k of attention)."""
    torch.manual_seed(0)
    model, _ = bert()
    model.train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p[[3, 17]] *= 30
    exact = _bert_step(model)
    errors = {}
    for channel_scale in (False, True):
        patched = act_hf.patch(copy.deepcopy(model), bits=2, channel_scale=channel_scale, variance_alarm=0)
        act_hf.manual_seed(0)
        errors[channel_scale] = sum((_bert_step(patched) - exact).norm() ** 2 for _ in range(4)).item()
    print(f"squared gradient error over 4 draws: plain {errors[False]:.3g}, scaled {errors[True]:.3g}")
    assert errors[True] < errors[False] / 1.2


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_config_rejects_a_non_bool(value):
    with pytest.raises(TypeError, match="channel_scale must be True, False or None"):
        act_hf.ActConfig(channel_scale=value)


def test_on_by_default_for_fixed_bits_and_adaptive_budgets():
    """The default is on (None, as configs saved when it meant "fixed bits only" hold, means the default);
    an explicit False turns it off."""
    assert act_hf.ActConfig(bits=3).scales_channels and act_hf.ActConfig(bits=2.5).scales_channels
    assert act_hf.ActConfig(bits=2.0, channel_scale=None).scales_channels
    assert not act_hf.ActConfig(bits=3, channel_scale=False).scales_channels
    assert not act_hf.ActConfig(bits=2.5, channel_scale=False).scales_channels
    model, _ = bert()
    act_hf.patch(model, bits=2.5)
    norms = {m.act_channel_scale for m in model.modules() if isinstance(m, ActModule) and m.act_channel_scalable}
    assert norms == {True}


def test_the_setting_survives_save_copy_and_unpatch(tmp_path):
    act_hf.ActConfig(channel_scale=False).save_pretrained(tmp_path)
    assert act_hf.ActConfig.from_pretrained(tmp_path).channel_scale is False
    model, _ = bert()
    act_hf.patch(model, bits=3, channel_scale=False)
    copied = copy.deepcopy(model)
    flags = {m.act_channel_scale for m in copied.modules() if isinstance(m, ActModule)}
    assert flags == {False}
    act_hf.unpatch(model)
    assert not any("act_channel_scale" in m.__dict__ for m in model.modules())
