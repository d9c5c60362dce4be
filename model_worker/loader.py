"""Fill a model's parameters from the safetensors files of a HF model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.model_worker.layers import LoadableModule
from radixserve.model_worker.models.base import CausalLM


class WeightLoadError(RuntimeError):
    pass


def load_weights(model: CausalLM, model_dir: str) -> None:
    """Copy every checkpoint tensor into this rank's shard of the parameter it maps to.

    Fails, naming the weights, when a checkpoint tensor maps to no parameter or when a parameter
    (or a piece of a fused one) is never filled.
    """
    modules = {name: m for name, m in model.named_modules() if isinstance(m, LoadableModule)}
    pending = {
        (f"{module_name}.{param_name}", piece)
        for module_name, module in modules.items()
        for param_name, _ in module.named_parameters(recurse=False)
        for piece in range(module.num_pieces)
    }
    param_names = {name for name, _ in pending}
    unexpected: list[str] = []
    for file in _safetensors_files(Path(model_dir)):
        with safe_open(file, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                target = model.param_for_checkpoint_name(ckpt_name)
                if target is None:
                    continue
                name, piece = target
                if name not in param_names:
                    unexpected.append(ckpt_name)
                    continue
                module_name, _, param_name = name.rpartition(".")
                try:
                    lazy = _LazyTensor(f.get_slice(ckpt_name))
                    modules[module_name].load_weight(param_name, lazy, piece)
                except ValueError as e:
                    raise WeightLoadError(
                        f"checkpoint weight {ckpt_name} ({file.name}): {e}"
                    ) from e
                pending.discard((name, piece))
    if unexpected:
        raise WeightLoadError(f"checkpoint weights the model has no place for: {unexpected}")
    if pending:
        missing = sorted(model.checkpoint_name(name, piece) for name, piece in pending)
        raise WeightLoadError(f"weights missing from the checkpoint in {model_dir}: {missing}")


class _LazyTensor:
    """A checkpoint tensor read from the file only where indexed (safetensors slices)."""

    def __init__(self, view: Any):
        self._view = view
        self.shape = tuple(view.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._view[index]


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no .safetensors files in {model_dir}")
    return files
