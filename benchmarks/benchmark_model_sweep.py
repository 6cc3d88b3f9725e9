"""Does act_hf train models it has no family for like the originals? Tiny random-init models, one step each.

For each model: build it from a small config (random weights, train mode), deep-copy it, ``act_hf.patch`` the
copy at ``--bits`` (8 by default: every difference left is act_hf's, not the width's), run one forward and
backward on both with the same seeds, and record whether the losses are bit-equal, whether the floating buffers
(BatchNorm's running statistics) are bit-equal after the step, the relative error of the whole parameter
gradient, the worst cosine among parameters carrying >= 1% of the gradient norm, and the verdict of the tests'
criterion (:func:`tests.utils.assert_grads_match`: each parameter's gradient at cosine >= 0.999 or within 1e-3 of
the whole gradient's norm). Models with an act_hf family are here too when they are not in the tests' own cases,
and convolutional nets of timm and torchvision whose BatchNorms write into their conv's output; a model that fails
to build or run is listed with its error.

With ``--autocast`` both steps run under bf16 autocast, and two more errors say how much of the difference is
bf16's own: the unpatched bf16 step's whole-gradient error against an unpatched fp32 step, and the patched bf16
step's against the same fp32 step (the tests' criterion, made for fp32, flags bf16's noise on some stems).

    python benchmarks/benchmark_model_sweep.py                    # every model, 8 bits (about 10 min on 2 cores)
    python benchmarks/benchmark_model_sweep.py --models bart cspdarknet53 --bits 4
    python benchmarks/benchmark_model_sweep.py --autocast --name model_sweep_bf16

Writes ``model_sweep.json`` and ``model_sweep.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import act_hf
from tests.utils import assert_grads_match, relative_error  # the tests' criterion, not a copy of it

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_saved_memory import _meta, pyplot

_TEXT = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}


def _ids(vocab=100, batch=2, seq=16):
    return torch.randint(3, vocab, (batch, seq))


def _pixels(size=32):
    return torch.randn(2, 3, size, size)


def _hf_cases() -> dict[str, tuple[Callable, Callable]]:
    """name -> (build, inputs): transformers models from small configs."""
    import transformers as tf

    two = lambda: torch.tensor([0, 1])
    text_and_image = {"text_config": dict(vocab_size=100, num_hidden_layers=2, max_position_embeddings=32, **_TEXT),
                      "vision_config": dict(image_size=32, patch_size=8, num_hidden_layers=2, **_TEXT)}
    seq2seq = {"vocab_size": 100, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
               "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
               "decoder_ffn_dim": 128}
    return {
        "bart": (lambda: tf.BartForConditionalGeneration(tf.BartConfig(max_position_embeddings=64, **seq2seq)),
                 lambda: {"input_ids": _ids(), "labels": _ids()}),
        "electra": (lambda: tf.ElectraForSequenceClassification(tf.ElectraConfig(
            vocab_size=100, embedding_size=32, num_hidden_layers=2, **_TEXT)),
            lambda: {"input_ids": _ids(), "labels": two()}),
        "gptj": (lambda: tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=100, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                                         n_positions=64)),
                 lambda: {"input_ids": _ids(), "labels": _ids()}),
        "whisper": (lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
            num_mel_bins=16, max_source_positions=16, max_target_positions=32, decoder_start_token_id=1,
            pad_token_id=0, **seq2seq)),
            lambda: {"input_features": torch.randn(2, 16, 32), "labels": _ids(seq=8)}),
        "wav2vec2": (lambda: tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
            vocab_size=32, num_hidden_layers=2, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0, **_TEXT)),
            lambda: {"input_values": torch.randn(2, 800), "labels": two()}),
        "clip": (lambda: tf.CLIPModel(tf.CLIPConfig(projection_dim=32, **text_and_image)),
                 lambda: {"input_ids": _ids(), "pixel_values": _pixels(), "return_loss": True}),
        "siglip": (lambda: tf.SiglipModel(tf.SiglipConfig(**text_and_image)),
                   lambda: {"input_ids": _ids(), "pixel_values": _pixels(), "return_loss": True}),
        "swinv2": (lambda: tf.Swinv2ForImageClassification(tf.Swinv2Config(
            image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3)),
            lambda: {"pixel_values": _pixels(), "labels": torch.tensor([0, 2])}),
        "segformer": (lambda: tf.SegformerForSemanticSegmentation(tf.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
            decoder_hidden_size=32, num_labels=3)),
            lambda: {"pixel_values": _pixels(), "labels": torch.randint(0, 3, (2, 32, 32))}),
        "vitmae": (lambda: tf.ViTMAEForPreTraining(tf.ViTMAEConfig(
            image_size=32, patch_size=8, num_hidden_layers=2, decoder_num_hidden_layers=1, decoder_hidden_size=32,
            decoder_intermediate_size=64, decoder_num_attention_heads=2, mask_ratio=0.5, **_TEXT)),
            lambda: {"pixel_values": _pixels()}),
        "mamba": (lambda: tf.MambaForCausalLM(tf.MambaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                                                              state_size=8, expand=2)),
                  lambda: {"input_ids": _ids(), "labels": _ids()}),
        "deberta-v2": (lambda: tf.DebertaV2ForSequenceClassification(tf.DebertaV2Config(
            vocab_size=100, num_hidden_layers=2, max_position_embeddings=64, relative_attention=True,
            pos_att_type=["p2c", "c2p"], **_TEXT)),
            lambda: {"input_ids": _ids(), "labels": two()}),
        "dinov2": (lambda: tf.Dinov2ForImageClassification(tf.Dinov2Config(
            image_size=32, patch_size=8, num_hidden_layers=2, num_labels=3, **_TEXT)),
            lambda: {"pixel_values": _pixels(), "labels": torch.tensor([0, 2])}),
        "mobilenet_v2": (lambda: tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(
            depth_multiplier=0.35, image_size=32, num_labels=3)),
            lambda: {"pixel_values": _pixels(), "labels": torch.tensor([0, 2])}),
        "yolos": (lambda: tf.YolosModel(tf.YolosConfig(image_size=[32, 32], patch_size=8, num_hidden_layers=2,
                                                       num_detection_tokens=4, **_TEXT)),
                  lambda: {"pixel_values": _pixels()}),
    }


#: timm models by name, with the image size they need (the rest take 64 x 64): the first rows have no family or
#: one the tests do not cover; from ``resnet18`` on, BatchNorm nets of many kinds of block, many of them blocks that
#: hand each BatchNorm its conv's output to write into (``act_hf.nn.norm.norm_of_owned``).
TIMM_MODELS = {
    "maxvit_nano_rw_256": 256, "coatnet_nano_rw_224": 224, "efficientnet_b0": 64, "resnext26ts": 64,
    "regnety_002": 64, "resnetv2_50x1_bit": 64, "swinv2_cr_tiny_ns_224": 224, "poolformer_s12": 64, "mobilevitv2_050": 64,
    "ghostnet_050": 64, "convmixer_768_32": 64, "nfnet_f0": 64, "dla34": 64, "repvgg_a0": 64, "cspdarknet53": 64,
    "cspresnet50": 64, "darknet53": 64, "cspresnext50": 64, "edgenext_xx_small": 64, "fastvit_t8": 224,
    "mobileone_s0": 64, "hgnetv2_b0": 64, "tiny_vit_5m_224": 224, "rdnet_tiny": 64, "efficientformerv2_s0": 224,
    "inception_next_atto": 64, "mambaout_femto": 64, "starnet_s050": 64, "efficientvit_b0": 128,
    "mobilenetv3_small_050": 128, "hiera_tiny_224": 224, "mobilenetv2_050": 64,
    "resnet18": 64, "resnet50d": 64, "seresnext26d_32x4d": 64, "resnest14d": 64, "res2net50_14w_8s": 64,
    "regnetx_002": 64, "regnetz_b16": 64, "dpn48b": 64, "densenet121": 64, "hrnet_w18_small": 64,
    "selecsls42b": 64, "vgg11_bn": 64, "repvit_m0_9": 64, "mixnet_s": 64, "efficientnetv2_rw_t": 64,
    "lcnet_050": 64, "mobilenetv4_conv_small": 64, "rexnet_100": 64, "tf_efficientnet_b0": 64, "xception41": 64,
    "gernet_s": 64, "ese_vovnet19b_dw": 64, "tresnet_m": 64, "mobilenetv3_large_100": 64, "mnasnet_050": 64,
    "halonet26t": 256, "lambda_resnet26t": 256,
}

#: torchvision models as ``tv_<name>`` (``torchvision.models.<name>(num_classes=5)``), with their image sizes:
#: act_hf's rules for torchvision's ResNet blocks (``patches/torchvision_models.py``) and the generic path's others.
TORCHVISION_MODELS = {
    "tv_resnet18": 64, "tv_resnet50": 64, "tv_resnext50_32x4d": 64, "tv_mobilenet_v3_small": 64,
    "tv_efficientnet_b0": 64, "tv_regnet_y_400mf": 64, "tv_densenet121": 64, "tv_shufflenet_v2_x0_5": 64,
    "tv_mnasnet0_5": 64,
}


def _hf_loss(model, inputs):
    out = model(**inputs)
    if getattr(out, "loss", None) is not None:
        return out.loss
    h = out[0].float()  # no loss head: a fixed nonlinear read-out of the last hidden state
    return (h @ torch.linspace(-1, 1, h.shape[-1], device=h.device)).sin().mean()


def _timm_loss(model, inputs):
    x, labels = inputs
    return torch.nn.functional.cross_entropy(model(x).float(), labels)  # bf16 logits under autocast


def _to(inputs, device: torch.device):
    if isinstance(inputs, dict):
        return {k: _to(v, device) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(_to(v, device) for v in inputs)
    return inputs.to(device) if isinstance(inputs, torch.Tensor) else inputs


def _build(name: str) -> tuple[Callable, Callable, Callable]:
    """``(build, inputs, loss_of)`` of a sweep model."""
    hf = _hf_cases()
    if name in hf:
        build, make_inputs = hf[name]
        return build, make_inputs, _hf_loss
    if name in TORCHVISION_MODELS:
        import torchvision

        size = TORCHVISION_MODELS[name]
        build = lambda: getattr(torchvision.models, name.removeprefix("tv_"))(num_classes=5)
    else:
        import timm

        size = TIMM_MODELS[name]
        build = lambda: timm.create_model(name, pretrained=False, num_classes=5)
    return build, lambda: (torch.randn(2, 3, size, size), torch.tensor([0, 3])), _timm_loss


def _step(model, loss_of, inputs, autocast: bool, device: torch.device | str) -> torch.Tensor:
    """One forward and backward (``torch.manual_seed(2)`` first: dropout, layer drop and masking draw alike)."""
    torch.manual_seed(2)
    with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=autocast):
        loss = loss_of(model, inputs)
    loss.backward()
    return loss


def _grads(model) -> list[torch.Tensor | None]:
    return [p.grad for p in model.parameters()]


def _whole_error(got: list[torch.Tensor | None], exact: list[torch.Tensor | None]) -> float:
    pairs = [(a, b) for a, b in zip(got, exact) if a is not None and b is not None]
    return relative_error([a for a, _ in pairs], [b for _, b in pairs])


def measure(name: str, bits: float, device: torch.device | str = "cpu", autocast: bool = False) -> dict:
    """One model: loss and buffer equality, whole-gradient relative error, worst cosine, the tests' verdict; with
    ``autocast``, under bf16 autocast, and the two errors against an unpatched fp32 step (module docstring). On a
    GPU the unpatched and patched steps may differ by the kernels' own nondeterminism too (atomics in backward)."""
    build, make_inputs, loss_of = _build(name)
    torch.manual_seed(0)
    ref = build().to(device).train()
    fp32 = copy.deepcopy(ref) if autocast else None
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        act_hf.patch(model, bits=bits)
    family = not any("has no family" in str(w.message) for w in caught)
    torch.manual_seed(1)
    inputs = _to(make_inputs(), device)
    act_hf.manual_seed(0)  # act_hf's rounding draws: the same figures on every run
    losses = [_step(m, loss_of, inputs, autocast, device) for m in (ref, model)]
    buffers = [(a, b) for a, b in zip(ref.buffers(), model.buffers()) if a.is_floating_point()]
    error = _whole_error(_grads(model), _grads(ref))
    floor = {}
    if fp32 is not None:
        _step(fp32, loss_of, inputs, False, device)
        floor = {"unpatched_bf16_vs_fp32": _whole_error(_grads(ref), _grads(fp32)),
                 "patched_bf16_vs_fp32": _whole_error(_grads(model), _grads(fp32))}
    try:
        worst = assert_grads_match(ref, model, name=name)
        verdict = "pass"
    except AssertionError as e:
        worst, verdict = float("nan"), f"outside: {e}"
    return {"model": name, "family": family, "adaptive": getattr(model, "act_hf_allocator", None) is not None,
            "loss_equal": bool(torch.equal(*losses)), "buffers_equal": all(torch.equal(a, b) for a, b in buffers),
            "relative_error": error, "worst_cosine": worst, "verdict": verdict, **floor}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [*_hf_cases(), *TIMM_MODELS, *TORCHVISION_MODELS]
    p.add_argument("--models", nargs="+", default=names, choices=names, metavar="MODEL",
                   help=f"models to check (default: all): {', '.join(names)}")
    p.add_argument("--bits", type=lambda b: int(b) if float(b).is_integer() else float(b), default=8,
                   help="a whole number is a fixed width; a fraction is an adaptive budget (default 8)")
    p.add_argument("--device", type=torch.device, default=torch.device("cpu"), help="cpu (default) or cuda")
    p.add_argument("--autocast", action="store_true",
                   help="both steps under bf16 autocast, with bf16's own error beside act_hf's (module docstring)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="model_sweep", help="file name of the results, without extension")
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        try:
            rows.append(measure(name, args.bits, args.device, args.autocast))
        except Exception as e:  # noqa: BLE001 -- a model that cannot be built or run is a result too
            traceback.print_exc(limit=2)
            rows.append({"model": name, "verdict": f"error: {type(e).__name__}: {str(e)[:200]}"})
        r = rows[-1]
        print(f"{name}: {r['verdict'][:160]}" + (f" (relative error {r['relative_error']:.4f})"
                                                  if "relative_error" in r else ""), flush=True)
    meta = _meta(args.device) | {"threads": torch.get_num_threads(), "bits": args.bits, "autocast": args.autocast}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    precision = "both under bf16 autocast" if args.autocast else "fp32"
    lines = [(f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, timm {meta['timm']}; "
              f"act_hf.patch(bits={args.bits:g}) against the unpatched model, one step, tiny random-init configs, "
              f"{precision}"), "",
             "| model | act_hf family | loss bit-equal | buffers bit-equal | gradient relative error | worst cosine | "
             "tests' criterion |" + (" unpatched bf16 vs fp32 | act_hf bf16 vs fp32 |" if args.autocast else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if args.autocast else "")]
    for r in rows:
        if "relative_error" not in r:
            lines.append(f"| {r['model']} | | | | | | {r['verdict']} |" + (" | |" if args.autocast else ""))
            continue
        verdict = r["verdict"].replace("|", "/").replace("\n", " ")
        line = (f"| {r['model']} | {'yes' if r['family'] else 'no (fallback)'} | {r['loss_equal']} | "
                f"{r['buffers_equal']} | {r['relative_error']:.4f} | {r['worst_cosine']:.5f} | {verdict} |")
        if args.autocast:
            line += f" {r['unpatched_bf16_vs_fp32']:.4f} | {r['patched_bf16_vs_fp32']:.4f} |"
        lines.append(line)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args.bits, args.out / f"{args.name}.png")
    return rows


def plot(rows: list[dict], bits: float, path: Path) -> None:
    """Each model's gradient relative error against the unpatched model (models that failed marked at 0)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows)), 4))
    ok = ["relative_error" in r for r in rows]
    ax.bar(range(len(rows)), [r.get("relative_error", 0.0) for r in rows],
           color=["tab:blue" if good else "tab:red" for good in ok])
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel(f"gradient relative error at {bits:g} bits (red: no result)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
