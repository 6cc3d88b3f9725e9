"""``ActCompressCallback``: act_hf inside a ``transformers.Trainer``.

    trainer = Trainer(model, args, ..., callbacks=[act_hf.ActCompressCallback(bits=3)])

The callback patches the model at the start of training if it is not patched yet, measures the saved
activation memory of one training step every ``log_interval`` logging events (a forward pre-hook on the
model opens :func:`act_hf.track_saved` for that step), and adds ``act_hf/avg_bits``, ``act_hf/saved_mb`` and
``act_hf/ratio`` to the Trainer's logs. With a fractional ``bits`` budget (adaptive bits, see
:mod:`act_hf.adapt`) it also schedules the re-allocations: before the first step and every
``config.adapt_interval`` optimizer steps, the model's :class:`~act_hf.adapt.BitAllocator` probes the next
training batch (captured by its forward pre-hook) and re-distributes the budget; ``act_hf/variance_ratio``
(compression / minibatch gradient variance) and ``act_hf/adapt_overhead`` (probe time / training time) join
the logs. Its state (the per-slot bits and the allocator's groups) is saved into each Trainer checkpoint
(``act_hf_state.json``) and restored on resume, so a resumed run continues with the same allocation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import nn
from transformers import TrainerCallback

from .config import ActConfig
from .context import SavedTracker, track_saved

__all__ = ["ActCompressCallback"]

logger = logging.getLogger(__name__)

STATE_NAME = "act_hf_state.json"


class ActCompressCallback(TrainerCallback):
    """Patch, measure and log act_hf compression inside ``transformers.Trainer``.

    Args:
        bits: bits for :func:`act_hf.patch` when the model is not patched yet (ignored if ``config`` is given).
        config: a full :class:`act_hf.ActConfig`.
        measure_every: measure saved activations on one training step every this many optimizer steps
            (the first step is always measured); 0 turns measuring off.
    """

    def __init__(self, bits: float = 3, config: ActConfig | None = None, *, measure_every: int = 50) -> None:
        self.config = config if config is not None else ActConfig(bits=bits)
        self.measure_every = measure_every
        self._model: nn.Module | None = None
        self._hook = self._post = None
        self._tracker_cm = None
        self._last: SavedTracker | None = None
        self._measure_next = True

    # -- patching ------------------------------------------------------------------------------------------
    def _ensure_patched(self, model: nn.Module) -> None:
        from .patcher import patch

        if getattr(model, "act_hf_config", None) is None:
            patch(model, config=self.config)
        self.config = model.act_hf_config
        self._model = model
        if self.allocator is not None:
            self.allocator.automatic = False  # scheduled by optimizer steps in on_step_begin

    @property
    def allocator(self):
        """The model's :class:`act_hf.adapt.BitAllocator` (adaptive bits), else ``None``."""
        return getattr(self._model, "act_hf_allocator", None)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self._ensure_patched(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self._ensure_patched(model)
            if self._hook is None:
                self._hook = model.register_forward_pre_hook(self._maybe_start_tracking)
                self._post = model.register_forward_hook(self._stop_tracking, always_call=True)
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, str) and resume:
            self.load_state(resume)
        elif state.global_step > 0:  # Trainer restored its state from output_dir/checkpoint-<step>
            self.load_state(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        for handle in (self._hook, self._post):
            if handle is not None:
                handle.remove()
        self._hook = self._post = None

    # -- measuring -----------------------------------------------------------------------------------------
    def _maybe_start_tracking(self, module, args):
        allocator = self.allocator
        if allocator is not None and allocator.probing:
            return
        if self._measure_next and module.training and self._tracker_cm is None:
            self._tracker_cm = track_saved(module)
            self._last = self._tracker_cm.__enter__()

    def _stop_tracking(self, module, args, output):
        allocator = self.allocator
        if allocator is not None and allocator.probing:
            return
        if self._tracker_cm is not None:
            self._tracker_cm.__exit__(None, None, None)
            self._tracker_cm = None
            self._measure_next = False

    def on_step_begin(self, args, state, control, **kwargs):
        # a fresh allocator (or one restored without groups) is already due before its first training forward
        allocator = self.allocator
        if allocator is not None and state.global_step % self.config.adapt_interval == 0:
            allocator.request_update()

    def on_step_end(self, args, state, control, **kwargs):
        if self.measure_every and state.global_step % self.measure_every == 0:
            self._measure_next = True

    def average_bits(self) -> float:
        """With adaptive bits, the allocated bits averaged over stored elements; otherwise the mean bits of the
        patched modules."""
        if self._model is None:
            return float("nan")
        if self.allocator is not None:
            return self.allocator.average_bits()
        bits = [m.act_bits for m in self._model.modules() if hasattr(m, "act_bits")]
        return sum(bits) / len(bits) if bits else float("nan")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self._model is None:
            return
        ours = {"act_hf/avg_bits": round(self.average_bits(), 3)}
        if self._last is not None and self._last.bytes:
            ours["act_hf/saved_mb"] = round(self._last.bytes / 2**20, 3)
            ours["act_hf/ratio"] = round(self._last.ratio, 3)
        allocator = self.allocator
        if allocator is not None:
            ours["act_hf/adapt_updates"] = allocator.updates
            ours["act_hf/adapt_overhead"] = round(allocator.overhead, 5)
            if allocator.variance_ratio is not None:
                ours["act_hf/variance_ratio"] = float(f"{allocator.variance_ratio:.4g}")
        logs.update(ours)  # seen by the reporting callbacks that run after this one
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(ours)  # Trainer appended its copy before calling the callbacks

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The allocation state saved into checkpoints."""
        state = {"config": self.config.to_dict(),  # fixed bits: no slot of its own
                 "slot_bits": dict(self.allocator.slot_bits) if self.allocator is not None else {}}
        if self.allocator is not None:
            state["allocator"] = self.allocator.state_dict()
        return state

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STATE_NAME).write_text(json.dumps(self.state_dict(), sort_keys=True, indent=2))

    def load_state(self, checkpoint: str | Path) -> bool:
        """Restore the per-slot bits (and the allocator's state) saved in ``checkpoint``; returns whether a state
        was found."""
        path = Path(checkpoint) / STATE_NAME
        if not path.exists():
            logger.warning("no %s in %s: act_hf keeps its current allocation", STATE_NAME, checkpoint)
            return False
        data = json.loads(path.read_text())
        if self.allocator is not None:  # fixed bits read no per-slot table
            self.allocator.slot_bits.clear()
            self.allocator.slot_bits.update({k: int(v) for k, v in data.get("slot_bits", {}).items()})
            if "allocator" in data:
                self.allocator.load_state_dict(data["allocator"])
        return True
