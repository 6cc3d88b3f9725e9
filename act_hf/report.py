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
            f"group_size={config.group_size}, kinds={','.join(config.kinds)}"
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
    if saved is not None:
        lines.append(
            f"saved for backward: {saved.bytes / 2**20:.2f} MiB in {saved.num_tensors} tensors; uncompressed "
            f"equivalent {saved.uncompressed_bytes / 2**20:.2f} MiB; ratio {saved.ratio:.2f}x"
        )
        for slot, nbytes in sorted(saved.by_slot.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {nbytes / 2**20:9.3f} MiB  {slot}")
    text = "\n".join(lines)
    if file is not False:
        print(text, file=file)
    return text
