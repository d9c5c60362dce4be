"""What every server process does first: logging, torch threads, and dying with its parent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

from server_args import ServerArgs

_PR_SET_PDEATHSIG = 1


def configure_process(name: str, args: ServerArgs, torch_threads: int | None = 1) -> None:
    """torch_threads: the model process takes all cores by default; the others take one, so
    that they never spin OpenMP threads against the model on a small machine."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"[%(asctime)s {name}] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    _die_with_parent()
    # launch.py's SIGTERM must end us at once, even inside a blocking receive. Ctrl-C reaches the
    # whole process group; launch.py alone decides how to stop us, so it is ignored here.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Every process imports torch (transformers does); its default pool would compete for the
    # cores with the model.
    import torch

    torch.set_num_threads(torch_threads or os.cpu_count() or 1)


def _die_with_parent() -> None:
    """If launch.py is killed outright it cannot tear us down: ask the kernel to."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
