"""load_model: a model built for its kernels and filled from its checkpoint, ready to run.

The target model's ModelRunner and a speculative draft model (draft_model.py) are both built
this way, each with its own kernels' choice."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.forward_batch import ForwardBatch
from radixserve.model_worker.host_memory import meminfo_bytes
from radixserve.model_worker.kernel_selection import Kernels, select_kernels
from radixserve.model_worker.kv_pool import TokenToKVPool
from radixserve.model_worker.loader import load_weights, loadable_modules, stored_dtype
from radixserve.model_worker.model_config import ModelConfig
from radixserve.model_worker.models import get_model_class
from radixserve.model_worker.models.base import CausalLM
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.quantization import check_quantization
from radixserve.model_worker.weight_format import WeightFormat


class NotEnoughMemory(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    kernels: Kernels
    num_kv_heads: int  # this rank's
    weight_bytes: int
    fused_layers: bool  # whether its decoder layers run as one call of the CPU extension

    def hidden_states(
        self, batch: ModelWorkerBatch, kv_pool: TokenToKVPool, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states of every packed row of the batch (its K and V written to
        the pool), and the rows of the sequences' last tokens."""
        fb = ForwardBatch.from_worker_batch(batch, device, kv_pool)
        self.kernels.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb), fb.last_rows


def load_model(
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup,
    kernel_choice: str,
    quantization: str | None,
    fused_layers: bool,
) -> LoadedModel:
    config = ModelConfig.from_dir(model_path)
    model_class = get_model_class(config.architecture)
    # The embedding table's dtype as stored, not as config.json says (merged checkpoints
    # mislabel it): a float32 table kept as "bfloat16" would lose its low bits.
    table = stored_dtype(model_path, model_class.EMBEDDING_WEIGHT)
    config = dataclasses.replace(config, dtype=table or config.dtype)
    _, num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")
    _, num_kv_heads = tp.shard_heads(config.num_key_value_heads, "num_key_value_heads")
    check_quantization(quantization, device, dtype)
    kernels = select_kernels(kernel_choice, num_heads, num_kv_heads, device, dtype)
    weight_format = kernels.ops.weight_format()
    if quantization == "int8":
        weight_format = WeightFormat.INT8
    model = model_class(
        config,
        tp=tp,
        attn_backend=kernels.attn_backend,
        ops=kernels.ops,
        weight_format=weight_format,
        dtype=dtype,
        device=device,
    )
    weight_bytes = sum(m.planned_bytes() for m in loadable_modules(model).values())
    if device.type == "cpu":
        _check_weights_fit(weight_bytes, weight_format, dtype)
    load_weights(model, model_path)
    # The fused layers call paged_attention themselves, and have no all-reduce between a
    # layer's matmuls.
    fusable = fused_layers and kernels.name == "cpu_extension" and tp.size == 1
    return LoadedModel(
        config, model, kernels, num_kv_heads, weight_bytes, fusable and model.fuse_layers()
    )


def _check_weights_fit(weight_bytes: int, weight_format: WeightFormat, dtype: torch.dtype) -> None:
    available = meminfo_bytes("MemAvailable")
    if weight_bytes > available:
        form = "int8 linear layers" if weight_format is WeightFormat.INT8 else str(dtype)
        raise NotEnoughMemory(
            f"the weights take {weight_bytes / 1e9:.2f} GB ({form}) but only "
            f"{available / 1e9:.2f} GB of memory is available"
        )
