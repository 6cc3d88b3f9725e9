"""Saved activation memory per sample: unpatched fp32 and bf16 against act_hf at several bit widths.

The analogue of ActNN's Table 5, measured with :func:`act_hf.track_saved` (unique storages saved for
backward during one training-mode forward, parameters excluded, packed payloads at packed size), on CPU or
GPU. Models are built from their standard configs with random weights (attention-probability dropout off,
see ``MODELS``) (bert-base, bert-large, roberta-base, gpt2, a LLaMA-style decoder, Phi-3-, Mixtral-, Granite-,
Cohere- and Gemma-2-style decoders on the generic fallback, and timm's vit-base, swin-tiny, convnext-tiny,
convnextv2-tiny, resnet50, and the mobile nets efficientnet-b0, tf-efficientnet-b0, mobilenetv3-large, regnety-016,
mobilenetv2-100);
text at sequence length 128, images at 224x224. act_hf
runs under bf16 autocast, so its ratio is against the bf16 baseline. A
fractional ``--bits`` value is an adaptive average budget (default columns: 1, 2, 3, 4, 8 bits and adaptive 2.5).

    python benchmarks/benchmark_saved_memory.py [--models bert-base swin-tiny] [--bits 1 2 3 4 8 2.5] [--batch 2]

Writes ``saved_memory.json``, ``saved_memory.md`` and ``saved_memory.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import act_hf


def _hf(config_name: str, model_name: str, **kwargs):
    def build(**overrides):
        """The model, with ``overrides`` of the config's keyword arguments."""
        import transformers as tf

        return getattr(tf, model_name)(getattr(tf, config_name)(**(kwargs | overrides))), "text"

    return build


def _timm(name: str):
    def build():
        import timm

        return timm.create_model(name, pretrained=False), "image"

    return build


#: the LLaMA-style decoder's sizes, shared by the decoders measured beside it
_LLAMA_SIZES = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
                "num_key_value_heads": 4}

# Attention-probability dropout is off in the HF configs: with it, CPU SDPA takes its math path and saves the
# S x S probabilities, which GPU fused kernels never store; without it the CPU baseline matches the GPU one
# (bert-base bf16: 50.4 MiB/sample here, 47.8 MiB measured on an H100), so the ratios are not inflated.
MODELS = {
    "bert-base": _hf("BertConfig", "BertForSequenceClassification", attention_probs_dropout_prob=0.0),
    "bert-large": _hf("BertConfig", "BertForSequenceClassification", hidden_size=1024, num_hidden_layers=24,
                      num_attention_heads=16, intermediate_size=4096, attention_probs_dropout_prob=0.0),
    "roberta-base": _hf("RobertaConfig", "RobertaForSequenceClassification", attention_probs_dropout_prob=0.0),
    "gpt2": _hf("GPT2Config", "GPT2LMHeadModel", attn_pdrop=0.0),
    "llama-style": _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA_SIZES, vocab_size=32000),
    # HF causal LMs without an act_hf family, on the generic fallback: the llama-style sizes
    "phi3-style": _hf("Phi3Config", "Phi3ForCausalLM", **_LLAMA_SIZES, vocab_size=32064, pad_token_id=0),
    "mixtral-style": _hf("MixtralConfig", "MixtralForCausalLM", **(_LLAMA_SIZES | {"num_hidden_layers": 4}),
                         vocab_size=32000, num_local_experts=4, num_experts_per_tok=2),
    # ... and ones that scale (Granite, Cohere) or soft-cap (Gemma 2) the head's output, at their vocabularies
    "granite-style": _hf("GraniteConfig", "GraniteForCausalLM", **_LLAMA_SIZES, vocab_size=49155, logits_scaling=8.0,
                         pad_token_id=0),
    "cohere-style": _hf("CohereConfig", "CohereForCausalLM", **_LLAMA_SIZES, vocab_size=256000, logit_scale=0.0625,
                        pad_token_id=0),
    "gemma2-style": _hf("Gemma2Config", "Gemma2ForCausalLM", **_LLAMA_SIZES, head_dim=64, vocab_size=256000,
                        pad_token_id=0),
    # OPT-125m (the config's defaults) on the fallback: dropout 0.1 called as a function after attention and MLP
    "opt-125m": _hf("OPTConfig", "OPTForCausalLM"),
    # language models that compute their own loss (every position labelled): a masked LM, T5, BART (fallback)
    "bert-base-mlm": _hf("BertConfig", "BertForMaskedLM", attention_probs_dropout_prob=0.0),
    "t5-small": _hf("T5Config", "T5ForConditionalGeneration", decoder_start_token_id=0, pad_token_id=0),
    # flan-T5's gated-GELU feed-forward (T5 v1.1 sizes: untied head, wider d_ff, 6 heads of 64)
    "flan-t5-small": _hf("T5Config", "T5ForConditionalGeneration", d_ff=1024, num_layers=8, num_heads=6,
                         feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                         pad_token_id=0),
    "bart-base": _hf("BartConfig", "BartForConditionalGeneration"),
    "vit-base": _timm("vit_base_patch16_224"),
    "swin-tiny": _timm("swin_tiny_patch4_window7_224"),
    "convnext-tiny": _timm("convnext_tiny"),
    "convnextv2-tiny": _timm("convnextv2_tiny"),
    "resnet50": _timm("resnet50"),
    # mobile conv nets: squeeze-and-excitation before a conv, TF's SAME padding (tf_), a ReLU before the SE (RegNetY)
    "efficientnet-b0": _timm("efficientnet_b0"),
    "tf-efficientnet-b0": _timm("tf_efficientnet_b0"),
    "mobilenetv3-large": _timm("mobilenetv3_large_100"),
    "regnety-016": _timm("regnety_016"),
    "mobilenetv2-100": _timm("mobilenetv2_100"),  # ReLU6 after BatchNorm before the depthwise and project convs
}


def make_inputs(kind: str, model, batch: int, seq: int, device, image_size: int = 224) -> dict[str, torch.Tensor]:
    """A fixed random batch: ``{"x"}`` images for timm models; token ids and labels (the ids for a language model:
    causal, masked or seq2seq; zeros for a classifier) for HF ones."""
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return {"x": torch.randn(batch, 3, image_size, image_size, generator=g).to(device)}
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    out = {"input_ids": ids}
    language_model = any(kind in type(model).__name__ for kind in ("CausalLM", "LMHead", "MaskedLM", "Generation"))
    out["labels"] = ids if language_model else torch.zeros(batch, dtype=torch.long, device=device)
    return out


def saved_bytes(model, kind: str, inputs, dtype: torch.dtype | None) -> int:
    model.train()
    autocast = torch.autocast(inputs[next(iter(inputs))].device.type, dtype=dtype, enabled=dtype is not None)
    with autocast, act_hf.track_saved(model) as saved:
        out = model(inputs["x"]) if kind == "image" else model(**inputs).loss
    del out
    return saved.bytes


def _label(bits: float) -> str:
    return f"act_hf {int(bits)}-bit" if float(bits).is_integer() else f"act_hf adaptive {bits:g}"


def _allocate(model, kind: str, inputs) -> None:
    """Run the adaptive allocator's sensitivity probe on the benchmark batch: under bf16 autocast on a GPU, in
    fp32 on a CPU (CPU bf16 matmuls are up to 200x slower than fp32 here; the probe only ranks slots)."""
    allocator = model.act_hf_allocator
    allocator.automatic = False
    device_type = inputs[next(iter(inputs))].device.type
    if kind == "image":
        loss = lambda b: torch.nn.functional.cross_entropy(model(b["x"]).float(),  # noqa: E731
                                                           torch.zeros(len(b["x"]), dtype=torch.long, device=b["x"].device))
    else:
        loss = lambda b: model(**b).loss  # noqa: E731
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
        allocator.update_batch(inputs, loss)


def measure_model(name: str, bits_list: list[float], batch: int, seq: int, device: torch.device) -> dict:
    """Per-sample saved MiB of one model: unpatched fp32 and bf16, and act_hf at each bit width.

    A fractional width is an adaptive budget: the allocator probes the benchmark batch first, then the
    forward is measured with the widths it chose (``avg_bits`` records their element-weighted mean)."""
    torch.manual_seed(0)
    base, kind = MODELS[name]()
    base.to(device)
    inputs = make_inputs(kind, base, batch, seq, device)
    row = {"model": name, "per_sample_mib": {}}
    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        row["per_sample_mib"][label] = saved_bytes(base, kind, inputs, dtype) / batch / 2**20
    for bits in bits_list:
        model = act_hf.patch(copy.deepcopy(base), bits=int(bits) if float(bits).is_integer() else bits)
        if not float(bits).is_integer():
            _allocate(model, kind, inputs)
            row.setdefault("avg_bits", {})[_label(bits)] = model.act_hf_allocator.average_bits()
        row["per_sample_mib"][_label(bits)] = saved_bytes(model, kind, inputs, torch.bfloat16) / batch / 2**20
        del model
        gc.collect()
    bf16 = row["per_sample_mib"]["bf16"]
    row["ratio_vs_bf16"] = {k: bf16 / v for k, v in row["per_sample_mib"].items() if k.startswith("act_hf")}
    return row


def _meta(device) -> dict:
    import timm
    import transformers

    try:  # "-dirty" when the tree differs from its commit (a device machine's copy of .git can lag the files)
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                                text=True, cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    except OSError:
        commit = ""
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "transformers": transformers.__version__, "timm": timm.__version__,
        "act_hf": act_hf.__version__, "commit": commit, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "act_hf_slicing": os.environ.get("ACT_HF_SLICING") or "auto",  # when ops slice the batch (README, Ops)
    }


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` after saying so when the ``bench`` extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install act-hf[bench])")
        return None
    return plt


def save_log_plot(fig, ax, path: Path) -> None:
    """Finish a per-sample memory plot (log y axis in MiB per sample, legend) and save it at 120 dpi."""
    ax.set_yscale("log")
    ax.set_ylabel("MiB per sample (log)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--bits", type=float, nargs="+", default=[1, 2, 3, 4, 8, 2.5],
                        help="bit widths; a fractional one is an adaptive budget (default: 1 2 3 4 8 2.5)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--merge", action="store_true",
                        help="re-measure only --models and keep the other rows of the existing saved_memory.json "
                             "(each row records the commit it was measured at)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one model, print its row as JSON
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.one:
        print(json.dumps(measure_model(args.one, args.bits, args.batch, args.seq, device)))
        return 0

    meta = _meta(device) | {"batch": args.batch, "seq": args.seq, "image": 224}
    rows = []
    for name in args.models:  # one subprocess per model: memory is returned, and a failure stays contained
        cmd = [sys.executable, __file__, "--one", name, "--batch", str(args.batch), "--seq", str(args.seq),
               "--device", args.device, "--bits", *(f"{b:g}" for b in args.bits)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1]) | {"commit": meta["commit"]}
        rows.append(row)
        print(name, {k: round(v, 2) for k, v in row["per_sample_mib"].items()},
              {k: round(v, 2) for k, v in row["ratio_vs_bf16"].items()}, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    previous = args.out / "saved_memory.json"
    if args.merge and previous.exists():
        old = json.loads(previous.read_text())
        if (old["meta"]["batch"], old["meta"]["seq"], old["meta"]["device"]) != (args.batch, args.seq, meta["device"]):
            parser.error("--merge: the existing results were measured with another batch, seq or device")
        if rows and list(old["rows"][0]["per_sample_mib"]) != list(rows[0]["per_sample_mib"]):
            parser.error("--merge: the existing results have other columns (give the same --bits)")
        fresh = {r["model"]: r for r in rows}
        rows = [fresh.pop(r["model"], r | {"commit": r.get("commit", old["meta"]["commit"])}) for r in old["rows"]]
        rows += list(fresh.values())
    (args.out / "saved_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    cols = list(rows[0]["per_sample_mib"])
    lines = [
        f"Saved activations per sample (MiB), training-mode forward; text seq {args.seq}, images 224x224; "
        f"act_hf under bf16 autocast, ratio against unpatched bf16; 'adaptive b' is the average budget b, "
        f"allocated by one sensitivity probe on the same batch ({'bf16' if device.type == 'cuda' else 'fp32'}). "
        f"Batch {args.batch}. {meta['device']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, timm {meta['timm']}, act_hf {meta['act_hf']} @ {meta['commit']}.",
        "",
        "| model | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for r in rows:
        cells = [f"{r['per_sample_mib'][c]:.2f}" + (f" ({r['ratio_vs_bf16'][c]:.1f}x)" if c in r["ratio_vs_bf16"] else "")
                 for c in cols]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    others = [f"{r['model']} @ {r['commit']}" for r in rows if r.get("commit", meta["commit"]) != meta["commit"]]
    if others:
        lines += ["", f"Rows measured at an earlier commit (kept by --merge): {', '.join(others)}."]
    (args.out / "saved_memory.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(9, 4))
        keys = [k for k in cols if k.startswith("act_hf")]
        width = 0.8 / len(keys)
        for i, k in enumerate(keys):
            ax.bar([j + i * width for j in range(len(rows))], [r["ratio_vs_bf16"][k] for r in rows], width, label=k)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["model"] for r in rows], rotation=30)
        ax.set_ylabel("saved-activation reduction vs bf16 (x)")
        ax.axhline(5, color="gray", lw=0.8, ls="--")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out / "saved_memory.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
