"""act_hf.checkpoint: gradient checkpointing whose kept inputs are packed (GACT's CB1), alone and in HF models."""

from __future__ import annotations

import copy
import functools
import logging
import math
import threading
import warnings

import pytest
import torch
import transformers
from torch import nn

import act_hf
from act_hf.checkpoint import checkpoint, enable_hf_checkpointing
from act_hf.compress import dequantize, quantize
from tests.patches.models import _text_inputs, bert, llama
from tests.utils import assert_grads_match

torch_checkpoint = torch.utils.checkpoint.checkpoint


def _layer():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 16)).double()


def _grads(layer, x, run):
    """Output, input gradient and parameter gradients of ``run(layer, x)`` under a fixed dropout seed."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(1)
    y = run(layer, x * 2)
    (y ** 2).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]


def test_exact_inputs_give_the_uncheckpointed_gradient():
    """bits=None keeps the inputs: the same output and gradients as no checkpoint, dropout replayed."""
    layer, x = _layer(), torch.randn(4, 8, 16, dtype=torch.float64)
    y0, gx0, gp0 = _grads(layer, x, lambda m, h: m(h))
    y1, gx1, gp1 = _grads(layer, x, lambda m, h: checkpoint(m, h, bits=None))
    assert torch.equal(y1, y0)
    torch.testing.assert_close(gx1, gx0, rtol=1e-12, atol=1e-12)
    for a, b in zip(gp1, gp0):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("channel_scale", [True, False])
def test_packed_inputs_recompute_on_the_dequantized_input(bits, channel_scale):
    """Forward is exact; backward is exact autograd of the layer at Q(x) (the draw quantize() makes, channel
    scaled by default) applied to the gradient of the exact output."""
    layer, x = _layer(), torch.randn(8, 8, 16, dtype=torch.float64)  # 64 rows: enough to be channel scaled
    x[..., 3] *= 30  # an outlier channel
    y0, _, _ = _grads(layer, x, lambda m, h: m(h))
    act_hf.manual_seed(7)
    with act_hf.track_saved() as saved:
        y1, gx1, gp1 = _grads(layer, x, lambda m, h: checkpoint(m, h, bits=bits, group_size=64,
                                                                channel_scale=channel_scale))
    assert torch.equal(y1, y0)
    numel = x.numel()
    assert saved.by_slot["checkpoint"] == math.ceil(numel * bits / 8) + 4 * (numel // 64) + 4 * 16 * channel_scale

    act_hf.manual_seed(7)
    q = dequantize(quantize((x * 2).detach(), bits, 64, channel_scale=channel_scale)).requires_grad_()
    layer.zero_grad()
    torch.manual_seed(1)
    layer(q).backward(2 * y0)
    torch.testing.assert_close(gx1, 2 * q.grad, rtol=1e-12, atol=1e-12)
    for a, p in zip(gp1, layer.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-12, atol=1e-12)


def test_the_packed_input_is_all_that_is_kept():
    layer, x = _layer().float(), torch.randn(4, 8, 64, requires_grad=True)
    layer[0] = nn.Linear(64, 32)
    with act_hf.track_saved() as saved:
        y = checkpoint(layer, x * 1, bits=4, group_size=128, slot="block")
    numel = x.numel()
    assert saved.by_slot == {"block": math.ceil(numel * 4 / 8) + 4 * math.ceil(numel / 128)}
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())
    with act_hf.track_saved() as saved:
        checkpoint(layer, x * 1)  # 8 bits by default: 4 bits measurably cost accuracy (README)
    assert saved.by_slot == {"checkpoint": numel + 4 * math.ceil(numel / 256)}


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_recomputed_input_and_output_are_gone_while_the_layer_runs_backward():
    """In backward the layer runs again on the decoded input; its ops keep packed copies of what they read
    (act_hf's Linears, GELU), so neither that input nor the recomputed output is alive while the layer's
    backward runs: the input is no leaf held by the graph, and the backward starts from the output's gradient
    edge. Gradients as before (the test above)."""
    import weakref

    layer = act_hf.patch(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), bits=4)
    seen, alive = [], []

    def run(x):
        out = layer(x)
        seen.append((weakref.ref(x), weakref.ref(out)))
        if len(seen) == 2:  # the recomputation; the first weight's gradient is accumulated in the layer's backward
            layer[0].weight.register_post_accumulate_grad_hook(
                lambda p: alive.append(tuple(r() is not None for r in seen[1])))
        return out

    x = torch.randn(4, 8, 16, requires_grad=True)
    checkpoint(run, x * 1, bits=4).sum().backward()
    assert alive == [(False, False)]
    assert x.grad is not None


@pytest.mark.parametrize("bits", [None, 8])
def test_the_input_gradient_is_laid_out_as_a_leafs(bits):
    """The gradient handed to the ops before the checkpoint has the input's strides, as ``AccumulateGrad`` gave a
    leaf's: ``sum``'s backward makes an expanded (zero-stride) one, which is copied out."""
    x = torch.randn(6, 5, requires_grad=True)
    h = x * 1
    strides = []
    h.register_hook(lambda g: strides.append(g.stride()))
    checkpoint(lambda t: t.sum(0), h, bits=bits).sum().backward()
    assert strides == [h.stride()]
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_keyword_tensors_of_a_partial_get_their_gradients():
    """HF calls ``checkpoint(partial(forward, self, **kwargs), *args)``: a keyword tensor that requires grad
    still receives its gradient, and a mask keyword is passed through untouched."""
    lin = nn.Linear(8, 8).double()

    def block(module, x, *, other, mask):
        return module(x) * other + mask

    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    other = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(3, 8, dtype=torch.float64)
    y = checkpoint(functools.partial(block, lin, other=other, mask=mask), x, bits=None)
    y.sum().backward()
    gx, go, gw = x.grad.clone(), other.grad.clone(), lin.weight.grad.clone()
    for t in (x, other, lin.weight):
        t.grad = None
    block(lin, x, other=other, mask=mask).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(go, other.grad)
    torch.testing.assert_close(gw, lin.weight.grad)


def test_an_input_without_grad_still_trains_the_parameters():
    layer = _layer()
    x = torch.randn(4, 16, dtype=torch.float64)
    checkpoint(layer, x, bits=4).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


def test_misuse_is_refused_clearly():
    layer = _layer()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="autograd.grad"):
        torch.autograd.grad(checkpoint(layer, x, bits=4).sum(), x)
    with pytest.raises(RuntimeError, match="must return a tensor or a tuple"):
        checkpoint(lambda h: {"out": layer(h)}, x, bits=4)
    with pytest.raises(ValueError, match="bits must be an integer from 1 to 8"):
        checkpoint(layer, x, bits=9)


@pytest.mark.parametrize("value", [0, 9, True, 2.5, "4"])
def test_config_rejects_bad_checkpoint_bits(value):
    with pytest.raises((ValueError, TypeError), match="checkpoint_bits"):
        act_hf.ActConfig(checkpoint_bits=value)


# ------------------------------------------------------------------------------------------------ HF models


def _step(model, inputs):
    model.zero_grad()
    with act_hf.track_saved() as saved:
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), saved


#: the installed transformers' names of the switch (the current one arrived in 5.2x; 5.17 has only the old one)
CHECKPOINTING_APIS = [api for api in ("activation_checkpointing_enable", "gradient_checkpointing_enable")
                      if hasattr(transformers.PreTrainedModel, api)]


@pytest.mark.parametrize("api", CHECKPOINTING_APIS)
@pytest.mark.parametrize("order", ["before", "after"])
def test_hf_checkpointing_keeps_packed_layer_inputs(order, api):
    """Checkpointing switched on before or after the patch, by transformers' current method or its deprecated
    name: the loss is the uncheckpointed one, gradients agree at 8 bits, the layer inputs are packed, and
    unpatch restores torch's checkpoint. Layer 0's input is the embedding LayerNorm's output, which that
    LayerNorm has packed at the same width already: it is shared, not packed twice."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, inputs = bert()
    model.train()
    reference = copy.deepcopy(model)
    act_hf.patch(reference, bits=8)
    if order == "before":
        getattr(model, api)()
    act_hf.patch(model, bits=8, checkpoint_bits=8)
    if order == "after":
        getattr(model, api)()

    ref_loss, _ = _step(reference, inputs)
    loss, saved = _step(model, inputs)
    assert torch.equal(loss, ref_loss)
    assert_grads_match(reference, model, cos=0.999)
    hidden = inputs["input_ids"].numel() * 32  # elements of one hidden state
    assert {s: n for s, n in saved.by_slot.items() if s.endswith(":checkpoint_input")} == \
        {"bert.encoder.layer.1:checkpoint_input": hidden + 4 * math.ceil(hidden / 256)}
    assert "bert.embeddings.LayerNorm:output" in saved.by_slot

    act_hf.unpatch(model)
    func = model.bert.encoder.layer[0]._gradient_checkpointing_func
    assert isinstance(func, functools.partial) and func.func is torch_checkpoint
    assert func.keywords == {"use_reentrant": False}
    assert "_set_gradient_checkpointing" not in model.__dict__


@pytest.mark.parametrize("how", ["backward in another thread", "entries purged at every insert"])
def test_exact_checkpointed_layers_save_alike_in_both_passes(how, monkeypatch):
    """HF checkpointing with exact layer inputs: layer 1's Q, K and V linears read layer 0's last LayerNorm
    output, which that LayerNorm packed channel scaled; the checkpoint's forward drops the copy, so both passes
    must pack it again in that form. The recomputation runs where backward runs (on CUDA, autograd's device
    thread, emulated here by a thread) and after the store has purged dead entries many times."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, _ = bert()
    model.train()
    # 128 rows: LayerNorm outputs are channel scaled (at least CHANNEL_SCALE_MIN_ROWS)
    inputs = _text_inputs(99, batch=4, seq=32) | {"labels": torch.tensor([0, 1, 1, 0])}
    reference = copy.deepcopy(model)
    act_hf.patch(reference, bits=8)
    enable_hf_checkpointing(model)
    act_hf.patch(model, bits=8)
    if how == "entries purged at every insert":
        monkeypatch.setattr(act_hf.context, "_PURGE_EVERY", 1)
    ref_loss, _ = _step(reference, inputs)
    model.zero_grad()
    loss = model(**inputs).loss
    errors = []

    def backward():
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    if how == "backward in another thread":
        worker = threading.Thread(target=backward)
        worker.start()
        worker.join()
    else:
        backward()
    if errors:
        raise errors[0]
    assert torch.equal(loss.detach(), ref_loss)
    assert_grads_match(reference, model, cos=0.999)


def test_enable_hf_checkpointing_uses_the_current_method_with_torch_non_reentrant_checkpoint():
    model, inputs = bert()
    model.train()
    act_hf.patch(model, bits=8, checkpoint_bits=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # not the name transformers 5.2x deprecates
        enable_hf_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.bert.encoder.layer)
    _, saved = _step(model, inputs)
    assert "bert.encoder.layer.1:checkpoint_input" in saved.by_slot
    act_hf.unpatch(model)
    assert model.bert.encoder.layer[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}


def test_a_deep_copy_switches_its_own_layers():
    """``copy.deepcopy`` of a patched model (an EMA or reference copy): switching checkpointing on in the copy
    converts the copy's layers and leaves the original alone."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, inputs = bert()
    model.train()
    act_hf.patch(model, bits=8, checkpoint_bits=4)
    twin = copy.deepcopy(model)
    twin.gradient_checkpointing_enable()
    assert not model.bert.encoder.layer[0].gradient_checkpointing
    assert twin.bert.encoder.layer[0].gradient_checkpointing
    assert getattr(twin.bert.encoder.layer[0]._gradient_checkpointing_func, "act_hf_compressed", False)
    _, saved = _step(twin, inputs)
    assert "bert.encoder.layer.1:checkpoint_input" in saved.by_slot


def test_packed_checkpoint_layers_pickle(tmp_path):
    """The checkpoint function act_hf puts on each layer pickles (HF's own input-grad hook does not, so the
    encoder is saved, not the whole model): the loaded encoder keeps its inputs packed and computes the same
    gradients."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, _ = bert()
    model.train()
    model.gradient_checkpointing_enable()
    act_hf.patch(model, bits=4, checkpoint_bits=4)
    torch.save(model.bert.encoder, tmp_path / "encoder.pt")
    loaded = torch.load(tmp_path / "encoder.pt", weights_only=False)
    assert getattr(loaded.layer[0]._gradient_checkpointing_func, "act_hf_compressed", False)
    grads = []
    for encoder in (model.bert.encoder, loaded):
        x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        act_hf.manual_seed(0)
        with act_hf.track_saved() as saved:
            out = encoder(x).last_hidden_state
        out.pow(2).sum().backward()
        assert "bert.encoder.layer.1:checkpoint_input" in saved.by_slot
        grads.append([x.grad, *(p.grad for p in encoder.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_decoder_with_rotary_tables_and_dropout():
    """LLaMA passes its rotary tables as keyword tensors: the checkpointed, packed model trains like the
    uncheckpointed one (loss exact, gradients agree at 8 bits) with dropout replayed."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, inputs = llama(dropout=0.1)
    model.train()
    reference = copy.deepcopy(model)
    act_hf.patch(reference, bits=8)
    model.gradient_checkpointing_enable()
    act_hf.patch(model, bits=8, checkpoint_bits=8)
    torch.manual_seed(5)
    ref_loss, _ = _step(reference, inputs)
    torch.manual_seed(5)
    loss, saved = _step(model, inputs)
    assert torch.equal(loss, ref_loss)
    assert_grads_match(reference, model, cos=0.99)
    assert any(s.endswith(":checkpoint_input") for s in saved.by_slot)


def test_adaptive_bits_probe_runs_uncheckpointed():
    """The allocator's probe uses autograd.grad; layers run uncheckpointed during it, and training goes on."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, inputs = bert()
    model.train()
    model.gradient_checkpointing_enable()
    act_hf.patch(model, bits=2.5, adapt_samples=2, variance_alarm=0, checkpoint_bits=4)
    for _ in range(2):
        loss, saved = _step(model, inputs)
        assert torch.isfinite(loss)
    assert model.act_hf_allocator.updates == 1
    assert model.act_hf_allocator.average_bits() <= 2.5
    assert any(s.endswith(":checkpoint_input") for s in saved.by_slot)


def test_hf_offloaded_checkpointing_keeps_its_own_function_and_warns_once(caplog):
    """transformers' ``offload=True`` wraps torch's checkpoint in ``save_on_cpu``: act_hf leaves that function
    on every layer (the inputs stay exact, on the host), says so once, and the step is the plain one."""
    model, inputs = bert()
    model.train()
    reference = copy.deepcopy(model)
    act_hf.patch(reference, bits=8)
    act_hf.patch(model, bits=8, checkpoint_bits=8)
    with caplog.at_level(logging.WARNING, logger="act_hf.checkpoint"):
        getattr(model, CHECKPOINTING_APIS[0])(offload=True)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "checkpoint_bits=8 has no effect" in caplog.text
    funcs = {id(layer._gradient_checkpointing_func) for layer in model.bert.encoder.layer}
    assert len(funcs) == 1 and not getattr(model.bert.encoder.layer[0]._gradient_checkpointing_func,
                                           "act_hf_compressed", False)
    ref_loss, _ = _step(reference, inputs)
    try:
        loss, saved = _step(model, inputs)
    except RuntimeError as exc:  # the offload pins host memory: torch 2.6 refuses to without a GPU, 2.14 not
        if "pin_memory allocator" not in str(exc):
            raise
        pytest.skip(f"needs a CUDA GPU: transformers' offload pins host memory, which torch {torch.__version__} "
                    "does only with one")
    assert torch.equal(loss, ref_loss)
    assert_grads_match(reference, model, cos=0.999)
    assert not any(s.endswith(":checkpoint_input") for s in saved.by_slot)


@pytest.mark.filterwarnings("ignore:act_hf has no family")
def test_a_model_without_hf_checkpointing_warns():
    with pytest.warns(act_hf.ActHFWarning, match="checkpoint_bits=4 has no effect"):
        act_hf.patch(nn.Sequential(nn.Linear(4, 4)), bits=3, checkpoint_bits=4)


@pytest.mark.cuda
def test_packed_checkpoint_frees_the_layer_inputs_on_cuda():
    """BERT (6 x 512) at batch 64 x 128 under bf16 autocast, checkpointed: with checkpoint_bits=4 the memory
    held after forward drops by about the six full-width layer inputs less their packed copies; swapping
    the packed inputs to the host changes no gradient (bit for bit under deterministic algorithms: without them
    CUDA's embedding backward accumulates with atomics, and two runs of one setting differed in
    token_type_embeddings by 3.5e-7 on the H100, benchmarks/results/gpu_h100_3/diagnosis.log)."""
    import transformers as tf

    warnings.filterwarnings("ignore", category=FutureWarning)
    cfg = tf.BertConfig(vocab_size=1000, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                        intermediate_size=2048, attention_probs_dropout_prob=0.0, num_labels=2)
    torch.manual_seed(0)
    base = tf.BertForSequenceClassification(cfg).cuda().train()
    base.gradient_checkpointing_enable()
    inputs = {"input_ids": torch.randint(0, 1000, (64, 128), device="cuda"),
              "labels": torch.zeros(64, dtype=torch.long, device="cuda")}
    dtypes = []
    base.bert.encoder.layer[1].register_forward_pre_hook(lambda m, args: dtypes.append(args[0].dtype))
    held, grads = {}, {}
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: cuBLAS asks for CUBLAS_WORKSPACE_CONFIG
    try:
        for name, options in {"exact": {}, "packed": {"checkpoint_bits": 4},
                              "swapped": {"checkpoint_bits": 4, "swap": True}}.items():
            model = act_hf.patch(copy.deepcopy(base), bits=3, **options)
            act_hf.manual_seed(0)
            torch.manual_seed(0)
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**inputs).loss
            torch.cuda.synchronize()
            torch.empty(1, device="cuda")
            held[name] = torch.cuda.memory_allocated() - start
            loss.backward()
            grads[name] = [p.grad for p in model.parameters()]
            assert all(g is not None and torch.isfinite(g).all() for g in grads[name])
            del model, loss
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    hidden = 64 * 128 * 512
    full, packed = hidden * torch.empty(0, dtype=dtypes[0]).element_size(), hidden // 2 + 4 * hidden // 256
    assert held["exact"] - held["packed"] >= 0.9 * 6 * (full - packed)
    assert all(torch.equal(a, b) for a, b in zip(grads["packed"], grads["swapped"]))
