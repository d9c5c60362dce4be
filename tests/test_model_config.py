from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve.model_worker.cpu_features import has_native_bf16
from radixserve.model_worker.model_config import ModelConfig, RopeConfig, resolve_dtype

LLAMA31_V4 = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": [128001, 128008, 128009],
}

QWEN2_V4 = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "num_hidden_layers": 24,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "eos_token_id": 151643,
}


def test_v4_llama31_config() -> None:
    config = ModelConfig.from_hf(LLAMA31_V4, {"eos_token_id": [128001, 128009]})
    assert config.head_dim == 128
    assert config.rope == RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.dtype == torch.bfloat16
    assert not (config.qkv_bias or config.o_proj_bias or config.qk_norm)


def test_qwen2_always_has_qkv_bias_and_eos_comes_from_both_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_V4))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645]}))
    config = ModelConfig.from_dir(tmp_path)
    assert config.qkv_bias and not config.o_proj_bias
    assert config.rope == RopeConfig(theta=1e6, original_max_position_embeddings=32768)
    assert config.eos_token_ids == (151643, 151645)
    assert config.tie_word_embeddings


def test_unsupported_rope_is_refused() -> None:
    hf = dict(LLAMA31_V4, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf(hf, {})


def test_resolve_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("auto", cuda, checkpoint_dtype=torch.float16) == torch.float16
    assert resolve_dtype("auto", cuda, checkpoint_dtype=torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if has_native_bf16() else torch.float32)
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", cpu)
