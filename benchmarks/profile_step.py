"""Where a training step spends its time: torch.profiler tables of one model under each setting.

The issue's rule for a missed speed target: profile, then fix the hot spots. For each ``--settings`` word (the
forms of benchmark_gpu_training.py) this builds the same trial as the speed benchmark, runs ``--warmup`` steps,
profiles ``--steps`` more, and writes the ops and kernels sorted by their own device time (by CPU time on a CPU),
plus the step time, to ``profile_<model>.md`` and ``profile_<model>.json`` under ``--out``. Every kernel (every op
on a CPU) is also summed by family (:func:`kernel_family`: act_hf's kernels each, matmuls, attention, casts and
copies, each elementwise functor, ...), and each setting after the first gets the families' differences from the
first: where its extra device time goes, the rows past the top ones included. With ``--stacks`` the profiler
records Python calls, and each setting also gets its ops' own time by the function of act_hf (else of
transformers or timm) that called them: which act_hf code an elementwise kernel of the families' table comes from.

    python benchmarks/profile_step.py --model bert-large --settings unpatched bits3 --batch 32
    python benchmarks/profile_step.py --model resnet50 --settings unpatched bits3 --batch 128 --stacks
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_gpu_training import MODELS, Trial, parse_setting, prepare_step
from benchmark_saved_memory import _meta, pyplot

_WRAPPERS = frozenset({"vectorized_elementwise_kernel", "unrolled_elementwise_kernel", "elementwise_kernel",
                       "reduce_kernel", "gpu_kernel_impl_nocast", "gpu_kernel_impl", "ReduceOp", "func_wrapper_t",
                       "memory", "detail", "TensorIteratorBase", "index_elementwise_kernel", "BinaryFunctor",
                       "AUnaryFunctor", "BUnaryFunctor"})
_FAMILIES = (("attention", ("sdpa", "flash", "fmha", "attention")),
             ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "sm80_", "cublas")),
             ("optimizer (foreach)", ("multi_tensor_apply",)),
             ("layer norm", ("layer_norm", "LayerNorm", "GammaBeta")))


def kernel_family(name: str) -> str:
    """A short family for a kernel's name (an op's on a CPU, which stays as it is), so that settings compare:
    each act_hf kernel with its template arguments, ``matmul``, ``attention``, ``optimizer (foreach)``, ``layer
    norm``, ``elementwise <functor>`` and ``reduce <functor>`` for ATen's TensorIterator kernels, else the name's
    first 60 characters."""
    own = re.search(r"act_hf::(?:\(anonymous namespace\)::)?(\w+(?:<[^>]*>)?)", name)
    if own:
        return "act_hf " + own.group(1)
    for family, marks in _FAMILIES:
        if any(mark in name for mark in marks):
            return family
    for kind in ("elementwise", "reduce"):
        if f"{kind}_kernel" in name:
            found = re.findall(r"at::native::(?:\(anonymous namespace\)::)?((?:\w+::)*\w+)", name)
            functors = [f.split("::")[-1] for f in found if f.split("::")[-1] not in _WRAPPERS]
            return f"{kind} {functors[0] if functors else '?'}"
    return name[:60]


def by_family(events, key: str, steps: int) -> dict[str, dict]:
    """``{family: {"calls", "us_per_step"}}`` of the kernel events (all events on a CPU) by own ``key`` time."""
    families: dict[str, dict] = collections.defaultdict(lambda: {"calls": 0, "us_per_step": 0.0})
    for e in events:
        time_us = getattr(e, key)
        if time_us > 0:
            row = families[kernel_family(e.key)]
            row["calls"] += e.count / steps
            row["us_per_step"] += time_us / steps
    return dict(families)


def family_differences(base: dict[str, dict], other: dict[str, dict]) -> list[dict]:
    """The families of two settings side by side, ``[{"family", "base_us", "us", "delta_us", "calls_base",
    "calls"}]``, the largest growth first."""
    rows = [{"family": f, "base_us": base.get(f, {}).get("us_per_step", 0.0),
             "us": other.get(f, {}).get("us_per_step", 0.0), "calls_base": base.get(f, {}).get("calls", 0.0),
             "calls": other.get(f, {}).get("calls", 0.0)} for f in set(base) | set(other)]
    for r in rows:
        r["delta_us"] = r["us"] - r["base_us"]
    return sorted(rows, key=lambda r: -r["delta_us"])


def calling_function(frames: list[str]) -> str:
    """The innermost function of act_hf's among a profiled op's Python frames, innermost first, as the profiler
    names it (``act_hf/ops/norm.py(298): backward``: the line its definition starts at), else of the model's
    library (transformers, timm), else ``(outside act_hf and the model)``: autograd's own nodes, an unpatched
    model's backward, the optimizer."""
    for marks in (("act_hf/",), ("transformers/", "timm/")):
        for frame in frames:
            for mark in marks:
                if mark in frame:
                    return frame[frame.index(mark):]
    return "(outside act_hf and the model)"


def python_frames(event) -> list[str]:
    """An op's Python frames, innermost first: its recorded stack, or (torch >= 2.x records Python calls as events
    of their own) the names of its enclosing events."""
    if event.stack:
        return list(event.stack)
    frames, parent = [], event.cpu_parent
    while parent is not None:
        frames.append(parent.name)
        parent = parent.cpu_parent
    return frames


def by_function(events, key: str, steps: int) -> list[dict]:
    """``[{"op", "function", "calls", "us_per_step"}]``: the own ``key`` time of the ops (CPU events: on a GPU,
    the kernels each launched itself) by op and :func:`calling_function`, the largest first."""
    rows: dict[tuple[str, str], dict] = {}
    for e in events:
        time_us = getattr(e, key)
        if e.device_type == DeviceType.CUDA or time_us <= 0 or ".py(" in e.name:
            continue  # kernels (their ops carry them) and Python calls
        function = calling_function(python_frames(e))
        row = rows.setdefault((e.name, function), {"op": e.name, "function": function, "calls": 0.0,
                                                   "us_per_step": 0.0})
        row["calls"] += 1 / steps
        row["us_per_step"] += time_us / steps
    return sorted(rows.values(), key=lambda r: -r["us_per_step"])


def profile_setting(trial: Trial, rows: int, stacks: bool = False) -> dict:
    """Step time of ``trial.steps`` profiled steps and the ``rows`` ops with the most own time; with ``stacks``,
    the ``rows`` largest of :func:`by_function` too."""
    cuda = trial.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step, _, _ = prepare_step(trial)
    for _ in range(trial.warmup):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities, with_stack=stacks) as prof:
        for _ in range(trial.steps):
            step()
        sync()
    elapsed = time.perf_counter() - start
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    # on a GPU an op's own device time is that of the kernels it launched itself: summing ops and kernels counts
    # each kernel twice (the tables before 2026-11-27 did), so the device's busy time sums the kernels alone
    kernels = [e for e in events if e.device_type == DeviceType.CUDA] if cuda else events
    total = sum(getattr(e, key) for e in kernels) or 1.0
    top = [{"name": e.key, "calls": e.count, "self_us_per_step": getattr(e, key) / trial.steps,
            "share": getattr(e, key) / total, "cpu_us_per_step": e.self_cpu_time_total / trial.steps}
           for e in events[:rows]]
    result = {"setting": trial.setting, "step_ms_profiled": 1000 * elapsed / trial.steps,
              "self_total_ms_per_step": total / 1000 / trial.steps, "top": top,
              "families": by_family(kernels, key, trial.steps)}
    if stacks:
        result["functions"] = by_function(prof.events(), key, trial.steps)[:rows]
    return result


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
    parser.add_argument("--stacks", action="store_true",
                        help="record Python calls and table the ops' own time by the act_hf function that called "
                             "them")
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
        results.append(profile_setting(trial, args.rows, args.stacks))
        print(f"{args.model} {name}: {results[-1]['step_ms_profiled']:.1f} ms/step profiled", flush=True)
    meta = _meta(torch.device(args.device)) | {k: getattr(args, k) for k in ("model", "batch", "seq", "dtype")}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"profile_{args.model}"
    what = "device" if args.device.startswith("cuda") else "CPU"
    lines = [(f"{args.model}, batch {args.batch}, {args.dtype} autocast, {args.steps} profiled steps; "
              f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, act_hf @ {meta['commit']}."), ""]
    for r in results:
        busy = "device busy time (its kernels)" if what == "device" else "own CPU time"
        lines += [(f"## {r['setting']}: {r['step_ms_profiled']:.1f} ms/step under the profiler, "
                  f"{r['self_total_ms_per_step']:.1f} ms {busy}; shares of it below"), "",
                  f"| op or kernel | calls | own {what} us/step | share | own CPU us/step |", "|---|---|---|---|---|"]
        lines += [f"| {t['name'][:90].replace('|', '/')} | {t['calls']} | {t['self_us_per_step']:.0f} | "
                  f"{t['share']:.1%} | {t['cpu_us_per_step']:.0f} |" for t in r["top"]]
        lines.append("")
        if "functions" in r:
            lines += [f"### {r['setting']}: own {what} time by op and the function that called it", "",
                      f"| op | called in | calls a step | own {what} us a step |", "|---|---|---|---|"]
            lines += [f"| {t['op'][:60]} | {t['function'][:100].replace('|', '/')} | {t['calls']:g} | "
                      f"{t['us_per_step']:.0f} |" for t in r["functions"]]
            lines.append("")
    base = results[0]
    for r in results[1:]:
        diff = family_differences(base["families"], r["families"])
        r["family_differences"] = diff
        what_by = "kernel" if args.device.startswith("cuda") else "op"
        lines += [(f"## {r['setting']} against {base['setting']}, by {what_by} family (own {what} us a step; the "
                   f"{args.rows} largest changes either way)"), "",
                  (f"| family | {base['setting']} | {r['setting']} | change | calls {base['setting']} | "
                   f"calls {r['setting']} |"), "|---|---|---|---|---|---|"]
        shown = sorted(diff, key=lambda d: -abs(d["delta_us"]))[:args.rows]
        lines += [f"| {d['family'][:90].replace('|', '/')} | {d['base_us']:.0f} | {d['us']:.0f} | "
                  f"{d['delta_us']:+.0f} | {d['calls_base']:g} | {d['calls']:g} |"
                  for d in sorted(shown, key=lambda d: -d["delta_us"])]
        lines += [(f"| all | {sum(d['base_us'] for d in diff):.0f} | {sum(d['us'] for d in diff):.0f} | "
                   f"{sum(d['delta_us'] for d in diff):+.0f} | | |"), ""]
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    plot(results, args.rows, "device" if args.device.startswith("cuda") else "CPU", args.out / f"{stem}.png")
    return 0


def plot(results: list[dict], rows: int, what: str, path: Path) -> None:
    """Each setting's busy time, and the largest changes by family of each setting against the first."""
    plt = pyplot()
    if plt is None:
        return
    others = results[1:]
    fig, axes = plt.subplots(1, 1 + len(others), figsize=(5 + 6 * len(others), 4.5), squeeze=False)
    axes[0][0].bar([r["setting"] for r in results], [r["self_total_ms_per_step"] for r in results])
    axes[0][0].set_ylabel(f"ms a step of {what} time")
    for ax, r in zip(axes[0][1:], others):
        diff = sorted(r["family_differences"], key=lambda d: -abs(d["delta_us"]))[:rows][::-1]
        ax.barh([d["family"][:50] for d in diff], [d["delta_us"] / 1000 for d in diff],
                color=["tab:red" if d["delta_us"] > 0 else "tab:green" for d in diff])
        ax.set_xlabel(f"change against {results[0]['setting']}, ms a step ({r['setting']})")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
