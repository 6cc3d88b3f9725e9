"""What is alive at the memory peak of a training step, and who allocated it: per sample, by code site.

The per-sample peak of a patched step is its saved context *plus* the transient working set of the moment the
peak falls in (the first GPU run: swin-tiny at 3 bits peaked at 19.9 MiB a sample above resident memory against
9.1 MiB of saved context). This names the rest. One forward and backward runs under ``torch.profiler`` with
``profile_memory`` and Python stacks; every allocation and free of the model's device is replayed in order, the
peak of the running total is found, and the blocks alive at that moment are summed by **site**: the innermost
frame in act_hf, timm or transformers (or, for a C++ autograd node, the node) together with the aten op that
allocated the block. Run at two batch sizes, a site's bytes at the larger minus those at the smaller, over the
difference of batches, is its share of the per-sample peak; what does not grow with the batch (autocast's cached
bf16 weights, parameter gradients) drops out.

The same code reads CPU allocations (here) and CUDA ones (on a GPU the caching allocator reports each block it
hands out and takes back; its reserved-but-free memory, fragmentation, is not counted)::

    python benchmarks/memory_at_peak.py --model swin-tiny --setting bits3 --batches 2 4
    python benchmarks/memory_at_peak.py --model resnet50 --setting bits3 --device cuda --batches 16 32

Each (batch) runs in its own subprocess. Writes ``memory_at_peak_<model>_<setting>.json``, ``.md`` and ``.png``
under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

import act_hf

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_checkpoint_memory import parse_setting
from benchmark_saved_memory import MODELS, _meta, make_inputs

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


def peak_sites(events, backward_from_ns: int) -> dict:
    """The running total's peak over ``events`` (bytes above the first event), the phase it fell in, and the
    bytes alive then by :func:`_site`."""
    total = peak = 0
    at = -1
    for i, (_, _, size, _, _) in enumerate(events):
        total += size
        if total > peak:
            peak, at = total, i
    live: dict[int, tuple[int, tuple]] = {}
    for _, _, size, ptr, stack in events[: at + 1]:
        if size > 0:
            live[ptr] = (size, stack)
        else:
            live.pop(ptr, None)
    sites: dict[str, int] = defaultdict(int)
    for size, stack in live.values():
        sites[_site(stack)] += size
    phase = "backward" if at >= 0 and events[at][0] >= backward_from_ns else "forward"
    return {"peak": peak, "phase": phase, "sites": dict(sites)}


def profile_peak(forward_loss: Callable[[], torch.Tensor], device: torch.device) -> dict:
    """:func:`peak_sites` of one ``forward_loss().backward()``, profiled (allocations on ``device`` only)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True, with_stack=True) as prof:
        loss = forward_loss()
        with record_function("act_hf_backward"):
            loss.backward()
        del loss
    return peak_sites(*_allocations(prof, device))


def measure(model_name: str, setting: str, batch: int, device: torch.device, dtype: str, seq: int) -> dict:
    """In this process: :func:`profile_peak` of one training step of ``model_name`` at ``batch``, after a batch-1
    step (so parameter gradients exist)."""
    checkpointing, _, bits = parse_setting(setting)
    if checkpointing:
        raise SystemExit("--setting: checkpointing is not measured here; use unpatched or bitsN")
    torch.manual_seed(0)
    model, kind = MODELS[model_name]()
    model.to(device).train()
    if kind != "image":  # its dense vocabulary-sized gradient would set the peak at small batches
        model.get_input_embeddings().weight.requires_grad_(False)
    if bits is not None:
        act_hf.patch(model, bits=bits)
    inputs = make_inputs(kind, model, batch, seq, device)
    labels = torch.zeros(batch, dtype=torch.long, device=device)

    def forward_loss(n: int) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            if kind == "image":
                return torch.nn.functional.cross_entropy(model(inputs["x"][:n]).float(), labels[:n])
            return model(**{k: v[:n] for k, v in inputs.items()}).loss

    forward_loss(1).backward()
    return {"batch": batch} | profile_peak(lambda: forward_loss(batch), device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="swin-tiny", choices=list(MODELS))
    parser.add_argument("--setting", default="bits3", help="unpatched or bitsN (N 1..8)")
    parser.add_argument("--batches", type=int, nargs=2, default=[2, 4], metavar=("B1", "B2"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="bf16: autocast (default)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=25, help="sites in the table")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure this batch, print JSON
    args = parser.parse_args(argv)
    parse_setting(args.setting)
    b1, b2 = args.batches
    if not 1 <= b1 < b2:
        parser.error(f"--batches: two sizes with 1 <= B1 < B2, got {b1} {b2}")
    device = torch.device(args.device)
    if args.one is not None:
        print(json.dumps(measure(args.model, args.setting, args.one, device, args.dtype, args.seq)))
        return 0
    runs = []
    for batch in (b1, b2):
        cmd = [sys.executable, __file__, "--one", str(batch), "--model", args.model, "--setting", args.setting,
               "--device", args.device, "--dtype", args.dtype, "--seq", str(args.seq)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"batch {batch}: {proc.stderr.strip()[-2000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    small, large = runs
    mib = 2**20 * (b2 - b1)
    names = set(small["sites"]) | set(large["sites"])
    rows = sorted(({"site": s, "mib_per_sample": (large["sites"].get(s, 0) - small["sites"].get(s, 0)) / mib,
                    "bytes": [small["sites"].get(s, 0), large["sites"].get(s, 0)]} for s in names),
                  key=lambda r: -abs(r["mib_per_sample"]))
    meta = _meta(device) | {"model": args.model, "setting": args.setting, "batches": [b1, b2], "dtype": args.dtype,
                            "seq": args.seq}
    result = {"meta": meta, "peak_mib_per_sample": (large["peak"] - small["peak"]) / mib,
              "phases": [small["phase"], large["phase"]], "peaks": [small["peak"], large["peak"]], "sites": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"memory_at_peak_{args.model}_{args.setting}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    shown = rows[: args.rows]
    lines = [(f"{args.model}, {args.setting}, {args.dtype}, batches {b1} and {b2} on {meta['device']} (torch "
             f"{meta['torch']}, act_hf @ {meta['commit']}): peak {result['peak_mib_per_sample']:.2f} MiB a sample "
             f"above the step's start, in {small['phase']} / {large['phase']}. Alive at the peak, by site (the "
             f"{len(shown)} largest of {len(rows)}):"), "",
             "| site (innermost frame or autograd node, allocating op) | MiB per sample | bytes at each batch |",
             "|---|---|---|"]
    lines += [f"| `{r['site']}` | {r['mib_per_sample']:.3f} | {r['bytes'][0]:,} / {r['bytes'][1]:,} |" for r in shown]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = shown[:15][::-1]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(top) + 1.5))
    ax.barh([r["site"][:70] for r in top], [r["mib_per_sample"] for r in top])
    ax.set_xlabel("MiB per sample alive at the peak")
    ax.set_title(f"{args.model} {args.setting} ({args.dtype}, {args.device}): "
                 f"peak {result['peak_mib_per_sample']:.2f} MiB/sample", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
