"""ActCompressCallback inside a real transformers.Trainer: patches, logs, saves and restores its state."""

from __future__ import annotations

import json

import torch

import act_hf
from tests.patches.models import bert


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, inputs, n=16):
        self.items = [{k: v[i % 2] for k, v in inputs.items()} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(tmp_path, callback, max_steps=4, save_steps=2):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model, inputs = bert()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2,
                             logging_steps=1, save_steps=save_steps, report_to=[], use_cpu=True,
                             learning_rate=1e-3, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=_Pairs(inputs), callbacks=[callback])


def test_callback_patches_and_logs(tmp_path):
    callback = act_hf.ActCompressCallback(bits=3, measure_every=2)
    trainer = _trainer(tmp_path, callback)
    assert trainer.model.act_hf_config.bits == 3  # patched at Trainer init
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs and all("act_hf/avg_bits" in e for e in logs)
    assert any(e.get("act_hf/saved_mb", 0) > 0 and e.get("act_hf/ratio", 0) > 1 for e in logs)
    state = json.loads((tmp_path / "checkpoint-2" / "act_hf_state.json").read_text())
    assert state["config"]["bits"] == 3


def test_fixed_bits_neither_read_nor_save_another_models_allocation(tmp_path):
    """An adaptive model alive beside this one, with the same module paths, has its own allocation: the fixed
    3-bit run does not read it, save it into its checkpoints, or clear it on resume."""
    other = act_hf.patch(bert()[0], bits=2.5)
    other.act_hf_allocator.remove()  # no probe: the test writes the allocation itself
    other.act_hf_slot_bits["bert.encoder.layer.0.intermediate.dense:input"] = 5
    allocation = dict(other.act_hf_slot_bits)
    callback = act_hf.ActCompressCallback(bits=3)
    trainer = _trainer(tmp_path, callback, max_steps=2, save_steps=2)
    trainer.train()
    assert callback.average_bits() == 3
    state = json.loads((tmp_path / "checkpoint-2" / "act_hf_state.json").read_text())
    assert state["slot_bits"] == {}
    resumed = _trainer(tmp_path, act_hf.ActCompressCallback(bits=3), max_steps=3, save_steps=10)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert other.act_hf_slot_bits == allocation


def _adaptive_trainer(tmp_path, max_steps, interval=2, save_steps=2):
    config = act_hf.ActConfig(bits=2.5, adapt_interval=interval, adapt_samples=2)
    return _trainer(tmp_path, act_hf.ActCompressCallback(config=config), max_steps=max_steps, save_steps=save_steps)


def test_callback_adapts_bits_under_the_budget(tmp_path):
    trainer = _adaptive_trainer(tmp_path, max_steps=4)
    allocator = trainer.model.act_hf_allocator
    assert allocator.automatic is False and not allocator.groups  # the callback schedules the updates
    seen = []
    original = allocator.update

    def spy(closure):
        groups = original(closure)
        seen.append({n: g.bits for n, g in groups.items()})
        return groups

    allocator.update = spy
    trainer.train()
    assert len(seen) == 2  # before steps 0 and 2 (adapt_interval=2)
    assert len(set(seen[0].values())) > 1  # not uniform: the budget is distributed by sensitivity
    assert allocator.average_bits() <= 2.5 and allocator.average_bits() > 2.0
    for group in allocator.groups.values():
        assert all(trainer.model.act_hf_slot_bits[slot] == group.bits for slot in group.slots)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(e["act_hf/avg_bits"] <= 2.5 and e["act_hf/adapt_updates"] >= 1 for e in logs)
    assert all("act_hf/variance_ratio" in e and e["act_hf/adapt_overhead"] > 0 for e in logs)
    state = json.loads((tmp_path / "checkpoint-2" / "act_hf_state.json").read_text())
    assert state["allocator"]["groups"] and state["allocator"]["budget"] == 2.5
    table = trainer.model.act_hf_slot_bits
    act_hf.unpatch(trainer.model)
    assert not table and not hasattr(trainer.model, "act_hf_slot_bits")


def test_resume_keeps_the_adaptive_allocation(tmp_path):
    trainer = _adaptive_trainer(tmp_path, max_steps=3, interval=100, save_steps=3)
    trainer.train()
    saved = {n: (g.bits, g.sensitivity) for n, g in trainer.model.act_hf_allocator.groups.items()}
    act_hf.unpatch(trainer.model)
    resumed = _adaptive_trainer(tmp_path, max_steps=5, interval=100, save_steps=10)
    allocator = resumed.model.act_hf_allocator
    calls = []
    allocator.update = lambda closure: calls.append(closure)  # no probe may run: step 3 is not an interval step
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert not calls
    assert {n: (g.bits, g.sensitivity) for n, g in allocator.groups.items()} == saved
    for group in allocator.groups.values():
        assert all(allocator.slot_bits[slot] == group.bits for slot in group.slots)
    act_hf.unpatch(resumed.model)


def test_fractional_bits_patch_an_allocator():
    model = act_hf.patch(bert()[0], bits=2.5)
    assert model.act_hf_config.adaptive and model.act_hf_allocator.budget == 2.5
    act_hf.unpatch(model)
    assert not hasattr(model, "act_hf_allocator") and not model._forward_pre_hooks
