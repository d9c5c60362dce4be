"""TPGroup: this process's place in the tensor-parallel group, handed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank waits this long for the others at start (loading a large shard) and in a collective; a
# dead or hung rank is caught sooner by launch.py's watchdog, which takes the whole server down.
DIST_TIMEOUT = timedelta(minutes=30)
# A step's batch is token ids and slots: anything this large is a bug, not a batch.
MAX_BROADCAST_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (when size > 1)
    # Where the collectives' own tensors live: this rank's GPU with NCCL, the CPU with gloo.
    # Explicit: the current CUDA device is per thread, and the overlap thread runs collectives.
    device: torch.device = torch.device("cpu")

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` rows or columns."""
        if total % self.size:
            raise ValueError(
                f"{what} = {total} is not divisible by the tensor-parallel size {self.size}"
            )
        length = total // self.size
        return self.rank * length, length

    def shard_heads(self, num_heads: int, what: str) -> tuple[int, int]:
        """(first head, heads) of this rank. With fewer heads than ranks (KV heads under GQA or
        MQA) each rank holds one, replicated on size // num_heads neighbouring ranks: the ones
        whose query heads read it."""
        if num_heads >= self.size:
            return self.shard(num_heads, what)
        if self.size % num_heads:
            raise ValueError(
                f"{what} = {num_heads} does not divide the tensor-parallel size {self.size}"
            )
        return self.rank // (self.size // num_heads), 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int) -> int:
        """The smallest `value` over ranks, so that every rank sizes its KV pool alike."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None): its length, then the bytes, each
        as one tensor broadcast. Empty data costs the one broadcast of its length."""
        device = self.device
        length = torch.tensor([len(data) if data is not None else 0], device=device)
        dist.broadcast(length, group=self.group, group_src=0)
        n = int(length.item())
        if n == 0:
            return b""
        if n > MAX_BROADCAST_BYTES:
            raise ValueError(f"rank 0 broadcasts {n} bytes, over {MAX_BROADCAST_BYTES}")
        if data is not None:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        else:
            buffer = torch.empty(n, dtype=torch.uint8, device=device)
        dist.broadcast(buffer, group=self.group, group_src=0)
        return data if data is not None else buffer.cpu().numpy().tobytes()


def init_tp_group(rank: int, size: int, init_addr: str, device: torch.device) -> TPGroup:
    """Join the TP group: `size` processes meeting at `init_addr` (host:port, served by rank 0);
    gloo on the CPU, NCCL on GPUs."""
    if size == 1:
        return TPGroup()
    nccl = device.type == "cuda"
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=size,
        timeout=DIST_TIMEOUT,
        device_id=device if nccl else None,  # NCCL binds this rank's communicator to its GPU
    )
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    return TPGroup(rank=rank, size=size, device=device if nccl else torch.device("cpu"))
