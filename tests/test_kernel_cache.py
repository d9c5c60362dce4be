"""The CPU extension's build cache (model_worker/cpu_kernels.py), in real processes on a cache of
the test's own: a build killed halfway never blocks the next start, two environments on one
cache keep their own builds, and a cache that cannot be written falls back to torch_native.

One build for the whole module (the killed one is stopped as soon as it starts), of one small
unit of the real sources: the cache's lock, half builds and keys are what is tested, and they do
not depend on what is compiled (the suite's own first load builds and loads the whole extension
through the same code). The whole extension here took 50-80 s of CI's 10 minutes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

LOAD = (
    "import logging, sys\n"
    "logging.basicConfig(level='INFO', format='%(message)s')\n"
    "from radixserve.model_worker import cpu_kernels\n"
    "cpu_kernels.UNITS = (('argmax.cpp',),)  # one unit, no op registered: a ~15 s build\n"
    "print(cpu_kernels.kernel_build_dir(), flush=True)\n"
    "if sys.argv[1:] == ['load']:\n"
    "    cpu_kernels.load_cpu_kernels()  # raises if the library is not there or does not load\n"
)


def run_load(cache: Path, *argv: str, pythonpath: str | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "RADIXSERVE_KERNEL_CACHE": str(cache)}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-c", LOAD, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: the compilers it starts can be stopped with it
    )


def finish(proc: subprocess.Popen[str], timeout: float = 900) -> tuple[Path, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return Path(out.splitlines()[0]), err


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A cache whose first build was SIGKILLed as soon as it began, then built by a second
    start: (cache, build directory, that second start's log)."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    first = run_load(cache, "load")
    deadline = time.monotonic() + 300
    while not any(p.name.startswith(".partial-") for p in cache.glob("*")):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    time.sleep(1)  # into the compile
    os.kill(first.pid, signal.SIGKILL)  # as the launcher stops a child that is starting
    first.wait()
    os.killpg(first.pid, signal.SIGKILL)  # the compilers it left: only to spare the machine
    build, log = finish(run_load(cache, "load"))
    return cache, build, log


def test_a_build_killed_halfway_is_redone_and_says_why(built_cache: tuple[Path, Path, str]):
    cache, build, log = built_cache
    assert "building the CPU kernels" in log
    assert "an earlier build of this environment was interrupted (pid" in log, log
    assert "built the CPU kernels in" in log
    assert (build / "radixserve_cpu.so").is_file() and (build / "key.json").is_file()
    assert not list(cache.glob(".partial-*")), "the half build was not removed"
    assert not list(build.glob("lock")), "torch's own lock must not live in the cache"
    # The next start loads it: no build, no wait.
    again, log = finish(run_load(cache, "load"), timeout=120)
    assert again == build and "building" not in log, log


def test_two_environments_on_one_cache_keep_their_own_builds(
    built_cache: tuple[Path, Path, str], tmp_path: Path
):
    """A second environment: the same torch seen at another install path (a venv of its own
    would differ the same way). Its build is stood in for by a copy of the first, so the module
    builds once."""
    cache, build_a, _ = built_cache
    venv = tmp_path / "site-packages"
    venv.mkdir()
    (venv / "torch").symlink_to(Path(torch.__file__).parent)
    build_b, _ = finish(run_load(cache, pythonpath=str(venv)), timeout=120)
    assert build_b != build_a and build_b.parent == cache
    subprocess.run(["cp", "-a", str(build_a), str(build_b)], check=True)
    stamp_a = (build_a / "radixserve_cpu.so").stat().st_mtime_ns
    for pythonpath, build in ((str(venv), build_b), (None, build_a), (str(venv), build_b)):
        where, log = finish(run_load(cache, "load", pythonpath=pythonpath), timeout=120)
        assert where == build and "building" not in log, log
    assert (build_a / "radixserve_cpu.so").stat().st_mtime_ns == stamp_a


def test_an_unwritable_cache_falls_back_to_torch_native_with_one_warning(tmp_path: Path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    code = (
        "import torch\n"
        "from radixserve.model_worker.cpu_kernels import cpu_kernels_available\n"
        "from radixserve.model_worker.kernel_selection import select_kernels\n"
        "assert not cpu_kernels_available()\n"
        "k = select_kernels('auto', 4, 2, torch.device('cpu'), torch.float32)\n"
        "print(k.name)\n"
    )
    env = {**os.environ, "RADIXSERVE_KERNEL_CACHE": str(not_a_dir / "kernels")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch_native"
    assert out.stderr.count("falling back to torch_native") == 1, out.stderr
    assert "Traceback" not in out.stderr
