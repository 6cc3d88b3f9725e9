"""Where a training step spends its time: torch.profiler tables of one model under each setting.

The issue's rule for a missed speed target: profile, then fix the hot spots. For each ``--settings`` word (the
forms of benchmark_gpu_training.py) this builds the same trial as the speed benchmark, runs ``--warmup`` steps,
profiles ``--steps`` more, and writes the ops and kernels sorted by their own device time (by CPU time on a CPU),
plus the step time, to ``profile_<model>.md`` and ``profile_<model>.json`` under ``--out``.

    python benchmarks/profile_step.py --model bert-large --settings unpatched bits3 --batch 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_gpu_training import MODELS, Trial, parse_setting, prepare_step
from benchmark_saved_memory import _meta


def profile_setting(trial: Trial, rows: int) -> dict:
    """Step time of ``trial.steps`` profiled steps and the ``rows`` ops with the most own time."""
    cuda = trial.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step, _ = prepare_step(trial)
    for _ in range(trial.warmup):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(trial.steps):
            step()
        sync()
    elapsed = time.perf_counter() - start
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    top = [{"name": e.key, "calls": e.count, "self_us_per_step": getattr(e, key) / trial.steps,
            "share": getattr(e, key) / total, "cpu_us_per_step": e.self_cpu_time_total / trial.steps}
           for e in events[:rows]]
    return {"setting": trial.setting, "step_ms_profiled": 1000 * elapsed / trial.steps,
            "self_total_ms_per_step": total / 1000 / trial.steps, "top": top}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-large", choices=list(MODELS))
    parser.add_argument("--settings", nargs="+", default=["unpatched", "bits3"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--rows", type=int, default=30, help="ops listed per setting (default 30)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    for name in args.settings:
        parse_setting(name)
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.rows < 1:
        parser.error("--batch, --steps and --rows must be >= 1, --warmup >= 0")
    results = []
    for name in args.settings:
        trial = Trial(args.model, name, args.batch, steps=args.steps, warmup=args.warmup, seq=args.seq,
                      image_size=args.image_size, dtype=args.dtype, device=args.device)
        results.append(profile_setting(trial, args.rows))
        print(f"{args.model} {name}: {results[-1]['step_ms_profiled']:.1f} ms/step profiled", flush=True)
    meta = _meta(torch.device(args.device)) | {k: getattr(args, k) for k in ("model", "batch", "seq", "dtype")}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"profile_{args.model}"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    what = "device" if args.device.startswith("cuda") else "CPU"
    lines = [(f"{args.model}, batch {args.batch}, {args.dtype} autocast, {args.steps} profiled steps; "
              f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, act_hf @ {meta['commit']}."), ""]
    for r in results:
        lines += [(f"## {r['setting']}: {r['step_ms_profiled']:.1f} ms/step under the profiler, "
                  f"{r['self_total_ms_per_step']:.1f} ms own {what} time"), "",
                  f"| op or kernel | calls | own {what} us/step | share | own CPU us/step |", "|---|---|---|---|---|"]
        lines += [f"| {t['name'][:90].replace('|', '/')} | {t['calls']} | {t['self_us_per_step']:.0f} | "
                  f"{t['share']:.1%} | {t['cpu_us_per_step']:.0f} |" for t in r["top"]]
        lines.append("")
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
