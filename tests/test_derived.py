"""A conv after BatchNorm + (leaky) ReLU reads BatchNorm's packed input: bytes, exactness, unbiasedness,
invalidation."""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import act_hf
from act_hf import derived
from act_hf.nn import ActModule
from tests.utils import assert_grads_match, sqnr_db

C, H = 16, 16  # 256 values per channel: BatchNorm packs x_norm (above MIN_VALUES_PER_CHANNEL)


#: the activations a conv reads through: name -> module (inplace), and BatchNorm's gamma range for it (ReLU6's
#: wide enough that it clips at 6 too)
RECTIFIERS = {
    "relu": (lambda inplace: nn.ReLU(inplace=inplace), (0.5, 1.5)),
    "leaky_relu": (lambda inplace: nn.LeakyReLU(0.2, inplace=inplace), (0.5, 1.5)),
    "relu6": (lambda inplace: nn.ReLU6(inplace=inplace), (2.0, 6.0)),
    "hardtanh": (lambda inplace: nn.Hardtanh(-0.5, 1.0, inplace=inplace), (0.5, 1.5)),
}


class Chain(nn.Module):
    """BatchNorm -> ReLU (or another of :data:`RECTIFIERS`) -> Conv, with an optional in-place edit between two of
    them."""

    def __init__(self, inplace: bool = True, edit: str | None = None, act: str = "relu"):
        super().__init__()
        make, gamma = RECTIFIERS[act]
        self.bn = nn.BatchNorm2d(C)
        self.relu = make(inplace)
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.edit = edit
        with torch.no_grad():
            self.bn.weight.uniform_(*gamma)
            self.bn.bias.normal_(0, 0.5)

    def forward(self, x):
        y = self.bn(x)
        if self.edit == "bn_output":
            y = y.mul_(2)
        h = self.relu(y)
        if self.edit == "relu_output":
            h = h.mul_(2)  # autograd's own ReLU keeps its output: the unpatched twin edits a copy
        elif self.edit == "relu_output_copy":
            h = h * 2
        return self.conv(h)


def _twins(cls, bits, config: dict, **kwargs):
    """An unpatched ``cls(**kwargs)`` and a patched copy."""
    torch.manual_seed(0)
    ref = cls(**kwargs)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", act_hf.ActHFWarning)  # no family: known leaf modules only
        act_hf.patch(model, bits=bits, fallback_hooks=False, **config)
    return ref, model


def _chain(bits=3, share=True, **kwargs):
    return _twins(Chain, bits, {"share_bn_relu": share}, **kwargs)


def _input():
    return torch.randn(4, C, H, H) * 2 + 0.3


ACTS = pytest.mark.parametrize("act", list(RECTIFIERS))


@ACTS
@pytest.mark.parametrize("inplace", [True, False])
def test_conv_saves_no_input_of_its_own(inplace, act):
    """The conv keeps nothing of its own after a (leaky) ReLU; after a clipping one, 1 bit an element: where the
    activation clipped at the top."""
    _, shared = _chain(inplace=inplace, act=act)
    _, own = _chain(share=False, inplace=inplace, act=act)
    x = _input()
    with act_hf.track_saved(shared) as s:
        shared(x.clone().requires_grad_())
    with act_hf.track_saved(own) as o:
        own(x.clone().requires_grad_())
    upper = x.numel() // 8 if act in ("relu6", "hardtanh") else 0
    assert s.by_slot.get("conv:input", 0) == upper and o.by_slot["conv:input"] > 2 * upper
    assert s.bytes == o.bytes - o.by_slot["conv:input"] + upper


def _assert_exact_at_8_bits(ref, model, name):
    """The forward is unchanged and the gradients match the unpatched twin's."""
    x = _input()
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = model(xm), ref(xr)
    assert torch.equal(out, expected)
    g = torch.randn_like(out)
    out.backward(g)
    expected.backward(g)
    assert_grads_match(ref, model, name=name)
    assert sqnr_db(xr.grad, xm.grad) > 30


def _assert_unbiased(ref, model, conv: str, torch_seed: int | None = None):
    """The mean over many draws of the 2-bit weight gradient of ``conv`` converges to the exact one (with
    ``torch_seed``, torch's generator is reseeded before every forward: the same stochastic depth draws)."""
    x = _input()
    g = torch.randn(4, C, H, H)
    if torch_seed is not None:
        torch.manual_seed(torch_seed)
    ref.double()(x.double()).backward(g.double())
    exact = ref.get_submodule(conv).weight.grad
    draws = 256
    total = torch.zeros_like(exact)
    first_error = None
    for seed in range(draws):
        act_hf.manual_seed(seed)
        if torch_seed is not None:
            torch.manual_seed(torch_seed)
        model.zero_grad()
        model(x.clone().requires_grad_()).backward(g)
        grad = model.get_submodule(conv).weight.grad.double()
        total += grad
        if first_error is None:
            first_error = (grad - exact).norm()
    # an unbiased estimate's error falls as 1/sqrt(draws) = 1/16 of one draw's; a bias would stop it
    assert (total / draws - exact).norm() < 0.15 * first_error


@ACTS
def test_forward_is_unchanged_and_gradients_match_at_8_bits(act):
    _assert_exact_at_8_bits(*_chain(bits=8, inplace=True, act=act), name="bn-relu-conv")


@ACTS
def test_conv_weight_gradient_is_unbiased(act):
    _assert_unbiased(*_chain(bits=2, act=act), "conv")


class Fork(Chain):
    """BatchNorm -> ReLU6 -> two convs that read its output."""

    def __init__(self):
        super().__init__(act="relu6")
        self.conv2 = nn.Conv2d(C, C, 1, bias=False)

    def forward(self, x):
        h = self.relu(self.bn(x))
        return self.conv(h) + self.conv2(h)


def test_convs_reading_one_clipped_tensor_share_its_upper_code():
    ref, model = _twins(Fork, 8, {})
    with act_hf.track_saved(model) as saved:
        model(_input().requires_grad_())
    assert saved.by_slot["conv:input"] == _input().numel() // 8 and "conv2:input" not in saved.by_slot
    _assert_exact_at_8_bits(ref, model, name="fork")


def test_one_bit_more_beats_the_own_copy_with_fewer_bytes():
    """The trade measured in act_hf.derived: shared at b + 1 bits against an own copy at b bits."""
    x = _input()
    g = torch.randn(4, C, H, H)
    ref, _ = _chain()
    ref.double()(x.double().requires_grad_()).backward(g.double())
    results = {}
    for share, bits in ((False, 3), (True, 4)):
        _, model = _chain(bits=bits, share=share)
        sqnr = []
        for seed in range(4):
            act_hf.manual_seed(seed)
            model.zero_grad()
            model(x.clone().requires_grad_()).backward(g)
            sqnr.append(sqnr_db(ref.conv.weight.grad, model.conv.weight.grad))
        with act_hf.track_saved(model) as saved:
            model(x.clone().requires_grad_())
        results[share] = (sum(sqnr) / len(sqnr), saved.bytes)
    assert results[True][0] > results[False][0]
    assert results[True][1] < results[False][1]


@pytest.mark.parametrize("edit", ["bn_output", "relu_output"])
def test_an_in_place_edit_makes_the_conv_pack_its_own_input(edit):
    ref, model = _chain(bits=8, edit=edit)
    if edit == "relu_output":
        ref.edit = "relu_output_copy"
    x = _input()
    with act_hf.track_saved(model) as saved:
        out = model(x.clone().requires_grad_())
    assert saved.by_slot.get("conv:input", 0) > 0
    out.backward(torch.ones_like(out))
    ref(x.clone().requires_grad_()).backward(torch.ones_like(out))
    assert_grads_match(ref, model, name=edit)


def test_a_conv_at_other_bits_packs_its_own_input():
    _, model = _chain(bits=3)
    model.conv.act_bits = 4
    with act_hf.track_saved(model) as saved:
        model(_input().requires_grad_())
    assert saved.by_slot.get("conv:input", 0) > 0


def test_fused_in_place_relu_gives_the_conv_the_same_codes(monkeypatch):
    """BatchNorm -> in-place ReLU -> conv with the ReLU fused with its code (``act_hf::relu_inplace_code``, forced
    here for CPU tensors) and unfused: the conv, rebuilding its input from BatchNorm's packed input and the ReLU's
    code, gets the same gradients, bit for bit, and so does everything else."""
    from act_hf.ops import activation as act_ops
    from tests.utils import dispatched

    x = _input()
    grads = []
    for fused in (True, False):
        monkeypatch.setattr(act_ops, "_fuses_relu", lambda t, fused=fused: fused and t.is_contiguous())
        _, model = _chain(bits=3)
        act_hf.manual_seed(0)
        xm, outs = x.clone().requires_grad_(), []
        ops = {f.overloadpacket.__name__ for f, _ in dispatched(lambda m=model, x=xm, o=outs: o.append(m(x)))}
        assert ("relu_inplace_code" in ops) == fused
        outs[0].backward(torch.ones_like(outs[0]))
        grads.append([xm.grad, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    del outs
    gc.collect()  # the dispatch mode's frames hold the forwards' tensors, and their notes, until the collector runs


def test_share_bn_relu_is_validated():
    with pytest.raises(TypeError, match="share_bn_relu must be True or False"):
        act_hf.ActConfig(share_bn_relu="yes")


def test_adaptive_bits_give_conv_and_batchnorm_one_group():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C), nn.ReLU(inplace=True),
                          nn.Conv2d(C, C, 3, padding=1), nn.Flatten(), nn.Linear(C * H * H, 4))
    with pytest.warns(act_hf.ActHFWarning, match="no family"):
        act_hf.patch(model, bits=2.5, variance_alarm=0)
    x, y = torch.randn(4, 3, H, H), torch.randint(0, 4, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.act_hf_allocator.update_batch((x, y), lambda b: nn.functional.cross_entropy(model(b[0]), b[1]))
    groups = [g.slots for g in model.act_hf_allocator.groups.values()]
    assert ["1:input", "3:input"] in groups
    with warnings.catch_warnings(), act_hf.track_saved(model) as saved:
        warnings.simplefilter("error")  # no second probe (it would warn that the output has no loss)
        model(x)
    assert model.act_hf_allocator.updates == 1
    assert "3:input" not in saved.by_slot  # one width for the group: the conv reads BatchNorm's draw
    act_hf.unpatch(model)


def test_gradient_checkpointing_recomputes_the_same_context():
    """checkpoint drops the first pass's saved tensors at once; the recomputation must decide the same way."""
    ref, model = _chain(bits=8)
    x = _input()
    xm = x.clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(model, xm, use_reentrant=False)
    out.backward(torch.ones_like(out))
    ref(x.clone().requires_grad_()).backward(torch.ones_like(out))
    assert_grads_match(ref, model, name="checkpointed")


def test_notes_die_with_the_tensors_they_describe():
    _, model = _chain()
    during = []
    model.conv.register_forward_pre_hook(lambda m, args: during.append(len(derived._notes())))
    out = model(_input().requires_grad_())
    assert during == [2]  # BatchNorm's output and the ReLU's (the same tensor, in place)
    gc.collect()
    assert len(derived._notes()) == 0  # that tensor is gone: only the conv's saved references remain
    out.sum().backward()


def test_a_note_outlives_its_tensor_only_until_the_next_note_or_query():
    x = torch.randn(2, C, 4, 4, requires_grad=True)
    t = x * 1
    derived.remember(t, "affine", "t's note")
    node = t.grad_fn
    del t
    assert derived._dead() == [("affine", node, 0, "t's note")]
    kept = x * 2
    derived.remember(kept, "affine", "kept's note")
    assert derived._dead() == []  # the next note
    derived.remember(x * 3, "affine", "a note")
    assert len(derived._dead()) == 1
    derived.affine_of(kept)
    assert derived._dead() == []  # the next query
    edited = x * 4
    derived.remember(edited, "affine", "edited's note")
    with torch.no_grad():
        edited.add_(0)
    del edited
    assert derived._dead() == []  # modified since noted: vouches for nothing
    head_output = x * 5  # an LM head's output that ``logits / scale`` frees before the loss asks
    derived.remember(head_output, "lm_head", "the head's note")
    node = head_output.grad_fn
    del head_output
    assert derived._operand(node, 0, x) is None  # a residual sum's operand is never an LM head's output
    assert derived.note_made_by(node, 0, "lm_head") == "the head's note"
    assert derived.note_made_by(node, 0, "lm_head") is None  # read once: the query dropped it


class Stage(nn.Module):
    """``h = relu(bn0(x))``, then ``blocks`` residual blocks ``h = relu(bn(conv(h)) + h)`` (``add``: ``"in_place"``
    ``y += h``; ``"new"`` ``z = y + h`` with ``y`` alive; ``"rebound"`` ``y = y + h``, which frees BatchNorm's
    output before the ReLU asks; ``"edited_rebound"`` the same after an edit of ``y`` autograd does not see;
    ``"alpha"`` ``torch.add(y, h, alpha=2)``), then a head conv: every conv after the first
    block reads a residual block's output. With ``drop_path``, timm's stochastic depth follows each block's
    BatchNorm; with ``se``, timm's squeeze-and-excitation (SE-ResNet's ``SEModule``) comes before it."""

    def __init__(self, blocks: int = 3, add: str = "in_place", edit_shortcut: bool = False, drop_path: float = 0.0,
                 se: bool = False):
        super().__init__()
        from timm.layers import DropPath, SEModule

        self.drop_paths = nn.ModuleList(DropPath(drop_path) for _ in range(blocks))
        self.ses = nn.ModuleList(SEModule(C, rd_ratio=0.25) if se else nn.Identity() for _ in range(blocks))
        self.bn0 = nn.BatchNorm2d(C)
        self.relu0 = nn.ReLU(inplace=True)
        self.convs = nn.ModuleList(nn.Conv2d(C, C, 3, padding=1, bias=False) for _ in range(blocks))
        self.bns = nn.ModuleList(nn.BatchNorm2d(C) for _ in range(blocks))
        self.relus = nn.ModuleList(nn.ReLU(inplace=True) for _ in range(blocks))
        self.head = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.add, self.edit_shortcut = add, edit_shortcut
        with torch.no_grad():
            for bn in [self.bn0, *self.bns]:
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.normal_(0, 0.5)

    def forward(self, x):
        h = self.relu0(self.bn0(x))
        for conv, bn, relu, drop_path, se in zip(self.convs, self.bns, self.relus, self.drop_paths, self.ses):
            y = drop_path(se(bn(conv(h))))
            if self.edit_shortcut:
                with torch.no_grad():
                    h.mul_(1.0)  # same values, one more version: the note on h no longer vouches for them
            if self.add == "in_place":
                y += h
            elif self.add == "new":
                z = y + h
                h = relu(z)
                continue
            elif self.add == "rebound":
                y = y + h
            elif self.add == "edited_rebound":
                with torch.no_grad():
                    y.mul_(1.0)  # same values, one more version: the note on y no longer vouches for them
                y = y + h
            else:
                y = torch.add(y, h, alpha=2)
            h = relu(y)
        return self.head(h)


def _stage(bits=3, share=True, **kwargs):
    return _twins(Stage, bits, {"share_residual": share}, **kwargs)


READERS = ["convs.1:input", "convs.2:input", "head:input"]  # each reads relu(bn(.) + shortcut)


ADDS = ["in_place", "new", "rebound"]


def _shared_and_own(**kwargs):
    """The saved-tensor trackers of a stage's forward with ``share_residual`` on and off; the convs after its
    residual blocks read their input from the ops before them only with it on."""
    _, shared = _stage(**kwargs)
    _, own = _stage(share=False, **kwargs)
    x = _input()
    with act_hf.track_saved(shared) as s:
        shared(x.clone().requires_grad_())
    with act_hf.track_saved(own) as o:
        own(x.clone().requires_grad_())
    assert not set(READERS) & set(s.by_slot) and all(o.by_slot[slot] > 0 for slot in READERS)
    return s, o


@pytest.mark.parametrize("add", ADDS)
def test_convs_after_residual_blocks_save_no_input_of_their_own(add):
    s, o = _shared_and_own(add=add)
    assert "convs.0:input" not in s.by_slot and "convs.0:input" not in o.by_slot  # relu(bn(.)): shared either way
    assert s.bytes == o.bytes - sum(o.by_slot[slot] for slot in READERS)


@pytest.mark.parametrize("add", ADDS)
def test_residual_forward_is_unchanged_and_gradients_match_at_8_bits(add):
    _assert_exact_at_8_bits(*_stage(bits=8, add=add), name=f"residual-{add}")


def test_a_residual_relu_mask_is_applied_from_its_packed_bits(monkeypatch):
    """A conv reading ``relu(bn(.) + shortcut)`` zeroes what the ReLU dropped straight from its packed mask, as the
    terms of the sum are decoded into it, all of a chain in one pass (``act_hf::unpack_dequantize_chain``, whose
    CPU kernel unpacks the masks a run of rows at a time, here one item): no 1-byte mask of the whole tensor is
    made, no pass of its own zeroes the dropped elements, no decode adds to a sum another wrote, and the gradients
    are those of a run over the whole tensor, bit for bit."""
    from act_hf.compress import reference
    from tests.utils import dispatched

    chain, calls = reference.unpack_dequantize_chain, []

    def step(run_elements):
        def recorded(out, payloads, *args, **kwargs):
            calls.append((len(payloads), args[-1]))  # the terms, accumulate
            chain(out, payloads, *args, chunk=run_elements)

        monkeypatch.setattr(reference, "unpack_dequantize_chain", recorded)
        _, model = _stage(bits=3)
        act_hf.manual_seed(0)
        out = model(_input().requires_grad_())
        ops = dispatched(lambda: out.backward(torch.ones_like(out)))
        return [p.grad for p in model.parameters()], ops

    whole, _ = step(1 << 20)
    calls.clear()
    sliced, ops = step(16)
    numel = _input().numel()
    names = [str(func) for func, _ in ops]
    assert any("act_hf.unpack_dequantize_chain" in name for name in names)
    assert sorted(terms for terms, _ in calls)[-3:] == [2, 3, 4] and not any(accumulate for _, accumulate in calls)
    assert not any("zero_unmasked_inplace" in name for name in names)
    assert not [t for func, outs in ops if "unpack_bits" in str(func) for t in outs if t.numel() >= numel]
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))


@pytest.mark.parametrize("case", ["plain", "channels_last", "drop_path"])
def test_a_block_input_is_one_chain_decode_where_its_terms_allow(monkeypatch, case):
    """Each block input of a stage is one ``dequantize_chain`` (1 to 4 terms); a term decoded to its own layout
    (channels last) or scaled per sample (stochastic depth) makes the sum go term by term as before: with channels
    last no chain at all, with stochastic depth only the one-term decodes of ``relu(bn(.))``."""
    from act_hf import derived

    chain, calls = derived.dequantize_chain, []

    def recorded(terms, **kwargs):
        calls.append(len(terms))
        return chain(terms, **kwargs)

    monkeypatch.setattr(derived, "dequantize_chain", recorded)
    _, model = _stage(bits=3, drop_path=0.2 if case == "drop_path" else 0.0)
    x = _input()
    if case == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    out = model(x.requires_grad_())
    out.backward(torch.ones_like(out))
    assert sorted(calls) == {"plain": [1, 2, 3, 4], "channels_last": [], "drop_path": [1, 1, 1, 1]}[case]
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_residual_conv_weight_gradient_is_unbiased():
    """The head conv reads a chain of three sums."""
    _assert_unbiased(*_stage(bits=2), "head")


@pytest.mark.parametrize("case", ["alpha", "edited_rebound", "edited_shortcut", "off"])
def test_an_add_it_cannot_vouch_for_makes_the_conv_pack_its_own_input(case):
    kwargs = {"alpha": {"add": "alpha"}, "edited_rebound": {"add": "edited_rebound"},
              "edited_shortcut": {"edit_shortcut": True}, "off": {"share": False}}[case]
    ref, model = _stage(bits=8, **kwargs)
    ref.edit_shortcut = False  # autograd's ReLU keeps its output: the reference may not edit it (values unchanged)
    x = _input()
    with act_hf.track_saved(model) as saved:
        out = model(x.clone().requires_grad_())
    assert all(saved.by_slot.get(slot, 0) > 0 for slot in READERS)
    out.backward(torch.ones_like(out))
    ref(x.clone().requires_grad_()).backward(torch.ones_like(out))
    assert_grads_match(ref, model, name=case)


def test_adaptive_bits_give_a_residual_chain_one_group():
    """The convs after the blocks read every BatchNorm input of the chain: the allocator gives them one width."""
    _, model = _twins(Stage, 2.5, {"variance_alarm": 0})
    x = _input()
    model.act_hf_allocator.update_batch(x, lambda b: model(b.requires_grad_()).square().mean())
    chain = {"bn0:input", "bns.0:input", "bns.1:input", "bns.2:input", "convs.0:input", *READERS}
    assert any(chain <= set(group.slots) for group in model.act_hf_allocator.groups.values())
    with act_hf.track_saved(model) as saved:
        model(x.clone().requires_grad_())
    assert not ({"convs.0:input", *READERS} & set(saved.by_slot))
    act_hf.unpatch(model)


def _checkpointed_stage(stage, inp):
    """The stage with its second block in torch's non-reentrant checkpoint: the block's input ``h`` and its
    shortcut are noted outside the checkpoint."""
    h = stage.relu0(stage.bn0(inp))
    y = stage.bns[0](stage.convs[0](h))
    y += h
    h = stage.relus[0](y)

    def block(h):
        y = stage.bns[1](stage.convs[1](h))
        y += h
        return stage.head(stage.relus[1](y))

    return torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)


# the saved-tensor hooks a checkpointed forward may run inside: torch's recomputation then gets the block's input
# as a new tensor object, which carries none of the notes made on the forward's
SURROUNDING_HOOKS = {"none": contextlib.nullcontext, "track_saved": act_hf.track_saved,
                     "save_on_cpu": torch.autograd.graph.save_on_cpu}


@pytest.mark.parametrize("hooks", SURROUNDING_HOOKS)
def test_residual_chain_under_gradient_checkpointing(hooks):
    """The checkpointed block's forward and its recomputation decide alike: neither reads the notes made outside
    the checkpoint (the forward did, the recomputation under saved-tensor hooks could not: CheckpointError)."""
    ref, model = _stage(bits=8)
    x = _input()
    with SURROUNDING_HOOKS[hooks]():
        out = _checkpointed_stage(model, x.clone().requires_grad_())
    out.backward(torch.ones_like(out))
    _checkpointed_stage(ref, x.clone().requires_grad_()).backward(torch.ones_like(out))
    assert_grads_match(ref, model, name="checkpointed residual")


def test_notes_under_a_builtin_pack_hook_are_the_outside_ones():
    """A pack hook without weak references (a builtin) names no region: notes go on as outside any hooks."""
    x = torch.randn(2, C, 4, 4, requires_grad=True)
    t = x * 1
    derived.remember(t, "affine", "outside")
    with torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, torch.Tensor.detach):
        assert derived.recall(t, "affine") == "outside"
        u = x * 2
        derived.remember(u, "affine", "inside")
    assert derived.recall(u, "affine") == "inside"


def test_notes_are_seen_only_in_the_checkpoint_pass_that_made_them_and_dropped_after_it():
    x = torch.randn(2, C, 4, 4, requires_grad=True)
    outer = x * 1
    derived.remember(outer, "affine", "outer")
    seen, inner = [], []

    def block(h):
        u = h * 2
        derived.remember(u, "affine", "inner")
        seen.append((derived.recall(outer, "affine"), derived.recall(u, "affine")))
        inner.append(u)
        return (u * u).sum()

    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    assert seen == [(None, "inner")]
    assert derived.recall(outer, "affine") == "outer"
    assert derived.recall(inner[0], "affine") is None  # outside the pass that noted it
    assert len(derived._local.regions) == 0  # that pass is over: its notes, and what they hold, are gone
    out.backward()
    assert seen[1] == (None, "inner")  # the recomputation: a pass of its own


def test_share_residual_is_validated():
    with pytest.raises(TypeError, match="share_residual must be True or False"):
        act_hf.ActConfig(share_residual=1)


def _timm_saved_by_sharing(name: str, **model_kwargs) -> dict:
    """``{share_residual: tracker}``: the saved context of timm model ``name`` at 2 bits, one training forward of
    2 x 3 x 128 x 128 (the last stage's 4 x 4 maps: 32 values per channel, so its BatchNorms pack)."""
    import timm

    torch.manual_seed(0)
    x = torch.randn(2, 3, 128, 128)
    saved = {}
    for share in (True, False):
        model = timm.create_model(name, num_classes=3, **model_kwargs).train()
        act_hf.patch(model, bits=2, share_residual=share)
        with act_hf.track_saved(model) as saved[share]:
            model(x)
    return saved


@pytest.mark.parametrize("drop_path_rate", [0.0, 0.2])
def test_timm_resnet_block_inputs_cost_nothing_of_their_own(drop_path_rate):
    """timm's BasicBlock adds its shortcut in place: every block input after the first is read from the ops
    before it (layer1.0's shortcut is the max-pool output layer1.0.conv1 packed; later stages start with a
    downsample BatchNorm), with stochastic depth too (timm's training recipes use it)."""
    saved = _timm_saved_by_sharing("resnet18", drop_path_rate=drop_path_rate)
    block_inputs = {slot for slot in saved[False].by_slot if slot.endswith(".conv1:input")}
    assert len(block_inputs) == 8
    assert {slot for slot in saved[True].by_slot if slot.endswith(".conv1:input")} == {"layer1.0.conv1:input"}
    assert saved[True].bytes == saved[False].bytes - sum(saved[False].by_slot[s] for s in block_inputs - {
        "layer1.0.conv1:input"})


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")  # no family for RegNet: known modules and hooks
def test_timm_regnet_block_inputs_cost_nothing_of_their_own():
    """timm's RegNet block adds out of place, ``x = drop_path(conv3(x)) + downsample(shortcut)``, so BatchNorm's
    output is gone when the ReLU asks (its note outlives it); a stage's first block adds a downsample
    ``BatchNormAct2d`` in the In-Place ABN form, noted as its packed output. Every block input but the first
    (the stem's ReLU output, shared either way) is read from the ops before it, and the 8-bit gradients match."""
    import timm

    saved = _timm_saved_by_sharing("regnetx_002")
    block_inputs = {slot for slot in saved[False].by_slot if slot.endswith(".conv1.conv:input")}
    assert len(block_inputs) == 12  # depths 1, 1, 4, 7: all blocks after s1.b1
    assert not {slot for slot in saved[True].by_slot if slot.endswith(".conv1.conv:input")}
    assert saved[True].bytes == saved[False].bytes - sum(saved[False].by_slot[s] for s in block_inputs)

    ref = timm.create_model("regnetx_002", num_classes=3).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    x = torch.randn(2, 3, 128, 128)
    for net in (ref, model):
        net(x).square().mean().backward()
    assert_grads_match(ref, model, name="regnetx_002")


class SplitShortcut(nn.Module):
    """``p, q = x.chunk(2)``; a conv packs ``p`` (noted), and the block adds ``q``, the other output of the same
    autograd node, as its shortcut: the note on ``p`` must not stand for ``q``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(C)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Conv2d(C, C, 3, padding=1, bias=False)

    def forward(self, x):
        p, q = (x * 1).chunk(2, dim=1)
        y = self.bn(self.conv(p))
        y += q
        return self.head(self.relu(y))


def test_a_shortcut_is_told_from_its_siblings_by_output_number():
    ref, model = _twins(SplitShortcut, 8, {})
    x = torch.randn(4, 2 * C, H, H)
    with act_hf.track_saved(model) as saved:
        out = model(x.clone().requires_grad_())
    assert saved.by_slot.get("head:input", 0) > 0
    out.backward(torch.ones_like(out))
    ref(x.clone().requires_grad_()).backward(torch.ones_like(out))
    assert_grads_match(ref, model, name="split shortcut")


@pytest.mark.parametrize("add", ADDS)
def test_stochastic_depth_keeps_the_block_inputs_shared(add):
    """``y = drop_path(bn(.)); y += h``: the dropped or scaled BatchNorm output is still read from BatchNorm's
    packed input, times the per-sample scale, so the bytes are those of the stage without stochastic depth and
    the scales (one fp32 a sample and block, which autograd's multiply keeps anyway)."""
    _, plain = _stage(add=add)
    _, dropping = _stage(add=add, drop_path=0.5)
    x = _input()
    with act_hf.track_saved(plain) as p:
        plain(x.clone().requires_grad_())
    with act_hf.track_saved(dropping) as d:
        dropping(x.clone().requires_grad_())
    assert not set(READERS) & set(d.by_slot)
    assert d.bytes - p.bytes == 3 * 4 * 4


def test_stochastic_depth_draws_as_timm_does_and_gradients_match_at_8_bits():
    ref, model = _stage(bits=8, drop_path=0.5)
    assert all(isinstance(m, ActModule) for m in model.drop_paths)
    x = _input()
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(3)  # 3 blocks x 4 samples: some kept (scaled by 2), some dropped
    out = model(xm)
    after = torch.rand(1)
    torch.manual_seed(3)
    expected = ref(xr)
    assert torch.equal(out, expected) and torch.equal(torch.rand(1), after)  # the same draws, no more
    g = torch.randn_like(out)
    out.backward(g)
    expected.backward(g)
    assert_grads_match(ref, model, name="drop path")
    assert sqnr_db(xr.grad, xm.grad) > 30


class DroppedChain(Chain):
    """BatchNorm -> ReLU6 -> stochastic depth -> Conv: the conv reads ``s * h``, ``h`` clipped."""

    def __init__(self):
        from timm.layers import DropPath

        super().__init__(act="relu6")
        self.drop = DropPath(0.5)

    def forward(self, x):
        return self.conv(self.drop(self.relu(self.bn(x))))


def test_a_scaled_clipped_tensor_is_read_with_the_code_of_where_it_clipped():
    """Stochastic depth notes ``s * h`` with the 1-bit code of where ``h`` clipped at the top, packed from ``h``
    (``s * h`` cannot tell it: ``s`` may be 0), under its slot; the conv reads that."""
    ref, model = _twins(DroppedChain, 8, {})
    x = _input()
    torch.manual_seed(3)
    with act_hf.track_saved(model) as saved:
        model(x.clone().requires_grad_())
    assert saved.by_slot["drop:input"] == x.numel() // 8 and "conv:input" not in saved.by_slot
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(3)
    out = model(xm)
    torch.manual_seed(3)
    expected = ref(xr)
    assert torch.equal(out, expected)
    out.backward(torch.ones_like(out))
    expected.backward(torch.ones_like(out))
    assert_grads_match(ref, model, name="relu6-drop-path-conv")


def test_stochastic_depth_conv_weight_gradient_is_unbiased():
    _assert_unbiased(*_stage(bits=2, drop_path=0.5), "head", torch_seed=3)


@pytest.mark.parametrize("drop_path", [0.0, 0.5])
def test_squeeze_excite_keeps_the_block_inputs_shared(drop_path):
    """SE-ResNet: ``y = se(bn(.)) = g * bn(.)``, ``g`` one gate value per sample and channel; the SE module notes
    its output as BatchNorm's term times ``g`` (exact), so the block inputs after it are still read from the
    ops before them, and it reads its own input, for the gate's gradient, from BatchNorm's packed input."""
    assert all(isinstance(m, ActModule) for m in _stage(se=True)[1].ses)
    s, o = _shared_and_own(se=True, drop_path=drop_path)
    assert not {f"ses.{i}:input" for i in range(3)} & (set(s.by_slot) | set(o.by_slot))
    products = 3 * 4 * C * 4 if drop_path else 0  # the drop path's scale times the gate: fp32, a block each
    assert s.bytes == o.bytes - sum(o.by_slot[slot] for slot in READERS) + products


def test_squeeze_excite_packs_its_input_where_batchnorm_does_not_note_it():
    """``share_bn_relu=False``: BatchNorm notes nothing, so the SE module packs its input itself and notes its output
    from that copy; the block inputs are still shared."""
    _, model = _twins(Stage, 3, {"share_bn_relu": False}, se=True)
    with act_hf.track_saved(model) as saved:
        model(_input().requires_grad_())
    assert all(saved.by_slot[f"ses.{i}:input"] > 0 for i in range(3))
    assert not set(READERS) & set(saved.by_slot)


def test_squeeze_excite_forward_is_unchanged_and_gradients_match_at_8_bits():
    _assert_exact_at_8_bits(*_stage(bits=8, se=True), name="squeeze-excite")


def test_squeeze_excite_conv_weight_gradient_is_unbiased():
    _assert_unbiased(*_stage(bits=2, se=True), "head")


class GatedChain(nn.Module):
    """BatchNorm -> ``act`` -> squeeze-and-excitation (timm's ``SEModule``, ``g * h``) -> Conv: RegNetY's
    ``conv3(se(relu(bn2(.))))`` (``"relu"``; ``"relu6"`` clips), EfficientNet's ``conv_pwl(se(silu(bn(.))))``
    (``"silu"``), or none; without ``se``, BatchNorm -> ``act`` -> Conv."""

    def __init__(self, act: str = "relu", se: bool = True):
        super().__init__()
        from timm.layers import SEModule

        self.bn = nn.BatchNorm2d(C)
        self.act = {"relu": nn.ReLU(inplace=True), "relu6": nn.ReLU6(inplace=True), "silu": nn.SiLU(inplace=True),
                    "none": nn.Identity()}[act]
        self.se = SEModule(C, rd_ratio=0.25) if se else nn.Identity()
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=False)
        with torch.no_grad():
            self.bn.weight.uniform_(*RECTIFIERS["relu6"][1] if act == "relu6" else (0.5, 1.5))
            self.bn.bias.normal_(0, 0.5)

    def forward(self, x):
        return self.conv(self.se(self.act(self.bn(x))))


GATES = pytest.mark.parametrize("act", ["relu", "relu6", "silu", "none"])


@GATES
def test_conv_after_squeeze_excite_reads_its_input_from_the_ops_before_it(act):
    """The conv reads ``g * h`` as ``g`` (exact) times what the ops before it saved of ``h``: BatchNorm's packed
    input (and the ReLU's mask), or the SE's own packed copy of a SiLU's output; so does the SE, for its gate's
    gradient, where BatchNorm's input describes ``h``. Neither packs anything of its own then, but for a ReLU6's
    clipped output the SE's 1-bit code of where it clipped at the top (the conv reads it too)."""
    _, shared = _twins(GatedChain, 3, {}, act=act)
    _, own = _twins(GatedChain, 3, {"share_bn_relu": False, "share_residual": False}, act=act)
    x = _input()
    with act_hf.track_saved(shared) as s:
        shared(x.clone().requires_grad_())
    with act_hf.track_saved(own) as o:
        own(x.clone().requires_grad_())
    readers = ["conv:input"] + (["se:input"] if act != "silu" else [])
    upper = {"se:input": x.numel() // 8} if act == "relu6" else {}
    assert {slot: n for slot, n in s.by_slot.items() if slot in readers} == upper
    assert all(o.by_slot[slot] > 0 for slot in readers)
    assert s.bytes == o.bytes - sum(o.by_slot[slot] for slot in readers) + sum(upper.values())


@GATES
def test_squeeze_excite_chain_forward_is_unchanged_and_gradients_match_at_8_bits(act):
    _assert_exact_at_8_bits(*_twins(GatedChain, 8, {}, act=act), name=f"{act}-squeeze-excite-conv")


@GATES
def test_conv_after_squeeze_excite_weight_gradient_is_unbiased(act):
    _assert_unbiased(*_twins(GatedChain, 2, {}, act=act), "conv")


def test_squeeze_excite_gate_gradient_is_unbiased_when_read_from_batchnorm_and_relu():
    _assert_unbiased(*_twins(GatedChain, 2, {}, act="relu"), "se.fc2")


def test_conv_after_batchnorm_reads_its_packed_input():
    """BatchNorm -> Conv (a MobileNet block's output read by the next block's first conv): the conv reads
    ``weight * Q(x_norm) + bias``, exact at 8 bits, unbiased at 2."""
    _, shared = _twins(GatedChain, 3, {}, act="none", se=False)
    with act_hf.track_saved(shared) as s:
        shared(_input().requires_grad_())
    assert set(s.by_slot) == {"bn:input", "<uncompressed:torch.float32>"}  # and BatchNorm's statistics
    _assert_exact_at_8_bits(*_twins(GatedChain, 8, {}, act="none", se=False), name="bn-conv")
    _assert_unbiased(*_twins(GatedChain, 2, {}, act="none", se=False), "conv")


class LinearStage(nn.Module):
    """A linear-bottleneck stage (MobileNetV2's, EfficientNet's): ``x = bn(conv(x))``, then ``blocks`` residual
    blocks ``x = drop_path(bn(conv(x))) + x``, out of place and with no ReLU after the add (as timm's
    ``InvertedResidual``), then a head conv: every conv after the second reads a block output."""

    def __init__(self, blocks: int = 3, drop_path: float = 0.0):
        super().__init__()
        from timm.layers import DropPath

        self.convs = nn.ModuleList(nn.Conv2d(C, C, 3, padding=1, bias=False) for _ in range(blocks + 1))
        self.bns = nn.ModuleList(nn.BatchNorm2d(C) for _ in range(blocks + 1))
        self.drop_paths = nn.ModuleList(DropPath(drop_path) for _ in range(blocks))
        self.head = nn.Conv2d(C, C, 3, padding=1, bias=False)
        with torch.no_grad():
            for bn in self.bns:
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.normal_(0, 0.5)

    def forward(self, x):
        x = self.bns[0](self.convs[0](x))
        for conv, bn, drop_path in zip(self.convs[1:], self.bns[1:], self.drop_paths):
            shortcut = x
            x = drop_path(bn(conv(x))) + shortcut
        return self.head(x)


LINEAR_READERS = ["convs.2:input", "convs.3:input", "head:input"]  # each reads bn(.) + shortcut


@pytest.mark.parametrize("drop_path", [0.0, 0.5])
def test_convs_after_linear_bottlenecks_save_no_input_of_their_own(drop_path):
    """The sum is read from autograd's graph; each block output is noted as it, so the next add finds its
    shortcut; the stage's block inputs cost nothing of their own (``share_residual``)."""
    _, shared = _twins(LinearStage, 3, {}, drop_path=drop_path)
    _, own = _twins(LinearStage, 3, {"share_residual": False}, drop_path=drop_path)
    x = _input()
    torch.manual_seed(3)
    with act_hf.track_saved(shared) as s:
        shared(x.clone().requires_grad_())
    torch.manual_seed(3)
    with act_hf.track_saved(own) as o:
        own(x.clone().requires_grad_())
    assert "convs.1:input" not in s.by_slot and "convs.1:input" not in o.by_slot  # BatchNorm's output either way
    assert not set(LINEAR_READERS) & set(s.by_slot) and all(o.by_slot[slot] > 0 for slot in LINEAR_READERS)
    assert s.bytes == o.bytes - sum(o.by_slot[slot] for slot in LINEAR_READERS)


def test_linear_bottleneck_forward_is_unchanged_and_gradients_match_at_8_bits():
    _assert_exact_at_8_bits(*_twins(LinearStage, 8, {}), name="linear bottleneck")


def test_linear_bottleneck_conv_weight_gradient_is_unbiased():
    _assert_unbiased(*_twins(LinearStage, 2, {}), "head")


def test_drop_path_code_other_than_the_copied_one_is_left_as_it_is(monkeypatch):
    from act_hf.patches import timm_models

    monkeypatch.setattr(timm_models, "DROP_PATH_CODE", ("changed", "code"))
    _, model = _stage(drop_path=0.5)
    assert not any(isinstance(m, ActModule) for m in model.drop_paths)
    with act_hf.track_saved(model) as saved:
        model(_input().requires_grad_())
    assert all(saved.by_slot[slot] > 0 for slot in READERS)  # no note past the drop path: own copies


#: models whose convs read each kind of context: BatchNorm + each rectifier (a plain, a leaky and two clipping
#: ReLUs), residual blocks with squeeze-and-excitation and stochastic depth (scaled and nested terms), and linear
#: bottlenecks (BatchNorm's output, sums without a ReLU, and the stage input the first conv packs itself)
SLICED = {**{f"chain-{act}": (Chain, {"act": act}) for act in RECTIFIERS},
          "se-stage": (Stage, {"se": True, "drop_path": 0.5}), "linear-stage": (LinearStage, {"drop_path": 0.5})}


def _step(model, x, g):
    """Output, input gradient and parameter gradients of one seeded forward and backward."""
    act_hf.manual_seed(0)
    torch.manual_seed(1)  # stochastic depth's draws
    xm = x.clone().requires_grad_()
    out = model(xm)
    out.backward(g)
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad()
    return out, xm.grad, grads


@pytest.mark.parametrize("case", list(SLICED))
def test_a_large_batch_convolves_and_decodes_its_input_a_slice_at_a_time(monkeypatch, case):
    """Past ``CONV_CHUNK_ELEMENTS`` a conv's backward runs over slices of the batch, each slice's input decoded
    alone from every kind of context, bit for bit the whole decode's slice: the output (the CPU's forward runs
    whole) is unchanged, the gradients are up to the rounding of sums taken in another order."""
    from act_hf.ops import linear as linear_ops

    cls, kwargs = SLICED[case]
    model = _twins(cls, 3, {}, **kwargs)[1]
    x = torch.randn(8, C, H, H) * 2 + 0.3
    out = model(x.clone().requires_grad_())
    g = torch.randn_like(out)
    whole = _step(model, x, g)

    decoded = []
    real = linear_ops.input_values

    def checked(saved, dtype, items=None):
        values = real(saved, dtype, items)
        if items is not None:
            assert torch.equal(values, real(saved, dtype)[items[0]:items[1]])
            decoded.append(type(saved).__name__)
        return values

    monkeypatch.setattr(linear_ops, "input_values", checked)
    monkeypatch.setenv("ACT_HF_SLICING", "always")  # the slices, whatever room a GPU has
    monkeypatch.setattr(linear_ops, "CONV_CHUNK_ELEMENTS", 3 * C * H * H)  # slices of 3, 3 and 2 items
    sliced = _step(model, x, g)
    assert torch.equal(sliced[0], whole[0])
    torch.testing.assert_close(sliced[1], whole[1], rtol=1e-5, atol=1e-5 * whole[1].abs().max().item())
    for name, grad in whole[2].items():
        torch.testing.assert_close(sliced[2][name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)
    if case == "linear-stage":  # the first conv packs the input; the next reads BatchNorm's output, then sums
        assert set(decoded) == {"PackedTensor", "AffineTerm", "AffineSum"}
    else:
        assert set(decoded) == {"RectifiedAffine"}
    sliced_convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(decoded) == 3 * len(sliced_convs)  # squeeze-and-excitation's 1x1 convs on (8, C, 1, 1): one call
