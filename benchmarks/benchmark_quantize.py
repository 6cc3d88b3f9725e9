"""Throughput of quantize+pack and unpack+dequantize against a device-to-device copy (GPU).

For bf16 tensors of 64 MiB to 1 GiB at 1, 2, 3, 4 and 8 bits, measures each direction's effective bandwidth
(bytes read + bytes written per second) and compares it with ``copy_`` of the same tensor, measured in the
same run; up to 4 bits also Few-Bit Backward's encode (an activation's input read, its codes written); the decode
into fp32 with LayerNorm's per-channel map (``unpack_dequantize_affine``, rows of 1024 channels); a residual block's
term decoded by channel into a bf16 sum and masked (``unpack_dequantize_into``, items of 256 x 56 x 56: the sum read
and written, the codes standing for the mask); a block input of four such terms, each masked, in one pass
(``unpack_dequantize_chain``: four payloads and masks read, the sum written once; per term, one ``into`` call each);
in the 1-bit rows, dropout's gradient from its packed keep-mask (``masked_scale``: the gradient and the mask read,
the input gradient written); up to 4 bits a GELU written in place with its codes (``activation_inplace_code``: x
read and written, the codes written); and once a size, an in-place ReLU written with its 1-bit code
(``relu_inplace_code``) beside aten's ``relu_`` of the same tensor, and aten's ``gelu_`` (its row's bits 0: no code).
Target: each direction >= 70% of copy bandwidth. Writes JSON and a markdown table under ``benchmarks/results/``.

    python benchmarks/benchmark_quantize.py [--sizes-mib 64 256 1024] [--bits 1 2 3 4 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_saved_memory import _meta, pyplot


def _versions() -> dict:
    """:func:`benchmark_saved_memory._meta` (device, torch, transformers, timm, act_hf, commit, time) and CUDA's
    version."""
    return _meta(torch.device("cuda" if torch.cuda.is_available() else "cpu")) | {"cuda": torch.version.cuda}


def _time_ms(fn, repeat: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)


def _quantiles(times: list[float]) -> dict:
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]
    return {"p20": pick(0.2), "p50": pick(0.5), "p80": pick(0.8)}


def _row(op: str, mib: int, bits: int, times: list[float], nbytes: int, copy_gbs: float) -> dict:
    """A table row: ``op``'s bandwidth moving ``nbytes`` in the median of ``times`` (ms), against a copy's; printed."""
    gbs = nbytes / (times[len(times) // 2] * 1e-3) / 1e9
    print(f"{op:24s} {mib:5d} MiB {bits} bit: {gbs:7.1f} GB/s = {gbs / copy_gbs:.2f} x copy")
    return {"op": op, "size_mib": mib, "bits": bits, "ms": _quantiles(times), "gb_per_s": gbs,
            "copy_gb_per_s": copy_gbs, "fraction_of_copy": gbs / copy_gbs}


def size_ops(ext, x: torch.Tensor) -> list[tuple[str, int, Callable[[], object], int]]:
    """The ops timed once a size, as ``(op, bits, call, bytes read and written)``: an in-place ReLU with its 1-bit
    code against aten's ``relu_``, and aten's ``gelu_`` (the fused GELU's rows are :func:`bits_ops`'), each on a
    copy of ``x`` that it keeps rewriting (a ReLU of a ReLU, a GELU of a GELU: the same passes over memory)."""
    n = x.numel()
    rectified, activated = x.clone(), x.clone()
    negative_zero_out = torch.zeros(1, device=x.device, dtype=x.dtype)
    return [("relu_inplace_code", 1, partial(ext.relu_inplace_code, rectified, negative_zero_out),
             2 * x.nbytes + -(-n // 8)),
            ("relu_ (aten)", 1, rectified.relu_, 2 * x.nbytes),
            ("gelu_ (aten)", 0, partial(torch._C._nn.gelu_, activated), 2 * x.nbytes)]


def bits_ops(ext, x: torch.Tensor, bits: int, group_size: int) -> list[tuple[str, int, Callable[[], object], int]]:
    """The ops timed at ``bits`` on a flat bf16 ``x``, as :func:`size_ops` gives them: quantize, decodes (plain,
    LayerNorm's affine, a residual term into a sum, a chain of four), at 1 bit dropout's gradient, up to 4 bits
    the few-bit encode and a GELU written in place with its codes (``activation_inplace_code``)."""
    n = x.numel()
    packed = ext.quantize_pack(x, bits, group_size, 1)
    packed_bytes = sum(t.nbytes for t in packed)
    moved = x.nbytes + packed_bytes  # bytes read + written, both directions
    mult, shift = torch.rand(1024, device=x.device) + 0.5, torch.randn(1024, device=x.device)
    # a residual block's term: decoded by channel of resnet50's stage 1 (256 x 56 x 56 an item), added to a bf16
    # tensor (read and written) and masked by a ReLU's 1-bit code (the codes stand for the mask)
    weight, bias = mult[:256], shift[:256]
    sums = torch.randn(n // 802816 * 802816, device=x.device, dtype=torch.bfloat16)
    mask = packed[0][:-(-sums.numel() // 8)]
    terms = ([packed[0]] * 4, [packed[1]] * 4, [packed[2]] * 4, [weight] * 4, [bias] * 4, [mask] * 4)
    ops = [("quantize_pack", bits, partial(ext.quantize_pack, x, bits, group_size, 1), moved),
           ("unpack_dequantize", bits, partial(ext.unpack_dequantize, *packed, bits, group_size, n, x.dtype), moved),
           ("unpack_dequantize_affine", bits,
            partial(ext.unpack_dequantize_affine, *packed, bits, group_size, n, mult, shift), packed_bytes + 4 * n),
           ("unpack_dequantize_into", bits, partial(ext.unpack_dequantize_into, sums, *packed, bits, group_size, n, 0,
                                                    weight, bias, 3136, mask, True),
            packed_bytes + 4 * sums.numel() + mask.nbytes),
           ("unpack_dequantize_chain", bits,
            partial(ext.unpack_dequantize_chain, sums, *terms, bits, group_size, n, 0, 3136, False),
            4 * (packed_bytes + mask.nbytes) + 2 * sums.numel())]
    if bits == 1:  # dropout's gradient: x stands for the gradient, the codes for its keep-mask
        ops.append(("masked_scale", bits, partial(ext.masked_scale, x, packed[0], 1.25),
                    2 * x.nbytes + packed[0].nbytes))
    if bits <= 4:  # Few-Bit Backward's codes: x read, its codes at `bits` written; GELU's also x written
        bounds = torch.linspace(-2, 2, (1 << bits) - 1, device=x.device, dtype=x.dtype)
        codes = -(-n * bits // 8)
        ops += [("fewbit_encode_pack", bits, partial(ext.fewbit_encode_pack, x, bounds, bits), x.nbytes + codes),
                ("activation_inplace_code", bits,
                 partial(ext.activation_inplace_code, x.clone(), bounds, bits, "gelu"), 2 * x.nbytes + codes)]
    return ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--bits", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--group-size", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")

    from act_hf import _ext

    ext = _ext.require()
    rows = []
    for mib in args.sizes_mib:
        x = torch.randn(mib * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        copy_ms = _time_ms(lambda: dst.copy_(x), args.repeat)
        copy_gbs = 2 * x.nbytes / (copy_ms[len(copy_ms) // 2] * 1e-3) / 1e9
        timed = size_ops(ext, x) + [op for bits in args.bits for op in bits_ops(ext, x, bits, args.group_size)]
        rows += [_row(op, mib, bits, _time_ms(call, args.repeat), nbytes, copy_gbs)
                 for op, bits, call, nbytes in timed]
        del x, dst, timed

    args.out.mkdir(parents=True, exist_ok=True)
    meta = _versions()
    (args.out / "quantize_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [(f"Device: {meta['device']}, torch {meta['torch']} (CUDA {meta['cuda']}), transformers "
              f"{meta['transformers']}, timm {meta['timm']}, act_hf {meta['act_hf']} @ {meta['commit']}, "
              f"{meta['timestamp']}"), "",
             "| op | size MiB | bits | GB/s (read+write) | copy GB/s | fraction of copy |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['size_mib']} | {r['bits']} | {r['gb_per_s']:.1f} | {r['copy_gb_per_s']:.1f} | "
              f"{r['fraction_of_copy']:.2f} |" for r in rows]
    (args.out / "quantize_throughput.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "quantize_throughput.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Each direction's fraction of a copy's bandwidth against the width, one line per size."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = (("quantize_pack", "-o"), ("unpack_dequantize", "--s"), ("fewbit_encode_pack", ":^"),
              ("unpack_dequantize_affine", "-.d"), ("unpack_dequantize_into", "-.v"),
              ("unpack_dequantize_chain", "-.>"), ("masked_scale", "x"), ("relu_inplace_code", "P"),
              ("relu_ (aten)", "*"), ("activation_inplace_code", ":p"), ("gelu_ (aten)", "h"))
    for op, style in styles:
        for mib in sorted({r["size_mib"] for r in rows}):
            points = sorted((r["bits"], r["fraction_of_copy"]) for r in rows if r["op"] == op and r["size_mib"] == mib)
            if points:
                ax.plot(*zip(*points), style, label=f"{op} {mib} MiB")
    ax.axhline(0.7, color="gray", lw=0.8, ls=":", label="target 0.7")
    ax.set_xlabel("bits")
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
