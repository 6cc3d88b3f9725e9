"""Throughput of quantize+pack and unpack+dequantize against a device-to-device copy (GPU).

For bf16 tensors of 64 MiB to 1 GiB at 1, 2, 3, 4 and 8 bits, measures each direction's effective bandwidth
(bytes read + bytes written per second) and compares it with ``copy_`` of the same tensor, measured in the
same run. Target: each direction >= 70% of copy bandwidth. Writes JSON and a markdown table under
``benchmarks/results/``.

    python benchmarks/benchmark_quantize.py [--sizes-mib 64 256 1024] [--bits 1 2 3 4 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch


def _versions() -> dict:
    import act_hf

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "act_hf": act_hf.__version__,
        "commit": commit,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


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
        n = mib * 2**20 // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        copy_ms = _time_ms(lambda: dst.copy_(x), args.repeat)
        copy_gbs = 2 * x.nbytes / (copy_ms[len(copy_ms) // 2] * 1e-3) / 1e9
        for bits in args.bits:
            packed = ext.quantize_pack(x, bits, args.group_size, 1)
            packed_bytes = sum(t.nbytes for t in packed)
            q_ms = _time_ms(lambda: ext.quantize_pack(x, bits, args.group_size, 1), args.repeat)
            d_ms = _time_ms(lambda: ext.unpack_dequantize(*packed, bits, args.group_size, n, x.dtype), args.repeat)
            moved = x.nbytes + packed_bytes  # bytes read + written, both directions
            for direction, times in (("quantize_pack", q_ms), ("unpack_dequantize", d_ms)):
                gbs = moved / (times[len(times) // 2] * 1e-3) / 1e9
                rows.append({"op": direction, "size_mib": mib, "bits": bits, "ms": _quantiles(times),
                             "gb_per_s": gbs, "copy_gb_per_s": copy_gbs, "fraction_of_copy": gbs / copy_gbs})
                print(f"{direction:18s} {mib:5d} MiB {bits} bit: {gbs:7.1f} GB/s = {gbs / copy_gbs:.2f} x copy")
        del x, dst

    args.out.mkdir(parents=True, exist_ok=True)
    meta = _versions()
    (args.out / "quantize_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"Device: {meta['device']}, torch {meta['torch']} (CUDA {meta['cuda']}), act_hf {meta['act_hf']} "
             f"@ {meta['commit']}, {meta['timestamp']}", "",
             "| op | size MiB | bits | GB/s (read+write) | copy GB/s | fraction of copy |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['size_mib']} | {r['bits']} | {r['gb_per_s']:.1f} | {r['copy_gb_per_s']:.1f} | "
              f"{r['fraction_of_copy']:.2f} |" for r in rows]
    (args.out / "quantize_throughput.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
