"""Building blocks of a decoder: norms, RoPE, and linear layers that know their TP shard.

Every layer with weights is a `LoadableModule`: the loader hands it a whole checkpoint tensor and
the layer copies in the part this rank holds. Parameters start uninitialised (torch.empty: no page
is touched before it is loaded); the loader fails if any of them is never written. A linear
layer's weight starts on the meta device, is filled in a plain tensor, and is kept only in the
model's `WeightFormat` once its last piece is in (weight_format.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model_worker.fused_ops import TorchOps
from radixserve.model_worker.int8_weight import Int8Weight
from radixserve.model_worker.model_config import RopeConfig
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.weight_format import PreparedWeight, WeightFormat, held_tensors

# Vocabulary rows copied at a time: the checkpoint rows read for one copy stay small.
_VOCAB_CHUNK_ROWS = 8192


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class CheckpointTensor(Protocol):
    """A checkpoint tensor, or a lazy view of one that reads from disk only the part indexed:
    each TP rank reads its own shard alone."""

    @property
    def shape(self) -> Sequence[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class LoadableModule(nn.Module):
    # A layer fusing several checkpoint tensors (q/k/v, gate/up) into one parameter has a piece
    # for each of them.
    num_pieces: int = 1

    def load_weight(self, name: str, loaded: CheckpointTensor, piece: int = 0) -> None:
        """Copy the checkpoint tensor `loaded` into parameter `name` (replicated by default)."""
        param = getattr(self, name)
        _check_shape(param.shape, loaded.shape)
        param.copy_(loaded[:])

    def loadable_names(self) -> list[str]:
        """What the loader fills, each in `num_pieces` pieces."""
        return [name for name, _ in self.named_parameters(recurse=False)]

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """The tensors this module's weights take in memory, once loaded."""
        yield from self.parameters(recurse=False)

    def planned_bytes(self) -> int:
        """What this module's weights will take in memory once loaded."""
        return sum(p.numel() * p.element_size() for p in self.parameters(recurse=False))


def _check_shape(expected: Sequence[int], got: Sequence[int]) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"shape {tuple(got)} does not fit {tuple(expected)}")


class RMSNorm(LoadableModule):
    def __init__(
        self, dim: int, eps: float, *, ops: TorchOps, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x); with a residual: residual += x in place, then rms_norm(residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding:
    """Neox-style RoPE (Llama, Qwen): rotates the two halves of each head."""

    def __init__(self, head_dim: int, rope: RopeConfig, device: torch.device):
        self.inv_freq = _inv_freq(head_dim, rope).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin [T, head_dim / 2] for the batch's positions, once per forward.

        Computed per forward rather than cached for every position: it costs T * head_dim / 2
        multiplies shared by all layers, and a max_position_embeddings cache can be 64 MB.
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # the two cut-offs interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class PreparedLinear(LoadableModule):
    """A layer whose weight [rows, cols] the loader fills in a plain tensor and the layer then
    keeps in `weight_format` only; until then `weight` is a meta tensor of its shape and dtype."""

    weight: torch.Tensor | PreparedWeight

    def _init_weight(
        self,
        rows: int,
        cols: int,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.weight_format = weight_format
        self.weight_shape = (rows, cols)
        self.weight_dtype = dtype  # loaded in, before it is prepared
        self.weight = torch.empty(rows, cols, dtype=dtype, device="meta")
        self._device = device
        self._loading: torch.Tensor | Int8Weight | None = None
        self._pieces_left = set(range(self.num_pieces))

    def _write_rows(self, start: int, rows: torch.Tensor) -> None:
        """Rows start.. of the weight, as read from the checkpoint."""
        if self._loading is None:
            assert isinstance(self.weight, torch.Tensor), "the weight is loaded already"
            rows_, cols = self.weight_shape
            self._loading = self.weight_format.start_loading(
                rows_, cols, self.weight_dtype, self._device
            )
        self.weight_format.write_rows(self._loading, start, rows)

    def _piece_loaded(self, piece: int) -> None:
        """After the last piece the weight takes its final form (the pieces of a fused weight
        may come from different files)."""
        self._pieces_left.discard(piece)
        if not self._pieces_left and self._loading is not None:
            loading, self._loading = self._loading, None
            self.weight = self.weight_format.finish_loading(loading)

    def loadable_names(self) -> list[str]:
        return ["weight", *super().loadable_names()]

    def held_tensors(self) -> Iterator[torch.Tensor]:
        yield from held_tensors(self.weight)
        yield from super().held_tensors()

    def planned_bytes(self) -> int:
        rows, cols = self.weight_shape
        return self.weight_format.nbytes(rows, cols, self.weight_dtype) + super().planned_bytes()


class ColumnParallelLinear(PreparedLinear):
    """y = x W^T + b, W's output rows split over ranks; no communication.

    `output_sizes` fuses several projections (q/k/v, or gate/up) into one matmul. Each piece is
    split on its own, so a rank holds its share of every piece, back to back. `shards` gives each
    piece's (start, length) on this rank where it is not an equal split (replicated KV heads).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        tp: TPGroup,
        ops: TorchOps,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
        shards: Sequence[tuple[int, int]] | None = None,
    ):
        super().__init__()
        self.ops = ops
        self.num_pieces = len(output_sizes)
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        if shards is None:
            shards = [tp.shard(n, "output size") for n in output_sizes]
        self.starts = tuple(start for start, _ in shards)
        self.local_sizes = tuple(length for _, length in shards)
        local_out = sum(self.local_sizes)
        self._init_weight(local_out, input_size, weight_format, dtype, device)
        self.bias = _param(local_out, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate/up pair's outputs, [T, local intermediate]."""
        assert self.num_pieces == 2 and self.local_sizes[0] == self.local_sizes[1]
        return self.ops.linear_silu_and_mul(x, self.weight, self.bias)

    def load_weight(self, name: str, loaded: CheckpointTensor, piece: int = 0) -> None:
        trailing = (self.input_size,) if name == "weight" else ()
        _check_shape((self.output_sizes[piece], *trailing), loaded.shape)
        length, start = self.local_sizes[piece], self.starts[piece]
        offset = sum(self.local_sizes[:piece])
        rows = loaded[start : start + length]
        if name == "weight":
            self._write_rows(offset, rows)
            self._piece_loaded(piece)
        else:
            getattr(self, name)[offset : offset + length].copy_(rows)


class RowParallelLinear(PreparedLinear):
    """y = x W^T + b, W's input columns split over ranks; the partial products are summed."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        tp: TPGroup,
        ops: TorchOps,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.ops = ops
        self.input_size = input_size
        self.input_start, local_in = tp.shard(input_size, "input size")
        self._init_weight(output_size, local_in, weight_format, dtype, device)
        self.bias = _param(output_size, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.ops.linear(x, self.weight, None))
        # Added after the sum, or every rank would add it once.
        return y + self.bias if self.bias is not None else y

    def load_weight(self, name: str, loaded: CheckpointTensor, piece: int = 0) -> None:
        if name == "bias":
            super().load_weight(name, loaded)
            return
        rows, local_in = self.weight_shape
        _check_shape((rows, self.input_size), loaded.shape)
        columns = loaded[:, self.input_start : self.input_start + local_in]
        self._write_rows(0, columns)
        self._piece_loaded(piece)


class VocabParallelEmbedding(LoadableModule):
    """Rows of the vocabulary split over ranks: each rank holds ceil(vocab / tp) rows; rows past
    the vocabulary are zero. The table may be kept in a narrower dtype (`table_dtype`) than the
    rows it returns (`dtype`)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        table_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = _param(
            self.rows_per_rank, hidden_size, dtype=table_dtype or dtype, device=device
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight).to(self.dtype)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight).to(self.dtype)
        out.masked_fill_(~mine[:, None], 0)
        return self.tp.all_reduce(out)

    def load_weight(self, name: str, loaded: CheckpointTensor, piece: int = 0) -> None:
        _check_shape((self.vocab_size, self.weight.shape[1]), loaded.shape)
        _copy_vocab_rows(self._write_rows, loaded, self.vocab_start, self.rows_per_rank)

    def _write_rows(self, start: int, rows: torch.Tensor) -> None:
        self.weight[start : start + rows.shape[0]].copy_(rows)


class ParallelLMHead(PreparedLinear):
    """The LM head, its vocabulary rows split over ranks as VocabParallelEmbedding's: logits of
    rows past the vocabulary are dropped. A tied head is loaded from the embedding's checkpoint
    tensor into its own weight, kept in the model's weight format (the lookup needs plain rows,
    the matmul oneDNN's layout: two copies of that one tensor, for small tied models only)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TPGroup,
        ops: TorchOps,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.ops = ops
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self._init_weight(self.rows_per_rank, hidden_size, weight_format, dtype, device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in the model's dtype, on every rank
        (a greedy step's argmax reads bfloat16 as well: no float32 pass over the vocabulary)."""
        logits = self.tp.all_gather(self.ops.linear(hidden, self.weight, None), dim=-1)
        return logits[:, : self.vocab_size]

    def load_weight(self, name: str, loaded: CheckpointTensor, piece: int = 0) -> None:
        _check_shape((self.vocab_size, self.hidden_size), loaded.shape)
        _copy_vocab_rows(self._write_rows, loaded, self.vocab_start, self.rows_per_rank)
        self._piece_loaded(piece)


def _copy_vocab_rows(
    write: Callable[[int, torch.Tensor], None], loaded: CheckpointTensor, start: int, count: int
) -> None:
    """This rank's `count` rows of a [vocab, hidden] checkpoint tensor, from row `start`, to
    write(row, values), a block at a time; rows past the vocabulary are zeros."""
    rows = max(0, min(count, loaded.shape[0] - start))
    for begin in range(0, rows, _VOCAB_CHUNK_ROWS):
        end = min(begin + _VOCAB_CHUNK_ROWS, rows)
        write(begin, loaded[start + begin : start + end])
    if rows < count:
        write(rows, torch.zeros(count - rows, loaded.shape[1]))
