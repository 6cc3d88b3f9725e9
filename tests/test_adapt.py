"""Adaptive bits: the greedy allocation, the sensitivity estimate against brute force, the alarm, isolation."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import act_hf
from act_hf.adapt import allocate_bits, variance_factor
from tests.patches.models import bert

# ------------------------------------------------------------------------------------------------ allocation


def test_allocation_meets_the_budget_from_below_and_is_deterministic():
    sens = {"a": 5.0, "b": 1.0, "c": 0.01, "d": 0.0}
    numel = {"a": 100, "b": 300, "c": 50, "d": 10}
    for budget in (1.0, 1.5, 2.0, 2.5, 3.7, 8.0):
        bits = allocate_bits(sens, numel, budget)
        used = sum(bits[n] * numel[n] for n in numel)
        assert used <= budget * sum(numel.values()) + 1e-9
        assert all(1 <= b <= 8 for b in bits.values())
        # nothing more fits: every group that is not at 8 bits would overshoot with one more bit
        assert all(bits[n] == 8 or used + numel[n] > budget * sum(numel.values()) for n in numel)
        assert allocate_bits(dict(reversed(sens.items())), dict(reversed(numel.items())), budget) == bits
    bits = allocate_bits(sens, numel, 3.0)
    assert bits["a"] >= bits["b"] >= bits["c"]


def test_allocation_is_optimal_for_equal_sizes():
    """With equal sizes the objective is separable and convex in the bits: greedy equals exhaustive search."""
    torch.manual_seed(0)
    for _ in range(5):
        sens = {f"g{i}": float(torch.rand(()).item() * 10 ** torch.randint(-3, 3, ()).item()) for i in range(4)}
        numel = dict.fromkeys(sens, 1)
        for budget in (2.0, 2.5, 3.25):
            bits = allocate_bits(sens, numel, budget)
            best = min(
                (sum(sens[n] * variance_factor(b) for n, b in zip(sens, combo)), combo)
                for combo in itertools.product(range(1, 9), repeat=4) if sum(combo) <= budget * 4
            )
            got = sum(sens[n] * variance_factor(bits[n]) for n in sens)
            assert got == pytest.approx(best[0], rel=1e-12)


def test_allocation_rejects_bad_input():
    with pytest.raises(ValueError, match="budget"):
        allocate_bits({"a": 1.0}, {"a": 1}, 9.0)
    with pytest.raises(ValueError, match="same groups"):
        allocate_bits({"a": 1.0}, {"b": 1}, 2.0)
    with pytest.raises(ValueError, match="variance_alarm"):
        act_hf.ActConfig(bits=2.5, variance_alarm=-1)
    with pytest.raises(ValueError, match="adapt_samples"):
        act_hf.ActConfig(bits=2.5, adapt_samples=0)


# ------------------------------------------------------------------------------------------------ sensitivity


class _Mlp(nn.Module):
    """Two Linears; the first one's input has a 100x larger range than the second one's."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.second = nn.Linear(64, 8)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _mlp_batch(n=16):
    torch.manual_seed(1)
    x = torch.randn(n, 32, dtype=torch.float64) * 100
    target = torch.randn(n, 8, dtype=torch.float64)
    return x, target


def _mse(model, batch):
    x, target = batch
    return (model(x) - target).pow(2).mean()


def test_sensitivity_is_the_variance_of_the_gradient():
    """c_l * S(b) is an unbiased estimate of the gradient variance that quantizing slot l adds: compared with the
    empirical variance of the weight gradient over many independent quantizations of the same input."""
    model = _Mlp().double()
    act_hf.patch(model, bits=2.0, kinds=("linear",), adapt_samples=16, variance_alarm=0)
    allocator = model.act_hf_allocator
    x, target = _mlp_batch()
    estimates = []
    for _ in range(40):
        allocator.update_batch((x, target), lambda b: _mse(model, b))
        group = allocator.groups["first:input"]
        estimates.append(group.sensitivity * variance_factor(2))  # measured at 2 bits before the first allocation
        model.act_hf_slot_bits.clear()  # measure at 2 bits every time
    with torch.no_grad():
        hidden_out = model.first(x).requires_grad_()
    out = model.second(torch.tanh(hidden_out))
    grad_pre = torch.autograd.grad((out - target).pow(2).mean(), hidden_out)[0]  # dL/d(first's output)
    grads = []
    for seed in range(400):
        x_hat = act_hf.dequantize(act_hf.quantize(x, 2, 256, seed=seed))
        grads.append(grad_pre.t() @ x_hat)  # the first layer's weight gradient with a quantized input
    grads = torch.stack(grads)
    empirical = grads.var(dim=0, unbiased=True).sum().item()
    mean_estimate = sum(estimates) / len(estimates)
    assert mean_estimate == pytest.approx(empirical, rel=0.1)  # measured: within 1%
    act_hf.unpatch(model)


def _sensitivities(model, inputs: dict, *, whole: bool) -> dict[str, float]:
    """Every group's sensitivity from one probe of ``model`` (patched with an adaptive budget) on ``inputs``, at
    fixed seeds, by whole backwards or by local differences."""
    allocator = model.act_hf_allocator
    allocator.whole_backward = whole
    act_hf.manual_seed(7)
    torch.manual_seed(7)
    model.act_hf_slot_bits.clear()
    allocator.update_batch(inputs, lambda b: model(**b).loss)
    return {n: g.sensitivity for n, g in allocator.groups.items()}


def test_local_difference_matches_a_whole_backward():
    """The per-group local difference (one op re-run + a backward from it) equals GACT's whole backward with the
    group's draws changed, on the same forward and draws, for every kind of slot of a BERT layer."""
    torch.manual_seed(0)
    model, inputs = bert()
    model = model.double()
    act_hf.patch(model, bits=2.5, adapt_samples=2, variance_alarm=0)
    local, whole = _sensitivities(model, inputs, whole=False), _sensitivities(model, inputs, whole=True)
    assert local.keys() == whole.keys() and len(local) > 8
    assert any(":q" in n for n in local) and any("LayerNorm:output" in n for n in local)
    scale = max(whole.values())
    for name in local:  # first order vs exact: equal up to second-order terms
        assert local[name] == pytest.approx(whole[name], rel=0.02, abs=1e-6 * scale), name
    act_hf.unpatch(model)


def test_a_slot_whose_compression_hurts_gets_more_bits():
    """Quantizing the first Linear's input (100x range) demonstrably hurts the gradient more than the second's;
    the allocator measures that and gives it more bits."""
    x, target = _mlp_batch()
    reference = _Mlp().double()
    exact = torch.autograd.grad(_mse(reference, (x, target)), list(reference.parameters()))

    def harm(slot_bits):
        model = copy.deepcopy(reference)
        act_hf.patch(model, bits=8.0, kinds=("linear",))  # adaptive: its slots read the allocation table
        model.act_hf_allocator.remove()  # no probe: the test writes the slots' bits itself
        model.act_hf_slot_bits.update(slot_bits)
        errors = []
        for seed in range(20):
            act_hf.manual_seed(seed)
            grads = torch.autograd.grad(_mse(model, (x, target)), list(model.parameters()))
            errors.append(sum((g - e).pow(2).sum() for g, e in zip(grads, exact)).item())
        act_hf.unpatch(model)
        return sum(errors) / len(errors)

    harm_first, harm_second = harm({"first:input": 2}), harm({"second:input": 2})
    assert harm_first > 10 * harm_second  # demonstrably: the first slot's 2-bit compression hurts far more

    model = copy.deepcopy(reference)
    act_hf.patch(model, bits=2.5, kinds=("linear",), variance_alarm=0)
    model.act_hf_allocator.update_batch((x, target), lambda b: _mse(model, b))
    groups = model.act_hf_allocator.groups
    assert groups["first:input"].bits > groups["second:input"].bits
    assert groups["first:input"].sensitivity > groups["second:input"].sensitivity
    act_hf.unpatch(model)


# ------------------------------------------------------------------------------------------------ alarm, report


def test_variance_alarm_warns_and_reports():
    torch.manual_seed(0)
    model, inputs = bert()
    act_hf.patch(model, bits=1.5, adapt_samples=2, variance_alarm=1e-12)
    model.train()
    with pytest.warns(act_hf.ActHFWarning, match="minibatch gradient variance"):
        model(**inputs).loss.backward()  # the first training forward probes first
    allocator = model.act_hf_allocator
    assert allocator.updates == 1 and allocator.variance_ratio > 0
    text = act_hf.report(model, file=False)
    assert "adaptive bits: budget 1.5" in text and "ALARM" in text and "most sensitive groups" in text
    low = allocator.variance_ratio
    act_hf.unpatch(model)

    model, inputs = bert()
    act_hf.patch(model, bits=6.0, adapt_samples=2, variance_alarm=1e-12)
    model.train()
    with pytest.warns(act_hf.ActHFWarning):
        model(**inputs)
    assert model.act_hf_allocator.variance_ratio < low / 100  # more bits, far less compression variance
    act_hf.unpatch(model)


def test_probe_leaves_training_untouched():
    """The probe restores the RNG streams and buffers (BatchNorm statistics) and makes no .grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    act_hf.patch(model, bits=2.5, variance_alarm=0)
    allocator = model.act_hf_allocator
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    bn = model[1]
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        allocator.update_batch((x, y), lambda b: nn.functional.cross_entropy(model(b[0]), b[1]))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(stats, (bn.running_mean, bn.running_var, bn.num_batches_tracked)))
    assert all(p.grad is None for p in model.parameters())
    assert allocator.groups and 2.0 < allocator.average_bits() <= 2.5
    act_hf.unpatch(model)


def test_automatic_updates_without_trainer():
    """Patched with a float budget, the model re-allocates by itself every adapt_interval training forwards."""
    torch.manual_seed(0)
    model, inputs = bert()
    act_hf.patch(model, bits=2.0, adapt_interval=2, adapt_samples=2, variance_alarm=0)
    model.train()
    for _ in range(3):
        model(**inputs).loss.backward()
    with torch.no_grad():
        model(**inputs)  # no probe without grad
    model.eval()
    model(**inputs)  # nor in eval mode
    assert model.act_hf_allocator.updates == 2  # forwards 0 and 2
    state = model.act_hf_allocator.state_dict()
    act_hf.unpatch(model)
    fresh, _ = bert()
    act_hf.patch(fresh, bits=2.0)
    fresh.act_hf_allocator.load_state_dict(state)
    assert {n: g.bits for n, g in fresh.act_hf_allocator.groups.items()} == \
        {n: g["bits"] for n, g in state["groups"].items()}
    assert fresh.act_hf_allocator.average_bits() <= 2.0
    act_hf.unpatch(fresh)


def test_probing_forward_keeps_the_training_output():
    """The first training forward probes before it runs; its output (dropout included) is the unpatched one."""
    torch.manual_seed(0)
    model, inputs = bert(dropout=0.1)
    model.train()
    reference = copy.deepcopy(model)
    act_hf.patch(model, bits=2.5, adapt_samples=2, variance_alarm=0)
    torch.manual_seed(123)
    expected = reference(**inputs).logits
    torch.manual_seed(123)
    got = model(**inputs).logits
    assert model.act_hf_allocator.updates == 1
    assert torch.equal(got, expected)
    act_hf.unpatch(model)


def test_an_explicit_update_satisfies_the_first_forwards_request():
    """A loop that calls update_batch itself (train_timm, a custom loss) is not probed again by the next forward."""
    torch.manual_seed(0)
    model, inputs = bert()
    act_hf.patch(model, bits=2.5, adapt_samples=2, variance_alarm=0)
    allocator = model.act_hf_allocator
    allocator.automatic = False
    model.train()
    allocator.update_batch(inputs, lambda b: model(**b).loss)
    bits = {n: g.bits for n, g in allocator.groups.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second probe here would also warn that the output has no loss
        model(**{k: v for k, v in inputs.items() if k != "labels"})
    assert allocator.updates == 1
    assert {n: g.bits for n, g in allocator.groups.items()} == bits
    act_hf.unpatch(model)


def test_the_interval_counts_from_an_explicit_update():
    """With automatic updates on, an explicit update_batch before the first forward is not followed by a probe
    at that forward; the next one comes adapt_interval training forwards later."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.warns(act_hf.ActHFWarning, match="no family"):
        act_hf.patch(model, bits=2.5, adapt_interval=3, variance_alarm=0)
    allocator = model.act_hf_allocator
    allocator.loss_fn = lambda out: out.pow(2).mean()
    x = torch.randn(8, 16)
    allocator.update_batch(x, lambda b: model(b).pow(2).mean())
    updates = []
    for _ in range(7):
        model(x)
        updates.append(allocator.updates)
    assert updates == [1, 1, 1, 2, 2, 2, 3]
    act_hf.unpatch(model)


def test_a_model_reads_only_its_own_allocation():
    """Two models with the same module paths in one process (co-training, a sweep in a notebook): a fixed-bits
    model beside an adaptive one keeps its bits, and a second adaptive model's allocation leaves the first's."""
    fixed, inputs = bert()
    act_hf.patch(fixed, bits=3)
    fixed.train()

    def saved_bytes(model):
        with act_hf.track_saved(model) as saved:
            model(**inputs)
        return saved.bytes

    alone = saved_bytes(fixed)
    first, _ = bert()
    act_hf.patch(first, bits=1.5, adapt_samples=2, variance_alarm=0)
    first.train()
    first(**inputs).loss.backward()  # the first training forward allocates
    allocation = dict(first.act_hf_slot_bits)
    assert allocation and set(allocation) <= {s for g in first.act_hf_allocator.groups.values() for s in g.slots}
    assert saved_bytes(fixed) == alone
    second, _ = bert()
    act_hf.patch(second, bits=4.5, adapt_samples=2, variance_alarm=0)
    second.train()
    second(**inputs).loss.backward()
    assert second.act_hf_slot_bits and second.act_hf_slot_bits is not first.act_hf_slot_bits
    assert first.act_hf_slot_bits == allocation
    assert saved_bytes(fixed) == alone
    for model in (first, second):
        table = model.act_hf_slot_bits
        act_hf.unpatch(model)
        assert not table


def test_a_deep_copy_allocates_for_itself():
    """``copy.deepcopy`` of an adaptive model (an EMA or reference copy, a sweep from one base): the copy starts
    from the original's allocation and its probes change only its own; the original's next probe leaves the
    copy's."""
    model, inputs = bert()
    act_hf.patch(model, bits=2.5, adapt_samples=2, variance_alarm=0)
    model.train()
    model(**inputs).loss.backward()
    allocation = dict(model.act_hf_slot_bits)
    assert allocation
    twin = copy.deepcopy(model)
    assert twin.act_hf_slot_bits == allocation and twin.act_hf_slot_bits is not model.act_hf_slot_bits
    converted = [m for m in twin.modules() if hasattr(m, "act_slot_bits")]
    assert converted and all(m.act_slot_bits is twin.act_hf_slot_bits for m in converted)
    assert twin.act_hf_allocator.slot_bits is twin.act_hf_slot_bits and twin.act_hf_allocator.model is twin

    def saved_bytes(m):
        with act_hf.track_saved(m) as saved:
            m(**inputs)
        return saved.bytes

    before = saved_bytes(model)
    twin.act_hf_slot_bits.clear()  # the twin alone goes back to its starting width
    assert model.act_hf_slot_bits == allocation and saved_bytes(model) == before
    assert saved_bytes(twin) != before
    twin.act_hf_allocator.request_update()
    twin(**inputs).loss.backward()  # the twin's probe fills the twin's table
    assert twin.act_hf_slot_bits and model.act_hf_slot_bits == allocation
    twins = dict(twin.act_hf_slot_bits)
    model.act_hf_allocator.budget = 4.5
    model.act_hf_allocator.request_update()
    model(**inputs).loss.backward()  # and the original's probe, at a new budget, leaves it
    assert model.act_hf_slot_bits != allocation and twin.act_hf_slot_bits == twins
    act_hf.unpatch(twin)
    assert model.act_hf_slot_bits
    act_hf.unpatch(model)


def test_pickling_keeps_the_allocation(tmp_path):
    """``torch.save(model)`` / ``torch.load``: the loaded model reads the allocation it was saved with, in a table
    of its own."""
    model, inputs = bert()
    act_hf.patch(model, bits=2.5, adapt_samples=2, variance_alarm=0)
    model.train()
    model(**inputs).loss.backward()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded.act_hf_slot_bits == model.act_hf_slot_bits and loaded.act_hf_slot_bits is not model.act_hf_slot_bits
    loaded.act_hf_allocator.automatic = model.act_hf_allocator.automatic = False

    def saved_bytes(m):
        with act_hf.track_saved(m) as saved:
            m(**inputs)
        return saved.bytes

    assert saved_bytes(loaded) == saved_bytes(model)
    act_hf.unpatch(loaded)
    assert model.act_hf_slot_bits
    act_hf.unpatch(model)


def test_a_consumer_that_takes_no_hook_is_measured_by_a_whole_backward(monkeypatch):
    """A consumer node whose register_hook raises (torch's error for an autograd.Function instance that is not a
    graph node) does not stop the probe: the groups it consumes are measured by the whole backward, as
    whole_backward=True measures every group."""
    from act_hf.context import Probe

    torch.manual_seed(0)
    model, inputs = bert()
    model = model.double()
    act_hf.patch(model, bits=2.5, adapt_samples=2, variance_alarm=0)
    whole = _sensitivities(model, inputs, whole=True)

    class NoHooks:
        def __init__(self, node):
            self.node = node

        def register_hook(self, hook):
            raise RuntimeError("Attribute 'register_hook' is invalid for this instance of _C._FunctionBase")

    groups = Probe.groups
    refused = []

    def with_a_refusing_node(self):
        found = groups(self)
        name = next(n for n in sorted(found) if ":q" in n)
        found[name]["consumers"] = [NoHooks(n) for n in found[name]["consumers"]]
        refused.append(name)
        return found

    monkeypatch.setattr(Probe, "groups", with_a_refusing_node)
    mixed = _sensitivities(model, inputs, whole=False)
    assert mixed[refused[0]] == pytest.approx(whole[refused[0]], rel=1e-9)  # the same whole backward
    assert mixed.keys() == whole.keys()
