"""CausalLM: what the model runner and the weight loader need from every model class."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from radixserve.model_worker.forward_batch import ForwardBatch


class CausalLM(nn.Module, ABC):
    # The checkpoint's embedding table: the dtype it is stored in is the table's (model_loading).
    EMBEDDING_WEIGHT = "model.embed_tokens.weight"

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """Final hidden states [T, hidden_size] of every token of the batch."""

    @abstractmethod
    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab_size] of the given rows only, in the model's dtype."""

    @abstractmethod
    def checkpoint_targets(self, name: str) -> list[tuple[str, int]]:
        """The weights (module.name) of ours, and the piece of each, that a checkpoint tensor
        fills: none to skip it, two for a tied embedding and LM head."""

    @abstractmethod
    def checkpoint_name(self, param: str, piece: int) -> str:
        """The checkpoint tensor that fills a piece of our weight, for error messages."""

    def fuse_layers(self) -> bool:
        """From now on run the decoder layers in one call of the CPU extension (cpu_extension on one
        rank; fused_layers.py), where the model has such a path; whether it has."""
        return False
