"""What is alive at the memory peak of a training step, and who allocated it: per sample, by code site.

The per-sample peak of a patched step is its saved context *plus* the transient working set of the moment the
peak falls in (the first GPU run: swin-tiny at 3 bits peaked at 19.9 MiB a sample above resident memory against
9.1 MiB of saved context). This names the rest. One forward and backward runs under ``torch.profiler`` with
``profile_memory`` and Python stacks; every allocation and free of the model's device is replayed in order, the
highest point of the running total in forward and in backward is found, and the blocks alive at that moment are
summed by **site**: the innermost frame in act_hf, timm or transformers (or, for a C++ autograd node, the node)
together with the aten op that allocated the block. Run at two batch sizes, a phase's highest point at the larger
minus that at the smaller, over the difference of batches, is its per-sample growth, and the phase of the larger
batch's peak is broken down by site the same way, at the same moment of both runs; what does not grow with the
batch (autocast's cached bf16 weights, parameter gradients) drops out. (The H100 run of swin-tiny peaked in
backward at batch 16 and in forward at 32, and comparing the two peaks mixed two moments of the step.) Growth
between small batches overstates what is done in chunks of a fixed size once the batch is large (attention's
recomputation in backward).

Each phase's highest point is also placed in the model: every submodule's forward runs inside a profiler range
named after its path, and the innermost module open at that moment is reported, with the highest point reached
inside each module (forward), so that a peak is named as "``layer1.2.conv3``'s moment" and not only by the blocks
alive then.

The same code reads CPU allocations (here) and CUDA ones (on a GPU the caching allocator reports each block it
hands out and takes back; its reserved-but-free memory, fragmentation, is not counted)::

    python benchmarks/memory_at_peak.py --model swin-tiny --setting bits3 --batches 2 4
    python benchmarks/memory_at_peak.py --model resnet50 --setting bits3 --device cuda --batches 16 32
    python benchmarks/memory_at_peak.py --model resnet50 --setting bits2 --channels-last --batches 8 16

Each (batch) runs in its own subprocess. Writes ``memory_at_peak_<model>_<setting>.json``, ``.md`` and ``.png``
under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

import act_hf
from act_hf._chunks import SLICING_MODES

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_checkpoint_memory import parse_setting
from benchmark_gpu_training import enable_checkpointing
from benchmark_saved_memory import MODELS, _meta, make_inputs, pyplot

_OURS = re.compile(r"(^|/)(act_hf|timm|transformers)/")  # a frame's file, absolute or relative to the cwd


def _site(stack: tuple[str, ...]) -> str:
    """A block's site: the innermost act_hf/timm/transformers frame (else the autograd node or outermost op) and
    the aten op that allocated it."""
    ops = [s for s in stack if s.startswith("op:")]
    frames = [s for s in stack if not s.startswith("op:") and _OURS.search(s)]
    nodes = [s for s in ops if "evaluate_function" in s]
    where = frames[-1].split("/")[-1] if frames else (nodes[-1][3:] if nodes else (ops[0][3:] if ops else "-"))
    return f"{where} | {ops[-1][3:] if ops else '-'}"


def _allocations(prof, device: torch.device) -> tuple[list[tuple], int]:
    """``(time ns, order, bytes (negative: a free), ptr, stack)`` of every allocation event on ``device``, in
    the order they happened (``stack``: the Python frames and ``op:NAME`` ops above the event), and the start
    of the ``act_hf_backward`` range."""
    from torch._C._profiler import _EventType

    events = []
    backward = [0]

    def walk(node, stack):
        if node.name == "act_hf_backward":
            backward[0] = node.start_time_ns
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == device.type:
                events.append((node.start_time_ns, len(events), f.alloc_size, f.ptr, stack))
            return
        if node.tag == _EventType.PyCall:
            stack = stack + (node.name,)
        elif node.tag == _EventType.TorchOp:
            stack = stack + ("op:" + node.name,)
        for child in node.children:
            walk(child, stack)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, ())
    return sorted(events, key=lambda e: (e[0], e[1])), backward[0]


def _module_ranges(prof) -> list[tuple[int, int, str]]:
    """``(start ns, end ns, module path)`` of the ``module:<path>`` ranges :func:`label_modules` opened."""
    ranges = []

    def walk(node):
        if node.name.startswith("module:"):
            ranges.append((node.start_time_ns, node.end_time_ns, node.name[len("module:"):]))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return ranges


def _innermost(times: list[int], ranges: list[tuple[int, int, str]]) -> list[str | None]:
    """For each of the ascending ``times``, the path of the innermost range open then (ranges nest or are
    disjoint, as a module's calls do), or ``None``: one sweep over both."""
    ranges = sorted(ranges)
    out, stack, j = [], [], 0
    for t in times:
        while True:
            while stack and stack[-1][1] < t:
                stack.pop()
            if j < len(ranges) and ranges[j][0] <= t:
                stack.append(ranges[j])
                j += 1
            else:
                break
        out.append(stack[-1][2] if stack else None)
    return out


def peak_sites(events, backward_from_ns: int, ranges: list[tuple[int, int, str]] = ()) -> dict:
    """The running total's peak over ``events`` (bytes above the first event), the phase it fell in, and the
    bytes alive then by :func:`_site`; under ``phases``, the same for the highest point of each phase
    (``forward``: before ``backward_from_ns``), so that two runs can be compared at the same moment of the
    step even when their overall peaks fall in different phases. With the modules' ``ranges``
    (:func:`_module_ranges`), each phase also names the innermost ``module`` open at its highest point, and
    ``module_highs`` holds the highest total reached inside each module (as the innermost one)."""
    total = 0
    best = {"forward": (0, -1), "backward": (0, -1)}  # phase -> (peak, index of the event that reached it)
    modules = _innermost([e[0] for e in events], list(ranges)) if ranges else [None] * len(events)
    highs: dict[str, int] = {}
    for i, (time_ns, _, size, _, _) in enumerate(events):
        total += size
        phase = "backward" if time_ns >= backward_from_ns else "forward"
        if total > best[phase][0]:
            best[phase] = (total, i)
        if modules[i] is not None and total > highs.get(modules[i], -1):
            highs[modules[i]] = total
    phases = {phase: {"peak": peak, "sites": _alive_at(events, at)} for phase, (peak, at) in best.items()}
    if ranges:
        for phase, (_, at) in best.items():
            phases[phase]["module"] = modules[at] if at >= 0 else None
    phase = max(phases, key=lambda p: (phases[p]["peak"], p == "forward"))
    out = {"peak": phases[phase]["peak"], "phase": phase, "sites": phases[phase]["sites"], "phases": phases}
    if ranges:
        out["module_highs"] = highs
    return out


def _alive_at(events, at: int) -> dict[str, int]:
    """Bytes by :func:`_site` of the blocks alive just after ``events[at]`` (none for ``at`` -1)."""
    live: dict[int, tuple[int, tuple]] = {}
    for _, _, size, ptr, stack in events[: at + 1]:
        if size > 0:
            live[ptr] = (size, stack)
        else:
            live.pop(ptr, None)
    sites: dict[str, int] = defaultdict(int)
    for size, stack in live.values():
        sites[_site(stack)] += size
    return dict(sites)


def label_modules(model: torch.nn.Module) -> Callable[[], None]:
    """Run each submodule's ``forward`` inside a profiler range ``module:<path>`` (an instance attribute wrapping
    the bound method, its signature kept); returns the function that takes the wrappers off again."""
    from torch.profiler import record_function

    wrapped = []
    for path, module in model.named_modules():
        if not path:
            continue
        inner = module.forward

        def forward(*args, _inner=inner, _name="module:" + path, **kwargs):
            with record_function(_name):
                return _inner(*args, **kwargs)

        wrapped.append((module, module.__dict__.get("forward")))
        module.forward = functools.update_wrapper(forward, inner)

    def undo() -> None:
        for module, own in wrapped:
            if own is None:
                del module.forward
            else:
                module.forward = own

    return undo


def profile_peak(forward_loss: Callable[[], torch.Tensor], device: torch.device,
                 model: torch.nn.Module | None = None) -> dict:
    """:func:`peak_sites` of one ``forward_loss().backward()``, profiled (allocations on ``device`` only); with
    ``model``, its modules labelled (:func:`label_modules`) to name where each phase's highest point falls."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    undo = label_modules(model) if model is not None else None
    try:
        with profile(activities=activities, profile_memory=True, with_stack=True) as prof:
            loss = forward_loss()
            with record_function("act_hf_backward"):
                loss.backward()
            del loss
    finally:
        if undo is not None:
            undo()
    return peak_sites(*_allocations(prof, device), _module_ranges(prof) if model is not None else ())


def measure(model_name: str, setting: str, batch: int, device: torch.device, dtype: str, seq: int,
            channels_last: bool = False) -> dict:
    """In this process: :func:`profile_peak` of one training step of ``model_name`` at ``batch``, after a batch-1
    step (so parameter gradients exist); an image model and its images channels last with ``channels_last``."""
    checkpointing, checkpoint_bits, bits = parse_setting(setting)
    torch.manual_seed(0)
    model, kind = MODELS[model_name]()
    model.to(device).train()
    if kind != "image":  # its dense vocabulary-sized gradient would set the peak at small batches
        model.get_input_embeddings().weight.requires_grad_(False)
    if checkpointing:
        enable_checkpointing(model)
    if bits is not None:
        act_hf.patch(model, bits=bits, checkpoint_bits=checkpoint_bits)
    inputs = make_inputs(kind, model, batch, seq, device)
    if channels_last:
        if kind != "image":
            raise SystemExit(f"--channels-last: an image model, got {model_name} ({kind})")
        model.to(memory_format=torch.channels_last)
        inputs["x"] = inputs["x"].contiguous(memory_format=torch.channels_last)
    labels = torch.zeros(batch, dtype=torch.long, device=device)

    def forward_loss(n: int) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            if kind == "image":
                return torch.nn.functional.cross_entropy(model(inputs["x"][:n]).float(), labels[:n])
            return model(**{k: v[:n] for k, v in inputs.items()}).loss

    forward_loss(1).backward()
    return {"batch": batch} | profile_peak(lambda: forward_loss(batch), device, model)


def _site_rows(runs: list[dict], phase: str, mib: float) -> list[dict]:
    """Per-site growth at ``phase``'s highest point between the two runs (MiB a sample, ``mib`` being a MiB times
    the difference of batches), largest first, with the bytes at each batch."""
    small, large = (run["phases"][phase]["sites"] for run in runs)
    return sorted(({"site": s, "mib_per_sample": (large.get(s, 0) - small.get(s, 0)) / mib,
                    "bytes": [small.get(s, 0), large.get(s, 0)]} for s in set(small) | set(large)),
                  key=lambda r: -abs(r["mib_per_sample"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="swin-tiny", choices=list(MODELS))
    parser.add_argument("--setting", default="bits3",
                        help="unpatched, bitsN, ckpt (gradient checkpointing), ckpt+bitsN or ckptK+bitsN (the "
                             "checkpointed layer inputs packed at K bits); N, K in 1..8")
    parser.add_argument("--batches", type=int, nargs=2, default=[2, 4], metavar=("B1", "B2"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="bf16: autocast (default)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=25, help="sites in the table")
    parser.add_argument("--slice-elements", type=int, metavar="N",
                        help="act_hf's CONV_CHUNK_ELEMENTS and BATCH_NORM_CHUNK_ELEMENTS for this run (a convolution "
                             "or a BatchNorm backward past it works on slices of the batch): to see at small batches "
                             "what a large batch gets")
    parser.add_argument("--slicing", choices=SLICING_MODES, default="always",
                        help="ACT_HF_SLICING for the run (default always: ops past their thresholds work on slices "
                             "of the batch however much room the device has, as they do near a memory cap; auto, "
                             "act_hf's default, runs them whole where a GPU has room for it)")
    parser.add_argument("--channels-last", action="store_true",
                        help="an image model and its images in channels-last memory format (timm's --channels-last)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure this batch, print JSON
    args = parser.parse_args(argv)
    parse_setting(args.setting)
    b1, b2 = args.batches
    if not 1 <= b1 < b2:
        parser.error(f"--batches: two sizes with 1 <= B1 < B2, got {b1} {b2}")
    device = torch.device(args.device)
    os.environ["ACT_HF_SLICING"] = args.slicing  # read by act_hf at each op; the batches' subprocesses inherit it
    if args.slice_elements is not None:
        from act_hf.ops import linear as linear_ops
        from act_hf.ops import norm as norm_ops

        linear_ops.CONV_CHUNK_ELEMENTS = norm_ops.BATCH_NORM_CHUNK_ELEMENTS = args.slice_elements
    if args.one is not None:
        print(json.dumps(measure(args.model, args.setting, args.one, device, args.dtype, args.seq,
                                 args.channels_last)))
        return 0
    runs = []
    for batch in (b1, b2):
        cmd = [sys.executable, __file__, "--one", str(batch), "--model", args.model, "--setting", args.setting,
               "--device", args.device, "--dtype", args.dtype, "--seq", str(args.seq)]
        if args.slice_elements is not None:
            cmd += ["--slice-elements", str(args.slice_elements)]
        if args.channels_last:
            cmd.append("--channels-last")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"batch {batch}: {proc.stderr.strip()[-2000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    mib = 2**20 * (b2 - b1)
    # per phase, so that the slopes compare the same moment of the step at both batches
    slopes = {phase: (runs[1]["phases"][phase]["peak"] - runs[0]["phases"][phase]["peak"]) / mib
              for phase in ("forward", "backward")}
    # the phase of the larger batch's peak first (a slope between small batches can mislead: backward's
    # recomputation works in chunks of a fixed size once the batch is large enough), then the other one
    phase = runs[1]["phase"]
    by_phase = {p: _site_rows(runs, p, mib) for p in (phase, "backward" if phase == "forward" else "forward")}
    rows = by_phase[phase]
    meta = _meta(device) | {"model": args.model, "setting": args.setting, "batches": [b1, b2], "dtype": args.dtype,
                            "seq": args.seq, "slice_elements": args.slice_elements,
                            "channels_last": args.channels_last}
    result = {"meta": meta, "peak_mib_per_sample": slopes[phase], "phase": phase,
              "phase_peaks_mib_per_sample": slopes, "overall_peak_phases": [run["phase"] for run in runs],
              "peaks": [run["peak"] for run in runs], "sites": rows, "sites_by_phase": by_phase}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"memory_at_peak_{args.model}_{args.setting}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    shown = rows[: args.rows]
    sliced = (f", slicing {args.slicing}" if args.slice_elements is None
              else f", slicing {args.slicing} past {args.slice_elements} elements")
    sliced += ", channels last" if args.channels_last else ""
    lines = [(f"{args.model}, {args.setting}{sliced}, {args.dtype}, batches {b1} and {b2} on {meta['device']} (torch "
             f"{meta['torch']}, act_hf @ {meta['commit']}): the highest point of forward grows by "
             f"{slopes['forward']:.2f} MiB a sample above the step's start, that of backward by "
             f"{slopes['backward']:.2f} (each run's overall peak fell in {runs[0]['phase']} / {runs[1]['phase']}).")]
    large = runs[1]
    if "module_highs" in large:
        where = {p: large["phases"][p].get("module") for p in ("forward", "backward")}
        said = {p: f"inside `{m}`" if m else "outside every module" for p, m in where.items()}
        highs = sorted(large["module_highs"].items(), key=lambda kv: -kv[1])[:10]
        result["modules_at_highest"] = where
        result["module_highs_mib_per_sample"] = {m: v / 2**20 / b2 for m, v in highs}
        lines += ["", (f"At batch {b2} the highest point of forward falls {said['forward']}, that of backward "
                       f"{said['backward']} (the innermost module running then). The highest points reached inside "
                       "each module (the 10 highest; MiB a sample above the step's start, at that batch):"),
                  "", "| module | MiB a sample |", "|---|---|"]
        lines += [f"| `{m}` | {v / 2**20 / b2:.2f} |" for m, v in highs]
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    for p, p_rows in by_phase.items():
        p_shown = p_rows[: args.rows]
        title = (f"Alive at the highest point of {p} ({slopes[p]:.2f} MiB a sample), by site (the {len(p_shown)} "
                 f"largest of {len(p_rows)}):")
        lines += ["", title, "",
                  "| site (innermost frame or autograd node, allocating op) | MiB per sample | bytes at each batch |",
                  "|---|---|---|"]
        lines += [f"| `{r['site']}` | {r['mib_per_sample']:.3f} | {r['bytes'][0]:,} / {r['bytes'][1]:,} |"
                  for r in p_shown]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return 0
    top = shown[:15][::-1]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(top) + 1.5))
    ax.barh([r["site"][:70] for r in top], [r["mib_per_sample"] for r in top])
    ax.set_xlabel("MiB per sample alive at the peak")
    ax.set_title(f"{args.model} {args.setting} ({args.dtype}, {args.device}): "
                 f"{phase} peak {result['peak_mib_per_sample']:.2f} MiB/sample", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
