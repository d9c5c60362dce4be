"""Issue 22, "first hour": `make serve` installed the test tools, and on a Linux machine without
an NVIDIA GPU it fetched PyPI's torch, the CUDA build with gigabytes of NVIDIA packages. Here
`make install` runs with a stand-in python (test_commands.FAKE_PYTHON) that records each pip
command, has no torch, and finds no nvidia-smi."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from test_commands import FAKE_PYTHON

from radixserve.client.local_server import REPO_ROOT


def make_install(tmp_path: Path) -> list[str]:
    """The pip commands `make install` runs."""
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_bytes((REPO_ROOT / name).read_bytes())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"  # no nvidia-smi
    out = subprocess.run(
        ["make", "install", f"PY={python}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [c for c in (bin_dir / "calls").read_text().splitlines() if c.startswith("-m pip")]


def test_make_serve_installs_no_test_tools(tmp_path: Path) -> None:
    pips = make_install(tmp_path)
    extras = [c for c in pips if "[test]" in c]
    assert not extras, f"`make install` (what `make serve` runs) installs the test tools: {extras}"


def test_without_a_gpu_make_takes_the_cpu_torch(tmp_path: Path) -> None:
    torch = [c for c in make_install(tmp_path) if "torch==" in c]
    assert torch and "download.pytorch.org/whl/cpu" in torch[0], (
        f"without a GPU, torch comes from PyPI (the CUDA build) first: {torch}"
    )
