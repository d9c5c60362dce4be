"""The radixserve CPU extension (`model_worker/csrc/`): paged attention, fused small ops and
small-batch linear layers, registered as `torch.ops.radixserve.*`.

Built on first use for the CPU it runs on and cached: `-march=native`, and ATen's SIMD width as
torch reports it for this CPU (AVX2, AVX-512, ...). The cache directory is keyed by that, by the
CPU's flags and by torch's version, so a home directory shared by two kinds of machine keeps one
build for each. Needs a C++ compiler and ninja (a dependency, from PyPI); the first build takes
about a minute.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "attention.cpp",
    "decoder.cpp",
    "elementwise.cpp",
    "int8.cpp",
    "linear.cpp",
    "register.cpp",
)
# SIMD widths of ATen's Vectorized<float> that the sources compile for; others build scalar.
_VEC_CAPABILITIES = ("AVX2", "AVX512")


class KernelBuildError(RuntimeError):
    pass


def cpu_kernels_available() -> bool:
    """Whether the extension is loaded, building it first if needed; a failed build is logged."""
    try:
        load_cpu_kernels()
    except KernelBuildError as e:
        logger.warning("CPU kernels unavailable, falling back to torch ops: %s", e)
        return False
    return True


@functools.cache
def load_cpu_kernels() -> None:
    """Build (once per CPU kind) and load the extension; raises KernelBuildError."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    defines = [f"-DCPU_CAPABILITY={capability}"]
    if capability in _VEC_CAPABILITIES:
        defines.append(f"-DCPU_CAPABILITY_{capability}")
    build_dir = _cache_root() / f"{capability.lower()}-{_machine_key()}"
    sources = _stage_sources(build_dir / "src")
    _put_ninja_on_path()
    try:
        cpp_extension.load(
            name="radixserve_cpu",
            sources=[str(s) for s in sources],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *defines],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
        )
    except (RuntimeError, OSError, ImportError) as e:
        raise KernelBuildError(f"building {CSRC} in {build_dir} failed: {e}") from e


def _stage_sources(src_dir: Path) -> list[Path]:
    """Copy the sources into the cache, where their path is the same for every install (a
    checkout, a wheel in a venv): ninja rebuilds when a compile command changes, so sources
    compiled from two places would rebuild each other. Files are rewritten only when their
    contents change, keeping the timestamps ninja compares."""
    src_dir.mkdir(parents=True, exist_ok=True)
    staged = []
    for path in sorted(CSRC.iterdir()):
        target = src_dir / path.name
        data = path.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)  # atomic: another process may be compiling from it
        if path.name in SOURCES:
            staged.append(target)
    return staged


def _cache_root() -> Path:
    default = Path.home() / ".cache" / "radixserve" / "kernels"
    return Path(os.environ.get("RADIXSERVE_KERNEL_CACHE", default))


def _machine_key() -> str:
    """What -march=native compiles for, and the torch whose headers and ABI it compiles against."""
    flags = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
    return hashlib.sha256(f"{flags}|{torch.__version__}".encode()).hexdigest()[:12]


def _put_ninja_on_path() -> None:
    # torch runs `ninja` by name: the PyPI package's binary is not on PATH when the venv's python
    # runs without the venv activated.
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(ninja.BIN_DIR)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
