"""ActCompressCallback inside a real transformers.Trainer: patches, logs, saves and restores its state."""

from __future__ import annotations

import json

import pytest
import torch

import act_hf
from act_hf.context import store
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


def test_resume_restores_the_allocation(tmp_path):
    store.bits.clear()
    callback = act_hf.ActCompressCallback(bits=3)
    trainer = _trainer(tmp_path, callback, max_steps=2, save_steps=2)
    store.bits["bert.encoder.layer.0.intermediate.dense:input"] = 5  # an allocation decided during training
    trainer.train()
    store.bits.clear()
    resumed = _trainer(tmp_path, act_hf.ActCompressCallback(bits=3), max_steps=3, save_steps=10)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert store.bits == {"bert.encoder.layer.0.intermediate.dense:input": 5}
    store.bits.clear()


def test_fractional_bits_are_refused_until_the_allocator_exists():
    with pytest.raises(ValueError, match="adaptive bit allocator"):
        act_hf.patch(bert()[0], bits=2.5)
