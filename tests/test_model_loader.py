from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.model_worker.loader import WeightLoadError
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup


def load(path: Path) -> ModelRunner:
    return ModelRunner(
        str(path),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_total_tokens=16,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
    )


def rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_is_named(tiny_model) -> None:
    path = tiny_model("qwen3")
    rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load(path)


def test_unexpected_weight_is_named(tiny_model) -> None:
    path = tiny_model("llama")
    rewrite(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load(path)


def test_wrong_shape_is_named(tiny_model) -> None:
    path = tiny_model("llama")
    rewrite(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight"):
        load(path)
