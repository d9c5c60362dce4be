from __future__ import annotations

import json
import os
import struct
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


def test_a_weight_in_two_files_is_refused_naming_both(tiny_model) -> None:
    """A directory without an index is read file by file: a leftover file repeating a tensor
    used to load half a fused weight over the other (k and v rows uninitialised)."""
    path = tiny_model("llama")
    tensors = load_file(path / "model.safetensors")
    repeated = {k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj" in k}
    save_file(repeated, path / "zz-extra.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"q_proj\.weight is in two files: .*zz-extra"):
        load(path)


def test_a_truncated_file_is_named(tiny_model) -> None:
    path = tiny_model("llama")
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size - 5000)
    with pytest.raises(WeightLoadError, match=r"model\.safetensors: .* past the end of the file"):
        load(path)


@pytest.mark.parametrize(
    "corrupt",
    [
        {"dtype": "I8"},  # 1 byte an element where the range holds 4
        {"shape": [64, 64]},
        {"data_offsets": [0, 64 * 128 * 4]},  # over the first tensor's bytes
        {"dtype": "X"},  # no such dtype
        {"shape": [-1, 128]},
    ],
)
def test_a_header_that_disagrees_with_its_data_is_refused(tiny_model, corrupt) -> None:
    """safetensors' own reader checks each tensor's byte range against its shape and dtype, the
    file's end and the other tensors; ours read shape x dtype from the range's start."""
    path = tiny_model("llama")
    file = path / "model.safetensors"
    data = file.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 128] float32
    if "data_offsets" in corrupt:  # another tensor's start, its own length
        first = min(e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")
        end = first + header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
        corrupt = {"data_offsets": [first, end]}
    header[name].update(corrupt)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    file.write_bytes(data[:8] + text.ljust(size) + data[8 + size :])
    with pytest.raises(WeightLoadError, match="down_proj|overlaps"):
        load(path)


def test_an_index_naming_a_missing_file_is_refused_before_reading(tiny_model) -> None:
    path = tiny_model("llama", max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (path / last).unlink()
    with pytest.raises(WeightLoadError, match=f"names files not in .*{last}"):
        load(path)


def test_the_table_keeps_the_dtype_its_own_tensor_is_stored_in(tiny_model) -> None:
    """A bfloat16 checkpoint with float32 norms (as some are saved), run in float32: its table
    stays bfloat16 (half the memory: 1.2 GB for an 8B model). The dtype is the table's own
    tensor's, neither config.json's label nor the widest stored."""
    path = tiny_model("llama")
    rewrite(
        path,
        lambda t: t.update({k: v if "norm" in k else v.to(torch.bfloat16) for k, v in t.items()}),
    )
    assert load(path).model.model.embed_tokens.weight.dtype == torch.bfloat16


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
