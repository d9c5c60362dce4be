"""ModelConfig: the few numbers our model code needs, read once from a HF model directory."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.model_worker.cpu_features import has_native_bf16

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        # transformers v5 nests everything in `rope_parameters`; v4 configs keep `rope_theta` at
        # the top and the scaling (with `type` in the oldest ones) in `rope_scaling`.
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", hf["max_position_embeddings"])
            ),
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype  # the checkpoint's, as config.json says (model_loading: its table's)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> ModelConfig:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf(hf, gen)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
        architecture = hf["architectures"][0]
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        # Qwen2 configs do not state it, but Qwen2 always has q/k/v biases (and no o_proj bias).
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            architecture=architecture,
            hidden_size=hf["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            num_hidden_layers=hf["num_hidden_layers"],
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=_eos_ids(hf, gen),
            dtype=_DTYPES.get(hf.get("dtype") or hf.get("torch_dtype") or "", torch.float32),
        )


def _eos_ids(hf: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (hf, gen):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return tuple(sorted(ids))


def resolve_device(arg: str) -> torch.device:
    """`--device` to a torch device; "auto" takes the GPU when there is one."""
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(arg)


def resolve_dtype(
    arg: str,
    device: torch.device,
    *,
    checkpoint_dtype: torch.dtype | None = None,
) -> torch.dtype:
    """`--dtype` to a torch dtype. "auto" picks what runs fastest where the model runs."""
    if arg != "auto":
        if arg not in _DTYPES:
            raise ValueError(f"--dtype {arg!r}: expected auto, {', '.join(_DTYPES)}")
        return _DTYPES[arg]
    if device.type == "cpu":  # with --quantization int8 too: only its weights are int8
        # Without native bf16, a bf16 [64x576]x[576x1536] matmul took 5.9 ms vs 0.86 ms in fp32.
        return torch.bfloat16 if has_native_bf16() else torch.float32
    # GPUs serve half precision; float32 checkpoints too, as SGLang and vLLM do.
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    return torch.bfloat16
