"""CausalLM: what the model runner and the weight loader need from every model class."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from radixserve.model_worker.forward_batch import ForwardBatch
from radixserve.model_worker.layers import WeightConversion


class CausalLM(nn.Module, ABC):
    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """Final hidden states [T, hidden_size] of every token of the batch."""

    @abstractmethod
    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab_size] of the given rows only."""

    @abstractmethod
    def convert_linear_weights(self, convert: WeightConversion) -> None:
        """Replace every linear layer's weight, and the LM head's, by `convert` of it."""

    @abstractmethod
    def param_for_checkpoint_name(self, name: str) -> tuple[str, int] | None:
        """Our parameter, and the piece of it, that a checkpoint tensor fills; None to skip it."""

    @abstractmethod
    def checkpoint_name(self, param: str, piece: int) -> str:
        """The inverse of param_for_checkpoint_name, for error messages."""

    def fuse_layers(self) -> bool:
        """From now on run the decoder layers in one call of the CPU extension (cpu_attn on one
        rank; fused_layers.py), where the model has such a path; whether it has."""
        return False
