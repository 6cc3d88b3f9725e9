"""BERT-style layers whose feed-forward frees its intermediate tensor once the output's dense layer has read it
(``ActFeedForwardChunkMixin``): the same values and gradients as HF's ``feed_forward_chunk``, and HF's method
wherever a hook could see the output module's call."""

from __future__ import annotations

import pytest
import torch

import act_hf
from act_hf.patches._hf import ActFeedForwardChunkMixin
from tests.patches.models import ALL_CASES, loss_of
from tests.utils import alive_unhooked_and_hooked, output_alive_at

CASES = {c.name: c for c in ALL_CASES}


def _patched(name: str = "bert-seqcls", *, chunk: int = 0):
    torch.manual_seed(0)
    model, inputs = CASES[name].factory()
    for module in model.modules():
        if hasattr(module, "chunk_size_feed_forward"):
            module.chunk_size_feed_forward = chunk
    act_hf.patch(model, bits=4)
    return model.train(), inputs


def _layers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, ActFeedForwardChunkMixin)]


@pytest.mark.parametrize("name", ["bert-seqcls", "roberta", "xlm-roberta", "bert-mlm"])
def test_bert_style_layers_are_converted(name):
    model, _ = _patched(name)
    assert len(_layers(model)) == 2


def test_the_intermediate_is_freed_before_the_output_norm_unless_a_hook_could_see_the_output():
    """A hook on the output module sees its call: HF's method then runs."""
    model, inputs = _patched()
    layer = _layers(model)[0]
    run = lambda: loss_of(CASES["bert-seqcls"], model, inputs).backward()
    assert alive_unhooked_and_hooked(layer.intermediate, layer.output.LayerNorm, layer.output, run) == (False, True)


@pytest.mark.parametrize("chunk", [0, 4], ids=["whole", "chunked"])
def test_values_and_gradients_are_hf_feed_forwards(chunk):
    """Loss and every gradient equal those with HF's ``feed_forward_chunk`` (forced by a hook on each output
    module), bit for bit in fp32, with the same rounding draws; with ``chunk_size_feed_forward`` too, where
    ``apply_chunking_to_forward`` calls the method once per chunk of the sequence."""
    results = []
    for hf_method in (False, True):
        model, inputs = _patched(chunk=chunk)
        if hf_method:
            for layer in _layers(model):
                layer.output.register_forward_hook(lambda m, a, out: None)
        act_hf.manual_seed(0)
        loss = loss_of(CASES["bert-seqcls"], model, inputs)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (ref_loss, ref_grads) = results
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


@pytest.mark.parametrize("mode", ["eval", "train-no-grad"])
def test_in_eval_mode_hf_method_runs_and_in_a_checkpoints_first_pass_not(mode):
    """Eval mode runs HF's method; training mode without autograd (a checkpoint's first pass) frees the
    intermediate as with autograd on."""
    model, inputs = _patched()
    layer = _layers(model)[0]
    model.train(mode != "eval")
    with torch.no_grad():
        alive = output_alive_at(layer.intermediate, layer.output.LayerNorm,
                                lambda: model(**{k: v for k, v in inputs.items() if k != "labels"}))
    assert alive == (mode == "eval")
