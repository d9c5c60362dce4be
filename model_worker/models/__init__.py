"""Model classes by the `architectures` name of their HF config.json."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from radixserve.model_worker.models.base import CausalLM
from radixserve.model_worker.models.llama import LlamaForCausalLM

MODEL_REGISTRY: Mapping[str, type[CausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": LlamaForCausalLM,
    }
)


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODEL_REGISTRY:
        known = ", ".join(MODEL_REGISTRY)
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {known}")
    return MODEL_REGISTRY[architecture]
