"""BERT-style layers whose feed-forward frees its intermediate tensor once the output's dense layer has read it
(``ActFeedForwardChunkMixin``) and sums the residual into the attention output where nothing else can read it: the
same values and gradients as HF's ``feed_forward_chunk``, and HF's method wherever a hook could see the output
module's call."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
import transformers

import act_hf
from act_hf.checkpoint import checkpoint, enable_hf_checkpointing
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


def _force_hf_method(model) -> None:
    """A no-op forward hook on every layer's output module: the layers then run HF's ``feed_forward_chunk``."""
    for layer in _layers(model):
        layer.output.register_forward_hook(lambda m, a, out: None)


def _loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of the ``bert-seqcls`` case from act_hf's seed 0: its loss and parameter gradients."""
    act_hf.manual_seed(0)
    loss = loss_of(CASES["bert-seqcls"], model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(step, reference) -> None:
    """The two ``(loss, gradients)`` pairs are equal, bit for bit."""
    (loss, grads), (ref_loss, ref_grads) = step, reference
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


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
    steps = []
    for hf_method in (False, True):
        model, inputs = _patched(chunk=chunk)
        if hf_method:
            _force_hf_method(model)
        steps.append(_loss_and_grads(model, inputs))
    _assert_same_step(*steps)


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


def _norm_calls(monkeypatch, model) -> list[tuple[torch.nn.Module, int, int]]:
    """``(norm, input data_ptr, output data_ptr)`` of every call of the model's converted LayerNorms, recorded by
    wrapping their class's ``forward`` (a module hook would make the layer sum out of place)."""
    calls = []
    cls = type(_layers(model)[0].output.LayerNorm)
    original = cls.forward

    def forward(self, x, *args, **kwargs):
        out = original(self, x, *args, **kwargs)
        calls.append((self, x.data_ptr(), out.data_ptr()))
        return out

    monkeypatch.setattr(cls, "forward", forward)
    return calls


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "checkpoint-first-pass"])
def test_the_residual_sum_is_written_into_the_attention_output(monkeypatch, grad):
    """The output LayerNorm's input is the attention output's storage: ``x + h`` made no third tensor of the
    stream's width, with autograd and in training mode without it (a packed checkpoint's first pass)."""
    model, inputs = _patched()
    calls = _norm_calls(monkeypatch, model)
    with torch.set_grad_enabled(grad):
        loss_of(CASES["bert-seqcls"], model, inputs)
    out_of = {id(norm): out for norm, _, out in calls}
    for layer in _layers(model):
        attention_norm, output_norm = layer.attention.output.LayerNorm, layer.output.LayerNorm
        into = next(x for norm, x, _ in calls if norm is output_norm)
        assert into == out_of[id(attention_norm)]


def test_a_hook_that_keeps_the_attention_output_sees_it_unchanged(monkeypatch):
    """A forward hook that keeps the attention module's output (feature extraction) gets the attention's values:
    the layer then sums out of place."""
    model, inputs = _patched()
    calls = _norm_calls(monkeypatch, model)
    layer = _layers(model)[0]
    kept = []
    layer.attention.register_forward_hook(lambda m, args, out: kept.append((out[0], out[0].clone())))
    loss_of(CASES["bert-seqcls"], model, inputs).backward()
    (attention_output, copy), = kept
    assert torch.equal(attention_output, copy)
    into = next(x for norm, x, _ in calls if norm is layer.output.LayerNorm)
    assert into != attention_output.data_ptr()


def test_an_intermediate_linear_that_saves_its_input_keeps_the_sum_out_of_place():
    """An intermediate whose linear is not act_hf's (replaced after patching, as an adapter library might) saves
    the attention output itself for its weight gradient in fp32: summing into it would fail backward. The layer
    sums out of place, and the loss and gradients are those of HF's method."""
    steps = []
    for hf_method in (False, True):
        model, inputs = _patched()
        for layer in _layers(model):
            plain = torch.nn.Linear(layer.intermediate.dense.in_features, layer.intermediate.dense.out_features)
            plain.load_state_dict(layer.intermediate.dense.state_dict())
            layer.intermediate.dense = plain
        if hf_method:
            _force_hf_method(model)
        steps.append(_loss_and_grads(model, inputs))
    _assert_same_step(*steps)


def _checkpointed_model(checkpoint: str, decoder: bool):
    """A 2-layer BERT masked LM (a decoder with cross-attention: an LM head model), hidden dropout 0.1, at 3 bits,
    with ``checkpoint``: ``"none"``, HF's checkpointing with exact layer inputs (``"exact"``) or with inputs packed
    at 4 bits (``"packed"``)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, hidden_dropout_prob=0.1, is_decoder=decoder,
                                     add_cross_attention=decoder)
    model = (transformers.BertLMHeadModel if decoder else transformers.BertForMaskedLM)(config).train()
    if checkpoint != "none":
        enable_hf_checkpointing(model)
    act_hf.patch(model, bits=3, checkpoint_bits=4 if checkpoint == "packed" else None)
    return model


def _checkpointed_step(checkpoint: str, hf_method: bool, autocast: bool, decoder: bool, *,
                       hooked_layers: bool = False):
    """Loss and gradients of one step of :func:`_checkpointed_model` with, for ``hf_method``, HF's feed-forward
    forced by hooks on the output modules, and for ``hooked_layers``, a no-op forward hook on every layer."""
    model = _checkpointed_model(checkpoint, decoder)
    if hf_method:
        _force_hf_method(model)
    if hooked_layers:
        for layer in _layers(model):
            layer.register_forward_hook(lambda m, a, out: None)
    ids = torch.randint(0, 100, (4, 16))
    extra = {"encoder_hidden_states": torch.randn(4, 8, 64)} if decoder else {}
    torch.manual_seed(1)
    act_hf.manual_seed(0)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, **extra).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpoint", ["none", "exact", "packed"])
def test_checkpointed_layers_with_dropout_and_cross_attention_sum_as_hf(checkpoint, autocast):
    """With gradient checkpointing (the first pass with autograd, or without it for packed layer inputs, and the
    recomputation), hidden dropout drawn in both passes and a decoder's cross-attention between the attention and
    the feed-forward, the loss and every gradient are those of HF's method, bit for bit."""
    for decoder in (False, True):
        _assert_same_step(*(_checkpointed_step(checkpoint, hf, autocast, decoder) for hf in (False, True)))


def test_a_packed_checkpoints_recomputation_frees_the_layer_input_after_the_attention(monkeypatch):
    """The recomputation hands each layer its decoded input to own (``act_recompute_owned``): by the time the
    intermediate runs, the input is gone (transformers' forward and the checkpoint's call held it to the end)."""
    model = _checkpointed_model("packed", decoder=False)
    layer_cls, inner_cls = type(_layers(model)[0]), type(_layers(model)[0].intermediate)
    recompute, inner_forward = layer_cls.act_recompute_owned, inner_cls.forward
    inputs, alive = [], []

    def recompute_spy(self, box, *args, **kwargs):
        inputs.append(weakref.ref(box[0]))
        return recompute(self, box, *args, **kwargs)

    def inner_spy(self, x):
        if inputs:
            alive.append(inputs[-1]() is not None)
        return inner_forward(self, x)

    monkeypatch.setattr(layer_cls, "act_recompute_owned", recompute_spy)
    monkeypatch.setattr(inner_cls, "forward", inner_spy)
    ids = torch.randint(0, 100, (4, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(inputs) == 2 and alive == [False, False]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_owned_recomputation_gives_the_hooked_layers_bits(autocast):
    """A hook on each layer keeps the recomputation on transformers' forward: loss and gradients are the same bit
    for bit, for an encoder and a decoder with cross-attention."""
    for decoder in (False, True):
        _assert_same_step(*(_checkpointed_step("packed", False, autocast, decoder, hooked_layers=hooked)
                            for hooked in (False, True)))


def test_a_checkpoint_of_the_layers_module_call_recomputes_it_owned(monkeypatch):
    """transformers 5.17 checkpoints ``nn.Module.__call__`` bound to the layer (later releases its ``forward`` with
    the layer first): act_hf's checkpoint of that call runs the owned recomputation too, with the gradients of the
    recomputation through the call (the layer saying no)."""
    grads = []
    for owned in (True, False):
        model = _checkpointed_model("none", decoder=False)
        layer = _layers(model)[0]
        if not owned:
            monkeypatch.setattr(type(layer), "act_takes_input_owned", lambda self, args, kwargs: False)
        calls, recompute = [], type(layer).act_recompute_owned

        def recompute_spy(self, box, *args, calls=calls, recompute=recompute, **kwargs):
            calls.append(1)
            return recompute(self, box, *args, **kwargs)

        monkeypatch.setattr(type(layer), "act_recompute_owned", recompute_spy)
        x = torch.randn(2, 8, 64, requires_grad=True)
        call = functools.partial(super(transformers.modeling_layers.GradientCheckpointingLayer, layer).__call__)
        torch.manual_seed(3)
        act_hf.manual_seed(0)
        checkpoint(call, x, None, bits=4).sum().backward()
        grads.append((x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}))
        assert calls == ([1] if owned else [])
        monkeypatch.undo()
    (x_grad, params), (ref_x_grad, ref_params) = grads
    assert torch.equal(x_grad, ref_x_grad)
    _assert_same_step((x_grad.sum(), params), (ref_x_grad.sum(), ref_params))


def test_a_layer_takes_its_input_owned_only_as_transformers_calls_it():
    """``act_takes_input_owned``: in training, with the cache under this transformers release's name and at most
    three positional arguments after the input; not with the other release's name, a hook on the layer, in eval
    mode, or with more positional arguments."""
    from act_hf.patches._hf import LAYER_FORWARDS, _layer_forward_cache_name

    model, _ = _patched()
    layer = _layers(model)[0]
    name = _layer_forward_cache_name(type(layer))
    assert name in LAYER_FORWARDS.values()
    other = next(n for n in LAYER_FORWARDS.values() if n != name)
    assert layer.act_takes_input_owned((None, None), {name: None, "encoder_attention_mask": None})
    assert not layer.act_takes_input_owned((None, None), {other: None})
    assert not layer.act_takes_input_owned((None, None, None, None), {})
    handle = layer.register_forward_pre_hook(lambda m, args: None)
    assert not layer.act_takes_input_owned((None, None), {})
    handle.remove()
    layer.eval()
    assert not layer.act_takes_input_owned((None, None), {})
