"""Llama, and the two Qwen generations that differ from it only by flags in ModelConfig:
q/k/v biases (Qwen2), an RMSNorm over each head of q and k (Qwen3), tied embeddings.

q/k/v run as one matmul, and so do gate/up: fewer, larger matmuls are faster, on CPU most of all.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model_worker.attention import AttentionBackend
from radixserve.model_worker.forward_batch import ForwardBatch
from radixserve.model_worker.fused_layers import FusedDecoderLayers, linear_kernel
from radixserve.model_worker.fused_ops import TorchOps
from radixserve.model_worker.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from radixserve.model_worker.model_config import ModelConfig
from radixserve.model_worker.models.base import CausalLM
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.weight_format import WeightFormat

# Checkpoint projections that live in one of our fused layers: name -> (fused name, piece).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        tp: TPGroup,
        attn_backend: AttentionBackend,
        ops: TorchOps,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.attn_backend = attn_backend
        self.ops = ops
        self.head_dim = config.head_dim
        head_dim = config.head_dim
        q_head, self.num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")
        kv_head, self.num_kv_heads = tp.shard_heads(
            config.num_key_value_heads, "num_key_value_heads"
        )
        q_size = config.num_attention_heads * head_dim
        kv_size = config.num_key_value_heads * head_dim
        q_shard = (q_head * head_dim, self.num_heads * head_dim)
        kv_shard = (kv_head * head_dim, self.num_kv_heads * head_dim)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            (q_size, kv_size, kv_size),
            bias=config.qkv_bias,
            tp=tp,
            ops=ops,
            weight_format=weight_format,
            dtype=dtype,
            device=device,
            shards=(q_shard, kv_shard, kv_shard),
        )
        self.o_proj = RowParallelLinear(
            q_size,
            config.hidden_size,
            bias=config.o_proj_bias,
            tp=tp,
            ops=ops,
            weight_format=weight_format,
            dtype=dtype,
            device=device,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(config.head_dim, eps, ops=ops, dtype=dtype, device=device)
            self.k_norm = RMSNorm(config.head_dim, eps, ops=ops, dtype=dtype, device=device)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary(q, k, cos, sin)
        out = self.attn_backend.forward(q, k, v, self.layer_id, fb)
        return self.o_proj(out.reshape(-1, q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        tp: TPGroup,
        ops: TorchOps,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            (inter, inter),
            bias=config.mlp_bias,
            tp=tp,
            ops=ops,
            weight_format=weight_format,
            dtype=dtype,
            device=device,
        )
        self.down_proj = RowParallelLinear(
            inter,
            config.hidden_size,
            bias=config.mlp_bias,
            tp=tp,
            ops=ops,
            weight_format=weight_format,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        tp: TPGroup,
        attn_backend: AttentionBackend,
        ops: TorchOps,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(size, eps, ops=ops, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(
            config,
            layer_id,
            tp=tp,
            attn_backend=attn_backend,
            ops=ops,
            weight_format=weight_format,
            dtype=dtype,
            device=device,
        )
        self.post_attention_layernorm = RMSNorm(size, eps, ops=ops, dtype=dtype, device=device)
        self.mlp = LlamaMLP(
            config, tp=tp, ops=ops, weight_format=weight_format, dtype=dtype, device=device
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """hidden: the previous layer's output, not yet added to `residual` (the running sum,
        updated in place). Returns this layer's output, likewise not yet added."""
        hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, fb)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden)


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        tp: TPGroup,
        attn_backend: AttentionBackend,
        ops: TorchOps,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        # A bfloat16 checkpoint's table stays bfloat16 in a float32 model (int8's): the rows a
        # lookup widens are the same numbers, in half the memory (1.2 GB less for an 8B model).
        narrower = config.dtype.is_floating_point and config.dtype.itemsize < dtype.itemsize
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            tp=tp,
            dtype=dtype,
            table_dtype=config.dtype if narrower else dtype,
            device=device,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                i,
                tp=tp,
                attn_backend=attn_backend,
                ops=ops,
                weight_format=weight_format,
                dtype=dtype,
                device=device,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, ops=ops, dtype=dtype, device=device
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, device)
        self.fused_layers: FusedDecoderLayers | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        # The residual stream starts at zero so that every layer adds its input to it the same way
        # (fused into that layer's first norm).
        hidden = self.embed_tokens(input_ids)
        residual = torch.zeros_like(hidden)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        if self.fused_layers is not None:
            hidden = self.fused_layers(hidden, residual, cos, sin, fb)
        else:
            for layer in self.layers:
                hidden = layer(hidden, residual, cos, sin, fb)
        return self.norm(hidden, residual)

    def fuse_layers(self) -> None:
        """From now on run every layer in one call of the CPU extension (fused_layers.py), on
        the weights as loaded and converted."""
        layers = [layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer)]
        first = layers[0].self_attn
        fused = FusedDecoderLayers(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            self.norm.eps,
            first.head_dim**-0.5,  # as the attention backends scale
        )
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk_norms = None
            if attn.q_norm is not None and attn.k_norm is not None:
                qk_norms = (attn.q_norm.weight, attn.k_norm.weight)
            fused.add_layer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                qk_norms,
                linear_kernel(attn.qkv_proj.weight, attn.qkv_proj.bias),
                linear_kernel(attn.o_proj.weight, None),
                attn.o_proj.bias,
                linear_kernel(mlp.gate_up_proj.weight, mlp.gate_up_proj.bias),
                linear_kernel(mlp.down_proj.weight, None),
                mlp.down_proj.bias,
            )
        self.fused_layers = fused


class LlamaForCausalLM(CausalLM):
    def __init__(
        self,
        config: ModelConfig,
        *,
        tp: TPGroup,
        attn_backend: AttentionBackend,
        ops: TorchOps,
        weight_format: WeightFormat,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.config = config
        self.model = LlamaModel(
            config,
            tp=tp,
            attn_backend=attn_backend,
            ops=ops,
            weight_format=weight_format,
            dtype=dtype,
            device=device,
        )
        # A tied head is filled from the embedding's checkpoint tensor (checkpoint_targets).
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            tp=tp,
            ops=ops,
            weight_format=weight_format,
            dtype=dtype,
            device=device,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_rows)

    def fuse_layers(self) -> bool:
        self.model.fuse_layers()
        return True

    def checkpoint_targets(self, name: str) -> list[tuple[str, int]]:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return []  # some checkpoints store the tied head twice
        if name.endswith("rotary_emb.inv_freq"):
            return []  # recomputed from the config, and not a weight
        if name == self.EMBEDDING_WEIGHT and self.config.tie_word_embeddings:
            return [(name, 0), ("lm_head.weight", 0)]
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, piece = _FUSED[parts[-2]]
            return [(".".join([*parts[:-2], fused, parts[-1]]), piece)]
        return [(name, 0)]

    def checkpoint_name(self, param: str, piece: int) -> str:
        if param == "lm_head.weight" and self.config.tie_word_embeddings:
            return self.EMBEDDING_WEIGHT
        *module, fused, leaf = param.split(".")
        for name, target in _FUSED.items():
            if target == (fused, piece):
                return ".".join([*module, name, leaf])
        return param
