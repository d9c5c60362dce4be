"""What every server process does first: logging, dying with its parent, torch's threads where
it uses torch, and (the model process) keeping freed memory for its next forward. And the
heartbeat each one's main loop gives launch.py's watchdog."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from types import FrameType
from typing import Any

import msgspec
import setproctitle

# Its home is model_worker, whose loader calls it too; the scheduler takes it from here.
from radixserve.model_worker.host_memory import release_freed_memory as release_freed_memory
from radixserve.protocol.internal import ProcessReady
from radixserve.server_args import ServerArgs, usable_cores

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers

_PR_SET_PDEATHSIG = 1
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, glibc's malloc.h
_TRIM_THRESHOLD = 1 << 30

# An idle main loop still wakes this often to beat, so that only a hung one goes silent.
HEARTBEAT_INTERVAL_S = 0.5


class Heartbeat:
    """When a child's main loop last went round, in shared memory that launch.py reads. The loop
    itself writes it, never a helper thread: a hung loop must not look alive."""

    def __init__(self, ctx: SpawnContext):
        self._last = ctx.RawValue("d", time.monotonic())  # CLOCK_MONOTONIC: one for all processes

    def beat(self) -> None:
        self._last.value = time.monotonic()

    def silence(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self._last.value


_ready = False  # whether this process has told launch.py it is ready


def report_ready(ready_writer: Connection, name: str) -> None:
    """Tell launch.py this process is serving: from here on a failure is not a start-up's."""
    global _ready
    ready_writer.send_bytes(msgspec.msgpack.encode(ProcessReady(name)))
    _ready = True


def has_reported_ready() -> bool:
    return _ready


def configure_process(
    name: str, args: ServerArgs, on_sigterm: SignalHandler = signal.SIG_IGN
) -> None:
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"[%(asctime)s {name}] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    _die_with_parent()
    # `ps` and `top` show "radixserve: scheduler", not "python3 -B -c from multiprocessing...".
    setproctitle.setproctitle(f"radixserve: {name}")
    # launch.py alone decides how to stop us (SIGKILL once the tokenizer manager has drained):
    # a SIGTERM or Ctrl-C sent to the whole process group (systemd's default, kill -TERM -PGID)
    # must not end the scheduler under a drain. The tokenizer manager's SIGTERM is the drain: it
    # passes its own handler, in force from here on.
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: launch.py drains
    # Blocked by launch.py while it started us.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGHUP})


def take_torch_threads(threads: int | None) -> None:
    """For a process that imports torch: the model process takes all cores (None) or its share;
    the tokenizer manager (transformers imports torch) takes one, so that it never spins OpenMP
    threads against the model on a small machine. The DP controller never imports torch, nor
    does the detokenizer for a fast tokenizer (detokenizer/tokenizer_handoff.py)."""
    import torch

    torch.set_num_threads(threads or usable_cores())


# oneDNN (the CPU linears on reordered weights, packed_linear.py) keeps a compiled primitive, and
# torch's ideep layer its own, for every input shape it meets, 1,024 of each by default: a server
# meets a new row count at almost every step. Measured: 600 row counts held +474 MB after
# malloc_trim (+7 MB with 16 each); the reliability test's two rounds of load grew the model
# process by 89 MB (3 MB with 16). 16 hold a step's five shapes for three batch sizes; a miss
# costs ~0.8 ms.
_ONEDNN_CACHE_CAPACITY = "16"


def bound_onednn_caches() -> None:
    """For the server's children, set by launch.py before it starts them: ideep reads its
    capacity when torch loads, before a child's own code runs (set in the child, it did not
    take). A value the user set stays."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, _ONEDNN_CACHE_CAPACITY)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (where a TP group of this machine meets)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """If launch.py is killed outright it cannot tear us down: ask the kernel to. A parent that
    died before the request was made sends nothing: then we have a new parent already, and go."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:
            os._exit(1)


def keep_freed_memory() -> None:
    """Make glibc keep freed blocks for reuse instead of giving them back to the kernel.

    By default glibc serves large blocks with fresh mmaps (from a threshold that moves between
    128 KB and 32 MB) and trims the heap top once enough of it is free, so a forward's
    temporaries are page-faulted in again on every layer of every step. Measured here: a decode
    attention layer (its gathered K and V, 2 x 9 MB at 64 sequences of 190 tokens) 9.8 ms with
    the default, 2.6 ms with the threshold at 32 MB; a 2,048-token prefill chunk of the 0.5B
    Qwen2 shape in bfloat16, whose gate_up writes 40 MB at each of 24 layers (past any
    threshold), 234,000 page faults and 3.89 s with that threshold, 3.53 s with no mmaps. So no
    mmaps, and the heap top trimmed only past 1 GB; the idle model still gives the heap's free
    pages back (release_freed_memory). One exception: a thread's own arena (the forward thread of
    --enable-overlap-schedule) still maps a block larger than its 64 MB heaps afresh. tcmalloc
    and jemalloc, which vLLM's CPU backend preloads, keep freed memory too.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):  # not glibc
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
