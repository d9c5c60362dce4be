"""The radixserve CPU extension (`model_worker/csrc/`): paged attention, fused small ops and
small-batch linear layers, registered as `torch.ops.radixserve.*`.

Built for the CPU it runs on where a server chooses its kernels (kernel_selection and
check_quantization load it, before the model is built; nothing else starts a build), and cached in
RADIXSERVE_KERNEL_CACHE (default ~/.cache/radixserve/kernels): `-march=native`, and ATen's SIMD
width as torch reports it for this CPU (AVX2, AVX-512, ...). A build's directory is named by a key
over everything the build bakes in: the sources, the torch it compiles against (version, build and
install path), the Python, the compiler and its version, the flags and the CPU (x86 `flags`, ARM
`Features`). Two venvs, or two kinds of machine sharing a home, each keep their own build and
never rebuild each other's.

A start never waits on a dead build: the build holds an `fcntl.flock` on a lock file of ours,
which the kernel releases when its holder dies (however it dies), and it builds in a directory
of its own that is renamed into place when complete, so a half build is never loaded and is
removed by the next build. Needs a C++ compiler and ninja (a dependency, from PyPI); the first
build takes about a minute.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# The sources, compiled as two translation units that include them (a unity build): every
# source parses ATen's headers for ~12 s of a core, most of its compile, so nine units took ~64 s
# on two cores and two take about half (a build runs at every first start, and twice in the
# tests). The two are about even, so that two cores finish them together.
UNITS = (
    ("attention.cpp", "linear.cpp", "argmax.cpp"),
    ("decoder.cpp", "int8.cpp", "int8_vnni.cpp", "elementwise.cpp", "register.cpp"),
)
LIBRARY = "radixserve_cpu.so"
KEY_FILE = "key.json"  # in a complete build: what its key was made of, for a person to read
# SIMD widths of ATen's Vectorized<float> that the sources compile for; others build scalar.
_VEC_CAPABILITIES = ("AVX2", "AVX512")
_PARTIAL = ".partial-"  # prefix of a build under way (or of one whose process died)


class KernelBuildError(RuntimeError):
    pass


def cpu_kernels_available() -> bool:
    """Whether the extension is loaded, building it first if needed; a failure is logged once."""
    try:
        load_cpu_kernels()
    except KernelBuildError as e:
        _warn_once(str(e))
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("CPU kernels unavailable, falling back to torch_native: %s", message)


def load_cpu_kernels() -> None:
    """Load the extension, building it first if this environment has no build; raises
    KernelBuildError (the same one on every later call: a failed build is not retried). A
    server loads it where it chooses its kernels (kernel_selection, check_quantization), once,
    before it builds a model."""
    outcome = _load_once()
    if isinstance(outcome, KernelBuildError):
        raise outcome


def cpu_kernels_loaded() -> bool:
    """Whether the extension is loaded; never builds it."""
    return _load_once.cache_info().currsize == 1 and _load_once() is None


def require_cpu_kernels(what: str) -> None:
    """For code that runs the extension but must not start a build (converting or sizing a
    weight): a build belongs to the choice of kernels, not to a constructor."""
    if not cpu_kernels_loaded():
        raise KernelBuildError(f"{what} needs the CPU extension, and it is not loaded")


@functools.cache
def _load_once() -> KernelBuildError | None:
    try:
        build = kernel_build_dir()
        if not (build / LIBRARY).is_file():
            _build(build)
        torch.ops.load_library(str(build / LIBRARY))
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
        return KernelBuildError(f"building or loading {CSRC} in {_cache_root()} failed: {e}")
    return None


def kernel_build_dir() -> Path:
    """Where this environment's build lives (complete once it holds LIBRARY)."""
    key = build_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return _cache_root() / f"{key['capability'].lower()}-{digest}"


@functools.cache
def build_key() -> dict[str, str]:
    """Everything the build bakes in."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {
        "capability": capability,
        "sources": _sources_digest(),
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "torch_path": str(Path(torch.__file__).parent),
        "python": platform.python_version(),
        "compiler": _compiler_version(),
        "flags": " ".join(_cflags(capability)),
        "cpu": _cpu_description(),
    }


def _build(build: Path) -> None:
    """Build into a directory of our own, under the lock, and rename it into place."""
    from torch.utils import cpp_extension

    build.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(build.with_suffix(".lock")):
        if (build / LIBRARY).is_file():  # another process built it while we waited
            return
        interrupted = _remove_partial_builds(build)
        capability = build_key()["capability"]
        why = (
            "an earlier build of this environment was interrupted (" + interrupted + ")"
            if interrupted
            else _why_no_build(build)
        )
        logger.info(
            "building the CPU kernels for %s, once, ~20 s (%s): %s", capability.lower(), why, build
        )
        start = time.monotonic()
        partial = build.with_name(f"{_PARTIAL}{build.name}-{os.getpid()}")
        partial.mkdir()
        _put_ninja_on_path()
        path = cpp_extension.load(
            name="radixserve_cpu",
            sources=_unity_sources(partial),
            extra_cflags=_cflags(capability),
            extra_ldflags=["-fopenmp"],
            build_directory=str(partial),
            is_python_module=False,
        )
        os.replace(path, partial / LIBRARY)  # torch names it _v1, _v2... after a first load
        (partial / KEY_FILE).write_text(json.dumps(build_key(), indent=1, sort_keys=True))
        shutil.rmtree(build, ignore_errors=True)  # a directory left by an older layout
        os.rename(partial, build)
        logger.info("built the CPU kernels in %.0f s", time.monotonic() - start)


def _unity_sources(directory: Path) -> list[str]:
    """One file per unit in `directory`, each including its sources by absolute path (their own
    includes still resolve beside them)."""
    paths = []
    for i, unit in enumerate(UNITS):
        path = directory / f"unit{i}.cpp"
        path.write_text("".join(f'#include "{CSRC / source}"\n' for source in unit))
        paths.append(str(path))
    return paths


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """One build per key at a time, across processes. flock: released by the kernel when the
    holder exits or is killed, so a killed build never blocks the next start."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process's build of the CPU kernels (%s)", path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_partial_builds(build: Path) -> str:
    """Remove the unfinished builds of this key (we hold its lock, so their processes died);
    returns which, for the log."""
    found = []
    for partial in build.parent.glob(f"{_PARTIAL}{build.name}-*"):
        found.append(f"pid {partial.name.rsplit('-', 1)[1]}")
        shutil.rmtree(partial, ignore_errors=True)
    return ", ".join(found)


def _why_no_build(build: Path) -> str:
    others = [p for p in build.parent.glob(f"*/{KEY_FILE}") if p.parent != build]
    if not others:
        return "no build in the cache yet"
    return f"the cache holds {len(others)} build(s) for other environments, none for this one"


def _cflags(capability: str) -> list[str]:
    flags = ["-O3", "-march=native", "-fopenmp", f"-DCPU_CAPABILITY={capability}"]
    if capability in _VEC_CAPABILITIES:
        flags.append(f"-DCPU_CAPABILITY_{capability}")
    return flags


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # the headers too
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _compiler_version() -> str:
    """The compiler torch's build runs ($CXX, else c++), by its path and its --version line;
    an error here surfaces as a failed build."""
    compiler = os.environ.get("CXX", "c++")
    resolved = shutil.which(compiler) or compiler
    out = subprocess.run(
        [resolved, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    return f"{os.path.realpath(resolved)} {out.splitlines()[0] if out else ''}"


def _cpu_description() -> str:
    """What -march=native compiles for: the first CPU's model and flags (x86) or Features and
    part (ARM)."""
    wanted = ("flags", "model name", "Features", "CPU implementer", "CPU part", "CPU architecture")
    seen: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in wanted and name not in seen:
                seen[name] = value.strip()
    return f"{platform.machine()} {platform.processor()} {sorted(seen.items())}"


def _cache_root() -> Path:
    default = Path.home() / ".cache" / "radixserve" / "kernels"
    return Path(os.environ.get("RADIXSERVE_KERNEL_CACHE", default))


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
