"""``act_hf.report``: what was patched, and what a training step saved."""

from __future__ import annotations

from collections import Counter, defaultdict

from torch import nn

from .context import SavedTracker
from .nn._base import ActModule

__all__ = ["report"]


def report(model: nn.Module, saved: SavedTracker | None = None, *, top: int = 10, file=None) -> str:
    """Print and return a summary of ``model``'s act_hf patching.

    Args:
        model: a patched model.
        saved: the result of :func:`act_hf.track_saved` around one training forward, for the saved bytes per
            slot and the compression ratio.
        top: how many slots to list.
        file: where to print (default stdout); ``False`` to only return the text.

    Returns:
        The report text.
    """
    config = getattr(model, "act_hf_config", None)
    lines = []
    if config is None:
        lines.append(f"act_hf: {type(model).__name__} is not patched")
    else:
        lines.append(
            f"act_hf: {type(model).__name__} (family {getattr(model, 'act_hf_family', '?')}), bits={config.bits}, "
            f"group_size={config.group_size}{'' if config.scales_channels else ' (channels unscaled)'}, "
            f"kinds={','.join(config.kinds)}"
            + (f", inputs without history at {config.data_bits_floor} bits"
               if config.data_bits_floor > config.default_bits else "")
        )
        kinds: dict[str, Counter] = defaultdict(Counter)
        for path in getattr(model, "act_hf_patched_modules", []):
            module = model.get_submodule(path) if not path.startswith("<") else None
            kind = getattr(module, "act_kind", "attention" if module is not None else "hooks")
            kinds[kind][getattr(module, "act_bits", config.default_bits)] += 1
        lines.append(f"{'kind':<12}{'modules':>8}  bits")
        for kind in sorted(kinds):
            bits = ", ".join(f"{b}b x{n}" for b, n in sorted(kinds[kind].items()))
            lines.append(f"{kind:<12}{sum(kinds[kind].values()):>8}  {bits}")
        unpatched = sorted({type(m).__name__ for m in model.modules()
                            if not isinstance(m, ActModule) and not list(m.children())})
        lines.append(f"leaf module types not converted: {', '.join(unpatched) or 'none'}")
        allocator = getattr(model, "act_hf_allocator", None)
        if allocator is not None:
            lines.extend(_adaptive_lines(allocator, top))
    if saved is not None:
        lines.append(
            f"saved for backward: {saved.bytes / 2**20:.2f} MiB in {saved.num_tensors} tensors; uncompressed "
            f"equivalent {saved.uncompressed_bytes / 2**20:.2f} MiB; ratio {saved.ratio:.2f}x"
        )
        if saved.host_bytes:
            lines.append(f"swapped to pinned host memory (not in the above): {saved.host_bytes / 2**20:.2f} MiB")
        for slot, nbytes in sorted(saved.by_slot.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {nbytes / 2**20:9.3f} MiB  {slot}")
    text = "\n".join(lines)
    if file is not False:
        print(text, file=file)
    return text


def _adaptive_lines(allocator, top: int) -> list[str]:
    """The allocation, its cost and the variance alarm of an :class:`act_hf.adapt.BitAllocator`."""
    if not allocator.groups:
        return [(f"adaptive bits: budget {allocator.budget:g}, not allocated yet (every slot at "
                 f"{allocator.config.default_bits} bits until the first training step)")]
    histogram = Counter()
    for group in allocator.groups.values():
        histogram[group.bits] += group.numel
    total = sum(histogram.values())
    share = ", ".join(f"{b}b {100 * n / total:.0f}%" for b, n in sorted(histogram.items()))
    lines = [(
        f"adaptive bits: budget {allocator.budget:g}, allocated {allocator.average_bits():.3f} over "
        f"{len(allocator.groups)} slot groups ({share} of elements); {allocator.updates} update(s), probe time "
        f"{100 * allocator.overhead:.2f}% of training time"
    )]
    ratio = allocator.variance_ratio
    if ratio is not None:
        alarm = allocator.config.variance_alarm
        verdict = "ALARM: compression dominates, raise the budget" if alarm and ratio > alarm else "ok"
        lines.append(f"compression / minibatch gradient variance: {ratio:.3g} ({verdict}; alarm above {alarm:g})")
    lines.append("most sensitive groups (sensitivity c_l, bits):")
    ranked = sorted(allocator.groups.items(), key=lambda kv: (-kv[1].sensitivity, kv[0]))[:top]
    for name, group in ranked:
        lines.append(f"  {group.sensitivity:10.3e}  {group.bits}b  {name}")
    return lines
