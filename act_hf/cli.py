"""The ``act-hf`` console command."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _build_ext(args: argparse.Namespace) -> int:
    import os

    from . import _ext

    if args.arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = args.arch
    module = _ext.build(verbose=args.verbose)
    print(f"built {module.__name__} from {_ext.CSRC_DIR} (TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')})")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from .errors import ActHFError
    from .estimate import estimate

    try:
        est = estimate(args.model, batch=args.batch, seq=args.seq, bits=args.bits, gpu_mem=args.gpu_mem,
                       dtype=args.dtype, device=args.device, optimizer=args.optimizer, task=args.task,
                       img_size=args.img_size, margin=args.margin, transient_factor=args.transient_factor,
                       local_files_only=args.offline,
                       checkpointing=args.checkpointing or args.checkpoint_bits is not None,
                       checkpoint_bits=args.checkpoint_bits)
    except ActHFError as e:
        print(f"act-hf estimate: error: {e}", file=sys.stderr)
        return 2
    print(est.to_json() if args.json else est.table())
    return 0


def _bits_arg(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 1..8 or a budget such as 2.5, got {text!r}") from None
    if not 1 <= value <= 8:
        raise argparse.ArgumentTypeError(f"must be in [1, 8], got {text}")
    return int(value) if value.is_integer() else value


def _size_arg(name: str):
    def parse(text: str) -> int:
        from .estimate import parse_size

        try:
            return parse_size(text, name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{name}: ")) from None

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="act-hf", description="act_hf: compressed activations for training")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build-ext", help="compile the CUDA extension now (no GPU needed) and cache it")
    p.add_argument("--arch", help='TORCH_CUDA_ARCH_LIST to build for, e.g. "8.0;9.0" (default: the visible GPU, '
                   'else "8.0;9.0+PTX")')
    p.add_argument("--verbose", action="store_true", help="show the compiler commands")
    p.set_defaults(func=_build_ext)

    from .estimate import TASKS

    p = sub.add_parser(
        "estimate", help="project training memory and the largest batch under a memory cap, with and without act_hf",
        description="Build MODEL with random weights (a folder with config.json, a timm model name, "
        "torchvision:NAME for a torchvision classification model, or a hub id), "
        "measure saved activations unpatched and patched at --bits, and project peak training memory (params + "
        "grads + optimizer states + saved activations + transients). The projection is a model of memory "
        "calibrated against measured saved bytes, not a measured peak.")
    p.add_argument("model", help="HF model folder (with config.json), timm model name, torchvision:NAME (e.g. "
                                 "torchvision:resnet50), or HF hub id (config only)")
    p.add_argument("--batch", type=int, required=True, help="batch size to project for")
    p.add_argument("--seq", type=int, default=128, help="sequence length for text models (default 128)")
    p.add_argument("--bits", type=_bits_arg, default=3, metavar="{1..8 | budget}",
                   help="act_hf bits: an int 1..8, or a fractional average budget such as 2.5 for adaptive bits "
                        "(default 3)")
    p.add_argument("--gpu-mem", type=_size_arg("--gpu-mem"), default=None,
                   help="memory PyTorch may allocate, e.g. 16GiB, 80GB, 24000MiB: also project the largest batch")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="bf16 autocast over fp32 weights (default) or fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where to measure saved activations (default: cuda if available, else cpu)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="adamw: 2 fp32 states per parameter (default); sgd: momentum, 1 state")
    p.add_argument("--task", choices=sorted(TASKS), default=None, help="override the detected task (HF models)")
    p.add_argument("--img-size", type=int, default=None,
                   help="image side for vision models (default: the model's own, 224 for most)")
    p.add_argument("--margin", type=float, default=0.05,
                   help="the unpatched column's transients as a fraction of its saved activations (default 0.05)")
    p.add_argument("--transient-factor", type=float, default=None,
                   help="the act_hf column's transients in units of the largest activation the unpatched model "
                        "saves (default 2.5, with --checkpointing too)")
    p.add_argument("--offline", action="store_true", help="never contact the Hugging Face hub")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--checkpointing", action="store_true",
                   help="HF gradient checkpointing in the act_hf column (against the unpatched model without it)")
    p.add_argument("--checkpoint-bits", type=int, choices=range(1, 9), default=None, metavar="{1..8}",
                   help="with checkpointing, keep the checkpointed layer inputs packed at this width (implies "
                        "--checkpointing; 8 keeps accuracy, 4 is GACT's CB1)")
    p.set_defaults(func=_estimate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
