"""Which C++ errors a torch extension built here can raise into Python without killing the process.

On the H100 machine (Ubuntu 24.04, Python 3.12.3, gcc 13.3.0, torch 2.11.0+cu130) every error raised out of
act_hf's CUDA extension ended the process with SIGSEGV, even a ``TORCH_CHECK`` on the arguments with the GIL held;
here (Python 3.11, gcc 12) the same errors raise. This builds a tiny CPU-only extension (``load_inline``, no CUDA)
whose functions fail in four ways, calls each in a fresh interpreter, and reports how each ended:

* ``std_error``: ``throw std::runtime_error`` (pybind11's own translation of a std::exception);
* ``torch_check``: ``TORCH_CHECK(false, ...)`` (a ``c10::Error``, translated by torch's handler);
* ``value_error``: ``throw pybind11::value_error`` (pybind11's builtin exception type);
* ``caught``: the ``c10::Error`` caught inside the function and returned as a string (nothing crosses pybind11).

If all four crash, throwing itself is the problem; if only the first three, pybind11's translation of exceptions
is (and returning errors as values avoids it); if only ``torch_check``, torch's handler is::

    python benchmarks/probe_extension_errors.py            # prints one line per case; exit 1 if any crashed

Writes nothing but the build (under torch's extension cache, or ``--build-dir``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("std_error", "torch_check", "value_error", "caught")

_SOURCE = r"""
#include <torch/extension.h>
#include <stdexcept>
#include <string>

void std_error() { throw std::runtime_error("std_error raised"); }
void torch_check() { TORCH_CHECK(false, "torch_check raised"); }
void value_error() { throw pybind11::value_error("value_error raised"); }
std::string caught() {
  try {
    TORCH_CHECK(false, "caught raised");
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}
"""


def build(build_dir: Path):
    """The probe extension (compiled on first use, then loaded from ``build_dir``)."""
    from torch.utils.cpp_extension import load_inline

    build_dir.mkdir(parents=True, exist_ok=True)
    return load_inline(name="act_hf_error_probe", cpp_sources=[_SOURCE], functions=list(CASES),
                       build_directory=str(build_dir), verbose=False)


def run_case(case: str, build_dir: Path) -> str:
    """How calling ``case`` ended, in a fresh interpreter: ``raised: <message>``, ``returned: <value>``, or
    ``crashed (exit <code>)``."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import probe_extension_errors as p\n"
            f"m = p.build(__import__('pathlib').Path({str(build_dir)!r}))\n"
            f"try:\n    print('returned:', m.{case}(), flush=True)\n"
            f"except Exception as e:\n    print('raised:', type(e).__name__, str(e).splitlines()[0], flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env=os.environ.copy())
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0:
        return f"crashed (exit {proc.returncode})"
    return out[-1] if out else "no output"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", type=Path, default=Path(tempfile.gettempdir()) / "act_hf_error_probe")
    args = parser.parse_args(argv)
    build(args.build_dir)  # once here, so the cases only load it
    results = {case: run_case(case, args.build_dir) for case in CASES}
    for case, how in results.items():
        print(f"{case}: {how}")
    return 1 if any(how.startswith("crashed") for how in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
