"""What channel scaling buys on a pretrained model: quantization error of its hidden states and the variance
act_hf adds to its gradient, with ``ActConfig(channel_scale=True)`` (the default) against plain groups.

The model is the packaged pretrained all-MiniLM-L6-v2 with a fresh 2-class head, in training mode with dropout
set to 0 (so the only randomness is act_hf's rounding), fp32, on the first ``--batch`` rows of a GLUE task at
sequence length ``--seq``. Two measurements per bit width:

* **hidden states**: ``|Q(h) - h| / |h|`` for the input of every encoder layer (what a packed gradient
  checkpoint keeps, and what the Q/K/V projections read), mean over layers and ``--draws`` draws;
* **gradient**: ``E|g_hat - g|^2 / |g|^2`` over ``--draws`` training steps of the patched model, where ``g``
  is the exact gradient of all non-embedding parameters. act_hf's estimate is unbiased, so this is the
  variance it adds, relative to the gradient's own size.

``--what contexts`` measures instead, for each kind of saved tensor in layer 2 (norm output and input, q, k,
v, attention context, GELU output), the squared quantization error with channel scaling over that without:
below 1 where scaling helps. act_hf scales only the norm outputs (and checkpoint inputs) for this reason.

    python benchmarks/benchmark_channel_scale.py --bits 2 3 4 --draws 6
    python benchmarks/benchmark_channel_scale.py --what contexts --name channel_scale_contexts

Writes ``channel_scale.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from benchmark_adapt_cost import _glue_batch, _minilm
from benchmark_saved_memory import _meta, pyplot

import act_hf
from act_hf.compress import dequantize, quantize

ROOT = Path(__file__).resolve().parents[1]


def _gradient(model, batch: dict) -> torch.Tensor:
    model.zero_grad()
    model(**batch).loss.backward()
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters()
                      if p.grad is not None and "embeddings" not in n])


def hidden_state_error(hidden: list[torch.Tensor], bits: int, channel_scale: bool, draws: int) -> float:
    """Mean relative error ``|Q(h) - h| / |h|`` over the layer inputs ``hidden`` and ``draws`` seeds."""
    errors = [((dequantize(quantize(h, bits, 256, seed=s, channel_scale=channel_scale)) - h).norm() / h.norm()).item()
              for h in hidden for s in range(draws)]
    return sum(errors) / len(errors)


def measure(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    model = _minilm().train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batch = _glue_batch(args.glue_task, args.batch, args.seq)
    with torch.no_grad():
        hidden = list(model.bert(**{k: v for k, v in batch.items() if k != "labels"},
                                 output_hidden_states=True).hidden_states[:-1])
    exact = _gradient(model, batch)
    rows = []
    for bits in args.bits:
        row = {"bits": bits}
        for channel_scale in (False, True):
            name = "scaled" if channel_scale else "plain"
            act_hf.patch(model, bits=bits, channel_scale=channel_scale, variance_alarm=0)
            act_hf.manual_seed(0)
            errors = [((_gradient(model, batch) - exact).norm() ** 2 / exact.norm() ** 2).item()
                      for _ in range(args.draws)]
            act_hf.unpatch(model)
            row[f"gradient_{name}"] = sum(errors) / len(errors)
            row[f"hidden_{name}"] = hidden_state_error(hidden, bits, channel_scale, args.draws)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def context_errors(args: argparse.Namespace) -> list[dict]:
    """Squared quantization error, channel scaled over plain, of each kind of saved tensor in layer 2."""
    model = _minilm().eval()
    batch = _glue_batch(args.glue_task, args.batch, args.seq)
    layer, seen = model.bert.encoder.layer[2], {}
    heads = model.config.num_attention_heads

    def keep(name, pick):
        return lambda module, inputs, output: seen.__setitem__(name, pick(inputs, output).detach())

    def split_heads(t):
        return t.view(*t.shape[:2], heads, -1).transpose(1, 2)

    hooks = [layer.attention.output.LayerNorm.register_forward_hook(keep("norm output", lambda i, o: o)),
             layer.output.LayerNorm.register_forward_hook(keep("norm input", lambda i, o: i[0])),
             layer.attention.output.dense.register_forward_hook(keep("attention context", lambda i, o: i[0])),
             layer.output.dense.register_forward_hook(keep("GELU output", lambda i, o: i[0]))]
    hooks += [getattr(layer.attention.self, n).register_forward_hook(keep(n[0], lambda i, o: split_heads(o)))
              for n in ("query", "key", "value")]
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "labels"})
    for h in hooks:
        h.remove()

    def error(x, bits, channel_scale):
        return sum(((dequantize(quantize(x, bits, 256, seed=s, channel_scale=channel_scale)) - x) ** 2).sum().item()
                   for s in range(args.draws))

    rows = [{"context": name, **{f"ratio_{b}bit": error(x, b, True) / error(x, b, False) for b in args.bits}}
            for name, x in seen.items()]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def context_table(rows: list[dict], bits: list[int]) -> str:
    lines = ["| saved tensor | " + " | ".join(f"error scaled / plain, {b} bits" for b in bits) + " |",
             "|---" * (len(bits) + 1) + "|"]
    lines += [f"| {r['context']} | " + " | ".join(f"{r[f'ratio_{b}bit']:.2f}" for b in bits) + " |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| bits | hidden-state error, plain | scaled | gradient variance / \\|g\\|^2, plain | scaled | "
             "variance reduction |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bits']} | {r['hidden_plain']:.3f} | {r['hidden_scaled']:.3f} | "
                     f"{r['gradient_plain']:.4g} | {r['gradient_scaled']:.4g} | "
                     f"{r['gradient_plain'] / r['gradient_scaled']:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--draws", type=int, default=6, help="rounding draws per setting")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--glue-task", default="SST-2", choices=["SST-2", "RTE", "MRPC"])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="channel_scale", help="file name stem of the results")
    p.add_argument("--what", choices=["model", "contexts"], default="model",
                   help="model: hidden states and gradient (default); contexts: error ratio per kind of tensor")
    args = p.parse_args(argv)
    rows = measure(args) if args.what == "model" else context_errors(args)
    meta = {**_meta(torch.device("cpu")), "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    header = (f"MiniLM (pretrained), {args.glue_task} batch {args.batch} x {args.seq}, fp32, {args.draws} draws; "
              f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, commit {meta['commit']}")
    text = table(rows) if args.what == "model" else context_table(rows, args.bits)
    (args.out / f"{args.name}.md").write_text(header + "\n\n" + text + "\n")
    print(text)
    if args.what == "contexts":
        return rows
    plt = pyplot()
    if plt is None:
        return rows
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, style in (("plain", "o--"), ("scaled", "o-")):
        ax.plot([r["bits"] for r in rows], [r[f"gradient_{name}"] for r in rows], style,
                label=f"{name} groups" if name == "plain" else "channel scaled")
    ax.set_yscale("log")
    ax.set_xlabel("bits")
    ax.set_ylabel("added gradient variance / |g|^2 (log)")
    ax.set_title("MiniLM: variance act_hf adds to the gradient")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / f"{args.name}.png", dpi=120)
    return rows


if __name__ == "__main__":
    main()
