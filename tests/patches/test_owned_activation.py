"""MLPs whose activation writes into its first linear's output (``activation_of_owned``): timm's ``Mlp`` and HF's
``*Intermediate``. The in-place form must be the out-of-place one bit for bit, forward and backward, and must step
aside wherever a hook could keep or read the overwritten tensor."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import act_hf
from tests.patches.models import ALL_CASES, loss_of
from tests.utils import forward_peak, stub_codec

MLPS = {"timm-vit": "ActMlpMixin", "timm-swin": "ActMlpMixin", "bert-seqcls": "ActIntermediateMixin",
        "vit-hf": "ActFcMLPMixin", "llama": "ActGatedMLPMixin", "convnext-hf": "ActConvNextLayerMixin",
        "timm-vit-swiglu": "ActSwiGLUMixin", "t5": "ActDenseActDenseMixin", "gemma": "ActGatedMLPMixin"}
CASES = {c.name: c for c in ALL_CASES if c.name in MLPS}
ACTIVATION = {"llama": "silu", "t5": "relu"}  # the others' is GELU (timm's ViT passes GELU to SwiGLU too; Gemma's:
# its tanh form, gelu_pytorch_tanh)


class _GeluCalls(TorchDispatchMode):
    """Counts the calls of an activation's aten op, out of place and in place (``gelu``, ``gelu_``)."""

    def __init__(self, name: str = "gelu"):
        super().__init__()
        self.calls = {name: 0, name + "_": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.calls:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _patched(name: str, bits: int = 3):
    torch.manual_seed(0)
    model, inputs = CASES[name].factory()
    act_hf.patch(model, bits=bits)
    return model.train(), inputs


def _mlps(model, name: str) -> list[torch.nn.Module]:
    return [m for m in model.modules() if any(c.__name__ == MLPS[name] for c in type(m).__mro__)]


def _step(name: str, model, inputs, autocast: bool):
    act_hf.manual_seed(0)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = loss_of(CASES[name], model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_mlp_activation_runs_in_place_with_the_out_of_place_results(name, autocast):
    """Every MLP is converted and runs ``gelu_`` instead of ``gelu`` (LLaMA's: ``silu_``; the gated ones write their
    product into the activation's output too); loss and every gradient equal those of the out-of-place calls
    (forward hooks on each first linear, and on a gated MLP's activation, force them), bit for bit, at 3 bits."""
    model, inputs = _patched(name)
    mlps = _mlps(model, name)
    assert mlps, f"no {MLPS[name]} in {name}"
    act = ACTIVATION.get(name, "gelu")
    with _GeluCalls(act) as calls:
        loss, grads = _step(name, model, inputs, autocast)
    assert calls.calls == {act: 0, act + "_": len(mlps)}, calls.calls
    first = [next(getattr(m, n) for n in ("fc1", "dense", "gate_proj", "pwconv1", "fc1_g", "wi") if hasattr(m, n))
             for m in mlps]
    gated_acts = [m.act_fn if hasattr(m, "act_fn") else m.act for m in mlps if hasattr(m, "gate_proj")
                  or hasattr(m, "fc1_g")]
    handles = [m.register_forward_hook(lambda mod, args, out: None) for m in first + gated_acts]
    with _GeluCalls(act) as calls:
        loss_ref, grads_ref = _step(name, model, inputs, autocast)
    assert calls.calls == {act: len(mlps), act + "_": 0}, calls.calls
    for h in handles:
        h.remove()
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for key in grads:
        assert torch.equal(grads[key], grads_ref[key]), key


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", [n for n in CASES if n != "t5"])
def test_an_owned_activation_writes_its_code_in_the_same_pass_with_the_same_results(monkeypatch, name, autocast):
    """Where the fused activations run (on CUDA; forced here, the reference kernel standing in), each MLP's GELU
    (LLaMA's SiLU) is one ``act_hf::activation_inplace_code`` (no ``gelu_``, no separate encode), and the loss and
    every gradient are the unfused run's bit for bit."""
    from act_hf.ops import activation as act_ops
    from tests.utils import dispatched

    model, inputs = _patched(name)
    in_place = ACTIVATION.get(name, "gelu") + "_"
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(act_ops, "_fuses_activation", lambda t, n, fused=fused: fused and t.is_contiguous())
        step = []
        ops = [f.overloadpacket.__name__
               for f, _ in dispatched(lambda step=step: step.append(_step(name, model, inputs, autocast)))]
        runs.append((ops, *step[0]))
        gc.collect()  # else the dispatch mode's frames keep the batch's packed copy, which the next step would reuse
    (ops, loss, grads), (unfused_ops, loss_ref, grads_ref) = runs
    assert ops.count("activation_inplace_code") == len(_mlps(model, name)) and in_place not in ops
    assert "activation_inplace_code" not in unfused_ops and unfused_ops.count(in_place) == len(_mlps(model, name))
    assert torch.equal(loss, loss_ref) and grads.keys() == grads_ref.keys()
    for key in grads:
        assert torch.equal(grads[key], grads_ref[key]), key


@pytest.mark.filterwarnings("ignore:act_hf has no family:act_hf.ActHFWarning")
@pytest.mark.parametrize(("model_type", "act"), [("granite", "silu"), ("cohere", "silu"), ("gemma2", "gelu")])
def test_gated_mlps_on_the_generic_fallback_own_their_activation(model_type, act):
    """LLaMA's gated MLP code in a model without an act_hf family (Granite, Cohere; Gemma 2's tanh GELU): the
    fallback converts it as LLaMA's family does, its activation runs in place, and the loss and every gradient
    equal those of the out-of-place calls that hooks on ``gate_proj`` force, bit for bit, at 3 bits."""
    from tests.patches.models import fallback_decoder

    torch.manual_seed(0)
    model, inputs = fallback_decoder(model_type)
    act_hf.patch(model, bits=3)
    model.train()
    mlps = [m for m in model.modules() if type(m).__name__.startswith("Act") and type(m).__name__.endswith("MLP")]
    assert mlps and all(any(c.__name__ == "ActGatedMLPMixin" for c in type(m).__mro__) for m in mlps)

    def step():  # the activations counted inside the MLPs alone (the fallback's loss path is no mode's to watch)
        act_hf.manual_seed(0)
        model.zero_grad(set_to_none=True)
        calls = _GeluCalls(act)

        def enter(mod, args):
            calls.__enter__()

        def leave(mod, args, out):
            calls.__exit__(None, None, None)

        handles = [h for m in mlps for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        loss = model(**inputs).loss
        for h in handles:
            h.remove()
        loss.backward()
        return calls.calls, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}

    calls, loss, grads = step()
    assert calls == {act: 0, act + "_": len(mlps)}, calls
    handles = [m.gate_proj.register_forward_hook(lambda mod, args, out: None) for m in mlps]
    calls_ref, loss_ref, grads_ref = step()
    for h in handles:
        h.remove()
    assert calls_ref == {act: len(mlps), act + "_": 0}, calls_ref
    assert torch.equal(loss, loss_ref) and grads.keys() == grads_ref.keys()
    for key in grads:
        assert torch.equal(grads[key], grads_ref[key]), key


def test_transformers_activations_hand_the_in_place_forms_that_fuse():
    """A patched transformers activation whose forward is a torch call hands that call's in-place form, the very
    function the fused path recognises (``FUSED_IN_PLACE``): ``GELUActivation`` exact GELU's, ``GELUTanh``
    (``gelu_pytorch_tanh``) the tanh form's, ``SiLUActivation`` SiLU's; their Python formulas hand none."""
    from torch import nn
    from transformers import activations as hf_act

    from act_hf.errors import ActHFWarning
    from act_hf.ops.activation import FUSED_IN_PLACE

    acts = nn.ModuleDict({"gelu": hf_act.GELUActivation(), "gelu_tanh": hf_act.GELUTanh(),
                          "silu": hf_act.SiLUActivation(), "gelu_python": hf_act.GELUActivation(use_gelu_python=True),
                          "gelu_tanh_python": hf_act.GELUTanh(use_gelu_tanh_python=True)})
    with pytest.warns(ActHFWarning, match="no family for ModuleDict"):
        act_hf.patch(acts, bits=3)
    for name, act in acts.items():
        assert act.act_inplace_forward() is FUSED_IN_PLACE.get(name), name


@pytest.mark.parametrize("name", ["timm-vit", "bert-seqcls", "vit-hf", "llama", "t5"])
def test_a_training_forward_without_autograd_runs_the_activation_in_place(name):
    """A packed checkpoint's first pass runs its layers in training mode without autograd: the activation still
    writes into the linear's output there (nothing is saved, and nothing reads that output after it; LLaMA's
    product goes into the activation's), with the values of the out-of-place calls that hooks on the first
    linears force."""
    model, inputs = _patched(name)
    mlps = _mlps(model, name)
    first = [next(getattr(m, n) for n in ("fc1", "dense", "gate_proj", "wi") if hasattr(m, n)) for m in mlps]
    act = ACTIVATION.get(name, "gelu")
    outputs = []
    for hooked in (False, True):
        handles = [m.register_forward_hook(lambda mod, args, out: None) for m in first] if hooked else []
        torch.manual_seed(0)
        with torch.no_grad(), _GeluCalls(act) as calls:
            outputs.append(loss_of(CASES[name], model, inputs))
        for h in handles:
            h.remove()
        assert calls.calls == ({act: len(mlps), act + "_": 0} if hooked else {act: 0, act + "_": len(mlps)})
    assert torch.equal(outputs[0], outputs[1])


def test_a_hook_that_keeps_the_linear_output_sees_it_unchanged():
    """A forward hook on the first linear that keeps its output (feature extraction) gets the linear's values, not
    the activation's: the MLP then calls the activation out of place. So do hooks on the activation itself."""
    model, inputs = _patched("timm-vit")
    mlp = _mlps(model, "timm-vit")[0]
    kept = {}
    handle = mlp.fc1.register_forward_hook(lambda mod, args, out: kept.update(fc1=(args[0], out)))
    loss_of(CASES["timm-vit"], model, inputs).backward()
    handle.remove()
    x, out = kept["fc1"]
    with torch.no_grad():
        assert torch.equal(out, torch.nn.functional.linear(x, mlp.fc1.weight, mlp.fc1.bias))
    seen = {}
    handle = mlp.act.register_forward_hook(lambda mod, args, out: seen.update(act=(args[0].clone(), out)))
    with _GeluCalls() as calls:
        loss_of(CASES["timm-vit"], model, inputs)
    handle.remove()
    assert calls.calls["gelu_"] == len(_mlps(model, "timm-vit")) - 1
    assert not torch.equal(seen["act"][0], seen["act"][1])


def test_eval_and_unpatch_run_the_original_mlp():
    model, inputs = _patched("bert-seqcls")
    model.eval()
    with torch.no_grad(), _GeluCalls() as calls:
        loss_of(CASES["bert-seqcls"], model, inputs)
    assert calls.calls["gelu_"] == 0
    act_hf.unpatch(model)
    assert not _mlps(model, "bert-seqcls")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_activation_output_and_the_linear_output_are_never_alive_together(monkeypatch, device):
    """The highest point of an MLP's forward (its input made outside) is lower than that of the out-of-place call
    (a hook on fc1), which holds fc1's output and the activation's at once: on the CPU from the profiler's
    allocations, the codec's reference stubbed, as a GPU's kernels make no temporaries, below two hidden-width
    tensors where the out-of-place call passes them (0.65 of one lower); on a GPU under bf16 autocast, whose
    hidden tensors are bf16, by 0.3 of one or more. There the in-place call's highest point is fc2's: fc2's output,
    its packed input and the bf16 copy of its weight (0.25, 0.19 and 0.18 of a hidden tensor here) come on top of
    fc1's output, so the saving is 0.38 of one, not a whole (H200 at 9c33c4f: 2.29 against 2.66 hidden tensors;
    the CPU under bf16 autocast gives the same to the byte, the input's bf16 copy in both, autocast caching the
    casts of leaves)."""
    stub_codec(monkeypatch)
    model, _ = _patched("timm-vit")
    mlp = model.to(device).blocks[0].mlp
    x = torch.randn(4 if device == "cpu" else 64, 17, mlp.fc1.in_features, device=device, requires_grad=True)
    hidden = x.shape[0] * x.shape[1] * mlp.fc1.out_features * (4 if device == "cpu" else 2)
    in_place = forward_peak(mlp, x)
    handle = mlp.fc1.register_forward_hook(lambda mod, args, out: None)
    out_of_place = forward_peak(mlp, x)
    handle.remove()
    assert out_of_place - in_place >= 0.3 * hidden, (in_place, out_of_place, hidden)
    if device == "cpu":
        assert in_place < 2 * hidden <= out_of_place, (in_place, out_of_place, hidden)


def test_a_gated_mlp_holds_at_most_two_intermediate_tensors(monkeypatch):
    """LLaMA's MLP, ``down(act(gate(x)) * up(x))``: the activation into ``gate``'s output, the product into the
    activation's, so the forward's highest point stays below three intermediate-width tensors, which the
    out-of-place calls hold at once (a hook on the activation forces them); codec stubbed as above."""
    stub_codec(monkeypatch)
    model, _ = _patched("llama")
    mlp = _mlps(model, "llama")[0]
    x = torch.randn(4, 33, mlp.gate_proj.in_features, requires_grad=True)
    wide = x.shape[0] * x.shape[1] * mlp.gate_proj.out_features * 4  # fp32 bytes of one intermediate tensor
    in_place = forward_peak(mlp, x)
    handle = mlp.act_fn.register_forward_hook(lambda mod, args, out: None)
    out_of_place = forward_peak(mlp, x)
    handle.remove()
    assert in_place < 3 * wide <= out_of_place, (in_place, out_of_place, wide)


def test_t5s_gated_feed_forward_keeps_its_product_operands_packed():
    """flan-T5's ``wo(act(wi_0(x)) * wi_1(x))``: both operands of the product packed in the slots ``:gate_act`` and
    ``:up``, where autograd's ``mul`` kept both at full width: no float tensor of the feed-forward's width is saved."""
    case = next(c for c in ALL_CASES if c.name == "flan-t5")
    torch.manual_seed(0)
    model, inputs = case.factory()
    act_hf.patch(model, bits=3).train()
    ffn = model.encoder.block[0].layer[1].DenseReluDense
    assert any(c.__name__ == "ActGatedActDenseMixin" for c in type(ffn).__mro__)
    wide = []

    def note(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dim() == 3 and t.shape[-1] == ffn.wi_0.out_features:
            wide.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
        loss_of(case, model, inputs).backward()
    assert not wide, wide
    with act_hf.track_saved(model) as saved:  # its own saved-tensor hooks: a run of its own
        loss = loss_of(case, model, inputs)
    loss.backward()
    width = inputs["input_ids"].numel() * ffn.wi_0.out_features * 4  # fp32 bytes of one encoder operand
    packed = saved.by_slot["encoder.block.0.layer.1.DenseReluDense:gate_act"]
    assert 0 < packed < width / 4 and saved.by_slot["encoder.block.0.layer.1.DenseReluDense:up"] == packed


@pytest.mark.parametrize("name", ["timm-vit-swiglu", "timm-vit-glu"])
def test_timms_gated_mlps_keep_their_product_operands_packed(name):
    """timm's ``SwiGLU`` and ``GluMlp``: the gated product through ``act_product``, so no float tensor of the
    hidden width is saved (autograd's ``mul`` kept both operands)."""
    case = next(c for c in ALL_CASES if c.name == name)
    torch.manual_seed(0)
    model, inputs = case.factory()
    act_hf.patch(model, bits=3).train()
    hidden = model.blocks[0].mlp.fc2.in_features
    wide = []

    def note(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dim() == 3 and t.shape[-1] == hidden:
            wide.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
        loss_of(case, model, inputs).backward()
    assert not wide, wide
