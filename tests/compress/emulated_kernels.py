"""act_hf's CUDA extension built for the CPU: the kernels of ``csrc/`` run as written on CPU tensors.

:func:`build` copies ``csrc/`` (the sources and headers ``act_hf._ext`` builds), rewrites what only nvcc or a GPU
understands, and compiles the copy with the host compiler against ``cuda_on_cpu.h``, which supplies CUDA's device
built-ins (threads as fibers, warp shuffles, ``__syncthreads``, ``atomicMax``). The rewriting is mechanical:

* ``kernel<<<grid, block, smem, stream>>>(args)`` -> ``act_hf_emulation::launch(grid, block, smem, stream)(kernel,
  args)``: the grid's blocks run one after another, a block's threads as fibers;
* ``#include <c10/cuda/...>`` lines are dropped (the header stands in for the guard, the stream and the launch
  check);
* the bindings' ``.is_cuda()`` checks read ``.is_cpu()``: the module takes CPU tensors, and names them as the CUDA
  one names CUDA tensors.

So the launch code (grid sizes, alignment tests, the per-launch constants such as a channel's divider) and every
kernel body are the ones nvcc compiles; what differs is the arithmetic's host build (the header's intrinsics, and
the ``#if defined(__CUDA_ARCH__)`` branches of the ``.cuh`` files take their host side) and that nothing runs
concurrently. Tests compare the module against ``act_hf.compress.reference`` as ``test_kernels_cuda.py`` compares
the GPU's, so a kernel's indexing, tails and reductions are checked on every CI run, not only on a lent GPU. The
build is optimized (-O2), so that the host compiler holds the kernels to C++'s aliasing rules: it found octets read
through pointers of another type, which nvcc's device code had let pass (f211ea4).

``ACT_HF_EMULATION_FLAGS`` adds compiler and linker flags, for the sanitizers (a build of its own)::

    ACT_HF_EMULATION_FLAGS="-fsanitize=undefined -fno-sanitize-recover=undefined" \
        python -m pytest -q tests/compress/test_kernels_cuda.py -k emulated
    LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
        ACT_HF_EMULATION_FLAGS="-fsanitize=address -fno-omit-frame-pointer" \
        python -m pytest -s -q tests/compress/test_kernels_cuda.py -k emulated   # -s: the report is on stderr
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from types import ModuleType

from act_hf import _ext

SHIM = Path(__file__).with_name("cuda_on_cpu.h")
_LAUNCH = re.compile(r"^(\s*)(\S[^\n]*?)<<<([^\n]*?)>>>\(", re.MULTILINE)
_CUDA_INCLUDE = re.compile(r"^#include <c10/cuda/[^>]+>\n", re.MULTILINE)


def rewritten(name: str, text: str) -> str:
    """``csrc/<name>``'s text as the host compiler builds it (see the module docstring)."""
    text = _LAUNCH.sub(r"\1act_hf_emulation::launch(\3)(\2, ", text)
    text = _CUDA_INCLUDE.sub("", text)
    if name == "bindings.cpp":
        text = text.replace(".is_cuda()", ".is_cpu()")
    if name in _ext.SOURCES:
        text = '#include "cuda_on_cpu.h"\n' + text
    return text


def build() -> ModuleType | None:
    """The emulated extension, built once per version of the sources and the header (under ``$ACT_HF_CACHE``);
    ``None`` where no CUDA toolkit headers (``cuda_runtime.h``) are found."""
    from torch.utils import cpp_extension

    cuda_home = _ext._find_cuda_home()
    if cuda_home is None or not (Path(cuda_home) / "include" / "cuda_runtime.h").is_file():
        return None
    names = _ext.SOURCES + _ext.HEADERS
    texts = {name: rewritten(name, (_ext.CSRC_DIR / name).read_text()) for name in names}
    flags = os.environ.get("ACT_HF_EMULATION_FLAGS", "").split()
    digest = hashlib.sha256(SHIM.read_bytes() + " ".join(flags).encode())
    for name in names:
        digest.update(name.encode() + texts[name].encode())
    tag = digest.hexdigest()[:12]
    root = Path(os.environ.get("ACT_HF_CACHE", Path.home() / ".cache" / "act_hf")) / "emulated" / tag
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    sources = []
    for name, text in {SHIM.name: SHIM.read_text(), **texts}.items():
        path = src / (name[:-3] + ".cpp" if name.endswith(".cu") else name)
        if not path.is_file() or path.read_text() != text:  # rewritten only when changed: ninja goes by the times
            path.write_text(text)
        if name in _ext.SOURCES:
            sources.append(str(path))
    return cpp_extension.load(name=f"act_hf_emulated_{tag}", sources=sources,
                              extra_include_paths=[str(src), str(Path(cuda_home) / "include")],
                              extra_cflags=["-O2", "-ffp-contract=off", *flags], extra_ldflags=flags,
                              build_directory=str(root))
