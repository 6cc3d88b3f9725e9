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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="act-hf", description="act_hf: compressed activations for training")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build-ext", help="compile the CUDA extension now (no GPU needed) and cache it")
    p.add_argument("--arch", help='TORCH_CUDA_ARCH_LIST to build for, e.g. "8.0;9.0" (default: the visible GPU, '
                   'else "8.0;9.0+PTX")')
    p.add_argument("--verbose", action="store_true", help="show the compiler commands")
    p.set_defaults(func=_build_ext)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
