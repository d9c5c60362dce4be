"""The wheel as a user installs it: one top-level import name, working beside PyPI's namesakes.

PyPI has packages called `scheduler`, `protocol`, `launch` and `detokenizer`, and `client` is a
common name for a user's own module. The test installs the built wheel into a fresh venv next to
stand-ins for every folder name of this repository, each of which fails loudly when imported, then
serves and generates through the installed entry points from outside the repository.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from radixserve.client.local_server import REPO_ROOT, launched_server

# The repository's own folders and root modules: none may be a top-level name of the install.
REPO_NAMES = (
    "client",
    "detokenizer",
    "http_server",
    "launch",
    "model_worker",
    "process_setup",
    "protocol",
    "scheduler",
    "server_args",
    "tokenizer_manager",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy, so that setuptools' build/ directory never lands in the checkout.
    src = tmp_path_factory.mktemp("src") / "radixserve"
    shutil.copytree(
        REPO_ROOT,
        src,
        ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".*"),
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("radixserve-*.whl")
    return whl


@pytest.fixture(scope="module")
def env(tmp_path_factory, wheel) -> Path:
    """A fresh venv holding the wheel and a failing stand-in for each repository name. Its
    dependencies (torch, transformers, ...) come from this interpreter's site-packages."""
    root = tmp_path_factory.mktemp("venv")
    venv.create(root, system_site_packages=True, with_pip=False)
    site = next((root / "lib").glob("python3*/site-packages"))
    # Run from a venv, this interpreter's own packages (uvicorn, ...) are not the system's: a
    # path file lists them, after the venv's own (it holds no .pth hooks such as an editable
    # install's: those run only in site directories).
    (site / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for name in REPO_NAMES:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(
            f"raise ImportError('this is a stand-in for PyPI\\'s {name}, not radixserve')\n"
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(root / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return root


def test_the_wheel_adds_one_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        paths = [line.split(",")[0] for line in z.read(record).decode().splitlines() if line]
    top = {p.split("/")[0] for p in paths if not p.split("/")[0].endswith(".dist-info")}
    assert top == {"radixserve"}


def test_installed_package_imports_beside_namesakes(env, tmp_path):
    python = env / "bin" / "python"
    code = (
        "import radixserve.launch, radixserve.scheduler.process, radixserve.client.cli; "
        "print(radixserve.__file__)"
    )
    out = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(env)), "radixserve was not imported from the venv"
    # The stand-ins are in the way, so nothing of radixserve may import a bare name.
    shadowed = subprocess.run(
        [python, "-c", "import scheduler"], cwd=tmp_path, capture_output=True, text=True
    )
    assert "stand-in" in shadowed.stderr


def test_installed_entry_points_serve_and_generate(env, tmp_path):
    bin_dir = env / "bin"
    help_out = subprocess.run(
        [bin_dir / "radixserve", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert help_out.returncode == 0, help_out.stderr
    assert "--max-total-tokens" in help_out.stdout
    with launched_server(
        "--dtype", "float32", command=[str(bin_dir / "radixserve")], cwd=tmp_path
    ) as server:
        port = server.address.rsplit(":", 1)[1]
        out = subprocess.run(
            [
                bin_dir / "radixserve-client",
                "--port",
                port,
                "--chat",
                "--temperature",
                "0",
                "--max-new-tokens",
                "16",
                "Name the capital of France.",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
