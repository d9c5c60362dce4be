from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


def pytest_report_header() -> str:
    """Which tree's radixserve the tests import (tests/replay_issue13.py checks it)."""
    import radixserve

    return f"radixserve: {Path(radixserve.__file__).parent}"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the in-process model tests run: the CPU, or `RADIXSERVE_TEST_DEVICE=cuda` on a GPU
    box (the server tests take the GPU there by themselves, `--device auto`, except those whose
    tokens must not depend on the batch (overlap's batched test, the fuzz's), TP's, checked
    against transformers on the CPU, and those of CPU-only flags)."""
    return torch.device(os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu"))


@pytest.fixture
def tiny_model(tmp_path: Path) -> Callable[..., Path]:
    """Builds a tiny randomly initialised HF model and saves it as safetensors.

    `tiny_model("qwen3", tie_word_embeddings=False)` returns the directory. Every parameter is
    random (biases and norm weights too: HF starts those at 0 and 1, which would hide bugs).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    configs: dict[str, Any] = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}

    def build(kind: str, max_shard_size: str | None = None, **overrides: Any) -> Path:
        fields = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            max_position_embeddings=512,
            eos_token_id=2,
        )
        config = configs[kind](**(fields | overrides))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        path = tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}"
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kwargs)
        return path

    return build


@pytest.fixture(scope="session")
def tiny_served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama that speaks the default model's tokenizer (its files and vocabulary
    size, so real text tokenizes): for server tests where the answers are not the point, and
    throughput is. Greedy, its tokens are the argmax of random logits: a fixed function of the
    prompt that any batching must keep."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    from radixserve.model_worker.model_source import default_model_dir

    source = default_model_dir()
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=49152,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    path = tmp_path_factory.mktemp("tiny-served")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path
