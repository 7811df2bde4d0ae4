"""Finding, compiling and caching the kernels: CUDA through CuPy, or the host build.

- :func:`backend` says which runs: ``cuda`` where CuPy sees a usable GPU (and
  ``$MEMKV_KERNELS`` is not ``cpu``), else ``cpu`` (the torch/numpy reference).
- :func:`cuda_module` compiles one ``.cu`` with CuPy's ``RawModule`` (NVRTC) for
  the current device's architecture, once per (source, device).
- :func:`nvcc_ptx_command` and :func:`host_library` are how the test suite checks
  the sources without a GPU: ``nvcc -ptx`` for each architecture, and a g++ build
  of the same source (``MEMKV_HOST_BUILD``: kernels as loops over their grid)
  loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "SOURCES",
    "backend",
    "cuda_module",
    "host_library",
    "kernel_sources",
    "nvcc_ptx_command",
]

SOURCES = Path(__file__).with_name("cuda")
#: Architectures every source must compile for (A100, H100).
ARCHITECTURES = ("sm_80", "sm_90")
BACKEND_ENV = "MEMKV_KERNELS"
_HOST_FLAGS = ("-std=c++17", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-x", "c++",
               "-DMEMKV_HOST_BUILD")


def kernel_sources() -> list[Path]:
    """Every ``.cu`` source, sorted."""
    return sorted(SOURCES.glob("*.cu"))


@functools.cache
def _cuda_devices() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "none"
        return 0


def backend() -> str:
    """``cuda`` when kernels run on a GPU here, else ``cpu`` (the reference)."""
    if os.environ.get(BACKEND_ENV, "").lower() == "cpu":
        return "cpu"
    return "cuda" if _cuda_devices() > 0 else "cpu"


@functools.cache
def _cuda_module_cached(name: str, device: int, arch: str) -> Any:
    import cupy

    source = (SOURCES / f"{name}.cu").read_text()
    # NVRTC has no include path of its own: the compat header goes in inline.
    header = (SOURCES / "memkv_compat.cuh").read_text()
    source = source.replace('#include "memkv_compat.cuh"', header)
    return cupy.RawModule(code=source, options=("--std=c++17", f"--gpu-architecture={arch}"))


def cuda_module(name: str) -> Any:
    """The compiled module of ``cuda/<name>.cu`` for the current device (cached)."""
    import cupy

    device = cupy.cuda.Device()
    major, minor = device.compute_capability[0], device.compute_capability[1:]
    return _cuda_module_cached(name, int(device.id), f"sm_{major}{minor}")


def nvcc_ptx_command(source: Path, arch: str, out: Path) -> list[str]:
    """``nvcc -ptx`` of one source for one architecture."""
    nvcc = shutil.which("nvcc") or "nvcc"
    return [nvcc, "-ptx", f"-arch={arch}", "-std=c++17", "-o", str(out), str(source)]


def host_library(source: Path, cache_dir: Path) -> ctypes.CDLL:
    """The host build of ``source`` (g++), compiled once per content into ``cache_dir``.

    Raises:
        FileNotFoundError: no g++ on this machine.
        subprocess.CalledProcessError: the source does not compile.
    """
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise FileNotFoundError("the host build of the kernels needs g++")
    text = source.read_bytes() + (SOURCES / "memkv_compat.cuh").read_bytes()
    digest = hashlib.sha256(text + " ".join(_HOST_FLAGS).encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    lib = cache_dir / f"{source.stem}-{digest}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([cxx, *_HOST_FLAGS, "-I", str(SOURCES), "-o", str(tmp), str(source)],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))
