"""Measured peak memory of a training step on the CPU, per sample: unpatched against act_hf, with and without
gradient checkpointing.

Without a GPU, ``torch.cuda.max_memory_allocated`` is not there to read; this reads the process's peak resident
memory instead (``ru_maxrss``). Each (model, setting, batch) runs in its own subprocess with glibc told to serve
every allocation above 128 KiB by ``mmap`` and to give it back on free (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), so resident memory follows live tensors instead of the heap's high-water mark. The
subprocess builds the model, applies the setting, runs one batch-1 step (so parameter gradients exist), then
one training step at the batch; the step's peak is ``ru_maxrss`` after it minus the resident memory before it.
The slope between two batch sizes is the per-sample peak: saved activations *and* transient buffers, which
the saved-bytes benchmarks leave out. The word embeddings are frozen: their gradient is a dense buffer of the
vocabulary's size made at the end of backward, the same at every batch, which at small batches would set the
peak instead of the activations. The same step's saved bytes (:func:`act_hf.track_saved`) are recorded
beside it.

CPU kernels are not GPU kernels (their workspaces differ), so this is evidence about act_hf's transients, not
the H100 figure the issue asks for. bf16 autocast backward is very slow on a CPU (minutes per bert-large step),
hence ``--dtype fp32`` by default::

    python benchmarks/benchmark_cpu_peak.py --models bert-large \\
        --settings unpatched bits3 bits2 ckpt ckpt+bits3 ckpt4+bits3

Settings as in ``benchmark_checkpoint_memory.py`` (vision models: no checkpointing); ``--act-config`` passes more
:class:`act_hf.ActConfig` fields as JSON. Vision models (timm, 224 x 224, cross-entropy on fixed labels)::

    python benchmarks/benchmark_cpu_peak.py --models resnet50 --settings unpatched bits3 bits2 \\
        --out benchmarks/results/cpu_peak_resnet50

Writes ``cpu_peak.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

import act_hf
from act_hf.checkpoint import enable_hf_checkpointing

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_checkpoint_memory import parse_setting
from benchmark_saved_memory import MODELS, _meta, make_inputs, pyplot, save_log_plot

TEXT_MODELS = ["bert-base", "bert-large", "roberta-base", "gpt2", "llama-style"]
VISION_MODELS = ["vit-base", "swin-tiny", "convnext-tiny", "resnet50"]
DEFAULT_SETTINGS = ["unpatched", "bits3", "bits2", "ckpt", "ckpt+bits3", "ckpt4+bits3"]
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_step(model_name: str, setting: str, batch: int, seq: int, dtype: str, act_config: dict) -> dict:
    """In this process: the resident-memory peak of one training step at ``batch`` over the memory before it,
    and the bytes its forward saved (both in bytes)."""
    checkpointing, checkpoint_bits, bits = parse_setting(setting)
    torch.manual_seed(0)
    model, kind = MODELS[model_name]()
    model.train()
    if checkpointing:
        enable_hf_checkpointing(model)
    if kind != "image":
        # The word-embedding gradient is a dense vocab x hidden buffer made at the end of backward (90-120 MiB
        # for BERT), the same at every batch: at small batches it, not the activations, would set the peak.
        model.get_input_embeddings().weight.requires_grad_(False)
    if bits is not None:
        act_hf.patch(model, bits=bits, checkpoint_bits=checkpoint_bits, **act_config)
    inputs = make_inputs(kind, model, batch, seq, torch.device("cpu"))
    if kind == "image":
        inputs["labels"] = torch.zeros(batch, dtype=torch.long)

    def forward_loss(part: dict) -> torch.Tensor:
        if kind == "image":
            return torch.nn.functional.cross_entropy(model(part["x"]).float(), part["labels"])
        return model(**part).loss

    def step(part: dict) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"), act_hf.track_saved(model) as saved:
            loss = forward_loss(part)
        loss.backward()
        return saved.bytes

    step({k: v[:1] for k, v in inputs.items()})
    gc.collect()
    before = _rss()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    saved = step(inputs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_peak": peak - before, "saved": saved, "peak_rose": peak > peak_before}


def run(model_name: str, setting: str, batch: int, seq: int, dtype: str, act_config: dict) -> dict:
    """:func:`measure_step` in a fresh subprocess with the glibc settings above."""
    cmd = [sys.executable, __file__, "--one", model_name, setting, str(batch), "--seq", str(seq), "--dtype", dtype,
           "--act-config", json.dumps(act_config)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | _MALLOC, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{model_name} {setting} batch {batch}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert-large"], choices=TEXT_MODELS + VISION_MODELS)
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, help=f"default: {' '.join(DEFAULT_SETTINGS)}")
    parser.add_argument("--batches", type=int, nargs=2, default=[4, 8], metavar=("B1", "B2"),
                        help="the two batch sizes the per-sample slope is taken between (default 4 8)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--act-config", type=json.loads, default={}, metavar="JSON",
                        help='more ActConfig fields for the patched settings, e.g. \'{"share_residual": false}\'')
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # internal: MODEL SETTING BATCH
    args = parser.parse_args(argv)
    if args.one:
        name, setting, batch = args.one
        print(json.dumps(measure_step(name, setting, int(batch), args.seq, args.dtype, args.act_config)))
        return 0
    if not isinstance(args.act_config, dict):
        parser.error("--act-config: a JSON object of ActConfig fields")
    try:
        act_hf.ActConfig(**args.act_config)  # a bad field or value, before any subprocess runs
    except (TypeError, ValueError) as exc:
        parser.error(f"--act-config: {exc}")
    for s in args.settings:
        if parse_setting(s)[0] and set(args.models) & set(VISION_MODELS):
            parser.error(f"--settings {s}: HF gradient checkpointing does not apply to the vision models")
    b1, b2 = sorted(args.batches)
    if b1 < 2 or b1 == b2:
        parser.error("--batches: two different sizes, both at least 2 (the warm-up step runs at batch 1)")
    meta = _meta(torch.device("cpu")) | {"batches": [b1, b2], "seq": args.seq, "dtype": args.dtype,
                                         "malloc": _MALLOC, "act_config": args.act_config}
    rows = []
    for name in args.models:
        for setting in args.settings:
            low = run(name, setting, b1, args.seq, args.dtype, args.act_config)
            high = run(name, setting, b2, args.seq, args.dtype, args.act_config)
            row = {"model": name, "setting": setting, "measured": {str(b1): low, str(b2): high},
                   "peak_mib_per_sample": (high["step_peak"] - low["step_peak"]) / (b2 - b1) / 2**20,
                   "saved_mib_per_sample": (high["saved"] - low["saved"]) / (b2 - b1) / 2**20,
                   "peak_rose": low["peak_rose"] and high["peak_rose"]}
            rows.append(row)
            print(f"{name} {setting}: peak {row['peak_mib_per_sample']:.2f} MiB/sample, saved "
                  f"{row['saved_mib_per_sample']:.2f}", file=sys.stderr, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_peak.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        (f"Measured peak of one training step per sample (MiB; slope between batch {b1} and {b2}; process peak RSS "
         f"with glibc mmap for allocations above 128 KiB), {args.dtype}, seq {args.seq} (images 224 x 224), AdamW not "
         f"stepped{'' if not args.act_config else ', act_hf with ' + json.dumps(args.act_config)}. "
         f"'saved' is what the forward kept for backward (track_saved, AM1). CPU kernels: not the GPU figure. "
         f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, act_hf {meta['act_hf']} "
         f"@ {meta['commit']}."),
        "",
        "| model | setting | peak / sample | saved / sample | peak vs unpatched |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ref = next((q["peak_mib_per_sample"] for q in rows if q["model"] == r["model"] and q["setting"] == "unpatched"),
                   None)
        ratio = f"{ref / r['peak_mib_per_sample']:.1f}x" if ref else "-"
        flag = "" if r["peak_rose"] else " (peak did not rise over the warm-up: not measured)"
        lines.append(f"| {r['model']} | {r['setting']} | {r['peak_mib_per_sample']:.2f}{flag} | "
                     f"{r['saved_mib_per_sample']:.2f} | {ratio} |")
    (args.out / "cpu_peak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['model']}\n{r['setting']}" for r in rows]
        ax.bar(range(len(rows)), [r["peak_mib_per_sample"] for r in rows], label="step peak")
        ax.bar(range(len(rows)), [r["saved_mib_per_sample"] for r in rows], width=0.4, label="saved for backward")
        ax.set_xticks(range(len(rows)), labels, rotation=30, fontsize=7)
        save_log_plot(fig, ax, args.out / "cpu_peak.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
