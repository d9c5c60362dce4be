from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.model_worker.loader import SafetensorsFile, WeightLoadError
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


def test_file_tensors_read_what_safetensors_reads(tmp_path: Path) -> None:
    """The loader's own reader (pread, only the rows asked for) against safetensors' across
    dtypes, row and column slices, and a tensor after others in the file."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        "b": torch.randn(11, 3, generator=gen),
        "c": torch.arange(6, dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    with SafetensorsFile(tmp_path / "x.safetensors") as file:
        read = dict(file.tensors())
        assert file.nbytes == sum(t.nbytes for t in tensors.values())
        for name, expected in tensors.items():
            assert read[name].shape == tuple(expected.shape)
            assert torch.equal(read[name][:], expected)
            assert torch.equal(read[name][1:4], expected[1:4])
        assert torch.equal(read["b"][:, 1:3], tensors["b"][:, 1:3])
        assert read["a"][2:2].shape == (0, 7)
