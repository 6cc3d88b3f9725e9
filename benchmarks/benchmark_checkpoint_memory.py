"""Activation memory with gradient checkpointing, with and without act_hf (GACT's Table 7: AM1 and AM2).

For an HF model with HF gradient checkpointing, per sample:

- **AM1**, what a training forward leaves for backward: the saved tensors (:func:`act_hf.track_saved`). Both
  torch's non-reentrant checkpoint and act_hf's packed one (``checkpoint_bits``) keep the layer inputs through
  ``save_for_backward``, so the tracker counts them; what the checkpointed layers save inside is dropped.
- **AM2**, AM1 plus what re-forwarding one layer keeps while that layer's backward runs: the saved bytes of a
  training forward of the first checkpointed layer on the input it received (HF layers of one model are
  alike).

Settings: ``unpatched``, ``ckpt`` (checkpointing alone), ``bitsN`` (act_hf alone), ``ckpt+bitsN`` (act_hf,
exact layer inputs), ``ckptK+bitsN`` (layer inputs packed at K bits: ``ActConfig(checkpoint_bits=K)``, GACT's
CB1). Models come from ``benchmark_saved_memory.MODELS`` (random weights, attention-probability dropout off).
This measures bytes kept for backward, not the device peak (transient buffers come on top; the GPU benchmark
``benchmark_gpu_training.py --settings ckpt4+bits3`` measures the largest batch)::

    python benchmarks/benchmark_checkpoint_memory.py --models bert-large \\
        --settings unpatched ckpt bits3 ckpt+bits3 ckpt4+bits3 ckpt2+bits3 ckpt4+bits2

Writes ``checkpoint_memory.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path

import torch

import act_hf

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_saved_memory import MODELS, _meta, make_inputs, pyplot, save_log_plot

from act_hf.checkpoint import enable_hf_checkpointing
from act_hf.estimate import saved_with_checkpointing

DEFAULT_SETTINGS = ["unpatched", "ckpt", "bits3", "ckpt+bits3", "ckpt8+bits3", "ckpt4+bits3", "ckpt2+bits3",
                    "ckpt4+bits2"]


def parse_setting(name: str) -> tuple[bool, int | None, int | None]:
    """``(checkpointing, checkpoint_bits, bits)`` of a ``--settings`` word; unknown words exit naming the forms."""
    match = re.fullmatch(r"(?:(ckpt)([1-8])?\+)?bits([1-8])|(unpatched)|(ckpt)", name)
    if not match:
        raise SystemExit(f"--settings: unknown setting {name!r}; allowed: unpatched, ckpt, bitsN, ckpt+bitsN, "
                         "ckptK+bitsN (K, N in 1..8)")
    if match.group(4):
        return False, None, None
    if match.group(5):
        return True, None, None
    return bool(match.group(1)), int(match.group(2)) if match.group(2) else None, int(match.group(3))


def measure(model: torch.nn.Module, inputs: dict, setting: str, dtype: torch.dtype | None) -> dict:
    """AM1 and AM2 (bytes, whole batch) of ``model`` (unpatched, as built) under one setting."""
    checkpointing, checkpoint_bits, bits = parse_setting(setting)
    model = copy.deepcopy(model).train()
    if checkpointing:
        enable_hf_checkpointing(model)
    if bits is not None:
        act_hf.patch(model, bits=bits, checkpoint_bits=checkpoint_bits)
    device_type = inputs["input_ids"].device.type
    autocast = torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)
    am1, am2 = saved_with_checkpointing(model, lambda: model(**inputs).loss, autocast)
    return {"am1": am1, "am2": am2}


def measure_model(name: str, settings: list[str], batch: int, seq: int, device: torch.device,
                  dtype: torch.dtype | None) -> dict:
    """Per-sample AM1 / AM2 (MiB) of one model under each setting."""
    torch.manual_seed(0)
    base, kind = MODELS[name]()
    if kind != "text" or not getattr(base, "supports_gradient_checkpointing", False):
        raise SystemExit(f"--models: {name} has no HF gradient checkpointing; choose a Hugging Face text model")
    base.to(device)
    inputs = make_inputs(kind, base, batch, seq, device)
    row = {"model": name, "am1_mib": {}, "am2_mib": {}}
    for setting in settings:
        result = measure(base, inputs, setting, dtype)
        row["am1_mib"][setting] = result["am1"] / batch / 2**20
        row["am2_mib"][setting] = result["am2"] / batch / 2**20
        print(f"{name} {setting}: AM1 {row['am1_mib'][setting]:.3f} MiB/sample, AM2 {row['am2_mib'][setting]:.3f}",
              file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    text_models = [m for m in MODELS if m in ("bert-base", "bert-large", "roberta-base", "gpt2", "llama-style")]
    parser.add_argument("--models", nargs="+", default=["bert-large"], choices=text_models)
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS,
                        help=f"default: {' '.join(DEFAULT_SETTINGS)}")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="bf16: autocast, as in training (default); fp32: no autocast")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    for s in args.settings:
        parse_setting(s)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    meta = _meta(device) | {"batch": args.batch, "seq": args.seq, "dtype": args.dtype}
    rows = [measure_model(name, args.settings, args.batch, args.seq, device, dtype) for name in args.models]

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        (f"Activation memory per sample (MiB) with HF gradient checkpointing, {args.dtype}, seq {args.seq}, batch "
         f"{args.batch}. AM1: kept after forward; AM2: AM1 plus one re-forwarded layer's context (GACT's Table 7). "
         f"Ratios against unpatched without checkpointing. Bytes kept for backward, not device peaks. "
         f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, act_hf {meta['act_hf']} "
         f"@ {meta['commit']}."),
        "",
        "| model | setting | AM1 | AM2 | AM2 vs unpatched |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ref = r["am2_mib"].get("unpatched")
        for s in args.settings:
            ratio = f"{ref / r['am2_mib'][s]:.1f}x" if ref else "-"
            lines.append(f"| {r['model']} | {s} | {r['am1_mib'][s]:.2f} | {r['am2_mib'][s]:.2f} | {ratio} |")
    (args.out / "checkpoint_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            xs = [j + i * width for j in range(len(args.settings))]
            ax.bar(xs, [r["am2_mib"][s] for s in args.settings], width, label=f"{r['model']} AM2")
            ax.scatter(xs, [r["am1_mib"][s] for s in args.settings], color="black", s=12, zorder=3,
                       label="AM1" if i == 0 else None)
        ax.set_xticks(range(len(args.settings)), args.settings, rotation=30)
        save_log_plot(fig, ax, args.out / "checkpoint_memory.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
