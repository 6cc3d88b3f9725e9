"""The CUDA extension ``act_hf._C``: built on first use, cached, or pre-built with ``act-hf build-ext``.

``import act_hf`` never builds, imports or initialises CUDA. :func:`load` tries once per process and keeps
the error; :func:`require` raises it with the build command. ``ACT_HF_DISABLE_EXT=1`` forces the
pure-PyTorch path. The build is cached under ``$ACT_HF_CACHE`` (default ``~/.cache/act_hf``) keyed by a hash
of the sources, the torch and CUDA versions and the arch list, so editing a .cu rebuilds it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

from .errors import ActHFRuntimeError

__all__ = ["CSRC_DIR", "build", "disabled", "is_available", "load", "load_error", "require"]

logger = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parent
#: the CUDA sources: ``act_hf/csrc`` in an installed wheel, ``csrc/`` beside the package in a source tree
CSRC_DIR = _PACKAGE_DIR / "csrc"
if not (CSRC_DIR / "bindings.cpp").is_file():
    CSRC_DIR = _PACKAGE_DIR.parent / "csrc"
SOURCES = ("bindings.cpp", "quantize_kernel.cu", "quantize_scaled_kernel.cu", "quantize_normalized_kernel.cu",
           "dequantize_kernel.cu", "channel_scale_kernel.cu", "fewbit_kernel.cu")
#: the headers they include (their text keys the build too)
HEADERS = ("dispatch.h", "octets.cuh", "fewbit_octets.cuh", "quantize_octets.cuh", "decode_octets.cuh", "elements.cuh",
           "quantize_kernels.cuh")
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
BUILD_COMMAND = "act-hf build-ext   (or: python -m act_hf.cli build-ext)"

_lock = threading.Lock()
_module: ModuleType | None = None
_error: BaseException | None = None
_tried = False


def disabled() -> bool:
    """True when ``ACT_HF_DISABLE_EXT=1`` forces the pure-PyTorch reference."""
    return os.environ.get("ACT_HF_DISABLE_EXT", "0") not in ("", "0", "false", "False")


def _arch_list() -> str:
    import torch

    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        return arch
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    logger.info("TORCH_CUDA_ARCH_LIST is not set and no GPU is visible: building for %s", DEFAULT_ARCH_LIST)
    return DEFAULT_ARCH_LIST


def _build_dir(arch: str) -> Path:
    import torch

    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((CSRC_DIR / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{arch}|{os.environ.get('DEBUG', '0')}".encode())
    root = Path(os.environ.get("ACT_HF_CACHE", Path.home() / ".cache" / "act_hf"))
    path = root / "ext" / digest.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


def _find_cuda_home() -> str | None:
    """A CUDA toolkit folder holding both ``bin/nvcc`` and ``libcudart``.

    torch guesses CUDA_HOME as the folder above ``which nvcc``; a wrapper script such as
    ``/usr/local/bin/nvcc`` then sends the linker to ``/usr/local/lib64``, which has no libcudart.
    """
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc")
    candidates = [
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        cpp_extension.CUDA_HOME,
        "/usr/local/cuda",
        str(Path(os.path.realpath(nvcc)).parent.parent) if nvcc else None,
    ]
    for home in filter(None, candidates):
        root = Path(home)
        if (root / "bin" / "nvcc").exists() and any((root / d / "libcudart.so").exists() for d in ("lib64", "lib")):
            return str(root)
    return None


def build(*, verbose: bool = False) -> ModuleType:
    """Compile (or load from the cache) and import the extension. Raises on failure; never needs a GPU."""
    import torch
    from torch.utils import cpp_extension

    cuda_home = _find_cuda_home()
    if cuda_home is None:
        raise ActHFRuntimeError(
            "no CUDA toolkit found (set CUDA_HOME to a folder with bin/nvcc and lib64/libcudart.so): "
            "cannot build act_hf's CUDA extension"
        )
    cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = cuda_home
    if torch.version.cuda is None:
        raise ActHFRuntimeError(f"torch {torch.__version__} is a CPU-only build: act_hf's CUDA extension needs CUDA")
    arch = _arch_list()
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    cuda_flags = opt + [
        "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "-lineinfo",
    ]
    return cpp_extension.load(
        name="act_hf_C",
        sources=[str(CSRC_DIR / s) for s in SOURCES],
        extra_cflags=opt,  # the C++ standard is torch's own (C++20 for torch >= 2.10)
        extra_cuda_cflags=cuda_flags,
        build_directory=str(_build_dir(arch)),
        verbose=verbose,
    )


def load() -> ModuleType | None:
    """The extension module, or ``None`` (disabled, no CUDA, or the build failed; see :func:`load_error`)."""
    global _module, _error, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if disabled():
            _error = ActHFRuntimeError("disabled by ACT_HF_DISABLE_EXT=1")
            return None
        try:
            _module = build()
        except Exception as exc:  # any build or import failure falls back to the reference
            _error = exc
            logger.debug("act_hf CUDA extension unavailable", exc_info=True)
        return _module


def load_error() -> BaseException | None:
    """Why :func:`load` returned ``None``, if it did."""
    return _error


def is_available() -> bool:
    """True if the extension is (or can be) built and imported in this process."""
    return load() is not None


def require() -> ModuleType:
    """The extension, or an :class:`ActHFRuntimeError` with the original error and the build command."""
    module = load()
    if module is None:
        raise ActHFRuntimeError(
            f"act_hf's CUDA extension is not available ({type(_error).__name__}: {_error}). "
            f"Build it with: {BUILD_COMMAND}"
        )
    return module
