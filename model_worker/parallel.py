"""TPGroup: this process's place in the tensor-parallel group, handed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (when size > 1)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` rows or columns."""
        if total % self.size:
            raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size")
        length = total // self.size
        return self.rank * length, length

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
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
