"""Training speed and memory on a GPU: unpatched against act_hf, with and without gradient checkpointing.

For each model and setting it measures, with real optimizer steps (AdamW, bf16 autocast by default):

1. peak memory and samples/s at one equal batch (``--batch``); speed is reported against ``unpatched``;
2. the largest batch that trains under a memory cap (``--cap``, applied with
   ``torch.cuda.set_per_process_memory_fraction``), found by growing from a projection of step 1 (jumping to
   where the line through the two largest fitting peaks meets the cap) and then bisecting to ``--resolution``;
   ``--parallel N`` runs N of these trials at once on one GPU (each capped, so a GPU of at least N x the cap
   answers as N GPUs would), the speed trials of steps 1 and 3 always alone. ``--targets bits3=4.5`` with
   ``--unpatched-max bert-large=91`` starts bits3's search at the target batch, ceil(4.5 x 91) = 410, and reports
   whether it fits as soon as that one trial returns: the issue's targets in one trial per row;
3. samples/s against batch size up to that largest batch (ActNN's Fig. 1, GACT's Fig. 4).

Every measurement is a *trial* run in its own subprocess, so that an out-of-memory never poisons the caching
allocator of a later one. Settings (``--settings``):

    unpatched        the model as built
    bitsN            act_hf.patch(model, bits=N), N in 1..8
    adaptiveB        act_hf.patch(model, bits=B) with a fractional budget B (the probe runs before timing)
    ckpt             gradient checkpointing alone (HF: use_reentrant=False; timm: set_grad_checkpointing)
    ckpt+bitsN       checkpointing with act_hf, the checkpointed layer inputs kept exact; ckpt+adaptiveB likewise
    ckptK+bitsN      the same with the layer inputs packed at K bits (ActConfig(checkpoint_bits=K); GACT's CB1,
                     which used K=4)
    swap+bitsN       act_hf with ActConfig(swap=True): packed contexts in pinned host memory (GACT's L2)

Examples (the issue's targets: bert-large, swin-tiny, resnet50 under 16 GiB; CB1 on bert-large)::

    python benchmarks/benchmark_gpu_training.py --models bert-large swin-tiny resnet50 \\
        --settings unpatched bits3 bits2 --cap 16GiB
    python benchmarks/benchmark_gpu_training.py --models bert-large --settings unpatched ckpt ckpt+bits3 \\
        ckpt4+bits3 swap+bits3 --cap 16GiB --no-curve --out benchmarks/results/ckpt_swap
    python benchmarks/benchmark_gpu_training.py --models bert-large swin-tiny resnet50 --settings bits3 bits2 \\
        bert-large:ckpt4+bits3 --cap 16GiB --no-speed --no-curve --targets bits3=4.5 bits2=6.5 ckpt4+bits3=20 \\
        --unpatched-max bert-large=91 swin-tiny=233 resnet50=374

Writes ``gpu_training.json``, ``gpu_training.md`` and ``gpu_training.png`` under ``--out``. On a CPU
(``--device cpu``) it measures samples/s only: there is no cap to search under.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import act_hf
from act_hf.checkpoint import enable_hf_checkpointing
from act_hf.estimate import format_bytes, parse_size
from act_hf.ops.activation import fused_activation_checks

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_saved_memory import MODELS, _meta, make_inputs, pyplot


@dataclass(frozen=True)
class Setting:
    """What a trial does to the model: act_hf bits (``None``: not patched), gradient checkpointing (with the
    layer inputs packed at ``checkpoint_bits``, or exact for ``None``), and ``ActConfig(swap=True)``."""

    name: str
    bits: int | float | None
    checkpointing: bool = False
    swap: bool = False
    checkpoint_bits: int | None = None


_SETTINGS_HELP = ("allowed: unpatched, bitsN (N 1..8), adaptiveB (a fractional budget such as adaptive2.5), ckpt, "
                  "and ckpt+ / ckptK+ (layer inputs packed at K bits) / swap+ in front of a bits setting (ckpt+bits3, "
                  "ckpt4+bits3, swap+bits3, ckpt+swap+adaptive2.5)")


def parse_setting(name: str) -> Setting:
    """A ``--settings`` word as a :class:`Setting`; unknown words exit with the allowed forms."""
    *options, base = name.split("+")
    if base == "ckpt" and not options:
        options, base = ["ckpt"], "unpatched"
    match = re.fullmatch(r"unpatched|bits([1-8])|adaptive([0-9]*\.[0-9]+)", base)
    ckpt = [o for o in options if re.fullmatch(r"ckpt[1-8]?", o)]
    if not match or len(set(options)) != len(options) or len(ckpt) > 1 \
            or not all(o == "swap" or o in ckpt for o in options) \
            or (base == "unpatched" and options and name != "ckpt"):
        raise SystemExit(f"--settings: unknown setting {name!r}; {_SETTINGS_HELP}")
    bits: int | float | None = None
    if match.group(1):
        bits = int(match.group(1))
    elif match.group(2):
        bits = float(match.group(2))
        if bits.is_integer() or not 1 < bits < 8:
            raise SystemExit(f"--settings: {name!r}: an adaptive budget is a fractional number in (1, 8), "
                             "e.g. adaptive2.5 (bitsN is a fixed width)")
    return Setting(name, bits, checkpointing=bool(ckpt), swap="swap" in options,
                   checkpoint_bits=int(ckpt[0][4:]) if ckpt and ckpt[0] != "ckpt" else None)


@dataclass(frozen=True)
class Trial:
    """One measurement: ``warmup`` untimed steps, then ``steps`` timed ones at ``batch``; then the same at each
    batch of ``sweep`` in turn, in the same process (the model built once; the first out-of-memory ends it)."""

    model: str
    setting: str
    batch: int
    steps: int = 5
    warmup: int = 2
    seq: int = 128
    image_size: int = 224
    dtype: str = "bf16"
    device: str = "cuda"
    cap_bytes: int | None = None
    attention_dropout: float | None = None
    checkpoint_debug: bool = False
    sweep: tuple[int, ...] = ()


#: the attention-probability dropout keyword of each HF family among ``MODELS`` (an unknown one is ignored)
_ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Gradient checkpointing of an HF model (``use_reentrant=False``) or a timm one."""
    if hasattr(model, "gradient_checkpointing_enable"):  # transformers
        enable_hf_checkpointing(model)
    elif hasattr(model, "set_grad_checkpointing"):  # timm
        model.set_grad_checkpointing(True)
    else:
        raise SystemExit(f"--settings ckpt: {type(model).__name__} has no gradient checkpointing switch")


def prepare_step(trial: Trial) -> tuple[Callable[[], None], dict, Callable[[int], None]]:
    """Build, set up and (for ``bitsN``) patch the trial's model on its device, with AdamW and the trial's batch.

    Returns one training step (zero_grad, forward under autocast, backward, optimizer step; no sync), what
    preparing it measured (the adaptive allocator's ``avg_bits`` and ``probe_s``, run once here, before timing),
    and ``rebatch(b)``, which gives the step a fresh batch of ``b`` samples in place of the one it has.
    """
    device = torch.device(trial.device)
    if device.type == "cuda" and trial.cap_bytes:
        total = torch.cuda.get_device_properties(device).total_memory
        index = torch.cuda.current_device() if device.index is None else device.index  # torch 2.11 needs one
        torch.cuda.set_per_process_memory_fraction(min(1.0, trial.cap_bytes / total), index)
    setting = parse_setting(trial.setting)
    torch.manual_seed(0)
    if trial.attention_dropout is None:
        model, kind = MODELS[trial.model]()
    else:
        model, kind = MODELS[trial.model](**dict.fromkeys(_ATTENTION_DROPOUT_KEYS, trial.attention_dropout))
    if setting.checkpointing:
        enable_checkpointing(model)
    model.to(device).train()
    if setting.bits is not None:
        act_hf.patch(model, bits=setting.bits, swap=setting.swap, checkpoint_bits=setting.checkpoint_bits)
    def inputs(size: int) -> dict:
        b = make_inputs(kind, model, size, trial.seq, device, trial.image_size)
        if kind == "image":
            b["y"] = torch.zeros(size, dtype=torch.long, device=device)
        return b

    batch = inputs(trial.batch)

    def rebatch(size: int) -> None:
        nonlocal batch
        batch = None  # freed before the next one is made
        if device.type == "cuda":
            torch.cuda.empty_cache()
        batch = inputs(size)

    if kind == "image":
        def loss_of(b: dict) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(model(b["x"]).float(), b["y"])
    else:
        def loss_of(b: dict) -> torch.Tensor:
            return model(**b).loss
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=trial.dtype == "bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_of(batch)
        loss.backward()
        optimizer.step()

    info: dict = {}
    allocator = getattr(model, "act_hf_allocator", None)
    if allocator is not None:  # adaptive: allocate once, before timing (amortized over adapt_interval steps)
        allocator.automatic = False
        with autocast:
            allocator.update_batch(batch, loss_of)
        info = {"avg_bits": allocator.average_bits(), "probe_s": allocator.probe_seconds}
    return step, info, rebatch


#: the caching allocator's counters (``torch.cuda.memory_stats``) that :func:`_timed_steps` reports a step of: a
#: ``cudaMalloc`` or ``cudaFree`` during a step, or an allocation retried after freeing the cache, stalls the host
#: (``cudaFree`` and a retry wait for the device), so a step that makes them is not bound by its launches alone
ALLOCATOR_EVENTS = {"cudaMalloc": "num_device_alloc", "cudaFree": "num_device_free", "retries": "num_alloc_retries"}


def _timed_steps(step: Callable[[], None], trial: Trial, batch: int) -> dict:
    """``trial.warmup`` untimed and ``trial.steps`` timed steps at ``batch``: samples/s, and on a GPU the peak
    allocated and reserved memory over the timed steps and the allocator's events a step
    (:data:`ALLOCATOR_EVENTS`). An out-of-memory propagates."""
    device = torch.device(trial.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(trial.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        settled = torch.cuda.memory_allocated(device)
        before = torch.cuda.memory_stats(device)
    start = time.perf_counter()
    for _ in range(trial.steps):
        step()
    sync()
    elapsed = time.perf_counter() - start
    out = {"samples_per_s": batch * trial.steps / elapsed, "step_ms": 1000 * elapsed / trial.steps}
    if cuda:  # resident: what stays between steps (weights, gradients, optimizer states); it must not grow
        resident, after = torch.cuda.memory_allocated(device), torch.cuda.memory_stats(device)
        out |= {"peak_bytes": torch.cuda.max_memory_allocated(device),
                "reserved_bytes": torch.cuda.max_memory_reserved(device),
                "resident_bytes": resident, "growth_bytes_per_step": (resident - settled) / trial.steps,
                "allocator_events_per_step": {name: (after.get(key, 0) - before.get(key, 0)) / trial.steps
                                              for name, key in ALLOCATOR_EVENTS.items()}}
    return out


def run_trial(trial: Trial) -> dict:
    """Train ``trial.warmup + trial.steps`` steps in this process (:func:`_timed_steps`), then as many at each
    batch of ``trial.sweep``, under ``"sweep"`` by batch, until one runs out of memory (that one ``{"oom":
    True}``, the rest not tried: the allocator may be left in pieces). An out-of-memory at ``trial.batch``
    returns ``{"oom": True}``."""
    if trial.checkpoint_debug:  # a CheckpointError then names the saved tensor that differs, with both stacks
        torch.utils.checkpoint.set_checkpoint_debug_enabled(True)
    try:
        step, info, rebatch = prepare_step(trial)
        out = {"oom": False} | info | _timed_steps(step, trial, trial.batch)
    except torch.OutOfMemoryError:
        return {"oom": True}
    out["fused_activation_checks"] = fused_activation_checks()  # where one failed, that activation ran unfused
    if trial.sweep:
        out["sweep"] = {}
    for size in trial.sweep:
        try:
            rebatch(size)
            out["sweep"][size] = {"oom": False} | _timed_steps(step, trial, size)
        except torch.OutOfMemoryError:
            out["sweep"][size] = {"oom": True}
            break
    return out


def run_in_subprocess(trial: Trial, timeout: float = 1800) -> dict:
    """:func:`run_trial` in a fresh interpreter; a crash is returned as ``{"error": ...}``, an out-of-memory that
    escaped the trial (e.g. in CUDA context creation) as ``{"oom": True}``."""
    cmd = [sys.executable, __file__, "--trial", json.dumps(asdict(trial))]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if "out of memory" in proc.stderr.lower():
        return {"oom": True}
    return {"error": _exception_text(proc.stderr)}


def _exception_text(stderr: str, limit: int = 4000) -> str:
    """The last exception in a traceback on ``stderr``: its line and the message lines after it (a
    CheckpointError's message runs over many lines), joined by `` | ``, at most ``limit`` characters."""
    lines = stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", line)]
    text = " | ".join(lines[starts[-1]:] if starts else lines[-3:])
    return text if len(text) <= limit else text[:limit] + " ..."


def largest_batch(fits: Callable[[int], bool], start: int, *, limit: int = 1 << 16, growth: float = 1.5,
                  resolution: float = 0.02,
                  propose: Callable[[int, int | None], int | None] | None = None) -> tuple[int, int | None]:
    """The largest batch for which ``fits`` holds, assuming it holds below some threshold and fails above it.

    Grows by ``growth`` from ``start`` while it fits (or shrinks by it while it does not), then bisects until the
    gap between the largest fitting and the smallest failing batch is at most ``max(1, resolution * fitting)``.
    ``propose(fitting, failing)``, when given, may name the next batch to try instead of a growth, shrink or
    bisection step (a projection from the peaks measured so far: ``failing`` is ``None`` while growing,
    ``fitting`` 0 while shrinking); an answer outside the open interval between them, one already tried, or
    ``None`` takes the step instead. Every trial narrows the interval, so the search ends whatever it proposes.

    Returns:
        ``(fitting, failing)``: the largest batch seen to fit (0 if even batch 1 fails) and the smallest seen to
        fail (``None`` if every batch up to ``limit`` fit).
    """
    if start < 1:
        raise ValueError(f"start must be >= 1, got {start}")
    if growth <= 1:
        raise ValueError(f"growth must be > 1, got {growth}")
    seen: dict[int, bool] = {}

    def check(b: int) -> bool:
        if b not in seen:
            seen[b] = fits(b)
        return seen[b]

    def proposed(lo: int, hi: int | None, step: int) -> int:
        b = propose(lo, hi) if propose is not None else None
        upper = limit if hi is None else hi - 1
        return b if b is not None and lo < b <= upper and b not in seen else step

    lo, hi = 0, None
    b = min(start, limit)
    if check(b):
        lo = b
        while hi is None and lo < limit:
            b = proposed(lo, None, min(limit, max(lo + 1, int(lo * growth))))
            if check(b):
                lo = b
            else:
                hi = b
    else:
        hi = b
        while lo == 0 and hi > 1:
            b = proposed(0, hi, min(hi - 1, int(hi / growth)))
            if check(b):
                lo = b
            else:
                hi = b
    while hi is not None and hi - lo > max(1, int(resolution * lo)):
        b = proposed(lo, hi, (lo + hi) // 2)
        if check(b):
            lo = b
        else:
            hi = b
    return lo, hi


def secant_batch(points: dict[int, int], cap: int, *, resident: int | None = None) -> int | None:
    """The batch at which the line through the two largest ``points`` (batch -> measured peak bytes) reaches 99%
    of ``cap``; with one point, the line from ``resident`` (the memory held between steps: weights, gradients,
    optimizer states) at batch 0 through it. ``None`` without enough points or with a peak that does not grow.
    Peaks grow about linearly with the batch once the per-sample part dominates, so this lands near the
    threshold in a step or two, where growing 1.1x a trial from 271 takes 12 trials to a threshold of 586."""
    known = sorted(points.items())
    if len(known) < 2 and resident is not None:
        known.insert(0, (0, resident))
    if len(known) < 2:
        return None
    (b1, p1), (b2, p2) = known[-2:]
    if p2 <= p1:
        return None
    return int(b2 + (0.99 * cap - p2) / ((p2 - p1) / (b2 - b1)))


def bracketed_guess(guess: int | None, lo: int, hi: int | None, resolution: float, *,
                    most_growth: float = 4.0) -> int | None:
    """What to try after ``lo`` fit (and ``hi`` failed, unless ``None``) given a projected threshold ``guess``:
    ``guess`` itself (while growing, at most ``most_growth`` times ``lo``), or when it is not above ``lo`` the
    smallest batch whose failure would end the search (``lo`` plus the resolution); ``None`` (bisect or grow
    instead) without a guess or when ``hi`` has already failed at or below it, which shows the projection too
    high."""
    if guess is None or (hi is not None and guess >= hi):
        return None
    if hi is None:
        guess = int(min(guess, most_growth * lo))
    return max(guess, lo + max(1, int(resolution * lo)))


def _curve_batches(largest: int, equal: int) -> list[int]:
    """Powers of two from 8 up to ``largest``, plus the equal batch and ``largest`` itself."""
    points = {2 ** k for k in range(3, int(math.log2(max(largest, 1))) + 1)} | {largest}
    if equal <= largest:
        points.add(equal)
    return sorted(p for p in points if p >= 1)


def _progress(model: str, setting: str, what: str, result: dict) -> None:
    shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in result.items()}
    print(f"{model} {setting} {what}: {shown}", flush=True)


def _search_start(equal: dict, batch: int, cap: int) -> tuple[int, float]:
    """Where the largest-batch search starts and how fast it grows, from the equal-batch trial.

    With the memory resident between steps (weights, gradients, optimizer states) the per-sample cost is
    ``(peak - resident) / batch`` and the projection is close: start 3% below it and grow by 1.1x. Without it
    (or when the equal batch failed) the projection ignores the fixed memory and underestimates: grow by 1.5x.
    """
    peak, resident = equal.get("peak_bytes"), equal.get("resident_bytes")
    if peak and resident is not None and peak > resident and cap > resident:
        return max(1, int(0.97 * batch * (cap - resident) / (peak - resident))), 1.1
    if peak:
        return max(1, int(batch * cap / peak)), 1.5
    return batch, 1.5


def _peak(result: dict) -> int | None:
    """What a trial's peak counts against the cap: the allocator's reserved bytes (what an out-of-memory is decided
    on), else the allocated peak."""
    return result.get("reserved_bytes") or result.get("peak_bytes")


def measure(models: list[str], settings: list[str], args: argparse.Namespace,
            report: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Rows for every model and setting: equal-batch speed and peak (unless ``args.speed`` is false), and (with a
    cap) the largest batch and the curve. ``report`` gets the rows after every phase, so an interrupted run keeps
    what it measured.

    The equal-batch trials and the curves run one at a time (their samples/s see the GPU alone); the
    largest-batch searches only ask whether a batch fits, so ``args.parallel`` of their trials share the GPU,
    each capped at ``args.cap``. A setting with a target ratio (``args.targets``: setting -> ratio) for a model
    with a known unpatched largest batch ``U`` (``args.unpatched_max``: model -> U) starts its search at
    ``ceil(ratio * U)``, and the row records at once whether that batch fits (``row["target"]``). While a search
    grows, it jumps to where the line through its two largest fitting peaks meets the cap (:func:`secant_batch`).
    """
    base = {"seq": args.seq, "image_size": args.image_size, "dtype": args.dtype, "device": args.device,
            "steps": args.steps, "warmup": args.warmup, "attention_dropout": args.attention_dropout,
            "checkpoint_debug": args.checkpoint_debug}
    targets, unpatched_max = getattr(args, "targets", None) or {}, getattr(args, "unpatched_max", None) or {}
    rows = [{"model": model, "setting": name} for model in models for name in _settings_of(model, settings)]
    sweep = tuple(sorted(set(getattr(args, "curve_batches", None) or ()) - {args.batch}))
    for row in rows if getattr(args, "speed", True) else ():
        result = run_in_subprocess(Trial(row["model"], row["setting"], args.batch, cap_bytes=args.cap, sweep=sweep,
                                         **base))
        points = {int(b): point for b, point in result.pop("sweep", {}).items()}
        row["equal_batch"] = result
        _progress(row["model"], row["setting"], f"batch {args.batch}", result)
        for b, point in points.items():
            _progress(row["model"], row["setting"], f"curve batch {b}", point)
        if sweep:
            row["curve"] = {b: p.get("samples_per_s") for b, p in sorted(({args.batch: result} | points).items())}
        _add_ratios(rows)
        report(rows)
    if args.cap and args.search:
        slots, reporting = threading.Semaphore(max(1, args.parallel)), threading.Lock()
        quick = base | {"steps": 1, "warmup": 1}  # step 2 holds the optimizer states: the peak is reached

        def search(row: dict) -> None:
            model, name = row["model"], row["setting"]
            equal = row.get("equal_batch", {})
            start, growth = _search_start(equal, args.batch, args.cap)
            target = None
            if name in targets and model in unpatched_max:
                target = math.ceil(targets[name] * unpatched_max[model])
                row["target"] = {"ratio": targets[name], "unpatched": unpatched_max[model], "batch": target,
                                 "fits": None}
            points = {args.batch: _peak(equal)} if not equal.get("oom") and _peak(equal) else {}
            resident = equal.get("resident_bytes")

            def fits(b: int) -> bool:
                nonlocal resident
                with slots:
                    result = run_in_subprocess(Trial(model, name, b, cap_bytes=args.cap, **quick))
                _progress(model, name, f"fits batch {b}", result)
                if "error" in result:
                    raise RuntimeError(f"{model} {name} batch {b}: {result['error']}")
                if not result["oom"] and _peak(result):
                    points[b], resident = _peak(result), result.get("resident_bytes")
                if b == target:
                    with reporting:
                        row["target"]["fits"] = not result["oom"]
                        report(rows)
                return not result["oom"]

            def propose(lo: int, hi: int | None) -> int | None:
                if lo == 0:  # a target that failed: the projection from the equal batch next
                    return start if start < hi else None
                return bracketed_guess(secant_batch(points, args.cap, resident=resident), lo, hi, args.resolution)

            try:
                row["max_batch"], row["first_failing_batch"] = largest_batch(
                    fits, target or start, growth=growth, resolution=args.resolution, propose=propose)
            except RuntimeError as e:  # a crashing trial is a result of its row; the other searches go on
                row["search_error"] = str(e)
            with reporting:
                _add_ratios(rows)
                report(rows)

        print(f"searching the largest batches under {format_bytes(args.cap)}, {args.parallel} trial(s) at a time",
              flush=True)
        with ThreadPoolExecutor(max_workers=len(rows)) as pool:
            list(pool.map(search, rows))
        if args.curve and not sweep:
            for row in (r for r in rows if r.get("max_batch")):
                row["curve"] = {}
                for b in _curve_batches(row["max_batch"], args.batch):
                    point = run_in_subprocess(Trial(row["model"], row["setting"], b, cap_bytes=args.cap, **base))
                    _progress(row["model"], row["setting"], f"curve batch {b}", point)
                    row["curve"][b] = point.get("samples_per_s")
                report(rows)
    return rows


def _settings_of(model: str, settings: list[str]) -> list[str]:
    """The ``--settings`` words that apply to ``model``: plain ones, and ``MODEL:setting`` ones naming it."""
    return [word.partition(":")[2] if ":" in word else word for word in settings
            if ":" not in word or word.partition(":")[0] == model]


def _add_ratios(rows: list[dict]) -> None:
    """Speed and largest batch of each row against its model's ``unpatched`` row, where both were measured."""
    for r in rows:
        reference = next((u for u in rows if u["model"] == r["model"] and u["setting"] == "unpatched"), None)
        if reference is None:
            continue
        ref_speed = reference.get("equal_batch", {}).get("samples_per_s")
        speed = r.get("equal_batch", {}).get("samples_per_s")
        if ref_speed and speed:
            r["speed_vs_unpatched"] = speed / ref_speed
        if reference.get("max_batch") and r.get("max_batch") is not None:
            r["max_batch_vs_unpatched"] = r["max_batch"] / reference["max_batch"]


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _target_cell(target: dict | None) -> str:
    """``4.5x of 91 = 410: fits`` (or ``: OOM``, or ``: not answered`` when the run ended before the trial)."""
    if target is None:
        return "-"
    answer = {True: "fits", False: "OOM", None: "not answered"}[target["fits"]]
    return f"{target['ratio']:g}x of {target['unpatched']} = {target['batch']}: {answer}"


def write_results(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_training.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    cap = f"under {format_bytes(meta['cap_bytes'])}" if meta["cap_bytes"] else "(no cap)"
    with_targets = any("target" in r for r in rows)
    lines = [
        (f"Training steps (AdamW, {meta['dtype']} autocast; text seq {meta['seq']}, images {meta['image_size']}px), "
        + (f"equal batch {meta['batch']}, {meta['steps']} timed steps after {meta['warmup']} warm-up; "
           if meta.get("speed", True) else "no equal-batch speed trials; ")
        + f"largest batch "
        f"{cap}, searched in subprocesses to {meta['resolution']:.0%}. {meta['device']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, timm {meta['timm']}, act_hf {meta['act_hf']} @ {meta['commit']}."
        + ("" if meta.get("attention_dropout") is None else
           f" HF attention-probability dropout {meta['attention_dropout']:g}.")
        + (f" PYTORCH_CUDA_ALLOC_CONF={meta['alloc_conf']}." if meta.get("alloc_conf") else "")),
        "",
        "| model | setting | peak @ equal batch | samples/s | speed vs unpatched | largest batch | vs unpatched |"
        + (" target batch |" if with_targets else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if with_targets else ""),
    ]
    for r in (r for r in rows if "equal_batch" in r or "max_batch" in r or "target" in r or "search_error" in r):
        eq = r.get("equal_batch", {})
        peak = "OOM" if eq.get("oom") else "error" if eq.get("error") else \
            format_bytes(eq["peak_bytes"]) if eq.get("peak_bytes") else "-"
        largest = "error" if r.get("search_error") else _cell(r.get("max_batch"), "d")
        if r.get("first_failing_batch"):
            largest += f" (fails at {r['first_failing_batch']})"
        line = (f"| {r['model']} | {r['setting']} | {peak} | {_cell(eq.get('samples_per_s'), '.1f')} | "
                f"{_cell(r.get('speed_vs_unpatched'), '.3f')} | {largest} | "
                f"{_cell(r.get('max_batch_vs_unpatched'), '.2f')} |")
        if with_targets:
            line += f" {_target_cell(r.get('target'))} |"
        lines.append(line)
    timed = [r for r in rows if "growth_bytes_per_step" in r.get("equal_batch", {})]
    grew = [r for r in timed if r["equal_batch"]["growth_bytes_per_step"] > 0]
    if timed:
        lines += ["", "Allocated memory after the timed steps against after the warm-up: "
                  + ("the same in every speed trial." if not grew else "**grew** in "
                     + ", ".join(f"{r['model']} {r['setting']} "
                                 f"({format_bytes(r['equal_batch']['growth_bytes_per_step'])} a step)" for r in grew)
                     + " (a leak, or a cache still filling).")]
    events = [r for r in timed if any(r["equal_batch"].get("allocator_events_per_step", {}).values())]
    if timed:
        def counts(r: dict) -> str:
            per_step = r["equal_batch"]["allocator_events_per_step"]
            return ", ".join(f"{value:g} {name}" for name, value in per_step.items())

        lines += ["", "The caching allocator's events a timed step (" + ", ".join(ALLOCATOR_EVENTS) + "): "
                  + ("none in any speed trial." if not events else "; ".join(
                      f"{r['model']} {r['setting']} {counts(r)}" for r in events)
                     + " (each `cudaFree` and retry waits for the device).")]
    checks = {f"{r['model']} {r['setting']}": r["equal_batch"]["fused_activation_checks"] for r in timed
              if r["equal_batch"].get("fused_activation_checks")}
    if timed:
        any_failed = any(not passed for verdicts in checks.values() for passed in verdicts.values())
        lines += ["", "Fused activations (their check of act_hf's kernel against torch's, every 16-bit value, before "
                  "fusing): " + ("none checked in any speed trial." if not checks else "; ".join(
                      f"{trial}: " + ", ".join(f"{name} {'passed' if passed else '**failed**'}"
                                               for name, passed in verdicts.items())
                      for trial, verdicts in checks.items())
                      + (" (a failed one ran unfused)." if any_failed else "."))]
    curves = [r for r in rows if r.get("curve")]
    if curves:
        batches = sorted({int(b) for r in curves for b in r["curve"]})
        lines += ["", "Samples/s against batch size (- where a trial ran out of memory or was not run after one):",
                  "", "| model | setting | " + " | ".join(map(str, batches)) + " |",
                  "|---|---|" + "---|" * len(batches)]
        for r in curves:
            by_batch = {int(b): sps for b, sps in r["curve"].items()}
            lines.append(f"| {r['model']} | {r['setting']} | "
                         + " | ".join(_cell(by_batch.get(b), ".1f") for b in batches) + " |")
    (out / "gpu_training.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    if not curves:
        _plot_ratios(plt, rows, out / "gpu_training.png")
        return
    models = list(dict.fromkeys(r["model"] for r in curves))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in (r for r in curves if r["model"] == model):
            points = sorted((int(b), s) for b, s in r["curve"].items() if s)
            ax.plot([b for b, _ in points], [s for _, s in points], marker="o", label=r["setting"])
        ax.set_xscale("log", base=2)
        ax.set_title(model)
        ax.set_xlabel("batch size")
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "gpu_training.png", dpi=120)


def _plot_ratios(plt, rows: list[dict], path: Path) -> None:
    """Without curves: each setting's samples/s and largest batch against its model's unpatched row (the table's
    two ratio columns), a bar for each model and setting; a panel only where some row has its ratio."""
    panels = [(key, label) for key, label in (("speed_vs_unpatched", "samples/s vs unpatched"),
                                              ("max_batch_vs_unpatched", "largest batch vs unpatched"))
              if any(r.get(key) is not None for r in rows)]
    if not panels:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    width = 0.8 / len(settings)
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.5, 1.2 * len(models) + 2) * len(panels), 3.6),
                             squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for k, setting in enumerate(settings):
            by_model = {r["model"]: r.get(key) for r in rows if r["setting"] == setting}
            ax.bar([m + (k - (len(settings) - 1) / 2) * width for m in range(len(models))],
                   [by_model.get(model) or math.nan for model in models], width, label=setting)  # NaN: no bar
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _known_setting(name: str) -> None:
    try:
        parse_setting(name)
    except SystemExit as e:
        raise SystemExit(str(e).replace("--settings", "--targets", 1)) from None


def _known_model(name: str) -> None:
    if name not in MODELS:
        raise SystemExit(f"--unpatched-max: unknown model {name!r}; allowed: {', '.join(MODELS)}")


def _pairs(parser: argparse.ArgumentParser, flag: str, words: list[str], kind: type,
           check_key: Callable[[str], object]) -> dict:
    """``KEY=VALUE`` words as a dict, each key checked by ``check_key`` and each value read as ``kind``."""
    out = {}
    for word in words:
        key, sep, value = word.rpartition("=")
        try:
            if not sep:
                raise ValueError
            out[key] = kind(value)
        except ValueError:
            parser.error(f"{flag}: expected KEY={kind.__name__.upper()}, got {word!r}")
        check_key(key)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert-large", "swin-tiny", "resnet50"], choices=list(MODELS))
    parser.add_argument("--settings", nargs="+", default=["unpatched", "bits3", "bits2"],
                        help="what to compare (see above; MODEL:setting applies to that model alone, e.g. "
                             "bert-large:ckpt+bits3); include unpatched to get the ratios")
    parser.add_argument("--batch", type=int, default=32, help="the equal batch for speed and peak (default 32)")
    parser.add_argument("--cap", type=lambda s: parse_size(s, "--cap"), default=None,
                        help="memory cap for the largest-batch search, e.g. 16GiB (GPU only)")
    parser.add_argument("--resolution", type=float, default=0.02, help="relative precision of the search")
    parser.add_argument("--no-search", dest="search", action="store_false", help="skip the largest-batch search")
    parser.add_argument("--no-curve", dest="curve", action="store_false", help="skip the throughput curve")
    parser.add_argument("--curve-batches", type=int, nargs="+", metavar="B",
                        help="the throughput curve at these batches instead of up to each searched largest batch: "
                             "timed in the equal-batch speed trial's process after --batch, smallest first, until "
                             "one runs out of memory under --cap (no search needed)")
    parser.add_argument("--no-speed", dest="speed", action="store_false",
                        help="skip the equal-batch speed trials (the searches then start without their projection)")
    parser.add_argument("--targets", nargs="+", default=[], metavar="SETTING=RATIO",
                        help="start the search of SETTING at RATIO times the model's unpatched largest batch (from "
                             "--unpatched-max) and report whether that batch fits, e.g. bits3=4.5 bits2=6.5 "
                             "ckpt4+bits3=20 (the issue's targets)")
    parser.add_argument("--unpatched-max", nargs="+", default=[], metavar="MODEL=BATCH",
                        help="the unpatched largest batch under --cap that --targets multiply, e.g. bert-large=91 "
                             "swin-tiny=233 resnet50=374 (ENVIRONMENT.md's H100 figures at 16 GiB)")
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="largest-batch trials sharing the GPU at once (each under --cap; default 1). Speed "
                             "trials always run alone")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--alloc-conf", metavar="CONF",
                        help="PYTORCH_CUDA_ALLOC_CONF for every trial, unpatched ones included (e.g. "
                             "expandable_segments:True, against the fragmentation that packed contexts of many "
                             "sizes cause)")
    parser.add_argument("--checkpoint-debug", action="store_true",
                        help="torch.utils.checkpoint.set_checkpoint_debug_enabled(True) in every trial: a "
                             "CheckpointError then names the tensor that differs")
    parser.add_argument("--attention-dropout", type=float, default=None, metavar="P",
                        help="HF models: attention-probability dropout P (default: as in benchmark_saved_memory, "
                             "0 for BERT/RoBERTa/GPT-2; BERT's own default is 0.1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--trial", help=argparse.SUPPRESS)  # internal: run one Trial (JSON), print the result
    args = parser.parse_args(argv)
    if args.trial:
        print(json.dumps(run_trial(Trial(**json.loads(args.trial)))))
        return 0
    for word in args.settings:
        model, _, name = word.rpartition(":")
        if model and model not in MODELS:
            parser.error(f"--settings {word!r}: unknown model {model!r}; allowed: {', '.join(MODELS)}")
        parse_setting(name)
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.parallel < 1 \
            or any(b < 1 for b in args.curve_batches or ()):
        parser.error("--batch, --curve-batches, --steps and --parallel must be >= 1, --warmup >= 0")
    if args.curve_batches and not args.speed:
        parser.error("--curve-batches is timed in the speed trials: it cannot go with --no-speed")
    if args.cap and not args.device.startswith("cuda"):
        parser.error(f"--cap needs a CUDA device (--device is {args.device!r})")
    args.targets = _pairs(parser, "--targets", args.targets, float, _known_setting)
    args.unpatched_max = _pairs(parser, "--unpatched-max", args.unpatched_max, int, _known_model)
    if args.targets and not (args.cap and args.search):
        parser.error("--targets needs --cap and the search (they start it)")
    if any(ratio <= 0 for ratio in args.targets.values()) or any(b < 1 for b in args.unpatched_max.values()):
        parser.error("--targets ratios must be > 0 and --unpatched-max batches >= 1")
    if args.alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf  # the trials' subprocesses inherit it
    meta = _meta(torch.device(args.device)) | {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")} | {
        key: getattr(args, key) for key in ("batch", "steps", "warmup", "seq", "image_size", "dtype", "resolution",
                                            "attention_dropout", "parallel", "speed", "targets", "unpatched_max",
                                            "curve_batches")
    } | {"cap_bytes": args.cap}
    measure(args.models, args.settings, args, report=lambda rows: write_results(rows, meta, args.out))
    print((args.out / "gpu_training.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
