"""A patched HF model's training forwards build no KV cache unless the caller asks for one
(``act_hf.patches._hf.disable_training_cache``): the same logits and loss, a lower highest point of forward."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers as tf

import act_hf
from tests.utils import load_benchmark, stub_codec


def _model(kind: str, layers: int = 2, hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":  # no attention dropout: SDPA's backend, and so its dropout draws, follow the keys' layout,
        # which the cache changes (unpatched GPT-2 with use_cache=False draws other masks than with it, too)
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=2, vocab_size=100,
                                                bos_token_id=0, eos_token_id=0, attn_pdrop=0.0)).train()
    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden,
                                              intermediate_size=2 * hidden, num_attention_heads=2,
                                              num_key_value_heads=2, vocab_size=100)).train()


def _cache(out):
    return getattr(out, "cache", None)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_training_forwards_build_no_cache_and_compute_the_same(kind):
    unpatched = _model(kind)
    model = act_hf.patch(copy.deepcopy(unpatched), bits=8)
    ids = torch.randint(0, 100, (2, 8))
    torch.manual_seed(1)  # the residual and embedding dropouts draw the same masks
    want = unpatched(input_ids=ids, labels=ids)
    torch.manual_seed(1)
    got = model(input_ids=ids, labels=ids)
    assert _cache(want) is not None and _cache(got) is None
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert _cache(model(input_ids=ids, use_cache=True)) is not None  # asked for
    with torch.no_grad():
        assert _cache(model(input_ids=ids)) is not None  # no autograd recording: not a training forward
    first = model(input_ids=ids[:, :4], use_cache=True)
    assert _cache(model(input_ids=ids[:, 4:], cache=_cache(first))) is not None  # a cache given: left alone
    assert _cache(model(ids)) is None  # input_ids by position
    model.eval()
    assert _cache(model(input_ids=ids)) is not None
    assert _cache(copy.deepcopy(model).train()(input_ids=ids)) is None  # a copy keeps the hook
    act_hf.unpatch(model.train())
    assert _cache(model(input_ids=ids)) is not None  # unpatch removes it


def test_a_model_whose_config_turns_the_cache_off_gets_no_hook():
    model = _model("llama")
    model.config.use_cache = False
    act_hf.patch(model, bits=8)
    assert not model._forward_pre_hooks


def test_the_cache_no_longer_raises_the_forward_peak(monkeypatch):
    """Forward's highest point of a LLaMA-style step, the codec stubbed (as a GPU's kernels make no
    temporaries): without the cache it is lower by most of every layer's keys and values (at the highest point,
    0.88 of the four layers' on this CPU)."""
    stub_codec(monkeypatch)
    profile_peak = load_benchmark("memory_at_peak").profile_peak
    layers, hidden, batch, seq = 4, 128, 2, 64
    model = act_hf.patch(_model("llama", layers, hidden), bits=3)
    ids = torch.randint(0, 100, (batch, seq))
    peaks = {}
    for use_cache in (None, True):
        step = functools.partial(model, input_ids=ids, labels=ids, use_cache=use_cache)
        profile = profile_peak(lambda step=step: step().loss, torch.device("cpu"))
        peaks[use_cache] = profile["phases"]["forward"]["peak"]
        model.zero_grad(set_to_none=True)
    keys_and_values = layers * 2 * batch * seq * hidden * 4
    assert peaks[True] - peaks[None] >= 0.75 * keys_and_values, (peaks, keys_and_values)
